"""`InferencePlan`: a serving configuration and what it is predicted to cost (JSON, never pickle).

Written by `autoshard plan --inference`, explained by `autoshard show`. Same conventions as
`ir.Plan` (frozen, `to_json` / `from_json` / `save` / `load`, a schema version, `PlanFileError`
for a malformed file), told apart by `"kind": "inference"`.

The whole contract: docs/modules/package.md (inference_plan.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from autoshard.errors import InvalidConfigError, PlanFileError
from autoshard.ir import POSITIVE_INT, TEXT, Check, Mesh, Plan, PlanField, check_fields, is_positive_number
from autoshard.json_file import read_plan_json

INFERENCE_SCHEMA_VERSION = 1
ROLES = ("both", "prefill", "decode")


@dataclass(frozen=True, slots=True, kw_only=True)
class Pool:
    role: str  # "both" | "prefill" | "decode"
    tp: int
    pp: int
    replicas: int
    batch: int
    ep: int = 1

    def __post_init__(self) -> None:
        check_fields(self, POOL_FIELDS)

    @property
    def devices(self) -> int:
        return self.tp * self.pp * self.ep * self.replicas


@dataclass(frozen=True, slots=True, kw_only=True)
class InferencePlan:
    model: str
    fingerprint: str
    hardware: str
    devices: int
    prompt_len: int
    output_len: int
    ttft_slo_s: float
    tpot_slo_s: float
    pools: tuple[Pool, ...]
    predicted: Mapping[str, Any] = field(default_factory=dict)
    solver: Mapping[str, Any] = field(default_factory=dict)
    schema_version: int = INFERENCE_SCHEMA_VERSION

    def __post_init__(self) -> None:
        check_fields(self, INFERENCE_FIELDS)
        used = sum(p.devices for p in self.pools)
        if used != self.devices:
            raise PlanFileError(f"the pools use {used} devices but the plan has {self.devices}")
        if tuple(p.role for p in self.pools) not in (("both",), ("prefill", "decode")):
            raise PlanFileError(f"pools must be one 'both' pool or a 'prefill' and a 'decode' pool, got "
                                f"{[p.role for p in self.pools]}")

    @property
    def disaggregated(self) -> bool:
        return len(self.pools) == 2

    @property
    def mesh(self) -> Mesh:
        pool = self.pools[-1]
        return Mesh(dp=pool.replicas, pp=pool.pp, tp=pool.tp, ep=pool.ep)

    @property
    def kind(self) -> str:
        return "inference"  # what tells the file from a training plan's

    @property
    def mode(self) -> str:
        return "disaggregated" if self.disaggregated else "colocated"

    @property
    def batch(self) -> int:
        """Sequences at once in a replica of the served pool."""
        return self.pools[-1].batch

    def pool(self, role: str) -> Pool:
        for p in self.pools:
            if p.role == role or p.role == "both":
                return p
        raise PlanFileError(f"the plan has no {role!r} pool; its pools are {[p.role for p in self.pools]}")

    def replica_plan(self, role: str = "decode") -> dict[str, int]:
        """The plan of one replica of pool `role` for `autoshard.parallelize` (dp = cp = 1)."""
        pool = self.pool(role)
        return {"tp": pool.tp, "pp": pool.pp, **({"ep": pool.ep} if pool.ep > 1 else {})}

    def replica_training_plan(self, *, world: int, seq_len: int, fingerprint: str, strategies=()) -> Plan:
        """The `Plan` one replica of the served pool runs under `parallelize` (the colocated pool, or
        the decode pool of a disaggregated plan: the one autoshard's runtime serves): mesh tp x pp x
        ep, global batch the pool's batch (informative: generation takes any batch), `strategies` the intra-op
        choices it runs (`sharding.runnable_strategies` at the pool's tp: the inference planner prices those).
        PlanFileError when `world` ranks are not one replica or the plan was made for another model."""
        from autoshard.fingerprint import check_plan_matches

        pool = self.pools[-1]
        size = pool.tp * pool.pp * pool.ep
        if world != size:
            raise PlanFileError(f"the inference plan's {pool.role} replicas are tp{pool.tp} x pp{pool.pp} x ep{pool.ep} "
                                f"= {size} ranks each, but this world has {world}; start {size} ranks per replica "
                                f"(the plan has {pool.replicas} replica(s))")
        plan = Plan(model=self.model, fingerprint=self.fingerprint, hardware=self.hardware, devices=size,
                    global_batch=pool.batch, seq_len=seq_len, mesh=Mesh(tp=pool.tp, pp=pool.pp, ep=pool.ep),
                    strategies=dict(strategies))
        check_plan_matches(plan, fingerprint=fingerprint, devices=world, source="the inference plan")
        return plan

    # -- JSON -------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        """One key per field of INFERENCE_FIELDS, in its order (kind, mesh, mode, batch: what the fields imply)."""
        return {f.name: f.written(getattr(self, f.name)) for f in INFERENCE_FIELDS}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def from_json(cls, data: Any, *, source: str = "plan") -> InferencePlan:
        if not isinstance(data, Mapping) or data.get("kind") != "inference":
            raise PlanFileError(f"{source}: not an inference plan (no \"kind\": \"inference\"); write one with "
                                "`autoshard plan --inference ... --out plan.json`")
        if data.get("schema_version") != INFERENCE_SCHEMA_VERSION:
            raise PlanFileError(f"{source}: inference plan schema version {data.get('schema_version')!r}, this "
                                f"autoshard reads {INFERENCE_SCHEMA_VERSION}; make the plan again")
        why = _fields_violation(data)
        if why:
            raise PlanFileError(f"{source}: {why}; make the plan again with `autoshard plan --inference --out`")
        try:
            pools = tuple(Pool(**_read(POOL_FIELDS, p)) for p in data["pools"])
            return cls(**{**_read(INFERENCE_FIELDS, data), "pools": pools})
        except (TypeError, InvalidConfigError) as e:  # a field left out (TypeError names it), a value Pool refuses
            raise PlanFileError(f"{source}: malformed inference plan ({type(e).__name__}: {e})") from None

    @classmethod
    def load(cls, path: str | Path) -> InferencePlan:
        return cls.from_json(read_plan_json(path), source=str(path))


_SECONDS = Check("a positive finite number of seconds", is_positive_number)
_ROLE = Check(f"one of {', '.join(map(repr, ROLES))}", lambda v: v in ROLES)

# In the file's order; `written_only`: what the other fields imply, written for the reader of the file, not read.
INFERENCE_FIELDS: tuple[PlanField, ...] = (
    PlanField(name="schema_version", check=POSITIVE_INT, doc="1"),
    PlanField(name="kind", written_only=True, doc='"inference": what tells the file from a training plan\'s'),
    PlanField(name="model", check=TEXT, doc="the preset or `package.module:factory` the plan was made for"),
    PlanField(name="fingerprint", check=TEXT, doc="the model's fingerprint (autoshard/fingerprint.py)"),
    PlanField(name="hardware", check=TEXT, doc="the device profile"),
    PlanField(name="devices", check=POSITIVE_INT, doc="the devices of every pool together"),
    PlanField(name="mesh", written=Mesh.as_dict, written_only=True,
              doc="the served pool's replica mesh, dp = its replicas (the decode pool's when disaggregated)"),
    PlanField(name="mode", written_only=True, doc='"colocated" or "disaggregated"'),
    PlanField(name="batch", written_only=True, doc="sequences at once in a replica of the served pool"),
    PlanField(name="prompt_len", check=POSITIVE_INT, doc="prompt tokens the plan was made for"),
    PlanField(name="output_len", check=POSITIVE_INT, doc="generated tokens the plan was made for"),
    PlanField(name="ttft_slo_s", check=_SECONDS, read=float, doc="time-to-first-token target, seconds"),
    PlanField(name="tpot_slo_s", check=_SECONDS, read=float, doc="time-per-output-token target, seconds"),
    PlanField(name="pools", form="a list of pool objects (below)",
              written=lambda pools: [{f.name: getattr(p, f.name) for f in POOL_FIELDS} for p in pools],
              doc="one per role: 'both' (colocated), or 'prefill' and 'decode' (disaggregated)"),
    PlanField(name="predicted", read=dict, form="an object",
              doc="ttft_s, tpot_s, throughput_tokens_per_s, memory_gb, memory_breakdown_gb, batch, time breakdowns"),
    PlanField(name="solver", read=dict, form="an object",
              doc="the runner-up and why it lost, layouts priced, seconds taken"),
)
POOL_FIELDS: tuple[PlanField, ...] = (
    PlanField(name="role", check=_ROLE, doc="'both', 'prefill' or 'decode'"),
    PlanField(name="tp", check=POSITIVE_INT, doc="tensor-parallel degree of a replica"),
    PlanField(name="pp", check=POSITIVE_INT, doc="pipeline stages of a replica"),
    PlanField(name="ep", check=POSITIVE_INT, doc="expert-parallel degree of a replica (1 unless a mixture of experts)"),
    PlanField(name="replicas", check=POSITIVE_INT, doc="copies of the replica"),
    PlanField(name="batch", check=POSITIVE_INT, doc="sequences a replica serves at once"),
)
FILE_KEYS = frozenset(f.name for f in INFERENCE_FIELDS)
POOL_KEYS = frozenset(f.name for f in POOL_FIELDS)


def _read(fields: tuple[PlanField, ...], data: Mapping) -> dict[str, Any]:
    """The constructor's arguments from a file's object: each field that is read and present, by its `read`."""
    return {f.name: f.read(data[f.name]) if f.read else data[f.name]
            for f in fields if not f.written_only and f.name in data and f.name != "pools"}


def _fields_violation(data: Mapping) -> str | None:
    """What is wrong with an inference plan's fields (None: nothing), named as the file's fields: unknown keys
    (a misspelt one would take its default), values their field's check refuses (`true`, 2.5 and "2" are no
    sizes: int() would take them; a target is positive finite seconds)."""
    unknown = sorted(set(data) - FILE_KEYS)
    if unknown:
        return f"unknown field(s) {unknown}; an inference plan has {', '.join(sorted(FILE_KEYS))}"
    for f in INFERENCE_FIELDS:
        why = f.check and f.name in data and f.check.violation(f"field {f.name!r}", data[f.name], verb="found")
        if why:
            return why
    pools = data.get("pools")
    if not isinstance(pools, list) or not all(isinstance(p, Mapping) for p in pools):
        return f"field 'pools' must be a list of pool objects, found {pools!r}"
    for i, pool in enumerate(pools):
        unknown = sorted(set(pool) - POOL_KEYS)
        if unknown:
            return f"pool {i}: unknown field(s) {unknown}; a pool has {', '.join(sorted(POOL_KEYS))}"
        for f in POOL_FIELDS:
            why = f.name in pool and f.check.violation(f"pool {i}: field {f.name!r}", pool[f.name], verb="found")
            if why:
                return why
    return None


def read_plan_file(path: str | Path) -> Plan | InferencePlan:
    """The plan in the file at `path`, read once: an `InferencePlan` when it says `"kind": "inference"`,
    else a training `Plan`; PlanFileError naming what is wrong."""
    data = read_plan_json(path)
    if isinstance(data, Mapping) and data.get("kind") == "inference":
        return InferencePlan.from_json(data, source=str(path))
    return Plan.from_json(data, source=str(path))
