"""Inference cost model: time to first token, time per output token and memory of a serving layout.

Contract
--------
`estimate_serving(table, hw, layout, *, prompt_len, output_len) -> ServeEstimate`

The whole contract: docs/modules/serving.md (passes/serving/inference_cost.py).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import sympy

from autoshard.errors import InvalidConfigError
from autoshard.hardware import DeviceProfile
from autoshard.cost_table import B, S, CostTable, attention_modules, degree_in_s, is_scan_op
from autoshard.ir import BlockKind, Mesh, Stage, even_stages, is_positive_int
from autoshard.model_spec import Mixer, ModelSpec
from autoshard.passes.cost.collectives import Collective, best_time, collective_time
from autoshard.rules.ranks import group_stride
from autoshard.ir import Precision
from autoshard.passes.cost.block import block_params, expert_block_params
from autoshard.passes.cost.compiled import CompiledTable, compile_table, priced_nodes
from autoshard.passes.cost.cost import node_times, tp_comm_times, tp_divisor
from autoshard.passes.cost.layout import Layout
from autoshard.rules import sharding
from autoshard.passes.cost.precision import precision_numbers

_SERVE = precision_numbers(Precision.BF16_MIXED)  # bf16 weights and activations (passes/cost/precision.py)
ACT_BYTES, PARAM_BYTES = _SERVE.act_bytes, _SERVE.param_bytes

C = sympy.Symbol("c", positive=True, integer=True)  # context length: tokens already in the cache
KV_BYTES = 2.0  # bf16 K/V cache and conv state (the model's dtype, as HF's DynamicCache stores them)
SSM_STATE_BYTES = 4.0  # fp32 SSM state: HF Mamba-2 keeps the chunk scan's float32 final state (measured)
LOGIT_BYTES = 4.0  # fp32 logits of the last position (HF generate casts them to float32)


@dataclass(frozen=True, slots=True, kw_only=True)
class ServeLayout:
    """One serving configuration: tp x pp per replica, `replicas` of them, `batch` sequences each."""

    tp: int = 1
    pp: int = 1
    replicas: int = 1
    batch: int = 1
    ep: int = 1  # mixture of experts: the experts of each layer split over ep ranks of the replica

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "replicas", "batch", "ep"):
            value = getattr(self, name)
            if not is_positive_int(value):
                raise InvalidConfigError(f"{name} must be a positive integer, got {value!r}")

    @property
    def devices(self) -> int:
        return self.tp * self.pp * self.ep * self.replicas

    @property
    def shape(self) -> str:
        """One replica's layout, as the CLI prints it: tp2 pp1 (ep2)."""
        return f"tp{self.tp} pp{self.pp}" + (f" ep{self.ep}" if self.ep > 1 else "")

    def as_dict(self) -> dict[str, int]:
        return {"tp": self.tp, "pp": self.pp, "ep": self.ep, "replicas": self.replicas, "batch": self.batch}


@dataclass(frozen=True, slots=True, kw_only=True)
class PhaseTime:
    """Seconds of one forward (a prefill, or one decode step) through a whole replica."""

    compute: float  # roofline of the table's nodes (weights read, GEMMs, vector ops)
    core: float  # decode only: attention over the KV cache / the Mamba-2 recurrent step
    tp_comm: float
    pp_comm: float  # stage-to-stage hops and the token broadcast
    ep_comm: float = 0.0  # ep > 1: the all-reduce of every MoE layer's output over the ep group
    fixed: float = 0.0  # the kernels' fixed cost beyond their bytes (`_floor_seconds`)
    step_inputs: float = 0.0  # tp > 1: the driver's broadcast of the step's inputs to its workers (`_step_input_seconds`)

    @property
    def total(self) -> float:
        return self.compute + self.core + self.tp_comm + self.pp_comm + self.ep_comm + self.fixed + self.step_inputs

    @property
    def per_step(self) -> float:
        """What a forward costs whatever it carries (kernel floors, the input broadcast): an engine
        iteration pays it once for every sequence and prompt it runs together."""
        return self.fixed + self.step_inputs

    def as_dict(self) -> dict[str, float]:
        return {"compute": self.compute, "core": self.core, "tp_comm": self.tp_comm, "pp_comm": self.pp_comm,
                "ep_comm": self.ep_comm, "fixed": self.fixed, "step_inputs": self.step_inputs}


@dataclass(frozen=True, slots=True, kw_only=True)
class ServeMemory:
    """Bytes on the busiest device."""

    weights: float
    cache: float  # KV cache (LLaMA) or conv + SSM state (Mamba-2)
    activations: float

    @property
    def total(self) -> float:
        return self.weights + self.cache + self.activations

    def as_gb(self) -> dict[str, float]:
        return {"weights": self.weights / 1e9, "cache": self.cache / 1e9, "activations": self.activations / 1e9}


