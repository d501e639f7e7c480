"""Kernel substitution: price a recognised region of the captured graph as the fused kernel that runs.

Contract
--------
`find_regions(cap, *, kernels=KERNEL_NAMES) -> tuple[Region, ...]`

The whole contract: docs/modules/capture.md (passes/capture/kernels.py).
"""

from __future__ import annotations

import heapq
import math
import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from autoshard.errors import InvalidConfigError
from autoshard.model_spec import Mixer, ModelSpec

if TYPE_CHECKING:  # torch is imported by the functions that walk a graph: reading a table needs none
    import torch
    from torch import fx

    from autoshard.passes.capture.capture import Captured


@dataclass(frozen=True, slots=True, kw_only=True)
class KernelCost:
    """What one call of a fused kernel costs, at one concrete (b, s)."""

    fwd_flops: int
    bwd_flops: int  # gradients plus the chunk-local recomputation the kernel does in backward
    state_bytes: int  # what the kernel saves for backward beyond its inputs (written once in forward)
    gemm: tuple[int, int, int, int] | None  # (batch, m, n, k) of its matmul-like work, for GEMM efficiency


@dataclass(frozen=True, slots=True, kw_only=True)
class Kernel:
    """One fused kernel: how to recognise its region and what it costs."""

    name: str
    description: str  # what runs, and its source
    is_anchor: Callable[[fx.Node], bool]  # an op only this kernel's algorithm produces
    min_anchors: int  # a region must contain at least this many anchors
    mixers: tuple[Mixer, ...]  # the sequence mixers whose spec numbers give the rule its dimensions
    cost: Callable[[ModelSpec, int, int], KernelCost]  # (spec, micro-batch, sequence length) -> cost


@dataclass(frozen=True, slots=True, kw_only=True)
class Region:
    """One matched region of the captured graph, replaced by one fused kernel call."""

    kernel: str
    output: str  # the forward node whose value the kernel returns
    fwd: frozenset[str]  # forward nodes the kernel replaces (output included)
    bwd: frozenset[str]  # backward nodes of those
    inputs: tuple[str, ...]  # activation inputs: nodes outside the region that it reads
    param_inputs: tuple[str, ...]  # parameter placeholders it reads
    module_path: str
    block: int | None

    @property
    def fwd_name(self) -> str:
        return f"fused_{self.kernel}_{self.output}"

    @property
    def bwd_name(self) -> str:
        return f"fused_{self.kernel}_{self.output}_backward"


# -- the SSD (Mamba-2) -----------------------------------------------------------------------------

def _is_segsum_exp(node: fx.Node) -> bool:
    """exp of a log-decay masked with -inf: the semiseparable mask L = exp(segsum(A dt)) of the
    chunked SSD (arXiv 2405.21060 sec. 6), within a chunk or across chunks."""
    import torch

    if node.op != "call_function" or node.target is not torch.ops.aten.exp.default:
        return False
    src = _through_views(node.args[0])
    if src.op != "call_function" or src.target not in (torch.ops.aten.masked_fill.Scalar,
                                                       torch.ops.aten.masked_fill.Tensor):
        return False
    value = src.args[2]
    return isinstance(value, (int, float)) and math.isinf(value) and value < 0


