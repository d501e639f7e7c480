"""Cost model: seconds and bytes of one training step for a parallel layout.

Contract
--------
`estimate(table, spec, hw, layout, *, global_batch, seq_len, stages=None) -> Estimate`

* `table` is the symbolic `CostTable` of the model (passes/capture/shapes) or the `CompiledTable` made
  from it once by `compile_table(table, spec)` (do that when pricing many layouts).
* `layout` is a `Layout`: mesh (dp, pp, tp, cp, ep), micro-batch size, ZeRO level 0-3, recompute.
* `stages` (optional) assigns layers to pipeline stages (ir.Stage), each with its own recompute
  level (`Stage.recompute`: the planner mixes levels per stage; `layout.recompute` is then only
  the plan's label); default: an even split, the first stages taking the remainder, embedding on
  the first stage and head on the last, every stage at `layout.recompute`.
* Runtime convention: rank order (pp, dp, ep, cp, tp), tp innermost. A tp group is contiguous
  ranks (stride 1), cp stride tp, ep stride cp*tp, dp stride ep*cp*tp (the dense gradient group
  dp x ep x cp has stride tp; the experts' dp x cp spans the same ranks at ep times the spacing),
  pp stride dp*ep*cp*tp.
* Mixture of experts (`passes/cost/moe_cost.py`): EP folds into DP (the batch splits over dp x ep,
  `Layout.microbatches`); expert GEMMs at the rows each expert receives, times
  `layout.moe_imbalance` on the busiest rank; dispatch / combine all-to-alls per MoE layer on the
  ep group's link (`BlockTime.ep_comm_s`); expert parameters over ep, their gradients reduced and
  ZeRO-sharded over dp x cp, the dense ones over dp x ep x cp (`expert=` of the state and sync
  functions: the routed-expert share of `params`); expert activations at the worst case of
  dropless routing; MoE blocks whole on every tp rank (the sharding table's EXPERT / REPLICATE
  roles); MFU on the parameters a token meets (top-k experts).

Component functions (public, stable names; the CP-SAT planner builds its model from them and
`estimate` is nothing but their composition, so both agree):

  compile_table(table, spec) -> CompiledTable          numeric evaluators of the SymPy table
  block_time(ct, hw, layout, kind, *, seq_len) -> BlockTime
        one instance of a block (one layer, the embedding, the head) for ONE micro-batch:
        forward, backward, recompute, TP and CP communication (all on the critical path)
  block_activation_bytes(ct, layout, kind, *, seq_len) -> float
        bytes one instance keeps alive for backward per micro-batch, after recompute
  block_params(ct, layout, kind) -> float              parameters of one instance on one device
  expert_block_params(ct, layout, kind) -> float       the routed-expert part of block_params
  state_bytes(params, layout, *, expert=0) -> MemoryBreakdown  weights, grads, optimizer under ZeRO
  zero2_staging_bytes(params, layout, *, expert=0)     ZeRO-2's gradient staging buckets (a stage's buffers)
  p2p_time(ct, hw, layout, *, seq_len) -> float        stage-to-stage sends per micro-batch
  dp_exposed_time(hw, params, layout, *, backward_s, forward_s) -> float
                                                       gradient sync of one stage left exposed
  optimizer_time(hw, params, layout) -> float          Adam step on this device's shard (host under offload)
  offload_time(hw, params, layout) -> float            host-link copies of one micro-batch under offload
  logits_bytes(ct, layout, *, seq_len) -> float        fp32 logits peak of the head stage
  buffer_bytes(ct, layout, *, seq_len) -> float        communication staging buffers of a stage
  pipeline_time(stage_times, microbatches) -> float    1F1B makespan (arXiv 2602.09109 sec. 4.3)
  model_flops_per_token(ct, seq_len) -> float          paper's MFU convention

What TP shards comes from the family's sharding table (rules/sharding.py), the one the rewrite
carries out: each captured node's work and saved bytes are divided by the parts of its module's
role (`_tp_divisor`: heads, KV heads split by min(tp, kv_heads), MLP width, Mamba-2 heads and
groups, vocabulary; 1 for replicated roles such as the RMSNorms outside the mixer and the residual
adds), parameters per rank by `sharding.params_per_rank`, and a layer's forward TP all-reduces
are its row-parallel roles (`sharding.row_parallel_count`). CP splits every token-proportional cost by cp (load-balanced causal
split); LLaMA attention's s x s work divides by cp times (2cp+1)/(2cp), the full diagonal chunk
pairs of runtime/cp_attention.py (`cp_attention_overwork`). Recompute reruns the forward of what
the runtime checkpoints, the TP and CP collectives inside it included (`_recompute_time`).
Sequence parallelism (`Layout.sequence_parallel`): the ops on a tp shard of the sequence divided
by tp, all-gathers and reduce-scatters in place of the TP all-reduces (passes/cost/sequence_cost.py).

Precision (passes/cost/precision.py; Megatron-LM / MindSpeed mixed precision, arXiv 1910.02054 table 1):
bf16 weights (2 B/param), fp32 main gradients (4 B), fp32 master weights + Adam m + v (12 B).
ZeRO-1 shards the 12 B over dp x cp, ZeRO-2 also the gradients; ZeRO-3 is FSDP2's layout: fp32
sharded parameters (the masters), fp32 gradients and Adam m + v, (4 + 4 + 8) B / (dp x cp).
"""

from __future__ import annotations

import functools

from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import numpy as np
import sympy

from autoshard.errors import InvalidConfigError
from autoshard.hardware import DeviceProfile
from autoshard.cost_table import B, S, CostTable
from autoshard.ir import (BlockKind, Fp8Recipe, Mesh, OpKind, Precision, Recompute, Schedule, Stage, _enum_field,
                          check_schedule, even_stages, fp8_recipe_of)
from autoshard.models.presets import Family, ModelSpec
from autoshard.passes.cost import fused_regions, moe_cost
from autoshard.rules import schedules
from autoshard.passes.cost.collectives import Collective, best_time, group_link, steps, volume
from autoshard.rules.buckets import gradient_bucket_params
from autoshard.passes.cost.shape_memo import ShapeMemo
from autoshard.passes.cost import sequence_cost
from autoshard.rules import sharding
from autoshard.rules.validity import plan_violation
from autoshard.passes.cost.precision import PrecisionNumbers, precision_numbers, resolve_precision
from autoshard.rules.sharding import selective_module

OPTIM_TRAFFIC = 30.0  # HBM bytes per parameter of an Adam step: grad r, master/m/v r+w, bf16 w