@dataclass(frozen=True, slots=True, kw_only=True)
class ServeEstimate:
    layout: ServeLayout
    ttft_s: float
    tpot_s: float
    throughput_tokens_per_s: float  # output tokens per second over all replicas
    memory: ServeMemory
    fits: bool
    prefill: PhaseTime
    decode: PhaseTime  # one step at the mean context

    def to_json(self) -> dict[str, Any]:
        return {**self.layout.as_dict(), "ttft_s": self.ttft_s, "tpot_s": self.tpot_s,
                "throughput_tokens_per_s": self.throughput_tokens_per_s, "memory_gb": self.memory.total / 1e9,
                "memory_breakdown_gb": self.memory.as_gb(), "fits": self.fits,
                "prefill_breakdown_s": self.prefill.as_dict(), "decode_breakdown_s": self.decode.as_dict()}


@dataclass(frozen=True, slots=True, kw_only=True)
class InferenceTable:
    """The compiled training table plus, per block, which forward nodes inference runs and which of
    them are the sequence-mixing core that decode replaces; made once by `compile_inference_table`."""

    ct: CompiledTable
    core: dict  # BlockKind -> bool array: nodes decode prices by its own rule
    skip: dict  # BlockKind -> bool array: nodes inference does not run (the training loss)
    lookup: dict  # BlockKind -> bool array: table lookups (the embedding): read the rows asked, not the table
    paths: dict  # BlockKind -> tuple of module paths, per node (what `kernels_per_forward` counts by)
    attention_flops: Any  # lambdified (b, c) -> FLOPs of one decode step's attention, one layer (LLaMA)
    # the sequence mixers a layer holds, each as the spec of its numbers (ModelSpec.mixer_spec): the attention's
    # KV cache, the Mamba-2 conv + SSM state; none for a layer of per-token ops (Nemotron-H's MLP and MoE layers)
    mixers: tuple[ModelSpec, ...] = ()
    # a mixed stack (CompiledTable.kinds): the one-kind table of every layer kind (each layer's kind is
    # `ct.layer_kinds`); the embedding and head are read from this table, the layers through `layer_tables` /
    # `stage_layer_tables`
    kinds: tuple = ()
    # a recurrent mixer's state per sequence beside those (a gated DeltaNet's, a short convolution's, Mamba-1's: the
    # part's measured `state_bytes`, models/layered.py `recurrent_state_bytes`) and what tp divides it by, per tp
    state: tuple[float, Any] = (0.0, None)

    @property
    def spec(self) -> ModelSpec:
        return self.ct.spec

    def state_bytes(self, tp: int) -> float:
        """Bytes of one sequence's recurrent state (`state`) one tp rank holds for one layer of this kind."""
        nbytes, divisor = self.state
        return nbytes / divisor(tp) if nbytes else 0.0


def compile_inference_table(table: CostTable | InferenceTable, spec: ModelSpec) -> InferenceTable:
    from autoshard.rules.validity import refusal

    if isinstance(table, InferenceTable):
        return table
    why = refusal(spec, "inference")  # the facts refuse serving it (the rule "serving-refused" asks the same)
    if why:
        raise InvalidConfigError(why)
    ct = compile_table(table, spec, layers_compiled=True)  # priced as serving engines run it: their norms, RoPE and
    if not ct.kinds:                                       # SwiGLU fused (CUDA graphs and custom ops), any model
        return _kind_table(ct, table.blocks, spec)
    edges = [b for b in table.blocks if b.kind is not BlockKind.LAYER]
    kinds = tuple(_kind_table(view, (edges[0], blk, edges[1]), spec,
                              tuple(i for i, k in enumerate(table.layer_kinds) if k == blk.name))
                  for view, blk in zip(ct.kinds, table.layer_blocks()))
    return replace(kinds[0], ct=ct, kinds=kinds)


