"""Collective communication costs: alpha-beta model, ring and tree algorithms, the link a group spans.

Contract: `collective_time(hw, op, nbytes, size=N, stride=k)` -> seconds for one collective over a
group of N ranks whose members are `stride` apart in the global rank order. `volume(op, nbytes, N,
algo)` is the bytes one device sends (the busiest link), `steps(op, N, algo)` the message steps
on the critical path; time = steps * alpha + volume / beta (Hockney's alpha-beta model, as in
arXiv 2602.09109 section 2 and Thakur, Rabenseifner & Gropp, IJHPCA 2005).

The whole contract: docs/modules/cost.md (passes/cost/collectives.py).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from enum import Enum

import numpy as np

from autoshard.ir import POSITIVE_INT
from autoshard.hardware import DeviceProfile


class Collective(str, Enum):
    REDUCE = "reduce"
    GATHER = "gather"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"
    ALL_TO_ALL = "all_to_all"
    SEND_RECV = "send_recv"
    BROADCAST = "broadcast"


class Algorithm(str, Enum):
    RING = "ring"
    TREE = "tree"


@dataclass(frozen=True, slots=True, kw_only=True)
class Link:
    """The link a group's collective is limited by."""

    name: str  # "intra" or "inter"
    bandwidth: float  # bytes/s per device per direction
    latency: float  # seconds per step


def _log2(n: int) -> int:
    return max(1, math.ceil(math.log2(n)))


def volume(op: Collective, nbytes: float, size: int, algo: Algorithm = Algorithm.RING) -> float:
    """Bytes the busiest device sends for one `op` over `size` ranks (docs/modules/cost.md)."""
    _check_size(size)
    if size == 1 and op is not Collective.SEND_RECV:
        return 0.0
    frac = (size - 1) / size
    if op in (Collective.SEND_RECV, Collective.BROADCAST):
        return nbytes * 1.0  # a number, or a numpy array of them (the planner prices many layouts at once)
    if op is Collective.ALL_REDUCE:
        return 2 * frac * nbytes if algo is Algorithm.RING else 2.0 * nbytes
    if op is Collective.REDUCE:
        return 2 * frac * nbytes if algo is Algorithm.RING else float(nbytes)
    if op is Collective.ALL_TO_ALL and algo is Algorithm.TREE:
        return nbytes / 2 * _log2(size)
    return frac * nbytes  # GATHER, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL (ring / pairwise)


def steps(op: Collective, size: int, algo: Algorithm = Algorithm.RING) -> int:
    """Message steps on the critical path (each costs one latency alpha)."""
    _check_size(size)
    if op is Collective.SEND_RECV:
        return 1
    if size == 1:
        return 0
    two_phase = op in (Collective.ALL_REDUCE, Collective.REDUCE)
    if algo is Algorithm.TREE:
        return _log2(size) * (2 if op is Collective.ALL_REDUCE else 1)
    return (size - 1) * (2 if two_phase else 1)


def group_link(hw: DeviceProfile, *, size: int, stride: int = 1) -> Link:
    """The link that limits a group of `size` ranks spaced `stride` apart in the rank order."""
    _check_size(size)
    POSITIVE_INT.check("group stride", stride)
    span = stride * size
    if size == 1 or (span <= hw.devices_per_node and hw.devices_per_node % span == 0):
        return Link(name="intra", bandwidth=hw.intra_bandwidth, latency=hw.intra_latency)
    per_node = max(1, min(size, hw.devices_per_node // stride)) if stride < hw.devices_per_node else 1
    bandwidth = hw.inter_bandwidth if per_node == 1 else min(hw.intra_bandwidth, per_node * hw.inter_bandwidth)
    return Link(name="inter", bandwidth=bandwidth, latency=hw.inter_latency)


def collective_time(hw: DeviceProfile, op: Collective, nbytes: float, *, size: int, stride: int = 1,
                    algo: Algorithm = Algorithm.RING) -> float:
    """Seconds for one collective: steps * alpha + volume / beta on the link the group spans."""
    _check_size(size)
    if size == 1 and op is not Collective.SEND_RECV:
        return 0.0
    link = group_link(hw, size=size if op is not Collective.SEND_RECV else 2, stride=stride)
    return steps(op, size, algo) * link.latency + volume(op, nbytes, size, algo) / link.bandwidth


def best_time(hw: DeviceProfile, op: Collective, nbytes: float, *, size: int, stride: int = 1,
              low_latency: bool = False) -> float:
    """The faster of ring and tree (what NCCL / HCCL pick by message size), tree only where the
    device's library has one for `op` (`hw.log_collectives`: NCCL's tree is AllReduce's alone).
    `nbytes` may be a numpy array: the result is then elementwise (the planner prices every stage
    size at once). Memoised on its arguments for a scalar `nbytes`: the planner asks for the same
    collective for many layouts. `low_latency` adds NCCL's LL protocol (`low_latency_time`): the
    serving model asks for it (a decode step's all-reduces of a few KB, checked against vLLM runs);
    training keeps the Simple model its published runs were checked with (docs/cost_model.md)."""
    if isinstance(nbytes, np.ndarray):
        return _best_time(hw, op, nbytes, size, stride, low_latency)
    return _best_time_memo(hw, op, nbytes, size, stride, low_latency)


def _best_time(hw: DeviceProfile, op: Collective, nbytes, size: int, stride: int, low_latency: bool):
    algos = (Algorithm.RING, Algorithm.TREE) if op.value in hw.log_collectives else (Algorithm.RING,)
    times = [collective_time(hw, op, nbytes, size=size, stride=stride, algo=a) for a in algos]
    if low_latency and hw.ll_base_latency is not None and size > 1 and op is not Collective.SEND_RECV:
        times += [low_latency_time(hw, op, nbytes, size=size, stride=stride, algo=a) for a in algos]
    best = times[0]
    for t in times[1:]:
        best = np.minimum(best, t) if isinstance(best, np.ndarray) or isinstance(t, np.ndarray) else min(best, t)
    return best


LL_PAYLOAD = 0.5  # NCCL's LL protocol: each 8-byte line carries 4 bytes of data and a 4-byte flag


def low_latency_time(hw: DeviceProfile, op: Collective, nbytes, *, size: int, stride: int = 1,
                     algo: Algorithm = Algorithm.RING):
    """Seconds of one collective under NCCL's low-latency protocol (LL), NCCL's own cost model
    (src/graph/tuning.cc): a fixed `ll_base_latency` (baseLat, the kernel's launch and flag setup)
    plus, per step of the algorithm, the per-hop LL latency of the link the group spans (hwLat:
    NVLink 0.6 us, PCI 1.0 us, network 2.7 us), with the payload at half the link bandwidth (data and
    flag share every 8-byte store, so no fence is needed: that is why its latency is low). NCCL picks
    LL for small messages (a decode step's all-reduce of a few KB), LL128 / Simple for large ones
    (`best_time` takes the cheapest). Profiles without `ll_base_latency` have no LL (the Simple
    alpha-beta model alone)."""
    link = group_link(hw, size=size, stride=stride)
    hop = hw.intra_ll_latency if link.name == "intra" else hw.inter_ll_latency
    if hop is None:
        hop = link.latency
    return hw.ll_base_latency + steps(op, size, algo) * hop + volume(op, nbytes, size, algo) / (link.bandwidth * LL_PAYLOAD)


_best_time_memo = functools.lru_cache(maxsize=1 << 16)(_best_time)


def _check_size(size: int) -> None:
    POSITIVE_INT.check("collective group size", size)
