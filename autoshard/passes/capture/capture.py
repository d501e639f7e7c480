"""Capture: trace an unmodified model into one aten-level joint (forward + backward) graph.

Contract
--------
`capture_model(model, example_inputs, *, mode="fake", joint=True) -> Captured`

The whole contract: docs/modules/capture.md (passes/capture/capture.py).
"""

from __future__ import annotations

import contextlib
import inspect
import re
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Iterator, Mapping, Sequence

import torch
from torch import fx, nn

from autoshard.errors import CaptureError

FWD, BWD = "fwd", "bwd"
MODES = ("fake", "symbolic")


@dataclass(frozen=True, slots=True, kw_only=True)
class Site:
    """Where a graph node came from."""

    module_path: str  # "" for the root module (the loss of HF models is computed there)
    block: int | None  # index of the repeated block (decoder layer), None outside one
    phase: str  # "fwd" or "bwd"


@dataclass(frozen=True, slots=True, kw_only=True)
class RepeatedBlock:
    """A `ModuleList` of structurally identical children: `prefix.0` ... `prefix.{count-1}`."""

    prefix: str
    count: int
    cls: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Captured:
    """The traced joint graph of one model and where each of its nodes came from."""

    graph_module: fx.GraphModule
    param_names: tuple[str, ...]
    buffer_names: tuple[str, ...]
    num_inputs: int  # example inputs after params and buffers
    joint: bool
    outputs: tuple[str, ...]  # what the graph returns: "loss", "logits", then "grad:<param name>"
    sites: Mapping[str, Site]
    repeated: tuple[RepeatedBlock, ...]

    def site(self, node: fx.Node | str) -> Site:
        return self.sites[node if isinstance(node, str) else node.name]

    def call_nodes(self) -> Iterator[fx.Node]:
        return (n for n in self.graph_module.graph.nodes if n.op == "call_function")


def _no_cache(model: nn.Module) -> dict:
    """{"use_cache": False} for a model without attention layers (an all-Mamba Bamba or Granite-4: HF's hybrid
    cache cannot even be built for it, and a training step keeps none), else {} (HF's default: the trace of an
    attention model keeps sdpa's causal mask unmaterialized only beside the cache it builds, as the runtime's real
    tensors do without one)."""
    from autoshard.models.facts import is_attention

    takes = inspect.signature(model.forward).parameters
    if any(is_attention(m) for m in model.modules()) or not (
            "use_cache" in takes or any(p.kind is p.VAR_KEYWORD for p in takes.values())):
        return {}
    return {"use_cache": False}