def _kind_table(ct: CompiledTable, blocks, stack: ModelSpec, layers: tuple[int, ...] = ()) -> InferenceTable:
    """The inference table of a one-kind table `ct` (its symbolic `blocks`): which nodes decode replaces (the
    sequence mixers' own ops, found on the graph: the module of an attention kernel or of eager attention's s x s
    matmuls (`cost_table.attention_modules`), its s x s ops; the module
    of the SSD scan / conv1d, all of its ops) and the specs of those mixers (`stack`'s numbers for its `layers`,
    ModelSpec.mixer_spec)."""
    ssd = stack.mixer_spec(Mixer.SSD) is not None
    core, skip, lookup, paths, attn, mixers, state = {}, {}, {}, {}, sympy.Integer(0), (), (0.0, None)
    for block in blocks:
        nodes = priced_nodes(block)  # the nodes compile_table keeps, in its order
        lookup[block.kind] = np.array([n.target == "aten.embedding.default" for n in nodes], dtype=bool)
        paths[block.kind] = tuple(n.module_path for n in nodes)
        fwd = [n for n in nodes if n.phase == "fwd"]
        attention = attention_modules(fwd)  # sdpa / flash, or eager attention's s x s matmuls
        kept = _state_part(stack, layers)  # a recurrent mixer's s x s blocks (MiniMax's lightning attention): no KV
        if kept is not None:
            at = f"{sharding.layer_prefix(stack, 0)}.{kept.path}"
            attention = {m for m in attention if m != at and not m.startswith(f"{at}.")}
        scans = {n.module_path.removesuffix(".conv1d") for n in fwd if is_scan_op(n, mamba2=ssd)}
        # only the s x s attention runs differently in decode; all of the SSD mixer's own ops do
        in_core = [(n.module_path in attention and degree_in_s(n.flops) >= 2) or n.module_path in scans for n in nodes]
        if block.kind is BlockKind.LAYER:
            attn = sum((n.flops.subs(S, 1) * C for n, c in zip(nodes, in_core)
                        if c and n.phase == "fwd" and n.module_path in attention), sympy.Integer(0))
            mixers = tuple(_mixer_spec(stack, m, block, layers) for m, held in ((Mixer.ATTENTION, attention), (Mixer.SSD, scans))
                           if held)
            state = _recurrent_state(stack, block, fwd, ssd, layers, kept)
        core[block.kind] = np.array(in_core, dtype=bool)
        skip[block.kind] = np.array([block.kind is BlockKind.HEAD and n.module_path == "" for n in nodes], dtype=bool)
    return InferenceTable(ct=ct, core=core, skip=skip, lookup=lookup, paths=paths, mixers=mixers, state=state,
                          attention_flops=sympy.lambdify((B, C), attn, modules=[np]))


def _mixer_spec(stack: ModelSpec, mixer: Mixer, block, layers: tuple[int, ...]) -> ModelSpec:
    spec = stack.mixer_spec(mixer, layers)
    if spec is None:
        raise InvalidConfigError(f"{stack.name}: the layers of kind {block.name!r} hold {mixer.value} but the model's "
                                 f"spec has no {mixer.value} numbers to price its cache from (ModelSpec.mixer_spec); "
                                 "read the spec off the model (autoshard.models.presets.resolve_model)")
    return spec


def _state_part(stack: ModelSpec, layers: tuple[int, ...]):
    """The part of the kind's layers (`layers`, its first) whose recurrent state was measured on HF's cache
    (`layered.recurrent_state_bytes`), or None."""
    first = layers[0] if layers else 0
    return next((p for p in stack.parts if first in p.layers and dict(p.sizes).get("state_bytes")), None)


def _recurrent_state(stack: ModelSpec, block, fwd, ssd: bool, layers: tuple[int, ...], part) -> tuple[float, Any]:
    """(bytes, tp divisor) of the recurrent state a layer's sequence mixer keeps beside attention's KV and Mamba-2's
    state (a convolution over the sequence that is no Mamba-2 SSD: Mamba-1's selective scan, a short convolution, a
    gated DeltaNet; or a mixer whose state HF keeps beside its layers' cache, MiniMax's lightning attention): its
    part's measured `state_bytes` (`part`: `_state_part` of the kind's layers), split over tp as its convolution's
    channels are (`sharding.node_divisor` at the kind's own first layer; a mixer with no convolution as its module
    is); (0, None) for none; a convolution with no measured state is refused by name."""
    conv = next((n for n in fwd if "convolution" in n.target), None)
    if ssd or (conv is None and part is None):
        return 0.0, None
    if part is None:
        raise InvalidConfigError(
            f"{stack.name}: {conv.module_path or block.name} mixes its sequence by a convolution that is no Mamba-2 "
            "SSD (Mamba-1's selective scan, a short convolution, gated DeltaNet) whose state per sequence could not "
            "be read off HF's cache: serving prices the attention layers' KV cache, the Mamba-2 layers' conv + SSM "
            "state and the measured state of a hybrid's other recurrent layers (Mamba-1, short convolutions, gated "
            "DeltaNet); plan its training")
    inside = conv.module_path.removeprefix(sharding.layer_prefix(stack, 0)) if conv is not None else f".{part.path}"
    path = sharding.layer_prefix(stack, layers[0] if layers else 0) + inside
    divisor = functools.partial(sharding.node_divisor, stack, BlockKind.LAYER, path)  # of tp
    return float(dict(part.sizes)["state_bytes"]), divisor


