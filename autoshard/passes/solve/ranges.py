"""The exact split search of a mixed layer stack, and where its plan spends time and memory per layer kind.

`range_search(problem, ok, *, cutoff_s)` finds the fastest split of a mixed stack's tables (their columns are
layer ranges, passes/solve/layer_ranges.py): a branch and bound over the slowest-stage time T and the largest
tail U, each (T, U) solved by a min-plus DP over the stage boundaries; it always runs to its proof.
`kind_breakdown` is what `autoshard show` prints per layer kind. The search and its proof: docs/solver.md.
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import replace

import numpy as np

from autoshard.ir import BlockKind
from autoshard.passes.cost import cost
from autoshard.passes.cost.block import block_activation_bytes, block_params, block_time, expert_block_params
from autoshard.passes.cost.state import state_bytes
from autoshard.passes.solve.layer_ranges import range_columns, range_lengths, range_sums, stage_windows
from autoshard.passes.solve.solve_model import (MeshResult, evaluate, range_class_index, stage_groups,
                                                stage_min_layers)
from autoshard.rules import schedules


def bottleneck(problem, ok: np.ndarray) -> float | None:
    """The least slowest-stage time any split of `problem` has with every stage in `ok`, or None when no split is
    allowed."""
    return _least_slowest(np.where(ok, problem.time_s, np.inf).min(axis=1), problem.pp, problem.layers)


def _least_slowest(fastest: np.ndarray, pp: int, layers: int, lows=None) -> float | None:
    """The least slowest-stage time of the splits of stage tables `fastest` [i, column] (None: no split): a min-max
    DP over the stages and their boundaries (best_i[b] = min_a max(best_{i-1}[a], t_i[a, b])). `lows`: each stage's
    least layers, where the tables hold inf for the ranges shorter (the DP then reads only the starts and ends a
    split can reach, `stage_windows`)."""
    size = layers + 1
    square = fastest.reshape(pp, size, size)
    windows = stage_windows(layers, lows) if lows is not None else [(slice(None), slice(None))] * pp
    best = np.full(size, np.inf)
    best[0] = 0.0
    for i, (starts, ends) in enumerate(windows):
        step = np.full(size, np.inf)
        step[ends] = np.maximum(best[starts, None], square[i, starts, ends]).min(axis=0)
        best = step
    value = float(best[layers])
    return value if math.isfinite(value) else None


def _least_sum(fastest: np.ndarray, pp: int, layers: int, lows) -> float:
    """The least sum of stage times of the splits of stage tables `fastest` [i, column] (`range_sums`)."""
    square = fastest.reshape(pp, layers + 1, layers + 1)  # [i, a, b]
    return float(range_sums(lambda i, ra, rb: square[i, None, ra, rb], pp, layers, 1, lows, splits=False)[0][0])


def table_bound(ct, hw, layout, blocks, *, global_batch: int, seq_len: int, memo: dict | None = None) -> float:
    """A lower bound on the step of every split of the tables `mesh_problem` would build for the resolved `layout`
    of a mixed stack (`blocks`: its `stage_numbers`), read before they are built: `range_search`'s first bound
    (m - f) T + f S + min tail with the tails left out (0; they are the costly part) and the time cutoff not
    applied, T and S over the same entries that fit the device (`stage_entries`' memory, `stage_groups`). `range_search`
    returns at once, nothing found, where its first bound reaches the cutoff: so does it where this one does.
    `memo`: a dict kept over plans of one device and sequence length; T and S read the global batch only through
    the micro-batches each stage holds in flight, so a re-plan at another batch mostly reuses them; and the two DPs
    read only the per-class table of the entries that fit, so layouts whose tables are alike (a mesh's ZeRO levels,
    most often, where memory does not bind) share one evaluation."""
    mesh, L = layout.mesh, ct.spec.layers
    m = layout.microbatches(global_batch)
    f = float(schedules.bubble_fraction(layout.schedule, layout.virtual_stages, microbatches=m, pp=mesh.pp))
    if not 0 <= f <= m:  # the bound is monotone in T and S only so
        return -math.inf
    memo = {} if memo is None else memo
    # the micro-batches each stage holds in flight
    flight = tuple(schedules.in_flight(layout.schedule, i, mesh.pp, m, layout.virtual_stages) for i in range(mesh.pp))
    key = ("table bound", layout, flight)
    if key not in memo:
        lows = [stage_min_layers(layout, L, i) for i in range(mesh.pp)]
        index = range_class_index(ct)
        fastest = np.full((mesh.pp, int(index.max()) + 1), np.inf)  # per class of ranges, then per range
        for stages, _, time, act, other, valid, _ in stage_groups(ct, hw, layout, blocks, seq_len=seq_len,
                                                                  tails=False):
            if not valid:
                continue
            held = np.array([flight[i] for i in stages])
            mem = act[None] * held[:, None, None] + other  # [stage, r, class]: stage_entries' memory
            fits = np.where(mem <= hw.memory_bytes, time[None], np.inf).min(axis=1)
            fastest[list(stages)] = np.minimum(fastest[list(stages)], fits)
        same = ("table bound of", hashlib.blake2b(fastest.tobytes(), digest_size=16).digest(), tuple(lows))
        if same not in memo:  # layouts whose fitting entries are alike (a mesh's ZeRO levels, mostly) share it
            fastest = _to_windows(fastest, index, L, lows)
            floor = _least_slowest(fastest, mesh.pp, L, lows)
            memo[same] = (floor, None if floor is None else _least_sum(fastest, mesh.pp, L, lows))
        memo[key] = memo[same]
    floor, total = memo[key]
    return math.inf if floor is None else (m - f) * floor + f * total


def _to_windows(per_class: np.ndarray, index: np.ndarray, layers: int, lows) -> np.ndarray:
    """Stage tables per class of ranges [i, class] taken to the range columns [i, (L + 1)^2] the DPs read (the
    starts and ends a split can reach, `stage_windows`), inf elsewhere and where a range is shorter than the
    stage's least layers (or no range)."""
    size = layers + 1
    out = np.full((len(lows), size, size), np.inf)
    square, short = index.reshape(size, size), _short(layers, tuple(lows)).reshape(len(lows), size, size)
    for i, (starts, ends) in enumerate(stage_windows(layers, lows)):
        out[i, starts, ends] = np.where(short[i, starts, ends], np.inf, per_class[i, square[starts, ends]])
    return out.reshape(len(lows), -1)


@functools.lru_cache(maxsize=64)
def _short(layers: int, lows: tuple[int, ...]) -> np.ndarray:
    """[stage, range column]: the ranges shorter than each stage's least layers (or no range, b < a)."""
    out = range_lengths(layers)[None, :] < np.array(lows)[:, None]
    out.flags.writeable = False
    return out


def _chunks(values: np.ndarray, limit: int):
    """`values` in chunks of 1, 2, 4, ... `limit` (a search that stops early wastes little)."""
    start, size = 0, 1
    while start < len(values):
        yield values[start:start + size]
        start, size = start + size, min(2 * size, limit)


def range_search(problem, ok: np.ndarray, *, cutoff_s: float = math.inf):
    """The fastest split of a mixed stack's `problem` allowed by `ok[i, o, column]`, exactly (docs/solver.md, mixed layer stacks).
    Returns (assignment or None, step seconds, lower bound seconds)."""
    m, L, p, f = problem.microbatches, problem.layers, problem.pp, problem.bubble
    size = L + 1
    lows = [problem.min_layers(i) for i in range(p)]
    t = np.where(ok & ~_short(L, tuple(lows))[:, None, :], problem.time_s, np.inf)
    fastest = t.min(axis=1)  # [i, column]: a stage's tail is the same at every level
    tail = problem.tail_s.min(axis=1)
    floor = _least_slowest(fastest, p, L, lows)
    if floor is None:
        return None, math.inf, math.inf
    square = fastest.reshape(p, size, size)  # [i, a, b]
    total = _least_sum(fastest, p, L, lows)
    live = np.isfinite(fastest)
    tail_lo = float(max(tail[i][live[i]].min(initial=math.inf) for i in range(p)))
    best_a, best = None, math.inf
    # chunks of caps as large as ~4M numbers per stage table
    limit = max(1, min(64, (1 << 22) // (size * size)))

    def found(counts) -> float:
        nonlocal best_a, best
        cols = range_columns(counts, L)
        a = problem.assignment(counts, [np.argmin(t[i, :, c]) for i, c in enumerate(cols)])  # its fastest level
        ev = evaluate(problem, a)
        if ev.step_s < best and ev.step_s < cutoff_s:
            best_a, best = a, ev.step_s
        return ev.tail_s

    times = np.unique(fastest[live & (fastest >= floor)])
    for chunk in _chunks(times, limit):
        if (m - f) * chunk[0] + f * total + tail_lo >= min(best, cutoff_s):
            break
        caps = chunk[:, None, None]
        sums, splits = range_sums(lambda i, ra, rb: np.where(square[i, None, ra, rb] <= caps, square[i, None, ra, rb],
                                                             np.inf), p, L, len(chunk), lows)
        for cap, s_t, counts in zip(chunk, sums, splits):
            goal = min(best, cutoff_s)
            if (m - f) * cap + f * total + tail_lo >= goal:
                break
            if not math.isfinite(s_t):
                continue
            top = found(counts)
            capped = np.where(fastest <= cap, fastest, np.inf)
            allowed = np.isfinite(capped)
            tails = np.unique(tail[allowed & (tail < top)])
            # no split under `cap` has a largest tail below the least one (a min-max DP): those caps are infeasible
            least_top = _least_slowest(np.where(allowed, tail, np.inf), p, L, lows)
            for u in tails[tails >= max(tail_lo, least_top)]:  # the split at (cap, inf) has max tail `top`
                if (m - f) * cap + f * s_t + u >= min(best, cutoff_s):
                    break
                under = np.where(tail <= u, capped, np.inf)
                s_u, split = range_sums(lambda i, ra, rb: under.reshape(p, size, size)[i, None, ra, rb], p, L, 1, lows)
                if math.isfinite(s_u[0]):
                    found(split[0])
    return best_a, best, min(best, cutoff_s)


def known_result(known: tuple[float, MeshResult] | None, cutoff: float) -> MeshResult | None:
    """The exact search's result for a layout under `cutoff` where an earlier search of the same tables decides it
    (`known`: its cutoff and result; a re-plan of the same shape): the best split it found, when that beats
    `cutoff` too (the search is exact: nothing else does better), or nothing, when it found nothing under a cutoff
    at least this one; else None (search again)."""
    if known is None:
        return None
    before, result = known
    if result.assignment is not None:
        return result if result.step_s < cutoff else MeshResult(status="cut", assignment=None, step_s=math.inf,
                                                                 bound_s=cutoff, wall_s=0.0)
    return result if cutoff <= before else None


def kind_breakdown(ct, hw, layout, a, *, global_batch: int, seq_len: int) -> list[dict]:
    """Where a mixed stack's plan spends its time and memory, per layer kind (what `autoshard show` prints): for
    each kind (`CompiledTable.kind_names`) its layers on every stage of assignment `a`, their seconds per
    micro-batch there (forward, backward, recompute and the kind's own collectives: `block_time`) and the
    bytes they keep per device (weights, gradients and optimizer state under the plan's ZeRO, and the
    activations of the micro-batches the stage holds in flight)."""
    layout = cost.resolved(layout, hw)
    mesh, m, stages = layout.mesh, layout.microbatches(global_batch), a.stages()
    out = []
    for k, (name, view) in enumerate(zip(ct.kind_names, ct.kinds)):
        counts, times, mems = [], [], []
        params = block_params(view, layout, BlockKind.LAYER)
        experts = expert_block_params(view, layout, BlockKind.LAYER)
        for i, st in enumerate(stages):
            n = ct.layer_kinds[st.first_layer:st.end_layer].count(k)
            lay = replace(layout, recompute=st.recompute)
            bt = block_time(view, hw, lay, BlockKind.LAYER, seq_len=seq_len)
            act = block_activation_bytes(view, lay, BlockKind.LAYER, seq_len=seq_len, hw=hw) * \
                schedules.in_flight(layout.schedule, i, mesh.pp, m, layout.virtual_stages)
            state = state_bytes(params * n, layout, expert=experts * n)
            counts.append(n)
            times.append(n * bt.total_s)
            mems.append((state.weights + state.grads + state.optimizer + n * act) / 1e9)
        out.append({"kind": name, "layers": counts, "time_s": times, "memory_gb": mems})
    return out
