"""Preset models: the HF configs of the paper's LLaMA and Mamba-2 sizes, the MoE models Mixtral-8x7B
and Qwen1.5-MoE-A2.7B, plus tiny debug sizes.

A preset is a `ModelSpec` (frozen numbers) that builds an unmodified HF `LlamaForCausalLM`,
`Mamba2ForCausalLM`, `MixtralForCausalLM` or `Qwen2MoeForCausalLM`.

The whole contract: docs/modules/models.md (models/presets.py).
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import replace
from typing import TYPE_CHECKING

from autoshard.errors import InvalidConfigError, UnknownNameError
from autoshard.ir import POSITIVE_INT, BlockKind, is_positive_int
from autoshard.model_spec import MAX_POSITIONS, Mixer, ModelSpec, config_violation

if TYPE_CHECKING:  # torch is imported where a model is built: planning a preset needs only its spec
    import torch
    from torch import nn


SCALING_ROPES = ("linear", "yarn", "llama3", "longrope")  # HF rope types that stretch the trained positions


def max_positions(spec: ModelSpec, config=None) -> int | None:
    """The most positions (prompt + generated tokens, or a training sequence) the model was made for: its HF
    config's max_position_embeddings (`config`; a preset's when None: `MAX_POSITIONS`), lifted by HF's rope
    scaling (`rope_parameters` / `rope_scaling` of type linear, yarn, llama3 or longrope: the original length
    times `factor` when that is more; per layer type, the tightest); None where nothing caps them: Mamba-2
    (no positions) and HF's dynamic RoPE, whose max_position_embeddings is the original length it rescales
    past (transformers.modeling_rope_utils.dynamic_rope_update)."""
    if config is None:
        return None if spec.mixer is Mixer.SSD else MAX_POSITIONS
    limit = getattr(config, "max_position_embeddings", None)
    if not is_positive_int(limit):
        return None
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(rope, dict):
        return limit
    ropes = [rope] if not rope or not all(isinstance(v, dict) or v is None for v in rope.values()) else \
        [r for r in rope.values() if r]  # per layer type (HF's nested rope_parameters)
    limits = [_rope_limit(r, limit) for r in ropes] or [limit]
    return None if any(x is None for x in limits) else min(limits)


def _rope_limit(rope: dict, limit: int) -> int | None:
    """One rope parameter dict's position limit, given max_position_embeddings `limit` (see max_positions)."""
    rope_type = str(rope.get("rope_type", rope.get("type", "")))
    if "dynamic" in rope_type:
        return None
    factor = rope.get("factor")
    if rope_type not in SCALING_ROPES or not isinstance(factor, (int, float)) or factor <= 1:
        return limit
    original = rope.get("original_max_position_embeddings") or limit
    return max(limit, int(original * factor))


def position_violation(limit: int | None, *, prompt: int, new: int = 0, where: str = "generate") -> str | None:
    """Why a prompt of `prompt` tokens cannot grow by `new` tokens under `limit` (`max_positions`), or
    None; with `new` 0, why a training sequence of `prompt` tokens cannot run. The one position rule of
    every entry point: HF's `generate` only warns past max_position_embeddings ("friendly reminder") and
    goes on with positions the model never saw, and its training forward says nothing at all; `dm.generate`,
    the inference planner, `plan`, `sweep`, `parallelize` and `train_step` refuse (`where` names which)."""
    if limit is None or prompt + new <= limit:
        return None
    if new == 0:
        return (f"{where}: a sequence of {prompt} tokens needs {prompt} positions, more than the model's "
                f"{limit} (max_position_embeddings, with its rope scaling); train on sequences of at most {limit} "
                "tokens, or give the config a rope scaling that lifts the limit (rope_parameters: yarn, linear)")
    if prompt >= limit:
        return (f"{where}: the prompt has {prompt} tokens, and the model's max_position_embeddings is {limit}, so no "
                f"new token fits; shorten the prompt to fewer than {limit} tokens")
    return (f"{where}: the prompt's {prompt} tokens + {new} new tokens = {prompt + new} positions, more than the "
            f"model's max_position_embeddings ({limit}); ask for at most {limit - prompt} new tokens or shorten the "
            "prompt")


