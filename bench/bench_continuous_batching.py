"""Continuous batching: the analytic scheduler model against a discrete-event run of the same arrivals.

  python bench/bench_continuous_batching.py                       llama3.1-8b on 1 H100 (tp1) and llama-70b
                                                                  on 4 H100 (tp4), P 512 / O 128, rates from
                                                                  10% to 90% of the replica's prefill ceiling
  python bench/bench_continuous_batching.py --model M --tp T --prompt-len P --output-len O --rates r1,r2,...

For each rate: `passes/serving/continuous_batching.estimate_continuous` (mean-value steady state, TTFT as a
mixture of uniforms, TPOT by the central limit) beside a discrete-event simulation (DES) of the
scheduler it models, fed Poisson arrivals (fixed seed): every iteration admits the requests that
arrived during the previous one, runs one decode token per running sequence plus those prompts'
prefills, and lasts D(running) + k F, D and F from the same cost model, with the running count of
that iteration (not its mean) and the memory bound enforced (arrivals wait when it is full).
Printed: TTFT and TPOT p50 / p99 of both, their ratio model / DES, and the mean running batch.
"""

from __future__ import annotations

import argparse
import heapq
import math

import numpy as np

from autoshard.commands.common import cost_table_for
from autoshard.hardware import load_hardware
from autoshard.passes.serving.continuous_batching import estimate_continuous, replica_times
from autoshard.passes.serving.inference_cost import ServeLayout, compile_inference_table


def simulate(times, *, rate: float, output_len: int, requests: int, seed: int = 0) -> dict:
    """The scheduler of the model docstring, event by event; percentiles over the requests after a warm-up."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, size=requests))
    waiting: list[float] = []  # arrival times, in order
    running: list[list] = []  # [arrival, first token time, tokens emitted]
    ttft, tpot, batch = [], [], []
    clock, nxt = 0.0, 0
    while nxt < requests or waiting or running:
        while nxt < requests and arrivals[nxt] <= clock:
            waiting.append(arrivals[nxt])
            nxt += 1
        if not waiting and not running:
            clock = arrivals[nxt]
            continue
        room = times.max_sequences - len(running)
        admitted, waiting = waiting[:room], waiting[room:]
        duration = (times.decode(len(running)) if running else 0.0) + len(admitted) * times.prefill_s
        if running and not admitted:
            duration = times.decode(len(running))
        batch.append(len(running))
        clock += duration
        for r in running:
            r[2] += 1
        running += [[a, clock, 1] for a in admitted]
        for a, first, _ in [r for r in running if r[2] >= output_len]:
            ttft.append(first - a)
            tpot.append((clock - first) / (output_len - 1) if output_len > 1 else 0.0)
        running = [r for r in running if r[2] < output_len]
    skip = len(ttft) // 10  # warm-up
    ttft, tpot = np.array(ttft[skip:]), np.array(tpot[skip:])
    return dict(ttft=np.percentile(ttft, [50, 99]), tpot=np.percentile(tpot, [50, 99]), running=float(np.mean(batch)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", action="append")
    ap.add_argument("--tp", type=int, action="append")
    ap.add_argument("--hardware", default="h100")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rates", help="requests/s, comma-separated (default: 10..90%% of the prefill ceiling)")
    ap.add_argument("--requests", type=int, default=4000)
    args = ap.parse_args()
    cases = list(zip(args.model or ["autoshard.models.published:llama31_8b", "llama-70b"], args.tp or [1, 4]))
    hw = load_hardware(args.hardware)
    P, O = args.prompt_len, args.output_len
    for model, tp in cases:
        spec, table = cost_table_for(model, spinner=False)
        it = compile_inference_table(table, spec)
        layout = ServeLayout(tp=tp)
        times = replica_times(it, hw, layout, prompt_len=P, output_len=O)
        ceiling = 1.0 / times.prefill_s
        rates = [float(r) for r in args.rates.split(",")] if args.rates else [ceiling * f for f in (0.1, 0.3, 0.5, 0.7, 0.9)]
        print(f"\n{spec.name} tp{tp} on {hw.name}, P {P} O {O}: prefill {times.prefill_s * 1e3:.2f} ms "
              f"(ceiling {ceiling:.1f} requests/s), decode step {times.decode(1) * 1e3:.2f} ms at 1 sequence, "
              f"memory holds {times.max_sequences}")
        print(f"{'rate/s':>8} | {'TTFT p50 / p99 ms model':>24} {'DES':>16} {'ratio':>11} | "
              f"{'TPOT p50 / p99 ms model':>24} {'DES':>14} {'ratio':>11} | running model / DES")
        for rate in rates:
            e = estimate_continuous(it, spec, hw, layout, request_rate=rate, prompt_len=P, output_len=O, times=times)
            d = simulate(times, rate=rate, output_len=O, requests=args.requests)
            if not e.stable:
                print(f"{rate:8.2f} | model: unstable ({e.limit}); DES TTFT p99 {d['ttft'][1] * 1e3:.0f} ms")
                continue
            mt, mp = (e.ttft_p50_s, e.ttft_p99_s), (e.tpot_p50_s, e.tpot_p99_s)
            print(f"{rate:8.2f} | {mt[0] * 1e3:11.1f} / {mt[1] * 1e3:9.1f} {d['ttft'][0] * 1e3:7.1f} / {d['ttft'][1] * 1e3:7.1f} "
                  f"{mt[0] / d['ttft'][0]:5.2f} {mt[1] / d['ttft'][1]:5.2f} | {mp[0] * 1e3:11.2f} / {mp[1] * 1e3:9.2f} "
                  f"{d['tpot'][0] * 1e3:6.2f} / {d['tpot'][1] * 1e3:6.2f} {mp[0] / d['tpot'][0]:5.2f} {mp[1] / d['tpot'][1]:5.2f} | "
                  f"{e.running:6.1f} / {d['running']:6.1f}")


if __name__ == "__main__":
    main()
