"""Fused regions found on the captured graph by their op pattern: RMSNorm, SwiGLU / GeGLU, RoPE, MoE routing.

Contract
--------
`find_fused(cap, *, tokens) -> tuple[FusedRegion, ...]`: every region of the forward graph one of the
`PATTERNS` matches, with its backward nodes and its sizes per token; `check_routing(regions, spec)` holds the
routers found against the facts. What decides a region is the graph alone; a node's module path only names it.

The patterns, their anchors and sizes, and how to add one for a new op: docs/modules/capture.md
(passes/capture/fused_patterns.py)."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from autoshard.errors import CaptureError
from autoshard.passes.capture import kernels

if TYPE_CHECKING:
    from torch import fx

    from autoshard.model_spec import ModelSpec
    from autoshard.passes.capture.capture import Captured

RMSNORM, ROPE, SWIGLU, ROUTER = "rmsnorm", "rope", "swiglu", "moe_router"


@dataclass(frozen=True, slots=True, kw_only=True)
class FusedRegion:
    """One region a pattern matched: its kernel, its name (the output node), its nodes, its sizes per token."""

    kernel: str
    key: str
    module_path: str
    fwd: frozenset[str]
    bwd: frozenset[str]
    size: tuple[float, ...]


@functools.lru_cache(maxsize=None)
def _ops(names: tuple[str, ...]) -> frozenset:
    """The aten overloads `names` name ("mean.dim"; a name without an overload: its default)."""
    import torch

    out = set()
    for name in names:
        packet, _, overload = name.partition(".")
        out.add(getattr(getattr(torch.ops.aten, packet), overload or "default"))
    return frozenset(out)


def _is(node, *names: str) -> bool:
    return getattr(node, "op", None) == "call_function" and node.target in _ops(names)


_CASTS = ("_to_copy", "to.dtype", "clone")
_ACTS = ("silu", "gelu", "relu")
_GATES = ("silu", "sigmoid", "gelu")  # what a gated norm multiplies its input by


def _through(node, skip=_CASTS):
    """`node` with views and casts before it skipped."""
    while True:
        node = kernels._through_views(node)
        if _is(node, *skip) and node.args:
            node = node.args[0]
            continue
        return node


class _PatternView(kernels._GraphView):
    """The graph indexes of passes/capture/kernels.py; a region also stops at an op reading a weight through
    views (t(w), a transposed expert stack) and at nodes an earlier pattern took."""

    def __init__(self, cap: Captured) -> None:
        super().__init__(cap)
        self.taken: set = set()

    def _stops(self, node) -> bool:
        return super()._stops(node) or node in self.taken or self.reads_weight(node)

    def _descendants(self, node) -> list:
        """`node`, then the forward-live nodes it reaches without passing an op a region never holds: the
        candidates for a region's output, which is never a weight matmul (the expert GEMM after SwiGLU)."""
        seen, stack = set(), [node]
        while stack:
            for u in stack.pop().users:
                if u in self.live and u not in seen and not self._stops(u):
                    seen.add(u)
                    stack.append(u)
        return [node, *sorted(seen, key=self.index.__getitem__)]

    def reads_weight(self, node) -> bool:
        """An op reading a weight matrix, through views and casts (DeepSeek's router reads w.float())."""
        return node.op == "call_function" and any(_through(a) in self.weights for a in node.all_input_nodes)

    def from_weight_op(self, node) -> bool:
        """Whether `node` is (through views, splits and casts) the output of an op reading a weight."""
        node = _through(node, skip=(*_CASTS, "split.Tensor", "split_with_sizes", "chunk"))
        return self.reads_weight(node)


def _per_token(node, tokens: int) -> float:
    val = node.meta.get("val")
    return float(val.numel()) / tokens if val is not None and hasattr(val, "numel") else 0.0


# -- the patterns ---------------------------------------------------------------------------------------------

def _is_rmsnorm_anchor(node) -> bool:
    """rsqrt(mean(x^2, -1) + eps), or a LayerNorm's native_layer_norm."""
    if _is(node, "native_layer_norm"):
        return True
    if not _is(node, "rsqrt"):
        return False
    add = _through(node.args[0])
    if not (_is(add, "add.Tensor", "add.Scalar") and isinstance(add.args[1], (int, float))):
        return False
    mean = _through(add.args[0])
    return _is(mean, "mean.dim") and list(mean.args[1]) in ([-1], [mean.args[0].meta["val"].dim() - 1])


