"""Plain frozen dataclasses shared by the passes and the runtime: the mesh, stages, the Plan, and
the `ShardProgram` one tensor-parallel rank carries out (its `Replicate` / `Shard` placements).

Terms: an *axis* is a mesh axis (dp, pp, tp, cp, ep); a *dim* is a tensor dimension.
A `Plan` is what `solve` decides and `rewrite` carries out; it is JSON (never pickle) with a
schema version, and refers to layers and op groups by stable names. Its fields are defined once,
in `PLAN_FIELDS` (what each must be, its JSON, its doc line), with the one rule of a count
(`POSITIVE_INT`: booleans refused). No SymPy here: the
symbolic cost table (`b`, `s`, NodeCost, CostTable) lives in `autoshard.cost_table`, so the
runtime, which imports this module, never loads it.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Callable, Mapping

from autoshard.errors import InvalidConfigError, PlanFileError
from autoshard.json_file import read_plan_json

AXES = ("dp", "pp", "tp", "cp", "ep")
SCHEMA_VERSION = 2  # 2: precision, schedule, virtual_stages (a version-1 file loads with their defaults)


class Recompute(str, Enum):
    NONE = "none"
    SELECTIVE = "selective"  # rerun the attention module / Mamba-2 mixer (projections included) in backward
    FULL = "full"  # keep only each block's input; rerun the block's forward in backward


class Precision(str, Enum):
    """Numerics of a training step (Lightning's names). AUTO is the default of the device the plan runs on:
    bf16-mixed on an accelerator (cuda, npu), fp32 on CPU; `resolve(device_type)` says which."""

    AUTO = "auto"
    BF16_MIXED = "bf16-mixed"  # bf16 weights/compute/activations; fp32 master weights, main gradients, optimizer
    FP32 = "fp32"  # everything fp32: the exact equivalence tests
    # bf16-mixed with the attention / MLP projections' GEMMs in float8 through torchao's float8 training
    # (`Float8Linear`, recipe: the plan's `fp8_recipe`); runtime/fp8.py
    FP8 = "fp8"

    @property
    def mixed(self) -> bool:
        """bf16 weights and activations with fp32 masters and main gradients (bf16-mixed, and fp8 on top of it)."""
        return self in (Precision.BF16_MIXED, Precision.FP8)

    def resolve(self, device_type: str) -> Precision:
        """The concrete precision on a device of kind `device_type` ("cpu", "cuda", "npu"; a cost
        model passes its hardware profile's kind: "cpu" for the cpu profile, else an accelerator)."""
        if self is not Precision.AUTO:
            return self
        return Precision.FP32 if device_type == "cpu" else Precision.BF16_MIXED


class Fp8Recipe(str, Enum):
    """torchao's float8 training recipes (`Float8LinearConfig.from_recipe_name`), plan key `fp8_recipe`."""

    TENSORWISE = "tensorwise"  # one scale per tensor (input, weight, grad_output); FSDP2 may all-gather in float8
    ROWWISE = "rowwise"  # one scale per row of each GEMM operand (per-token / per-channel): more casts, no fp8 gather


class Schedule(str, Enum):
    """Pipeline schedule (torch.distributed.pipelining). Stage placement over pp ranks: `stage_rank`."""

    ONE_F_ONE_B = "1f1b"  # Schedule1F1B: at most pp micro-batches in flight, bubble (p-1)/(m+p-1)
    GPIPE = "gpipe"  # ScheduleGPipe: every forward, then every backward: all micro-batches in flight
    INTERLEAVED_1F1B = "interleaved-1f1b"  # ScheduleInterleaved1F1B: virtual_stages chunks per rank, loop placement
    ZERO_BUBBLE = "zero-bubble"  # backward split in input-grad (B) and weight-grad (W) passes; see runtime/pipeline.py


def fp8_recipe_of(precision: Precision, recipe: Any) -> Fp8Recipe | None:
    """The float8 recipe of a plan: `recipe` (torchao's default, tensorwise, when None) under precision fp8;
    None otherwise, where giving one is an error."""
    if precision is not Precision.FP8:
        if recipe is not None:
            raise InvalidConfigError(f"fp8_recipe {recipe!r} needs precision 'fp8', got precision "
                                     f"{precision.value!r}; set precision='fp8' or drop fp8_recipe")
        return None
    return Fp8Recipe.TENSORWISE if recipe is None else _enum_field(Fp8Recipe, recipe, "fp8_recipe")


def _enum_field(enum: type[Enum], value: Any, field_name: str) -> Enum:
    """`value` as a member of `enum`, or an InvalidConfigError listing the known values."""
    if isinstance(value, enum):
        return value
    try:
        return enum(str(value).lower() if isinstance(value, str) else value)
    except ValueError:
        known = ", ".join(repr(m.value) for m in enum)
        raise InvalidConfigError(f"{field_name} must be one of {known}; got {value!r}") from None


class OpKind(str, Enum):
    MATMUL = "matmul"  # priced by GEMM throughput (efficiency depends on shape)
    VECTOR = "vector"  # priced by memory bandwidth (elementwise, norms, scans, softmax)
    VIEW = "view"  # free: views, permutes of metadata, getitem


class BlockKind(str, Enum):
    EMBED = "embed"  # token embedding (and anything before the first repeated block)
    LAYER = "layer"  # one repeated block (decoder layer / Mamba-2 block)
    HEAD = "head"  # final norm, LM head, loss


@dataclass(frozen=True, slots=True, kw_only=True)
class Mesh:
    dp: int = 1
    pp: int = 1
    tp: int = 1
    cp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for axis in AXES:
            POSITIVE_INT.check(f"mesh axis {axis}", getattr(self, axis))

    @property
    def size(self) -> int:
        return self.dp * self.pp * self.tp * self.cp * self.ep

    def as_dict(self) -> dict[str, int]:
        return {axis: getattr(self, axis) for axis in AXES}

    def __str__(self) -> str:
        return " ".join(f"{axis}{getattr(self, axis)}" for axis in AXES if getattr(self, axis) > 1) or "single"


@dataclass(frozen=True, slots=True, kw_only=True)
class Replicate:
    """The full tensor on every tp rank."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Shard:
    """Slice `index` of `parts` of every piece (sizes `segments`) along `dim`."""

    dim: int
    index: int
    parts: int
    segments: tuple[int, ...]
    whole: tuple[bool, ...] = ()  # per piece: kept whole on every rank (Mamba-2 B/C when tp does not divide groups)

    def kept_whole(self, i: int) -> bool:
        return bool(self.whole) and self.whole[i]

    def local_sizes(self) -> tuple[int, ...]:
        """Length along `dim` of this rank's part of every piece."""
        return tuple(size if self.kept_whole(i) else size // self.parts for i, size in enumerate(self.segments))

    def ranges(self) -> tuple[tuple[int, int], ...]:
        """(start, length) along `dim` of this rank's slice of every piece, in the full tensor."""
        out, offset = [], 0
        for i, (size, step) in enumerate(zip(self.segments, self.local_sizes())):
            out.append((offset if self.kept_whole(i) else offset + self.index * step, step))
            offset += size
        return tuple(out)


Placement = Replicate | Shard


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardProgram:
    """What tensor-parallel rank `tp_rank` of `tp` holds and where its collectives go: decided by
    `passes/rewrite.py shard_program` (see its docstring), carried out by `runtime/`."""

    tp: int
    tp_rank: int
    placements: tuple[tuple[str, Placement], ...]
    partial_grads: tuple[str, ...] = ()
    regions: tuple[str, ...] = ()
    rowwise: tuple[str, ...] = ()
    vocab_embed: str | None = None
    vocab_head: str | None = None
    attrs: tuple[tuple[str, str, int], ...] = ()
    checkpoint: tuple[str, ...] = ()
    sequence_parallel: bool = False  # some stage runs its norms and residual on this rank's tp shard of the sequence
    sequence_paths: tuple[str, ...] = ()  # the modules that do (regions, row-parallel, norms, embedding / head)
    buffers: tuple[tuple[str, Placement], ...] = ()  # buffers sliced with a parameter (Falcon-H1's mup_vector)
    output_regions: tuple[str, ...] = ()  # row-parallel linears whose summed output enters a TP region (Mamba-1 x_proj)
    sequence_grads: tuple[str, ...] = ()  # under it: parameters whose gradients are summed over tp
    gather_outputs: tuple[str, ...] = ()  # colwise linears entering tp themselves, their output all-gathered whole
    split_inputs: tuple[str, ...] = ()  # row-parallel linears (in `rowwise`) slicing their whole input first
    sequence_splits: tuple[str, ...] = ()  # under it: a replicated embedding, its output cut to this rank's shard
    sequence_gathers: tuple[str, ...] = ()  # under it: a replicated LM head, its input gathered from the shards
    sequence_wholes: tuple[str, ...] = ()  # under it: modules run whole (HF's gathered attention), input gathered

    def placement(self, name: str) -> Placement:
        return dict(self.placements)[name]


@dataclass(frozen=True, slots=True, kw_only=True)
class Stage:
    """One pipeline stage: layers [first_layer, end_layer), plus embedding / head if it holds them."""

    first_layer: int
    end_layer: int
    embed: bool
    head: bool
    recompute: Recompute = Recompute.NONE

    def __post_init__(self) -> None:
        for name in ("first_layer", "end_layer"):
            NON_NEGATIVE_INT.check(f"stage {name}", getattr(self, name))
        if self.first_layer > self.end_layer:
            raise InvalidConfigError(f"stage layers [{self.first_layer}, {self.end_layer}): the first layer is after "
                                     "the end; a stage holds layers first_layer <= i < end_layer")

    @property
    def layers(self) -> int:
        return self.end_layer - self.first_layer


def stage_rank(index: int, *, pp: int, virtual_stages: int, schedule: Schedule) -> int:
    """The pp rank that runs model chunk `index` of the pp * virtual_stages chunks (model order).

    Loop placement (torch's interleaved schedules): chunk i on rank i % pp, so rank r holds chunks
    r, r + pp, ...; with virtual_stages = 2 the zero-bubble schedule uses the V placement of
    ScheduleZBVZeroBubble instead: rank r holds chunks r and 2 pp - 1 - r (the last chunk, with the
    LM head, sits on rank 0 next to the embedding)."""
    if schedule is Schedule.ZERO_BUBBLE and virtual_stages == 2:
        return index if index < pp else 2 * pp - 1 - index
    return index % pp


def end_chunks(rank: int, *, pp: int, virtual_stages: int, schedule: Schedule) -> int:
    """How many of pp rank `rank`'s model chunks hold the embedding or the LM head: the only chunks
    that may hold no layer (check_stages)."""
    last = pp * virtual_stages - 1
    return sum(stage_rank(i, pp=pp, virtual_stages=virtual_stages, schedule=schedule) == rank
               for i in sorted({0, last}))


def chunk_layers(layers: int, *, rank: int, pp: int, virtual_stages: int, schedule: Schedule) -> tuple[int, ...]:
    """Rank `rank`'s `layers` split over its model chunks (in model order), as evenly as they go, the
    spare layers going first to the chunks without the embedding / head, so that no middle chunk is
    empty while the rank holds at least one layer per middle chunk."""
    mine = [i for i in range(pp * virtual_stages)
            if stage_rank(i, pp=pp, virtual_stages=virtual_stages, schedule=schedule) == rank]
    ends = {0, pp * virtual_stages - 1}
    base, extra = divmod(layers, len(mine))
    spare = set(sorted(mine, key=lambda i: (i in ends, i))[:extra])
    return tuple(base + (i in spare) for i in mine)


def check_schedule(schedule: Schedule, virtual_stages: Any, *, pp: int) -> None:
    """InvalidConfigError unless `virtual_stages` chunks per rank suit `schedule` at this pp."""
    POSITIVE_INT.check("virtual_stages", virtual_stages)
    if virtual_stages > 1 and pp == 1:
        raise InvalidConfigError(f"virtual_stages={virtual_stages} needs a pipeline (pp > 1); use virtual_stages=1 "
                                 "with pp=1")
    if virtual_stages > 1 and schedule in (Schedule.ONE_F_ONE_B, Schedule.GPIPE):
        raise InvalidConfigError(f"schedule {schedule.value!r} runs one stage per rank, got virtual_stages="
                                 f"{virtual_stages}; use schedule='interleaved-1f1b' or 'zero-bubble' for model "
                                 "chunks, or virtual_stages=1")
    if schedule is Schedule.INTERLEAVED_1F1B and pp > 1 and virtual_stages < 2:
        raise InvalidConfigError("schedule 'interleaved-1f1b' needs virtual_stages >= 2 (model chunks per pipeline "
                                 "rank); with one chunk per rank use schedule='1f1b'")


def even_stages(layers: int, pp: int, *, recompute: Recompute = Recompute.NONE) -> tuple[Stage, ...]:
    """The default split: `layers` over `pp` stages, the first `layers % pp` one layer longer,
    every stage at recompute level `recompute`."""
    POSITIVE_INT.check("pp", pp)
    if pp > layers:
        raise InvalidConfigError(f"pp ({pp}) is larger than the number of layers ({layers}); "
                                 f"use pp <= {layers} so every stage holds at least one layer")
    base, extra = divmod(layers, pp)
    stages, first = [], 0
    for i in range(pp):
        end = first + base + (1 if i < extra else 0)
        stages.append(Stage(first_layer=first, end_layer=end, embed=i == 0, head=i == pp - 1, recompute=recompute))
        first = end
    return tuple(stages)


def check_stages(stages: tuple[Stage, ...], *, num_layers: int, pp: int) -> tuple[Stage, ...]:
    """`stages` if they are a valid split of `num_layers` layers over `pp` stages, else InvalidConfigError."""
    stages = tuple(stages)
    if len(stages) != pp:
        raise InvalidConfigError(f"the plan has {len(stages)} pipeline stages but pp is {pp}; "
                                 "give one Stage per pp rank (or none for an even split)")
    expected_first = 0
    for i, st in enumerate(stages):
        where = f"stage {i} (layers [{st.first_layer}, {st.end_layer}))"
        if st.first_layer != expected_first or st.end_layer < st.first_layer:
            raise InvalidConfigError(f"{where} does not follow the previous stage; stages must cover layers "
                                     f"0..{num_layers} in order, this one should start at layer {expected_first}")
        if st.embed != (i == 0) or st.head != (i == pp - 1):
            raise InvalidConfigError(f"{where}: the embedding belongs to the first stage and the LM head to "
                                     f"the last, found embed={st.embed}, head={st.head}")
        if st.layers == 0 and not (st.embed or st.head):
            raise InvalidConfigError(f"{where} holds nothing; give every middle stage at least one layer")
        expected_first = st.end_layer
    if expected_first != num_layers:
        raise InvalidConfigError(f"the stages cover layers 0..{expected_first} but the model has {num_layers} "
                                 f"layers; the last stage must end at layer {num_layers}")
    return stages


def is_int(value: Any) -> bool:
    """An int that is not a bool (True would pass as 1 otherwise); 1.0 and "2" are refused."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_positive_int(value: Any) -> bool:
    """The one rule for a count (a mesh degree, a batch, a length, a group size): an int (`is_int`) of at least 1."""
    return is_int(value) and value >= 1


def is_number(value: Any) -> bool:
    """A finite int or float that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def is_positive_number(value: Any) -> bool:
    """The one rule for a rate, a time or a size in bytes: a finite number (`is_number`) above 0."""
    return is_number(value) and value > 0


@dataclass(frozen=True, slots=True)
class Check:
    """What a value must be: `ok(value)`, and the phrase an error names it by ("a positive integer")."""

    phrase: str
    ok: Callable[[Any], bool]

    def violation(self, what: str, value: Any, *, verb: str = "got") -> str | None:
        """None if `value` passes, else "<what> must be <phrase>, <verb> <value>" (verb "found" in files)."""
        return None if self.ok(value) else f"{what} must be {self.phrase}, {verb} {value!r}"

    def check(self, what: str, value: Any) -> None:
        """InvalidConfigError naming `what` unless `value` passes."""
        why = self.violation(what, value)
        if why:
            raise InvalidConfigError(why)


INTEGER = Check("an integer", is_int)
POSITIVE_INT = Check("a positive integer", is_positive_int)
NON_NEGATIVE_INT = Check("a non-negative integer", lambda v: is_int(v) and v >= 0)
BOOLEAN = Check("true or false", lambda v: isinstance(v, bool))
TEXT = Check("a string", lambda v: isinstance(v, str))


def per_stage(value: Any, chunks: int) -> tuple:
    """A per-stage plan value as one entry per model chunk: a single value means every chunk; a
    tuple (one entry per chunk, checked by rules/validity.py plan_violation) is returned as is."""
    return tuple(value) if isinstance(value, tuple) else (value,) * chunks


def _per_stage_value(value: Any, chunks: int, ok, what: str) -> Any:
    """A plan field that may be given per stage: a list / tuple becomes a tuple (each entry passing
    `ok`), and one whose `chunks` entries all agree becomes that single value (the same plan)."""
    kind = "true or false" if what == "sequence_parallel" else "an option name"
    if isinstance(value, (list, tuple)):
        if not value or not all(ok(v) for v in value):
            raise InvalidConfigError(f"{what} must be {kind}, or a list of them with one per pipeline stage (model "
                                     f"chunk), got {value!r}")
        value = tuple(value)
        return value[0] if len(value) == chunks and len(set(value)) == 1 else value
    if not ok(value):
        raise InvalidConfigError(f"{what} must be {kind}, got {value!r} (or a list of them, one per pipeline stage)")
    return value


def strategy_pairs(value: Any, chunks: int = 1) -> tuple[tuple[str, str | tuple[str, ...]], ...]:
    """A plan's intra-op choices as sorted (choice, option) pairs, from a mapping or pairs; an
    option may be a list with one entry per model chunk (a layer choice made per stage, e.g. Mamba-2's
    "groups"; one whose `chunks` entries agree becomes that option); an InvalidConfigError names a
    malformed entry (which choices a model has, and which may differ per stage: rules/sharding.py)."""
    items = value.items() if isinstance(value, Mapping) else value
    try:
        if isinstance(value, (str, bytes)):
            raise TypeError
        pairs = [(k, v) for k, v in items]
    except (TypeError, ValueError):
        raise InvalidConfigError(f"strategies must be a mapping {{choice: option}}, e.g. {{'head': 'replicate'}}; "
                                 f"got {value!r}") from None
    for k, v in pairs:
        if not isinstance(k, str) or not (isinstance(v, str) or (isinstance(v, (list, tuple)) and v and
                                                                 all(isinstance(x, str) for x in v))):
            raise InvalidConfigError(f"strategies must map choice names to option names (strings, or a list of them "
                                     f"with one per pipeline stage); got {k!r}: {v!r}")
    pairs = [(k, _per_stage_value(v, chunks, lambda x: isinstance(x, str), f"strategies[{k!r}]")) for k, v in pairs]
    if len({k for k, _ in pairs}) != len(pairs):
        raise InvalidConfigError(f"strategies names a choice twice: {pairs}")
    return tuple(sorted(pairs))


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """A parallel layout for one model on one cluster, and what it is predicted to cost.

    Its fields, what each must be and its JSON are `PLAN_FIELDS` (below): one entry per field, which
    this class's checks, `to_json` / `from_json`, `api.PLAN_KEYS` and the cost model's `Layout` read.
    `placements` maps an op group (e.g. "attn.q_proj", "lm_head") to its placement name ("colwise", "vocab").
    """

    model: str
    fingerprint: str
    hardware: str
    devices: int
    global_batch: int
    seq_len: int
    mesh: Mesh
    micro_batch: int = 1
    zero: int = 0
    offload_optimizer: bool = False
    recompute: Recompute = Recompute.NONE
    precision: Precision = Precision.AUTO
    fp8_recipe: Fp8Recipe | None = None
    schedule: Schedule = Schedule.ONE_F_ONE_B
    virtual_stages: int = 1
    sequence_parallel: bool | tuple[bool, ...] = False  # or one per model chunk (`stage_sequence_parallel`)
    # {choice: option}; a layer choice ("groups") may name one option per model chunk (`stage_strategies`)
    strategies: tuple[tuple[str, str | tuple[str, ...]], ...] = ()
    stages: tuple[Stage, ...] = ()
    placements: tuple[tuple[str, str], ...] = ()
    predicted: Mapping[str, Any] = field(default_factory=dict)
    solver: Mapping[str, Any] = field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        check_fields(self, PLAN_FIELDS)
        if self.mesh.size != self.devices:
            raise InvalidConfigError(
                f"mesh {self.mesh.as_dict()} multiplies to {self.mesh.size}, but devices is {self.devices}"
            )
        why = offload_violation(self.offload_optimizer, self.zero)
        if why:
            raise InvalidConfigError(why)
        chunks = self.chunks
        object.__setattr__(self, "sequence_parallel", _per_stage_value(
            self.sequence_parallel, chunks, lambda x: isinstance(x, bool), "sequence_parallel"))
        object.__setattr__(self, "fp8_recipe", fp8_recipe_of(self.precision, self.fp8_recipe))
        object.__setattr__(self, "strategies", strategy_pairs(self.strategies, chunks))
        check_schedule(self.schedule, self.virtual_stages, pp=self.mesh.pp)
        if self.stages and len(self.stages) != self.mesh.pp * self.virtual_stages:
            raise InvalidConfigError(
                f"the plan has {len(self.stages)} stages but pp ({self.mesh.pp}) x virtual_stages "
                f"({self.virtual_stages}) = {self.mesh.pp * self.virtual_stages}; give one Stage per model chunk "
                "(or none for an even split)")
        if self.stages:  # the split itself; its layer count is checked against the model (rules/validity.check_plan)
            check_stages(self.stages, num_layers=self.stages[-1].end_layer, pp=self.chunks)

    @property
    def chunks(self) -> int:
        """Pipeline stages (model chunks) in all: pp * virtual_stages."""
        return self.mesh.pp * self.virtual_stages

    @property
    def stage_sequence_parallel(self) -> tuple[bool, ...]:
        """Sequence parallelism of every model chunk (model order)."""
        return per_stage(self.sequence_parallel, self.chunks)

    @property
    def per_stage(self) -> bool:
        """Whether the stages differ in a layer choice (sequence parallelism, a strategies list)."""
        return isinstance(self.sequence_parallel, tuple) or any(isinstance(v, tuple) for _, v in self.strategies)

    def stage_strategies(self, index: int) -> tuple[tuple[str, str], ...]:
        """The intra-op choices of model chunk `index`, one option each."""
        return tuple((k, v[index] if isinstance(v, tuple) else v) for k, v in self.strategies)

    # -- JSON -------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        """The plan file's object: one key per field of PLAN_FIELDS, in its order (an optional one only when set)."""
        out = {}
        for f in PLAN_FIELDS:
            value = getattr(self, f.name)
            if not (f.optional and value is None):
                out[f.name] = f.written(value)
        return out

    def save(self, path: str | Path) -> None:
        try:
            Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")
        except OSError as e:
            raise PlanFileError(f"cannot write plan file {path}: {e.strerror}") from None

    @classmethod
    def from_json(cls, data: Any, *, source: str = "plan") -> Plan:
        return _plan_from_json(data, source=source)

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        return _plan_from_json(read_plan_json(path), source=str(path))


def offload_violation(offload_optimizer: bool, zero: int) -> str | None:
    """Why optimizer offload cannot go with ZeRO level `zero` (FSDP2 offloads ZeRO-3's shards), or None."""
    if offload_optimizer and zero != 3:
        return (f"offload_optimizer needs zero=3 (FSDP2 offloads the ZeRO-3 shards), got zero={zero}; set zero=3 or "
                "drop offload_optimizer")
    return None


def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    return float(value) if hasattr(value, "__float__") else str(value)  # a SymPy number, numpy scalar


# -- the plan's fields, defined once -------------------------------------------------------------------------

@dataclass(frozen=True, slots=True, kw_only=True)
class PlanField:
    """One field of a plan: `name` is its attribute, its JSON key and (with `key`) its key in
    `parallelize(plan={...})`; its type and default are the dataclass's own."""

    name: str
    doc: str  # its entry in docs/plan_format.md (tests/test_plan_fields.py holds the doc to every field)
    form: str = ""  # what its JSON must be, for the docs, where `check` / `enum` do not say it (a structure)
    check: Check | None = None  # what the value must be; None: a structure its class checks (mesh, stages, ...)
    enum: type[Enum] | None = None  # an enum field: a member or its value, read into the member
    key: bool = False  # a plan key of parallelize(plan={...}) / autoshard.backend (api.PLAN_KEYS)
    optional: bool = False  # written only when set (not None), so the files of other plans stay as they were
    written_only: bool = False  # what the other fields imply (a property): written for the file's reader, never read
    written: Callable[[Any], Any] = _jsonable  # the value -> its JSON
    read: Callable[[Any], Any] | None = None  # its JSON -> the value the class takes (None: as it is)

    def parse(self, value: Any, what: str | None = None) -> Any:
        """`value` as this field holds it (an enum's member), or InvalidConfigError naming `what` (the field's name)."""
        what = what or self.name
        if self.enum is not None:
            return value if isinstance(value, self.enum) else _enum_field(self.enum, value, what)
        if self.check is not None:
            self.check.check(what, value)
        return value


def fields_table(fields: tuple[PlanField, ...]) -> str:
    """The markdown table of `fields` (name, what it must be, doc) that docs/plan_format.md carries."""
    def must(f: PlanField) -> str:
        if f.form:
            return f.form
        if f.enum is not None:
            return ", ".join(f"`{m.value}`" for m in f.enum)
        return "(implied by the others; written, not read)" if f.written_only else f.check.phrase if f.check else ""

    rows = [f"| `{f.name}` | {must(f)} | {f.doc} |" for f in fields]
    return "\n".join(["| field | must be | what it is |", "| --- | --- | --- |", *rows])


def check_fields(obj: Any, fields: tuple[PlanField, ...]) -> None:
    """Every field of `fields` of the frozen dataclass `obj` checked, an enum's value read into its member
    (`PlanField.parse`, inlined: the planner builds ~10^5 layouts)."""
    for f in fields:
        value = getattr(obj, f.name)
        if f.enum is not None:
            if not isinstance(value, f.enum):
                object.__setattr__(obj, f.name, _enum_field(f.enum, value, f.name))
        elif f.check is not None and not f.check.ok(value):
            raise InvalidConfigError(f.check.violation(f.name, value))


def _mesh_from_json(value: Any) -> Mesh:
    if not isinstance(value, dict):
        raise InvalidConfigError(f"field 'mesh' must be an object {{axis: degree}}, found {value!r}")
    unknown = set(value) - set(AXES)
    if unknown:
        raise InvalidConfigError(f"mesh has unknown axes {sorted(unknown)}; known axes are {', '.join(AXES)}")
    return Mesh(**{axis: value.get(axis, 1) for axis in AXES})


def _stages_from_json(value: Any) -> tuple[Stage, ...]:
    if not isinstance(value, list):
        raise InvalidConfigError(f"field 'stages' must be a list of stage objects, found {type(value).__name__}")
    return tuple(_stage_from_json(st, i) for i, st in enumerate(value))


def _placements_from_json(value: Any) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise InvalidConfigError("field 'placements' must be an object {op group: placement name}")
    return tuple((str(k), v) for k, v in value.items())


_MESH = Check("a Mesh (autoshard.ir.Mesh)", lambda v: isinstance(v, Mesh))
_ZERO_LEVEL = Check("0, 1, 2 or 3", lambda v: v in (0, 1, 2, 3) and is_int(v))
_OBJECT = Check("a mapping", lambda v: isinstance(v, Mapping))

# In the plan file's order.
PLAN_FIELDS: tuple[PlanField, ...] = (
    PlanField(name="schema_version", check=POSITIVE_INT,
              doc="2; a newer one is refused, a version-1 file loads with the defaults of precision, schedule and "
                  "virtual_stages"),
    PlanField(name="model", check=TEXT, doc="the preset or `package.module:factory` the plan was made for"),
    PlanField(name="fingerprint", check=TEXT,
              doc="16 hex digits: sha256 of module tree + parameter names/shapes/dtypes (autoshard/fingerprint.py)"),
    PlanField(name="hardware", check=TEXT, doc="the device profile (a name or profile.json)"),
    PlanField(name="devices", check=POSITIVE_INT, doc="the world size the plan runs on"),
    PlanField(name="global_batch", check=POSITIVE_INT, doc="sequences per optimizer step"),
    PlanField(name="seq_len", check=POSITIVE_INT, doc="tokens per sequence"),
    PlanField(name="mesh", check=_MESH, form="an object of positive integers", written=Mesh.as_dict,
              read=_mesh_from_json, doc="{dp, pp, tp, cp, ep}, multiplying to devices (an axis left out is 1)"),
    PlanField(name="micro_batch", check=POSITIVE_INT, key=True, doc="sequences per micro-batch of a dp replica"),
    PlanField(name="zero", check=_ZERO_LEVEL, key=True, doc="ZeRO level 0-3"),
    PlanField(name="offload_optimizer", check=BOOLEAN, key=True,
              doc="ZeRO-3 shards and optimizer state in host memory (runtime/zero3.py); needs zero 3"),
    PlanField(name="recompute", enum=Recompute, key=True,
              doc="the plan-wide recompute level (a stage's own when stages are given)"),
    PlanField(name="precision", enum=Precision, key=True, doc="bf16-mixed, fp32, fp8 or auto (the device's own)"),
    PlanField(name="schedule", enum=Schedule, key=True, doc="the pipeline schedule"),
    PlanField(name="virtual_stages", check=POSITIVE_INT, key=True, doc="model chunks per pipeline rank"),
    PlanField(name="sequence_parallel", key=True, form="true or false, or a list of them (one per model chunk)",
              doc="Megatron-LM sequence parallelism (\"Per-stage choices\" below)"),
    PlanField(name="strategies", key=True, form="an object {choice: option, or a list of options per chunk}",
              written=lambda pairs: {k: _jsonable(v) for k, v in pairs},
              doc="intra-op choices of the model's sharding table (rules/sharding.py CHOICES)"),
    PlanField(name="stages", form="a list of {first_layer, end_layer, embed, head, recompute}",
              written=lambda stages: [{**dataclasses.asdict(st), "recompute": st.recompute.value} for st in stages],
              read=_stages_from_json, doc="pp * virtual_stages model chunks in model order, or none for an even split"),
    PlanField(name="placements", form="an object of strings", written=dict, read=_placements_from_json,
              doc="{op group: placement}"),
    PlanField(name="predicted", check=_OBJECT, form="an object",
              doc="what the plan is predicted to cost (PREDICTED_FIELDS)"),
    PlanField(name="solver", check=_OBJECT, form="an object", doc="how it was solved, and the runner-up (SOLVER_FIELDS)"),
    PlanField(name="fp8_recipe", key=True, optional=True, form="`tensorwise` or `rowwise` (written only under fp8)",
              doc="torchao's float8 recipe, precision fp8 only (tensorwise by default)"),
)
PLAN_FIELD = {f.name: f for f in PLAN_FIELDS}
PLAN_FILE_KEYS = frozenset(PLAN_FIELD)  # what Plan.to_json writes
_REQUIRED = tuple(f.name for f in dataclasses.fields(Plan)
                  if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)


def _plan_from_json(data: Any, *, source: str) -> Plan:
    """The Plan of a plan file's object: each field read by its PlanField, then checked by Plan itself."""
    def bad(msg: str) -> PlanFileError:
        return PlanFileError(f"{source}: {msg}")

    if not isinstance(data, dict):
        raise bad(f"expected a JSON object at the top level, found {type(data).__name__}")
    version = data.get("schema_version")
    why = POSITIVE_INT.violation("field 'schema_version'", version, verb="found")
    if why:
        raise bad(f"{why}; is this an autoshard plan file?")
    if version > SCHEMA_VERSION:
        raise bad(f"schema_version {version} is newer than this autoshard understands ({SCHEMA_VERSION}); "
                  "upgrade autoshard or re-export the plan with this version")
    unknown = sorted(set(data) - PLAN_FILE_KEYS)
    if unknown:  # a misspelt field would silently take its default
        raise bad(f"unknown field(s) {unknown}; a plan file has {', '.join(sorted(PLAN_FILE_KEYS))}")
    missing = [name for name in _REQUIRED if name not in data]
    if missing:
        raise bad(f"missing field(s) {missing}; re-export the plan with `autoshard plan --out`")
    for key, schema in (("predicted", PREDICTED_FIELDS), ("solver", SOLVER_FIELDS)):
        why = _section_violation(data.get(key, {}), schema, key)
        if why:
            raise bad(f"{why}; re-export the plan with `autoshard plan --out`")
    values = {}
    for f in PLAN_FIELDS:  # an older file's absent field takes the default (schema 1: precision, schedule, chunks)
        if f.name in data and f.name != "schema_version":  # a loaded plan is of this version
            try:
                values[f.name] = f.read(data[f.name]) if f.read else data[f.name]
            except InvalidConfigError as e:
                raise bad(str(e)) from None
    try:
        return Plan(**values)
    except InvalidConfigError as e:
        raise bad(f"invalid plan: {e}") from None


def _stage_from_json(st: Any, i: int) -> Stage:
    fields = {"first_layer": is_int, "end_layer": is_int, "embed": lambda v: isinstance(v, bool),
              "head": lambda v: isinstance(v, bool)}
    if isinstance(st, dict) and set(st) - {*fields, "recompute"}:
        raise InvalidConfigError(f"stage {i} has unknown field(s) {sorted(set(st) - {*fields, 'recompute'})}; a stage "
                                 "has first_layer, end_layer, embed, head, recompute")
    if not isinstance(st, dict) or not all(k in st and ok(st[k]) for k, ok in fields.items()):
        raise InvalidConfigError(f"stage {i} must be an object with integer first_layer, end_layer and boolean "
                                 f"embed, head; found {st!r}")
    return Stage(first_layer=st["first_layer"], end_layer=st["end_layer"], embed=st["embed"], head=st["head"],
                 recompute=_enum_field(Recompute, st.get("recompute", "none"), f"stage {i} recompute"))


# -- the informational sections: what `show` reads, and the type each field must have -------------------------

_KINDS = {
    "a finite number": is_number,
    "an integer": is_int,
    "a string": lambda v: isinstance(v, str),
    "a boolean": lambda v: isinstance(v, bool),
    "a list of finite numbers": lambda v: isinstance(v, list) and all(map(is_number, v)),
    "an object of finite numbers": lambda v: isinstance(v, dict) and all(map(is_number, v.values())),
    "an object {axis: positive integer}": lambda v: isinstance(v, dict) and set(v) <= set(AXES) and all(
        map(is_positive_int, v.values())),
}
PREDICTED_FIELDS: dict[str, Any] = {
    "step_time_s": "a finite number", "tokens_per_s": "a finite number", "mfu": "a finite number",
    "memory_gb": "a finite number", "stage_time_s": "a list of finite numbers",
    "stage_memory_gb": "a list of finite numbers", "microbatches": "an integer", "fits": "a boolean",
    "time_breakdown_s": "an object of finite numbers", "memory_breakdown_gb": "an object of finite numbers",
}
RUNNER_UP_FIELDS: dict[str, Any] = {
    "mesh": "an object {axis: positive integer}", "zero": "an integer", "micro_batch": "an integer",
    "step_time_s": "a finite number", "why": "a string",
}
SOLVER_FIELDS: dict[str, Any] = {
    "status": "a string", "gap": "a finite number", "solve_time_s": "a finite number", "layouts": "an integer",
    "layouts_solved": "an integer", "layouts_pruned_by_memory": "an integer", "objective_s": "a finite number",
    "runner_up": RUNNER_UP_FIELDS,
}
_RUNNER_UP_REQUIRED = ("mesh", "step_time_s", "why")


def _section_violation(section: Any, schema: Mapping[str, Any], where: str) -> str | None:
    """Why `section` (an informational part of a plan file) does not match `schema`, or None; fields the
    schema does not name are kept as they are."""
    if not isinstance(section, dict):
        return f"field {where!r} must be an object, found {section!r}"
    for key, kind in schema.items():
        if key not in section:
            continue
        value = section[key]
        if isinstance(kind, Mapping):  # a nested object (the runner-up), or null
            if value is None:
                continue
            missing = [k for k in _RUNNER_UP_REQUIRED if not isinstance(value, dict) or k not in value]
            if missing:
                return f"'{where}.{key}' must be an object with {', '.join(_RUNNER_UP_REQUIRED)}, found {value!r}"
            why = _section_violation(value, kind, f"{where}.{key}")
            if why:
                return why
        elif not _KINDS[kind](value):
            return f"'{where}.{key}' must be {kind}, found {value!r}"
    return None