@dataclass(frozen=True, slots=True, kw_only=True)
class Layout:
    """One parallel layout: the mesh plus the memory options."""

    mesh: Mesh
    micro_batch: int = 1
    zero: int = 0
    recompute: Recompute = Recompute.NONE
    precision: Precision = Precision.AUTO  # passes/cost/precision.py; estimate resolves AUTO per device (`resolved`)
    fp8_recipe: Fp8Recipe | None = None  # precision fp8 only (tensorwise when None): torchao's recipe
    schedule: Schedule = Schedule.ONE_F_ONE_B  # pipeline schedule, priced by rules/schedules.py
    virtual_stages: int = 1  # model chunks per pipeline rank (interleaved-1f1b, zero-bubble V)
    offload: bool = False  # ZeRO-3 shards and optimizer state in host memory (plan key offload_optimizer)
    sequence_parallel: bool = False  # norms / residual on a tp shard of the sequence (passes/cost/sequence_cost.py)
    # intra-op choices as (choice, option) pairs that differ from the table's default (Plan.strategies,
    # rules/sharding.py CHOICES): what the sharding table splits, hence every TP divisor and collective
    strategies: tuple[tuple[str, str], ...] = ()
    moe_imbalance: float = 1.0  # mixture of experts: the busiest expert's load over the mean (passes/cost/moe_cost.py)
    # layer choices each pipeline stage makes on its own (the planner's tables, passes/solve/solve_model.py
    # `stage_variants`): "sequence_parallel" (on or off per stage; where they differ every stage boundary
    # carries the whole sequence, `sequence_boundary_time`) and "groups" (Mamba-2 split or whole per stage);
    # the layout's own sequence_parallel / groups are then off / split, the first of each stage's variants.
    # What estimate() prices of such a layout is that first variant on every stage
    stage_choices: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.moe_imbalance, (int, float)) or not self.moe_imbalance >= 1.0:
            raise InvalidConfigError(f"moe_imbalance is the busiest expert's load over the mean, so a number, at least 1.0; "
                                     f"got {self.moe_imbalance!r}")
        if not isinstance(self.precision, Precision):  # (the planner builds ~10^5 layouts: members pass as they are)
            object.__setattr__(self, "precision", _enum_field(Precision, self.precision, "precision"))
        if not isinstance(self.schedule, Schedule):
            object.__setattr__(self, "schedule", _enum_field(Schedule, self.schedule, "schedule"))
        if self.fp8_recipe is not None or self.precision is Precision.FP8:
            object.__setattr__(self, "fp8_recipe", fp8_recipe_of(self.precision, self.fp8_recipe))
        if not isinstance(self.virtual_stages, int) or self.virtual_stages < 1:
            raise InvalidConfigError(f"virtual_stages must be a positive integer, got {self.virtual_stages!r}")
        if not isinstance(self.micro_batch, int) or self.micro_batch < 1:
            raise InvalidConfigError(f"micro_batch must be a positive integer, got {self.micro_batch!r}")
        if self.zero not in (0, 1, 2, 3):
            raise InvalidConfigError(f"zero must be 0, 1, 2 or 3, got {self.zero!r}")
        if not isinstance(self.sequence_parallel, bool):
            raise InvalidConfigError(f"sequence_parallel must be true or false, got {self.sequence_parallel!r}")
        if self.offload and self.zero != 3:
            raise InvalidConfigError(f"optimizer offload needs zero=3 (FSDP2 offloads the ZeRO-3 shards), got "
                                     f"zero={self.zero}")
        if self.stage_choices and not set(self.stage_choices) <= {"sequence_parallel", "groups"} or self.stage_choices and (
                self.sequence_parallel and "sequence_parallel" in self.stage_choices) or (
                "groups" in self.stage_choices and "groups" in dict(self.strategies)):
            raise InvalidConfigError(f"stage_choices {self.stage_choices!r}: per-stage sequence_parallel / groups, "
                                     "with the layout's own off / split")
        if not isinstance(self.recompute, Recompute):
            object.__setattr__(self, "recompute", Recompute(self.recompute))

    @property
    def numbers(self) -> PrecisionNumbers:
        """Bytes per value and GEMM rate of this layout's precision."""
        return precision_numbers(self.precision, self.fp8_recipe)

    @property
    def numerics(self) -> tuple:
        """What of the layout its precision numbers depend on (memo keys): the precision and the fp8 recipe."""
        return self.precision, self.fp8_recipe

    def microbatches(self, global_batch: int) -> int:
        """Micro-batches per step: the batch splits over dp x ep (the ep peers take their own rows, as
        runtime/dist_model.py slices them), each replica's rows into micro-batches."""
        return global_batch // (self.mesh.dp * self.mesh.ep * self.micro_batch)


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockTime:
    """Seconds for one instance of a block and one micro-batch on one device."""

    fwd_s: float
    bwd_s: float
    recompute_s: float
    tp_comm_s: float
    cp_comm_s: float
    ep_comm_s: float = 0.0  # MoE dispatch / combine all-to-alls (passes/cost/moe_cost.py)

    @property
    def compute_s(self) -> float:
        return self.fwd_s + self.bwd_s

    @property
    def comm_s(self) -> float:
        """TP, CP and EP collectives on the critical path."""
        return self.tp_comm_s + self.cp_comm_s + self.ep_comm_s

    @property
    def total_s(self) -> float:
        return self.fwd_s + self.bwd_s + self.recompute_s + self.comm_s


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryBreakdown:
    """Bytes on one device."""

    weights: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    logits: float = 0.0
    buffers: float = 0.0

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations + self.logits + self.buffers

    def as_gb(self) -> dict[str, float]:
        names = ("weights", "grads", "optimizer", "activations", "logits", "buffers")
        return {n: getattr(self, n) / 1e9 for n in names}


@dataclass(frozen=True, slots=True, kw_only=True)
class TimeBreakdown:
    """Seconds of one step on the critical path; the parts add up to the step time."""

    compute: float = 0.0
    recompute: float = 0.0
    tp_comm: float = 0.0
    cp_comm: float = 0.0
    ep_comm: float = 0.0  # MoE dispatch / combine all-to-alls
    p2p: float = 0.0
    pp_bubble: float = 0.0
    dp_comm_exposed: float = 0.0
    optimizer: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return {n: getattr(self, n) for n in ("compute", "recompute", "tp_comm", "cp_comm", "ep_comm", "p2p",
                                              "pp_bubble", "dp_comm_exposed", "optimizer")}


