"""torch.compile(model, backend=autoshard.backend(...)): the losses of 3 AdamW steps and every
gradient match the eager single process (dp, tp, dp x tp on gloo)."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

import autoshard
from autoshard.errors import InvalidConfigError
from autoshard.models.presets import build_model, get_spec
from autoshard.runtime.mesh import coords_of
from tests.runtime.dist_harness import run_ranks

TOL = dict(rtol=1e-4, atol=1e-5)
GLOBAL_BATCH, SEQ, STEPS, LR = 4, 16, 3, 1e-2


def _data(vocab: int):
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (GLOBAL_BATCH, SEQ), generator=gen) for _ in range(STEPS)]


def _train(model, loss_of, data):
    """3 AdamW steps of `loss_of(ids)`; returns the gradients of the first step and every loss."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, first_grads = [], None
    for ids in data:
        opt.zero_grad()
        loss = loss_of(ids)
        loss.backward()
        first_grads = first_grads or {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        losses.append(loss.detach())
    return first_grads, losses


def _eager(build, data):
    model = build()
    return _train(model, lambda ids: model(ids, labels=ids).loss, data)


def _compiled_run(rank: int, build, plan: dict, data):
    torch._dynamo.reset()
    model = build()
    be = autoshard.backend(model, plan=plan, global_batch=GLOBAL_BATCH)
    compiled = torch.compile(model, backend=be)
    rows = GLOBAL_BATCH // be.plan.mesh.dp
    first = coords_of(rank, be.plan.mesh).dp * rows  # this rank passes its dp shard of the batch

    def loss_of(ids):
        local = ids[first:first + rows]
        return compiled(local, labels=local).loss

    return _train(model, loss_of, data)


def _check_plans(rank: int, world: int, cases) -> None:
    from tests.runtime.families import DENSE

    for preset, plan in cases:
        # Dynamo compiles take seconds per layer here: presets at 2 layers, tiny families (1 layer) as they are
        spec = DENSE[preset].spec if preset in DENSE else get_spec(preset, layers=2)
        build = DENSE[preset].build if preset in DENSE else (lambda spec=spec: build_model(spec, seed=0))
        data = _data(spec.vocab)
        ref_grads, ref_losses = _eager(build, data)
        grads, losses = _compiled_run(rank, build, plan, data)
        for step, (got, want) in enumerate(zip(losses, ref_losses)):
            assert_close(got, want, **TOL, msg=lambda m: f"{preset} {plan} step {step} loss: {m}")
        assert grads.keys() == ref_grads.keys()
        for name, grad in grads.items():  # every full gradient of the first step, on every rank
            assert_close(grad, ref_grads[name], **TOL, msg=lambda m: f"{preset} {plan} grad {name}: {m}")


def test_backend_two_ranks_dp_and_tp():
    """Phi-3: HF's colwise_gather_output / rowwise_split_input (the graph's linears gather / split, shard_graph.py)."""
    run_ranks(2, _check_plans, [("llama-tiny", dict(tp=2)), ("mamba2-tiny", dict(dp=2)), ("phi3", dict(tp=2))])


def test_backend_four_ranks_dp_tp():
    run_ranks(4, _check_plans, [("llama-tiny", dict(dp=2, tp=2))])


def test_backend_refuses_what_it_cannot_shard(monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "2")
    model = build_model(get_spec("mamba2-tiny"), device="meta")
    with pytest.raises(InvalidConfigError, match="parallelize"):
        autoshard.backend(model, plan=dict(tp=2))
    with pytest.raises(InvalidConfigError, match="pipeline"):
        autoshard.backend(model, plan=dict(pp=2))
    llama = build_model(get_spec("llama-tiny"), device="meta")
    with pytest.raises(InvalidConfigError, match="sequence_parallel is not supported by the torch.compile backend.*"
                                                 "autoshard.parallelize, which runs sequence parallelism"):
        autoshard.backend(llama, plan=dict(tp=2, sequence_parallel=True))
    monkeypatch.setenv("WORLD_SIZE", "4")  # a per-stage plan (layouts.backend_violation): pp is named first
    with pytest.raises(InvalidConfigError, match=r"pp=2 \(and with it per-stage choices\) is not supported"):
        autoshard.backend(llama, plan=dict(tp=2, pp=2, sequence_parallel=[True, False]))
    from autoshard.inference_plan import InferencePlan, Pool

    served = tmp_path / "serve.json"  # a plan file: read once (read_plan_file), an inference plan refused by name
    InferencePlan(model="llama-tiny", fingerprint="", hardware="cpu", devices=4, prompt_len=8, output_len=8,
                  ttft_slo_s=1.0, tpot_slo_s=1.0,
                  pools=(Pool(role="both", tp=2, pp=1, replicas=2, batch=1),)).save(served)
    with pytest.raises(InvalidConfigError, match="an inference plan runs under autoshard.parallelize"):
        autoshard.backend(llama, plan=served)
    assert not torch.distributed.is_initialized()  # refused before any process group exists


def test_backend_without_a_plan_is_data_parallel_over_the_world(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    model = build_model(get_spec("mamba2-tiny"), device="meta")
    with pytest.raises(InvalidConfigError, match="global batch 1 is not divisible by dp \\(2\\)"):
        autoshard.backend(model, global_batch=1)  # the default plan is dp = world size