def capture_model(model: nn.Module, example_inputs: Sequence[torch.Tensor], *, mode: str = "fake",
                  joint: bool = True) -> Captured:
    """Trace `model` at the aten level on fake tensors; see docs/modules/capture.md."""
    if mode not in MODES:
        raise CaptureError(f"capture mode must be one of {', '.join(MODES)}, got {mode!r}")
    if not isinstance(model, nn.Module):
        raise CaptureError(f"capture_model needs an nn.Module, got {type(model).__name__}")
    inputs = tuple(example_inputs)
    if not 1 <= len(inputs) <= 2 or not all(isinstance(t, torch.Tensor) for t in inputs):
        raise CaptureError("example_inputs must be (input_ids,) or (input_ids, labels) tensors, "
                           f"got {[type(t).__name__ for t in inputs]}")
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    with_loss = joint or len(inputs) == 2
    if joint and not params:
        raise CaptureError(f"{type(model).__name__} has no parameters to differentiate; capture it with joint=False")

    fake_mode = _fake_mode(mode)
    with fake_mode:
        fake_params = {k: _fake_like(v, requires_grad=joint) for k, v in params.items()}
        fake_buffers = {k: _fake_like(v, requires_grad=False) for k, v in buffers.items()}
    fake_inputs = tuple(_fake_input(fake_mode, t, dynamic=mode == "symbolic", index=i) for i, t in enumerate(inputs))
    if with_loss and len(fake_inputs) == 1:
        fake_inputs = (fake_inputs[0], fake_inputs[0])

    recorder = _SiteRecorder(model)

    n_params, n_buffers = len(params), len(buffers)
    no_cache = _no_cache(model)

    def step(*flat: torch.Tensor):
        p = dict(zip(params, flat[:n_params]))
        b = dict(zip(buffers, flat[n_params:n_params + n_buffers]))
        xs = flat[n_params + n_buffers:]
        kwargs = {"labels": xs[1], **no_cache} if with_loss else no_cache
        out = torch.func.functional_call(model, {**p, **b}, (xs[0],), kwargs)
        logits = out.logits if hasattr(out, "logits") else out
        if not with_loss:
            return (logits,)
        loss = out.loss
        if loss is None:
            raise CaptureError(f"{type(model).__name__}(input_ids, labels=...) returned no .loss; "
                               "autoshard needs a model that computes its training loss")
        if not joint:
            return loss, logits
        recorder.start_backward(loss)
        grads = torch.autograd.grad(loss, list(p.values()), allow_unused=True)
        grads = tuple(torch.zeros_like(p_) if g is None else g for g, p_ in zip(grads, p.values()))
        return (loss, logits, *grads)

    from torch.fx import traceback as fx_traceback
    from torch.fx.experimental.proxy_tensor import make_fx

    from autoshard.passes.capture import gated_delta_rule, selective_scan

    try:  # a Mamba-1 scan and a gated delta rule are each traced as one op, whatever the sequence length
        with recorder, fx_traceback.preserve_node_meta(), selective_scan.substituted(model), \
                gated_delta_rule.substituted(model):
            gm = make_fx(step, tracing_mode="fake", pre_dispatch=False)(
                *fake_params.values(), *fake_buffers.values(), *fake_inputs)
    except CaptureError:
        raise
    except Exception as e:  # any failure inside the model is the user's model not tracing
        raise _capture_error(model, e, recorder.current_path(), calls=recorder.layer_calls(recorder.current_path())) from e

    outputs = ("logits",) if not with_loss else ("loss", "logits") if not joint else (
        "loss", "logits", *(f"grad:{k}" for k in params))
    return Captured(
        graph_module=gm, param_names=tuple(params), buffer_names=tuple(buffers), num_inputs=len(fake_inputs),
        joint=joint, outputs=outputs, sites=MappingProxyType(recorder.sites(gm, joint=joint)),
        repeated=recorder.ran_blocks(),
    )


def find_repeated_blocks(model: nn.Module) -> tuple[RepeatedBlock, ...]:
    """`ModuleList`s of two or more children of one class with the same parameter shapes (or one
    child, when its class name says it is a layer/block), outermost first."""
    found = []
    for prefix, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        children = list(module)
        cls = type(children[0])
        shapes = _param_shapes(children[0])
        same = all(type(c) is cls and _param_shapes(c) == shapes for c in children)
        looks_like_layer = re.search(r"(Layer|Block)$", cls.__name__) is not None
        if same and (len(children) > 1 or looks_like_layer):
            if not any(prefix.startswith(r.prefix + ".") for r in found):
                found.append(RepeatedBlock(prefix=prefix, count=len(children), cls=cls.__name__))
    return tuple(found)


def block_of(path: str, repeated: Sequence[RepeatedBlock]) -> int | None:
    """The repeated-block index of a module path (`model.layers.7.mlp` -> 7), None outside one."""
    for rep in repeated:
        if path.startswith(rep.prefix + "."):
            head = path[len(rep.prefix) + 1:].split(".", 1)[0]
            if head.isdigit():
                return int(head)
    return None


def _param_shapes(module: nn.Module) -> tuple:
    return tuple((k, tuple(v.shape)) for k, v in module.named_parameters())


# -- fake tensors ---------------------------------------------------------------------------------

def _fake_mode(mode: str):
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    shape_env = ShapeEnv() if mode == "symbolic" else None
    return FakeTensorMode(allow_non_fake_inputs=False, shape_env=shape_env)


