"""The columns of a mixed layer stack's stage tables: a stage is a range of layers [start, end).

A model whose layers are of several kinds (passes/capture/layer_kinds.py) has a stage cost that depends on
which layers it holds, not only how many, so the planner's tables (solve_model.MeshProblem with `sequence`
set) have one column per layer range of the L layers, column start * (L + 1) + end (`range_column`); ranges
with end < start are no stage. `range_counts` gives the layers of each kind in every range (prefix sums);
`range_classes` the distinct counts (a stage's cost reads its range only through them: 333 classes for the 14,161
ranges of Nemotron-H-56B's 118 layers), so a table is priced once per class and taken to the columns;
`range_sums` is the min-plus DP over the stages and their boundaries that passes/solve/ranges.py searches with.
"""

from __future__ import annotations

import functools

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
def range_classes(sequence: tuple[int, ...], kinds: int) -> tuple[np.ndarray, np.ndarray]:
    """(held [kinds, U], index [(L + 1)^2]): the U distinct per-kind layer counts of the ranges, and the class of
    each range column (column c holds held[:, index[c]] layers of each kind; b < a: negative counts, no stage)."""
    held = range_counts(sequence, kinds, embed=False, head=False)[1:-1]
    classes, index = np.unique(held.T, axis=0, return_inverse=True)
    classes, index = np.ascontiguousarray(classes.T), index.reshape(-1)
    classes.flags.writeable = index.flags.writeable = False
    return classes, index


@functools.lru_cache(maxsize=64)
def range_lengths(layers: int) -> np.ndarray:
    """[(L + 1)^2]: the layers of each range, b - a (negative: no stage)."""
    x = np.arange(layers + 1)
    out = (x[None, :] - x[:, None]).reshape(-1)
    out.flags.writeable = False
    return out


def stage_windows(layers: int, lows) -> list[tuple[slice, slice]]:
    """Per stage i, the slices of starts and ends it can have when stage j holds at least `lows[j]` layers (the
    stages before i hold their least, those after it leave theirs)."""
    before = np.concatenate([[0], np.cumsum(lows)]).astype(int)  # least layers of the stages before i
    after = int(before[-1])
    return [(slice(int(before[i]), layers - (after - int(before[i])) + 1),
             slice(int(before[i]) + int(lows[i]), layers - (after - int(before[i + 1])) + 1)) for i in range(len(lows))]


def range_sums(stage_table, pp: int, layers: int, count: int, lows, *,
               splits: bool = True) -> tuple[np.ndarray, np.ndarray | None]:
    """The least sum over stages of t_i[a_i, a_{i+1}] with a_0 = 0 and a_pp = L, for `count` tables side by side,
    stage i holding at least `lows[i]` layers: `stage_table(i, starts, ends)` gives stage i's [count, starts, ends]
    (inf: not allowed) for the slices of starts and ends the other stages' least layers leave open
    (`stage_windows`). Returns (sums [count], counts [count, pp] of the splits reaching them, or None without
    `splits`; a row is meaningless where its sum is inf)."""
    size = layers + 1
    best = np.full((count, size), np.inf)
    best[:, 0] = 0.0
    args = []
    for i, (starts, ends) in enumerate(stage_windows(layers, lows)):
        cand = best[:, starts, None] + stage_table(i, starts, ends)  # [j, a, b]
        if not splits:
            best = np.full((count, size), np.inf)
            best[:, ends] = cand.min(axis=1)
            continue
        arg = cand.argmin(axis=1)  # [j, b]: the smallest start on ties
        best = np.full((count, size), np.inf)
        best[:, ends] = np.take_along_axis(cand, arg[:, None, :], axis=1)[:, 0, :]
        full = np.zeros((count, size), dtype=np.int64)
        full[:, ends] = arg + starts.start
        args.append(full)
    if not splits:
        return best[:, layers], None
    ends = np.full(count, layers)
    bounds = [ends]
    for arg in reversed(args):  # each table's boundaries, from the last stage back
        ends = arg[np.arange(count), ends]
        bounds.append(ends)
    edges = np.stack(bounds[::-1], axis=1)  # [j, pp + 1]
    return best[:, layers], np.diff(edges, axis=1)
