"""The tp collectives of HF's gathered styles (colwise_gather_output / rowwise_split_input, runtime/tensor_parallel.py)
are priced where tp comm is (passes/cost/block.py `_tp_comm`): the Megatron all-reduces (one forward per row-parallel
linear; one backward per tp entry: each gathered colwise linear enters tp itself) plus the all-gather of each gathered
colwise linear's output in forward and of each gathered rowwise linear's input gradient in backward."""

import dataclasses
import functools

import pytest

from autoshard.commands.common import cost_table_for
from autoshard.hardware import load_hardware
from autoshard.ir import BlockKind, Mesh
from autoshard.passes.cost.block import _tp_comm
from autoshard.passes.cost.collectives import Collective, best_time
from autoshard.passes.cost.compiled import compile_table
from autoshard.passes.cost.layout import Layout
from tests.runtime.families import DENSE

HW = dataclasses.replace(load_hardware("h100"), kernels=())


@functools.cache
def _compiled(name: str):
    source = DENSE[name]
    spec = source.spec
    return spec, compile_table(cost_table_for(name, spinner=False, spec=spec, module=source.build())[1], spec)


# (forward all-reduces, backward all-reduces, widths all-gathered forward, widths all-gathered backward) per layer
EXPECTED = {"phi3": (2, 2, ("qkv",), ("q",)),  # qkv_proj -> o_proj gathered; the packed gate_up_proj -> down_proj pair
            "olmo2": (2, 4, ("q", "kv", "kv"), ("q",))}  # q/k/v each enter tp; the MLP one Megatron pair


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_gathered_linears_price_their_all_gathers(name):
    from autoshard.rules import sharding

    spec, ct = _compiled(name)
    tp, seq = 2, 64
    layout = Layout(mesh=Mesh(tp=tp), precision="bf16-mixed")
    tokens = seq * layout.numbers.act_bytes  # micro-batch 1
    ar = best_time(HW, Collective.ALL_REDUCE, tokens * spec.hidden, size=tp, stride=1)
    ag = lambda widths: sum(best_time(HW, Collective.ALL_GATHER, tokens * sharding.size(spec, w), size=tp, stride=1)
                            for w in widths)  # noqa: E731
    fwd, bwd, gathered, split = EXPECTED[name]
    assert _tp_comm(ct, HW, layout, BlockKind.LAYER, seq) == pytest.approx((fwd * ar + ag(gathered),
                                                                             bwd * ar + ag(split)))


def test_a_gathered_attention_is_priced_whole_on_every_rank():
    """Gathered q/k/v (Phi-3, OLMo-2) run the attention whole on every tp rank: its KV heads are not cut (the CP
    K/V all-gather, the serving KV cache), as GLM-4's per-head attention region is."""
    from autoshard.passes.serving.inference_cost import cache_bytes_per_layer
    from autoshard.rules import sharding
    from tests.runtime.families import GATHERED

    for name, whole in (("phi3", True), ("olmo2", True), ("glm4", False)):
        spec = (DENSE.get(name) or GATHERED[name]).spec
        assert sharding.attention_whole(spec) is whole, name
        assert sharding.kv_parts(spec, 2) == (1 if whole else 2), name
        cache = [cache_bytes_per_layer(spec, batch=1, tokens=16, tp=tp) for tp in (1, 2)]
        assert cache[1] == (cache[0] if whole else cache[0] / 2), name
