"""Pipeline stages over a mixed layer stack: a stage is a range of layers, priced by the kinds it holds.

Contract
  A model whose layers are of several kinds (passes/capture/layer_kinds.py: Bamba, Nemotron-H, DeepSeek-V3's
  dense and MoE layers) has a stage cost that depends on which layers it holds, not only how many. The
  planner's tables (solve_model.MeshProblem with `sequence` set) then have one column per layer range
  [start, end) of the L layers, column start * (L + 1) + end (`range_column`); ranges with end < start are
  no stage (infinite). `range_counts` gives the layers of each kind in every range (prefix sums), the
  columns `solve_model._stage_sums` multiplies the per-kind block numbers by.

  `range_search(problem, ok, *, cutoff_s)` is the exact split search of a mixed stack: the branch and
  bound of `solve_model.split_search` over the slowest-stage time T and the largest tail U, each (T, U)
  solved by a min-plus DP over the stages and their boundaries (`range_sums`: best[i][b] =
  min_a best[i-1][a] + t_i[a, b]) instead of over layer counts. step = (m - f) max t + f sum t + max tail;
  value(T, U) = (m - f) T + f S(T, U) + U bounds the step of the split found at (T, U) from above and, at an
  optimum's own (max t, max tail), the optimum from below, so the least step found is the optimum; T runs
  up the distinct stage times from the bottleneck until (m - f) T + f S(inf, inf) + min tail reaches the
  best step (proven: no wall clock, no step limit). tests/passes/solve/test_ranges.py compares it with the
  enumeration of every contiguous split (`solve_model.brute_force`).
Terms: L layers, p stages, a / b a stage's first layer / one past its last, m micro-batches, f the bubble fraction.
"""

from __future__ import annotations

import functools
import math

import numpy as np


def range_column(start: int, end: int, layers: int) -> int:
    """The tables' column of the stage holding layers [start, end) of `layers`."""
    return start * (layers + 1) + end


def range_columns(counts, layers: int) -> tuple[int, ...]:
    """The column of each stage of a split with `counts` layers per stage, in order."""
    out, start = [], 0
    for n in counts:
        out.append(range_column(start, start + int(n), layers))
        start += int(n)
    return tuple(out)


@functools.lru_cache(maxsize=64)
def range_counts(sequence: tuple[int, ...], kinds: int, *, embed: bool, head: bool) -> np.ndarray:
    """[kinds + 2, (L + 1)^2]: per range [a, b) (column `range_column`), the embedding (0 / 1), the layers of
    each kind in it (b < a: negative, no stage) and the head, in the order of `BlockNumbers`' columns."""
    size = len(sequence) + 1
    onehot = np.zeros((kinds, size))
    for i, k in enumerate(sequence):
        onehot[k, i + 1] = 1.0
    prefix = np.cumsum(onehot, axis=1)  # [k, x]: layers of kind k among the first x
    held = (prefix[:, None, :] - prefix[:, :, None]).reshape(kinds, size * size)  # [k, a * size + b]
    edge = np.full((1, size * size), 1.0)
    out = np.concatenate([edge * float(embed), held, edge * float(head)])
    out.flags.writeable = False  # memoised: shared by every table of the model
    return out


@functools.lru_cache(maxsize=64)
def range_lengths(layers: int) -> np.ndarray:
    """[(L + 1)^2]: the layers of each range, b - a (negative: no stage)."""
    x = np.arange(layers + 1)
    out = (x[None, :] - x[:, None]).reshape(-1)
    out.flags.writeable = False
    return out


def range_sums(stage_table, pp: int, layers: int, count: int, lows) -> tuple[np.ndarray, np.ndarray | None]:
    """The least sum over stages of t_i[a_i, a_{i+1}] with a_0 = 0 and a_pp = L, for `count` tables side by side,
    stage i holding at least `lows[i]` layers: `stage_table(i, starts, ends)` gives stage i's [count, starts, ends]
    (inf: not allowed) for the slices of starts and ends the other stages' least layers leave open. Returns
    (sums [count], counts [count, pp] of the splits reaching them; a row is meaningless where its sum is inf)."""
    size = layers + 1
    before = np.concatenate([[0], np.cumsum(lows)]).astype(int)  # least layers of the stages before i
    after = int(before[-1])
    best = np.full((count, size), np.inf)
    best[:, 0] = 0.0
    args = []
    for i in range(pp):
        a0, a1 = int(before[i]), layers - (after - int(before[i]))  # the starts stage i can have
        b0, b1 = a0 + int(lows[i]), layers - (after - int(before[i + 1]))  # and its ends
        cand = best[:, a0:a1 + 1, None] + stage_table(i, slice(a0, a1 + 1), slice(b0, b1 + 1))  # [j, a, b]
        arg = cand.argmin(axis=1)  # [j, b]: the smallest start on ties
        best = np.full((count, size), np.inf)
        best[:, b0:b1 + 1] = np.take_along_axis(cand, arg[:, None, :], axis=1)[:, 0, :]
        full = np.zeros((count, size), dtype=np.int64)
        full[:, b0:b1 + 1] = arg + a0
        args.append(full)
    ends = np.full(count, layers)
    bounds = [ends]
    for arg in reversed(args):  # each table's boundaries, from the last stage back
        ends = arg[np.arange(count), ends]
        bounds.append(ends)
    edges = np.stack(bounds[::-1], axis=1)  # [j, pp + 1]
    return best[:, layers], np.diff(edges, axis=1)