@dataclass(frozen=True, slots=True, kw_only=True)
class Estimate:
    """The predicted cost of one training step of one layout."""

    layout: Layout
    step_time_s: float
    tokens_per_s: float
    mfu: float  # fraction, paper convention
    memory_gb: float  # peak over devices (what `fits` is judged on)
    mean_memory_gb: float  # average over devices (how the paper's table reports memory)
    memory: MemoryBreakdown  # of the device with the peak
    fits: bool
    time: TimeBreakdown
    microbatches: int
    stages: tuple[Stage, ...]
    stage_times_s: tuple[float, ...]  # per micro-batch, fwd + bwd, per stage
    stage_memory_gb: tuple[float, ...] = ()  # peak bytes / 1e9 of each stage's devices
    # sequence parallelism per pipeline stage when the stages differ (a `sweep` row, commands/sweep.py); empty:
    # the layout's own on every stage
    stage_sequence_parallel: tuple[bool, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """One sweep row. `memory_gb` is the device average (the convention of published tables,
        e.g. arXiv 2602.09109's), `peak_memory_gb` the busiest device (first pipeline stage)."""
        mesh, lay = self.layout.mesh, self.layout
        return {
            **mesh.as_dict(), "zero": lay.zero, "offload": lay.offload, "recompute": lay.recompute.value, "micro_batch": lay.micro_batch,
            "precision": lay.precision.value, **({"fp8_recipe": lay.fp8_recipe.value} if lay.fp8_recipe else {}),
            "schedule": lay.schedule.value, "virtual_stages": lay.virtual_stages,
            "sequence_parallel": list(self.stage_sequence_parallel) or lay.sequence_parallel,
            "strategies": dict(lay.strategies),  # the intra-op choices (plan key strategies)
            "step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s,
            # the paper's tables report memory averaged over the devices; `fits` judges the peak
            "memory_gb": self.mean_memory_gb, "peak_memory_gb": self.memory_gb,
            "mfu": self.mfu, "fits": self.fits, "microbatches": self.microbatches,
            "memory_breakdown_gb": self.memory.as_gb(), "time_breakdown_s": self.time.as_dict(),
        }


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
    wgrad_groups: dict  # parent module -> mask of its column-parallel weight-gradient GEMMs
    fn: Any  # lambdified (b, s) -> list of 7 * n numbers
    expert: np.ndarray | None = None  # bool: an op of the routed experts (the sharding table's EXPERT role)
    float8: np.ndarray | None = None  # bool: a GEMM of a float8 linear (fp8 plans: sharding.is_float8_role)
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
    mixers: tuple[int, int] = (0, 0)
    # what the planner computes once per model and keeps over plans (passes/solve/bounds.py: the ZeRO state of a
    # layout), each entry keyed on all it depends on besides the table
    memo: dict = field(default_factory=dict, compare=False, repr=False)

    def block(self, kind: BlockKind) -> CompiledBlock:
        return self.blocks[kind]


def compile_table(table: CostTable | CompiledTable, spec: ModelSpec) -> CompiledTable:
    """Turn the SymPy table into arrays and one lambdified function per block (done once)."""
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
    return CompiledTable(spec=spec, blocks=blocks)


def _compile_mixed(table: CostTable, spec: ModelSpec) -> CompiledTable:
    """A mixed stack: a one-kind table per layer kind (the embedding, that kind's layer, the head)."""
    edges = [b for b in table.blocks if b.kind is not BlockKind.LAYER]
    layers = table.layer_blocks()
    views = tuple(compile_table(replace(table, blocks=(edges[0], blk, edges[1]), layer_kinds=(), shared_params=0), spec)
                  for blk in layers)
    names = [b.name for b in layers]
    return CompiledTable(spec=spec, blocks=views[0].blocks, kinds=views,
                         layer_kinds=tuple(names.index(k) for k in table.layer_kinds),
                         mixers=table.mixer_layers(mamba2=spec.family is Family.MAMBA2))


def mixed_violation(ct: CompiledTable, layout: Layout) -> str | None:
    """Why a mixed stack cannot be priced at `layout` yet, or None: what the per-kind tables cannot price."""
    if not ct.kinds:
        return None
    mesh = layout.mesh
    if mesh.tp > 1 or mesh.cp > 1 or mesh.ep > 1:
        return (f"{ct.spec.name}: a model whose layers are of {len(ct.kinds)} kinds is priced under dp and pp "
                f"only so far (tp {mesh.tp}, cp {mesh.cp}, ep {mesh.ep} asked): the sharding table of its layer "
                "kinds is not read yet; use tp = cp = ep = 1")
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
    quadratic = np.array([_degree_in_s(n.flops) >= 2 for n in nodes], dtype=bool)
    fwd = np.array([n.phase == "fwd" for n in nodes], dtype=bool)
    paths = [n.module_path for n in nodes]
    region, region_kernels = fused_regions.region_kinds(paths, [n.kind is OpKind.VECTOR for n in nodes], spec)
    wgrad = is_gemm & ~fwd & ~quadratic & (cp_dim == 3)  # (out, in, tokens): a weight gradient
    colwise = np.array([r is not None and r.strategy is sharding.Strategy.COLWISE for r in found], dtype=bool)
    expert = np.array([r is not None and r.strategy is sharding.Strategy.EXPERT for r in found], dtype=bool)
    float8 = is_gemm & np.array([sharding.is_float8_role(r) for r in found], dtype=bool)
    return CompiledBlock(kind=block.kind, count=block.count, params=block.params, fwd=fwd, role=role,
                         rerun=rerun, is_gemm=is_gemm, tp_dim=tp_dim, cp_dim=cp_dim, quadratic=quadratic,
                         region=region, region_kernels=region_kernels,
                         wgrad_groups=fused_regions.wgrad_overlap_groups(paths, wgrad & colwise), fn=fn,
                         expert=expert, float8=float8)


def _degree_in_s(expr) -> int:
    """Degree of a node's FLOPs in the sequence length (0 when not a polynomial in S)."""
    try:
        return int(sympy.degree(sympy.expand(expr), S))
    except (sympy.PolynomialError, TypeError, ValueError):
        return 0


def _parts(path: str) -> list[str]:
    return path.split(".") if path else []


def _is_core(path: str, spec: ModelSpec) -> bool:
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
    if _is_core(node.module_path, spec) and node.gemm[0] != 1:
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


def _tp_divisor(blk: CompiledBlock, spec: ModelSpec, tp: int, sequence_parallel: bool = False,
                strategies=()) -> np.ndarray:
    """Per node: what TP divides its work and saved bytes by, its role's parts (the sharding table with
    the layout's intra-op choices: a replicated LM head divides nothing); under sequence parallelism tp
    for the ops on a sequence shard (passes/cost/sequence_cost.py)."""
    key = ("tp_divisor", tp, sequence_parallel, tuple(strategies))
    if key not in blk.memo:
        parts = np.array([1.0, *sharding.role_divisors(spec, tp, tuple(strategies))])
        if sequence_parallel and tp > 1:
            parts = sequence_cost.sequence_divisors(parts, spec, blk.kind, tp)
        blk.memo[key] = parts[blk.role + 1]
    return blk.memo[key]


def gemm_efficiency(hw: DeviceProfile, m: np.ndarray, n: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Achievable fraction of peak for GEMMs of these shapes: hw.gemm_efficiency times, per
    dimension, d / (d + hw.gemm_half_dim): thin or small GEMMs underfill the tiles (the paper's
    observation that TP's smaller GEMMs run less efficiently)."""
    return hw.gemm_efficiency * shape_factor(hw.gemm_half_dim, m, n, k)


def shape_factor(half_dim: float, m: np.ndarray, n: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Per GEMM, the product over its dimensions of d / (d + half_dim)."""
    f = np.ones_like(m)
    for d in (m, n, k):
        d = np.maximum(d, 1.0)
        f = f * d / (d + half_dim)
    return f


def float8_gemm_seconds(hw: DeviceProfile, flops: np.ndarray, dims: np.ndarray, *, cast_bytes: float) -> np.ndarray:
    """Seconds of float8 GEMMs (torchao's `Float8Linear`, passes/cost/precision.py "fp8"): the GEMM at the FP8
    tensor-core rate, `hw.fp8_peak_flops` x `hw.fp8_gemm_efficiency` x the shape factor with
    `hw.fp8_gemm_half_dim`, then the casts of its two operands (batch x (m k + k n) elements, `cast_bytes`
    each) at the vector rate; the cast kernels run before the GEMM that reads them. `dims`: [..., (batch,
    m, n, k), node] as in `_node_times_many`."""
    if hw.fp8_peak_flops is None:
        raise InvalidConfigError(fp8_refusal(hw))
    batch, m, n, k = (dims[:, i] for i in range(4))
    shape = shape_factor(hw.fp8_gemm_half_dim, m, n, k)
    cast_s = batch * (m * k + k * n) * cast_bytes / (hw.hbm_bandwidth * hw.vector_efficiency)
    return flops / (hw.fp8_peak_flops * hw.fp8_gemm_efficiency * shape) + cast_s


def fp8_refusal(hw: DeviceProfile) -> str:
    """Why precision fp8 cannot be priced on `hw` (a profile without an FP8 tensor-core peak)."""
    return (f"precision 'fp8' on {hw.name}: the profile has no FP8 tensor cores (no fp8_peak_flops; FP8 GEMMs need "
            "Hopper-class GPUs: h100, h200); plan with precision 'bf16-mixed' (or 'auto'), or give a profile "
            "with fp8_peak_flops, fp8_gemm_efficiency and fp8_gemm_half_dim and their sources")


def _fused_scales(ct: CompiledTable, hw: DeviceProfile, layout: Layout, kind: BlockKind, seq_len: int):
    """Per-node factors on the traced bytes and saved bytes: the fused kernels the device runs
    (passes/cost/fused_regions.py) and the precision (tables are traced in bf16)."""
    blk = ct.block(kind)
    key = ("fused_scales", layout.micro_batch, seq_len, hw, layout.numerics)  # the same for every mesh
    memo = blk.shaped.at(seq_len)
    if key not in memo:
        vals = blk.evaluate(layout.micro_batch, seq_len)
        prec = layout.numbers
        byte_scale, saved_scale = fused_regions.fused_scales(
            blk.region, blk.region_kernels, blk.fwd, vals[1], vals[2], spec=ct.spec, fused=hw.fuses,
            tokens=float(layout.micro_batch * seq_len), act_bytes=2.0)
        memo[key] = (byte_scale * prec.traced_scale, saved_scale * prec.traced_scale)
    return memo[key]


def _flash(ct: CompiledTable, hw: DeviceProfile) -> bool:
    return hw.fuses("flash_attention") and ct.spec.family is Family.LLAMA


def _node_times(ct: CompiledTable, hw: DeviceProfile, layout: Layout, kind: BlockKind, seq_len: int) -> np.ndarray:
    """Roofline seconds per node of one block instance and one micro-batch on one device."""
    return _node_times_many(ct, hw, (layout,), kind, seq_len)[0]


def _node_times_many(ct: CompiledTable, hw: DeviceProfile, layouts: Sequence[Layout], kind: BlockKind,
                     seq_len: int) -> np.ndarray:
    """`_node_times` of each of `layouts` (which share the micro-batch and precision), [layout, node]: one
    numpy pass for them all, each entry the same float operations as for its layout alone (elementwise; a
    layout without expert parallelism has its expert factors at 1.0, which changes no bit)."""
    blk = ct.block(kind)
    if not len(blk.fwd):
        return np.zeros((len(layouts), 0))
    first = layouts[0]
    vals = blk.evaluate(first.micro_batch, seq_len)

    def column(values) -> np.ndarray:  # one value per layout, [layout, 1]
        return np.array(values, dtype=np.float64)[:, None]

    cp = column([lay.mesh.cp for lay in layouts])
    div = np.stack([_tp_divisor(blk, ct.spec, lay.mesh.tp, lay.sequence_parallel, lay.strategies) for lay in layouts])
    overwork = column([cp_attention_overwork(ct.spec, lay.mesh.cp) for lay in layouts])
    flops = vals[0] / div / cp * np.where(blk.quadratic, overwork, 1.0)
    byte_scale, _ = _fused_scales(ct, hw, first, kind, seq_len)
    nbytes = vals[1] * byte_scale / div / cp
    peak = hw.peak_flops * first.numbers.flops_scale
    dims = np.repeat(vals[None, 3:7], len(layouts), axis=0)  # [layout, (batch, m, n, k), node]
    idx = np.arange(dims.shape[2])
    has_tp = blk.tp_dim >= 0
    dims[:, blk.tp_dim[has_tp], idx[has_tp]] /= div[:, has_tp]
    has_cp = blk.cp_dim >= 0
    dims[:, blk.cp_dim[has_cp], idx[has_cp]] /= cp
    if blk.expert is not None and blk.expert.any() and any(lay.mesh.ep > 1 for lay in layouts):  # passes/cost/moe_cost.py
        busiest = np.where(blk.expert, column([moe_cost.expert_flops_factor(lay.mesh, lay.moe_imbalance)
                                               for lay in layouts]), 1.0)
        flops, nbytes = flops * busiest, nbytes * busiest  # the busiest rank's rows set the pace
        per_expert, rows = (column(x) for x in zip(*(moe_cost.expert_gemm_scale(lay.mesh, lay.moe_imbalance)
                                                        for lay in layouts)))
        grow = blk.expert & blk.is_gemm & has_cp  # E/ep experts, each receiving ep x imbalance the rows
        dims[:, 0, grow] /= per_expert
        dims[:, blk.cp_dim[grow], idx[grow]] *= rows
    mem_t = nbytes / (hw.hbm_bandwidth * hw.vector_efficiency)
    eff = gemm_efficiency(hw, dims[:, 1], dims[:, 2], dims[:, 3])
    gemm_t = np.where(blk.is_gemm, flops / (peak * eff), 0.0)
    if first.precision is Precision.FP8 and blk.float8 is not None and blk.float8.any():
        gemm_t = np.where(blk.float8, float8_gemm_seconds(hw, flops, dims, cast_bytes=first.numbers.cast_bytes), gemm_t)
    if _flash(ct, hw):  # the attention nodes as the flash kernel runs them (passes/cost/fused_regions.py)
        attn = blk.is_gemm & blk.quadratic
        flash = fused_regions.flash_attention_flops(flops, blk.fwd, seq_len=seq_len, causal=True)
        gemm_t = np.where(attn, flash / (peak * hw.attention_efficiency), gemm_t)
    return np.maximum(gemm_t, mem_t)


def cp_attention_overwork(spec: ModelSpec, cp: int) -> float:
    """Factor on the ideal 1/cp share of the s x s attention work that a CP rank really does.
    runtime/cp_attention.py `local_causal_attention`: the sequence is cut into 2cp chunks of c
    tokens; rank i runs query chunks i and 2cp-1-i against their whole key prefixes, the diagonal
    chunk pair computed in full under a boolean mask: (i+1) + (2cp-i) = 2cp+1 chunk pairs, where
    an exact causal split is 2cp*2cp/2/cp = 2cp pairs. So (2cp+1)/(2cp) (1.25 at cp2, 1.125 at
    cp4); the mask's slower kernel path (docs/context_parallel.md, measured) is not priced.
    Mamba-2's scan is linear in S: no factor."""
    if cp == 1 or spec.family is not Family.LLAMA:
        return 1.0
    return (2 * cp + 1) / (2 * cp)


def _tokens(layout: Layout, seq_len: int) -> float:
    return layout.micro_batch * seq_len / layout.mesh.cp


def _tp_comm(ct: CompiledTable, hw: DeviceProfile, layout: Layout, kind: BlockKind, seq_len: int) -> tuple:
    """(forward, backward) seconds of TP collectives of one block instance, one micro-batch
    (Megatron-LM, Narayanan et al. 2021 sec. 2.3: all-reduce after each row-parallel GEMM in
    forward, after each column-parallel input in backward)."""
    tp = layout.mesh.tp
    if tp == 1:
        return 0.0, 0.0
    act = _tokens(layout, seq_len) * ct.spec.hidden * layout.numbers.act_bytes
    ar = best_time(hw, Collective.ALL_REDUCE, act, size=tp, stride=1)
    if kind is BlockKind.LAYER:
        n = sharding.row_parallel_count(ct.spec, BlockKind.LAYER)
        sync = _group_sync(ct, hw, layout, seq_len)
        return n * ar + sync, n * ar + sync
    if not sharding.vocab_parallel(ct.spec, kind, layout.strategies):
        return 0.0, 0.0  # replicated embedding / LM head and loss (the plan's choice): no collective
    if kind is BlockKind.EMBED:
        return ar, 0.0  # vocab-parallel lookup: partial sums all-reduced in forward
    small = best_time(hw, Collective.ALL_REDUCE, _tokens(layout, seq_len) * 3 * 4, size=tp, stride=1)
    return small, ar  # vocab-parallel CE (max, sum, target) forward; LM-head input grad backward


def _group_sync(ct: CompiledTable, hw: DeviceProfile, layout: Layout, seq_len: int) -> float:
    """Mamba-2 with its groups kept whole (tp does not divide them, or the plan chose "groups": "whole"):
    the gated norm's fp32 per-group sums of squares added over tp, once forward and once backward
    (runtime/ssd.py); else 0."""
    spec, tp = ct.spec, layout.mesh.tp
    if not sharding.groups_whole(spec, tp, layout.strategies):
        return 0.0
    return best_time(hw, Collective.ALL_REDUCE, _tokens(layout, seq_len) * spec.groups * 4, size=tp, stride=1)


def _cp_comm(ct: CompiledTable, hw: DeviceProfile, layout: Layout, kind: BlockKind, seq_len: int) -> tuple:
    """(forward, backward) seconds of CP communication of one block instance, one micro-batch, not
    overlapped. LLaMA (runtime/cp_attention.py): all-gather K/V in forward, reduce-scatter dK/dV in
    backward. Mamba-2 (runtime/cp_mamba.py): all-gather the chunk-final SSM states (fp32,
    O(d * d_state * CP), arXiv 2602.09109) and the conv1d halo (d_conv - 1 tokens of every rank)
    forward, reduce-scatter both backward. All of it runs inside the attention module / mixer."""
    mesh, spec = layout.mesh, ct.spec
    cp, tp = mesh.cp, mesh.tp
    if cp == 1 or kind is not BlockKind.LAYER:
        return 0.0, 0.0
    b = layout.micro_batch
    if spec.family is Family.LLAMA:
        head_dim = spec.attention_head_dim
        kv_local = spec.kv_heads / sharding.parts(spec, "self_attn.k_proj", tp)
        kv_full = 2 * b * seq_len * kv_local * head_dim * layout.numbers.act_bytes
        ag = best_time(hw, Collective.ALL_GATHER, kv_full, size=cp, stride=tp)
        rs = best_time(hw, Collective.REDUCE_SCATTER, kv_full, size=cp, stride=tp)
        return ag, rs
    # as runtime/cp_mamba.py runs it: each rank contributes its fp32 final state and log-decay per
    # head, and its last d_conv - 1 pre-conv tokens (both all-gathered; backward reduce-scatters)
    heads_local = spec.heads / tp
    state = b * heads_local * (spec.head_dim * spec.state + 1) * 4.0
    groups_local = spec.groups / (1 if sharding.groups_whole(spec, tp, layout.strategies) else tp)
    conv_dim = spec.intermediate / tp + 2 * groups_local * spec.state
    halo = b * (spec.conv - 1) * conv_dim * layout.numbers.act_bytes
    fwd, bwd = (sum(best_time(hw, op, nbytes * cp, size=cp, stride=tp) for nbytes in (state, halo))
                for op in (Collective.ALL_GATHER, Collective.REDUCE_SCATTER))
    return fwd, bwd


def _recompute_time(ct: CompiledTable, layout: Layout, kind: BlockKind, t: np.ndarray, tp_f: float,
                    cp_f: float, ep_f: float = 0.0) -> float:
    """Seconds of forward rerun in backward, as the runtime checkpoints (passes/rewrite.py
    `_checkpointed`, runtime/tensor_parallel.py `_checkpoint_forward`, runtime/stages.py): full
    reruns the whole layer, its TP all-reduces (RowParallelLinear o_proj and down_proj / out_proj),
    its CP collectives and its MoE dispatch / combine all-to-alls (`ep_f`) included; selective reruns the attention module / Mamba-2 mixer, whose
    forward holds one TP all-reduce (o_proj / out_proj) and all the CP collectives (the K/V
    all-gather of cp_attention.py, the halo and state all-gathers of cp_mamba.py)."""
    blk = ct.block(kind)
    if kind is not BlockKind.LAYER or layout.recompute is Recompute.NONE:
        return 0.0
    fwd = blk.fwd if len(t) else np.zeros(0, dtype=bool)
    if layout.recompute is Recompute.FULL:
        return float(t[fwd].sum()) + tp_f + cp_f + ep_f
    spec = ct.spec
    inside = sharding.row_parallel_count(spec, BlockKind.LAYER, under=selective_module(spec))
    return float(t[fwd & blk.rerun].sum()) + tp_f * inside / max(1, sharding.row_parallel_count(spec, kind)) + cp_f


def block_time(ct: CompiledTable, hw: DeviceProfile, layout: Layout, kind: BlockKind, *,
               seq_len: int) -> BlockTime:
    """One instance of block `kind` (one layer / the embedding / the head), one micro-batch. Memoised
    on what it depends on (the mesh's tp, cp and ep, not its dp nor pp: every group it prices is
    tp, cp or ep; not ZeRO, the schedule, nor the choices of the other blocks): the planner asks for
    it for many layouts that share those."""
    return block_times(ct, hw, (layout,), kind, seq_len=seq_len)[0]


def block_times(ct: CompiledTable, hw: DeviceProfile, layouts: Sequence[Layout], kind: BlockKind, *,
                seq_len: int) -> list[BlockTime]:
    """`block_time` of each of `layouts`; those not memoised yet are priced together, the node times of
    the ones that share a micro-batch and precision in one numpy pass (`_node_times_many`). The node
    times are memoised too (they do not depend on the recompute level)."""
    memo = ct.block(kind).shaped.at(seq_len)
    layer = kind is BlockKind.LAYER  # only a layer recomputes: the others' times are the same at every level
    keys = [(_node_key(hw, lay, kind, seq_len), lay.recompute if layer else Recompute.NONE) for lay in layouts]
    memo_node_times(ct, hw, kind, {node: lay for (node, rec), lay in zip(keys, layouts)
                                   if (node, rec) not in memo and node not in memo}, seq_len=seq_len)
    for key, lay in zip(keys, layouts):
        if key not in memo:
            memo[key] = _block_time(ct, hw, lay, kind, seq_len, memo[key[0]])
    return [memo[key] for key in keys]


def memo_node_times(ct: CompiledTable, hw: DeviceProfile, kind: BlockKind, todo: dict, *, seq_len: int) -> None:
    """Memoise the node times (`_node_times`) of block `kind` for each key of `todo` ({`node_key`: a layout with
    that key}) not memoised yet, those of the layouts that share a micro-batch and precision in one numpy pass
    (`_node_times_many`); `ct.block(kind).shaped.at(seq_len)[key]` then holds them."""
    memo = ct.block(kind).shaped.at(seq_len)
    groups: dict = {}  # (micro-batch, precision) -> {node times key: layout}
    for node, lay in todo.items():
        if node not in memo:
            groups.setdefault((lay.micro_batch, lay.numerics), {})[node] = lay
    for group in groups.values():
        for node, t in zip(group, _node_times_many(ct, hw, tuple(group.values()), kind, seq_len)):
            memo[node] = t


def _node_key(hw: DeviceProfile, layout: Layout, kind: BlockKind, seq_len: int) -> tuple:
    """What a block's node times depend on; its `block_time` depends on the recompute level too."""
    return node_key(hw, node_stem(layout, kind), seq_len)


def node_stem(layout: Layout, kind: BlockKind) -> tuple:
    """What of `layout` block `kind`'s node times depend on (`node_key` adds the device and the sequence length):
    the same for every plan, so the planner keeps it over plans (passes/solve/bounds.py)."""
    mesh = layout.mesh
    return (mesh.tp, mesh.cp, mesh.ep, layout.micro_batch, layout.numerics, layout.sequence_parallel,
            sharding.block_strategies(layout.strategies, kind), layout.moe_imbalance)


def node_key(hw: DeviceProfile, stem: tuple, seq_len: int) -> tuple:
    """The memo key of the node times of a block whose layout has `node_stem` `stem`."""
    return ("node_times", hw, *stem, seq_len)


def _block_time(ct: CompiledTable, hw: DeviceProfile, layout: Layout, kind: BlockKind, seq_len: int,
                t: np.ndarray) -> BlockTime:
    """`block_time` from the block's node times `t` (`_node_times`)."""
    blk = ct.block(kind)
    fwd, bwd = fwd_bwd_s(blk, t)
    cp_f, cp_b = _cp_comm(ct, hw, layout, kind, seq_len)
    if layout.sequence_parallel and layout.mesh.tp > 1:
        tp_f, tp_b = _sequence_tp_comm(ct, hw, layout, kind, seq_len, t)
    else:
        tp_f, tp_b = _tp_comm(ct, hw, layout, kind, seq_len)
        if kind is BlockKind.LAYER and tp_b > 0:
            n = sharding.row_parallel_count(ct.spec, BlockKind.LAYER)
            tp_b = _tp_backward_exposed(blk, t, tp_b / n, n)
    ep_f, ep_b = (0.0, 0.0) if kind is not BlockKind.LAYER else moe_cost.ep_comm_time(
        hw, ct.spec, layout.mesh, tokens=_tokens(layout, seq_len), imbalance=layout.moe_imbalance,
        act_bytes=layout.numbers.act_bytes)
    return BlockTime(fwd_s=fwd, bwd_s=bwd, recompute_s=_recompute_time(ct, layout, kind, t, tp_f, cp_f, ep_f),
                     tp_comm_s=tp_f + tp_b, cp_comm_s=cp_f + cp_b, ep_comm_s=ep_f + ep_b)


def fwd_bwd_s(blk: CompiledBlock, t: np.ndarray) -> tuple[float, float]:
    """(forward, backward) seconds of a block instance from its node times `t` (`BlockTime.fwd_s`, `bwd_s`)."""
    if not len(t):
        return 0.0, 0.0
    return float(t[blk.fwd].sum()), float(t[~blk.fwd].sum())


def _sequence_tp_comm(ct: CompiledTable, hw: DeviceProfile, layout: Layout, kind: BlockKind, seq_len: int,
                      t: np.ndarray) -> tuple[float, float]:
    """(forward, exposed backward) TP seconds under sequence parallelism (passes/cost/sequence_cost.py),
    with Mamba-2's gated-norm sync in a layer when its groups are kept whole (as without SP)."""
    tp = layout.mesh.tp
    sync = _group_sync(ct, hw, layout, seq_len) if kind is BlockKind.LAYER else 0.0
    small = best_time(hw, Collective.ALL_REDUCE, _tokens(layout, seq_len) * 3 * 4, size=tp, stride=1)
    act = _tokens(layout, seq_len) * ct.spec.hidden * layout.numbers.act_bytes
    comm = sequence_cost.tp_comm(ct.spec, hw, kind=kind, tp=tp, act_bytes=act, small_all_reduce_s=small,
                                 recompute=layout.recompute)
    hidden = sum(_tp_backward_exposed(ct.block(kind), t, s, n) for s, n in comm.backward_overlapped if n)
    return comm.forward + sync, hidden + comm.backward_exposed + sync


def _tp_backward_exposed(blk: CompiledBlock, t: np.ndarray, all_reduce_s: float, count: int) -> float:
    """Backward TP all-reduces left on the critical path: each input-gradient all-reduce of a
    column-parallel group (attention's q/k/v, the MLP's gate/up, Mamba-2's in_proj) runs while the
    same group's weight-gradient GEMMs compute (Megatron-LM's async tensor-parallel all-reduce,
    `LinearWithGradAccumulationAndAsyncCommunication`: dgrad all-reduce overlapped with wgrad), so
    only what outlasts them is exposed."""
    groups = list(blk.wgrad_groups.values())[:count]
    hidden = sum(max(0.0, all_reduce_s - float(t[mask].sum())) for mask in groups)
    return hidden + (count - len(groups)) * all_reduce_s


def block_activation_bytes(ct: CompiledTable, layout: Layout, kind: BlockKind, *, seq_len: int,
                           hw: DeviceProfile | None = None) -> float:
    """Bytes one block instance keeps for backward per micro-batch on one device (read off the
    joint graph's saved tensors; sharded by TP as above, by CP over tokens), after recompute; with
    `hw`, what the device's fused kernels save instead of the traced ops (passes/cost/fused_regions.py)."""
    blk = ct.block(kind)
    mesh, spec = layout.mesh, ct.spec
    if kind is BlockKind.LAYER and layout.recompute is Recompute.FULL:  # only the block input (a sequence shard
        shard = mesh.tp if layout.sequence_parallel else 1  # under sequence parallelism)
        return _tokens(layout, seq_len) * spec.hidden * layout.numbers.act_bytes / shard
    if not len(blk.fwd):
        return 0.0
    vals = blk.evaluate(layout.micro_batch, seq_len)
    if hw is not None:
        scale = _fused_scales(ct, hw, layout, kind, seq_len)[1]
    else:
        scale = layout.numbers.traced_scale
    saved = vals[2] * scale / _tp_divisor(blk, spec, mesh.tp, layout.sequence_parallel, layout.strategies) / mesh.cp
    if blk.expert is not None and mesh.ep > 1:  # worst case of dropless routing (passes/cost/moe_cost.py)
        saved = np.where(blk.expert, saved * moe_cost.expert_memory_factor(spec, mesh), saved)
    keep = blk.fwd.copy()
    if kind is BlockKind.LAYER and layout.recompute is Recompute.SELECTIVE:
        keep &= ~blk.rerun  # the checkpoint keeps the module's input: the norm's output, kept anyway
    total = float(saved[keep].sum())
    if kind is BlockKind.LAYER and mesh.cp > 1 and spec.family is Family.LLAMA:
        # the gathered K/V of the other CP ranks stay alive for the attention backward
        head_dim = spec.attention_head_dim
        kv_local = spec.kv_heads / sharding.parts(spec, "self_attn.k_proj", mesh.tp)
        total += 2 * layout.micro_batch * seq_len * kv_local * head_dim * layout.numbers.act_bytes * (mesh.cp - 1) / mesh.cp
    return total


def block_params(ct: CompiledTable, layout: Layout, kind: BlockKind) -> float:
    """Parameters of one instance of block `kind` held by one device (TP-sharded as the sharding
    table says, before ZeRO; of the routed experts, which the table keeps whole on every tp rank,
    the E/ep this ep rank holds)."""
    held = sharding.params_per_rank(ct.spec, kind, ct.block(kind).params, layout.mesh.tp, layout.strategies)
    if kind is BlockKind.LAYER and ct.spec.is_moe:
        held -= ct.spec.expert_params - expert_block_params(ct, layout, kind)
    return held


def expert_block_params(ct: CompiledTable, layout: Layout, kind: BlockKind) -> float:
    """The part of `block_params` that is routed experts (reduced and ZeRO-sharded over dp x cp)."""
    return moe_cost.expert_params(ct.spec, layout.mesh) if kind is BlockKind.LAYER else 0.0


def _dp_group(layout: Layout, *, experts: bool = False) -> int:
    """Ranks that reduce a gradient and share its ZeRO shards: dp x ep x cp for the dense parameters
    (the ep peers are data-parallel replicas), dp x cp for the routed experts."""
    mesh = layout.mesh
    return mesh.dp * mesh.cp * (1 if experts else mesh.ep)


def _sync_groups(params, layout: Layout, expert) -> tuple:
    """(parameters, group size, stride) of each gradient-sync group of a stage that holds `params`
    parameters, `expert` of them routed experts (runtime/dist_model.py GradSyncs): the dense ones
    over dp x ep x cp (stride tp), the experts over dp x cp, which spans the same ranks at ep times
    the spacing (stride ep*tp in the rank order (pp, dp, ep, cp, tp); exact for cp = 1). One group
    when ep = 1."""
    tp, ep = layout.mesh.tp, layout.mesh.ep
    if ep == 1 or not np.any(expert):
        return ((params, _dp_group(layout), tp),)
    return ((params - expert, _dp_group(layout), tp), (expert, _dp_group(layout, experts=True), ep * tp))


def _group_time(hw: DeviceProfile, op: Collective, groups: tuple, per_param: float):
    """Seconds of `op` over every sync group, one after the other (they share the device's links)."""
    return sum(best_time(hw, op, p * per_param, size=n, stride=s) for p, n, s in groups)


def _zeros_like(x):
    return np.zeros_like(x, dtype=float) if isinstance(x, np.ndarray) else 0.0


def state_bytes(params: float, layout: Layout, *, expert: float = 0.0) -> MemoryBreakdown:
    """Weights, gradients and optimizer state of `params` parameters under the ZeRO level,
    sharded over the dp x ep x cp group (Rajbhandari et al. 2020, ZeRO, sec. 5), the `expert` of
    them that are routed experts over dp x cp; none of it on the device under offload (FSDP2's
    CPUOffloadPolicy keeps the ZeRO-3 shards in host memory). What a rank keeps between steps; the
    transient ZeRO-2 adds while a step runs is `zero2_staging_bytes`."""
    if layout.offload:  # the shards live in host memory; a block is gathered on the device as it runs (buffer_bytes)
        return MemoryBreakdown(weights=0.0, grads=0.0, optimizer=0.0)
    groups, z, nb = _sync_groups(params, layout, expert), layout.zero, layout.numbers

    def held(per_param: float, level: int):
        return sum(p * per_param / (n if z >= level else 1.0) for p, n, _ in groups)

    if z == 3:  # FSDP2 (runtime/zero3.py): the fp32 shard is the master, the optimizer keeps Adam m, v
        return MemoryBreakdown(weights=held(nb.sharded_weight_bytes, 3), grads=held(nb.grad_bytes, 3),
                               optimizer=held(nb.optim_bytes - nb.master_bytes, 3))
    return MemoryBreakdown(weights=params * nb.param_bytes, grads=held(nb.grad_bytes, 2),
                           optimizer=held(nb.optim_bytes, 1))


def zero2_staging_bytes(params, layout: Layout, *, expert=0.0):
    """ZeRO-2's gradient staging during a micro-batch's backward (runtime/data_parallel.py GradSync; DeepSpeed
    stage 2's double-buffered `ipg_buffer` under overlap_comm): each sync group holds at most two buckets'
    fp32 gradients at once (`gradient_bucket_params`), one filling while the other is reduce-scattered in
    place, never more than its own parameters. The other levels reduce inside the persistent gradient buffer."""
    if layout.zero != 2:
        return _zeros_like(params)
    return sum(np.minimum(p, 2 * _bucket_params(n)) * layout.numbers.grad_bytes
               for p, n, _ in _sync_groups(params, layout, expert))


def dp_exposed_time(hw: DeviceProfile, params, layout: Layout, *, backward_s, forward_s, expert=0.0):
    """Per-step gradient sync of one stage left on the critical path (numbers or numpy arrays), as
    Megatron-LM's distributed optimizer overlaps it (`overlap_grad_reduce`, `overlap_param_gather`):
    the gradient all-reduce / reduce-scatter behind the last micro-batch's backward, the all-gather
    of the updated weights behind the next step's first forward. `expert`: the routed-expert share
    of `params`, synced over its own group after the dense one (`_sync_groups`).

    Two limits on that overlap (`_dp_sync_exposed`): the gradients are reduced in buckets
    (`dp_bucket_params`), and the bucket holding the first layers is only ready when the backward
    ends (the weights' first bucket is needed before the forward starts), so at least one bucket's
    collective is always exposed; and with v model chunks per rank (interleaved pipelines) a
    chunk's gradients are final when its last backward runs, which for all but the rank's first
    chunk is long before the drain ends: only the first chunk's share (1/v of the bytes, behind
    1/v of the backward) is left over."""
    groups = _sync_groups(params, layout, expert)
    if layout.zero == 3 or all(n == 1 for _, n, _ in groups):
        return _zeros_like(backward_s)
    nb = layout.numbers
    if layout.zero == 0:
        return _dp_sync_exposed(hw, Collective.ALL_REDUCE, groups, nb.grad_bytes, layout, overlap_s=backward_s)
    ag = _dp_sync_exposed(hw, Collective.ALL_GATHER, groups, nb.param_bytes, layout, overlap_s=forward_s)
    rs = 0.0 if layout.zero == 2 else _dp_sync_exposed(hw, Collective.REDUCE_SCATTER, groups, nb.grad_bytes, layout,
                                                       overlap_s=backward_s)
    return rs + ag


def dp_bucket_params(layout: Layout, *, experts: bool = False) -> float:
    """Parameters per gradient bucket of the data-parallel sync: Megatron-Core's DDP default
    max(40M, 1M x data-parallel size) (megatron/core/distributed/distributed_data_parallel.py:
    the bucket grows with the group so that the ring's per-rank latency stays amortised);
    `experts`: of the routed experts' group (dp x cp)."""
    return _bucket_params(_dp_group(layout, experts=experts))


def _bucket_params(group: int) -> float:
    return float(gradient_bucket_params(group))


def _dp_sync_exposed(hw: DeviceProfile, op: Collective, groups: tuple, bytes_per_param: float, layout: Layout, *,
                     overlap_s):
    """Exposed seconds of one data-parallel collective over a stage's sync `groups` (`_sync_groups`; see
    `dp_exposed_time`): the rank's first chunk (1/v of the parameters) against 1/v of the compute it
    overlaps, each group in its buckets (`bucketed_time`), and never less than that chunk's last
    bucket (the larger of the groups' last buckets)."""
    v = layout.virtual_stages
    whole = sum(bucketed_time(hw, op, p / v, bytes_per_param, size=n, stride=s) for p, n, s in groups)
    # a group of one rank costs a scalar 0 beside the others' arrays: broadcast, not stack
    last = functools.reduce(np.maximum, [np.asarray(best_time(hw, op, np.minimum(p / v, _bucket_params(n)) *
                                                              bytes_per_param, size=n, stride=s)) for p, n, s in groups])
    out = np.maximum(last, whole - overlap_s / v)
    return out if isinstance(out, np.ndarray) and out.ndim else float(out)


def bucketed_time(hw: DeviceProfile, op: Collective, params, bytes_per_param: float, *, size: int, stride: int):
    """Seconds of a data-parallel collective over `params` parameters run as Megatron runs it, one
    collective per bucket of max(40M, 1M x size) parameters (`dp_bucket_params`), each paying the
    ring's (N - 1) step latencies: the step's gradient sync (numbers or numpy arrays)."""
    buckets = np.maximum(1.0, np.ceil(params / _bucket_params(size)))
    return buckets * best_time(hw, op, params / buckets * bytes_per_param, size=size, stride=stride)


def zero2_time(hw: DeviceProfile, params: float, layout: Layout, *, expert: float = 0.0) -> float:
    """ZeRO-2 communication of one micro-batch of one stage: the reduce-scatter of its gradients
    (runtime/data_parallel.py drops the full gradient after each micro-batch, DeepSpeed stage 2);
    it overlaps that micro-batch's backward."""
    if layout.zero != 2:
        return 0.0
    return _group_time(hw, Collective.REDUCE_SCATTER, _sync_groups(params, layout, expert), layout.numbers.grad_bytes)


def zero3_time(hw: DeviceProfile, params: float, layout: Layout, *, expert: float = 0.0, blocks=1) -> float:
    """ZeRO-3 communication of one micro-batch of one stage: all-gather the weights in forward
    and again in backward, reduce-scatter the gradients, one collective of each per block (FSDP2
    wraps every transformer block, the embedding and the head: `blocks` of them, each paying the
    ring's (N - 1) step latencies; NCCL has no tree for these, `hw.log_collectives`)."""
    if layout.zero != 3:
        return 0.0
    k = np.maximum(1.0, blocks)
    groups, nb = [(p / k, n, st) for p, n, st in _sync_groups(params, layout, expert)], layout.numbers
    return k * (2 * _group_time(hw, Collective.ALL_GATHER, groups, nb.gather_bytes)
                + _group_time(hw, Collective.REDUCE_SCATTER, groups, nb.grad_bytes))


def _shard(params, layout: Layout, expert):
    """Parameters of this device's ZeRO shard (ZeRO >= 1)."""
    return sum(p / n for p, n, _ in _sync_groups(params, layout, expert))


def offload_time(hw: DeviceProfile, params: float, layout: Layout, *, expert: float = 0.0) -> float:
    """Host-link traffic of one micro-batch of one stage under offload (ZeRO-Offload, arXiv 2101.06840,
    sec. 4; FSDP2 CPUOffloadPolicy): this device's weight shard copied host -> device before each of
    ZeRO-3's two gathers, its gradient shard device -> host after the reduce-scatter."""
    if not layout.offload:
        return 0.0
    link = _host(hw, "host_link_bandwidth")
    return _shard(params, layout, expert) * (2 * layout.numbers.sharded_weight_bytes + layout.numbers.grad_bytes) / link


def _host(hw: DeviceProfile, field: str) -> float:
    value = getattr(hw, field)
    if value is None:
        raise InvalidConfigError(f"hardware profile {hw.name!r} has no {field}: optimizer offload cannot be priced "
                                 f"there; add {field} (bytes/s, with its source) to the profile or plan without offload")
    return value


def zero_exposed_time(hw: DeviceProfile, params, layout: Layout, *, compute_s, backward_s, expert=0.0, blocks=1):
    """ZeRO traffic of one micro-batch of one stage that its own work does not hide: ZeRO-3's
    weight gathers and gradient reduce-scatter (and under offload their host copies) behind its
    compute, ZeRO-2's gradient reduce-scatter behind its backward (numbers or numpy arrays;
    `expert`: the routed-expert share of `params`; `blocks`: the stage's FSDP units, layers,
    embedding and head, one ZeRO-3 collective each)."""
    z3 = (zero3_time(hw, params, layout, expert=expert, blocks=blocks)
          + offload_time(hw, params, layout, expert=expert))
    return (np.maximum(0.0, z3 - compute_s)
            + np.maximum(0.0, zero2_time(hw, params, layout, expert=expert) - backward_s))


def optimizer_time(hw: DeviceProfile, params: float, layout: Layout, *, expert: float = 0.0) -> float:
    """Adam on this device's shard: memory-bound, OPTIM_TRAFFIC bytes per parameter (under offload
    on the host, at the host memory bandwidth per device)."""
    shard = _shard(params, layout, expert) if layout.zero >= 1 else params
    if layout.offload:
        return shard * OPTIM_TRAFFIC / (_host(hw, "host_memory_bandwidth") * hw.vector_efficiency)
    return shard * OPTIM_TRAFFIC / (hw.hbm_bandwidth * hw.vector_efficiency)


def p2p_time(ct: CompiledTable, hw: DeviceProfile, layout: Layout, *, seq_len: int) -> float:
    """Stage-to-stage traffic of one micro-batch on the critical path: the activation forward and
    its gradient back. 1F1B / GPipe (v = 1): blocking sends (Megatron's send_forward_recv_backward),
    all of it. With v > 1 chunks per rank each micro-batch crosses v times as many boundaries, but
    Megatron-Core's interleaved schedule posts them asynchronously (`overlap_p2p_comm`, on in its
    interleaved recipes): each send runs while the next chunk computes, so only what outlasts one
    chunk's forward (backward) compute is exposed (`_chunk_compute`). autoshard's runtime (torch
    pipelining) waits for each step's sends: it is slower than this when p2p outlasts compute."""
    if layout.mesh.pp == 1:
        return 0.0
    terms = p2p_terms(hw, layout)
    fwd, bwd = (0.0, 0.0) if terms[-1] == 1 else _chunk_compute(ct, hw, layout, seq_len)
    return float(p2p_seconds(ct, *terms, fwd, bwd, seq_len=seq_len))


def p2p_terms(hw: DeviceProfile, layout: Layout) -> tuple:
    """What `p2p_time` reads of a pipelined (pp > 1) `layout` besides the chunk compute, which does not depend on
    the shape: (micro-batch, cp, activation bytes per value, the shard the stages exchange (tp under sequence
    parallelism, else 1), the send's link latency and bandwidth, boundary crossings per micro-batch)."""
    mesh = layout.mesh
    link = group_link(hw, size=2, stride=mesh.dp * mesh.ep * mesh.cp * mesh.tp)  # a send: collective_time's link
    return (layout.micro_batch, mesh.cp, layout.numbers.act_bytes, mesh.tp if layout.sequence_parallel else 1,
            link.latency, link.bandwidth, schedules.p2p_factor(layout.schedule, layout.virtual_stages))


def p2p_seconds(ct: CompiledTable, micro_batch, cp, act_bytes, shard, latency, bandwidth, crossings, fwd, bwd, *,
                seq_len: int):
    """`p2p_time` from its `p2p_terms` and the chunk's forward / backward compute (`_chunk_compute`, read only
    where crossings > 1); numbers or numpy arrays (the planner's bounds price many layouts at once)."""
    act = micro_batch * seq_len / cp * ct.spec.hidden * act_bytes / shard  # the sequence shard under SP (/ tp)
    send = (steps(Collective.SEND_RECV, 2) * latency  # collective_time(SEND_RECV) on the link's terms
            + volume(Collective.SEND_RECV, act, 2) / bandwidth)
    # blocking sends (v = 1) both ways; interleaving: v x the sends, each exposed beyond a chunk's compute
    return np.where(crossings == 1, 2 * send, crossings * (np.maximum(0.0, send - fwd) + np.maximum(0.0, send - bwd)))


def sequence_boundary_time(ct: CompiledTable, hw: DeviceProfile, layout: Layout, *, seq_len: int,
                           boundaries: int) -> float:
    """A sequence-parallel stage of a pipeline whose stages differ in sequence parallelism, per
    micro-batch: every boundary carries the whole (tokens, hidden) activation, so at each of its
    `boundaries` stage boundaries it all-gathers over tp (what it sends forward; the gradient of what
    it received, backward) and keeps its slice of the other direction for free
    (runtime/stages.py; Megatron-LM's gather / scatter_to_sequence_parallel_region). Blocking:
    on the critical path."""
    act = _tokens(layout, seq_len) * ct.spec.hidden * layout.numbers.act_bytes
    return boundaries * best_time(hw, Collective.ALL_GATHER, act, size=layout.mesh.tp, stride=1)


def _chunk_compute(ct: CompiledTable, hw: DeviceProfile, layout: Layout, seq_len: int) -> tuple[float, float]:
    """(forward, backward) compute seconds of the smallest model chunk (layers // (pp x v) layers) for
    one micro-batch: what an asynchronous stage-to-stage send overlaps."""
    per_chunk = max(1, ct.spec.layers // (layout.mesh.pp * layout.virtual_stages))
    base = layout if layout.recompute is Recompute.NONE else replace(layout, recompute=Recompute.NONE)
    bt = block_time(ct, hw, base, BlockKind.LAYER, seq_len=seq_len)
    return per_chunk * bt.fwd_s, per_chunk * bt.bwd_s


def logits_bytes(ct: CompiledTable, layout: Layout, *, seq_len: int, hw: DeviceProfile | None = None) -> float:
    """Transient peak of the loss on the head stage (vocab-parallel over TP, tokens split over CP),
    beyond the fp32 log-softmax the graph saves: the logits the LM head writes (activation bytes:
    2 B in bf16). runtime/loss.py's in-place cross-entropy (Megatron-LM's fused vocab-parallel one)
    holds them and one fp32 copy, which becomes the log-softmax it keeps (the graph's log-softmax bytes)
    and then the gradient, on every device; `hw` resolves an AUTO precision."""
    precision = layout.precision if hw is None else resolve_precision(layout.precision, hw)
    per_value = 2.0 if precision is Precision.AUTO else precision_numbers(precision).act_bytes
    vocab_parallel = sharding.vocab_parallel(ct.spec, BlockKind.HEAD, layout.strategies)
    return _tokens(layout, seq_len) * ct.spec.vocab / (layout.mesh.tp if vocab_parallel else 1) * per_value


def pipeline_time(stage_times: Sequence[float], microbatches: int, *, schedule: str = "1f1b",
                  virtual_stages: int = 1) -> float:
    """Pipeline makespan: every stage runs all micro-batches, the slowest stage sets the pace, and
    fill/drain costs a fraction f of one pass through the other stages (rules/schedules.py):
    m * max(t) + f * (sum(t) - max(t)). 1F1B / GPipe f = 1: sum(t) + (m - 1) max(t), with equal
    stages (m + p - 1) t, the bubble (p - 1)/(m + p - 1) (arXiv 2104.04473); interleaved f = 1/v;
    zero-bubble (ZB-H1) f = 1/3."""
    f = float(schedules.bubble_fraction(schedule, virtual_stages, microbatches=microbatches, pp=len(stage_times)))
    top = max(stage_times)
    return float(microbatches * top + f * (sum(stage_times) - top))


def model_flops_per_token(ct: CompiledTable, seq_len: int) -> float:
    """Training FLOPs per token in the paper's MFU convention: 6N + 12 L d s for LLaMA
    (PaLM, arXiv 2204.02311 app. B), N the parameters a token meets (a mixture of experts: its
    top-k experts only, Megatron-Core's MoE convention); for Mamba-2, 6N plus 3x the SSD forward
    FLOPs of arXiv 2405.21060 sec. 8.3 per token."""
    spec = ct.spec
    if ct.kinds:  # a mixed stack: 12 d s per attention layer, the SSD per Mamba-2 layer (read off its graph)
        n = sum(v.block(BlockKind.LAYER).params * v.block(BlockKind.LAYER).count for v in ct.kinds) + sum(
            ct.block(k).params for k in (BlockKind.EMBED, BlockKind.HEAD))
        attention, mamba = ct.mixers
        return 6.0 * n + 12.0 * attention * spec.hidden * seq_len + (3.0 * _ssd_flops(spec, seq_len) * mamba if mamba else 0.0)
    n = moe_cost.active_params_per_token(spec, sum(blk.params * blk.count for blk in ct.blocks.values()))
    if spec.family is Family.LLAMA:
        return 6.0 * n + 12.0 * spec.layers * spec.hidden * seq_len
    return 6.0 * n + 3.0 * _ssd_flops(spec, seq_len) * spec.layers


def _ssd_flops(spec: ModelSpec, seq_len: int) -> float:
    """Forward FLOPs per token of one Mamba-2 layer's SSD (arXiv 2405.21060 sec. 8.3)."""
    h, p, nst = spec.heads, spec.head_dim, spec.state
    chunk = min(spec.chunk, seq_len)
    return 2 * (h * chunk * nst + h * chunk * p + h * p * nst + h * p * nst / chunk + h * p * nst)


# --------------------------------------------------------------------------------------------
# Composition


def resolved(layout: Layout, hw: DeviceProfile) -> Layout:
    """`layout` with precision AUTO replaced by the device's default (fp32 on cpu, else bf16-mixed)."""
    if layout.precision is not Precision.AUTO:  # concrete already (resolve_precision would keep it)
        return layout
    return replace(layout, precision=resolve_precision(layout.precision, hw))


def estimate(table: CostTable | CompiledTable, spec: ModelSpec, hw: DeviceProfile, layout: Layout, *,
             global_batch: int, seq_len: int, stages: Sequence[Stage] | None = None) -> Estimate:
    """Predicted step time, throughput, MFU and peak memory of one layout (see module docstring)."""
    ct = compile_table(table, spec)
    layout = resolved(layout, hw)
    mesh = layout.mesh
    _check(spec, layout, global_batch, seq_len)
    m = layout.microbatches(global_batch)
    if stages is None:
        stages = even_stages(spec.layers, mesh.pp, recompute=layout.recompute)
    stages = tuple(stages)
    if len(stages) != mesh.pp or sum(st.layers for st in stages) != spec.layers:
        raise InvalidConfigError(f"{len(stages)} stages with {sum(st.layers for st in stages)} layers given; "
                                 f"expected pp={mesh.pp} stages covering all {spec.layers} layers")
    levels = {st.recompute: replace(layout, recompute=st.recompute) for st in stages}  # each stage's own
    for lay in levels.values():
        why = mixed_violation(ct, lay)
        if why:
            raise InvalidConfigError(why)
    bts: dict = {}  # (recompute, kind's table, block) -> its numbers, asked as the stages hold them
    p2p = p2p_time(ct, hw, layout, seq_len=seq_len)

    times, parts, peaks = [], [], []
    for i, st in enumerate(stages):
        lay = levels[st.recompute]
        held = stage_blocks(ct, st)
        for view, k, _ in held:
            if (st.recompute, id(view), k) not in bts:
                bts[st.recompute, id(view), k] = (block_time(view, hw, lay, k, seq_len=seq_len),
                                                  block_activation_bytes(view, lay, k, seq_len=seq_len, hw=hw),
                                                  block_params(view, layout, k),
                                                  expert_block_params(view, layout, k))
        counts = [(bts[st.recompute, id(view), k], c) for view, k, c in held]
        bt = [(b[0], c) for b, c in counts]
        if st.head and spec.tied and not st.embed:
            counts_params = block_params(ct, layout, BlockKind.EMBED)  # tied LM head keeps a copy of the embedding
        else:
            counts_params = 0.0
        params = sum(b[2] * c for b, c in counts) + counts_params
        experts = sum(b[3] * c for b, c in counts)  # the routed-expert share of `params` (MoE)
        comp = sum(b.compute_s * c for b, c in bt)
        reco = sum(b.recompute_s * c for b, c in bt)
        tpc = sum(b.tp_comm_s * c for b, c in bt)
        cpc = sum(b.cp_comm_s * c for b, c in bt)
        epc = sum(b.ep_comm_s * c for b, c in bt)
        bwd_last = sum(b.bwd_s * c for b, c in bt)
        fwd_first = sum(b.fwd_s * c for b, c in bt)
        zexp = float(zero_exposed_time(hw, params, layout, compute_s=comp, backward_s=bwd_last, expert=experts,
                                       blocks=sum(c for _, c in counts)))
        t = comp + reco + tpc + cpc + epc + p2p + zexp
        times.append(t)
        parts.append((comp, reco, tpc, cpc, epc, p2p, zexp, params, experts, bwd_last, fwd_first))
        in_flight = schedules.in_flight(layout.schedule, i, mesh.pp, m, layout.virtual_stages)
        stage_act = sum(b[1] * c for b, c in counts) * in_flight
        mem = state_bytes(params, layout, expert=experts)
        buffers = buffer_bytes(ct, layout, seq_len=seq_len) + zero2_staging_bytes(params, layout, expert=experts)
        logit = logits_bytes(ct, layout, seq_len=seq_len, hw=hw) if st.head else 0.0
        peaks.append(MemoryBreakdown(weights=mem.weights, grads=mem.grads, optimizer=mem.optimizer,
                                     activations=stage_act, logits=logit, buffers=float(buffers)))

    slow = int(np.argmax(times))
    comp, reco, tpc, cpc, epc, p2p_s, zexp = parts[slow][:7]
    pipe = pipeline_time(times, m, schedule=layout.schedule, virtual_stages=layout.virtual_stages)
    # DP sync and the optimizer step are per stage and run in parallel across stages: take the
    # stage where they end last. The gradient reduce overlaps the last micro-batch's backward,
    # the weight all-gather the first forward (`dp_exposed_time`).
    tail = []
    for (*_, prm_i, exp_i, bwd_last, fwd_first) in parts:
        exposed = float(dp_exposed_time(hw, prm_i, layout, backward_s=bwd_last, forward_s=fwd_first, expert=exp_i))
        tail.append((exposed, optimizer_time(hw, prm_i, layout, expert=exp_i)))
    dp_exposed, opt = max(tail, key=lambda x: x[0] + x[1])
    step = pipe + dp_exposed + opt
    breakdown = TimeBreakdown(compute=comp * m, recompute=reco * m, tp_comm=tpc * m, cp_comm=cpc * m, ep_comm=epc * m,
                              p2p=p2p_s * m, pp_bubble=pipe - m * (comp + reco + tpc + cpc + epc + p2p_s + zexp),
                              dp_comm_exposed=dp_exposed + zexp * m, optimizer=opt)
    peak = max(peaks, key=lambda mb: mb.total)
    tokens = global_batch * seq_len
    mfu = model_flops_per_token(ct, seq_len) * tokens / (step * mesh.size * hw.peak_flops)
    return Estimate(layout=layout, step_time_s=step, tokens_per_s=tokens / step, mfu=mfu,
                    memory_gb=peak.total / 1e9, mean_memory_gb=sum(mb.total for mb in peaks) / len(peaks) / 1e9,
                    memory=peak, fits=peak.total <= hw.memory_bytes,
                    time=breakdown, microbatches=m, stages=stages, stage_times_s=tuple(times),
                    stage_memory_gb=tuple(mb.total / 1e9 for mb in peaks))


def buffer_bytes(ct: CompiledTable, layout: Layout, *, seq_len: int) -> float:
    """Communication staging: two activation-sized TP/p2p buffers, and the gathered weights of
    one layer in flight (twice, prefetch) under ZeRO-3."""
    return staging_bytes(ct, *buffer_terms(ct, layout), seq_len=seq_len)


def buffer_terms(ct: CompiledTable, layout: Layout) -> tuple:
    """What `buffer_bytes` reads of `layout`, which does not depend on the shape: (micro-batch, cp, activation
    bytes per value, whether the TP / p2p buffers exist, ZeRO-3's gathered-weight bytes)."""
    z3 = 0.0
    if layout.zero == 3:
        z3 = 2 * block_params(ct, layout, BlockKind.LAYER) * layout.numbers.gather_bytes
    return layout.micro_batch, layout.mesh.cp, layout.numbers.act_bytes, layout.mesh.tp > 1 or layout.mesh.pp > 1, z3


def staging_bytes(ct: CompiledTable, micro_batch, cp, act_bytes, staged, z3, *, seq_len: int):
    """`buffer_bytes` from its `buffer_terms` (numbers, or numpy arrays of them: the planner's bounds price
    many layouts at once, with the same float operations)."""
    act = micro_batch * seq_len / cp * ct.spec.hidden * act_bytes  # _tokens(layout, seq_len) * hidden * bytes
    return 2 * act * staged + z3


def _check(spec: ModelSpec, layout: Layout, global_batch: int, seq_len: int) -> None:
    """The plan validator's rules (rules/validity.py), ZeRO-3 included: the cost model prices it."""
    why = plan_violation(spec, layout.mesh, global_batch=global_batch, seq_len=seq_len,
                         micro_batch=layout.micro_batch, zero=layout.zero, zeros=(0, 1, 2, 3),
                         sequence_parallel=layout.sequence_parallel, strategies=layout.strategies)
    if why:
        raise InvalidConfigError(why)
    mesh = layout.mesh
    check_schedule(layout.schedule, layout.virtual_stages, pp=mesh.pp)
    schedules.check_chunks(layout.schedule, layout.virtual_stages, pp=mesh.pp, layers=spec.layers,
                           microbatches=layout.microbatches(global_batch))


# Pieces the inference cost model (passes/serving/inference_cost.py) prices forward passes with.
node_times = _node_times
tp_comm_times = _tp_comm
tp_divisor = _tp_divisor
