"""dm.generate under tp and pp equals HF's single-process greedy generate, token for token.

Each world size is spawned once and runs every configuration inside (start-up costs seconds):
LLaMA, Mamba-2 and Mixtral at tp, pp, tp x pp, virtual stages (interleaved and the V placement),
Mixtral and Qwen2-MoE at ep 2 and with tp / pp (experts sliced over identical sequences; the replicas of
inference plans at tp 2 split every expert over tp too: Mixtral tp 2, Qwen2-MoE tp 2 x ep 2), and Mamba-2 with its groups kept whole (tp not dividing n_groups);
training plans with sequence parallelism, on every stage or per stage (generation runs those layers on
the whole sequence and leaves the plan's sequence parallelism in place for training). Prompts avoid the special ids
(0-2), so HF infers no padding mask from them. Inference plans (`autoshard plan --inference`'s
`InferencePlan`, as an object or its file) load under `parallelize` with no global batch and
generate at batch 1, which the training rules refuse under pp (1F1B: a micro-batch per stage) and ep
(ep splits the rows).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import autoshard
from autoshard.errors import InvalidConfigError, PlanFileError
from autoshard.fingerprint import fingerprint_module
from autoshard.inference_plan import InferencePlan, Pool
from autoshard.models.presets import build_model, get_spec
from autoshard.passes.serving.inference_cost import cache_bytes_per_layer
from tests.runtime.dist_harness import run_ranks

NEW_TOKENS = 4


def _prompts(vocab: int, *, batch: int = 2, length: int = 20) -> torch.Tensor:
    # 20 tokens: more than mamba2-tiny's chunk (16), so the prefill scan spans two chunks
    return torch.randint(3, vocab, (batch, length), generator=torch.Generator().manual_seed(3))


def _spec(preset: str):
    if preset == "mamba2-tiny-g1":  # one group: tp 2 keeps B/C whole, each rank's heads read group 0
        return replace(get_spec("mamba2-tiny"), name=preset, groups=1)
    if preset == "llama-tiny-vocab257":  # tp 2 does not divide it: embedding and head replicated
        return replace(get_spec("llama-tiny"), name=preset, vocab=257)
    if preset == "mixtral-tiny-window4":  # a 4-token sliding window (`_build`): the 20-token prompts outgrow it
        return replace(get_spec("mixtral-tiny"), name=preset)
    return get_spec(preset)


def _build(spec):
    model = build_model(spec, seed=0)
    if spec.name.endswith("-window4"):
        model.config.sliding_window = 4  # its masks and HF's sliding cache layers (the stages' masks kept none)
    return model


def _check(preset: str, plan: dict, *, eos_first: bool = False) -> None:
    spec = _spec(preset)
    ids = _prompts(spec.vocab)
    ref, model = _build(spec), _build(spec)
    if eos_first:  # the first sequence's first new token ends it: the rest of that row is padding
        first = int(ref.generate(ids, max_new_tokens=1, do_sample=False)[0, -1])
        for m in (ref, model):
            m.generation_config.eos_token_id = first
            m.generation_config.pad_token_id = 1
    expected = ref.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    # parallelize's global batch is the training one (ep splits its rows, pp its micro-batches);
    # generate takes any batch
    dm = autoshard.parallelize(model, ids, plan=plan, global_batch=ids.shape[0] * plan.get("ep", 1))
    sequence = sorted(n for n, m in dm.model.named_modules() if getattr(m, "sequence_parallel", False) is True)
    sp = plan.get("sequence_parallel", False)
    assert bool(sequence) == (any(sp) if isinstance(sp, list) else sp), f"{preset} {plan}: {sequence}"
    got = dm.generate(ids, max_new_tokens=NEW_TOKENS)
    assert sequence == sorted(n for n, m in dm.model.named_modules() if getattr(m, "sequence_parallel", False) is True)
    assert torch.equal(got, expected), f"{preset} {plan}:\n got {got.tolist()}\nwant {expected.tolist()}"
    # the cache holds this rank's heads of its stage's layers, as the cost model prices it (a sliding window's
    # layers keep only the window: HF's sliding cache layers, which the cost model does not price yet)
    if not eos_first and not spec.name.endswith("-window4"):
        tp, pp = plan.get("tp", 1), plan.get("pp", 1)
        chunks = dm._generator.chunks.values()  # this rank's (several under virtual stages)
        layers = sum(c.stage.layers for c in chunks)
        per_layer = cache_bytes_per_layer(spec, batch=ids.shape[0], tokens=ids.shape[1] + NEW_TOKENS - 1, tp=tp,
                                          dtype_bytes=4)  # the test models are float32
        assert dm._generator.cache_bytes == layers * per_layer, f"{preset} {plan}: cache bytes"
    assert torch.equal(dm.generate(ids, max_new_tokens=0), ids)


def _inference_plan(name: str, model, *pools: Pool, prompt_len: int) -> InferencePlan:
    """What `autoshard plan --inference` writes, with these pools for this model (targets unused here)."""
    return InferencePlan(model=name, fingerprint=fingerprint_module(model), hardware="cpu",
                         devices=sum(p.devices for p in pools), prompt_len=prompt_len, output_len=NEW_TOKENS,
                         ttft_slo_s=1.0, tpot_slo_s=1.0, pools=pools)


def _check_inference_plan(preset: str, *pools: Pool, as_file: bool) -> None:
    """A replica of an inference plan generates one sequence (no global batch given) as HF does, and
    does not train."""
    import tempfile
    from pathlib import Path

    spec = _spec(preset)
    ids = _prompts(spec.vocab, batch=1)
    expected = build_model(spec, seed=0).generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    model = build_model(spec, seed=0)
    plan = _inference_plan(preset, model, *pools, prompt_len=ids.shape[1])
    if as_file:
        path = Path(tempfile.mkdtemp()) / "serve.json"
        plan.save(path)
        plan = path
    dm = autoshard.parallelize(model, ids, plan=plan)
    got = dm.generate(ids, max_new_tokens=NEW_TOKENS)
    assert torch.equal(got, expected), f"{preset} {pools}:\n got {got.tolist()}\nwant {expected.tolist()}"
    served = pools[-1]
    if spec.is_moe and served.tp > 1:  # every expert split over tp (and the experts over ep), as priced
        from autoshard.runtime.expert_parallel import ParallelExperts

        held = [m for m in dm.model.modules() if isinstance(m, ParallelExperts)]
        assert held and all(tuple(m.down_proj.shape) == (spec.experts // served.ep, spec.hidden, spec.ffn // served.tp)
                            for m in held), f"{preset} {pools}: expert shards"
        reference = build_model(spec, seed=0).state_dict()
        full = dm.full_state_dict()  # the slices gathered back over tp and ep
        assert all(torch.equal(full[name], reference[name]) for name in full), f"{preset} {pools}: full_state_dict"
    with pytest.raises(InvalidConfigError, match="runs an inference plan"):
        dm.train_step(ids, ids)


def test_an_inference_plan_names_its_replica_size():
    """Refused before any process group exists: the world is not one replica of the served pool."""
    model = build_model(get_spec("llama-tiny"), seed=0)
    plan = _inference_plan("llama-tiny", model, Pool(role="both", tp=1, pp=2, replicas=2, batch=1), prompt_len=20)
    with pytest.raises(PlanFileError, match=r"tp1 x pp2 x ep1 = 2 ranks each, but this world has 1"):
        autoshard.parallelize(model, _prompts(256, batch=1), plan=plan)
    assert not torch.distributed.is_initialized()


INTERLEAVED = dict(pp=2, virtual_stages=2, schedule="interleaved-1f1b")  # chunks 0, 2 on rank 0; 1, 3 on rank 1
V_SHAPE = dict(pp=2, virtual_stages=2, schedule="zero-bubble")  # chunks 0, 3 on rank 0; 1, 2 on rank 1
WORLD2 = (("llama-tiny", dict(tp=2)), ("llama-tiny", dict(pp=2)), ("llama-tiny", INTERLEAVED),
          ("mamba2-tiny", dict(tp=2)), ("mamba2-tiny", dict(pp=2)), ("mamba2-tiny", V_SHAPE),
          ("mamba2-tiny-g1", dict(tp=2)), ("mixtral-tiny", dict(tp=2)), ("mixtral-tiny", dict(pp=2)),
          ("mixtral-tiny", dict(ep=2)), ("qwen2-moe-tiny", dict(ep=2)),
          ("llama-tiny", dict(tp=2, sequence_parallel=True)), ("mamba2-tiny", dict(tp=2, sequence_parallel=True)),
          ("llama-tiny-vocab257", dict(tp=2, strategies={"embedding": "replicate", "head": "replicate"})),
          ("mixtral-tiny-window4", dict(pp=2)), ("mixtral-tiny-window4", dict(tp=2)))
WORLD4 = (("llama-tiny", dict(tp=2, pp=2)), ("mamba2-tiny", dict(tp=2, pp=2)),
          ("llama-tiny", dict(tp=4)),  # 2 KV heads over tp 4: each rank caches one KV head
          ("mamba2-tiny", dict(tp=4)),  # 2 groups kept whole over tp 4: ranks 0-1 read group 0, 2-3 group 1
          ("mixtral-tiny", dict(tp=2, ep=2)), ("qwen2-moe-tiny", dict(pp=2, ep=2)),  # ep with tp / pp
          # sequence parallelism per stage (plan key lists, docs/plan_format.md "Per-stage choices")
          ("llama-tiny", dict(tp=2, pp=2, sequence_parallel=[True, False])),
          ("mamba2-tiny", dict(tp=2, pp=2, sequence_parallel=[False, True])))


def _run(rank: int, world: int, configs) -> None:
    for preset, plan in configs:
        _check(preset, plan)
    if world == 2:  # inference plans: pp 2 (from its file), ep 2 (the object), at batch 1
        _check_inference_plan("llama-tiny", Pool(role="both", tp=1, pp=2, replicas=1, batch=1), as_file=True)
        _check_inference_plan("mixtral-tiny", Pool(role="both", tp=1, pp=1, ep=2, replicas=1, batch=1), as_file=False)
        # tp 2: every expert's GEMMs split over tp, as serving engines run them (issue 29)
        _check_inference_plan("mixtral-tiny", Pool(role="both", tp=2, pp=1, replicas=1, batch=1), as_file=False)
        # tp 2 of a vocabulary it does not divide: the replica runs embedding and head replicated, as priced
        _check_inference_plan("llama-tiny-vocab257", Pool(role="both", tp=2, pp=1, replicas=1, batch=1), as_file=True)
    if world == 4:  # disaggregated: the world is a replica of the decode pool, the one the runtime serves
        _check_inference_plan("qwen2-moe-tiny", Pool(role="prefill", tp=2, pp=1, replicas=2, batch=4),
                              Pool(role="decode", tp=1, pp=2, ep=2, replicas=1, batch=1), as_file=True)
        _check_inference_plan("qwen2-moe-tiny", Pool(role="both", tp=2, pp=1, ep=2, replicas=1, batch=1), as_file=False)
    if world == 2:
        _check("llama-tiny", dict(tp=2), eos_first=True)
        spec = get_spec("llama-tiny")
        ids = _prompts(spec.vocab)
        dm = autoshard.parallelize(build_model(spec, seed=0), ids, plan=dict(dp=2), global_batch=2)
        with pytest.raises(InvalidConfigError, match="dp=2"):
            dm.generate(ids, max_new_tokens=2)


@pytest.mark.parametrize("world, configs", [(2, WORLD2), (4, WORLD4)], ids=["ws2", "ws4"])
def test_generate_matches_hf(world, configs):
    run_ranks(world, _run, configs)



def test_generate_stops_at_max_position_embeddings():
    """prompt + max_new_tokens may not pass the model's max_position_embeddings: HF only warns there and
    decodes positions the model never saw; generate refuses, naming the most new tokens that fit (HF's
    dynamic RoPE rescales past it: no cap; Mamba-2 has no positions)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Mamba2Config

    from autoshard.ir import Stage
    from autoshard.models.presets import max_positions, position_violation, spec_from_hf_config
    from autoshard.runtime.generate import Generator
    from autoshard.runtime.stages import build_stage_module

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=24)
    spec = spec_from_hf_config(config, name="user-llama")
    assert max_positions(spec, config) == 24 and max_positions(get_spec("llama-tiny")) == 2 * 65536
    assert max_positions(get_spec("mamba2-tiny")) is None and max_positions(get_spec("mamba2-tiny"), Mamba2Config()) is None
    dynamic = LlamaConfig(max_position_embeddings=24, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    assert max_positions(spec, dynamic) is None
    assert position_violation(24, prompt=20, new=4) is None
    assert "20 tokens + 5 new tokens = 25 positions, more than the model's max_position_embeddings (24); " \
           "ask for at most 4 new tokens" in position_violation(24, prompt=20, new=5)
    assert "shorten the prompt to fewer than 24 tokens" in position_violation(24, prompt=24, new=1)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    stage = build_stage_module(model, spec, Stage(first_layer=0, end_layer=1, embed=True, head=True))
    gen = Generator(model, spec, {0: stage}, (0,), tp_group=None, pp_group=None, device=torch.device("cpu"))
    ids = _prompts(64)  # 20 tokens
    with pytest.raises(InvalidConfigError, match="ask for at most 4 new tokens"):
        gen.generate(ids, max_new_tokens=5)
    assert torch.equal(gen.generate(ids, max_new_tokens=4), model.generate(ids, max_new_tokens=4, do_sample=False))