def _fake_like(t: torch.Tensor, *, requires_grad: bool) -> torch.Tensor:
    """A fake tensor of t's shape and dtype (on CPU when t is on meta); never reads t's data."""
    device = torch.device("cpu") if t.device.type == "meta" else t.device
    out = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device=device)
    return out.requires_grad_(requires_grad and t.dtype.is_floating_point)


def _fake_input(fake_mode, t: torch.Tensor, *, dynamic: bool, index: int) -> torch.Tensor:
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(t, FakeTensor):
        return t
    if t.device.type == "meta":
        t = torch.zeros(t.shape, dtype=t.dtype)
    if not dynamic:
        return fake_mode.from_tensor(t)
    from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext

    from torch._dynamo.source import ConstantSource

    ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC] * t.dim())
    return fake_mode.from_tensor(t, source=ConstantSource(f"input{index}"), symbolic_context=ctx)


# -- where nodes come from ------------------------------------------------------------------------

class _SiteRecorder:
    """Module hooks that note, while tracing, which module each new graph node belongs to."""

    def __init__(self, model: nn.Module) -> None:
        self._paths = {m: p for p, m in model.named_modules()}
        self._repeated = find_repeated_blocks(model)
        self._stack: list[str] = []
        self._marks: list[tuple[int, str]] = []  # (graph length when the path became current, path)
        self._bwd_start: int | None = None
        self._handles: list[Any] = []
        self._entered: dict[str, int] = {}  # path -> times its forward was entered

    def __enter__(self) -> _SiteRecorder:
        from torch.nn.modules import module as module_mod

        self._handles = [module_mod.register_module_forward_pre_hook(self._pre),
                         # no always_call: on an error the stack keeps the module that failed
                         module_mod.register_module_forward_hook(self._post)]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def current_path(self) -> str:
        return self._stack[-1] if self._stack else ""

    def ran_blocks(self) -> tuple[RepeatedBlock, ...]:
        """The repeated blocks whose layers the traced forward ran (a multimodal wrapper's vision tower, not run
        on text, is no layer stack of the decoder)."""
        return tuple(r for r in self._repeated if any(p.startswith(r.prefix + ".") for p in self._entered))

    def layer_calls(self, path: str) -> int:
        """How many times the forward of the module at `path`, inside a repeated block (a layer), was entered so
        far; 0 outside one."""
        return self._entered.get(path, 0) if block_of(path, self._repeated) is not None else 0

    def _graph_len(self) -> int:
        from torch.fx.experimental.proxy_tensor import get_proxy_mode

        mode = get_proxy_mode()
        return len(mode.tracer.graph.nodes) if mode is not None else 0

    def _pre(self, module: nn.Module, args) -> None:
        path = self._paths.get(module)
        if path is None:
            return
        self._stack.append(path)
        self._marks.append((self._graph_len(), path))
        self._entered[path] = self._entered.get(path, 0) + 1

    def _post(self, module: nn.Module, args, output) -> None:
        if self._paths.get(module) is None or not self._stack:
            return
        self._stack.pop()
        self._marks.append((self._graph_len(), self.current_path()))

    def start_backward(self, loss: torch.Tensor) -> None:
        """Called between forward and backward: from here on nodes are backward nodes, and each
        one carries the autograd sequence number of the forward op it differentiates."""
        from torch._functorch._aot_autograd.logging_utils import setup_stacktrace_preservation_hooks_from_tensors

        self._bwd_start = self._graph_len()
        setup_stacktrace_preservation_hooks_from_tensors(loss)

    def sites(self, gm: fx.GraphModule, *, joint: bool) -> dict[str, Site]:
        nodes = list(gm.graph.nodes)
        bwd_start = self._bwd_start if joint and self._bwd_start is not None else len(nodes)
        path_at = [""] * len(nodes)
        marks = sorted(self._marks, key=lambda m: m[0])
        current, j = "", 0
        for i in range(len(nodes)):
            while j < len(marks) and marks[j][0] <= i:
                current = marks[j][1]
                j += 1
            path_at[i] = current
        seq_path: dict[int, str] = {}
        out: dict[str, Site] = {}
        index = {node: i for i, node in enumerate(nodes)}
        for i, node in enumerate(nodes):
            if node.op != "call_function":
                continue
            seq = node.meta.get("seq_nr")
            if i < bwd_start:
                path = path_at[i]
                if seq is not None:
                    seq_path.setdefault(seq, path)
                phase = FWD
            else:
                path = seq_path.get(seq, "") if seq is not None else ""
                if not path:  # the engine's gradient accumulation runs outside any grad_fn: follow the data
                    path = _latest_input_path(node, index, out)
                phase = BWD
            out[node.name] = Site(module_path=path, block=block_of(path, self._repeated), phase=phase)
        return out