def bottleneck(problem, ok: np.ndarray) -> float | None:
    """The least slowest-stage time any split of `problem` has with every stage in `ok`, or None when no split is
    allowed: a min-max DP over the stages and their boundaries (best_i[b] = min_a max(best_{i-1}[a], t_i[a, b]))."""
    fastest = np.where(ok, problem.time_s, np.inf).min(axis=1)  # [i, column]
    size = problem.layers + 1
    best = np.full(size, np.inf)
    best[0] = 0.0
    for i in range(problem.pp):
        best = np.maximum(best[:, None], fastest[i].reshape(size, size)).min(axis=0)
    value = float(best[problem.layers])
    return value if math.isfinite(value) else None


def _chunks(values: np.ndarray, limit: int):
    """`values` in chunks of 1, 2, 4, ... `limit` (a search that stops early wastes little)."""
    start, size = 0, 1
    while start < len(values):
        yield values[start:start + size]
        start, size = start + size, min(2 * size, limit)


def range_search(problem, ok: np.ndarray, *, cutoff_s: float = math.inf):
    """The fastest split of a mixed stack's `problem` allowed by `ok[i, o, column]`, exactly (module docstring).
    Returns (assignment or None, step seconds, lower bound seconds)."""
    from autoshard.passes.solve.solve_model import evaluate

    m, L, p, f = problem.microbatches, problem.layers, problem.pp, problem.bubble
    size = L + 1
    short = range_lengths(L)[None, :] < np.array([problem.min_layers(i) for i in range(p)])[:, None]  # [i, column]
    t = np.where(ok & ~short[:, None, :], problem.time_s, np.inf)
    fastest, level = t.min(axis=1), t.argmin(axis=1)  # [i, column]: a stage's tail is the same at every level
    tail = problem.tail_s.min(axis=1)
    floor = bottleneck(problem, ok & ~short[:, None, :])
    if floor is None:
        return None, math.inf, math.inf
    lows = [problem.min_layers(i) for i in range(p)]
    square = fastest.reshape(p, size, size)  # [i, a, b]
    total = float(range_sums(lambda i, ra, rb: square[i, None, ra, rb], p, L, 1, lows)[0][0])
    live = np.isfinite(fastest)
    tail_lo = float(max(tail[i][live[i]].min(initial=math.inf) for i in range(p)))
    best_a, best = None, math.inf
    # chunks of caps as large as ~4M numbers per stage table
    limit = max(1, min(64, (1 << 22) // (size * size)))

    def found(counts) -> float:
        nonlocal best_a, best
        cols = range_columns(counts, L)
        a = problem.assignment(counts, [level[i, c] for i, c in enumerate(cols)])
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
            tails = np.unique(tail[np.isfinite(capped) & (tail < top)])
            for u in tails[tails >= tail_lo]:  # the split at (cap, inf) has max tail `top`: smaller caps on the tail
                if (m - f) * cap + f * s_t + u >= min(best, cutoff_s):
                    break
                under = np.where(tail <= u, capped, np.inf)
                s_u, split = range_sums(lambda i, ra, rb: under.reshape(p, size, size)[i, None, ra, rb], p, L, 1, lows)
                if math.isfinite(s_u[0]):
                    found(split[0])
    return best_a, best, min(best, cutoff_s)


def kind_breakdown(ct, hw, layout, a, *, global_batch: int, seq_len: int) -> list[dict]:
    """Where a mixed stack's plan spends its time and memory, per layer kind (what `autoshard show` prints): for
    each kind (`CompiledTable.kind_names`) its layers on every stage of assignment `a`, their seconds per
    micro-batch there (forward, backward, recompute and the kind's own collectives: `block_time`) and the
    bytes they keep per device (weights, gradients and optimizer state under the plan's ZeRO, and the
    activations of the micro-batches the stage holds in flight)."""
    from dataclasses import replace

    from autoshard.ir import BlockKind
    from autoshard.passes.cost import cost
    from autoshard.passes.cost.block import block_activation_bytes, block_params, block_time, expert_block_params
    from autoshard.passes.cost.state import state_bytes
    from autoshard.rules import schedules

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
