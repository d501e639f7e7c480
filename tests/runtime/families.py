"""Tiny models of the HF decoder families the equivalence tests train under every axis (issue 24).

Each is `tiny_config` of the family's own config class (autoshard/models/tiny.py), with its
multipliers and softcaps exaggerated so that a dropped op shows on a tiny random model, and 4-token
windows so that a dropped window shows at 16 tokens."""

from __future__ import annotations

from autoshard.models.tiny import exaggerated, tiny_config, without_dropout
from tests.runtime.equivalence import Tiny


class EagerTiny(Tiny):
    """A tiny model run with HF's eager attention: the causal mask HF builds, where sdpa takes a causal flag."""

    def build(self):
        model = super().build()
        model.set_attn_implementation("eager")
        return model


def _tiny(model_type: str, **overrides) -> Tiny:
    return Tiny(f"{model_type}-tiny", exaggerated(tiny_config(model_type, **overrides)))


DENSE = {
    "qwen3": _tiny("qwen3"),  # per-head q/k norms: replicated, gradient summed over tp
    "mistral": _tiny("mistral", sliding_window=4),  # the window under cp and in the stages' masks
    "gemma2": _tiny("gemma2"),  # scaled embedding, final and attention softcaps, alternating windows
    "gemma3": _tiny("gemma3_text"),  # q/k norms, rotary per layer type (local / global)
    "phi3": _tiny("phi3"),  # fused qkv gathered as HF declares it; fused gate_up packed (the graph chunks it)
    "olmo2": _tiny("olmo2"),  # full-width q/k norms on gathered q/k/v (and a padding row the embedding keeps)
    "granite": _tiny("granite"),  # embedding / residual / attention multipliers, logits scaling
}
MOE = {
    "qwen3_moe": _tiny("qwen3_moe"),
    "gpt_oss": _tiny("gpt_oss"),  # attention sinks; biased, transposed, interleaved, clamped experts (HF's own under ep)
    # base_model_prefix names another model; experts called pre-scattered; chunked attention within 4 tokens of the
    # 16 (tiny_config's chunk; HF's default, 8192, is causal at these lengths: it hid cp attending across chunks); its
    # full-attention layer without rope, as Llama-4's are, scaling its queries by position past 4 tokens (temperature
    # tuning, applied by the CP attention at each rank's real positions; tiny_config's floor_scale: HF's 8192, and a
    # tiny whose layers all had rope, hid that cp counted the positions from each rank's chunk)
    "llama4": _tiny("llama4_text"),
}

# multi-query attention (one KV head, Gemma-2B's, Falcon-7B's): under tp its k / v projections stay whole on every
# rank and their gradients (this rank's query heads' part) are summed over tp; Llama reads the head through SDPA's
# native GQA, Gemma-2 (softcapped, eager) repeats it (`repeat_kv`, its count set per rank); Llama's also under sequence
# parallelism (the whole k / v projections read the gathered sequence as any split one)
MULTI_QUERY = {"llama_mq": _tiny("llama", num_key_value_heads=1), "gemma2_mq": _tiny("gemma2", num_key_value_heads=1)}

# an embedding with rows beyond the vocabulary (Mllama's text model: 8 image tokens), replicated under tp while the LM
# head stays vocab-parallel; its layers under model.language_model, their head counts set per rank all the same
BEYOND_VOCAB = {"mllama": _tiny("mllama")}

# classes that declare no base_model_tp_plan: tp runs the Megatron pairs found on their graph
# (passes/capture/tp_proposal.py): Persimmon's fused per-head query_key_value -> dense, dense_h_to_4h -> dense_4h_to_h
# (its per-head q/k layer norms' gradients summed over tp), StableLM's q/k/v -> o_proj, gate/up -> down_proj, LFM2's
# q/k/v -> out_proj, w1/w3 -> w2 (HF declares its embedding only); StarCoder's (GPT-BigCode's) multi-query
# c_attn, [q; k; v] of one KV head, which no head count splits: gathered as HF declares Phi-3's qkv_proj (the attention
# whole on every rank)
NO_TP_PLAN = {
    "persimmon": _tiny("persimmon"),
    "stablelm": _tiny("stablelm"),
    "lfm2": _tiny("lfm2"),  # declares its embedding only; w1 / w3 -> w2 at its adjusted width (2/3, rounded up), not the config's
    "gpt_bigcode": _tiny("gpt_bigcode", attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0),
}