def moe_layout(shared_ffn: int) -> tuple[str, ...]:
    """`ModelSpec.moe_paths` of the MoE presets' HF classes (what models/facts.py reads off their module trees,
    tests/models/test_presets.py checks): Mixtral's router and experts, and Qwen2-MoE's shared expert (its
    three linears and its one-output gate) where a shared expert has a width."""
    routed = ("mlp.gate", "mlp.experts")
    if not shared_ffn:
        return (*routed, "")
    shared = "mlp.shared_expert"
    return (*routed, shared, *(f"{shared}.{n}" for n in ("gate_proj", "up_proj", "down_proj")), "mlp.shared_expert_gate")


def _moe(name, vocab, hidden, layers, heads, kv_heads, experts, top_k, ffn, shared_ffn=0) -> ModelSpec:
    return ModelSpec(name=name, mixer=Mixer.ATTENTION, vocab=vocab, hidden=hidden, ffn=ffn, layers=layers,
                     heads=heads, kv_heads=kv_heads, tied=False, experts=experts, top_k=top_k,
                     shared_ffn=shared_ffn, moe_paths=moe_layout(shared_ffn))


def _llama(name, vocab, hidden, ffn, layers, heads, kv_heads, tied=False) -> ModelSpec:
    return ModelSpec(name=name, mixer=Mixer.ATTENTION, vocab=vocab, hidden=hidden, ffn=ffn, layers=layers,
                     heads=heads, kv_heads=kv_heads, tied=tied)


def _mamba2(name, vocab, hidden, layers, heads, groups, tied, state=128, head_dim=64, chunk=256) -> ModelSpec:
    return ModelSpec(name=name, mixer=Mixer.SSD, vocab=vocab, hidden=hidden, layers=layers, state=state,
                     expand=2, head_dim=head_dim, heads=heads, groups=groups, conv=4, chunk=chunk, tied=tied)


PRESETS: dict[str, ModelSpec] = {
    s.name: s
    for s in (
        _llama("llama-1b", 32000, 2048, 5632, 22, 32, 4),
        _llama("llama-7b", 32000, 4096, 11008, 32, 32, 32),
        _llama("llama-13b", 32000, 5120, 13824, 40, 40, 40),
        _llama("llama-70b", 128256, 8192, 28672, 80, 64, 8),
        _llama("llama-tiny", 256, 64, 176, 4, 4, 2),
        _mamba2("mamba2-1b", 50288, 2048, 48, 64, 1, tied=True),
        _mamba2("mamba2-7b", 32768, 4096, 64, 128, 8, tied=False),
        _mamba2("mamba2-tiny", 256, 64, 4, 8, 2, tied=False, state=16, head_dim=16, chunk=16),
        # Mixtral-8x7B (arXiv 2401.04088 table 1); Qwen1.5-MoE-A2.7B (its HF config.json)
        _moe("mixtral-8x7b", 32000, 4096, 32, 32, 8, experts=8, top_k=2, ffn=14336),
        _moe("qwen2-moe", 151936, 2048, 24, 16, 16, experts=60, top_k=4, ffn=1408, shared_ffn=5632),
        _moe("mixtral-tiny", 256, 64, 4, 4, 2, experts=4, top_k=2, ffn=96),
        _moe("qwen2-moe-tiny", 256, 64, 4, 4, 4, experts=8, top_k=4, ffn=32, shared_ffn=128),
    )
}


def preset_names() -> tuple[str, ...]:
    return tuple(PRESETS)


def get_spec(name: str, *, layers: int | None = None) -> ModelSpec:
    """The preset called `name`, optionally with another layer count."""
    try:
        spec = PRESETS[name]
    except KeyError:
        raise UnknownNameError(
            f"unknown model preset {name!r} (known presets: {', '.join(PRESETS)}); for any other Hugging Face "
            "decoder pass --model package.module:factory, a function of no arguments returning the model, e.g. "
            "`def factory(): return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(...))` built from "
            "its HF config (docs/decoders.md)"
        ) from None
    if layers is not None:
        POSITIVE_INT.check("layers", layers)
        spec = replace(spec, layers=layers)
    return spec