def _latest_input_path(node: fx.Node, index: dict[fx.Node, int], sites: dict[str, Site]) -> str:
    """The module path of the most recently computed input that has one ("" if none)."""
    known = [(index[a], sites[a.name].module_path) for a in node.all_input_nodes
             if a.name in sites and sites[a.name].module_path]
    return max(known)[1] if known else ""


def _capture_error(model: nn.Module, e: Exception, path: str, *, calls: int = 1) -> CaptureError:
    if "nonzero" in str(getattr(e, "func", "")) + str(e) and path.split(".")[-1] == "experts":
        impl = getattr(getattr(model, "config", None), "_experts_implementation", None)
        experts = _get_submodule(model, path)
        why = (f"cannot trace {type(model).__name__}: the mixture-of-experts routing at {path!r} "
               f"(experts implementation {impl!r}) selects tokens with nonzero(), whose shape depends on the "
               "routing data and cannot be traced on fake tensors; ")
        if not hasattr(experts, "_is_expert_parallel"):  # HF's use_experts_implementation sets it on its classes
            return CaptureError(why + f"{type(experts).__name__} has only that loop (HF offers no fixed-shape "
                                      "'grouped_mm' implementation of it in this transformers), so autoshard cannot "
                                      "price or plan this model yet")
        return CaptureError(why + "use HF's fixed-shape 'grouped_mm' experts: build the config with "
                                  "experts_implementation='grouped_mm' (or set "
                                  "model.config._experts_implementation = 'grouped_mm')")
    if "multiple of 16 bytes" in str(e) and path.split(".")[-1] == "experts":
        config = getattr(model, "config", None)
        sizes = {k: getattr(config, k) for k in ("hidden_size", "intermediate_size", "moe_intermediate_size")
                 if isinstance(getattr(config, k, None), int)}
        return CaptureError(
            f"cannot trace {type(model).__name__}: the experts at {path!r} multiply with torch._grouped_mm "
            f"(HF's 'grouped_mm' experts), which needs every row of its operands aligned to 16 bytes, i.e. in "
            f"bf16 a multiple of 8 elements; this config has {sizes}; the model cannot run its experts in bf16 "
            "either: make the hidden and expert sizes multiples of 8")
    where = f"module {path!r} ({type(_get_submodule(model, path)).__name__})" if path else \
        f"the top level of {type(model).__name__}.forward"
    first = (str(e).strip().splitlines() or [""])[0][:300]
    what = type(e).__name__
    op = getattr(e, "func", None)
    if op is not None:
        what += f" in op {op}"
    hint = ("data-dependent Python control flow or .item()/.tolist() on a tensor cannot be traced on fake tensors; "
            "make it depend on shapes only" if "data" in (what + first).lower() or "Dynamic" in what else
            "rewrite that construct with torch ops or register the op")
    if calls > 1:  # a stack that runs a layer more than once per forward (Dory's looped layers under HF's KV cache)
        hint = (f"the forward calls {path!r} {calls} times (a layer stack run more than once per forward: a looped or "
                "recurrent stack), which autoshard does not trace, price or shard: each layer is costed and split once")
    return CaptureError(f"cannot trace {type(model).__name__}: {what} at {where}: {first}; {hint}")


def _get_submodule(model: nn.Module, path: str) -> nn.Module:
    with contextlib.suppress(AttributeError):
        return model.get_submodule(path)
    return model