def ssd_cost(spec: ModelSpec, b: int, s: int) -> KernelCost:
    """The chunked SSD (arXiv 2405.21060 sec. 6; FLOPs as in sec. 8.3 / `ssd_flops_per_token`) on
    the padded length T = l*ceil(s/l). Forward: intra-chunk C B^T (2 T l n per head), its mask (T l),
    the masked scores times X (2 T l p), chunk states B^T X (2 T n p), state passing (2 (T/l) n p),
    outputs C h (2 T n p), the D skip (T p). Backward: twice the forward (gradients) plus one forward
    of recomputation (runtime/ssd.py recomputes the chunk-local tensors, as mamba_ssm's and Ascend's
    fused kernels do). Saved beyond the inputs: the fp32 states entering every chunk (b, T/l, h, p, n)."""
    l, h, p, n = spec.chunk, spec.heads, spec.head_dim, spec.state
    chunks = -(-s // l)
    t = chunks * l
    fwd = b * h * (2 * t * l * n + t * l + 2 * t * l * p + 4 * t * n * p + 2 * chunks * n * p + t * p)
    return KernelCost(fwd_flops=fwd, bwd_flops=3 * fwd, state_bytes=b * chunks * h * p * n * 4,
                      gemm=(b * chunks * h, l, p, n))


def ssd_torch_cost(spec: ModelSpec, b: int, s: int) -> KernelCost:
    """The same chunked SSD written in torch ops under autograd, as MindSpeed-LLM runs it on the 910B
    (`mindspeed_llm/tasks/models/ssm/state_space_duality.py` `StateSpaceProcessor`, the path without context
    parallelism): the FLOPs of `ssd_cost`, a backward of twice the forward (autograd keeps every intermediate,
    nothing is recomputed), and saved for backward, per token of the padded length T and per head, beyond the
    inputs x, B, C, dt the trace already counts (bf16 = 2 B, fp32 = 4 B; p head dim, n state, l chunk):

      the l x l mask and scores    exp(segsum) fp32 4l, L in bf16 2l, C B^T 2l, (C B^T) * L 2l     10 l
      B and C per head             B, C repeated from groups to heads, the bmm copies of C and B,
                                   B times the chunk decay (all bf16)                             8 n
      x copies                     x permuted for the bmms, the inter-chunk C h before its decay   4 p
      chunk states                 the states, their inter-chunk einsum operand and bmm copy       6 p n / l
      dt and decays                softplus / clamp inputs, x * dt's dt, the fp32 decays, exp(A_cum) 16

    At mamba2-7b, tp 2, b 1, s 4096, chunk 256 that is 1.06 GB per layer (the fused kernel's chunk states: 0.03 GB)."""
    l, h, p, n = spec.chunk, spec.heads, spec.head_dim, spec.state
    fused = ssd_cost(spec, b, s)
    t = -(-s // l) * l
    per_head_token = 10 * l + 8 * n + 4 * p + 6 * p * n / l + 16
    return KernelCost(fwd_flops=fused.fwd_flops, bwd_flops=2 * fused.fwd_flops,
                      state_bytes=int(b * t * h * per_head_token), gemm=fused.gemm)


KERNELS: dict[str, Kernel] = {k.name: k for k in (
    Kernel(name="ssd_chunk_scan",
           description="Mamba-2 chunked SSD scan as one kernel: chunk-local tensors stay on chip, backward "
                       "recomputes them from the saved inputs and chunk states (mamba_ssm "
                       "mamba_chunk_scan_combined; autoshard's runtime/ssd.py where that is not installed)",
           is_anchor=_is_segsum_exp, min_anchors=2, mixers=(Mixer.SSD,), cost=ssd_cost),
    Kernel(name="ssd_chunk_scan_torch",
           description="Mamba-2 chunked SSD in torch ops under autograd, every intermediate kept for backward "
                       "(MindSpeed-LLM's StateSpaceProcessor on the 910B: no fused SSD there)",
           is_anchor=_is_segsum_exp, min_anchors=2, mixers=(Mixer.SSD,), cost=ssd_torch_cost),
)}
KERNEL_NAMES: tuple[str, ...] = tuple(KERNELS)


# -- finding regions ---------------------------------------------------------------------------------

def find_regions(cap: Captured, *, kernels: tuple[str, ...] = KERNEL_NAMES) -> tuple[Region, ...]:
    """Every region of `cap` that one of `kernels` replaces (docs/modules/capture.md)."""
    _check_names(kernels, tuple(KERNELS))
    graph = _GraphView(cap)
    found: list[Region] = []
    taken: set[fx.Node] = set()  # a node is in one region at most: of two kernels for one region, the first listed
    for name in kernels:
        kernel = KERNELS[name]
        anchors = [n for n in graph.fwd if kernel.is_anchor(n)]
        for anchor in anchors:
            if anchor in taken:
                continue
            match = graph.region_around(anchor, anchors, kernel.min_anchors)
            if match is None:
                continue
            out, body, inputs, params = match
            taken |= body
            found.append(graph.region(kernel.name, out, body, inputs, params, where=anchor))
    return tuple(sorted(found, key=lambda r: graph.index[graph.by_name[r.output]]))


def _through_views(node):
    from torch import fx

    while isinstance(node, fx.Node) and node.op == "call_function" and _is_view(node) and node.args \
            and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def _is_view(node: fx.Node) -> bool:
    import torch

    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return target is operator.getitem
    if target in (torch.ops.aten.detach.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.alias.default):
        return True
    returns = target._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


class _GraphView:
    """Indexes over the captured graph that region finding needs."""

    def __init__(self, cap: Captured) -> None:
        from autoshard.passes.capture.capture import BWD, FWD

        self.cap = cap
        nodes = list(cap.graph_module.graph.nodes)
        self.index = {n: i for i, n in enumerate(nodes)}
        self.by_name = {n.name: n for n in nodes}
        self.fwd = [n for n in nodes if n.op == "call_function" and cap.site(n).phase == FWD]
        self.bwd = [n for n in nodes if n.op == "call_function" and cap.site(n).phase == BWD]
        fwd_set = set(self.fwd)
        self.is_fwd = fwd_set.__contains__
        self.live = self._forward_live(nodes, fwd_set)
        placeholders = [n for n in nodes if n.op == "placeholder"]
        self.weights = {n for n in placeholders[:len(cap.param_names)] if _is_matrix(n)}

    def _forward_live(self, nodes, fwd_set) -> set[fx.Node]:
        """Forward nodes whose value reaches the loss or logits through forward ops."""
        from torch import fx

        out = next(n for n in reversed(nodes) if n.op == "output")
        results = out.args[0] if isinstance(out.args[0], (list, tuple)) else (out.args[0],)
        heads = [r for r, what in zip(results, self.cap.outputs) if not what.startswith("grad:")
                 and isinstance(r, fx.Node)]
        live, stack = set(), list(heads)
        while stack:
            n = stack.pop()
            if n in live or n not in fwd_set:
                continue
            live.add(n)
            stack.extend(n.all_input_nodes)
        return live

    def _stops(self, node: fx.Node) -> bool:
        """Nodes a region never contains: inputs, parameters, outputs of multi-output ops, and ops
        that read a weight matrix (they are priced as themselves)."""
        if node.op != "call_function" or not self.is_fwd(node) or node.target is operator.getitem:
            return True
        return any(a in self.weights for a in node.all_input_nodes)

    def single_exit(self, out: fx.Node) -> tuple[set[fx.Node], list[fx.Node]]:
        """The forward nodes whose forward-live results reach the rest of the model only through
        `out`, and the nodes just outside them that they read (the frontier)."""
        body, frontier, done = {out}, [], {out}
        heap = [(-self.index[a], id(a), a) for a in out.all_input_nodes]
        heapq.heapify(heap)
        while heap:  # decreasing graph order: every user of a node is decided before the node
            _, _, n = heapq.heappop(heap)
            if n in done:
                continue
            done.add(n)
            users = [u for u in n.users if u in self.live]
            if self._stops(n) or not all(u in body for u in users):
                frontier.append(n)
                continue
            body.add(n)
            for a in n.all_input_nodes:
                heapq.heappush(heap, (-self.index[a], id(a), a))
        return body, frontier

    def region_around(self, anchor: fx.Node, anchors: list[fx.Node], min_anchors: int):
        """The smallest single-exit region holding `anchor` and at least `min_anchors` anchors,
        grown over its output's followers that bring no new input; None if there is none."""
        anchor_set = set(anchors)
        for cand in self._descendants(anchor):
            body, frontier = self.single_exit(cand)
            if anchor in body and len(body & anchor_set) >= min_anchors:
                return self._grow(cand, body, frontier)
        return None

    def _descendants(self, node: fx.Node) -> list[fx.Node]:
        seen, stack = set(), [node]
        while stack:
            n = stack.pop()
            for u in n.users:
                if u in self.live and u not in seen:
                    seen.add(u)
                    stack.append(u)
        return sorted(seen, key=self.index.__getitem__)

    def _grow(self, out, body, frontier):
        """Extend the output over its only forward-live follower while that follower's region reads
        no new activation (views, the D skip connection, the un-padding slice)."""
        while True:
            users = [u for u in out.users if u in self.live]
            if len(users) != 1 or self._stops(users[0]):
                break
            nxt_body, nxt_frontier = self.single_exit(users[0])
            known = _ancestors(frontier) | set(frontier)
            if not body <= nxt_body or not all(f in known or f.op == "placeholder" for f in nxt_frontier):
                break
            out, body, frontier = users[0], nxt_body, nxt_frontier
        body = self._with_dead_followers(body)
        inputs = tuple(sorted({f.name for f in frontier if f.op == "call_function"}))
        params = tuple(sorted({f.name for f in frontier if f.op == "placeholder"}))
        return out, body, inputs, params

    def _with_dead_followers(self, body: set[fx.Node]) -> set[fx.Node]:
        """Add forward nodes that are not forward-live and read only the region (the detached copies
        autograd keeps for backward, an unused final state)."""
        body = set(body)
        changed = True
        while changed:
            changed = False
            for n in list(body):
                for u in n.users:
                    if u in body or not self.is_fwd(u) or u in self.live:
                        continue
                    if all(a in body or a.op == "placeholder" for a in u.all_input_nodes):
                        body.add(u)
                        changed = True
        return body

    def region(self, kernel: str, out: fx.Node, body: set[fx.Node], inputs, params, *, where: fx.Node) -> Region:
        """The Region record; it runs in the module of its anchor `where` (its output may be a view
        taken as the next module's input)."""
        import torch

        seqs = {n.meta.get("seq_nr") for n in body} - {None}
        bwd: set[fx.Node] = set()
        for n in self.bwd:
            if n.meta.get("seq_nr") in seqs:
                bwd.add(n)
            elif n.target is torch.ops.aten.add.Tensor:  # autograd's gradient accumulation
                ins = [a for a in n.all_input_nodes if a.op == "call_function" and not self.is_fwd(a)]
                if ins and all(a in bwd for a in ins):
                    bwd.add(n)
        site = self.cap.site(where)
        return Region(kernel=kernel, output=out.name, fwd=frozenset(n.name for n in body),
                      bwd=frozenset(n.name for n in bwd), inputs=inputs, param_inputs=params,
                      module_path=site.module_path, block=site.block)


def _ancestors(nodes) -> set[fx.Node]:
    seen, stack = set(), list(nodes)
    while stack:
        for a in stack.pop().all_input_nodes:
            if a not in seen:
                seen.add(a)
                stack.append(a)
    return seen


def _is_matrix(node: fx.Node) -> bool:
    """A placeholder holding a tensor of two or more dims (a weight matrix or conv kernel)."""
    import torch

    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dim() >= 2


def _check_names(names, known=None) -> None:
    from autoshard.hardware import KERNEL_NAMES as PROFILE_KERNELS

    known = known or tuple(dict.fromkeys((*PROFILE_KERNELS, *KERNELS)))
    unknown = [k for k in names if k not in known]
    if unknown:
        raise InvalidConfigError(f"unknown fused kernel(s) {unknown}; known: {', '.join(known)} "
                                 "(a device profile's 'kernels' field names them, see docs/kernels.md)")


def kernel_for(spec: ModelSpec, names: tuple[str, ...]) -> tuple[str, ...]:
    """The kernels of `names` that this step substitutes for `spec`'s sequence mixer (a profile's other
    kernels, flash attention and the LLaMA fusions, are priced by passes/cost/fused_regions.py); of two
    that replace the same region (the same anchors: the fused SSD and its torch version), the first."""
    _check_names(names)
    out: list[str] = []
    for n in names:
        if n in KERNELS and spec.mixer in KERNELS[n].mixers and \
                all(KERNELS[k].is_anchor is not KERNELS[n].is_anchor for k in out):
            out.append(n)
    return tuple(out)
