"""Pipeline parallelism: stage modules, splits, and pp runs on gloo against one process.

Each world size is spawned once; every configuration runs inside it. Every rank compares with
the single-process run of the same tiny HF model: loss of two AdamW steps, every full gradient
(gathered to original names) and the weights after the steps.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

import autoshard
from autoshard.errors import InvalidConfigError
from autoshard.fingerprint import fingerprint_module
from autoshard.ir import Mesh, Plan, Recompute, Stage, check_stages, even_stages
from autoshard.models.presets import build_model, get_spec
from autoshard.runtime.pipeline import PipelineOptions, PipelineRunner, Schedule
from autoshard.runtime.stages import build_stage_module, original_names
from tests.runtime.dist_harness import run_ranks

TOL = dict(rtol=1e-4, atol=1e-5)
ADAM = dict(lr=1e-3, eps=1e-6)  # eps: see tests/runtime/equivalence.py (sign noise of ~1e-9 gradients)
BATCH, SEQ = 4, 16


def _stages(*bounds: int, recompute_first: bool = False) -> tuple[Stage, ...]:
    """Stages from layer boundaries: _stages(0, 1, 4) -> [0, 1), [1, 4)."""
    n = len(bounds) - 1
    return tuple(Stage(first_layer=a, end_layer=b, embed=i == 0, head=i == n - 1,
                       recompute=Recompute.FULL if recompute_first and i == 0 else Recompute.NONE)
                 for i, (a, b) in enumerate(zip(bounds, bounds[1:])))


def _batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (BATCH, SEQ), generator=gen)
    labels = ids.clone()
    labels[1, 5:] = -100  # micro-batches with different valid-token counts
    labels[2, :3] = -100
    return ids, labels


# -- single process ------------------------------------------------------------------------------
def test_even_stages_split_and_errors():
    assert [(s.first_layer, s.end_layer) for s in even_stages(10, 4)] == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert even_stages(4, 2)[0].embed and even_stages(4, 2)[-1].head and not even_stages(4, 2)[0].head
    with pytest.raises(InvalidConfigError, match=r"pp \(5\) is larger than the number of layers \(4\)"):
        even_stages(4, 5)
    with pytest.raises(InvalidConfigError, match="should start at layer 2"):
        check_stages(_stages(0, 2, 4)[:1] + _stages(0, 3, 4)[1:], num_layers=4, pp=2)
    with pytest.raises(InvalidConfigError, match="model has 4"):
        check_stages(_stages(0, 2, 3), num_layers=4, pp=2)
    with pytest.raises(InvalidConfigError, match="2 pipeline stages but pp is 3"):
        check_stages(_stages(0, 2, 4), num_layers=4, pp=3)
    with pytest.raises(InvalidConfigError, match="holds nothing"):
        check_stages(_stages(0, 2, 2, 4), num_layers=4, pp=3)
    with pytest.raises(InvalidConfigError, match="unknown pipeline schedule 'zb'"):
        PipelineOptions(schedule="zb")


@pytest.mark.parametrize("name", ["llama-tiny", "mamba2-tiny"])
def test_chained_stages_equal_model(name):
    spec = get_spec(name)
    model = build_model(spec)
    ids, labels = _batch(spec.vocab)
    ref = model(ids).logits
    for split in (_stages(0, 2, 4), _stages(0, 0, 1, 3, 4)):
        x = ids
        for stage in split:
            x = build_stage_module(model, spec, stage)(x)
        torch.testing.assert_close(x, ref, rtol=0, atol=0)
    head = build_stage_module(model, spec, _stages(0, 3, 4)[1])
    names = original_names(model, head)
    assert names["layers.3.norm.weight" if name.startswith("mamba") else "layers.3.mlp.up_proj.weight"] \
        == ("backbone.layers.3.norm.weight" if name.startswith("mamba") else "model.layers.3.mlp.up_proj.weight")
    assert all(dict(model.named_parameters())[orig] is p for n, p in head.named_parameters()
               for orig in [names[n]])


def test_tied_head_maps_to_embedding_and_recompute_matches():
    spec = replace(get_spec("llama-tiny"), tied=True)
    model = build_model(spec)
    last = build_stage_module(model, spec, _stages(0, 2, 4)[1])
    assert original_names(model, last)["lm_head.weight"] == "model.embed_tokens.weight"
    ids, labels = _batch(spec.vocab)
    full = build_stage_module(model, spec, Stage(first_layer=0, end_layer=4, embed=True, head=True,
                                                 recompute=Recompute.FULL))
    full(ids).sum().backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model(ids).logits.sum().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, **TOL)


# -- distributed ---------------------------------------------------------------------------------
def _reference(spec, steps: int = 2):
    """Single-process logits, losses, gradients per step, and final weights."""
    model = build_model(spec)
    ids, labels = _batch(spec.vocab)
    with torch.no_grad():
        logits = model(ids).logits
    opt = torch.optim.AdamW(model.parameters(), **ADAM)
    losses, grads = [], []
    for _ in range(steps):
        loss = model(ids, labels=labels).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return logits, losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def _check_config(spec, stages, schedule, micro_batch, reference):
    """A plan of these stages run by `parallelize`, read back the way users read it (full_grads,
    full_state_dict); the runner's own checks (freed weights, refused batches) on `dm._runner`."""
    ref_logits, ref_losses, ref_grads, ref_weights = reference
    model = build_model(spec)
    world = dist.get_world_size()
    virtual = len(stages) // world
    plan = Plan(model=spec.name, fingerprint=fingerprint_module(model), hardware="cpu", devices=world,
                global_batch=BATCH, seq_len=SEQ, mesh=Mesh(pp=world), micro_batch=micro_batch, schedule=schedule,
                virtual_stages=virtual, stages=stages)
    ids, labels = _batch(spec.vocab)
    dm = autoshard.parallelize(model, ids, plan=plan, optimizer=functools.partial(torch.optim.AdamW, **ADAM))
    runner = dm._runner
    held = {n for n, p in model.named_parameters() if p.device.type != "meta"}
    assert held == set(runner.names.values())  # other stages' weights were freed
    torch.testing.assert_close(dm(ids), ref_logits, **TOL)
    if schedule is Schedule.ONE_F_ONE_B and len(stages) > 2 and virtual == 1:  # fewer micro-batches than stages
        # the one rule (schedules.check_chunks, which validity.check_plan calls too)
        with pytest.raises(InvalidConfigError, match=r"1f1b needs at least as many micro-batches \(2\) as stages \(4\)"):
            runner.step(ids[:2], labels[:2])
    if micro_batch > 1:  # raised on every rank before any collective: nothing hangs
        with pytest.raises(InvalidConfigError, match=rf"batch \(3\) is not divisible by micro_batch \({micro_batch}\)"):
            runner.step(ids[:3], labels[:3])
    for step in range(len(ref_losses)):
        torch.testing.assert_close(dm.train_step(ids, labels), ref_losses[step], **TOL)
        grads = dm.full_grads()
        assert grads.keys() == ref_grads[step].keys()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, ref_grads[step][name], **TOL, msg=lambda m, n=name: f"{n}: {m}")
    weights = dm.full_state_dict()
    for name, weight in weights.items():
        torch.testing.assert_close(weight, ref_weights[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")
    if spec.tied and runner.has_last:  # the last stage's copy equals the first stage's
        head = runner.chunks[-1].lm_head.weight
        name = {id(p): runner.names[n] for n, p in runner.module.named_parameters()}[id(head)]
        torch.testing.assert_close(head.detach(), weights[name])
        if runner.has_first and virtual == 2 and schedule is Schedule.ZERO_BUBBLE:  # V: one tensor on rank 0
            assert head is runner.chunks[0].embed.weight


def _check_parallelize(spec, plan, schedule, reference):
    """The same check through the public entry point: parallelize(plan=dict(pp=..)) runs PipelineRunner."""
    ref_logits, ref_losses, ref_grads, ref_weights = reference
    ids, labels = _batch(spec.vocab)
    dm = autoshard.parallelize(build_model(spec), ids, plan=plan, global_batch=BATCH, schedule=schedule.value,
                               optimizer=functools.partial(torch.optim.AdamW, **ADAM))
    assert isinstance(dm._runner, PipelineRunner) and dm._runner.options.schedule is schedule
    torch.testing.assert_close(dm(ids), ref_logits, **TOL)
    for expected in ref_losses:
        torch.testing.assert_close(dm.train_step(ids, labels), expected, **TOL)
    grads = dm.full_grads()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[-1][name], **TOL, msg=lambda m, n=name: f"{n}: {m}")
    for name, weight in dm.full_state_dict().items():
        torch.testing.assert_close(weight, ref_weights[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")


CONFIGS = {  # (preset, stages, schedule, micro_batch, tied)
    2: [
        ("llama-tiny", _stages(0, 2, 4), Schedule.GPIPE, 1, False),
        ("llama-tiny", _stages(0, 1, 4), Schedule.ONE_F_ONE_B, 2, False),
        ("mamba2-tiny", _stages(0, 2, 4), Schedule.ONE_F_ONE_B, 1, False),
        ("mamba2-tiny", _stages(0, 3, 4, recompute_first=True), Schedule.GPIPE, 2, False),
        ("llama-tiny", _stages(0, 2, 4), Schedule.ONE_F_ONE_B, 1, True),
        ("llama-tiny", _stages(0, 2, 4), Schedule.ZERO_BUBBLE, 1, False),  # one chunk per rank: ZB1P
        # two chunks per rank, uneven (a chunk of the embedding alone; one of three layers)
        ("llama-tiny", _stages(0, 0, 1, 2, 4), Schedule.INTERLEAVED_1F1B, 1, True),
        ("mamba2-tiny", _stages(0, 1, 3, 4, 4), Schedule.ZERO_BUBBLE, 1, True),  # V: embed and head on rank 0
    ],
    4: [
        ("llama-tiny", _stages(0, 1, 2, 3, 4), Schedule.ONE_F_ONE_B, 1, False),
        ("llama-tiny", _stages(0, 0, 2, 3, 4), Schedule.GPIPE, 1, False),
        ("mamba2-tiny", _stages(0, 1, 2, 3, 4), Schedule.ONE_F_ONE_B, 1, True),
    ],
}
# through autoshard.parallelize: (preset, plan, schedule, tied)
PLANS = {
    2: [("llama-tiny", dict(pp=2, micro_batch=1), Schedule.GPIPE, True)],
    4: [("llama-tiny", dict(pp=2, cp=2, micro_batch=2), Schedule.ONE_F_ONE_B, False)],
}


def _spec(name: str, tied: bool):
    return replace(get_spec(name), tied=tied)


def _run_all(rank: int, world: int, references: dict) -> None:
    for name, stages, schedule, micro_batch, tied in CONFIGS[world]:
        try:
            _check_config(_spec(name, tied), stages, schedule, micro_batch, references[name, tied])
        except AssertionError as e:
            raise AssertionError(f"rank {rank}, {name} tied={tied} stages {stages} {schedule.value} "
                                 f"micro_batch {micro_batch}: {e}") from None
    for name, plan, schedule, tied in PLANS[world]:
        try:
            _check_parallelize(_spec(name, tied), plan, schedule, references[name, tied])
        except AssertionError as e:
            raise AssertionError(f"rank {rank}, {name} tied={tied} plan {plan} {schedule.value}: {e}") from None


@pytest.mark.parametrize("world", [2, 4])
def test_pipeline_matches_single_process(world):
    keys = {(name, tied) for name, *_, tied in CONFIGS[world] + PLANS[world]}
    references = {key: _reference(_spec(*key)) for key in sorted(keys)}  # computed once, not per rank
    run_ranks(world, _run_all, references)
