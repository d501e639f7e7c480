"""Expert parallelism on gloo equals one process (Mixtral, Qwen2-MoE): the loss of two AdamW steps,
every gradient, the weights; composed with dp, tp, pp and cp; dropless under skewed routing; the
router auxiliary loss; sequence parallelism (the MoE block on each tp rank's shard); checkpoints saved under ep that resume under another ep or dp. Each world size is spawned once and runs all its configurations."""

from __future__ import annotations

import pytest
import torch

import autoshard
from autoshard.errors import InvalidConfigError
from autoshard.models.presets import build_model, get_spec
from tests.runtime.dist_harness import run_ranks
from tests.runtime.equivalence import check_plan


def aux_loss(model):
    """HF's router auxiliary loss on (load_balancing_loss_func, router_aux_loss_coef added to the loss).
    Its statistics are combined over all ranks per micro-step: with one micro-batch per rank it is
    HF's loss on the global batch, which the reference computes."""
    model.config.output_router_logits = True
    model.router_aux_loss_coef = 0.1  # (HF reads it off the model) large enough that a wrong combination shows


def skewed(model):
    """A router of zeros: every token ties and topk picks experts 0..k-1, all on ep rank 0: the other
    ranks receive no token (dropless: nothing is dropped, empty experts are fine)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.zero_()


WORLD2 = (
    ("mixtral-tiny", dict(ep=2), None, True),
    ("qwen2-moe-tiny", dict(ep=2, micro_batch=2), None, False),
    ("mixtral-tiny", dict(ep=2, micro_batch=4), aux_loss, False),  # aux: one micro-batch per rank (exact)
    ("mixtral-tiny", dict(ep=2), skewed, False),
    ("qwen2-moe-tiny", dict(ep=2, zero=1), None, False),
    # bf16-mixed (bf16 weights, fp32 main grads and masters) against the single-process bf16-mixed recipe
    ("mixtral-tiny", dict(ep=2, precision="bf16-mixed"), None, False),
    ("qwen2-moe-tiny", dict(ep=2, zero=1, precision="bf16-mixed"), None, False),
    # ZeRO-3 (FSDP2): dense weights sharded over dp x ep, each rank's experts over dp (runtime/zero3.py)
    ("mixtral-tiny", dict(ep=2, zero=3), None, True),
    ("qwen2-moe-tiny", dict(ep=2, zero=3), None, False),
    # fp8: attention and the shared expert in float8 (runtime/fp8.py); router and routed experts bf16
    ("qwen2-moe-tiny", dict(ep=2, precision="fp8"), None, False),
    ("mixtral-tiny", dict(ep=2, precision="fp8", fp8_recipe="rowwise"), None, False),
    # sequence parallelism: each tp rank routes its shard of the tokens, the aux statistics summed over tp too
    ("mixtral-tiny", dict(tp=2, sequence_parallel=True, micro_batch=8), aux_loss, False),
)
WORLD4 = (
    ("mixtral-tiny", dict(ep=4), None, False),
    ("qwen2-moe-tiny", dict(ep=4), None, False),
    ("mixtral-tiny", dict(dp=2, ep=2), None, False),
    ("qwen2-moe-tiny", dict(dp=2, ep=2, micro_batch=2), aux_loss, False),
    ("mixtral-tiny", dict(ep=2, tp=2), None, True),
    ("qwen2-moe-tiny", dict(ep=2, tp=2), None, False),
    ("mixtral-tiny", dict(ep=2, pp=2, micro_batch=2), None, False),
    ("qwen2-moe-tiny", dict(ep=2, pp=2, micro_batch=2), None, False),
    ("mixtral-tiny", dict(ep=2, cp=2, micro_batch=4), aux_loss, False),
    ("qwen2-moe-tiny", dict(ep=2, cp=2), None, False),
    ("mixtral-tiny", dict(dp=2, ep=2, zero=3), None, False),  # experts sharded over dp 2, dense over all 4
    ("qwen2-moe-tiny", dict(dp=2, ep=2, zero=3), None, True),
    ("qwen2-moe-tiny", dict(ep=2, tp=2, sequence_parallel=True, micro_batch=4), aux_loss, False),
    ("mixtral-tiny", dict(dp=2, tp=2, zero=3, sequence_parallel=True), None, False),
)


def _bad_plans_raise_on_every_rank(rank: int, world: int) -> None:
    """ep > 1 on a dense model, ep not dividing the experts: the same InvalidConfigError on every
    rank, raised before any collective (a rank that went on would hang the other)."""
    from transformers import AutoModelForCausalLM

    three = get_spec("mixtral-tiny").hf_config()
    three.num_local_experts = 3
    cases = ((build_model(get_spec("llama-tiny")), "has no experts"),
             (AutoModelForCausalLM.from_config(three), r"ep \(2\) does not divide the 3 experts"))
    for model, message in cases:
        with pytest.raises(InvalidConfigError, match=message):
            autoshard.parallelize(model, torch.zeros(2, 16, dtype=torch.long), plan=dict(ep=2))


def _checkpoint_across_ep(rank: int, world: int, root: str) -> None:
    """Qwen2-MoE (routed and shared experts) trains 2 steps at ep 2 ZeRO-3 (FSDP2) and saves; the checkpoint
    resumes at ep 2 (ZeRO 0), ep 2 ZeRO-1 and dp 2 ZeRO-1 (every expert on every rank), each from a model
    initialised differently, and after 2 more steps the weights equal 4 single-process steps."""
    import functools
    import os

    from tests.runtime.equivalence import ADAM, TOL, batches, reference

    spec = get_spec("qwen2-moe-tiny")
    data = batches(spec.vocab, global_batch=8, seq=16, steps=4)
    ref, _, _ = reference(spec, data)
    adamw = functools.partial(torch.optim.AdamW, **ADAM)

    def parallel(plan, seed):
        return autoshard.parallelize(build_model(spec, seed=seed), data[0][0], plan=plan, global_batch=8,
                                     optimizer=adamw)

    dm = parallel(dict(ep=2, zero=3), seed=0)
    for ids, labels in data[:2]:
        dm.train_step(ids, labels)
    path = os.path.join(root, "ep2")
    dm.save_checkpoint(path)
    for plan in (dict(ep=2), dict(ep=2, zero=1), dict(dp=2, zero=1)):
        resumed = parallel(plan, seed=7)
        assert resumed.load_checkpoint(path) == 2
        for ids, labels in data[2:]:
            resumed.train_step(ids, labels)
        state = resumed.full_state_dict()
        for name, param in ref.named_parameters():
            torch.testing.assert_close(state[name], param.detach(), **TOL, msg=lambda m: f"{plan}: {name}: {m}")


def _run_all(rank: int, world: int, configs, root: str) -> None:
    if world == 2:
        _bad_plans_raise_on_every_rank(rank, world)
        _checkpoint_across_ep(rank, world, root)
    for preset, plan, prepare, logits in configs:
        check_plan(preset, plan, logits=logits, prepare=prepare)


@pytest.mark.parametrize("world, configs", [(2, WORLD2), (4, WORLD4)], ids=["ws2", "ws4"])
def test_expert_parallel_matches_single_process(world, configs, tmp_path):
    run_ranks(world, _run_all, configs, str(tmp_path))
