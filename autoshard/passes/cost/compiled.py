"""The cost table compiled to numbers: every block's symbolic FLOPs / bytes (passes/capture/shapes)
become numeric evaluators in (b, s) once per model (`compile_table`), with what each node is (core
GEMM, TP / CP dims) read off once.

Part of the cost model: passes/cost/cost.py composes these into `estimate`.
"""

from __future__ import annotations


from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import sympy

from autoshard.errors import InvalidConfigError
from autoshard.cost_table import DELTA_RULE_TARGET, B, S, CostTable, degree_in_s
from autoshard.ir import BlockKind, OpKind, Recompute, Stage
from autoshard.model_spec import Mixer, ModelSpec
from autoshard.passes.capture.fused_patterns import ROUTER
from autoshard.passes.cost import fused_regions
from autoshard.passes.cost.shape_memo import ShapeMemo
from autoshard.rules import sharding
from autoshard.rules.kernels import compiles_layers
from autoshard.rules.sharding import selective_module
from autoshard.passes.cost.layout import Layout


# --------------------------------------------------------------------------------------------
# The table, compiled to numbers


@dataclass(frozen=True, slots=True, kw_only=True)
class CompiledBlock:
    """One block's nodes as arrays; `evaluate(b, s)` gives flops, bytes, saved bytes and GEMM dims."""

    kind: BlockKind
    count: int
    params: int
    fwd: np.ndarray  # bool per node
    role: np.ndarray  # per node: index of its role in the family's sharding table, -1 none (replicated)
    rerun: np.ndarray  # bool: in the attention module / Mamba-2 mixer (what selective recompute reruns)
    is_gemm: np.ndarray  # bool: priced by GEMM throughput
    tp_dim: np.ndarray  # index into (batch, m, n, k) that TP divides, -1 none
    cp_dim: np.ndarray  # index into (batch, m, n, k) that CP divides, -1 none
    quadratic: np.ndarray  # bool: FLOPs grow as S^2 (attention scores: the causal s x s work)
    region: np.ndarray  # int: fused-kernel region of the node (passes/cost/fused_regions.py), -1 none
    region_kernels: tuple  # the kernel of each region
    region_sizes: tuple  # the sizes per token of each region, as its kernel's cost rule reads them
    wgrad_groups: dict  # parent module -> mask of its column-parallel weight-gradient GEMMs
    fn: Any  # lambdified (b, s) -> list of 7 * n numbers
    expert: np.ndarray | None = None  # bool: an op of the routed experts (the sharding table's EXPERT role)
    float8: np.ndarray | None = None  # bool: a GEMM of a float8 linear (fp8 plans: sharding.is_float8_role)
    delta_rule: np.ndarray | None = None  # bool: an op of a gated delta rule (cp runs it three times: block.py)
    memo: dict = field(default_factory=dict, compare=False, repr=False)  # what does not depend on the shape
    # what does (the polynomials' values, node and block times), kept for the last few sequence lengths
    shaped: ShapeMemo = field(default_factory=ShapeMemo, compare=False, repr=False)

    def evaluate(self, b: int, s: int) -> np.ndarray:
        """(7, n) array: flops, bytes, saved, gemm batch, m, n, k."""
        memo = self.shaped.at(s)
        if b not in memo:
            n = len(self.fwd)
            vals = np.asarray(self.fn(b, s), dtype=np.float64) if n else np.zeros(0)
            memo[b] = vals.reshape(7, n)
        return memo[b]


@dataclass(frozen=True, slots=True, kw_only=True)
class CompiledTable:
    """A CostTable with numeric evaluators, plus the model spec; made once by `compile_table`."""

    spec: ModelSpec
    blocks: dict  # BlockKind -> CompiledBlock
    # a mixed stack (layers of several kinds, CostTable.layer_kinds): one table per kind, each with the
    # embedding, that kind's layer and the head (every per-block function prices a kind through its own),
    # the index of every layer's kind, and (attention layers, Mamba-2 layers) for the model FLOPs
    kinds: tuple = ()
    layer_kinds: tuple[int, ...] = ()
    kind_names: tuple[str, ...] = ()  # the name of each kind (passes/capture/layer_kinds.py), in `kinds` order
    mixers: tuple[int, int] = (0, 0)
    scans: tuple[float, int] = (0.0, 0)  # CostTable.scan_layers: Mamba-1 scan FLOPs per token, layers without attention
    # whether the runtime compiles the model's layers (rules/kernels.compiles_layers of the whole model's spec, also
    # on each kind of a mixed stack): the compiled-layer fusions are priced only then
    layers_compiled: bool = True
    # what the planner computes once per model and keeps over plans (passes/solve/bounds.py: the ZeRO state of a
    # layout), each entry keyed on all it depends on besides the table
    memo: dict = field(default_factory=dict, compare=False, repr=False)

    def block(self, kind: BlockKind) -> CompiledBlock:
        return self.blocks[kind]


