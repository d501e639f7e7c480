"""The hybrids of issue 25 trained under every axis on two ranks, inside the shared world-2 spawn
(test_equivalence.py): loss, every gradient and the weights after two AdamW steps against one process.

The configs are tests/models/hybrid_models.py's (2-6 layers, every kind of layer the model has), Falcon-H1's
mup multipliers exaggerated (a dropped multiplier shows) and its gated norm on. Under tp each layer part runs by its own
rule (attention, DeepSeek's MLA, Mamba-2 mixers by heads / groups, gated DeltaNets by key heads, short convolutions
by channel, MLPs, a fused [gate; up] by its halves; MoE blocks whole). An axis the
runtime cannot run yet on a model is refused by name, on every rank (models/layered.py `hybrid_refusals`)."""

from __future__ import annotations

from tests.runtime.equivalence import Tiny

_FALCON = dict(ssm_in_multiplier=1.7, ssm_multipliers=[0.6, 1.9, 0.7, 1.4, 2.3], ssm_out_multiplier=0.6,
               attention_in_multiplier=1.3, attention_out_multiplier=0.7, key_multiplier=1.6,
               mlp_multipliers=[1.5, 0.6], embedding_multiplier=2.0, lm_head_multiplier=0.5,
               mamba_rms_norm=True)


def _tiny(model_type: str, **overrides) -> Tiny:
    from tests.models.hybrid_models import config

    return Tiny(f"{model_type}-tiny", config(model_type, **overrides))


HYBRIDS = {
    "bamba": _tiny("bamba"),  # Mamba-2 layers, attention at 1
    "nemotron_h": _tiny("nemotron_h"),  # Mamba-2, MoE, attention and MLP layers
    "falcon_h1": _tiny("falcon_h1", **_FALCON),  # attention and Mamba-2 side by side in every layer
    "deepseek_v3": _tiny("deepseek_v3"),  # MLA; a dense layer, then MoE layers
    "jamba": _tiny("jamba"),  # Mamba-1 selective scan, attention, MoE
    # not named by issue 25: Granite-4 (Mamba-2 / attention, MoE in every layer), Zamba2 (a shared transformer
    # block), Qwen3-Next (gated DeltaNet + gated attention, MoE), LFM2 (short convolutions + attention)
    "granitemoehybrid": _tiny("granitemoehybrid"), "zamba2": _tiny("zamba2"), "qwen3_next": _tiny("qwen3_next"),
    "lfm2": _tiny("lfm2"),
    # without attention layers (HF's hybrid cache cannot be built for them: capture and the stages keep none): an
    # all-Mamba Bamba (one kind, an MLP beside the mixer), Granite-4 (MoE beside it), Nemotron-H (Mamba-2, MoE, MLP)
    "bamba_no_attention": _tiny("bamba", attn_layer_indices=None, num_hidden_layers=2),
    "granite4_no_attention": _tiny("granitemoehybrid", layer_types=["mamba", "mamba"], num_hidden_layers=2),
    "nemotron_h_no_attention": _tiny("nemotron_h", layers_block_type=["linear_attention", "moe", "linear_attention",
                                                                      "mlp"]),
}
# tp with sequence parallelism: each sequence mixer (attention, Mamba-1 / Mamba-2 mixers, gated DeltaNets, short
# convolutions) gathers the shard at its input, its state running along the whole sequence; HF handed the whole
# sequence's masks (runtime/stages.whole_sequence_mask: the attention layers' causal one, the recurrent layers' none)
PLANS = (dict(dp=2), dict(pp=2, micro_batch=2), dict(cp=2), dict(tp=2), dict(ep=2), dict(tp=2, sequence_parallel=True))
# tp: every layer part by its own rule (models/layered.py `layer_parts`); refused naming the first part none splits
# (Zamba2's shared block); cp: LFM2's short convolutions continue the previous rank's tokens (runtime/cp_conv.py),
# Jamba's Mamba-1 scans and Qwen3-Next's gated DeltaNets pass their state (runtime/cp_scan.py, cp_delta.py)
REFUSED = {           ("zamba2", "tp"): "no tensor-parallel rule splits a shared block yet",
           ("zamba2", "pp"): "its layers share a block"}