# HF's gathered styles beside plain ones: GLM-4's per-head attention region and gathered gate_up_proj ->
# down_proj, OLMo-3's gathered q/k/v with OLMo-2's norms and sliding windows, OLMoE's beside routed experts
# (tp only: their other axes are DENSE's and MOE's)
GATHERED = {"glm4": _tiny("glm4"), "olmo3": _tiny("olmo3"), "olmoe": _tiny("olmoe")}

# MoE after dense layers, decided per layer by a list the narrowed one-layer copy loses (`mlp_layer_types`, longer
# than the stack: ExaOne-MoE's first-k-dense, MiMo-V2-Flash's with sliding / full attention), so the capture traces
# the model's own layer (passes/capture/layer_kinds.py); MiMo-V2-Flash's values wider than its keys under cp (K and V
# packed along the features, runtime/cp_attention.py) and tp (v_proj / o_proj split by their own head widths, its
# full-attention layers' sinks with the heads)
PER_LAYER_MOE = {"exaone_moe": _tiny("exaone_moe"), "mimo_v2_flash": _tiny("mimo_v2_flash")}
PER_LAYER_PLANS = (dict(dp=2), dict(pp=2, micro_batch=2), dict(ep=2), dict(tp=2), dict(cp=2))
PER_LAYER_REFUSED = {}

# attention output gates (AFMoE's sigmoid gate_proj per head element, Laguna's softplus g_proj per head), split by
# heads with q_proj; AFMoE's router expert_bias is frozen (requires_grad False: its fp32 value kept beside the masters)
GATED = {"afmoe": _tiny("afmoe"), "laguna": _tiny("laguna")}
GATED_PLANS = (dict(tp=2), dict(cp=2), dict(tp=2, precision="bf16-mixed"))

# parameters HF's training forward never reaches (DeepSeek-V3.2's lightning indexer: its top-k selection is not
# differentiated): no gradient on any rank, so the optimizer leaves them, as one process does (runtime/data_parallel.py)
UNUSED = {"deepseek_v32": _tiny("deepseek_v32")}
UNUSED_PLANS = (dict(dp=2), dict(dp=2, zero=1), dict(dp=2, zero=2, micro_batch=2), dict(dp=2, precision="bf16-mixed"),
                dict(ep=2), dict(dp=2, zero=3), dict(cp=2))
# its indexer takes the whole sequence's mask itself: cp refused naming it (models/facts.py `mask_reader`)
UNUSED_REFUSED = {("deepseek_v32", "cp"): "layers.*.self_attn.indexer (DeepseekV32Indexer) reads the attention mask"}