def compile_table(table: CostTable | CompiledTable, spec: ModelSpec, *,
                  layers_compiled: bool | None = None) -> CompiledTable:
    """Turn the SymPy table into arrays and one lambdified function per block (done once); `layers_compiled`:
    None reads it off `spec` (rules/kernels.compiles_layers)."""
    if isinstance(table, CompiledTable):
        return table
    if table.mixed:
        return _compile_mixed(table, spec)
    blocks = {}
    for block in table.blocks:
        blocks[block.kind] = _compile_block(block, spec)
    for kind in BlockKind:
        if kind not in blocks:
            raise InvalidConfigError(f"cost table of {table.model} has no {kind.value} block; "
                                     "build it with autoshard.passes.capture.shapes.build_cost_table")
    return CompiledTable(spec=spec, blocks=blocks, scans=table.scan_layers(),
                         layers_compiled=compiles_layers(spec) if layers_compiled is None else layers_compiled)


def _compile_mixed(table: CostTable, spec: ModelSpec) -> CompiledTable:
    """A mixed stack: a one-kind table per layer kind (the embedding, that kind's layer, the head)."""
    edges = [b for b in table.blocks if b.kind is not BlockKind.LAYER]
    layers = table.layer_blocks()
    views = tuple(compile_table(replace(table, blocks=(edges[0], blk, edges[1]), layer_kinds=(), shared_params=0),
                                kind_spec(spec, blk, table.layer_kinds.index(blk.name)),
                                layers_compiled=compiles_layers(spec)) for blk in layers)
    names = [b.name for b in layers]
    return CompiledTable(spec=spec, blocks=views[0].blocks, kinds=views, kind_names=tuple(names),
                         layer_kinds=tuple(names.index(k) for k in table.layer_kinds),
                         mixers=table.mixer_layers(mamba2=spec.mixer is Mixer.SSD), scans=table.scan_layers(),
                         layers_compiled=compiles_layers(spec))


def routes_tokens(block) -> bool:
    """Whether a layer block routes tokens to experts on its graph (a router feeding topk,
    passes/capture/fused_patterns.py)."""
    return any(n.region is not None and n.region.kernel == ROUTER for n in block.nodes)


def kind_spec(spec: ModelSpec, block, first_layer: int) -> ModelSpec:
    """The spec one layer kind of a mixed stack is priced with: the stack's, without its routed experts for a
    kind whose layer routes no tokens on its graph (no router feeding topk, passes/capture/fused_patterns.py:
    DeepSeek-V3's dense layers, Nemotron-H's Mamba-2 / attention / MLP layers):
    such a layer is data-parallel over the ep ranks, its gradients reduced over dp x ep. A hybrid's layer parts
    (`ModelSpec.parts`) narrowed to those of the kind's layers (`first_layer`: one of them), on every layer: the
    kind's one-layer table is priced by its own parts' sharding rules; `passes_state` keeps what cp's layout is
    for the whole stack (`ModelSpec.cp_contiguous`)."""
    if spec.parts:
        spec = replace(spec, parts=tuple(replace(p, layers=()) for p in spec.parts
                                         if not p.layers or first_layer in p.layers), passes_state=spec.cp_contiguous)
    if not spec.is_moe:
        return spec
    if routes_tokens(block):
        return spec
    return replace(spec, experts=0, top_k=0, shared_ffn=0, moe_paths=())


def mixed_violation(ct: CompiledTable, layout: Layout) -> str | None:
    """Why a mixed stack cannot be priced at `layout` yet, or None: what the per-kind tables cannot price."""
    if not ct.kinds:
        return None
    mesh = layout.mesh
    experts = any(view.spec.is_moe for view in ct.kinds)  # ep: the MoE kinds' experts, the others data-parallel
    parts = all(view.spec.parts for view in ct.kinds)  # tp: each kind by its layer parts' rules
    if (mesh.tp > 1 and not parts) or (mesh.ep > 1 and not experts):
        axes = ", ".join(["dp", "pp", "cp"] + ["tp"] * parts + ["ep"] * experts)
        fix = " = ".join(["tp"] * (not parts) + ["ep"] * (not experts))
        return (f"{ct.spec.name}: a model whose layers are of {len(ct.kinds)} kinds is priced under {axes} "
                f"only so far (tp {mesh.tp}, cp {mesh.cp}, ep {mesh.ep} asked); use {fix} = 1")
    if layout.recompute is Recompute.SELECTIVE or layout.zero == 3:
        what = "selective recompute" if layout.recompute is Recompute.SELECTIVE else "ZeRO-3"
        return (f"{ct.spec.name}: {what} is not priced for a model whose layers are of several kinds yet; "
                "use recompute none or full, ZeRO 0-2")
    return None


def stage_blocks(ct: CompiledTable, stage: Stage) -> tuple[tuple[CompiledTable, BlockKind, int], ...]:
    """(table, block, instances) of what `stage` holds: its embedding / head and its layers, a mixed
    stack's by the kinds of its own layers (`stage.first_layer` .. `stage.end_layer`), each priced
    through that kind's table."""
    edges = ((ct, BlockKind.EMBED, int(stage.embed)), (ct, BlockKind.HEAD, int(stage.head)))
    if not ct.kinds:
        return edges[0], (ct, BlockKind.LAYER, stage.layers), edges[1]
    held = ct.layer_kinds[stage.first_layer:stage.end_layer]
    return (edges[0], *((view, BlockKind.LAYER, held.count(k)) for k, view in enumerate(ct.kinds)), edges[1])


