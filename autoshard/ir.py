"""Frozen dataclasses shared by the passes: the mesh, per-node costs, and the Plan.

Terms: an *axis* is a mesh axis (dp, pp, tp, cp, ep); a *dim* is a tensor dimension.
`b` and `s` are the SymPy symbols for micro-batch size and sequence length used by every
cost expression. A `Plan` is what `solve` decides and `rewrite` carries out; it is JSON
(never pickle) with a schema version, and refers to layers and op groups by stable names.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Mapping

import sympy

from autoshard.errors import InvalidConfigError, PlanFileError

B, S = sympy.symbols("b s", positive=True, integer=True)

AXES = ("dp", "pp", "tp", "cp", "ep")
SCHEMA_VERSION = 1


class Recompute(str, Enum):
    NONE = "none"
    SELECTIVE = "selective"  # rerun the attention module / Mamba-2 mixer (projections included) in backward
    FULL = "full"  # keep only each block's input; rerun the block's forward in backward


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
            value = getattr(self, axis)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidConfigError(f"mesh axis {axis} must be a positive integer, got {value!r}")

    @property
    def size(self) -> int:
        return self.dp * self.pp * self.tp * self.cp * self.ep

    def as_dict(self) -> dict[str, int]:
        return {axis: getattr(self, axis) for axis in AXES}

    def __str__(self) -> str:
        return " ".join(f"{axis}{getattr(self, axis)}" for axis in AXES if getattr(self, axis) > 1) or "single"


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeCost:
    """Cost of one aten node of the captured graph, as SymPy expressions in `B` and `S`.

    `phase` is "fwd" or "bwd". `saved_bytes` is what this (forward) node's output keeps
    alive for the backward pass (0 for nodes whose output backward does not read).
    `gemm` is (batch, m, n, k) for matmul-like nodes: the shape GEMM efficiency depends on.
    """

    name: str
    target: str
    kind: OpKind
    phase: str
    module_path: str
    block: int | None
    flops: sympy.Expr
    bytes_read: sympy.Expr
    bytes_written: sympy.Expr
    saved_bytes: sympy.Expr
    gemm: tuple[sympy.Expr, sympy.Expr, sympy.Expr, sympy.Expr] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockCost:
    """The nodes of one block of the model; a LAYER block stands for `count` identical layers."""

    name: str
    kind: BlockKind
    count: int
    params: int  # parameter count of ONE instance of the block
    nodes: tuple[NodeCost, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class CostTable:
    """Per-block symbolic costs of one training step (forward and backward) of a model."""

    model: str
    blocks: tuple[BlockCost, ...]

    def block(self, kind: BlockKind) -> BlockCost:
        for block in self.blocks:
            if block.kind is kind:
                return block
        raise KeyError(kind)


@dataclass(frozen=True, slots=True, kw_only=True)
class Stage:
    """One pipeline stage: layers [first_layer, end_layer), plus embedding / head if it holds them."""

    first_layer: int
    end_layer: int
    embed: bool
    head: bool
    recompute: Recompute = Recompute.NONE

    @property
    def layers(self) -> int:
        return self.end_layer - self.first_layer


def even_stages(layers: int, pp: int, *, recompute: Recompute = Recompute.NONE) -> tuple[Stage, ...]:
    """The default split: `layers` over `pp` stages, the first `layers % pp` one layer longer,
    every stage at recompute level `recompute`."""
    if pp < 1:
        raise InvalidConfigError(f"pp must be a positive integer, got {pp}")
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


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """A parallel layout for one model on one cluster, and what it is predicted to cost.

    `placements` maps an op group (e.g. "attn.q_proj", "mlp.down_proj", "embed", "lm_head")
    to its placement name (e.g. "colwise", "rowwise", "vocab", "replicate").
    `predicted` holds step_time_s, memory_gb, mfu, tokens_per_s and a breakdown.
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
    recompute: Recompute = Recompute.NONE
    stages: tuple[Stage, ...] = ()
    placements: tuple[tuple[str, str], ...] = ()
    predicted: Mapping[str, Any] = field(default_factory=dict)
    solver: Mapping[str, Any] = field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        if self.mesh.size != self.devices:
            raise InvalidConfigError(
                f"mesh {self.mesh.as_dict()} multiplies to {self.mesh.size}, but devices is {self.devices}"
            )
        if self.zero not in (0, 1, 2, 3):
            raise InvalidConfigError(f"zero must be 0, 1, 2 or 3, got {self.zero!r}")
        if self.micro_batch < 1:
            raise InvalidConfigError(f"micro_batch must be >= 1, got {self.micro_batch}")

    # -- JSON -------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version,
            "model": self.model,
            "fingerprint": self.fingerprint,
            "hardware": self.hardware,
            "devices": self.devices,
            "global_batch": self.global_batch,
            "seq_len": self.seq_len,
            "mesh": self.mesh.as_dict(),
            "micro_batch": self.micro_batch,
            "zero": self.zero,
            "recompute": self.recompute.value,
            "stages": [
                {**dataclasses.asdict(st), "recompute": st.recompute.value} for st in self.stages
            ],
            "placements": dict(self.placements),
            "predicted": _jsonable(self.predicted),
            "solver": _jsonable(self.solver),
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def from_json(cls, data: Any, *, source: str = "plan") -> Plan:
        return _plan_from_json(data, source=source)

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        path = Path(path)
        try:
            raw = path.read_bytes()
        except OSError as e:
            raise PlanFileError(f"cannot read plan file {path}: {e.strerror}") from None
        if raw[:1] == b"\x80" or raw[:2] in (b"PK",):
            raise PlanFileError(f"{path} looks like a pickle/zip, not JSON; autoshard plan files are JSON only "
                                "(write one with `autoshard plan ... --out plan.json`)")
        try:
            data = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise PlanFileError(f"{path} is not a valid JSON plan file: {e}") from None
        return _plan_from_json(data, source=str(path))