# --------------------------------------------------------------------------------------------
# Pieces


def stages_of(spec: ModelSpec, pp: int) -> tuple[Stage, ...]:
    return even_stages(spec.layers, pp)


def layer_tables(it: InferenceTable) -> tuple[tuple[InferenceTable, int], ...]:
    """(one-kind table, layers of that kind) of the whole model: the one kind of a uniform stack, every kind of
    a mixed one (each priced through its own table)."""
    if not it.kinds:
        return ((it, it.spec.layers),)
    return tuple((kind, it.ct.layer_kinds.count(k)) for k, kind in enumerate(it.kinds))


def stage_layer_tables(it: InferenceTable, stage: Stage) -> tuple[tuple[InferenceTable, int], ...]:
    """`layer_tables` of the layers `stage` holds (a mixed stack: the kinds of its own layers)."""
    if not it.kinds:
        return ((it, stage.layers),)
    held = it.ct.layer_kinds[stage.first_layer:stage.end_layer]
    return tuple((kind, held.count(k)) for k, kind in enumerate(it.kinds))


def _layout(spec: ModelSpec, tp: int, batch: int) -> Layout:
    return Layout(mesh=Mesh(tp=tp), micro_batch=batch, strategies=sharding.runnable_strategies(spec, tp) or ())


def _block_seconds(it: InferenceTable, hw: DeviceProfile, tp: int, kind: BlockKind, *, batch: int, seq_len: int,
                   decode: bool, ep: int = 1) -> float:
    """Roofline seconds of one instance of `kind`'s forward nodes that inference runs (decode: the
    sequence-mixing core left out, it is priced by `decode_core_seconds`; ep: each rank runs its
    E/ep experts on the rows routed to them, 1/ep of the routed experts' bytes and FLOPs)."""
    blk = it.ct.block(kind)
    if not len(blk.fwd):
        return 0.0
    t = node_times(it.ct, hw, _layout(it.spec, tp, batch), kind, seq_len)
    if blk.expert is not None and blk.expert.any():  # the routed experts' GEMMs read only the experts touched,
        # 1/ep of them on each ep rank, each expert's GEMMs split over tp (runtime/expert_parallel.py)
        t = np.where(blk.expert, t * _expert_byte_fraction(it, kind, batch=batch, seq_len=seq_len) / (ep * tp), t)
    if it.lookup[kind].any():  # an embedding lookup reads the rows of its tokens, not the whole table
        t = np.where(it.lookup[kind], t * _byte_share(blk, batch=batch, seq_len=seq_len, weight_fraction=0.0), t)
    run = blk.fwd & ~it.skip[kind]
    if decode:
        run &= ~it.core[kind]
    return float(t[run].sum())


def active_experts(experts: int, top_k: int, tokens: float) -> float:
    """Expected number of distinct experts that `tokens` tokens route to, each to `top_k` of
    `experts` (uniform routing, tokens independent). One token misses a given expert with
    probability 1 - k/E (it picks k distinct experts of E), so B tokens all miss it with
    probability (1 - k/E)^B and, by linearity of expectation over the E experts (the classical
    occupancy problem, Feller, An Introduction to Probability Theory, vol. I, ch. II.5 and IV.2),
    E[distinct] = E (1 - (1 - k/E)^B) <= min(E, B k): B k while B k << E (decode at small batch
    reads B k experts), E once B k >> E (a prefill reads them all)."""
    if experts <= 0:
        return 0.0
    return experts * (1.0 - (1.0 - min(top_k, experts) / experts) ** tokens)


def _expert_byte_fraction(it: InferenceTable, kind: BlockKind, *, batch: int, seq_len: int) -> np.ndarray:
    """Per node: the share of its roofline time left when its expert weights are read only for the
    experts touched (`active_experts` of batch x seq_len tokens). A node's bytes are its weights
    (the b-free part) plus its activations; the time scales with the bytes, which is exact while
    the node is memory-bound -- and a grouped GEMM is compute-bound only with hundreds of rows per
    expert, where (1 - k/E)^B ~ 0 and every expert is touched (fraction 1)."""
    spec, blk = it.spec, it.ct.block(kind)
    frac = active_experts(spec.experts, spec.top_k, batch * seq_len) / max(spec.experts, 1)
    return _byte_share(blk, batch=batch, seq_len=seq_len, weight_fraction=frac)