def priced_nodes(block) -> list:
    """The nodes of a block the cost model prices, in order: views cost nothing and are dropped,
    except a view that owns a saved tensor (the flash op's output and logsumexp, reached through
    getitem), which keeps its saved bytes."""
    return [n for n in block.nodes if n.kind is not OpKind.VIEW or n.saved_bytes != 0]


def _compile_block(block, spec: ModelSpec) -> CompiledBlock:
    nodes = priced_nodes(block)
    exprs: list[sympy.Expr] = []
    for attr in ("flops", "bytes", "saved_bytes"):
        for n in nodes:
            exprs.append(n.bytes_read + n.bytes_written if attr == "bytes" else getattr(n, attr))
    for i in range(4):
        exprs.extend((n.gemm[i] if n.gemm is not None else sympy.Integer(0)) for n in nodes)
    # numpy as the module object: the "numpy" string makes lambdify run `from numpy import *`, which
    # imports numpy.f2py (~0.4 s of every plan); the generated code and its numbers are the same
    fn = sympy.lambdify((B, S), exprs, modules=[np]) if nodes else None
    roles = sharding.table(spec)
    found = [sharding.role_of(spec, block.kind, n.module_path) for n in nodes]
    role = np.array([-1 if r is None else roles.index(r) for r in found], dtype=np.int16)
    rerun = np.array([_in_selective_module(n.module_path, spec) for n in nodes], dtype=bool)
    is_gemm = np.array([n.kind is OpKind.MATMUL and n.gemm is not None for n in nodes], dtype=bool)
    splits = [r is not None and r.strategy is not sharding.Strategy.REPLICATE for r in found]
    tp_dim = np.array([_tp_dim(n, spec) if c else -1 for n, c in zip(nodes, splits)], dtype=np.int8)
    cp_dim = np.array([_cp_dim(n) for n in nodes], dtype=np.int8)
    quadratic = np.array([degree_in_s(n.flops) >= 2 for n in nodes], dtype=bool)
    fwd = np.array([n.phase == "fwd" for n in nodes], dtype=bool)
    paths = [n.module_path for n in nodes]
    region, region_kernels, region_sizes = fused_regions.region_kinds(nodes)
    wgrad = is_gemm & ~fwd & ~quadratic & (cp_dim == 3)  # (out, in, tokens): a weight gradient
    colwise = np.array([r is not None and r.strategy is sharding.Strategy.COLWISE for r in found], dtype=bool)
    expert = np.array([r is not None and r.strategy is sharding.Strategy.EXPERT for r in found], dtype=bool)
    float8 = is_gemm & np.array([sharding.is_float8_role(r) for r in found], dtype=bool)
    return CompiledBlock(kind=block.kind, count=block.count, params=block.params, fwd=fwd, role=role,
                         rerun=rerun, is_gemm=is_gemm, tp_dim=tp_dim, cp_dim=cp_dim, quadratic=quadratic,
                         region=region, region_kernels=region_kernels, region_sizes=region_sizes,
                         wgrad_groups=fused_regions.wgrad_overlap_groups(paths, wgrad & colwise), fn=fn,
                         expert=expert, float8=float8,
                         delta_rule=np.array([n.target.startswith(DELTA_RULE_TARGET) for n in nodes], dtype=bool))


def _parts(path: str) -> list[str]:
    return path.split(".") if path else []


def is_core(path: str, spec: ModelSpec) -> bool:
    """An op of the attention module / Mamba-2 mixer itself (not of its projections)."""
    parts = _parts(path)
    return bool(parts) and parts[-1] == selective_module(spec)


def _in_selective_module(path: str, spec: ModelSpec) -> bool:
    """An op selective recompute reruns: anywhere inside the attention module / Mamba-2 mixer,
    projections included (the module passes/rewrite.py `_checkpointed` wraps)."""
    return selective_module(spec) in _parts(path)

def _symbols(expr) -> set:
    return getattr(expr, "free_symbols", set())


def _tp_dim(node, spec: ModelSpec) -> int:
    if node.gemm is None:
        return -1
    if is_core(node.module_path, spec) and node.gemm[0] != 1:
        return 0  # batched attention / SSD matmuls: heads live in the batch dim
    weight_dims = [i for i in (1, 2, 3) if not _symbols(node.gemm[i])]
    if not weight_dims:
        return -1
    for i in weight_dims:
        if int(node.gemm[i]) != spec.hidden:
            return i
    return weight_dims[0]


def _cp_dim(node) -> int:
    if node.gemm is None:
        return -1
    for i in (1, 2, 3):
        if S in _symbols(node.gemm[i]):
            return i
    return -1


# --------------------------------------------------------------------------------------------
# Component functions