def _rmsnorm(view: _PatternView, anchor, tokens: int) -> FusedRegion | None:
    found = view.region_around(anchor, [anchor], 1)
    if found is None:
        return None
    out, body, *_ = found
    if any(_is(n, *_GATES) for n in body):  # a gated norm (Mamba-2's): its own kernel, not this one
        return None
    # the normalised tensor: the layer norm's input, or the square the mean reads (x^2 has x's shape)
    x = anchor.args[0] if _is(anchor, "native_layer_norm") else _through(_through(anchor.args[0]).args[0]).args[0]
    width = x.meta["val"].shape[-1]
    # the norm starts at its input: what computed that input (the residual add before a last norm, whose only
    # reader the norm is) is not the norm's
    source = _through(x if _is(anchor, "native_layer_norm") else x.args[0])
    body = body - {source} - kernels._ancestors([source])
    return _record(view, RMSNORM, out, body, anchor, (_per_token(x, tokens) / width, float(width)))


def _is_swiglu_anchor(node) -> bool:
    return _is(node, "mul.Tensor") and any(_is(kernels._through_views(a), *_ACTS) for a in node.args[:2])


def _swiglu(view: _PatternView, anchor, tokens: int) -> FusedRegion | None:
    a, b = (kernels._through_views(x) for x in anchor.args[:2])
    act, up = (a, b) if _is(a, *_ACTS) else (b, a)
    if not (view.from_weight_op(act.args[0]) and view.from_weight_op(up)):
        return None
    found = view.region_around(anchor, [anchor], 1)
    if found is None:
        return None
    out, body, *_ = found
    if not any(view.reads_weight(u) for u in out.users):  # the product must feed the down projection
        return None
    return _record(view, SWIGLU, out, body, anchor, (_per_token(anchor, tokens),))


def _is_attention_anchor(node) -> bool:
    from autoshard.passes.capture.shapes_trace import _is_attention

    return node.op == "call_function" and _is_attention(str(node.target)) and "backward" not in str(node.target)


def _rope(view: _PatternView, anchor, tokens: int) -> FusedRegion | None:
    body: set = set()
    qkv = anchor.args[:3]
    for arg in qkv:
        if not view._stops(arg):
            body |= view.single_exit(arg)[0]
    rotate = any(_is(n, "cat") and _last_dim(n) for n in body)  # rotate_half, or GPT-OSS's two rotated halves
    if not rotate:
        return None
    body = view._with_dead_followers(body)
    return _record(view, ROPE, qkv[0], body, anchor, tuple(_per_token(x, tokens) for x in qkv))


def _last_dim(cat) -> bool:
    """Whether a cat joins its inputs along their last dim (the rotated halves of a head; the cache's
    concatenation is along the sequence)."""
    dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    return dim in (-1, cat.meta["val"].dim() - 1)


_ROUTE = ("_softmax", "softmax.int", "sigmoid", "add.Tensor", "mul.Tensor", "div.Tensor", "masked_fill.Scalar",
          "masked_fill.Tensor", *_CASTS)  # between the router's matmul and topk (DeepSeek: bias, group mask)


def _bias_add(view: _PatternView, node) -> bool:
    """An add of a bias kept as a matrix of one row (Ernie-4.5's (1, experts) score correction)."""
    reads = [_through(a) for a in node.all_input_nodes if _through(a) in view.weights]
    return _is(node, "add.Tensor") and all(sum(d > 1 for d in w.meta["val"].shape) == 1 for w in reads)


def _is_router_anchor(node) -> bool:
    return _is(node, "topk")


def _router(view: _PatternView, anchor, tokens: int) -> FusedRegion | None:
    chain, node = [anchor], kernels._through_views(anchor.args[0])
    while _is(node, *_ROUTE) and (not view.reads_weight(node) or _bias_add(view, node)):
        chain.append(node)
        node = kernels._through_views(node.args[0])
    if not view.reads_weight(node) or not _is(node, "mm", "addmm", "linear") or node in view.taken:
        return None  # not a router, or one an earlier topk of it (DeepSeek's group top-k) found
    chain.append(node)
    logits = node.meta["val"]
    return _record(view, ROUTER, anchor, set(chain), node, (float(logits.shape[-1]),))