MOE = ("nemotron_h", "deepseek_v3", "jamba", "granitemoehybrid", "qwen3_next", "granite4_no_attention",
       "nemotron_h_no_attention")


def check_hybrids() -> None:
    from tests.runtime.equivalence import check_axes

    check_axes(HYBRIDS, lambda name: tuple(p for p in PLANS if "ep" not in p or name in MOE), REFUSED)
    # ZeRO-3: Zamba2's layers call one shared block, which FSDP2 keeps in the root's unit (runtime/zero3.py
    # `_own_blocks`; a unit per layer raised "shared with a parameter already managed by another FSDP group")
    check_axes({"zamba2": HYBRIDS["zamba2"]}, lambda name: (dict(dp=2, zero=3),), {})
    # one hybrid layer shares its block with none, yet reads the embeddings' output: pp refused by that (it ran 4%
    # off in the embedding's gradient before), dp exact
    check_axes({"zamba2_one_hybrid": _tiny("zamba2", layers_block_type=["mamba", "hybrid"], num_hidden_layers=2)},
               lambda name: (dict(dp=2), dict(pp=2, micro_batch=2)),
               {("zamba2_one_hybrid", "pp"): "its layers read original_hidden_states beside their input"})
    _check_generate()


def _check_generate() -> None:
    """Greedy generation of Bamba and Nemotron-H under pp 2 and tp 2 (and Qwen3-Next's under tp 2) equals HF's: each stage's cache holds the
    K/V of its attention layers and the conv / SSM states of its Mamba-2 layers (runtime/ssd.py
    `cached_mixer_forward`), byte for byte what HF's one-process cache holds for those layers, and under tp
    each rank its share of the heads / groups (which serving prices: tests/passes/serving/test_hybrid_cache.py)."""
    import itertools

    import torch

    from autoshard.models.facts import cache_layer_bytes
    from tests.runtime.families import check_generate

    ids = torch.randint(3, 200, (2, 6), generator=torch.Generator().manual_seed(0))
    new = 8
    import pytest

    import autoshard
    from autoshard.errors import InvalidConfigError

    # no attention layer: HF's hybrid cache cannot serve it (HF's own generate raises), so generate is refused by name
    dm = autoshard.parallelize(HYBRIDS["bamba_no_attention"].build(), ids, plan=dict(tp=2), global_batch=2)
    with pytest.raises(InvalidConfigError, match="inference is refused for .*: it has no attention layer"):
        dm.generate(ids, max_new_tokens=2)
    for name in ("qwen3_next", "lfm2"):  # each rank's DeltaNet heads' conv / state cache, its short conv's channels
        check_generate(HYBRIDS[name], dict(tp=2), ids, new=new)
    for name, plan in itertools.product(("bamba", "nemotron_h"), (dict(pp=2), dict(tp=2))):
        dm = check_generate(HYBRIDS[name], plan, ids, new=new)
        cached = dm._generator.cache_bytes  # this rank's, after the new tokens
        with torch.no_grad():  # HF's cache after the same tokens: the prompt and the first new - 1 generated
            full = dm.generate(ids, max_new_tokens=new - 1)
            layers = HYBRIDS[name].build()(full, use_cache=True).past_key_values.layers
        held = [i for c in dm._generator.chunks.values() for i in range(c.stage.first_layer, c.stage.end_layer)]
        # tp 2 splits the 2 KV heads and the 2 Mamba-2 groups (their heads and conv channels): half of every layer's
        # cache on each rank, as serving prices it (tests/passes/serving/test_hybrid_cache.py)
        assert cached * plan.get("tp", 1) == sum(cache_layer_bytes(layers[i]) for i in held), f"{name} {plan} cache"
