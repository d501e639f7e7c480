"""Lower bounds on a layout's step time and peak memory, before its cost tables are built.

The whole contract: docs/modules/solve.md (passes/solve/bounds.py).
"""

from __future__ import annotations

import functools
import heapq
import math
from dataclasses import dataclass, replace

import numpy as np

from autoshard.ir import BlockKind, Recompute
from autoshard.passes.cost import cost
from autoshard.passes.cost.block import (block_activation_bytes, block_params, block_time, block_times,
                                         expert_block_params, fwd_bwd_s, memo_node_times, node_key, node_stem)
from autoshard.passes.cost.pipeline import p2p_seconds, p2p_terms, p2p_time
from autoshard.passes.cost.state import (dp_exposed_time, optimizer_time, state_bytes, tp_grad_sum_time,
                                         zero2_staging_bytes, zero_exposed_time)
from autoshard.rules import schedules, sharding
from autoshard.passes.cost.compiled import CompiledTable
from autoshard.passes.cost.layout import Layout
from autoshard.rules.schedules import bubble_fraction

KINDS = (BlockKind.EMBED, BlockKind.LAYER, BlockKind.HEAD)


@dataclass(frozen=True, slots=True, kw_only=True)
class Bounds:
    """What no plan of a layout beats, computed before any table: step time (all work without
    recompute perfectly balanced, the 1F1B fill, the optimizer step of an average stage) and
    peak memory (the weights, gradients and optimizer state of an average stage, the buffers)."""

    step_s: float
    peak_bytes: float


def lower_bounds(ct: CompiledTable, hw, layout: Layout, *, global_batch: int, seq_len: int,
                 block_s: dict | None = None, memo: dict | None = None) -> Bounds:
    """`Bounds` of `layout`. `block_s`: {kind: BlockTime without recompute} when already known
    (they depend on the mesh, micro-batch and intra-op strategy only); `memo`: a dict the caller
    keeps over many layouts, for what depends on fewer coordinates than the layout: the p2p time
    (not ZeRO), the bubble fraction (the schedule) and the ZeRO-dependent terms (not the schedule nor
    sequence parallelism; their shape-independent part, the parameters and ZeRO state per device, is
    kept in `ct.memo` over plans)."""
    if block_s is None:
        block_s = least_block_s(ct, hw, layout, seq_len=seq_len)
    bt = block_s
    mesh, spec = layout.mesh, ct.spec
    memo = {} if memo is None else memo
    key = _p2p_key(layout, memo)
    p2p = memo.get(key)
    if p2p is None:
        p2p = memo[key] = p2p_time(ct, hw, layout, seq_len=seq_len)
    work = sum(bt.values()) + (spec.layers - 1) * bt[BlockKind.LAYER] + mesh.pp * p2p
    m = layout.microbatches(global_batch)
    heaviest = max(bt.values()) + p2p
    key = _bubble_key(layout, m)
    f = memo.get(key)
    if f is None:
        f = memo[key] = float(bubble_fraction(layout.schedule, layout.virtual_stages, microbatches=m, pp=mesh.pp))
    key = _state_key(layout)
    state = memo.get(key)
    if state is None:
        state = memo[key] = _state_bounds(ct, hw, layout, seq_len=seq_len)
    optimizer_s, peak = state
    step = f * work + (m - f) * max(work / mesh.pp, heaviest) + optimizer_s
    return Bounds(step_s=step, peak_bytes=peak)


def least_block_s(ct: CompiledTable, hw, layout: Layout, *, seq_len: int) -> dict:
    """{kind: seconds of one block without recompute} that bound `layout`'s blocks from below: its own,
    or with per-stage choices (`Layout.stage_choices`) the least over the variants a stage may take
    (`solve_model.stage_variants`): every stage of such a plan runs one of them."""
    return least_block_s_many(ct, hw, (layout,), seq_len=seq_len)[0]


def least_block_s_many(ct: CompiledTable, hw, layouts, *, seq_len: int) -> list[dict]:
    """`least_block_s` of each of `layouts`, their block times priced together (`block_times`)."""
    return [least_of(times) for _, times in variant_block_times(ct, hw, layouts, seq_len=seq_len)]


def least_of(times: dict) -> dict:
    """{kind: the least seconds} of {kind: [the `BlockTime` of each variant]} (`variant_block_times`)."""
    return {k: min(bt.total_s for bt in times[k]) for k in KINDS}


def variant_block_times(ct: CompiledTable, hw, layouts, *, seq_len: int) -> list[tuple[list[Layout], dict]]:
    """For each of `layouts`: the variants a stage of it may take without recompute (`solve_model.stage_variants`)
    and {kind: [the `BlockTime` of each variant]}, all priced together (`block_times`)."""
    from autoshard.passes.solve.solve_model import stage_variants

    variants = [[v if v.recompute is Recompute.NONE else replace(v, recompute=Recompute.NONE)
                 for v in stage_variants(lay)] for lay in layouts]
    flat = [v for vs in variants for v in vs]
    times = {k: block_times(ct, hw, flat, k, seq_len=seq_len) for k in KINDS}
    ends = np.cumsum([len(vs) for vs in variants]).tolist()
    return [(vs, {k: t[end - len(vs):end] for k, t in times.items()}) for vs, end in zip(variants, ends)]


