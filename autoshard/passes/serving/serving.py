"""Serving planner: the highest-throughput configuration that meets TTFT and TPOT targets.

Contract: `plan_serving(table, spec, hw, *, devices, prompt_len, output_len, ttft_slo_s, tpot_slo_s,
disaggregation=True) -> ServingChoice`, or `InfeasiblePlanError` (one line: the best TTFT and the
best TPOT any configuration reaches, and the constraint that binds).

The whole contract: docs/modules/serving.md (passes/serving/serving.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from autoshard.errors import InfeasiblePlanError, InvalidConfigError
from autoshard.hardware import DeviceProfile
from autoshard.cost_table import CostTable
from autoshard.ir import Mesh, is_positive_int
from autoshard.model_spec import ModelSpec
from autoshard.passes.serving import inference_cost as ic
from autoshard.passes.cost.collectives import group_link
from autoshard.passes.serving.inference_cost import InferenceTable, ServeEstimate, ServeLayout
from autoshard.rules.validity import divisors, generate_violation
from autoshard.rules.sharding import runnable_strategies

MAX_BATCH = 4096  # concurrent sequences per replica searched at most


@dataclass(frozen=True, slots=True, kw_only=True)
class Candidate:
    """One configuration the planner priced: colocated (`decode` None) or disaggregated."""

    mode: str  # "colocated" | "disaggregated"
    ttft_s: float
    tpot_s: float
    throughput_tokens_per_s: float
    pools: tuple[tuple[str, ServeEstimate], ...]  # (role, estimate): ("both", ...) or prefill + decode
    limit: str  # what stopped the batch from growing (the colocated or decode pool's)
    memories: tuple[ic.ServeMemory, ...]  # per pool: the busiest device's bytes in that pool's role
    transfer_s: float = 0.0

    @property
    def shape(self) -> str:
        return " | ".join(f"{role} {e.layout.shape} x{e.layout.replicas}" for role, e in self.pools)

    def summary(self) -> str:
        batches = ", ".join(f"{role} batch {e.layout.batch}" for role, e in self.pools)
        return f"{self.mode} {self.shape} ({batches})"


@dataclass(frozen=True, slots=True, kw_only=True)
class ServingChoice:
    best: Candidate
    runner_up: Candidate | None
    why_runner_up_lost: str
    layouts_priced: int

    def predicted(self) -> dict[str, Any]:
        best = self.best
        decode = best.pools[-1][1]
        busiest = max(best.memories, key=lambda m: m.total)
        out = {"ttft_s": best.ttft_s, "tpot_s": best.tpot_s, "throughput_tokens_per_s": best.throughput_tokens_per_s,
               "memory_gb": busiest.total / 1e9, "memory_breakdown_gb": busiest.as_gb(),
               "batch": decode.layout.batch, "batch_limited_by": best.limit,
               "prefill_breakdown_s": best.pools[0][1].prefill.as_dict(),
               "decode_breakdown_s": decode.decode.as_dict()}
        if best.mode == "disaggregated":
            out["kv_transfer_s"] = best.transfer_s
        return out


def layouts(spec: ModelSpec, devices: int) -> tuple[tuple[int, int, int], ...]:
    """Every (tp, pp, ep) of one replica the runtime accepts, tp * pp * ep dividing `devices`."""
    out = []
    for tp in divisors(devices):  # ascending, from the prime factors: milliseconds even for 1e9 devices
        for pp in divisors(devices // tp):
            for ep in divisors(devices // (tp * pp)):
                if _runs(spec, tp, pp, ep):
                    out.append((tp, pp, ep))
    return tuple(out)


def _runs(spec: ModelSpec, tp: int, pp: int, ep: int = 1) -> bool:
    """Whether `DistributedModel.generate` runs one replica of tp x pp x ep (the check it makes itself)."""
    strategies = runnable_strategies(spec, tp)  # a vocabulary tp does not divide: embedding and head replicated
    if spec.is_moe and tp > 1 and (spec.ffn % tp or spec.experts_no_tp_split):  # a replica splits every
        return False  # expert's GEMMs over tp (runtime/expert_parallel.py), HF's default layout only
    return strategies is not None and generate_violation(spec, Mesh(tp=tp, pp=pp, ep=ep), strategies=strategies) is None


def transfer_seconds(it: InferenceTable, hw: DeviceProfile, *, batch: int, prompt_len: int, devices: int) -> float:
    """Moving the KV cache (attention layers, P tokens) and the conv + SSM state (Mamba-2 layers) of `batch`
    prefilled sequences from the prefill pool to the decode pool: every prefill device sends its shard at
    once, so the time is one shard over one link (intra-node when all `devices` share a node)."""
    whole = ic.stage_cache_bytes(it, ic.stages_of(it.spec, 1)[0], batch=batch, tokens=prompt_len, tp=1)
    link = group_link(hw, size=devices)  # a group spanning every device: inter-node unless they share one
    return link.latency + whole / link.bandwidth


class _Pricer:
    """Prices layouts at batches, memoised (the search asks for the same points often)."""

    def __init__(self, it: InferenceTable, spec: ModelSpec, hw: DeviceProfile, *, prompt_len: int, output_len: int):
        self.it, self.spec, self.hw, self.P, self.O = it, spec, hw, prompt_len, output_len
        self.memo: dict = {}

    def __call__(self, tp: int, pp: int, ep: int, replicas: int, batch: int) -> ServeEstimate:
        key = (tp, pp, ep, replicas, batch)
        if key not in self.memo:
            self.memo[key] = ic.estimate_serving(self.it, self.spec, self.hw,
                                                 ServeLayout(tp=tp, pp=pp, ep=ep, replicas=replicas, batch=batch),
                                                 prompt_len=self.P, output_len=self.O)
        return self.memo[key]


def largest_batch(ok, cap: int = MAX_BATCH) -> int:
    """The largest b in 1..cap with ok(b) (ok monotone: true up to some b); 0 if ok(1) is false."""
    if not ok(1):
        return 0
    lo = 1
    while lo < cap and ok(min(2 * lo, cap)):
        lo = min(2 * lo, cap)
    if lo == cap:
        return cap
    hi = min(2 * lo, cap)  # ok(lo), not ok(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def _limit(est: ServeEstimate, hw: DeviceProfile, ttft: float, tpot: float, *, decode_only=False,
           fits: bool | None = None) -> str:
    """Which target `est` (the first batch past the largest feasible one) breaks."""
    if not (est.fits if fits is None else fits):
        return f"memory (over {hw.memory_gb:.1f} GB per device at batch {est.layout.batch})"
    if not decode_only and est.ttft_s > ttft:
        return f"TTFT ({est.ttft_s * 1e3:.0f} ms > {ttft * 1e3:.0f} ms at batch {est.layout.batch})"
    if est.tpot_s > tpot:
        return f"TPOT ({est.tpot_s * 1e3:.1f} ms > {tpot * 1e3:.1f} ms at batch {est.layout.batch})"
    return f"the batch cap {MAX_BATCH}"


def _colocated(price: _Pricer, hw, tp, pp, ep, replicas, ttft, tpot) -> Candidate | None:
    def ok(b):
        e = price(tp, pp, ep, replicas, b)
        return e.fits and e.ttft_s <= ttft and e.tpot_s <= tpot

    b = largest_batch(ok)
    if b == 0:
        return None
    e = price(tp, pp, ep, replicas, b)
    limit = _limit(price(tp, pp, ep, replicas, b + 1), hw, ttft, tpot) if b < MAX_BATCH else f"the batch cap {MAX_BATCH}"
    return Candidate(mode="colocated", ttft_s=e.ttft_s, tpot_s=e.tpot_s,
                     throughput_tokens_per_s=e.throughput_tokens_per_s, pools=(("both", e),), limit=limit,
                     memories=(e.memory,))


def _disaggregated(price: _Pricer, spec, hw, grid, devices, ttft, tpot) -> Candidate | None:
    """The best split into a prefill pool and a decode pool (docs/modules/serving.md)."""
    P, O = price.P, price.O
    prefill, decode = {}, {}  # (tp, pp, ep) -> (requests/s per replica, estimate, limit)
    for tp, pp, ep in grid:
        def p_ok(b, tp=tp, pp=pp, ep=ep):
            e = price(tp, pp, ep, 1, b)
            mem_ok = ic.memory(price.it, e.layout, prompt_len=P, output_len=0).total <= hw.memory_bytes
            return mem_ok and e.ttft_s + transfer_seconds(price.it, hw, batch=b, prompt_len=P, devices=devices) <= ttft

        b = largest_batch(p_ok)
        if b:
            e = price(tp, pp, ep, 1, b)
            prefill[(tp, pp, ep)] = (b / e.ttft_s, e)

        def d_ok(b, tp=tp, pp=pp, ep=ep):
            e = price(tp, pp, ep, 1, b)
            return e.tpot_s <= tpot and _decode_fits(price, e)

        b = largest_batch(d_ok)
        if b:
            e = price(tp, pp, ep, 1, b)
            nxt = price(tp, pp, ep, 1, b + 1)
            limit = _limit(nxt, hw, ttft, tpot, decode_only=True, fits=_decode_fits(price, nxt))
            decode[(tp, pp, ep)] = (b / (max(O - 1, 1) * e.tpot_s), e, limit)
    best = None
    for (ptp, ppp, pep), (p_rate, p_est) in prefill.items():
        p_size = ptp * ppp * pep
        for n_p, (dtp, dpp, dep) in _splits(devices, p_size, p_rate, decode):
            d_rate, d_est, limit = decode[(dtp, dpp, dep)]
            d_size = dtp * dpp * dep
            n_d = (devices - n_p * p_size) // d_size
            rate = min(n_p * p_rate, n_d * d_rate)  # requests per second through both pools
            if best is not None and rate * O <= best.throughput_tokens_per_s:
                continue
            transfer = transfer_seconds(price.it, hw, batch=p_est.layout.batch, prompt_len=P, devices=devices)
            pools = (("prefill", price(ptp, ppp, pep, n_p, p_est.layout.batch)),
                     ("decode", price(dtp, dpp, dep, n_d, d_est.layout.batch)))
            memories = (ic.memory(price.it, p_est.layout, prompt_len=P, output_len=0),
                        ic.memory(price.it, d_est.layout, prompt_len=P, output_len=O, decode_only=True))
            best = Candidate(mode="disaggregated", ttft_s=p_est.ttft_s + transfer, tpot_s=d_est.tpot_s,
                             throughput_tokens_per_s=rate * O, pools=pools, limit=limit, transfer_s=transfer,
                             memories=memories)
    return best


def _splits(devices: int, p_size: int, p_rate: float, decode: dict) -> list[tuple[int, tuple[int, int, int]]]:
    """The (prefill replicas, decode layout) pairs worth pricing, in the order of a scan over every
    n_p = 1, 2, ... and then every decode layout. n_p * p_size + n_d * d_size = devices with n_p, n_d >= 1
    holds for n_p in one residue class modulo d_size / gcd; on it min(n_p * p_rate, n_d * d_rate) rises
    strictly up to the balance point and falls strictly after, so the best n_p of a decode layout is one of
    the two next to that point (two more kept against rounding): O(layouts) pairs, not O(devices)."""
    out = []
    last = (devices - 1) // p_size  # n_d >= 1
    for key, (d_rate, _, _) in decode.items():
        d_size = key[0] * key[1] * key[2]
        g = math.gcd(p_size, d_size)
        if devices % g:
            continue
        step = d_size // g  # n_p * (p_size / g) = devices / g (mod step)
        first = (devices // g) * pow(p_size // g, -1, step) % step if step > 1 else 0
        first = first or step  # n_p >= 1
        if first > last:
            continue
        balance = devices * d_rate / (p_rate * d_size + d_rate * p_size)  # n_p * p_rate = n_d * d_rate
        below = first + max(0, math.floor((balance - first) / step)) * step
        out += [(n, key) for n in (below - step, below, below + step, below + 2 * step) if first <= n <= last]
    order = {key: i for i, key in enumerate(decode)}
    return sorted(set(out), key=lambda pair: (pair[0], order[pair[1]]))


def _decode_fits(price: _Pricer, e: ServeEstimate) -> bool:
    """A decode pool holds weights and caches at P + O tokens; its activations are one token's."""
    mem = ic.memory(price.it, e.layout, prompt_len=price.P, output_len=price.O, decode_only=True)
    return mem.total <= price.hw.memory_bytes