def build_model(spec: ModelSpec, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                seed: int | None = 0) -> nn.Module:
    """An unmodified HF model for `spec` with random weights (`dtype` None: float32); `device="meta"`
    allocates none."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = torch.float32 if dtype is None else dtype

    if seed is not None and str(device) != "meta":
        torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(spec.hf_config(), dtype=dtype)
    return model


def spec_from_hf_config(config, *, name: str, model: nn.Module | None = None) -> ModelSpec:
    """Read a `ModelSpec` off any HF decoder's config and module tree (`model`; None: built from the
    config on the meta device), by facts, not by model type (models/facts.py); InvalidConfigError for a
    config HF builds but whose forward fails (`config_violation`) or a model with no sequence mixer
    autoshard knows. What an axis cannot run yet is in `spec.refused`, named per axis."""
    from autoshard.models.facts import per_layer_refusal

    if model is None:
        model = _meta_model(config, name=name)
    why = per_layer_refusal(config, model)
    if why:
        raise InvalidConfigError(f"{name}: {why}")
    spec = _spec_of(config, model, name=name)
    why = config_violation(spec)
    if why:
        raise InvalidConfigError(f"{name}: {why}")
    return spec


def _meta_model(config, *, name: str):
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    except Exception as e:  # a config transformers maps to no causal LM
        raise InvalidConfigError(f"{name}: transformers builds no causal LM from this config "
                                 f"({type(e).__name__}: {e}); pass the model itself") from None


def _spec_of(config, model, *, name: str) -> ModelSpec:
    from autoshard.models import facts as F

    facts = F.read_facts(config, model)
    both_ways = F.bidirectional_attention(model) or F.own_loss(model)
    if both_ways:
        raise InvalidConfigError(f"{name}: {both_ways}")
    tied = bool(getattr(config, "tie_word_embeddings", False))
    value = functools.partial(F.config_value, config)
    common = dict(name=name, vocab=value("vocab"), hidden=value("hidden"), layers=value("layers"), tied=tied)
    if facts.mixer == "ssd":
        from autoshard.models.layered import layered_spec

        layered = layered_spec(model, name=name)  # Mamba-2 layers with an MLP or experts (an all-Mamba Bamba)
        if layered is not None:
            return layered
        return ModelSpec(mixer=Mixer.SSD, state=value("state"), expand=value("expand", 2),
                         head_dim=value("head_dim"), heads=value("heads"), groups=value("groups", 1),
                         conv=value("conv"), chunk=value("chunk", 256), **common)
    from autoshard.models.layered import hybrid_refusals, layer_parts
    from autoshard.passes.capture.layer_kinds import find_layer_stack

    stack = find_layer_stack(model)  # walked once, passed on
    own = F.own_attention(model) if facts.mixer != "attention" else None  # first: such a module is no unknown mixer
    if facts.mixer != "attention" and not own:
        from autoshard.models.layered import _mixer_without_cp, layered_spec

        layered = layered_spec(model, name=name)  # Mamba-1's selective scans (Mamba, Falcon-Mamba): by their rules
        if layered is not None:
            return layered
        refused = hybrid_refusals(model, stack)
        if refused:  # a uniform stack of a mixer with no rule: the model's own forward, dp and pp only
            return ModelSpec(mixer=Mixer.ATTENTION, ffn=value("ffn", 0) or 0, own_forward=True, refused=refused,
                             **common)
        mixer = (_mixer_without_cp(model, stack) if stack is not None else None) or type(model).__name__
        raise InvalidConfigError(
            f"{name}: {mixer}: a sequence mixer autoshard has no rule for (neither a module calling HF's attention "
            "interface nor the Mamba-2 SSD scan), so no axis can be priced or run for it; autoshard plans decoders "
            "whose layers mix tokens by attention or SSD (mixed stacks may hold other mixers: dp and pp)")
    if own:  # attention in the layer's own forward (Falcon, BLOOM, MPT, XGLM, GPT-Neo): its stages run that forward,
        facts = replace(facts, attention_path=F.own_attention_path(model), own_forward=True, sliding_window=0,
                        window_layers=0)
    parts = layer_parts(model, stack) if stack is not None and not own else None  # read once (states measured)
    hybrid = hybrid_refusals(model, stack, parts) if not own else None  # None: one repeated kind of attention layer
    if hybrid is None:
        try:
            _check_layers_alike(model, facts, name=name)
        except InvalidConfigError as e:  # (GPT-NeoX-Japanese's last layer): its own forward under dp and pp only
            if not own:
                raise
            return ModelSpec(mixer=Mixer.ATTENTION, ffn=value("ffn", 0) or 0, own_forward=True, **common, refused=(
                ("tp", f"{own}: {str(e).partition(': ')[2]}"), *_own_attention_refusals(own, model),
                *_placing_refusals(model)))
    heads = value("heads")
    missing = [f"{key} ({' / '.join(F.ALIASES[key])})" for key, v in (("hidden", common["hidden"]), ("heads", heads))
               if not is_positive_int(v)]
    if missing:  # BLT: its sizes live in the sub-configs of its encoder, global transformer and decoder
        raise InvalidConfigError(
            f"{name}: {type(model).__name__}'s config has no {' and no '.join(missing)} of its own; autoshard reads "
            "a decoder's widths off its top-level config, so it cannot plan a model whose sizes live only in "
            "sub-configs")
    usual = common["hidden"] // heads
    head_dim = value("head_dim", usual) or usual
    kv_heads = _kv_heads(model, facts, value("kv_heads", heads)) if own else value("kv_heads", heads)
    spec = ModelSpec(mixer=Mixer.ATTENTION, heads=heads, kv_heads=kv_heads,
                     head_dim=0 if head_dim == usual else head_dim, ffn=_ffn(model, facts, value("ffn", 0), hybrid),
                     embedding_plain=facts.embedding_plain, own_forward=facts.own_forward or hybrid is not None,
                     head_params=facts.head_params, attention_attrs=facts.attention_attrs, transposed=facts.transposed,
                     attention_path=facts.attention_path or "self_attn",
                     sliding_window=facts.sliding_window, window_layers=facts.window_layers, **common)
    stack_paths = F.stack_paths(model)
    if stack_paths not in (None, _LLAMA_STACK):  # the table's roles at the model's own paths (GPT-NeoX's embed_in, ...)
        spec = replace(spec, stack=stack_paths)
    from autoshard.models.layered import kv_latent, stack_experts, with_experts

    if facts.experts_path:
        spec = with_experts(spec, config, (facts.experts_path, facts.router_path, facts.shared_path, facts.shared_parts),
                            model.get_submodule(facts.layers_path)[0])
    spec = replace(spec, **kv_latent(model, config))  # MLA's compressed KV cache (DeepSeek)
    if hybrid is not None:  # Mamba-2 mixers beside attention (Falcon-H1): their state, priced in serving; its
        from autoshard.models.layered import beside_facts  # table from its layers' parts, its experts

        spec = replace(spec, **beside_facts(model, config, Mixer.ATTENTION))
        if not spec.is_moe:  # those of its MoE layers (models/layered.py)
            spec = stack_experts(spec, model, stack, config)
        spec = replace(spec, parts=parts[0])
    # the table proven on the model's own graph (a hybrid refuses tp by its own rule: nothing to prove)
    # where HF declares no tp plan, the Megatron pairs found on the graph (passes/capture/tp_proposal.py) are the table
    # where HF's declared plan gathers (colwise_gather_output / rowwise_split_input), the declared layout is the table
    # (of a MoE model: its plan outside the MoE block, which keeps its own roles, `sharding._moe_block`)
    block = facts.experts_path.rpartition(".")[0]
    outside = tuple((p, s) for p, s in facts.tp_plan if not (block and p.startswith(f"layers.*.{block}.")))
    # HF's declared plan is the layout, proven on the graph, where it gathers or where it splits layer linears LLaMA's
    # table has no role for (Phi's dense, fc1 / fc2)
    as_declared = any(s in F.GATHERED_STYLES for _, s in outside) or bool(outside and _foreign(spec, outside))
    pairs, proof, untraced = _tp_proof(spec, model, propose=not (any(".*." in p for p, _ in facts.tp_plan) or spec.is_moe),
                                       declared=outside if as_declared else ()) if hybrid is None else ((), None, None)
    spec = replace(spec, tp_pairs=pairs)
    if not spec.parts:  # the layer's residual-stream norms, where they are not the table's (LLaMA's two)
        from autoshard.rules.sharding import moe_block_paths, table

        held = {r.path for r in table(spec) if r.block is BlockKind.LAYER and r.sequence} - moe_block_paths(spec)
        if facts.residual_norms and set(facts.residual_norms) != held:
            spec = replace(spec, sequence_norms=facts.residual_norms)
    if proof is not None:
        spec = replace(spec, grad_sum=proof.grad_sums, grad_sum_numel=proof.summed_numel)
    from autoshard.models.verdicts import failed_axes

    spec = _with_beside(spec, facts, model)
    found = _refusals(spec, facts, proof.refusal() if proof is not None else untraced, model)
    if own:  # its own refusals (sequence parallelism, cp, serving) over the one-kind rules'
        mine = _own_attention_refusals(own, model)
        found = mine + tuple(r for r in found if r[0] not in {a for a, _ in mine})
    if hybrid is not None:  # a hybrid's own refusals replace the one-kind rules' (models/layered.py)
        found = hybrid + tuple(r for r in found if r[0] not in {a for a, _ in hybrid})
    verified = tuple(v for v in failed_axes(type(model)) if v[0] not in {a for a, _ in found})
    return replace(spec, refused=found + verified)


def _ffn(model, facts, declared: int, hybrid) -> int:
    """The MLP width of the spec: read off the layer where a dense uniform stack's config misstates it
    (`facts.mlp_width`); a MoE or mixed stack's layer 0 holds no dense MLP to read: the config's."""
    from autoshard.models import facts as F

    if hybrid is None and not facts.experts_path:
        return F.mlp_width(model, facts, declared)
    return declared or F.mlp_width(model, facts)


def _own_attention_refusals(own: str, model) -> tuple[tuple[str, str], ...]:
    """An attention computed in the layer's own forward (`facts.own_attention`: Falcon, MPT, BLOOM, XGLM): run by
    the model's own forward under dp (any ZeRO), pp and tp (the attention whole on every rank, its projections in
    HF's gathered styles: passes/capture/tp_proposal.py), priced by the ops its graph runs; sequence parallelism
    and cp refused naming the module (no CP attention swaps in), serving too (its KV cache is read off the attention
    interface's calls)."""
    out = [("sequence_parallel", f"{own}: sequence parallelism is not run around it; set sequence_parallel to "
                                 "false"),
           ("cp", f"{own}: no context-parallel attention swaps in for it; use cp=1"),
           ("inference", f"{own}: serving prices the KV cache of attention called through that interface; plan "
                         "its training")]
    return tuple(out)


def _with_beside(spec: ModelSpec, facts, model) -> ModelSpec:
    """`spec` with what its base holds beside the layers read off its graph now (the runtime's model may not trace:
    under cp its attention is autoshard's): the modules outside it its forward never runs (`idle_modules`), the
    modules its forward runs after the layers (`after_layers`), and, where
    the base keeps no positions or mask of its own, how each runs under sequence parallelism (`beside`)."""
    from autoshard.models.beside import after_layers, idle_modules, sequence_beside
    from autoshard.models.facts import layer_list

    if layer_list(model) is None:
        return spec
    spec = replace(spec, idle_modules=idle_modules(model))
    if not spec.own_forward:
        return spec
    after = after_layers(model)
    beside = sequence_beside(model, after) if not facts.plain_stack and not facts.own_positions else ()
    return replace(spec, after_layers=after, beside=beside)


def _kv_heads(model, facts, declared: int) -> int:
    """The KV heads of an attention computed in its own forward: what its module keeps (Falcon-7B's multi-query
    attention keeps 1 where its config's num_kv_heads says 71), else the config's."""
    from autoshard.models.facts import layer_list

    found = layer_list(model)
    if not facts.attention_path or found is None:
        return declared
    module = found[1][0].get_submodule(facts.attention_path)
    kept = next((getattr(module, a) for a in ("num_key_value_heads", "num_kv_heads", "kv_heads")
                 if isinstance(getattr(module, a, None), int)), None)
    return kept or declared


def model_refusals(model) -> tuple[tuple[str, str], ...]:
    """The refusals read off the model itself, whichever reading makes its spec (`_spec_of`'s, `parallelize`'s, and
    `layered.layered_spec`'s of a mixed stack, `plan`'s): an attention computed in its own forward where no module
    calls HF's attention interface or runs a Mamba-2 SSD (as `_spec_of` reads it), what its pipeline stages cannot
    place, per-layer inputs. Before, a mixed stack's reading missed them: `plan` could pick pp for ModernBERT-decoder
    (and Gemma-4's E models) and serve GPT-NeoX-Japanese (its last layer differs), which `parallelize` refuses."""
    from autoshard.models import facts as F

    own = F.own_attention(model) if not F.mixer_of(model) else None
    return (*(_own_attention_refusals(own, model) if own else ()), *_placing_refusals(model))


def _placing_refusals(model) -> tuple[tuple[str, str], ...]:
    """pp refused for what the model's pipeline stages cannot place: a module beside the layers
    (`_unplaced_refusal`), per-layer inputs (`facts.per_layer_input_refusals`). `_spec_of` reads an attention of the
    model's own itself (before its other refusals), so `_refusals` takes these alone."""
    from autoshard.models import facts as F

    return (*_unplaced_refusal(model), *F.per_layer_input_refusals(model.config))


def _unplaced_refusal(model) -> tuple[tuple[str, str], ...]:
    """pp refused where the pipeline stages of the model's own forward cannot place what its base holds beside the
    layers (`beside.beside_layers`: a module no stand-in replaces on a later stage, a parameter no stage holds), else
    nothing. A multimodal wrapper's vision tower, which its forward on token ids never runs, the first stage holds."""
    from autoshard.models import facts as F
    from autoshard.models.beside import beside_layers

    unplaced = beside_layers(model)[2] if F.layer_list(model) is not None else ""
    return (("pp", f"{unplaced}; use pp=1"),) if unplaced else ()


def _tp_proof(spec: ModelSpec, model, *, propose: bool = False, declared: tuple[tuple[str, str], ...] = ()):
    """(pairs, proof, why): the proof of `spec`'s tp strategy on `model`'s traced graph (passes/capture/tp_proof.py)
    and None, or no proof and why: the model does not trace or, `propose` (the config declares no tp plan), no
    Megatron pairing is found on its graph. `pairs`: with `propose`, the layout found (passes/capture/tp_proposal.py,
    `ModelSpec.tp_pairs`) that the proof is of; with `declared` (HF's plan, where it gathers), the layout it declares
    (`tp_proposal.declared`). Memoised per model class and config."""
    key = (type(model), model.config.to_json_string(use_diff=False), spec, propose, declared)
    if key not in _PROOFS:
        from autoshard.errors import CaptureError
        from autoshard.passes.capture.tp_proof import prove_tp, traced

        try:
            graph = traced(model)
            found = _proposed_layout(spec, model, graph) if propose else \
                _declared_layout(spec, model, graph, declared) if declared else None
            if found is not None and found.refusal is not None:
                _PROOFS[key] = (), None, (f"HF declares no tp plan for it, and on its graph {found.refusal}" if propose
                                          else found.refusal)
            else:
                pairs = found.roles if found is not None else ()
                _PROOFS[key] = pairs, prove_tp(replace(spec, tp_pairs=pairs), model, graph), None
        except CaptureError as e:
            _PROOFS[key] = (), None, (f"the model's graph does not trace, so its tp strategy cannot be proven ({e}); "
                                      "tp is not offered for this model (dp, pp, cp and ep still plan)")
    return _PROOFS[key]


def _proposed_layout(spec: ModelSpec, model, graph):
    """The Megatron pairs found on the graph (passes/capture/tp_proposal.py `propose`), a fused q/k/v among them split
    by heads as interleaved per head (Persimmon's), or as packed [q; k; v] pieces (GPT-2's c_attn) where only that
    is proven on the graph."""
    from autoshard.passes.capture.tp_proof import prove_tp
    from autoshard.passes.capture.tp_proposal import Proposal, propose

    found = propose(graph[1], _layer0(graph[0]), spec)
    fused = tuple(("packed_colwise", n) if (s, n) == ("colwise", "qkv") else (s, n) for _, s, n in found.roles)
    if found.refusal is not None or fused == tuple((s, n) for _, s, n in found.roles) or \
            prove_tp(replace(spec, tp_pairs=found.roles), model, graph).proven:
        return found
    packed = Proposal(roles=tuple((p, *f) for (p, _, _), f in zip(found.roles, fused)))
    return packed if prove_tp(replace(spec, tp_pairs=packed.roles), model, graph).proven else found


def _declared_layout(spec: ModelSpec, model, graph, declared: tuple[tuple[str, str], ...]):
    """The layout of HF's gathering plan `declared` (passes/capture/tp_proposal.py `declared`): its fused [gate; up]
    pairs packed (a Megatron pair, nothing gathered) where the graph proves them chunked, else as HF declares them."""
    from autoshard.passes.capture.tp_proof import prove_tp
    from autoshard.passes.capture.tp_proposal import declared as declared_pairs

    packed = declared_pairs(_layer0(graph[0]), spec, declared, packed=True)
    if packed.refusal is None and prove_tp(replace(spec, tp_pairs=packed.roles), model, graph).proven:
        return packed
    return declared_pairs(_layer0(graph[0]), spec, declared)


def _layer0(model):
    """Layer 0 of the traced model's repeated stack."""
    from autoshard.passes.capture.capture import find_repeated_blocks

    blocks = find_repeated_blocks(model)
    return model.get_submodule(f"{blocks[0].prefix}.0") if blocks else None


_LLAMA_STACK = ("model.layers", "model.embed_tokens", "model.norm", "lm_head")  # facts.stack_paths of a LLaMA
_PROOFS: dict = {}  # a memo, not state: the proof of a model class and config never changes


def _refusals(spec: ModelSpec, facts, unproven: str | None, model) -> tuple[tuple[str, str], ...]:
    """(axis, why) of every axis this model cannot run yet (models/facts.py); `unproven`: why the placement
    propagation cannot prove its tp strategy, or None."""
    from autoshard.models import facts as F
    from autoshard.rules import sharding

    out = []
    roles = tuple(r.path for r in sharding.table(spec) if r.block is BlockKind.LAYER)
    # a declared layer module the table holds no role for (GPT-NeoX's attention.query_key_value, GPT-J's attn.q_proj):
    # named first where the proof refuses, the reason its finding is about the table, not the model
    unmatched = next((f"HF declares {p} {s!r}, a module the sharding table holds no role for (its roles: "
                      f"{', '.join(roles[:4])}, ...)" for p, s in facts.tp_plan
                      if ".*." in p and not any(_under(p.partition(".*.")[2], r) for r in roles if r)), None) \
        if unproven else None
    experts = tuple(r.path for r in sharding.table(spec) if r.strategy is sharding.Strategy.EXPERT)
    styles = F.tp_style_refusal(facts, layered=bool(spec.parts), mla=any(p.kind == "mla" for p in spec.parts),
                                experts=experts,
                                own=tuple(p.path for p in spec.parts if p.kind in ("delta", "kda", "attention_whole")))
    why = "; on the graph: ".join(w for w in (styles, unmatched, unproven) if w)
    if why:
        out.append(("tp", why))
    if spec.is_moe and facts.experts_no_ep:
        out.append(("ep", facts.experts_no_ep))
    reader = F.mask_reader(model)
    if reader:
        out.append(("cp", reader))
    out.extend(r for r in _placing_refusals(model) if r[0] not in {a for a, _ in out})  # what stages cannot place
    why = _sequence_refusal(spec, facts)
    if why:
        out.append(("sequence_parallel", f"{why}; set sequence_parallel to false"))
    return tuple(out)


def _sequence_refusal(spec: ModelSpec, facts) -> str:
    """Why sequence parallelism cannot run this attention model's layers, or "". It runs each layer's own ops (the
    residual adds, the norms of `sequence` roles) on a tp shard of the sequence, which each region (attention, MLP)
    gathers at its input and each row-parallel linear reduce-scatters at its output: so every layer parameter needs a
    role or a region around it (DeepSeek-V3.2's indexer), every column-parallel linear a region around it, and a replicated parameter whose gradient is summed over
    tp (Qwen3's q/k norms) a region too (there it reads the gathered sequence, as without sequence parallelism). A
    module that runs whole on every rank (HF's gathered attention, `sharding.whole_modules`) gathers the sequence at
    its input and runs as without it: what it holds needs no role of its own (OLMo-2's full-width q/k norms)."""
    from autoshard.models.facts import LAYER_MASKS
    from autoshard.rules import sharding

    layer = [r for r in sharding.table(spec) if r.block is BlockKind.LAYER]
    wholes = tuple(f"{w}." for w, _ in sharding.whole_modules(spec))
    regions = tuple(f"{r.path}." for r in layer if r.strategy is sharding.Strategy.REGION) + wholes
    roles = {r.path for r in layer}
    # a parameter with no role inside a region (DeepSeek-V3.2's indexer in the latent attention) is replicated and
    # reads the gathered sequence there, as without sequence parallelism
    extra = [n for n in facts.layer_params if n.rpartition(".")[0] not in roles and not n.startswith(regions)]
    # (a lone colwise linear in the layer is its own region, OPT's fc1: it gathers the shard at its own input)
    open_cols = [r.path for r in layer if r.strategy is sharding.Strategy.COLWISE
                 and not f"{r.path}.".startswith(regions)]
    # one KV head's projections run on the gathered sequence like any split linear: their tp sum is no hindrance
    one_kv = {r.path for r in layer if sharding.one_kv_head(spec, r)}
    summed = [p for p in spec.grad_sum if p not in one_kv and not p.startswith(regions)]
    if extra:
        return f"layers.*.{extra[0]} has no sequence-parallel rule"
    if not facts.plain_stack and not spec.beside:  # (GPT-2's learned positions, OPT's projections: `beside`)
        return ("the model's own forward around its layers (positions or attention masks of its own, modules beside "
                "them that are no embedding, linear or norm, or no final norm for the sequence to leave the shard at) "
                "is not run on a sequence shard")
    masked = sorted(set(facts.layer_types) - set(LAYER_MASKS))
    if masked:  # runtime/stages.whole_sequence_mask builds the masks of facts.LAYER_MASKS
        return f"its layers of type {masked[0]!r} take a mask autoshard does not build for the whole sequence"
    if open_cols:
        return (f"layers.*.{open_cols[0]} splits its output over tp with no region around it to gather the sequence "
                "shard at its input (HF's gathered layout or a linear beside the layer's own ops)")
    if summed:
        return (f"replicated parameters with gradients summed over tp outside any region "
                f"({', '.join(f'layers.*.{p}' for p in summed)})")
    return ""


def _foreign(spec: ModelSpec, plan: tuple[tuple[str, str], ...]) -> str:
    """The first layer linear HF's declared `plan` splits (colwise / rowwise) that `spec`'s sharding table splits
    under no role of its own, or "". A declared head-indexed parameter of the attention (GPT-OSS-style sinks,
    `spec.head_params`) is the table's too: split with the heads."""
    from autoshard.rules import sharding

    split = {r.path for r in sharding.table(spec) if r.block is BlockKind.LAYER
             and r.strategy in (sharding.Strategy.COLWISE, sharding.Strategy.ROWWISE)}
    split |= {f"{spec.attention_path}.{name}" for name in spec.head_params}
    return next((p for p, s in plan if ".*." in p and s.startswith(("colwise", "rowwise"))
                 and p.partition(".*.")[2] not in split), "")


def _under(path: str, role: str) -> bool:
    """Whether the module `path` is the table's `role` or lies inside it (a declared parameter of a role's module)."""
    return path == role or path.startswith(role + ".")


def _check_layers_alike(model, facts, *, name: str) -> None:
    """Every decoder layer must hold the same parameters (one repeated block)."""
    layers = model.get_submodule(facts.layers_path) if facts.layers_path else ()
    first = {n for n, _ in layers[0].named_parameters()} if len(layers) else set()
    for i, layer in enumerate(layers):
        these = {n for n, _ in layer.named_parameters()}
        if these != first:
            odd = sorted(these ^ first)[:3]
            raise InvalidConfigError(
                f"{name}: layer {i} holds other parameters than layer 0 ({', '.join(odd)}): autoshard costs one "
                "repeated layer; use a config whose layers are all alike (e.g. every layer MoE, or none)")


def resolve_model(name_or_factory: str, *, device: str = "meta") -> tuple[ModelSpec, nn.Module]:
    """A preset name or `package.module:factory` -> (spec, model)."""
    if ":" not in name_or_factory:
        spec = get_spec(name_or_factory)
        return spec, build_model(spec, device=device)
    import torch
    from torch import nn

    module_name, _, attr = name_or_factory.partition(":")
    if not module_name or not attr:
        raise InvalidConfigError(f"model {name_or_factory!r}: expected package.module:factory with both parts "
                                 "given (e.g. mypkg.models:build), or a preset name")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except Exception as e:  # ImportError, AttributeError, or whatever the module raised on import
        raise UnknownNameError(f"cannot load model factory {name_or_factory!r}: {type(e).__name__}: {e}") from None
    if not callable(factory):
        raise InvalidConfigError(f"{name_or_factory} is a {type(factory).__name__}, not a callable returning "
                                 "an nn.Module")
    try:
        with torch.device(device):
            model = factory()
    except (Exception, SystemExit) as e:  # sys:exit raises SystemExit: a failed factory, not a finished run
        raise InvalidConfigError(f"calling the model factory {name_or_factory}() failed with "
                                 f"{type(e).__name__}: {e}; it must take no arguments and return an nn.Module "
                                 "(a HF ...ForCausalLM, e.g. AutoModelForCausalLM.from_config(config))") from None
    if not isinstance(model, nn.Module):
        raise InvalidConfigError(f"{name_or_factory} returned {type(model).__name__}, expected an nn.Module")
    config = getattr(model, "config", None)
    if config is None:
        raise InvalidConfigError(f"{name_or_factory} returned a module without a HF .config; "
                                 "autoshard reads a Hugging Face ...ForCausalLM (its config and module tree); "
                                 "return AutoModelForCausalLM.from_config(config)")
    from autoshard.models.facts import per_layer_refusal, text_config
    from autoshard.models.layered import layered_spec  # layers of several kinds (hybrids)

    config = text_config(config)
    why = per_layer_refusal(config, model)  # before any read: a per-layer value read globally raises in HF
    if why:
        raise InvalidConfigError(f"{name_or_factory}: {why}")
    layered = layered_spec(model, name=name_or_factory)
    return layered or spec_from_hf_config(config, name=name_or_factory, model=model), model
