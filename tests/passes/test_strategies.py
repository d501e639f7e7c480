"""Sharding rules: coverage of the real LLaMA / Mamba-2 graphs, and rules checked on numbers."""

import warnings

import pytest
import torch

from autoshard.passes.collectives import Collective
from autoshard.passes.strategies import (OpInfo, Partial, Replicate, Shard, einsum_strategies, graph_strategies,
                                         strategies_for, transition, view_dim_map)


@pytest.mark.parametrize("name", ["llama-tiny", "mamba2-tiny"])
def test_every_op_of_the_real_graphs_has_a_rule(name):
    from autoshard.models.presets import build_model, get_spec
    from autoshard.passes.capture import capture_model

    spec = get_spec(name)
    model = build_model(spec, device="meta")
    ids = torch.randint(0, spec.vocab, (2, 32))
    captured = capture_model(model, (ids,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a missing rule would warn
        table = graph_strategies(captured.graph_module)
    assert table
    mms = [s for n, s in table.items() if n.startswith("mm")]
    assert mms and all(len(s) >= 3 for s in mms)  # replicate, shard m, shard n, shard k


def test_unknown_op_runs_replicated_with_one_warning():
    gm = torch.fx.symbolic_trace(lambda x: torch.special.erfcx(torch.special.erfcx(x)))
    for node in gm.graph.nodes:
        node.meta["val"] = torch.empty(4, 4)
    with pytest.warns(UserWarning, match="erfcx.*no sharding rule") as record:
        table = graph_strategies(gm)
    assert len([w for w in record if "erfcx" in str(w.message)]) == 1
    assert all(len(s) == 1 and s[0].replicated for s in table.values())


def test_einsum_mm():
    got = {(s.inputs, s.outputs) for s in einsum_strategies("mk,kn->mn")}
    assert got == {((Shard(0), Replicate()), (Shard(0),)), ((Shard(1), Shard(0)), (Partial(),)),
                   ((Replicate(), Shard(1)), (Shard(1),))}


def test_transitions():
    assert transition(Partial(), Replicate()) is Collective.ALL_REDUCE
    assert transition(Partial(), Shard(0)) is Collective.REDUCE_SCATTER
    assert transition(Shard(1), Replicate()) is Collective.ALL_GATHER
    assert transition(Shard(1), Shard(0)) is Collective.ALL_TO_ALL
    assert transition(Replicate(), Shard(0)) is None


def _split(t, p, n=2):
    if isinstance(p, Shard):
        return list(torch.chunk(t, n, dim=p.dim))
    if isinstance(p, Partial):
        parts = [torch.randn_like(t) for _ in range(n - 1)]
        return parts + [t - sum(parts)]
    return [t] * n


def _join(parts, p):
    if isinstance(p, Shard):
        return torch.cat(parts, dim=p.dim)
    if isinstance(p, Partial):
        return sum(parts) / (len(parts) if p.reduce == "avg" else 1)
    return parts[0]


@pytest.mark.parametrize("op, args, nontensor", [
    ("aten.mm.default", (torch.randn(4, 6), torch.randn(6, 8)), ()),
    ("aten.bmm.default", (torch.randn(2, 4, 6), torch.randn(2, 6, 8)), ()),
    ("aten.add.Tensor", (torch.randn(4, 6), torch.randn(6)), ()),
    ("aten.mul.Tensor", (torch.randn(2, 4, 6), torch.randn(2, 4, 1)), ()),
    ("aten.sum.dim_IntList", (torch.randn(4, 6, 8),), ([1], False)),
    ("aten.mean.dim", (torch.randn(4, 6, 8),), ([-1], True)),
    ("aten.permute.default", (torch.randn(2, 4, 6),), ([2, 0, 1],)),
    ("aten.cumsum.default", (torch.randn(4, 6),), (1,)),
    ("aten._log_softmax.default", (torch.randn(4, 6),), (1, False)),
])
def test_rules_are_exact_on_numbers(op, args, nontensor):
    """Every candidate: run the op on each rank's local pieces; joining the outputs per the output
    placement gives the full result."""
    fn = eval("torch.ops." + op)  # noqa: S307 - a fixed op name from the parametrisation
    full = fn(*args, *nontensor)
    info = OpInfo(target=op, in_shapes=tuple(tuple(a.shape) for a in args) + (None,) * len(nontensor),
                  out_shapes=(tuple(full.shape),), args=(None,) * len(args) + tuple(nontensor))
    cands = strategies_for(info)
    assert len(cands) > 1
    for s in cands:
        pieces = [_split(a, p) for a, p in zip(args, s.inputs)]
        local = [fn(*(pc[r] for pc in pieces), *nontensor) for r in range(2)]
        torch.testing.assert_close(_join(local, s.outputs[0]), full, msg=f"{op} {s}")


def test_view_dim_map():
    assert view_dim_map((2, 8, 64), (16, 64)) == {0: 0, 2: 1}
    assert view_dim_map((2, 8, 64), (2, 8, 4, 16)) == {0: 0, 1: 1, 2: 2}
