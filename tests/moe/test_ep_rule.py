"""One rule decides which experts expert parallelism runs (models/facts.py `experts_ep_refusal`): the spec's ep
refusal (plan, sweep, show) and the runtime's `ParallelExperts` (parallelize) say the same line of a module it
refuses, naming the module and the axis, and a module it accepts runs: this rank's experts equal HF's own."""

from __future__ import annotations

import copy

import pytest
import torch

import autoshard
from autoshard.errors import InvalidConfigError
from autoshard.ir import Mesh
from autoshard.models.facts import _moe_modules, config_value, experts_ep_refusal, experts_tp_split_refusal
from autoshard.models.layered import layered_spec
from autoshard.models.presets import build_model, get_spec, spec_from_hf_config
from autoshard.models.tiny import build_tiny, tiny_config
from autoshard.rules.validity import plan_violation
from autoshard.runtime.expert_parallel import ParallelExperts
from tests.models.hybrid_models import nemotron_h_tiny
from tests.runtime.dist_harness import run_ranks

SIZES = dict(global_batch=8, seq_len=16)


def _experts(model) -> tuple[str, torch.nn.Module]:
    """(path, module) of the first layer's routed experts of `model` that has any."""
    for i, layer in enumerate(model.model.layers):
        path = _moe_modules(layer, config_value(model.config, "experts"))[0]
        if path:
            return f"model.layers.{i}.{path}", layer.get_submodule(path)
    raise AssertionError(f"{type(model).__name__} has no experts")


def _spec(model, name: str = "m"):
    return layered_spec(model, name=name) or spec_from_hf_config(model.config, name=name, model=model)


def _sigmoid_llama4():
    """Llama-4 with an activation not 0 at 0: a token's zero row for an expert it is not routed to gives a nonzero
    output, so expert parallelism cannot leave the unrouted rows out."""
    return build_tiny(tiny_config("llama4_text", hidden_act="sigmoid"))


def _refused_experts():
    """(name, model, a piece of the reason): a model whose experts ep cannot run, each for another reason."""
    mixtral = build_model(get_spec("mixtral-tiny"))
    normed, shared = (copy.deepcopy(mixtral) for _ in range(2))
    normed.model.layers[0].mlp.experts.has_post_expert_norm = True
    shared.model.layers[0].mlp.experts.bias = torch.nn.Parameter(torch.zeros(mixtral.config.hidden_size))  # one for all
    return (("llama4 sigmoid", _sigmoid_llama4(), "already scattered to every expert"),
            ("post-norm", normed, "a norm after each expert"),
            ("shared parameter", shared, "a parameter not indexed by expert"))


def test_refused_experts_are_refused_by_one_line_naming_module_and_axis():
    for name, model, reason in _refused_experts():
        path, experts = _experts(model)
        why = experts_ep_refusal(experts, path)
        assert why is not None and why.startswith(f"{path} ({type(experts).__name__}): ") and reason in why, name
        assert why.endswith("use ep=1"), name
        with pytest.raises(InvalidConfigError) as raised:  # the runtime refuses it by the same rule
            ParallelExperts(experts, group=None, ep=1, ep_rank=0, where=path)
        assert str(raised.value) == why, name
    llama4 = _sigmoid_llama4()  # the spec (plan, sweep, show) carries it as the ep refusal, at the layers' path
    spec = _spec(llama4)
    want = experts_ep_refusal(_experts(llama4)[1], "layers.*.feed_forward.experts")
    assert dict(spec.refused)["ep"] == want
    assert plan_violation(spec, Mesh(ep=2), **SIZES) == f"ep is refused for m: {want}"


@pytest.mark.parametrize("build", [lambda: build_model(get_spec("mixtral-tiny")),
                                   lambda: build_model(get_spec("qwen2-moe-tiny")), nemotron_h_tiny,
                                   lambda: build_tiny(tiny_config("gpt_oss"))],
                         ids=["mixtral (gated)", "qwen2-moe (shared expert)", "nemotron-h (plain up x hidden)",
                              "gpt-oss (biases, transposed, interleaved, own gate)"])