PATTERNS: tuple[tuple[Callable, Callable], ...] = (
    (_is_router_anchor, _router), (_is_rmsnorm_anchor, _rmsnorm), (_is_swiglu_anchor, _swiglu),
    (_is_attention_anchor, _rope))


def _record(view: _PatternView, kernel: str, out, body: set, where, size: tuple[float, ...]) -> FusedRegion:
    view.taken |= body
    r = view.region(kernel, out, body, (), (), where=where)
    bwd = r.bwd | _residual_grad_adds(view, r.bwd) if kernel == RMSNORM else r.bwd
    return FusedRegion(kernel=kernel, key=out.name, module_path=r.module_path, fwd=r.fwd, bwd=bwd, size=size)


def _residual_grad_adds(view: _PatternView, bwd: frozenset[str]) -> frozenset[str]:
    """Autograd's adds of the norm's input gradient into the residual stream's (dx + the residual's gradient):
    the fused norm's backward rule counts that add (passes/cost/fused_regions.py, docs/modules/cost.md); an add
    of two norms' gradients is the norm's whose gradient came last."""
    import torch

    return frozenset(n.name for n in view.bwd if n.target is torch.ops.aten.add.Tensor and n.name not in bwd
                     and n.all_input_nodes and max(n.all_input_nodes, key=view.index.__getitem__).name in bwd)


def find_fused(cap: Captured, *, tokens: int) -> tuple[FusedRegion, ...]:
    """Every region of `cap` one of `PATTERNS` matches (see the module docstring)."""
    view = _PatternView(cap)
    found: list[FusedRegion] = []
    for is_anchor, match in PATTERNS:
        for node in view.fwd:
            if node not in view.taken and is_anchor(node):
                region = match(view, node, tokens)
                if region is not None:
                    found.append(region)
    return tuple(found)


# -- MoE routing against the model's facts ---------------------------------------------------------------------

def _in_layer(path: str) -> str:
    """A module path inside its decoder layer ("model.layers.0.mlp.gate" -> "mlp.gate")."""
    return re.sub(r"^.*?\.\d+\.", "", path, count=1)


def check_routing(regions, spec: ModelSpec, *, holds_experts: bool = False) -> None:
    """The routers found on the graph are the ones the model's facts name (`spec.moe_paths[0]`, read off the
    module tree, and `spec.experts`); a CaptureError naming both where they disagree, or where the traced layer
    holds the routed experts (`holds_experts`) and the graph shows no router (it would be priced as dense)."""
    routers = [r for r in regions if r.kernel == ROUTER]
    want = spec.moe_paths[0] if spec.is_moe and spec.moe_paths else None
    if want is not None and holds_experts and not routers:
        raise CaptureError(f"{spec.name}: the module tree puts routed experts at {spec.moe_paths[1]!r} but no router "
                           "(a weight matmul feeding softmax / sigmoid then topk) was found on the traced graph, so "
                           "the layer cannot be priced as a mixture of experts; add its routing pattern "
                           "(passes/capture/fused_patterns.py) or report the model")
    for r in routers:
        path = _in_layer(r.module_path)
        if want is None:
            raise CaptureError(f"{spec.name}: the graph routes tokens at {r.module_path!r} (a matmul of "
                               f"{int(r.size[0])} outputs feeding topk) but the model's facts found no mixture of "
                               "experts; give ModelSpec experts / moe_paths, or report the model")
        if int(r.size[0]) != spec.experts:  # Zaya's 5th, Inkling's shared choices: not the experts module's rows
            raise CaptureError(f"{spec.name}: the graph's router {path!r} chooses among {int(r.size[0])} experts, "
                               f"but the routed experts at {spec.moe_paths[1]!r} hold {spec.experts}: routing to a "
                               "choice that is no routed expert (a null or shared expert) has no rule to price or "
                               "run; this model is not supported yet")
        if path != want:
            raise CaptureError(f"{spec.name}: the graph's router is {path!r} choosing among {int(r.size[0])} "
                               f"experts, the module tree's (ModelSpec.moe_paths[0], experts) is {want!r}, "
                               f"{spec.experts}; fix the facts (models/facts.py _moe_modules) for this model")