def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    return float(value) if isinstance(value, sympy.Basic) else str(value)


def _plan_from_json(data: Any, *, source: str) -> Plan:
    def bad(msg: str) -> PlanFileError:
        return PlanFileError(f"{source}: {msg}")

    if not isinstance(data, dict):
        raise bad(f"expected a JSON object at the top level, found {type(data).__name__}")
    version = data.get("schema_version")
    if not isinstance(version, int):
        raise bad("missing integer field 'schema_version'; is this an autoshard plan file?")
    if version > SCHEMA_VERSION:
        raise bad(f"schema_version {version} is newer than this autoshard understands ({SCHEMA_VERSION}); "
                  "upgrade autoshard or re-export the plan with this version")
    required = {"model": str, "fingerprint": str, "hardware": str, "devices": int, "global_batch": int,
                "seq_len": int, "mesh": dict}
    for key, typ in required.items():
        if not isinstance(data.get(key), typ):
            raise bad(f"field {key!r} must be a {typ.__name__}, found {data.get(key)!r}")
    mesh_data = data["mesh"]
    unknown = set(mesh_data) - set(AXES)
    if unknown:
        raise bad(f"mesh has unknown axes {sorted(unknown)}; known axes are {', '.join(AXES)}")
    try:
        mesh = Mesh(**{axis: mesh_data.get(axis, 1) for axis in AXES})
        stages = tuple(
            Stage(first_layer=int(st["first_layer"]), end_layer=int(st["end_layer"]), embed=bool(st["embed"]),
                  head=bool(st["head"]), recompute=Recompute(st.get("recompute", "none")))
            for st in data.get("stages", [])
        )
        placements = data.get("placements", {})
        if not isinstance(placements, dict):
            raise bad("field 'placements' must be an object {op group: placement}")
        return Plan(
            model=data["model"], fingerprint=data["fingerprint"], hardware=data["hardware"],
            devices=data["devices"], global_batch=data["global_batch"], seq_len=data["seq_len"], mesh=mesh,
            micro_batch=int(data.get("micro_batch", 1)), zero=int(data.get("zero", 0)),
            recompute=Recompute(data.get("recompute", "none")), stages=stages,
            placements=tuple((str(k), str(v)) for k, v in placements.items()),
            predicted=data.get("predicted", {}), solver=data.get("solver", {}), schema_version=version,
        )
    except PlanFileError:
        raise
    except (InvalidConfigError, KeyError, TypeError, ValueError) as e:
        raise bad(f"invalid plan: {e}") from None