def plan_serving(table: CostTable | InferenceTable, spec: ModelSpec, hw: DeviceProfile, *, devices: int,
                 prompt_len: int, output_len: int, ttft_slo_s: float, tpot_slo_s: float,
                 disaggregation: bool = True) -> ServingChoice:
    """See docs/modules/serving.md."""
    if not (ttft_slo_s > 0 and tpot_slo_s > 0) or math.isinf(ttft_slo_s + tpot_slo_s):
        raise InvalidConfigError(f"TTFT and TPOT targets must be positive seconds, got {ttft_slo_s} and {tpot_slo_s}")
    if not (is_positive_int(prompt_len) and is_positive_int(output_len)):
        raise InvalidConfigError(f"prompt and output lengths must be positive, got {prompt_len} and {output_len}")
    it = ic.compile_inference_table(table, spec)
    price = _Pricer(it, spec, hw, prompt_len=prompt_len, output_len=output_len)
    grid = layouts(spec, devices)
    if not grid:
        raise InvalidConfigError(f"no tp x pp layout of {spec.name} fits {devices} devices under the sharding rules")
    found = [c for tp, pp, ep in grid
             if (c := _colocated(price, hw, tp, pp, ep, devices // (tp * pp * ep), ttft_slo_s, tpot_slo_s)) is not None]
    if disaggregation and devices > 1:
        d = _disaggregated(price, spec, hw, grid, devices, ttft_slo_s, tpot_slo_s)
        if d is not None:
            found.append(d)
    if not found:
        raise InfeasiblePlanError(_unmeetable(price, hw, grid, devices, ttft_slo_s, tpot_slo_s))
    found.sort(key=lambda c: -c.throughput_tokens_per_s)
    best = found[0]
    runner = next((c for c in found[1:] if c.shape != best.shape), None)
    why = ""
    if runner is not None:
        loss = 100 * (1 - runner.throughput_tokens_per_s / best.throughput_tokens_per_s)
        why = (f"{runner.summary()}: {runner.throughput_tokens_per_s:.4g} tokens/s ({loss:.1f}% less); "
               f"its batch is capped by {runner.limit}")
    return ServingChoice(best=best, runner_up=runner, why_runner_up_lost=why, layouts_priced=len(price.memo))


def _unmeetable(price: _Pricer, hw, grid, devices, ttft, tpot) -> str:
    """One line: the best TTFT and TPOT reachable (batch 1, any layout that fits) and what binds."""
    ests = [price(tp, pp, ep, devices // (tp * pp * ep), 1) for tp, pp, ep in grid]
    fitting = [e for e in ests if e.fits]
    if not fitting:
        small = min(ests, key=lambda e: e.memory.total)
        return (f"no layout fits in memory even at batch 1: the smallest needs {small.memory.total / 1e9:.1f} GB "
                f"per device ({small.layout.shape}) > {hw.memory_gb:.1f} GB; use more devices")
    best_ttft = min(fitting, key=lambda e: e.ttft_s)
    best_tpot = min(fitting, key=lambda e: e.tpot_s)
    reach = (f"best reachable TTFT {best_ttft.ttft_s * 1e3:.1f} ms ({best_ttft.layout.shape}), "
             f"TPOT {best_tpot.tpot_s * 1e3:.2f} ms ({best_tpot.layout.shape}) at batch 1")
    if best_ttft.ttft_s > ttft:
        binding = f"the TTFT target {ttft * 1e3:.1f} ms binds"
    elif best_tpot.tpot_s > tpot:
        binding = f"the TPOT target {tpot * 1e3:.2f} ms binds"
    else:
        binding = "no single layout meets both targets together"
    return f"no configuration meets the targets: {reach}; {binding}; relax it or add devices"