def _byte_share(blk, *, batch: int, seq_len: int, weight_fraction: float) -> np.ndarray:
    """Per node: the share of its bytes left when only `weight_fraction` of its weights (the b-free
    part of its bytes) is read; its activations are read whole."""
    total = blk.evaluate(batch, seq_len)[1]
    weights = blk.evaluate(0, seq_len)[1]
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(total > 0, (total - weights + weights * weight_fraction) / total, 1.0)


def cache_bytes_per_layer(spec: ModelSpec, *, batch: int, tokens: int, tp: int,
                          dtype_bytes: float = KV_BYTES) -> float:
    """Bytes one device holds for one layer: LLaMA's K and V of `tokens` tokens (its share of the
    KV heads: kv_heads / min(tp, kv_heads)), or Mamba-2's conv state (model dtype) and fp32 SSM
    state (constant in tokens). `dtype_bytes`: the model's element size (bf16 when serving)."""
    if spec.mixer is Mixer.ATTENTION and spec.kv_latent:  # MLA: the compressed KV and RoPE key, one per token
        return float(batch * spec.attended_tokens(tokens) * spec.kv_latent * dtype_bytes)
    if spec.mixer is Mixer.ATTENTION:
        head_dim = spec.attention_head_dim
        kv_local = spec.kv_heads // sharding.kv_parts(spec, tp)
        return 2.0 * batch * spec.attended_tokens(tokens) * kv_local * head_dim * dtype_bytes  # a window: its tokens
    ssm = batch * (spec.heads // tp) * spec.head_dim * spec.state * SSM_STATE_BYTES
    conv = batch * _conv_channels(spec, tp) * spec.conv * dtype_bytes
    return float(ssm + conv)


def layer_cache_bytes(it: InferenceTable, *, batch: int, tokens: int, tp: int, dtype_bytes: float = KV_BYTES) -> float:
    """Bytes one device holds for one layer of the kind `it` prices: `cache_bytes_per_layer` of each sequence
    mixer the layer holds (a hybrid's attention layer its KV, its Mamba-2 layer its state, Falcon-H1's layer both;
    0 for a layer of per-token ops), plus a recurrent mixer's measured state (`InferenceTable.state_bytes`)."""
    return sum(cache_bytes_per_layer(m, batch=batch, tokens=tokens, tp=tp, dtype_bytes=dtype_bytes)
               for m in it.mixers) + batch * it.state_bytes(tp)


def stage_cache_bytes(it: InferenceTable, stage: Stage, *, batch: int, tokens: int, tp: int,
                      dtype_bytes: float = KV_BYTES) -> float:
    """The cache of `stage`'s layers on one of its devices (the whole model: `stages_of(spec, 1)[0]`)."""
    return sum(n * layer_cache_bytes(kind, batch=batch, tokens=tokens, tp=tp, dtype_bytes=dtype_bytes)
               for kind, n in stage_layer_tables(it, stage) if n)


def _conv_channels(spec: ModelSpec, tp: int) -> float:
    """Mamba-2 conv channels one tp rank holds: x, B and C split by the sharding table (B and C
    whole on every rank when tp does not divide n_groups)."""
    conv_dim = spec.intermediate + 2 * spec.groups * spec.state
    return conv_dim / sharding.node_divisor(spec, BlockKind.LAYER, f"{sharding.layer_prefix(spec, 0)}.mixer.conv1d", tp)


def decode_core_seconds(it: InferenceTable, hw: DeviceProfile, tp: int, *, batch: int, context: float) -> float:
    """One layer's sequence mixing for one decode step on one device (docs/modules/serving.md): each of the
    layer's sequence mixers (`it.mixers`) as its own kernel, and a recurrent mixer's state read and written once."""
    state = 2.0 * batch * it.state_bytes(tp)  # a recurrent mixer's state, read and written back each step
    return sum(_mixer_step_seconds(it, spec, hw, tp, batch=batch, context=context) for spec in it.mixers) + \
        state / (hw.hbm_bandwidth * hw.vector_efficiency)


def _mixer_step_seconds(it: InferenceTable, spec: ModelSpec, hw: DeviceProfile, tp: int, *, batch: int,
                        context: float) -> float:
    if spec.mixer is Mixer.ATTENTION:
        heads = 1 if sharding.attention_whole(spec) else tp  # heads split over tp (HF's gathered q/k/v: whole)
        flops = float(it.attention_flops(batch, spec.attended_tokens(context))) / heads  # a window's keys
        q_out = 2.0 * batch * spec.hidden / heads * ACT_BYTES
        nbytes = cache_bytes_per_layer(spec, batch=batch, tokens=context, tp=tp) + q_out  # the config's head_dim
    else:
        state = batch * spec.heads * spec.head_dim * spec.state / tp
        conv = batch * _conv_channels(spec, tp) * spec.conv
        flops = 5.0 * state + 2.0 * conv
        nbytes = 2.0 * (state * SSM_STATE_BYTES + conv * KV_BYTES)  # conv state in the model's bf16
    return max(flops / (hw.peak_flops * hw.gemm_efficiency), nbytes / (hw.hbm_bandwidth * hw.vector_efficiency))


def kernels_per_forward(it: InferenceTable, hw: DeviceProfile, kind: BlockKind) -> int:
    """Kernels one instance of `kind` launches in a forward, as a serving engine runs it: one per
    module whose operators read weights (GEMMs, norms' scales, the embedding table, conv1d), one per fused
    region the device runs as one kernel (`hw.kernels`: the norm, RoPE, SwiGLU; its weight readers
    counted once), one for the sequence-mixing core (flash / paged attention, the SSD scan or its
    recurrent step). What is left (the unfused elementwise glue of the HF trace) an engine fuses
    into its neighbours. LLaMA layer on a GPU profile: 7 GEMMs + 2 norms + RoPE + SwiGLU + attention = 12."""
    key = ("kernels", kind, hw.kernels)
    blk = it.ct.block(kind)
    if key not in blk.memo:
        run = blk.fwd & ~it.skip[kind] & ~it.core[kind]
        reads_weights = blk.evaluate(0, 1)[1] > 0  # the b-free part of a node's bytes: its weights
        units = set()
        for i in np.flatnonzero(run):
            region = int(blk.region[i])
            if region >= 0 and hw.fuses(blk.region_kernels[region]):
                units.add(("region", region))
            elif reads_weights[i]:
                units.add(("module", it.paths[kind][i]))  # one kernel per module (HF's rotary: one)
        blk.memo[key] = len(units) + (len(it.mixers) if kind is BlockKind.LAYER else 0)
    return blk.memo[key]


def _floor_seconds(it: InferenceTable, hw: DeviceProfile) -> float:
    """The fixed cost of one forward of a replica beyond its bytes and FLOPs (what a decode step at
    small batch is made of besides the weights it streams): `hw.kernel_floor_s` per kernel
    (`kernels_per_forward`, every layer of every stage; 0 where the profile has none)."""
    if not hw.kernel_floor_s:
        return 0.0
    kernels = (sum(n * kernels_per_forward(kind, hw, BlockKind.LAYER) for kind, n in layer_tables(it))
               + kernels_per_forward(it, hw, BlockKind.EMBED) + kernels_per_forward(it, hw, BlockKind.HEAD))
    return kernels * hw.kernel_floor_s


KV_BLOCK_TOKENS = 16  # vLLM's default KV-cache block size (--block-size 16): one block-table entry per 16 tokens


def _step_input_seconds(hw: DeviceProfile, layout: ServeLayout, *, tokens: int, context: float | None) -> float:
    """tp > 1: a serving engine's driver broadcasts each step's inputs to the other ranks of its
    replica before they can run the forward -- `hw.step_input_broadcasts` eager NCCL broadcasts
    (vLLM 0.5.x: one per GPU tensor of the model input, see the profile's source), serialised on
    every rank ahead of the graph-launched forward. Each is priced by the collective model (a ring
    broadcast, NCCL's LL protocol where the profile has it) at the largest such tensor: one int64
    per token (ids, positions, slot mapping) or the block table, one int32 per 16 cached tokens per
    sequence. The engine's host time around them (pickling the metadata, the Python calls) is not
    priced: no published per-step figure (docs/inference.md)."""
    ranks = layout.tp * layout.ep
    if ranks == 1 or not hw.step_input_broadcasts:
        return 0.0
    cached = tokens if context is None else context + tokens
    nbytes = layout.batch * max(8.0 * tokens, 4.0 * math.ceil(cached / KV_BLOCK_TOKENS))
    return hw.step_input_broadcasts * best_time(hw, Collective.BROADCAST, nbytes, size=ranks,
                                                stride=group_stride(_replica_mesh(layout), "ep", "tp"),
                                                low_latency=True)


def _hop_seconds(hw: DeviceProfile, layout: ServeLayout, nbytes: float) -> float:
    """One stage-to-stage send (consecutive stages' ranks are ep x tp apart in a replica, rules/ranks.py)."""
    return collective_time(hw, Collective.SEND_RECV, nbytes, size=2, stride=group_stride(_replica_mesh(layout), "pp"))


def _replica_mesh(layout: ServeLayout) -> Mesh:
    """One replica's mesh (its ranks in the runtime's order, rules/ranks.py)."""
    return Mesh(pp=layout.pp, ep=layout.ep, tp=layout.tp)


def phase_time(it: InferenceTable, hw: DeviceProfile, layout: ServeLayout, *, tokens: int,
               context: float | None) -> PhaseTime:
    """A prefill (`tokens` = prompt length, `context` None) or one decode step (`tokens` = 1 at
    `context` tokens in the cache) of the whole batch through every stage of one replica."""
    spec, tp, b = it.spec, layout.tp, layout.batch
    decode = context is not None
    lay = _layout(spec, tp, b)
    layers = layer_tables(it)
    kinds = {BlockKind.EMBED: tokens, BlockKind.HEAD: 1}  # head: last position only
    per = {k: _block_seconds(it, hw, tp, k, batch=b, seq_len=s, decode=decode, ep=layout.ep) for k, s in kinds.items()}
    per[BlockKind.LAYER] = sum(n * _block_seconds(kind, hw, tp, BlockKind.LAYER, batch=b, seq_len=tokens,
                                                  decode=decode, ep=layout.ep) for kind, n in layers)
    comm = {BlockKind.EMBED: tp_comm_times(it.ct, hw, lay, BlockKind.EMBED, tokens, low_latency=True)[0],
            BlockKind.LAYER: sum(n * tp_comm_times(kind.ct, hw, _layout(kind.spec, tp, b), BlockKind.LAYER, tokens,
                                                   low_latency=True)[0] for kind, n in layers)}
    moe_layers = sum(n for kind, n in layers if kind.spec.is_moe)
    mesh = _replica_mesh(layout)
    comm[BlockKind.HEAD] = (best_time(hw, Collective.ALL_GATHER, b * spec.vocab * LOGIT_BYTES, size=tp,
                                      stride=group_stride(mesh, "tp"),
                                      low_latency=True)
                            if sharding.vocab_parallel(spec, BlockKind.HEAD, lay.strategies) else 0.0)  # replicated: none
    compute = per[BlockKind.LAYER] + per[BlockKind.EMBED] + per[BlockKind.HEAD]
    tp_comm = comm[BlockKind.LAYER] + comm[BlockKind.EMBED] + comm[BlockKind.HEAD]
    core = sum(n * decode_core_seconds(kind, hw, tp, batch=b, context=context) for kind, n in layers) if decode else 0.0
    pp_comm = 0.0
    if layout.pp > 1:
        hop = _hop_seconds(hw, layout, b * tokens * spec.hidden * ACT_BYTES)
        token = best_time(hw, Collective.ALL_GATHER, b * 8.0, size=layout.pp, stride=group_stride(mesh, "pp"),
                          low_latency=True)  # broadcast of b ids
        pp_comm = (layout.pp - 1) * hop + token
    ep_comm = 0.0
    if layout.ep > 1:  # the experts' partial outputs summed over the ep ranks, every MoE layer
        ep_comm = moe_layers * best_time(hw, Collective.ALL_REDUCE, b * tokens * spec.hidden * ACT_BYTES,
                                          size=layout.ep, stride=group_stride(mesh, "ep"), low_latency=True)
    if moe_layers and tp > 1:  # and over tp: every expert's GEMMs are split over the tp ranks
        tp_comm += moe_layers * best_time(hw, Collective.ALL_REDUCE, b * tokens * spec.hidden * ACT_BYTES,
                                           size=tp, stride=group_stride(mesh, "tp"), low_latency=True)
    return PhaseTime(compute=compute, core=core, tp_comm=tp_comm, pp_comm=pp_comm, ep_comm=ep_comm,
                     fixed=_floor_seconds(it, hw), step_inputs=_step_input_seconds(hw, layout, tokens=tokens,
                                                                                   context=context))


def memory(it: InferenceTable, layout: ServeLayout, *, prompt_len: int, output_len: int,
           decode_only: bool = False) -> ServeMemory:
    """Bytes on the busiest device (docs/modules/serving.md). `decode_only`: a disaggregated
    decode pool, which holds the cache at prompt_len + output_len tokens but runs no prefill
    (its activations are one decode step's)."""
    spec, tp, b = it.spec, layout.tp, layout.batch
    held = _held_layout(spec, layout)
    prm = {k: block_params(it.ct, held, k) for k in (BlockKind.EMBED, BlockKind.HEAD)}
    act = _activation_bytes(it, tp, batch=b, tokens=1 if decode_only else prompt_len, decode=decode_only)
    best = None
    for st in stages_of(spec, layout.pp):
        layers = stage_layer_tables(it, st)
        params = sum(n * _layer_params(kind, layout) for kind, n in layers if n) \
            + prm[BlockKind.EMBED] * st.embed + prm[BlockKind.HEAD] * st.head
        if st.head and spec.tied and not st.embed:
            params += prm[BlockKind.EMBED]  # the tied LM head keeps its copy of the embedding
        logits = b * spec.vocab / (tp if sharding.vocab_parallel(spec, BlockKind.HEAD, held.strategies) else 1) \
            * LOGIT_BYTES if st.head else 0.0
        cache = stage_cache_bytes(it, st, batch=b, tokens=prompt_len + output_len, tp=tp)
        mem = ServeMemory(weights=params * PARAM_BYTES, cache=cache, activations=act + logits)
        if best is None or mem.total > best.total:
            best = mem
    return best


def _held_layout(spec: ModelSpec, layout: ServeLayout) -> Layout:
    """What one device of a replica holds: E/ep experts per layer (cost.block_params), tp as the table splits."""
    return Layout(mesh=Mesh(tp=layout.tp, ep=layout.ep), micro_batch=layout.batch,
                  strategies=sharding.runnable_strategies(spec, layout.tp) or ())


def _layer_params(it: InferenceTable, layout: ServeLayout) -> float:
    """Parameters of one layer of the kind `it` prices on one device of `layout`."""
    held = _held_layout(it.spec, layout)
    params = block_params(it.ct, held, BlockKind.LAYER)
    if it.spec.is_moe and layout.tp > 1:  # each tp rank holds its slice of every expert (runtime/expert_parallel.py)
        params -= expert_block_params(it.ct, held, BlockKind.LAYER) * (1 - 1 / layout.tp)
    return params


def _activation_bytes(it: InferenceTable, tp: int, *, batch: int, tokens: int, decode: bool) -> float:
    """Transient bytes of one forward of `tokens` tokens per sequence: residual stream + its normed
    copy, plus the largest single forward node's inputs and output, weights excluded (a decode
    step: the sequence-mixing core excluded, it runs as the recurrent / cached step)."""
    spec = it.spec
    residual = 2.0 * batch * tokens * spec.hidden * ACT_BYTES
    largest = 0.0
    for table, kind in ((it, BlockKind.EMBED), *((k, BlockKind.LAYER) for k, _ in layer_tables(it))):
        blk = table.ct.block(kind)
        if not len(blk.fwd):
            continue
        moved = blk.evaluate(batch, tokens)[1] - blk.evaluate(0, tokens)[1]  # weights: the b-free part
        run = blk.fwd & ~table.core[kind] if decode else blk.fwd
        divisor = tp_divisor(blk, table.spec, tp, strategies=sharding.runnable_strategies(table.spec, tp) or ())
        largest = max(largest, float((moved / divisor)[run].max(initial=0.0)))
    return residual + largest


# --------------------------------------------------------------------------------------------
# Composition


def estimate_serving(table: CostTable | InferenceTable, spec: ModelSpec, hw: DeviceProfile, layout: ServeLayout, *,
                     prompt_len: int, output_len: int) -> ServeEstimate:
    """TTFT, TPOT, throughput and memory of `layout` (docs/modules/serving.md)."""
    if not (is_positive_int(prompt_len) and is_positive_int(output_len)):
        raise InvalidConfigError(f"prompt length and output length must be positive, got {prompt_len} and "
                                 f"{output_len}")
    if layout.pp > spec.layers:
        raise InvalidConfigError(f"pp ({layout.pp}) is larger than the number of layers of {spec.name} "
                                 f"({spec.layers}); use pp <= {spec.layers}")
    it = compile_inference_table(table, spec)
    prefill = phase_time(it, hw, layout, tokens=prompt_len, context=None)
    mean_context = prompt_len + output_len / 2.0  # steps see contexts P+1 .. P+O-1: linear in C
    decode = phase_time(it, hw, layout, tokens=1, context=mean_context)
    ttft, tpot = prefill.total, decode.total
    cycle = ttft + (output_len - 1) * tpot
    throughput = layout.replicas * layout.batch * output_len / cycle
    mem = memory(it, layout, prompt_len=prompt_len, output_len=output_len)
    return ServeEstimate(layout=layout, ttft_s=ttft, tpot_s=tpot, throughput_tokens_per_s=throughput, memory=mem,
                         fits=mem.total <= hw.memory_bytes, prefill=prefill, decode=decode)
