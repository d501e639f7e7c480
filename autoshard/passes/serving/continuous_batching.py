"""Continuous batching: TTFT and TPOT percentiles of a serving replica under Poisson request arrivals.

The whole contract: docs/modules/serving.md (passes/serving/continuous_batching.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from autoshard.errors import InvalidConfigError
from autoshard.hardware import DeviceProfile
from autoshard.cost_table import CostTable
from autoshard.ir import is_positive_int, is_positive_number
from autoshard.model_spec import ModelSpec
from autoshard.passes.serving import inference_cost as ic
from autoshard.passes.serving.inference_cost import InferenceTable, ServeLayout
from autoshard.passes.serving.serving import MAX_BATCH, largest_batch

Z99 = 2.326  # the standard normal's 99th percentile
KMAX = 32  # admitted counts kept beyond the chain's mean + 12 standard deviations (`_admitted`)


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplicaTimes:
    """What one replica's scheduler is made of: the decode step as a function of the running count,
    the marginal prefill of one prompt, and the most sequences its memory holds."""

    decode: Any  # callable n -> seconds of one decode step of n sequences
    prefill_s: float  # F: one prompt's prefill added to an iteration
    max_sequences: int  # memory: sequences whose cache at P + O tokens fits (0: not even one)


@dataclass(frozen=True, slots=True, kw_only=True)
class ContinuousEstimate:
    layout: ServeLayout
    request_rate: float  # requests / s over all replicas
    stable: bool
    limit: str  # "" when stable, else what breaks (prefill saturates, memory)
    running: float  # mean sequences running on a replica
    max_sequences: int
    iteration_s: float  # mean engine iteration
    ttft_p50_s: float
    ttft_p99_s: float
    tpot_p50_s: float
    tpot_p99_s: float
    throughput_tokens_per_s: float  # output tokens / s over all replicas (= rate x O when stable)

    def meets(self, ttft_slo_s: float, tpot_slo_s: float) -> bool:
        return self.stable and self.ttft_p99_s <= ttft_slo_s and self.tpot_p99_s <= tpot_slo_s

    def to_json(self) -> dict[str, Any]:
        return {**self.layout.as_dict(), "request_rate": self.request_rate, "stable": self.stable,
                "limit": self.limit, "running_sequences": self.running, "max_sequences": self.max_sequences,
                "iteration_s": self.iteration_s, "ttft_p50_s": self.ttft_p50_s, "ttft_p99_s": self.ttft_p99_s,
                "tpot_p50_s": self.tpot_p50_s, "tpot_p99_s": self.tpot_p99_s,
                "throughput_tokens_per_s": self.throughput_tokens_per_s}


def replica_times(it: InferenceTable, hw: DeviceProfile, layout: ServeLayout, *, prompt_len: int,
                  output_len: int) -> ReplicaTimes:
    """The decode step, the marginal prefill and the memory bound of one replica of `layout`."""
    context = prompt_len + output_len / 2.0
    memo: dict[int, float] = {}

    def decode(n: float) -> float:
        b = max(1, math.ceil(n))
        if b not in memo:
            lay = ServeLayout(tp=layout.tp, pp=layout.pp, ep=layout.ep, batch=b)
            memo[b] = ic.phase_time(it, hw, lay, tokens=1, context=context).total
        return memo[b]

    one = ServeLayout(tp=layout.tp, pp=layout.pp, ep=layout.ep, batch=1)
    prefill = ic.phase_time(it, hw, one, tokens=prompt_len, context=None)

    def fits(b: int) -> bool:
        lay = ServeLayout(tp=layout.tp, pp=layout.pp, ep=layout.ep, batch=b)
        return ic.memory(it, lay, prompt_len=prompt_len, output_len=output_len).total <= hw.memory_bytes

    return ReplicaTimes(decode=decode, prefill_s=prefill.total - prefill.per_step,
                        max_sequences=largest_batch(fits, cap=MAX_BATCH))


def estimate_continuous(table: CostTable | InferenceTable, spec: ModelSpec, hw: DeviceProfile, layout: ServeLayout,
                        *, request_rate: float, prompt_len: int, output_len: int,
                        times: ReplicaTimes | None = None) -> ContinuousEstimate:
    """See docs/modules/serving.md. `times`: `replica_times` of this layout, when pricing many rates."""
    if not is_positive_number(request_rate):
        raise InvalidConfigError(f"the request rate must be a positive number of requests per second, "
                                 f"got {request_rate!r}")
    if not (is_positive_int(prompt_len) and is_positive_int(output_len)):
        raise InvalidConfigError(f"prompt and output lengths must be positive, got {prompt_len} and {output_len}")
    if times is None:
        times = replica_times(ic.compile_inference_table(table, spec), hw, layout, prompt_len=prompt_len,
                              output_len=output_len)
    lam, F, O = request_rate / layout.replicas, times.prefill_s, output_len
    out = dict(layout=layout, request_rate=request_rate, max_sequences=times.max_sequences)
    unstable = dict(out, stable=False, running=math.inf, iteration_s=math.inf, ttft_p50_s=math.inf,
                    ttft_p99_s=math.inf, tpot_p50_s=math.inf, tpot_p99_s=math.inf, throughput_tokens_per_s=0.0)
    if times.max_sequences < 1:
        return ContinuousEstimate(**unstable, limit="memory: not one sequence fits")
    if lam * F >= 1:
        return ContinuousEstimate(**unstable, limit=f"prefill saturates the replica ({lam:.3g} requests/s x "
                                                    f"{F * 1e3:.3g} ms per prefill >= 1)")
    t, n = _steady_state(times.decode, lam=lam, prefill_s=F, output_len=O, cap=times.max_sequences)
    if n + Z99 * math.sqrt(n) > times.max_sequences:
        return ContinuousEstimate(**unstable, limit=f"memory: {n:.0f} sequences running on average (p99 "
                                                    f"{n + Z99 * math.sqrt(n):.0f}) > {times.max_sequences} that fit")
    d = times.decode(n)
    window = _admitted(d, F, lam)  # stationary pmf of the prompts an iteration admits
    b = lam * F
    # a request's TPOT: the mean of its O - 1 iterations. Their admitted counts form the chain of `_admitted`
    # (stationary mean m = lam t, variance m / (1 - b^2), lag-one correlation b), whose mean over O - 1
    # steps has variance F^2 m / ((1 - b)^2 (O - 1)); and the running count it meets stays within sqrt(n)
    # of n over its life (Poisson(n), persistent: it does not average out), added in quadrature
    occupancy = (times.decode(n + math.sqrt(n)) - d) / (1.0 - b)
    sd = math.hypot(F * math.sqrt(lam * t) / ((1.0 - b) * math.sqrt(O - 1)), occupancy) if O > 1 else 0.0
    tpot = (t, t + Z99 * sd) if O > 1 else (0.0, 0.0)
    ttft = tuple(_ttft_quantile(q, decode_s=d, prefill_s=F, lam=lam, window=window) for q in (0.5, 0.99))
    return ContinuousEstimate(**out, stable=True, limit="", running=n, iteration_s=t, ttft_p50_s=ttft[0],
                              ttft_p99_s=ttft[1], tpot_p50_s=tpot[0], tpot_p99_s=tpot[1],
                              throughput_tokens_per_s=request_rate * O)


def _steady_state(decode, *, lam: float, prefill_s: float, output_len: int, cap: int) -> tuple[float, float]:
    """(mean iteration t, mean running n) solving t = D(n) / (1 - lam F), n = lam (O - 1) t; D grows
    with n, so the iteration from n = 0 rises monotonically to the least fixed point (or past `cap`)."""
    n = 0.0
    for _ in range(200):
        t = decode(n) / (1.0 - lam * prefill_s)
        nxt = lam * (output_len - 1) * t
        if abs(nxt - n) <= 1e-9 * max(1.0, n) or nxt > 4 * cap:
            return t, nxt
        n = nxt
    return t, n


def _poisson(mean: float, k: np.ndarray) -> np.ndarray:
    if mean <= 0:
        return (k == 0).astype(float)
    log_fact = np.cumsum(np.log(np.maximum(k, 1)))
    return np.exp(k * math.log(mean) - mean - log_fact)


def _admitted(decode_s: float, prefill_s: float, lam: float) -> np.ndarray:
    """Stationary pmf of k, the prompts one iteration admits: those that arrived during the previous
    iteration, which lasted D + k_prev F, so k | k_prev ~ Poisson(lam (D + k_prev F)): a Markov chain
    whose long iterations beget long ones (bursts chain; its mean lam D / (1 - lam F) = lam t).
    Solved on 0..kmax (kmax well past the mean and 12 standard deviations) by power iteration."""
    b = lam * prefill_s
    mean = lam * decode_s / (1.0 - b)
    kmax = int(mean + 12 * math.sqrt(mean / (1.0 - b * b)) + KMAX)
    k = np.arange(kmax)
    step = np.stack([_poisson(lam * (decode_s + j * prefill_s), k) for j in k])  # (k_prev, k)
    pi = _poisson(mean, k)
    for _ in range(500):
        nxt = pi @ step
        nxt /= nxt.sum()
        if np.abs(nxt - pi).max() < 1e-12:
            break
        pi = nxt
    return nxt


def _ttft_quantile(q: float, *, decode_s: float, prefill_s: float, lam: float, window: np.ndarray) -> float:
    """The q-quantile of TTFT = U I_j + D + (1 + K) F (docs/modules/serving.md), by bisection on its CDF;
    `window`: the pmf of the prompts admitted by an iteration (`_admitted`), which sets its length I_j."""
    k = np.arange(len(window))
    lengths = decode_s + k * prefill_s  # I_j
    window = window * lengths
    window /= window.sum()  # length-biased: the iteration an arrival falls in
    # mixture components: (weight, start, width) of uniforms U I_j + D + (1 + K) F
    weights = window[:, None] * np.stack([_poisson(lam * length, k) for length in lengths])  # (j, K)
    starts = np.broadcast_to(decode_s + (1 + k) * prefill_s, weights.shape)  # over K
    widths = np.broadcast_to(lengths[:, None], weights.shape)  # over j
    weights = weights / weights.sum()

    def cdf(x: float) -> float:
        return float((weights * np.clip((x - starts) / widths, 0.0, 1.0)).sum())

    lo, hi = float(starts.min()), float((starts + widths).max())
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < q else (lo, mid)
    return hi


def max_request_rate(table: CostTable | InferenceTable, spec: ModelSpec, hw: DeviceProfile, layout: ServeLayout, *,
                     prompt_len: int, output_len: int, ttft_slo_s: float, tpot_slo_s: float,
                     times: ReplicaTimes | None = None) -> float:
    """The largest request rate (requests / s, all replicas) whose p99 TTFT and TPOT meet the targets
    (0.0 when none does): bisection, the percentiles growing with the rate."""
    it = ic.compile_inference_table(table, spec)
    times = times or replica_times(it, hw, layout, prompt_len=prompt_len, output_len=output_len)

    def ok(rate: float) -> bool:
        return estimate_continuous(it, spec, hw, layout, request_rate=rate, prompt_len=prompt_len,
                                   output_len=output_len, times=times).meets(ttft_slo_s, tpot_slo_s)

    ceiling = layout.replicas / max(times.prefill_s, 1e-12)  # prefill saturation: lam F < 1 per replica
    lo, hi = 0.0, ceiling
    if not ok(ceiling * 1e-6):
        return 0.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


@dataclass(frozen=True, slots=True, kw_only=True)
class ContinuousChoice:
    """Every colocated layout of the devices at the request rate, best first: those meeting both p99
    targets, by the most rate they sustain under the targets (headroom), then the others."""

    request_rate: float
    rows: tuple[tuple[ContinuousEstimate, float], ...]  # (estimate at the rate, max rate under the targets)

    @property
    def best(self) -> ContinuousEstimate:
        return self.rows[0][0]

    def to_json(self, ttft_slo_s: float, tpot_slo_s: float) -> dict[str, Any]:
        def row(e, rate):
            return {**e.to_json(), "meets_slos": e.meets(ttft_slo_s, tpot_slo_s), "max_request_rate": rate}

        return {"request_rate": self.request_rate, "scheduler": "continuous batching (prefills interleaved with "
                "running decodes)", "best": row(*self.rows[0]), "layouts": [row(e, r) for e, r in self.rows]}


def plan_continuous(table: CostTable | InferenceTable, spec: ModelSpec, hw: DeviceProfile, *, devices: int,
                    request_rate: float, prompt_len: int, output_len: int, ttft_slo_s: float,
                    tpot_slo_s: float) -> ContinuousChoice:
    """Price every colocated layout the runtime accepts (`serving.layouts`; replicas fill the devices)
    under continuous batching at `request_rate` (docs/modules/serving.md)."""
    from autoshard.passes.serving.serving import layouts

    it = ic.compile_inference_table(table, spec)
    rows = []
    for tp, pp, ep in layouts(spec, devices):
        layout = ServeLayout(tp=tp, pp=pp, ep=ep, replicas=devices // (tp * pp * ep))
        times = replica_times(it, hw, layout, prompt_len=prompt_len, output_len=output_len)
        e = estimate_continuous(it, spec, hw, layout, request_rate=request_rate, prompt_len=prompt_len,
                                output_len=output_len, times=times)
        rows.append((e, max_request_rate(it, spec, hw, layout, prompt_len=prompt_len, output_len=output_len,
                                         ttft_slo_s=ttft_slo_s, tpot_slo_s=tpot_slo_s, times=times)))
    if not rows:
        raise InvalidConfigError(f"no tp x pp layout of {spec.name} fits {devices} devices under the sharding rules")
    rows.sort(key=lambda r: (not r[0].meets(ttft_slo_s, tpot_slo_s), -r[1], r[0].ttft_p99_s))
    return ContinuousChoice(request_rate=request_rate, rows=tuple(rows))
