"""Collective volumes against the textbook / paper formulas, alpha-beta times, the link a group spans."""

import pytest

from autoshard.hardware import load_hardware
from autoshard.passes.cost.collectives import (Algorithm, Collective, best_time, collective_time, group_link, low_latency_time,
                                          steps, volume)

M = 1e9
RING, TREE = Algorithm.RING, Algorithm.TREE


@pytest.mark.parametrize("n", [2, 4, 8, 64])
def test_ring_volumes_match_the_formulas(n):
    frac = (n - 1) / n
    assert volume(Collective.ALL_REDUCE, M, n) == pytest.approx(2 * frac * M)
    assert volume(Collective.ALL_GATHER, M, n) == pytest.approx(frac * M)
    assert volume(Collective.REDUCE_SCATTER, M, n) == pytest.approx(frac * M)
    assert volume(Collective.ALL_TO_ALL, M, n) == pytest.approx(frac * M)
    assert volume(Collective.GATHER, M, n) == pytest.approx(frac * M)
    assert volume(Collective.REDUCE, M, n) == pytest.approx(2 * frac * M)
    assert volume(Collective.SEND_RECV, M, n) == M
    # all-reduce = reduce-scatter + all-gather, in volume and in ring steps
    assert volume(Collective.ALL_REDUCE, M, n) == pytest.approx(
        volume(Collective.REDUCE_SCATTER, M, n) + volume(Collective.ALL_GATHER, M, n))
    assert steps(Collective.ALL_REDUCE, n) == 2 * (n - 1)


def test_tree_trades_bandwidth_for_log_steps():
    assert steps(Collective.ALL_REDUCE, 64, TREE) == 12
    assert steps(Collective.ALL_GATHER, 64, TREE) == 6
    assert volume(Collective.ALL_REDUCE, M, 64, TREE) == 2 * M
    assert volume(Collective.ALL_TO_ALL, M, 8, TREE) == pytest.approx(M / 2 * 3)  # Bruck


def test_single_rank_groups_cost_nothing():
    hw = load_hardware("h100")
    for op in Collective:
        if op is not Collective.SEND_RECV:
            assert volume(op, M, 1) == 0 and collective_time(hw, op, M, size=1) == 0


def test_group_link_follows_the_rank_layout():
    hw = load_hardware("h100")  # 8 devices per node
    assert group_link(hw, size=8, stride=1).name == "intra"  # tp8: one node
    assert group_link(hw, size=2, stride=4).name == "intra"  # cp2 over tp4: ranks 0, 4
    assert group_link(hw, size=4, stride=8).name == "inter"  # dp over nodes
    assert group_link(hw, size=16, stride=1).name == "inter"  # spills over two nodes
    assert group_link(hw, size=3, stride=1).name == "inter"  # 3 does not tile a node of 8


def test_a_ring_across_nodes_uses_one_nic_per_member_gpu():
    """Rail-optimised nodes: NCCL runs a ring channel per NIC, so k members per node leave it through
    k NICs (capped by the intra-node link the ring also crosses); one member per node sees one NIC."""
    hw = load_hardware("a100-80g")  # 8 GPUs, 8 x 25 GB/s NICs per node, NVLink 240 GB/s
    assert group_link(hw, size=64, stride=1).bandwidth == pytest.approx(min(8 * 25e9, hw.intra_bandwidth))
    assert group_link(hw, size=16, stride=4).bandwidth == pytest.approx(2 * 25e9)  # 2 members per node
    assert group_link(hw, size=8, stride=8).bandwidth == pytest.approx(25e9)  # dp across nodes, tp8 inside


def test_alpha_beta_time():
    hw = load_hardware("ascend-910b")
    n = 4
    t = collective_time(hw, Collective.ALL_REDUCE, M, size=n, stride=1)
    assert t == pytest.approx(2 * (n - 1) * hw.intra_latency + 2 * (n - 1) / n * M / hw.intra_bandwidth)
    t_inter = collective_time(hw, Collective.ALL_REDUCE, M, size=n, stride=8)
    assert t_inter == pytest.approx(2 * (n - 1) * hw.inter_latency + 2 * (n - 1) / n * M / hw.inter_bandwidth)
    # small messages on many ranks: the tree's log2(N) steps win; large ones: the ring's bandwidth
    small, big = 1e3, 1e10
    assert best_time(hw, Collective.ALL_REDUCE, small, size=64, stride=8) == pytest.approx(
        collective_time(hw, Collective.ALL_REDUCE, small, size=64, stride=8, algo=TREE))
    assert best_time(hw, Collective.ALL_REDUCE, big, size=64, stride=8) == pytest.approx(
        collective_time(hw, Collective.ALL_REDUCE, big, size=64, stride=8, algo=RING))


