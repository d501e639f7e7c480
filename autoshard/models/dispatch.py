"""Kernel dispatch points of HF mixers, found by the called function's signature, never by its name.

A HF mixer reaches its kernel through a global of its modeling module (`mamba_selective_scan`, `causal_conv1d_fn`,
`torch_chunk_gated_delta_rule`): the name its forward calls, bound to mamba_ssm / causal-conv1d / fla where installed,
else to a torch loop. `dispatch_points(module, accepts, substitute)` finds those globals by signature; `swapped(...)`
sets each to a substitute while it is open and restores the originals after: capture traces a scan as one op
(passes/capture/selective_scan.py, gated_delta_rule.py), context parallelism runs a Mamba-1 mixer's own forward on
one rank's slice (runtime/cp_scan.py). The Mamba-1 mixer's points: its scan (`takes_scan`), its causal conv
(`takes_conv`) and its fused whole-mixer kernel (`takes_fused`); `split_points` says whether cp can swap them;
a gated DeltaNet's: its delta rules (`takes_delta_rule`) and its causal conv (`delta_split`).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterable, Iterator

from torch import nn

SCAN_INTERFACE = ("delta_bias", "delta_softplus", "return_last_state")  # selective_scan_fn's keyword arguments


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


def takes_scan(params: tuple[str, ...]) -> bool:
    """selective_scan_fn's signature: five tensors, then `SCAN_INTERFACE` among its keywords."""
    return len(params) >= 5 and all(k in params for k in SCAN_INTERFACE)


def takes_conv(params: tuple[str, ...]) -> bool:
    """causal_conv1d_fn's signature: (hidden states or causal-conv1d's x (b, c, L), weight (c, k), bias, ...,
    activation), no conv state (the one-token update's)."""
    return params[:3] in (("hidden_states", "weight", "bias"), ("x", "weight", "bias")) and "activation" in params \
        and "conv_state" not in params


def takes_fused(params: tuple[str, ...]) -> bool:
    """mamba_inner_fn's signature: the projected input and the mixer's weights (conv, x_proj, out_proj)."""
    return all(p in params for p in ("conv1d_weight", "x_proj_weight", "out_proj_weight"))


def declined(*args, **kwargs) -> None:
    """A fused whole-mixer kernel's stand-in (`takes_fused`): None, so HF's forward takes its unfused path (as without
    mamba_ssm), running its linears as modules (tp's, fp8's wrappers of them apply) and its conv and scan kernels."""
    return None


def split_points(module: nn.Module) -> tuple[tuple[dict, str], tuple[dict, str]] | str:
    """The (globals, name) of the scan and of the causal conv a Mamba-1 mixer's forward calls (selective_scan_fn's,
    causal_conv1d_fn's signatures), which context parallelism swaps (runtime/cp_scan.py); else why not, naming it."""
    none = object()
    scans, convs = (dispatch_points(module, accepts, none) for accepts in (takes_scan, takes_conv))
    if len(scans) == 1 and len(convs) == 1:
        return scans[0], convs[0]
    return (f"{type(module).__name__}'s forward calls {len(scans)} selective scans and {len(convs)} causal convs by "
            "selective_scan_fn's and causal_conv1d_fn's signatures, where context parallelism swaps one of each")


def scan_mixers(model: nn.Module) -> tuple[tuple[str, nn.Module], ...]:
    """(path, module) of every Mamba-1 mixer of `model` (its pattern: `is_selective_scan`)."""
    return tuple((p, m) for p, m in model.named_modules() if is_selective_scan(m))


def is_selective_scan(module: nn.Module) -> bool:
    """A Mamba-1 mixer: its own A_log (heads x state) and the dt / x projections, no SSD dt_bias."""
    own = {k for k, _ in module.named_parameters(recurse=False)}
    return "A_log" in own and "dt_bias" not in own and hasattr(module, "x_proj") and hasattr(module, "dt_proj")


def takes_delta_rule(params: tuple[str, ...]) -> bool:
    """A gated delta rule's signature: (query, key, value, g, beta) or fla's (q, k, v, g, beta), and an initial state."""
    return params[:5] in (("query", "key", "value", "g", "beta"), ("q", "k", "v", "g", "beta")) \
        and "initial_state" in params


def delta_mixers(model: nn.Module) -> tuple[tuple[str, nn.Module], ...]:
    """(path, module) of every module of `model` whose forward calls a gated delta rule (HF's chunked and recurrent
    rules, fla's kernels): Qwen3-Next's, Qwen3.5's, OLMo-hybrid's gated DeltaNet."""
    none = object()
    return tuple((p, m) for p, m in model.named_modules() if dispatch_points(m, takes_delta_rule, none))


def delta_split(module: nn.Module) -> str | None:
    """Why context parallelism cannot swap a gated DeltaNet's points (runtime/cp_delta.py), naming it, or None: its
    forward calls one causal conv (causal_conv1d_fn's signature) beside its delta rules."""
    convs = dispatch_points(module, takes_conv, object())
    if len(convs) == 1:
        return None
    return (f"{type(module).__name__}'s forward calls {len(convs)} causal convs by causal_conv1d_fn's signature, "
            "where context parallelism swaps one")


def swapping_forward(module: nn.Module, swaps, check) -> None:
    """Make `module`'s forward swap each (accepts, substitute) of `swaps` at its dispatch points (found once, here)
    for as long as it runs, after `check(args, kwargs)` (which raises for a call the substitutes do not serve);
    what each point held before is put back after, so wrappers nest."""
    points = [(where, name, substitute) for accepts, substitute in swaps
              for where, name in dispatch_points(module, accepts, substitute)]

    def forward(*args, _forward=module.forward, **kwargs):
        check(args, kwargs)
        held = [(where, name, where[name]) for where, name, _ in points]
        try:
            for where, name, substitute in points:
                where[name] = substitute
            return _forward(*args, **kwargs)
        finally:
            for where, name, original in reversed(held):
                where[name] = original

    module.forward = forward

