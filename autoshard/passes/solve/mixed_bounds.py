"""Lower bounds on the step and peak memory of a mixed layer stack's layouts, before their tables are built.

`mixed_bounds` is what `planner.ranges_search` orders and prunes a mixed stack's layouts by. Three floors, each a
sum of what no split of the stack's layers over the pipeline stages escapes:

* the step of `bounds.lower_bounds` per kind view with the stack's mean layer (its summed work exact, its heaviest
  block no more than the heaviest), plus the recompute that memory forces (`forced_recompute`);
* the peak of `bounds.lower_bounds` per kind view (every layer at that kind's size), the least over the kinds;
* the peak of the stack's actual mix (`mixed_peak_floor`).

The whole contract: docs/modules/solve.md (passes/solve/mixed_bounds.py).
"""

from __future__ import annotations

import functools

import numpy as np

from autoshard.ir import BlockKind
from autoshard.passes.cost import cost
from autoshard.passes.cost.block import block_activation_bytes, block_params, expert_block_params
from autoshard.passes.cost.compiled import CompiledTable
from autoshard.passes.cost.state import state_bytes
from autoshard.passes.solve import layer_ranges
from autoshard.passes.solve.bounds import (LazyBounds, average_stage_params, epoch_table, layout_codes, least_of,
                                           variant_block_times)
from autoshard.rules import schedules


def mixed_bounds(ct: CompiledTable, hw, layouts: list, *, global_batch: int, seq_len: int
                 ) -> tuple[np.ndarray, np.ndarray]:
    """(step, peak bytes) lower bounds of each of a mixed stack's resolved `layouts` (see the module); the step
    bound of a layout whose peak bound exceeds the device is left without the forced recompute (it is pruned)."""
    if not layouts:
        return np.zeros(0), np.zeros(0)
    counts = _kind_counts(ct)
    all_codes = layout_codes(layouts)
    codes = all_codes[:, 0]
    blocks = epoch_table(ct, "range bound blocks", hw).setdefault(seq_len, {})  # after the codes: their epoch
    first = np.unique(codes, return_index=True)[1].tolist()  # a layout of each code: they share their block times
    new = [k for k in first if int(codes[k]) not in blocks]
    per_kind = [_least_layer_many(view, hw, [layouts[k] for k in new], seq_len=seq_len) for view in ct.kinds]
    for j, k in enumerate(new):
        blocks[int(codes[k])] = [kind[j] for kind in per_kind]
    seconds = np.zeros((int(codes.max()) + 1, 3))  # [block code, (embed, mean layer, head)]
    fwd = np.zeros((int(codes.max()) + 1, len(ct.kinds)))  # [block code, kind]: the least forward of a layer
    act = np.zeros((int(codes.max()) + 1, len(ct.kinds)))  # [block code, kind]: a layer's saved bytes, no recompute
    for k in first:
        code = int(codes[k])
        kinds = blocks[code]  # each kind's ({block: seconds}, least forward seconds, saved bytes)
        mean = float(counts @ [b[BlockKind.LAYER] for b, _, _ in kinds]) / counts.sum()
        seconds[code] = (kinds[0][0][BlockKind.EMBED], mean, kinds[0][0][BlockKind.HEAD])
        fwd[code] = [f for _, f, _ in kinds]
        act[code] = [a for _, _, a in kinds]
    memos = epoch_table(ct, "range bound memos", hw).setdefault(seq_len, [{} for _ in ct.kinds])
    per = [LazyBounds(view, hw, layouts, global_batch=global_batch, seq_len=seq_len, memo=memo)
           for view, memo in zip(ct.kinds, memos)]
    average, per_layer, buffers, inputs = _memory_columns(ct, layouts, all_codes, seq_len=seq_len)
    peak = np.maximum(np.min([b.peak_bytes for b in per], axis=0), average + buffers + inputs)
    fits = np.flatnonzero(peak <= hw.memory_bytes)
    layers = forced_recompute(ct, hw, [layouts[j] for j in fits.tolist()], all_codes[fits], per_layer[fits],
                              act[codes[fits]], buffers[fits], global_batch=global_batch)
    extra = np.zeros(len(layouts))
    extra[fits] = _least_total(fwd[codes[fits]], counts, layers)  # the forced layers' reruns, at least
    return np.min([b.steps_with(seconds, extra=extra) for b in per], axis=0), peak


