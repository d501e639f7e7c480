"""`InferencePlan`: a serving configuration and what it is predicted to cost (JSON, never pickle).

Written by `autoshard plan --inference`, explained by `autoshard show`. Same conventions as
`ir.Plan` (frozen, `to_json` / `from_json` / `save` / `load`, a schema version, `PlanFileError`
for a malformed file), told apart by `"kind": "inference"`. The usual plan fields (model,
fingerprint, hardware, devices, mesh) plus:

* `pools`: one `Pool` per role -- ("both",) when prefill and decode share the devices
  (colocated), ("prefill", "decode") when they are disaggregated. A pool is `replicas` copies
  of a tp x pp x ep replica serving `batch` sequences at once (ep 1 unless the model is a
  mixture of experts; absent in older plan files: 1). `mesh` is the colocated pool's
  (dp = replicas), or the decode pool's when disaggregated.
* `prompt_len`, `output_len`, `ttft_slo_s`, `tpot_slo_s`: what the plan was made for.
* `predicted`: ttft_s, tpot_s, throughput_tokens_per_s, memory_gb and memory_breakdown_gb
  (weights, cache, activations) of the busiest device, batch, the time breakdowns;
  `solver`: the runner-up and why it lost, layouts priced, seconds taken.

Each replica runs `autoshard.parallelize(model, ids, plan=plan)` (the `InferencePlan` or its
file) on its tp * pp * ep ranks, then `dm.generate(...)`: `parallelize` takes the replica's
`Plan` from `replica_training_plan` and checks it with the generation rules (`validity.check_plan(...,
generate=True)`), not the training batch rules, so any batch generates; such a model generates and
evaluates but does not train. `replica_plan(role)` is the bare {"tp", "pp", "ep"} of a replica.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from autoshard.errors import PlanFileError
from autoshard.ir import Mesh, Plan, _jsonable, is_positive_int
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
        return {
            "schema_version": self.schema_version, "kind": "inference", "model": self.model,
            "fingerprint": self.fingerprint, "hardware": self.hardware, "devices": self.devices,
            "mesh": self.mesh.as_dict(), "mode": "disaggregated" if self.disaggregated else "colocated",
            "batch": self.pools[-1].batch, "prompt_len": self.prompt_len, "output_len": self.output_len,
            "ttft_slo_s": self.ttft_slo_s, "tpot_slo_s": self.tpot_slo_s,
            "pools": [{"role": p.role, "tp": p.tp, "pp": p.pp, "ep": p.ep, "replicas": p.replicas, "batch": p.batch}
                      for p in self.pools],
            "predicted": _jsonable(self.predicted), "solver": _jsonable(self.solver),
        }

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
            pools = tuple(Pool(role=str(p["role"]), tp=int(p["tp"]), pp=int(p["pp"]), ep=int(p.get("ep", 1)),
                               replicas=int(p["replicas"]), batch=int(p["batch"])) for p in data["pools"])
            return cls(model=str(data["model"]), fingerprint=str(data["fingerprint"]), hardware=str(data["hardware"]),
                       devices=int(data["devices"]), prompt_len=int(data["prompt_len"]),
                       output_len=int(data["output_len"]), ttft_slo_s=float(data["ttft_slo_s"]),
                       tpot_slo_s=float(data["tpot_slo_s"]), pools=pools, predicted=dict(data.get("predicted", {})),
                       solver=dict(data.get("solver", {})))
        except (KeyError, TypeError, ValueError) as e:
            raise PlanFileError(f"{source}: malformed inference plan ({type(e).__name__}: {e})") from None

    @classmethod
    def load(cls, path: str | Path) -> InferencePlan:
        return cls.from_json(read_plan_json(path), source=str(path))


FILE_KEYS = frozenset(("schema_version", "kind", "model", "fingerprint", "hardware", "devices", "mesh", "mode", "batch",
                       "prompt_len", "output_len", "ttft_slo_s", "tpot_slo_s", "pools", "predicted", "solver"))
POOL_KEYS = frozenset(("role", "tp", "pp", "ep", "replicas", "batch"))


def _fields_violation(data: Mapping) -> str | None:
    """What is wrong with an inference plan's fields (None: nothing): unknown keys (a misspelt one would
    take its default), sizes that are not positive integers (`true`, 2.5 and "2" included: int() would
    take them), targets that are not positive finite seconds."""
    import math

    def count(value) -> bool:
        return is_positive_int(value)

    unknown = sorted(set(data) - FILE_KEYS)
    if unknown:
        return f"unknown field(s) {unknown}; an inference plan has {', '.join(sorted(FILE_KEYS))}"
    for key in ("devices", "prompt_len", "output_len"):
        if key in data and not count(data[key]):
            return f"field {key!r} must be a positive integer, found {data[key]!r}"
    for key in ("ttft_slo_s", "tpot_slo_s"):
        value = data.get(key)
        if key in data and (isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf):
            return f"field {key!r} must be a positive finite number of seconds, found {value!r}"
    pools = data.get("pools")
    if not isinstance(pools, list) or not all(isinstance(p, Mapping) for p in pools):
        return f"field 'pools' must be a list of pool objects, found {pools!r}"
    for i, pool in enumerate(pools):
        unknown = sorted(set(pool) - POOL_KEYS)
        if unknown:
            return f"pool {i}: unknown field(s) {unknown}; a pool has {', '.join(sorted(POOL_KEYS))}"
        for key in ("tp", "pp", "ep", "replicas", "batch"):
            if key in pool and not count(pool[key]):
                return f"pool {i}: field {key!r} must be a positive integer, found {pool[key]!r}"
    return None


def is_inference_plan(plan: Any) -> bool:
    """Whether `plan` is an `InferencePlan` or names a file of one ("kind": "inference"). Never
    raises: a file that cannot be read is left to the loader, which names the problem."""
    if isinstance(plan, InferencePlan):
        return True
    if not isinstance(plan, (str, Path)):
        return False
    try:
        data = read_plan_json(plan)
    except PlanFileError:
        return False
    return isinstance(data, Mapping) and data.get("kind") == "inference"