@dataclass(frozen=True, slots=True, kw_only=True)
class BoundColumns:
    """`bound_columns`' answer: per layout (in the order given) its bounds and its block times' key."""

    step_s: np.ndarray  # float64, `Bounds.step_s` of each layout
    peak_bytes: np.ndarray  # float64, `Bounds.peak_bytes`
    block_code: np.ndarray  # int64, the key of the layout's block times in `block_s`
    block_s: dict  # block code -> {kind: seconds} (`least_block_s`), what `refined_step_bound` takes


def bound_columns(ct: CompiledTable, hw, layouts: list[Layout], *, global_batch: int, seq_len: int,
                  memo: dict) -> BoundColumns:
    """`lower_bounds` of every layout of `layouts` (docs/modules/solve.md); `memo` as `lower_bounds'`."""
    lazy = LazyBounds(ct, hw, layouts, global_batch=global_batch, seq_len=seq_len, memo=memo)
    lazy.expand(np.unique(lazy.block_code).tolist())
    return BoundColumns(step_s=lazy.step_s, peak_bytes=lazy.peak_bytes, block_code=lazy.block_code,
                        block_s=lazy.block_s)


class LazyBounds:
    """`bound_columns`, the step bounds computed as the search asks for them. The peak bounds, and a floor under
    every step bound, are computed for all layouts at once: the floor is the step bound's sum with each block at
    the least compute (forward + backward node times) of its variants and no p2p, less 1e-9 of itself (the
    step bound adds recompute, communication and p2p, none negative, and every operation of its sum is monotone,
    so the floor is at most the bound). `ordered` yields the layouts in the order of their step bounds (ties by
    index), pricing a block key's layouts exactly (`expand`: `bound_columns`' own sums) only once the floor of
    the next layout not priced is at most the least bound priced and not yet yielded; most layouts of a plan
    lie beyond the runner-up, where the search stops, and their block times are never priced. `step_s` holds
    the bounds priced so far (nan elsewhere)."""

    def __init__(self, ct: CompiledTable, hw, layouts: list[Layout], *, global_batch: int, seq_len: int,
                 memo: dict) -> None:
        self.ct, self.hw, self.seq_len, self.memo = ct, hw, seq_len, memo
        n = len(layouts)
        block, self._p2p_code, state_code, sched_code, self._pp, rows, self.ep = layout_codes(layouts).T
        self.block_code = block
        self._m = m = global_batch // rows  # schedules.microbatches_per_step, over arrays
        reps = _CODES.reps
        optimizer_s, peak = np.zeros(len(reps)), np.zeros(len(reps))
        codes = np.unique(state_code)
        optimizer_s[codes], peak[codes] = _state_columns(ct, hw, codes, seq_len=seq_len)
        bubble = sched_code * 2 + (m < self._pp)
        f = np.zeros(2 * len(reps))
        for c in np.unique(bubble).tolist():
            lay = reps[c // 2]
            key = _bubble_key(lay, 0 if c % 2 else lay.mesh.pp)  # all it reads of m, pp: m < pp
            if key not in memo:
                i = int(np.flatnonzero(bubble == c)[0])
                memo[key] = float(bubble_fraction(lay.schedule, lay.virtual_stages, microbatches=int(m[i]),
                                                  pp=int(self._pp[i])))
            f[c] = memo[key]
        self._f, self._optimizer = f[bubble], optimizer_s[state_code]
        self.peak_bytes = peak[state_code]
        self.step_s = np.full(n, np.nan)
        self.block_s: dict = {}  # block code -> {kind: seconds} (`least_block_s`), of the codes priced
        self._blocks = np.zeros((len(reps), len(KINDS)))
        self._p2p = np.full(len(reps), np.nan)  # p2p code -> seconds, of the codes priced
        self._done = np.zeros(len(reps), dtype=bool)  # block codes priced
        by_code = np.argsort(block, kind="stable")
        self._by_code, self._starts = by_code, np.searchsorted(block[by_code], np.arange(len(reps) + 1))

    @functools.cached_property
    def floor_s(self) -> np.ndarray:
        """A floor under each layout's step bound (see the class), computed for all layouts at once."""
        floor = _compute_floors(self.ct, self.hw, np.unique(self.block_code).tolist(), seq_len=self.seq_len)
        e, l, h = floor[self.block_code].T  # [code, kind] -> per layout
        return np.where(self._m >= self._f, self._step(e, l, h, 0.0, slice(None)) * (1 - 1e-9), -np.inf)

    def steps_with(self, blocks: np.ndarray, *, extra: np.ndarray | float = 0.0) -> np.ndarray:
        """The step bound of every layout with its blocks at `blocks` [block code, kind] seconds instead of its own
        (a mixed stack's kind view bounds its layouts with the stack's mean layer: passes/solve/mixed_bounds.py),
        `extra` seconds of work more on some stage (the recompute memory forces there)."""
        e, l, h = blocks[self.block_code].T
        return self._step(e, l, h, self._p2p_s(np.arange(len(self.step_s))), slice(None), extra=extra)

    def _p2p_s(self, idx: np.ndarray) -> np.ndarray:
        """The p2p seconds of the layouts `idx` (`lower_bounds`' memo keys, priced where not kept yet)."""
        p2p_code = self._p2p_code[idx]
        todo = np.unique(p2p_code[np.isnan(self._p2p[p2p_code])]).tolist()
        keys = [_CODES.keys[c][0] for c in todo]  # lower_bounds' memo keys
        fresh = [c for c, key in zip(todo, keys) if key not in self.memo]
        if fresh:
            for c, p2p in zip(fresh, _p2p_columns(self.ct, self.hw, fresh, seq_len=self.seq_len).tolist()):
                self.memo[_CODES.keys[c][0]] = p2p
        self._p2p[todo] = [self.memo[key] for key in keys]
        return self._p2p[p2p_code]

    def _step(self, e, l, h, p, idx, *, extra=0.0):
        """`lower_bounds`' step sums of the layouts `idx` with these block and p2p seconds, in its order."""
        pp, m, f = self._pp[idx], self._m[idx], self._f[idx]
        work = e + l + h + (self.ct.spec.layers - 1) * l + pp * p + extra
        heaviest = np.maximum(np.maximum(e, l), h) + p
        return f * work + (m - f) * np.maximum(work / pp, heaviest) + self._optimizer[idx]

    def expand(self, codes: list[int]) -> np.ndarray:
        """Price the step bounds of the layouts of block codes `codes` (those not priced yet); their indices."""
        codes = [c for c in codes if not self._done[c]]
        if not codes:
            return np.zeros(0, dtype=np.int64)
        for c, bt in zip(codes, least_block_s_many(self.ct, self.hw, [_CODES.reps[c] for c in codes],
                                                   seq_len=self.seq_len)):
            self.block_s[c] = bt
            self._blocks[c] = [bt[k] for k in KINDS]
        self._done[codes] = True
        idx = np.concatenate([self._by_code[self._starts[c]:self._starts[c + 1]] for c in codes])
        e, l, h = self._blocks[self.block_code[idx]].T
        self.step_s[idx] = self._step(e, l, h, self._p2p_s(idx), idx)
        return idx

    def ordered(self, kept: np.ndarray):
        """The layouts `kept` (ascending indices) in the order of (step bound, index), lazily (see the class)."""
        kept = np.asarray(kept, dtype=np.int64)
        mine = np.zeros(len(self.step_s), dtype=bool)
        mine[kept] = True
        lazy = kept[np.argsort(self.floor_s[kept], kind="stable")]
        codes = self.block_code[lazy]
        known = kept[self._done[self.block_code[kept]]]
        heap = list(zip(self.step_s[known].tolist(), known.tolist()))
        heapq.heapify(heap)
        pos, size, floor = 0, 16, None  # floor: of the next layout not priced (None: to find)
        while True:
            if floor is None:
                rest = self._done[codes[pos:]]
                pos = len(lazy) if rest.all() else pos + int(np.argmin(rest))
                floor = float(self.floor_s[lazy[pos]]) if pos < len(lazy) else math.inf
            if pos < len(lazy) and (not heap or floor <= heap[0][0]):
                window = codes[pos:pos + 8 * size]
                window = window[~self._done[window]]
                _, first = np.unique(window, return_index=True)
                new = self.expand(window[np.sort(first)[:size]].tolist())
                new = new[mine[new]]
                for item in zip(self.step_s[new].tolist(), new.tolist()):
                    heapq.heappush(heap, item)
                size, floor = min(2 * size, 256), None
                continue
            if not heap:
                return
            yield heapq.heappop(heap)[1]

    def least(self, kept: np.ndarray) -> float:
        """The least step bound of the layouts `kept` (inf when none)."""
        k = next(self.ordered(kept), None)
        return math.inf if k is None else float(self.step_s[k])


def _p2p_columns(ct: CompiledTable, hw, codes: list[int], *, seq_len: int) -> np.ndarray:
    """`p2p_time` of the p2p codes `codes` (of each code's layout), the same float operations over arrays
    (`p2p_seconds`); their shape-independent terms (`p2p_terms`, the layer's node-time stem) kept in
    the table's memo over plans, per device and `_CODES` epoch."""
    table = epoch_table(ct, "p2p columns", hw)
    rows = []
    for c in codes:
        row = table.get(c)
        if row is None:
            lay = _CODES.reps[c]
            if lay.mesh.pp == 1:
                row = (0.0, 1, 1, 1.0, 1, 0.0, 1.0, 1, 0, -1)  # p2p 0 (the pipelined flag first)
            else:
                base = lay if lay.recompute is Recompute.NONE else replace(lay, recompute=Recompute.NONE)
                per_chunk = max(1, ct.spec.layers // (lay.mesh.pp * lay.virtual_stages))  # pipeline._chunk_compute's
                row = (1.0, *p2p_terms(hw, lay), per_chunk,
                       _CODES.stem(node_stem(base, BlockKind.LAYER), base))
            row = table[c] = row
        rows.append(row)
    cols = np.array(rows, dtype=np.float64).reshape(-1, 10)
    piped, mb, cp, act_bytes, shard, latency, bandwidth, crossings, per_chunk, stem = cols.T
    fwd, bwd = np.zeros(len(rows)), np.zeros(len(rows))
    chunked = np.flatnonzero((crossings != 1) & (piped > 0))
    if len(chunked):  # pipeline._chunk_compute: the layer's forward / backward node-time sums (`block_time`'s)
        blk, stems = ct.block(BlockKind.LAYER), stem[chunked].astype(np.int64)
        uniq = np.unique(stems).tolist()
        keys = [node_key(hw, _CODES.stems[i][0], seq_len) for i in uniq]
        memo_node_times(ct, hw, BlockKind.LAYER, {key: _CODES.stems[i][1] for key, i in zip(keys, uniq)},
                             seq_len=seq_len)
        memo = blk.shaped.at(seq_len)
        sums = {i: fwd_bwd_s(blk, memo[key]) for i, key in zip(uniq, keys)}
        pairs = np.array([sums[i] for i in stems.tolist()]).reshape(-1, 2)
        fwd[chunked], bwd[chunked] = per_chunk[chunked] * pairs[:, 0], per_chunk[chunked] * pairs[:, 1]
    p2p = p2p_seconds(ct, mb.astype(np.int64), cp.astype(np.int64), act_bytes, shard.astype(np.int64), latency,
                           bandwidth, crossings.astype(np.int64), fwd, bwd, seq_len=seq_len)
    return np.where(piped > 0, p2p, 0.0)


def epoch_table(ct: CompiledTable, name: str, hw) -> dict:
    """The table `name` of device `hw` in the table's memo, per `_CODES` epoch (what its codes mean); when the codes
    start over, the tables of the earlier epoch are dropped (their codes mean nothing now)."""
    key = (name, hw, _CODES.epoch)
    table = ct.memo.get(key)
    if table is None:
        for old in [k for k in ct.memo if k[0] == name and k[2] is not _CODES.epoch]:
            del ct.memo[old]
        table = ct.memo[key] = {}
    return table


def _compute_floors(ct: CompiledTable, hw, codes: list[int], *, seq_len: int) -> np.ndarray:
    """[block code, kind]: for each of `codes` and block kind, the least over the code's variants
    (`least_block_s`) of the sum of the block's node times, the forward and backward compute `block_time` adds
    recompute and communication to (any order of the sum: the caller lowers it by 1e-9 of itself). The node
    times go in the block's memo of the sequence length, where `block_times` reads them."""
    out = np.zeros((len(_CODES.reps), len(KINDS)))
    for ki, kind in enumerate(KINDS):
        owner, ids = [], []
        for c in codes:
            stems = _variant_stems(c)[ki]
            owner.extend([c] * len(stems)), ids.extend(stems)
        ids = np.array(ids, dtype=np.int64)
        uniq = np.unique(ids).tolist()
        keys = [node_key(hw, _CODES.stems[i][0], seq_len) for i in uniq]
        memo_node_times(ct, hw, kind, {key: _CODES.stems[i][1] for key, i in zip(keys, uniq)}, seq_len=seq_len)
        memo = ct.block(kind).shaped.at(seq_len)
        sums = np.zeros(len(_CODES.stems))
        sums[uniq] = [float(memo[key].sum()) for key in keys]
        least = np.full(len(_CODES.reps), np.inf)
        np.minimum.at(least, np.array(owner, dtype=np.int64), sums[ids])
        out[codes, ki] = least[codes]
    return out


def _variant_stems(code: int) -> tuple:
    """Per block kind, the node-time stems (`node_stem`, as ids in `_CODES.stems`) of the variants of block
    code `code`'s layouts (`least_block_s`); kept over plans."""
    stems = _CODES.variant_stems.get(code)
    if stems is None:
        from autoshard.passes.solve.solve_model import stage_variants

        variants = [v if v.recompute is Recompute.NONE else replace(v, recompute=Recompute.NONE)
                    for v in stage_variants(_CODES.reps[code])]
        stems = _CODES.variant_stems[code] = tuple(tuple(_CODES.stem((node_stem(v, k)), v) for v in variants)
                                                    for k in KINDS)
    return stems


class _Codes:
    """Small integer codes for the keys a layout's bound reads, and a layout of each code; kept over plans."""

    def __init__(self) -> None:
        self.of: dict = {}  # (memo key, what one plan's layouts share) -> code
        self.keys: list = []  # code -> key
        self.reps: list = []  # code -> a layout with that key
        self.layouts: dict = {}  # id(layout) -> (layout, block, p2p, state, schedule codes, pp, dp x ep x micro-batch)
        self.choices: dict = {}  # `_layer_choices`' memo
        self.parts: dict = {}  # id(part) -> (part, `layout_codes` of it)
        self.epoch = object()  # what the codes mean: a new one when they start over
        self.read = 0  # layouts whose codes were read (each once per process, held here or in `parts`)
        self.variant_stems: dict = {}  # `_variant_stems`' memo
        self.stem_of: dict = {}  # node-time stem -> id
        self.stems: list = []  # id -> (stem, a layout with it)

    def stem(self, stem: tuple, layout: Layout) -> int:
        i = self.stem_of.get(stem)
        if i is None:
            i = self.stem_of[stem] = len(self.stems)
            self.stems.append((stem, layout))
        return i

    def code(self, key: tuple, layout: Layout) -> int:
        c = self.of.get(key)
        if c is None:
            c = self.of[key] = len(self.keys)
            self.keys.append(key)
            self.reps.append(layout)
        return c


_CODES = _Codes()


def layout_codes(layouts) -> np.ndarray:
    """[layout, (block, p2p, state, schedule code, pp, dp x ep x micro-batch, ep)] of `layouts`; when they are
    `parts`' concatenation (an attribute: the planner's candidates, `planner.CandidateLayouts`), read a part at a
    time, once per part object per process (held here, so its id is not reused)."""
    epoch, parts = _CODES.epoch, getattr(layouts, "parts", None)
    if parts is None:
        out = np.array([(*_layout_codes(lay)[1:], lay.mesh.ep) for lay in layouts],
                       dtype=np.int64).reshape(len(layouts), 7)
    else:
        out = []
        for part in parts:
            entry = _CODES.parts.get(id(part))
            if entry is None or entry[0] is not part:
                codes = np.array([_codes_of(lay) for lay in part], dtype=np.int64).reshape(len(part), 7)
                if _CODES.epoch is not epoch:  # the codes started over midway: read again
                    return layout_codes(layouts)
                entry = _CODES.parts[id(part)] = (part, codes)
            out.append(entry[1])
        out = np.concatenate(out) if out else np.zeros((0, 7), dtype=np.int64)
    return out if _CODES.epoch is epoch else layout_codes(layouts)  # the codes started over midway: read again


def _layout_codes(layout: Layout) -> tuple:
    """(layout, block code, p2p code, state code, schedule code, pp, dp x ep x micro-batch), once per layout
    object (held here, so its id is not reused)."""
    entry = _CODES.layouts.get(id(layout))
    if entry is None or entry[0] is not layout:
        entry = _CODES.layouts[id(layout)] = (layout, *_codes_of(layout)[:6])
    return entry


def _codes_of(layout: Layout) -> tuple:
    """(block code, p2p code, state code, schedule code, pp, dp x ep x micro-batch, ep) of `layout`."""
    _CODES.read += 1
    if _CODES.read > 1_000_000:  # many device counts planned in one process: start over
        _CODES.__init__()
    mesh = layout.mesh
    # what every layout of one plan shares, so the memo keys leave it out: a code is for any plan
    plan = (layout.numerics, layout.moe_imbalance, layout.recompute)
    block = ("block", mesh.tp, mesh.cp, mesh.ep, layout.micro_batch, layout.sequence_parallel, layout.strategies,
             layout.stage_choices)
    return (_CODES.code((block, plan), layout), _CODES.code((_p2p_key(layout, _CODES.choices), plan), layout),
            _CODES.code((_state_key(layout), plan), layout),
            _CODES.code((("schedule", layout.schedule, layout.virtual_stages), ()), layout), mesh.pp,
            schedules.rows_per_microbatch(mesh, layout.micro_batch), mesh.ep)


def _p2p_key(layout: Layout, memo: dict) -> tuple:
    """What `p2p_time` reads: of the schedule, the boundaries each micro-batch crosses and v."""
    return ("p2p", layout.mesh, layout.micro_batch, layout.sequence_parallel,  # the layers' choices: their compute
            _layer_choices(layout.strategies, memo), schedules.p2p_factor(layout.schedule, layout.virtual_stages),
            layout.virtual_stages)


def _bubble_key(layout: Layout, microbatches: int) -> tuple:
    return ("bubble", layout.schedule, layout.virtual_stages, microbatches < layout.mesh.pp)  # all it reads of m, pp


def _state_key(layout: Layout) -> tuple:
    """The ZeRO-dependent terms: of the mesh, the parameters (tp, strategies) and the buffers (micro-batch)."""
    return ("state", layout.mesh, layout.micro_batch, layout.strategies, layout.zero, layout.offload_optimizer, layout.numerics)


def _layer_choices(strategies: tuple, memo: dict) -> tuple:
    """`sharding.block_strategies(strategies, LAYER)`, memoised (asked once per layout)."""
    key = ("layer choices", strategies)
    if key not in memo:
        memo[key] = sharding.block_strategies(strategies, BlockKind.LAYER)
    return memo[key]


def _state_bounds(ct: CompiledTable, hw, layout: Layout, *, seq_len: int) -> tuple[float, float]:
    """(optimizer seconds, peak bytes without activations) of the average stage of `layout` (`Bounds`). What
    does not depend on the shape (all but the buffers) is kept in the table's memo, over plans."""
    state, optimizer_s = _fixed_state(ct, hw, layout)
    return optimizer_s, state + cost.buffer_bytes(ct, layout, seq_len=seq_len)


def average_stage_params(ct: CompiledTable, layout: Layout) -> tuple[float, float]:
    """(parameters, routed-expert parameters) of the average stage of `layout`: the whole model's over pp (the stage
    with the most holds at least the average); the model's parameters kept in the table's memo over plans."""
    mesh, spec = layout.mesh, ct.spec
    key = ("params", mesh.tp, mesh.ep, mesh.pp > 1, layout.strategies)
    if key not in ct.memo:
        params = sum(block_params(ct, layout, k) for k in KINDS) + \
            (spec.layers - 1) * block_params(ct, layout, BlockKind.LAYER)
        if spec.tied and mesh.pp > 1:
            params += block_params(ct, layout, BlockKind.EMBED)  # the head's copy
        ct.memo[key] = params
    return ct.memo[key] / mesh.pp, spec.layers * expert_block_params(ct, layout, BlockKind.LAYER) / mesh.pp


def _fixed_state(ct: CompiledTable, hw, layout: Layout) -> tuple[float, float]:
    """(state bytes, optimizer seconds) of the average stage of `layout`, kept in the table's memo over plans."""
    mesh = layout.mesh
    key = ("state bytes", hw, mesh, layout.strategies, layout.zero, layout.offload_optimizer, layout.numerics)  # not the micro-batch
    if key not in ct.memo:
        avg, experts = average_stage_params(ct, layout)
        ct.memo[key] = (state_bytes(avg, layout, expert=experts).total
                        + zero2_staging_bytes(avg, layout, expert=experts),
                        optimizer_time(hw, avg, layout, expert=experts))
    return ct.memo[key]


def _state_columns(ct: CompiledTable, hw, codes: np.ndarray, *, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(optimizer seconds, peak bytes) of the state codes `codes` (`_state_bounds` of each code's layout, the
    same float operations over arrays: `cost.staging_bytes`). Their shape-independent terms are kept in the
    table's memo over plans (per device, and per `_CODES` epoch: the codes' meaning)."""
    table = epoch_table(ct, "state columns", hw)
    rows = []
    for c in codes.tolist():
        row = table.get(c)
        if row is None:
            lay = _CODES.reps[c]
            mb, cp, act_bytes, staged, z3 = cost.buffer_terms(ct, lay)
            row = table[c] = (*_fixed_state(ct, hw, lay)[::-1], mb, cp, act_bytes, float(staged), z3)
        rows.append(row)
    optimizer_s, state, mb, cp, act_bytes, staged, z3 = np.array(rows, dtype=np.float64).reshape(-1, 7).T
    buffers = cost.staging_bytes(ct, mb.astype(np.int64), cp.astype(np.int64), act_bytes, staged, z3,
                                 seq_len=seq_len)
    return optimizer_s, state + buffers


def refined_step_bound(ct: CompiledTable, hw, layout: Layout, bounds: Bounds, *, global_batch: int, seq_len: int,
                       block_s: dict, memo: dict, cutoff_s: float = math.inf) -> float:
    """A lower bound on `layout`'s step at least `bounds.step_s` (docs/modules/solve.md); `block_s`
    and `memo` as `lower_bounds` had them. With pp > 1, where the slowest-stage floor alone does not reach
    `cutoff_s` (the value the layout must beat), the tail the floor takes is the least largest stage tail over
    the splits (`_tail_floor`), not the optimizer step of the average stage."""
    mesh, spec = layout.mesh, ct.spec
    m = layout.microbatches(global_batch)
    if mesh.pp == 1:
        key = ("single", mesh, layout.micro_batch, layout.sequence_parallel, layout.strategies, layout.zero,
               layout.offload_optimizer, layout.numerics, layout.moe_imbalance)
        if key not in memo:
            memo[key] = _single_stage_step(ct, hw, layout, microbatches=m, seq_len=seq_len,
                                           fixed_bytes=bounds.peak_bytes, memo=memo)
        return max(bounds.step_s, memo[key])
    p2p = memo[_p2p_key(layout, memo)]
    f = memo[_bubble_key(layout, m)]
    key = _state_key(layout)
    if key not in memo:  # (the lazy bounds keep the state terms in columns)
        memo[key] = _state_bounds(ct, hw, layout, seq_len=seq_len)
    optimizer_s = memo[key][0]
    e, l, h = (block_s[k] for k in KINDS)
    work = sum(block_s.values()) + (spec.layers - 1) * l + mesh.pp * p2p
    key = ("floor", mesh.pp, layout.virtual_stages, e, l, h, p2p)
    if key not in memo:
        memo[key] = slowest_stage_floor(mesh.pp, spec.layers, first_s=e + p2p, middle_s=p2p, last_s=h + p2p,
                                        layer_s=l, min_layers=(layout.virtual_stages - 1, layout.virtual_stages))
    step = max(bounds.step_s, f * work + (m - f) * memo[key] + optimizer_s)
    if step >= cutoff_s * (1 - 1e-9):
        return step
    return max(step, f * work + (m - f) * memo[key] + _tail_floor(ct, hw, layout, seq_len=seq_len, memo=memo))


def _tail_floor(ct: CompiledTable, hw, layout: Layout, *, seq_len: int, memo: dict) -> float:
    """pp > 1: the least largest stage tail (exposed gradient sync + optimizer step, as `solve_model.stage_tails`
    tabulates it, at each layer count the least over a stage's variants) over the splits of the layers, relaxed
    as `planner._bottleneck`'s spread is (a cap is reachable when the fewest and most layers the stages can hold
    under it bracket the layers): at most the largest tail of every assignment, inf when no split exists.
    Memoised on what the tails read (not the schedule but its v)."""
    from autoshard.passes.solve.solve_model import stage_variants

    key = ("tail floor", layout.mesh, layout.micro_batch, layout.sequence_parallel, layout.strategies,
           layout.stage_choices, layout.zero, layout.offload_optimizer, layout.numerics, layout.virtual_stages,
           layout.moe_imbalance)
    if key in memo:
        return memo[key]
    mesh, v, spec = layout.mesh, layout.virtual_stages, ct.spec
    places = ((True, False), (False, True), (False, False))[:3 if mesh.pp > 2 else 2]  # first, last, middle stages
    n = np.arange(spec.layers + 1, dtype=float)
    sums = []  # per (variant, place): `solve_model._stage_sums`' params, backward and forward (recompute none)
    for var in stage_variants(layout):
        what = ("tail sums", var.mesh.tp, var.mesh.cp, var.mesh.ep, var.micro_batch, var.numerics,
                var.sequence_parallel, var.strategies, var.moe_imbalance, len(places))  # what they read
        if what not in memo:
            bt = {k: block_time(ct, hw, var, k, seq_len=seq_len) for k in KINDS}  # (the bounds priced them)
            prm = np.array([block_params(ct, var, k) for k in KINDS])
            bwd, fwd = np.array([bt[k].bwd_s for k in KINDS]), np.array([bt[k].fwd_s for k in KINDS])
            memo[what] = []
            for embed, head in places:
                counts = np.stack([np.full_like(n, float(embed)), n, np.full_like(n, float(head))])  # [kind, n]
                tied = prm[0] if head and spec.tied and not embed else 0.0
                memo[what].append((prm @ counts + tied, bwd @ counts, fwd @ counts))
        sums.extend(memo[what])
    params, bwd, fwd = (np.stack(x) for x in zip(*sums))
    experts = n * expert_block_params(ct, layout, BlockKind.LAYER)
    tails = (dp_exposed_time(hw, params, layout, backward_s=bwd, forward_s=fwd, expert=experts)
             + optimizer_time(hw, params, layout, expert=experts)
             + tp_grad_sum_time(hw, spec, layout, n))  # every place and variant at once
    least = np.broadcast_to(tails, params.shape).reshape(-1, len(places), len(n)).min(axis=0)
    stages = [(tail[fewest:], fewest, 1 if embed or head else mesh.pp - 2)
              for tail, (embed, head), fewest in zip(least, places, (v - 1, v - 1, v))]  # (tails, fewest, stages)
    caps = np.unique(np.concatenate([tail for tail, _, _ in stages]))  # every cap a largest tail can be
    lo, hi, reach = np.zeros(len(caps), dtype=np.int64), np.zeros(len(caps), dtype=np.int64), np.ones(len(caps), bool)
    for tail, fewest, count in stages:  # per cap: the fewest / most layers the stages hold with no tail above it
        first = np.minimum.accumulate(tail)  # the least tail of the counts up to n: the first count under a cap
        last = np.minimum.accumulate(tail[::-1])[::-1]  # the least from n on: the last count under a cap
        reach &= caps >= first[-1]
        lo += count * (fewest + np.searchsorted(-first, -caps, side="left"))
        hi += count * (fewest + np.searchsorted(last, caps, side="right") - 1)
    ok = np.flatnonzero(reach & (lo <= spec.layers) & (spec.layers <= hi))  # monotone in the cap: the first is least
    memo[key] = float(caps[ok[0]]) if len(ok) else math.inf
    return memo[key]


def slowest_stage_floor(pp: int, layers: int, *, first_s: float, middle_s: float, last_s: float, layer_s: float,
                        min_layers: tuple[int, int] = (0, 1)) -> float:
    """The least slowest-stage time over every split of `layers` layers on `pp` >= 2 stages, stage i
    taking `fixed_i + n_i * layer_s` (fixed: `first_s`, `middle_s` for the pp - 2 middle stages,
    `last_s`), the first and last holding at least `min_layers[0]` layers, the middle ones
    `min_layers[1]`. Any stage time that is at least this (recompute, ZeRO traffic: only more) keeps it
    a lower bound. Counting is made generous by 1e-6 of a layer, and the result lowered by as much,
    so rounding in the callers' sums never lifts it above a split's true slowest stage."""
    if layer_s <= 0:
        return max(first_s, last_s, middle_s if pp > 2 else first_s)
    tol = 1e-6
    stages = ((first_s, min_layers[0], 1), (last_s, min_layers[0], 1), (middle_s, min_layers[1], pp - 2))

    k = np.arange(layers + 1, dtype=np.float64)
    caps = np.unique(np.concatenate([fixed + k * layer_s for fixed, _, _ in stages]))  # sorted
    held, can = np.zeros(len(caps)), np.ones(len(caps), dtype=bool)  # per cap: most layers the stages hold with
    for fixed, least, count in stages:  # none slower than it, and whether each can hold its fewest
        most = np.floor((caps - fixed) / layer_s + tol)
        if count:
            can &= most >= least
        held += count * most
    enough = can & (held >= layers)  # monotone in the cap: the first is the least
    if not enough[-1]:
        return float(caps[-1])
    return float(caps[int(np.argmax(enough))]) - tol * layer_s


def _single_stage_step(ct: CompiledTable, hw, layout: Layout, *, microbatches: int, seq_len: int,
                       fixed_bytes: float, memo: dict) -> float:
    """pp = 1: the step of the one stage (every block) at its fastest recompute level among those that can fit,
    m (compute + recompute + communication + exposed ZeRO traffic) + exposed gradient sync + optimizer,
    as `solve_model` tabulates it; inf when none can. A level cannot fit when `fixed_bytes` (`Bounds.peak_bytes`:
    for one stage its weights, gradients, optimizer state and buffers, the bytes the tables count besides the
    activations and the logits) plus one micro-batch's activations at that level exceed the device (the
    tables hold at least one micro-batch in flight; 1e-9 of slack for the sums' order). `memo`: the blocks'
    sums per level, shared by the ZeRO levels of a mesh."""
    spec = ct.spec
    counts = {BlockKind.EMBED: 1, BlockKind.LAYER: spec.layers, BlockKind.HEAD: 1}
    key = ("single blocks", layout.mesh, layout.micro_batch, layout.sequence_parallel, layout.strategies,
           layout.numerics, layout.moe_imbalance)  # what block times, activations and parameters read: not ZeRO
    if key not in memo:
        edge: dict = {}  # the embedding's and head's numbers, the same at every level (they do not recompute)
        memo[key] = ([_single_stage_blocks(ct, hw, replace(layout, recompute=r), counts, seq_len=seq_len, edge=edge)
                      for r in Recompute], sum(block_params(ct, layout, k) * c for k, c in counts.items()),
                     spec.layers * expert_block_params(ct, layout, BlockKind.LAYER))
    levels, params, experts = memo[key]
    fits = [level for level in levels if fixed_bytes + level[0] <= hw.memory_bytes * (1 + 1e-9)]
    if not fits:
        return math.inf
    zexp = zero_exposed_time(hw, params, layout, compute_s=np.array([c for _, c, _, _, _ in fits]),
                                  backward_s=np.array([b for _, _, _, b, _ in fits]), expert=experts,
                                  blocks=sum(counts.values()))  # every level that fits at once (elementwise)
    t, bwd, fwd = min((comp + other + z, bwd, fwd) for (_, comp, other, bwd, fwd), z in zip(fits, zexp.tolist()))
    tail = (float(dp_exposed_time(hw, params, layout, backward_s=bwd, forward_s=fwd, expert=experts))
            + optimizer_time(hw, params, layout, expert=experts) + tp_grad_sum_time(hw, spec, layout, spec.layers))
    return microbatches * t + tail


def _single_stage_blocks(ct: CompiledTable, hw, layout: Layout, counts: dict, *, seq_len: int, edge: dict) -> tuple:
    """(activation bytes of one micro-batch, compute, recompute + communication, backward, forward seconds) of
    `counts` blocks at `layout`'s recompute level. `edge`: the embedding's and head's (activation bytes,
    BlockTime) where another level priced them (only a layer recomputes)."""
    nums = {}
    for k in KINDS:
        if k is BlockKind.LAYER or k not in edge:
            nums[k] = (block_activation_bytes(ct, layout, k, seq_len=seq_len, hw=hw),
                       block_time(ct, hw, layout, k, seq_len=seq_len))
            if k is not BlockKind.LAYER:
                edge[k] = nums[k]
        else:
            nums[k] = edge[k]
    act = sum(nums[k][0] * c for k, c in counts.items())
    bt = {k: nums[k][1] for k in KINDS}
    return (act, sum(bt[k].compute_s * c for k, c in counts.items()),
            sum((bt[k].recompute_s + bt[k].comm_s) * c for k, c in counts.items()),
            sum(bt[k].bwd_s * c for k, c in counts.items()), sum(bt[k].fwd_s * c for k, c in counts.items()))