# pipeline stages of other forwards: BioGPT's LM head is `output_projection` (tied to the embedding: its gradient summed
# over the first and last stage) and its positions embedding is called with the mask and position_ids; Doge builds its
# causal mask materialised (its dynamic mask is added onto it), so its stages run its own forward
STAGED = {"biogpt": _tiny("biogpt", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
          "doge": _tiny("doge", hidden_dropout=0.0), "mellum": _tiny("mellum"),  # Mellum: rotary by layer type
          "olmo": _tiny("olmo")}  # OLMo: a final norm with no parameters (the last stage's entry)

# declared plans that name other linears than LLaMA's (Phi's dense, fc1 / fc2 and a biased LM head split with the
# vocab; StarCoder-2's c_fc / c_proj): HF's plan is the layout, proven on the graph
DECLARED = {"phi": _tiny("phi", resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0),
            "starcoder2": _tiny("starcoder2", residual_dropout=0.0, embedding_dropout=0.0, attention_dropout=0.0)}

# multi-head latent attention in every layer (a uniform stack): run by its layer parts (models/layered.py), HF's
# `mla_kv_a_proj` style the MLA part's rule (q / kv up projections by heads, the latent projections and their norms
# whole with gradients summed over tp): MiniCPM3 dense with a compressed query, DeepSeek-V2 MoE with a full q_proj
LATENT = {"minicpm3": _tiny("minicpm3"), "deepseek_v2": _tiny("deepseek_v2")}
# a declared sinks parameter and HF's `local_params` marker (split with the heads: Granite-SWA); Aria's
# `packed_rowwise` experts, whole on every tp rank as every routed expert (Llama-4's: MOE below)
MARKED = {"granite_swa": _tiny("granite_swa"), "aria_text": _tiny("aria_text")}

# gated DeltaNet layers beside attention, split by key heads (models/layered.py `_delta_part`): Qwen3.5's separate
# [q; k; v], z, b and a projections beside gated attention (Qwen3-Next's fused per-key-head ones:
# tests/runtime/hybrids.py); OLMo-hybrid's q / k / v / a / b / g beside attention with full-width q / k norms, which
# runs whole on every rank as HF declares it (gathered q / k / v, o_proj's input sliced); cp passes each rank's
# final state (runtime/cp_delta.py)
DELTA = {"qwen3_5": _tiny("qwen3_5_text"), "olmo_hybrid": _tiny("olmo_hybrid")}

# per-channel gated delta attention (Kimi-Linear's KDA beside MLA layers, Bailing-hybrid's beside MLA with a per-head
# output gate), split by heads (models/layered.py `_kda_part`): q / k / v, the forget gate's low-rank pair (its
# hidden -> r projection whole, gradient summed), its dt_bias and A_log (Kimi's held (1, 1, heads, 1): split along
# the heads, passes/rewrite.py `_fitted`), beta, the output gate, o_proj row-parallel; cp by runtime/cp_delta.py
KDA = {"kimi_linear": _tiny("kimi_linear"), "bailing_hybrid": _tiny("bailing_hybrid")}

# MiniMax's lightning attention (a decay buffer, no Conv1d or A_log) beside attention layers: cp refused by name
LIGHTNING = {"minimax": _tiny("minimax")}
LIGHTNING_REFUSED = {("minimax", "cp"): "the sequence mixer layers.1.self_attn (MiniMaxLightningAttention"}

# a uniform stack of Mamba-1 selective scans, read by its parts as Jamba's layers are (models/layered.py
# `layered_spec`): the model's own forward under dp and pp, tp by the scan's inner channels, cp by state passing
# (runtime/cp_scan.py)
SCANS = {"mamba": _tiny("mamba")}

# the classic decoders, their layers found by structure (transformer.h, model.decoder.layers) and their attention by
# its call to HF's attention interface (GPT-NeoX's head_size): dp, pp (the model's own forward where the base is no
# plain LLaMA stack: GPT-2's learned positions, OPT) and cp; tp as HF declares it at the model's own paths
# (GPT-NeoX's per-head fused query_key_value and parallel residual, GPT-J's h.*, CodeGen's qkv_proj in whole model-
# parallel groups, their MLP width read off the layer), proposed on the graph where none is declared (GPT-2's Conv1D:
# transposed linears split on their other dim, the fused c_attn as packed [q; k; v] pieces, its split_size per rank);
# OPT's fc1 -> fc2 sit in the layer itself, no module holds the pair: fc1's own input enters the tp region; OPT's pp
# places its project_in with the first stage and project_out (past the final norm) with the last, by where its traced
# graph runs them (tiny OPT projects 768 -> 64);
# dropout off, so one process is reproducible. CTRL's attention takes its normed input as v, k and q (tp: each use's
# gradient summed over the ranks; only v's was) and its base scales the embeddings in place (a later pipeline stage
# feeds its own forward zeros, not the received tensor, which in-place scaling refused)
CLASSIC = {"gpt_neox": _tiny("gpt_neox"), "opt": _tiny("opt", dropout=0.0),
           "gpt2": _tiny("gpt2", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0), "gptj": _tiny("gptj"),
           "codegen": _tiny("codegen"), "ctrl": _tiny("ctrl", resid_pdrop=0.0, embd_pdrop=0.0)}
CLASSIC_REFUSED = {}

# every family under every axis on two ranks (dense: dp, tp, pp, cp; MoE: dp, tp, pp, cp, ep), inside the
# shared world-2 spawn (test_equivalence.py); an axis a family refuses must say so by name, on every rank
PLANS = (dict(dp=2), dict(tp=2), dict(pp=2, micro_batch=2), dict(cp=2))

# attention computed in the layer's own forward (Falcon's direct SDPA call, MPT's and Bloom's ALiBi, XGLM's matmuls,
# GPT-Neo's global and 4-token local layers): dp and pp by the model's own forward (Bloom's embedding norm with the
# first stage, a later one running a stand-in), priced by the ops it traces to; tp with the attention whole on every
# rank, its projections in HF's gathered styles (no head count its forward views by is set per rank), the MLP a
# Megatron pair (Falcon's multi-query query_key_value, XGLM's fc1 -> fc2 in the layer itself); cp refused naming the
# module (no CP attention swaps in); dropout off
OWN_ATTENTION = {t: Tiny(f"{t}-tiny", without_dropout(exaggerated(tiny_config(t, **more)))) for t, more in (
    ("falcon", {}), ("mpt", {}), ("bloom", {}), ("xglm", {}), ("gpt_neo", dict(window_size=4)))}
_OWN = "computes attention in its own forward"
OWN_ATTENTION_REFUSED = {(t, "cp"): _OWN for t in OWN_ATTENTION}
# a heterogeneous config (HF's per_layer_config): Gemma-4's full-attention layers with twice the head_dim of its
# sliding ones, and (k_eq_v) half their K/V heads with the keys as values (no v_proj); read as two layer kinds.
# Its attention (scale 1, q/k RMS-normed) turns float32 noise in the first step's weights into ~1e-4 of the second
# step's gradients under AdamW (the first step's gradients agree to 3e-6 under tp), so these train with SGD
def _gemma4(name: str, **full) -> Tiny:
    from transformers import Gemma4TextConfig

    return Tiny(name, exaggerated(tiny_config(Gemma4TextConfig(hidden_size_per_layer_input=0, **full))))


GEMMA4 = {"gemma4": _gemma4("gemma4-tiny"),
          "gemma4_k_eq_v": _gemma4("gemma4-k-eq-v-tiny", attention_k_eq_v=True, num_attention_heads=32,
                                   num_key_value_heads=16, num_global_key_value_heads=4),  # Gemma-4-31B's heads
          # Gemma-4-26B-A4B's layer: an MLP and a MoE block side by side, its router and experts the layer's own
          # children (its router reads the layer's input); under tp its experts whole on each rank, as Qwen3-MoE's
          "gemma4_moe": _gemma4("gemma4-moe-tiny", enable_moe_block=True, num_experts=128, top_k_experts=8,
                                moe_intermediate_size=704)}
GEMMA4_REFUSED = {}
# Gemma-4's E models (HF's default Gemma4TextConfig): every layer reads its own slice of a per-layer input embedding
# ([vocab, layers x d], looked up and added to a projection of the input embedding before the layers); dp (ZeRO-3 too)
# and cp run it, per token; pp and tp refused by name (before, the whole model was refused: the table grew with the
# layer count outside the layers, unpriced)
PER_LAYER_INPUT = {"gemma4_ple": Tiny("gemma4-ple-tiny", exaggerated(tiny_config("gemma4_text")))}
PER_LAYER_INPUT_PLANS = (dict(dp=2), dict(cp=2), dict(dp=2, zero=3), dict(pp=2, micro_batch=2), dict(tp=2))
PER_LAYER_INPUT_REFUSED = {("gemma4_ple", "pp"): "its layers read per-layer inputs",
                           ("gemma4_ple", "tp"): "layers.0.per_layer_input_gate (Linear) is neither attention"}
# HF's default configs leave a field unset that every checkpoint sets (models/tiny.py `UNSET_BY_DEFAULT`; before, the
# tiny model did not build): Nemotron's K/V heads (squared-ReLU MLP, partial rotary, LayerNorm1P), dots1's experts
# (shared experts beside routed ones), LFM2-MoE's layer types (a dense conv layer, then a MoE attention layer)
UNSET = {"nemotron": _tiny("nemotron"), "dots1": _tiny("dots1"), "lfm2_moe": _tiny("lfm2_moe")}
# a multimodal wrapper whose vision tower holds as many layers as its decoder (Gemma-3's tiny config): the decoder's
# layers are the list beside the input embedding, the tower (never run on text) no gradient; pp refused by name
# multimodal wrappers trained on token ids: the vision tower and projector, which the forward never runs on them,
# held by the first pipeline stage (models/beside.py `idle_modules`); Gemma-4-unified's later stages look its image /
# audio tokens up in the input embedding they do not hold (runtime/stages.py `_Unmatched`); GOT-OCR2 and Fuyu (a
# Persimmon decoder) run LLaMA's stage forward, their vision modules held on the first stage the same way
WRAPPED = {"gemma3_wrapper": _tiny("gemma3")}
WRAPPED_PP = {"gemma4_unified": _tiny("gemma4_unified"), "got_ocr2": _tiny("got_ocr2")}
WRAPPED_REFUSED = {}
# sequence parallelism on the layer's own residual norms (models/facts.py `residual_norms`, not LLaMA's two): Apertus'
# attention_layernorm / feedforward_layernorm, StableLM's LayerNorms with biases, GPT-NeoX's parallel residual (both
# regions gather the one shard), Qwen3's q/k norms (summed over tp inside the attention region, on the gathered
# sequence); the masks HF builds, for the whole sequence (runtime/stages.py `whole_sequence_mask`): Mistral's 4-token
# window in every layer, Ministral's on one layer of two (a mask per layer type), LLaMA under eager attention; the
# model's own forward around the layers on the shard: Gemma-2's scaled embedding (replicated, its output cut to the
# shard), softcaps and alternating windows, Granite's multipliers, Mllama's embedding with image rows; a MoE block
# routing each rank's shard of the tokens (Qwen3-MoE); a hybrid's parts (models/layered.py `_sequence_unsplit`):
# DeepSeek-V2's latent attention and its MoE block, AFMoE's sliding / full layers with a dense first layer, Qwen3.5's
# gated DeltaNet and Mamba-1's scans (their regions gather the whole sequence, Mamba-1's row-parallel x_proj summing
# inside it; tests/runtime/hybrids.py runs the Mamba hybrids), GPT-OSS's sinks (split with the heads inside the
# attention region, which reads the gathered sequence), DeepSeek-V3.2's indexer (inside the latent attention's region,
# handed the whole sequence's causal mask materialised, as its forward builds it), Llama-4's chunked attention (the
# whole sequence's chunked mask); HF's gathered attention run whole with the sequence gathered at its input
# (OLMo-2's full-width q/k norms, Phi-3's fused qkv); GPT-2's learned positions (looked up whole, cut to the shard)
# and its final norm run whole (its forward views the output by the input's length past it: the sequence leaves the
# shard there, `ModelSpec.beside`); OPT's project_in on the shard, its fc1 its own region over the tokens its layer
# flattens (b x s, h): gathered and reduce-scattered on that dim (runtime/tensor_parallel.py `token_dim`)
SEQUENCE = {"apertus": Tiny("apertus-tiny", without_dropout(exaggerated(tiny_config("apertus")))),
            "stablelm": NO_TP_PLAN["stablelm"], "gpt_neox": CLASSIC["gpt_neox"], "qwen3": DENSE["qwen3"],
            "mistral": DENSE["mistral"],
            "ministral": _tiny("ministral", layer_types=["sliding_attention", "full_attention"]),
            "llama_eager": EagerTiny("llama-tiny", exaggerated(tiny_config("llama"))),
            "gemma2": DENSE["gemma2"], "granite": DENSE["granite"], "mllama": BEYOND_VOCAB["mllama"],
            "qwen3_moe": MOE["qwen3_moe"], "llama4": MOE["llama4"], "deepseek_v2": LATENT["deepseek_v2"],
            "afmoe": GATED["afmoe"], "qwen3_5": DELTA["qwen3_5"], "olmo2": DENSE["olmo2"], "phi3": DENSE["phi3"],
            "mamba": SCANS["mamba"], "gpt_oss": MOE["gpt_oss"], "deepseek_v32": UNUSED["deepseek_v32"],
            "gpt2": CLASSIC["gpt2"], "opt": CLASSIC["opt"]}
SEQUENCE_REFUSED = {}
SEQUENCE_PLAN = dict(sequence_parallel=True, tp=2)
REFUSED = {}


def check_families() -> None:
    from tests.runtime.equivalence import check_axes, check_plan

    check_axes({**DENSE, **MOE, **SCANS}, lambda name: PLANS + ((dict(ep=2),) if name in MOE else ()), REFUSED)
    check_axes({**NO_TP_PLAN, **GATHERED}, lambda name: (dict(tp=2),), {})
    check_axes(MULTI_QUERY, lambda name: (dict(tp=2), dict(tp=2, micro_batch=2, precision="bf16-mixed"))
               + ((dict(tp=2, sequence_parallel=True, recompute="selective"),) if name == "llama_mq" else ()), {})
    check_axes(BEYOND_VOCAB, lambda name: (dict(tp=2),), {})
    check_axes(CLASSIC, lambda name: PLANS, CLASSIC_REFUSED)
    check_axes(OWN_ATTENTION, lambda name: PLANS + ((dict(dp=2, zero=3),) if name == "falcon" else ()),
               OWN_ATTENTION_REFUSED)
    # ZeRO-3's FSDP2 units and torch.compile's regions are the blocks found by structure (CodeGen's and GPT-2's
    # transformer.h): both raised "'CodeGenModel' object has no attribute 'layers'"
    check_axes({"codegen": CLASSIC["codegen"]}, lambda name: (dict(dp=2, zero=3),), {})
    check_plan(CLASSIC["gpt2"], dict(dp=2, zero=3), compile="aot_eager", logits=True)
    # OPT-350m's layout: norms after each sublayer (do_layer_norm_before false), so no final norm: each stage enters
    # the model's own forward at a layer of its own, project_out with the last
    check_plan(Tiny("opt-post-norm-tiny", exaggerated(tiny_config("opt", dropout=0.0, do_layer_norm_before=False))),
               dict(pp=2, micro_batch=2), logits=True)
    check_axes(PER_LAYER_MOE, lambda name: PER_LAYER_PLANS, PER_LAYER_REFUSED)
    check_axes(UNUSED, lambda name: UNUSED_PLANS, UNUSED_REFUSED)
    check_axes(STAGED, lambda name: (dict(pp=2, micro_batch=2),), {})
    check_axes(DECLARED, lambda name: (dict(tp=2),), {})
    check_axes(LIGHTNING, lambda name: (dict(dp=2), dict(cp=2)), LIGHTNING_REFUSED)
    check_axes(GATED, lambda name: GATED_PLANS, {})
    check_axes(LATENT, lambda name: PLANS + ((dict(ep=2),) if name == "deepseek_v2" else ()), {})
    check_axes(MARKED, lambda name: (dict(tp=2),), {})
    check_axes(DELTA, lambda name: (dict(tp=2), dict(cp=2)), {})
    check_axes(KDA, lambda name: (dict(tp=2), dict(cp=2), dict(tp=2, sequence_parallel=True)), {})
    check_axes(GEMMA4, lambda name: PLANS + ((dict(ep=2),) if name == "gemma4_moe" else ()), GEMMA4_REFUSED, sgd=True)
    check_axes(PER_LAYER_INPUT, lambda name: PER_LAYER_INPUT_PLANS, PER_LAYER_INPUT_REFUSED, sgd=True)
    check_axes(UNSET, lambda name: (dict(tp=2),) + ((dict(ep=2),) if name != "nemotron" else ()), {})
    check_axes(WRAPPED, lambda name: PLANS, WRAPPED_REFUSED)
    check_axes(WRAPPED_PP, lambda name: (dict(pp=2, micro_batch=2),), {})
    check_axes(SEQUENCE, lambda name: (SEQUENCE_PLAN,), SEQUENCE_REFUSED)
    _check_unused_stay()
    _check_generate()


def _check_unused_stay() -> None:
    """A parameter no loss reaches keeps `.grad` None in one process, so AdamW leaves it alone; distributed it
    must stay bit-identical too (a zero gradient in its place still takes AdamW's weight decay: 0.5 here, so any
    step shows)."""
    import functools

    import torch

    import autoshard
    from tests.runtime.equivalence import batches

    for name, source in UNUSED.items():
        probe = source.build()
        data = batches(probe.config.vocab_size, global_batch=8, seq=16, steps=2)
        probe(data[0][0], labels=data[0][1]).loss.backward()
        unused = {n: p.detach().clone() for n, p in probe.named_parameters() if p.grad is None}
        assert unused, f"{name}: every parameter got a gradient; the check needs one that does not"
        for plan in (p for p in UNUSED_PLANS if (name, next(iter(p))) not in UNUSED_REFUSED):
            dm = autoshard.parallelize(source.build(), data[0][0], plan=plan, global_batch=8,
                                       optimizer=functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.5))
            for ids, labels in data:
                dm.train_step(ids, labels)
            state = dm.full_state_dict()
            moved = [n for n, value in unused.items() if not torch.equal(state[n].float(), value.float())]
            assert not moved, f"{name} {plan}: parameters no loss reaches were stepped: {moved}"