def test_nccl_has_a_tree_for_all_reduce_only():
    # NCCL's double binary tree serves AllReduce; its AllGather / ReduceScatter are rings, whose
    # (N - 1) step latencies grow with the group; HCCL (910B) keeps its log-depth algorithms
    h100, npu = load_hardware("h100"), load_hardware("ascend-910b")
    assert h100.log_collectives == ("all_reduce",) and h100.source("log_collectives")
    assert load_hardware("h200").log_collectives == load_hardware("a100-80g").log_collectives == ("all_reduce",)
    small = 1e4
    for op in (Collective.ALL_GATHER, Collective.REDUCE_SCATTER):
        ring = collective_time(h100, op, small, size=1024, stride=8, algo=Algorithm.RING)
        assert best_time(h100, op, small, size=1024, stride=8) == ring  # training: Simple
        ll = low_latency_time(h100, op, small, size=1024, stride=8, algo=Algorithm.RING)
        assert best_time(h100, op, small, size=1024, stride=8, low_latency=True) == min(ring, ll)  # serving
        assert best_time(npu, op, small, size=1024, stride=8) < collective_time(npu, op, small, size=1024, stride=8,
                                                                                 algo=Algorithm.RING)
    tree = collective_time(h100, Collective.ALL_REDUCE, small, size=1024, stride=8, algo=Algorithm.TREE)
    assert best_time(h100, Collective.ALL_REDUCE, small, size=1024, stride=8) == tree
    ll = low_latency_time(h100, Collective.ALL_REDUCE, small, size=1024, stride=8, algo=Algorithm.TREE)
    assert best_time(h100, Collective.ALL_REDUCE, small, size=1024, stride=8, low_latency=True) == min(tree, ll)


def test_low_latency_protocol_is_nccl_tuning_model_for_small_messages():
    # NCCL tuning.cc: LL = baseLat 6.6 us + steps x hwLat (NVLink 0.6 us, NET 2.7 us), payload at half the link;
    # a decode step's all-reduce of (1, 1, 8192) bf16 over tp 4 on one H100 node: 4 tree steps
    h100 = load_hardware("h100")
    nbytes = 8192 * 2
    expected = 6.6e-6 + 4 * 0.6e-6 + 2 * nbytes / (h100.intra_bandwidth / 2)
    assert best_time(h100, Collective.ALL_REDUCE, nbytes, size=4, low_latency=True) == pytest.approx(expected)
    assert best_time(h100, Collective.ALL_REDUCE, nbytes, size=4, low_latency=True) < collective_time(
        h100, Collective.ALL_REDUCE, nbytes, size=4, algo=Algorithm.TREE)  # Simple: 8 us per step
    big = 256e6  # gradient buckets: Simple, as before (LL's half bandwidth loses)
    assert best_time(h100, Collective.ALL_REDUCE, big, size=4, low_latency=True) == collective_time(
        h100, Collective.ALL_REDUCE, big, size=4, algo=Algorithm.RING)
    assert best_time(h100, Collective.ALL_REDUCE, nbytes, size=4) == collective_time(
        h100, Collective.ALL_REDUCE, nbytes, size=4, algo=Algorithm.TREE)  # training is priced with Simple
    inter = low_latency_time(h100, Collective.ALL_REDUCE, nbytes, size=2, stride=8)  # across nodes: NET hops
    assert inter == pytest.approx(6.6e-6 + 2 * 2.7e-6 + nbytes / (h100.inter_bandwidth / 2))


def test_log_collectives_is_checked():
    import dataclasses

    from autoshard.errors import InvalidConfigError

    with pytest.raises(InvalidConfigError, match="log_collectives"):
        dataclasses.replace(load_hardware("h100"), log_collectives=("broadcast",))
