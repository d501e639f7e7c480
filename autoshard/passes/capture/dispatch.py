"""Kernel dispatch points swapped for the length of a capture.

A HF mixer reaches its kernel through a global of its modeling module (`mamba_selective_scan`,
`torch_chunk_gated_delta_rule`): the name its forward calls, bound to mamba_ssm / fla where installed, else to a
torch loop whose traced graph grows with the sequence. `dispatch_points(module, accepts, substitute)` finds those globals by the
called function's signature, never by its name; `swapped(points)` sets each to autoshard's traced op while it
is open and restores the originals after; `reference_grads` is the real backward of such an op from its
reference forward (passes/capture/selective_scan.py, gated_delta_rule.py)."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import Tensor, nn


def dispatch_points(module: nn.Module, accepts: Callable[[tuple[str, ...]], bool], substitute) -> list[tuple[dict, str]]:
    """(globals, name) of each function the forward of `module`'s class calls whose parameter names `accepts`
    (or that is already `substitute`), in the order the forward names them."""
    forward = inspect.unwrap(type(module).forward)
    found = []
    for name in getattr(getattr(forward, "__code__", None), "co_names", ()):
        fn = forward.__globals__.get(name)
        if fn is not substitute and (not callable(fn) or isinstance(fn, type)):
            continue
        try:
            if fn is substitute or accepts(tuple(inspect.signature(fn).parameters)):
                found.append((forward.__globals__, name))
        except (TypeError, ValueError):
            continue
    return found


@contextlib.contextmanager
def swapped(modules: Iterable[nn.Module], accepts: Callable[[tuple[str, ...]], bool], substitute) -> Iterator[int]:
    """While open, the dispatch point of every module in `modules` calls `substitute`; yields how many points
    were swapped (a module whose forward has none is traced as it is)."""
    points = {}
    for module in modules:
        for where, name in dispatch_points(module, accepts, substitute):
            if where[name] is not substitute:
                points[(id(where), name)] = (where, name, where[name])
    try:
        for where, name, _ in points.values():
            where[name] = substitute
        yield len(points)
    finally:
        for where, name, original in points.values():
            where[name] = original


def reference_grads(forward: Callable[..., Tensor], inputs: tuple[Tensor | None, ...], dout: Tensor) -> list[Tensor]:
    """The gradient of `forward(*inputs)` against `dout` for each input, in its dtype (an empty tensor where an
    input is None): the real backward kernel of a substituted op, from its reference forward."""
    present = [i for i, t in enumerate(inputs) if t is not None]

    def given(*tensors):
        full = list(inputs)
        for i, t in zip(present, tensors):
            full[i] = t
        return forward(*full)

    _, vjp = torch.func.vjp(given, *(inputs[i] for i in present))
    grads = dict(zip(present, vjp(dout.float())))
    empty = inputs[present[0]].new_empty(0)
    return [grads[i].to(t.dtype) if t is not None else empty for i, t in enumerate(inputs)]