def mixed_peak_floor(ct: CompiledTable, layouts, *, seq_len: int) -> np.ndarray:
    """A floor under the peak bytes of every plan of each of a mixed stack's `layouts` (`ct.kinds`), each a sum
    of what no stage split escapes: the weights, gradients and optimizer state of the average stage over the
    stack's actual kinds (`state_bytes` is linear in the parameters, so it is the kinds' states weighted by their
    layer counts; the stage holding the most holds at least the average), the least of the kinds' buffers (what
    `_stage_columns` adds per stage), and the activations of the average stage at full recompute (a layer's input,
    a sequence shard where a stage may take sequence parallelism) for the one micro-batch every stage holds at
    least. ZeRO-2's staging is left out (it is not monotone in a stage's dense and expert parameters together).
    `bounds.lower_bounds`' peak per kind view holds every layer at that kind's size: this one reads the mix."""
    average, _, buffers, inputs = _memory_columns(ct, layouts, layout_codes(layouts), seq_len=seq_len)
    return average + buffers + inputs


def forced_recompute(ct: CompiledTable, hw, layouts, codes: np.ndarray, per_layer: np.ndarray, act: np.ndarray,
                     buffers: np.ndarray, *, global_batch: int) -> np.ndarray:
    """How many of a mixed stack's layers every plan of each of `layouts` (`codes`: their `bounds.layout_codes`)
    recomputes, at least, to fit the device:
    a stage without recompute keeps, per layer of kind k, its state `per_layer[j, k]` and its saved bytes
    `act[j, k]` for each micro-batch it holds in flight (`schedules.in_flight`), besides `buffers[j]`, all within
    the device. Two ceilings on the layers the stages without recompute hold, the lower one counts: per stage, the
    longest contiguous range of the stack whose bytes at that stage's in-flight count fit (`_longest_within`); over
    all stages, the most of the stack's layers whose bytes at one micro-batch in flight fit pp devices. A stage that
    recomputes reruns the forward of every layer it holds (`Recompute.FULL`: a mixed stack's stages recompute all
    or none): where the ceilings hold fewer than all the layers, at least one stage recomputes, and the stages that
    do not are at most pp - 1 (the ceilings again, the least stage's left out, over pp - 1 devices); the one stage
    of pp = 1 then reruns all."""
    if not layouts:
        return np.zeros(0)
    L, counts = ct.spec.layers, _kind_counts(ct)
    room = np.maximum(hw.memory_bytes - buffers, 0.0)  # what a stage's layers may take
    # (.., schedule code, pp, dp x ep x micro-batch, ..) of the codes: the micro-batches each stage holds
    groups, first, inverse = np.unique(np.stack([codes[:, 3], codes[:, 4], global_batch // codes[:, 5]], axis=1),
                                       axis=0, return_index=True, return_inverse=True)
    rows = np.zeros((len(groups), int(groups[:, 1].max())))  # [group, stage] micro-batches in flight, 0: no stage
    for g, (k, (_, pp, m)) in enumerate(zip(first.tolist(), groups.tolist())):
        lay = layouts[k]
        rows[g, :pp] = [schedules.in_flight(lay.schedule, i, pp, m, lay.virtual_stages) for i in range(pp)]
    inverse = inverse.reshape(-1)
    held = rows[inverse]
    # the longest range a stage keeps, per distinct (a layer's state, its saved bytes, the room) and in-flight count
    distinct, which = np.unique(np.column_stack([per_layer, act, room]), axis=0, return_inverse=True)
    in_flight, at = np.unique(rows, return_inverse=True)  # at[group, stage]: the index of its count in in_flight
    k = len(ct.kinds)
    weight = distinct[:, None, :k] + in_flight[None, :, None] * distinct[:, None, k:2 * k]  # [distinct, count, kind]
    longest = _longest_within(ct, weight, np.broadcast_to(distinct[:, -1:], weight.shape[:2]))
    per_stage = np.where(held > 0, longest[which.reshape(-1)[:, None], at.reshape(rows.shape)[inverse]], 0.0)
    stages, ceilings, one_each = (held > 0).sum(axis=1), per_stage.sum(axis=1), per_layer + act
    kept = np.minimum(ceilings, _most_within(one_each, counts, room * stages))
    # short of all: some stage recomputes (all it holds), so the others keep at most their ceilings less the least
    one_off = np.minimum(ceilings - np.where(held > 0, per_stage, np.inf).min(axis=1),
                         _most_within(one_each, counts, room * (stages - 1)))
    return np.where(kept >= L, 0.0, L - one_off)


def _longest_within(ct: CompiledTable, weight: np.ndarray, budget: np.ndarray) -> np.ndarray:
    """A ceiling on the layers of one contiguous range of the stack (`ct.layer_kinds`; each layer of kind k weighing
    `weight[..., k]`) whose weights sum to at most `budget[...]`: the longest n whose ranges' least weight fits,
    that weight at least the fewest layers of each kind a range of n holds, the rest at the lightest kind's."""
    fewest = _fewest_of_each(ct.layer_kinds, len(ct.kinds))  # [kind, n]
    n = np.arange(fewest.shape[1])
    least = weight @ fewest + weight.min(axis=-1, keepdims=True) * (n - fewest.sum(axis=0))  # [..., n]
    fits = least <= budget[..., None]  # n = 0 always
    return (n[-1] - np.argmax(fits[..., ::-1], axis=-1)).astype(float)


@functools.lru_cache(maxsize=16)
def _fewest_of_each(sequence: tuple[int, ...], kinds: int) -> np.ndarray:
    """[kind, n]: the fewest layers of each kind a contiguous range of n layers of `sequence` holds."""
    classes, _ = layer_ranges.range_classes(sequence, kinds)  # [kind, class]
    classes = classes[:, (classes >= 0).all(axis=0)].astype(int)
    out = np.full((kinds, len(sequence) + 1), len(sequence))
    for n, counts in zip(classes.sum(axis=0).tolist(), classes.T.tolist()):
        out[:, n] = np.minimum(out[:, n], counts)
    out.flags.writeable = False
    return out


def _most_within(weight: np.ndarray, counts: np.ndarray, budget: np.ndarray) -> np.ndarray:
    """The most layers (at most `counts[k]` of kind k, each weighing `weight[..., k]`) whose weights sum to at most
    `budget[...]`: the lightest first (no other choice holds more)."""
    out, budget = np.zeros(budget.shape), budget.astype(float)
    for k in np.moveaxis(np.argsort(weight, axis=-1, kind="stable"), -1, 0):  # the kinds from the lightest
        w = np.take_along_axis(weight, k[..., None], axis=-1)[..., 0]
        with np.errstate(divide="ignore", invalid="ignore"):
            take = np.minimum(counts[k], np.where(w > 0, np.floor(budget / w), counts[k]))
        out += take
        budget = budget - take * w
    return out


def _least_total(values: np.ndarray, counts: np.ndarray, layers: np.ndarray) -> np.ndarray:
    """The least sum of `layers[j]` of the stack's layers (at most `counts[k]` of kind k, each `values[j, k]`)."""
    out, left = np.zeros(len(layers)), layers.astype(float)
    for k in np.argsort(values, axis=1, kind="stable").T:  # the kinds from the smallest
        take = np.minimum(counts[k], left)
        out += take * np.take_along_axis(values, k[:, None], axis=1)[:, 0]
        left = left - take
    return out


def _memory_columns(ct: CompiledTable, layouts, codes: np.ndarray, *, seq_len: int
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per layout of a mixed stack's `layouts` (`codes`: their `bounds.layout_codes`): the state bytes of the
    average stage over the stack's kinds, the state bytes of one layer [layout, kind], the least of the kinds'
    buffers, and the saved bytes of the average stage at full recompute (each layer's input, a sequence shard where
    a stage may take sequence parallelism, one micro-batch in flight). Priced once per state code and per block
    code (a layout of each); the states are kept in the table's memo over plans."""
    counts, spec = _kind_counts(ct), ct.spec
    state_codes, first, inverse = np.unique(codes[:, 2], return_index=True, return_inverse=True)
    average, per_layer = np.zeros(len(first)), np.zeros((len(first), len(ct.kinds)))
    terms = np.zeros((len(first), 5))  # `cost.buffer_terms`, ZeRO-3's gathered layer the least over the kinds
    for j, k in enumerate(first.tolist()):
        lay = layouts[k]
        mesh = lay.mesh
        key = ("mixed state", mesh, lay.strategies, lay.zero, lay.offload_optimizer, lay.numerics)
        state = ct.memo.get(key)
        if state is None:
            mean, layer = 0.0, []
            for count, view in zip(counts, ct.kinds):  # each kind's stack: every layer of that kind
                avg, experts = average_stage_params(view, lay)
                mean += count / spec.layers * state_bytes(avg, lay, expert=experts).total
                layer.append(state_bytes(block_params(view, lay, BlockKind.LAYER), lay,
                                         expert=expert_block_params(view, lay, BlockKind.LAYER)).total)
            state = ct.memo[key] = (mean, tuple(layer), min(cost.gathered_bytes(view, lay) for view in ct.kinds))
        average[j], per_layer[j], terms[j, 4] = state
        terms[j, :4] = cost.staged_terms(lay)
    mb, cp, act_bytes, staged, z3 = terms.T
    buffers = cost.staging_bytes(ct, mb.astype(np.int64), cp.astype(np.int64), act_bytes, staged, z3, seq_len=seq_len)
    block_codes, first_block, block_of = np.unique(codes[:, 0], return_index=True, return_inverse=True)
    inputs = np.zeros(len(first_block))  # a layer's input bytes per block code
    for j, k in enumerate(first_block.tolist()):
        lay = layouts[k]
        shard = lay.mesh.tp if lay.sequence_parallel or "sequence_parallel" in lay.stage_choices else 1
        inputs[j] = lay.micro_batch * seq_len / lay.mesh.cp * spec.hidden * lay.numbers.act_bytes / shard
    inverse, block_of = inverse.reshape(-1), block_of.reshape(-1)
    return (average[inverse], per_layer[inverse], buffers[inverse],
            spec.layers * inputs[block_of] / codes[:, 4])


def _least_layer_many(ct: CompiledTable, hw, layouts, *, seq_len: int) -> list[tuple[dict, float, float]]:
    """For each of `layouts`: `bounds.least_block_s` ({kind: seconds}), the least forward seconds of a layer (what a
    full recompute reruns, at least) and the least bytes a layer saves without recompute, each the least over the
    variants a stage may take (`bounds.variant_block_times`)."""
    return [(least_of(times), min(bt.fwd_s for bt in times[BlockKind.LAYER]),
             min(block_activation_bytes(ct, v, BlockKind.LAYER, seq_len=seq_len, hw=hw) for v in vs))
            for vs, times in variant_block_times(ct, hw, layouts, seq_len=seq_len)]


def _kind_counts(ct: CompiledTable) -> np.ndarray:
    """[kind]: the layers of each kind of the stack (`ct.layer_kinds`)."""
    return np.bincount(np.asarray(ct.layer_kinds), minlength=len(ct.kinds)).astype(float)