def _check_generate() -> None:
    """Greedy generation keeps the model's own forward (Gemma-2's softcap and scaled embedding, Granite's
    multipliers) under tp and over pipeline stages: Gemma-2 with 4 layers and a 3-token window, so the later
    stage's sliding layer sizes its mask without layer 0 (6 + 8 tokens: the window drops keys; without it the
    tokens differ); GPT-OSS's own experts (biases, clamped gate) sliced over ep 2 (`replicated_tokens`); DeepSeek-V2's
    latent attention under tp 2 (its heads' cache split, the compressed projection whole); multi-query Gemma-2 under tp 2
    (its one KV head cached whole on each rank); Gemma-4's two layer kinds (head_dim 16 / 32, k_eq_v) under tp 2 and
    pp 2, its MLP-beside-MoE layer over ep 2 and tp 2; Gemma-3's multimodal wrapper under tp 2 (its stage read the
    wrapper config's missing layer count); dots1's shared and routed experts over ep 2; Mamba-1's conv and scan state
    cached per rank's inner channels under tp 2; Llama-4's chunked layers (4-token chunks, 14 tokens) over pp 2."""
    import copy

    import torch

    import autoshard
    from tests.runtime.equivalence import Tiny

    windowed = copy.deepcopy(DENSE["gemma2"].config)
    windowed.num_hidden_layers, windowed.sliding_window = 4, 3
    windowed.layer_types = ["sliding_attention", "full_attention"] * 2
    ids = torch.randint(3, 200, (2, 6), generator=torch.Generator().manual_seed(0))
    for source, plan in ((DENSE["gemma2"], dict(tp=2)), (DENSE["granite"], dict(tp=2)), (LATENT["deepseek_v2"], dict(tp=2)),
                         (MULTI_QUERY["gemma2_mq"], dict(tp=2)),
                         (DENSE["granite"], dict(pp=2)), (Tiny("gemma2-4-window3", windowed), dict(pp=2)),
                         (MOE["gpt_oss"], dict(ep=2)), (GEMMA4["gemma4_k_eq_v"], dict(tp=2)),
                         (GEMMA4["gemma4_k_eq_v"], dict(pp=2)), (GEMMA4["gemma4_moe"], dict(ep=2)), (GEMMA4["gemma4_moe"], dict(tp=2)),
                         (WRAPPED["gemma3_wrapper"], dict(tp=2)), (WRAPPED["gemma3_wrapper"], dict(pp=2)), (UNSET["dots1"], dict(ep=2)),
                         (SCANS["mamba"], dict(tp=2)), (MOE["llama4"], dict(pp=2)), (MOE["llama4"], dict(ep=2))):
        check_generate(source, plan, ids)


def check_generate(source, plan: dict, ids, *, new: int = 8):
    """`dm.generate` under `plan` equals HF's greedy `generate` of the same model on one process; the
    DistributedModel, for further checks."""
    import torch

    import autoshard

    ref = source.build()
    ref.generation_config.pad_token_id = 0
    want = ref.generate(ids, max_new_tokens=new, do_sample=False)
    dm = autoshard.parallelize(source.build(), ids, plan=plan, global_batch=ids.shape[0])
    got = dm.generate(ids, max_new_tokens=new)
    assert torch.equal(got, want), f"{source} {plan}: {got[:, ids.shape[1]:].tolist()} != {want[:, ids.shape[1]:].tolist()}"
    return dm