def test_accepted_experts_run_as_hf_runs_them(build):
    """A module the rule accepts is not refused by the spec and runs: one rank's ParallelExperts holding every
    expert (the generation path: no collective at ep 1) gives HF's experts' output on the same routing, and
    keeps HF's parameter names (biases included)."""
    torch.manual_seed(0)
    model = build()
    path, experts = _experts(model)
    assert experts_ep_refusal(experts, path) is None
    assert "ep" not in dict(_spec(model).refused)
    names = [n for n, _ in experts.named_parameters()]
    hidden = torch.randn(6, model.config.hidden_size)
    index = torch.randint(0, experts.num_experts, (6, 2))
    weights = torch.rand(6, 2)
    want = experts(hidden, index, weights)
    parallel = ParallelExperts(experts, group=None, ep=1, ep_rank=0, where=path)
    parallel.replicated = True
    assert [n for n, _ in parallel.named_parameters()] == names
    torch.testing.assert_close(parallel(hidden, index, weights), want)


def test_scattered_experts_run_the_routed_rows_as_hf_runs_every_row():
    """Llama-4's experts take every token's row for every expert, scaled by the router (zero where unrouted): the
    rule accepts them (`experts_scattered`), the spec says so, and the rows one rank's experts receive, padded to
    equal blocks, give HF's output on those rows, as HF's dense forward does with the zero rows in place."""
    from autoshard.models.facts import experts_scattered

    torch.manual_seed(0)
    model = build_tiny(tiny_config("llama4_text"))
    path, experts = _experts(model)
    assert experts_ep_refusal(experts, path) is None and experts_scattered(experts)
    spec = _spec(model)
    assert spec.experts_scattered and "ep" not in dict(spec.refused)
    assert "called with the routing" in spec.experts_no_tp_split  # a serving replica keeps its experts whole
    total, hidden = experts.num_experts, model.config.hidden_size
    dense = torch.zeros(total, 5, hidden)
    routed = [(0, 1), (0, 4), (total - 1, 0), (total - 1, 2), (total - 1, 3)]  # uneven: one expert none at all
    for e, t in routed:
        dense[e, t] = torch.randn(hidden)
    want = experts(dense.view(-1, hidden)).view(total, 5, hidden)
    parallel = ParallelExperts(experts, group=None, ep=1, ep_rank=0, where=path)
    ids = torch.tensor([e for e, _ in routed][::-1])  # in any order: rows come back in theirs
    rows = torch.stack([dense[e, t] for e, t in routed][::-1])
    got = parallel._padded(rows, ids)
    torch.testing.assert_close(got, torch.stack([want[e, t] for e, t in routed][::-1]))
    assert want.view(total, 5, hidden)[dense.ne(0).any(-1).logical_not()].abs().max() == 0  # zero rows: zeros
    parallel.replicated = True  # generation: this rank's experts' blocks of the same rows (one rank: all of them)
    torch.testing.assert_close(parallel(dense.view(-1, hidden)), want.view(-1, hidden))


def test_serving_tp_split_takes_only_hf_default_experts():
    """A serving replica's tp split of every expert (`expert_tp_placements`) is HF's default layout's: GPT-OSS's
    biased, transposed, interleaved experts are refused by one line naming the module and tp, the line the spec
    carries (`experts_no_tp_split`), so the inference planner offers its replicas tp 1 only (ep still runs)."""
    from autoshard.passes.serving.serving import _runs

    gpt = build_tiny(tiny_config("gpt_oss"))
    path, experts = _experts(gpt)
    spec = _spec(gpt)
    assert spec.experts_no_tp_split == experts_tp_split_refusal(experts, "layers.*.mlp.experts")
    assert not _runs(spec, 2, 1) and _runs(spec, 1, 1, 2)
    assert get_spec("mixtral-tiny").experts_no_tp_split == "" and _runs(get_spec("mixtral-tiny"), 2, 1)
    with pytest.raises(InvalidConfigError, match=rf"^{path} \(GptOssExperts\): a serving replica splits over tp .*"
                                                 "gate_up_proj_bias.*use tp=1 with ep$"):
        ParallelExperts(experts, group=None, ep=1, ep_rank=0, tp=2, where=path)


def _parallelize_refuses_as_plan(rank: int, world: int) -> None:
    model = _sigmoid_llama4()
    want = plan_violation(_spec(model, model.config.model_type), Mesh(ep=2), **SIZES)  # parallelize's name for it
    with pytest.raises(InvalidConfigError) as raised:
        autoshard.parallelize(model, torch.zeros(2, 16, dtype=torch.long), plan=dict(ep=2), global_batch=8)
    assert str(raised.value) == want, (str(raised.value), want)


def test_parallelize_refuses_the_experts_with_the_plans_line():
    """On two gloo ranks, parallelize of a Llama-4 whose experts ep cannot run (a sigmoid activation) at ep 2
    raises, on every rank, the line plan_violation gives."""
    run_ranks(2, _parallelize_refuses_as_plan)
