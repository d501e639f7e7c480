"""`ModelSpec`: the numbers of a model (sizes, counts, the facts read off a user's model) that the
planner, the rules and the runtime read, and the Hugging Face config of a preset they describe.
Presets and reading a user's model live in models/; this module imports neither."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class Mixer(str, Enum):
    """The sequence mixer of a model's layers (models/facts.py `mixer_of` finds it): what every rule that
    prices or runs the token-mixing op keys on, never the model's type or class name."""

    ATTENTION = "attention"  # a module calling HF's attention interface (softmax attention, any features)
    SSD = "ssd"  # Mamba-2's state-space duality scan (the chunked selective scan)


def _fact(default):
    return field(default=default, metadata={"omit_default": True})


# layer parts whose sequence state crosses a cp rank boundary (state passing, a conv's halo): a Mamba-2 or Mamba-1
# scan, a gated DeltaNet, a short convolution (runtime/cp_mamba.py, cp_scan.py, cp_delta.py, cp_conv.py)
STATE_PASSING = ("ssd", "mamba1", "delta", "kda", "short_conv")


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerPart:
    """One sub-block of a hybrid's layers (models/layered.py `layer_parts`), what its tensor-parallel rule
    is read from: `kind` "attention" (q/k/v/o projections; "attention_whole" where full-width q/k norms keep it
    whole on every rank), "mla" (DeepSeek's latent attention), "ssd" (a
    Mamba-2 mixer), "delta" (a gated DeltaNet: Qwen3-Next, Qwen3.5, OLMo-hybrid), "kda" (one whose decay is per
    channel: Kimi-Linear, Bailing-hybrid; `params` its per-head vectors, `linears` its projections), "mlp" (gate / up / down or
    up / down), "moe" (router, experts, shared experts), or the model's "embed", "final_norm" and "lm_head" (full
    paths); `path` inside each layer of `layers` (the
    indices holding it); `sizes`: its counts by name (heads, kv_heads, q, kv, ffn, inner, groups, ..., a recurrent
    mixer's state_bytes per sequence);
    `names`: the child modules it holds (the MLP's projections; the MoE block's router, experts, shared expert
    and the shared expert's linears and the block's one-output gate, models/facts.py `_moe_modules`); `attrs`: head-count attributes its module keeps (set to this rank's under tp); `buffers`:
    buffers indexed like its in_proj's output (Falcon-H1's mup_vector)."""

    kind: str
    path: str
    layers: tuple[int, ...] = ()
    sizes: tuple[tuple[str, int], ...] = ()
    names: tuple[str, ...] = ()
    attrs: tuple[str, ...] = ()
    buffers: tuple[str, ...] = ()
    params: tuple[str, ...] = ()  # a MoE part's experts' parameters (gate_up_proj or up_proj, down_proj); an attention
    #                               part's own per-head parameters (sinks), split with its heads
    # an attention (or latent attention) part's output gates: linears of the layer's input, one output per head or per
    # head element, split by heads as q_proj (AFMoE's gate_proj, Laguna's and Bailing-hybrid's g_proj: the attention
    # output times their activation)
    gates: tuple[str, ...] = ()
    # a gated DeltaNet part's linears, (child name, "colwise" | "rowwise"): its projections of the layer's input
    # split by key heads, its output projection row-parallel (`names`: its norms, whole)
    linears: tuple[tuple[str, str], ...] = ()

    def size(self, name: str) -> int:
        return dict(self.sizes)[name]


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
    """The numbers of a model that the cost model and the runtime's divisibility rules need."""

    name: str
    mixer: Mixer  # the layers' sequence mixer (a hybrid's spec: the mixer of the kind it was read from)
    vocab: int
    hidden: int
    layers: int
    tied: bool
    # LLaMA (ffn: the MLP width; for a MoE model, each routed expert's)
    ffn: int = 0
    heads: int = 0
    kv_heads: int = 0
    # Mamba-2 (heads is the SSM head count)
    state: int = 0
    expand: int = 0
    head_dim: int = 0
    groups: int = 0
    conv: int = 0
    chunk: int = 0
    # mixture of experts (attention layers): routed experts, experts per token, and the shared expert's MLP
    # width (Qwen2-MoE; 0 for none); where the MoE block's modules sit is `moe_paths`
    experts: int = 0
    top_k: int = 0
    shared_ffn: int = 0
    # elements of one layer's routed experts as the model holds them (models/layered.py `with_experts`: GPT-OSS's
    # biases, Nemotron-H's ungated up x hidden), where that is not experts x 3 x hidden x ffn (0: it is)
    expert_numel: int = _fact(0)
    # why a serving replica cannot split each expert's GEMMs over tp (models/facts.py `experts_tp_split_refusal`:
    # GPT-OSS's biased experts, Nemotron-H's ungated ones), "" where it can
    experts_no_tp_split: str = _fact("")
    # the routed experts take every token, scaled by its router score (Llama-4's, models/facts.py `experts_scattered`):
    # HF runs every expert on every token; ep sends the routed rows alone (passes/cost/moe_cost.py `routed_share`)
    experts_scattered: bool = _fact(False)
    # facts read off a user's model (models/facts.py); at their defaults for the presets, and then left out
    # of the cache keys (passes/capture/table_cache.py), so the presets' shipped tables still match
    refused: tuple[tuple[str, str], ...] = _fact(())  # (axis, why) pairs this model cannot run yet
    grad_sum: tuple[str, ...] = _fact(())  # layer paths replicated over tp whose gradient is summed (q/k norms)
    grad_sum_numel: int = _fact(0)  # elements per layer of those parameters (their tp all-reduce, priced per step)
    head_params: tuple[str, ...] = _fact(())  # attention parameters indexed by head (sinks): split with the heads
    attention_path: str = _fact("self_attn")  # the layer's module calling HF's attention interface (models/facts.py)
    attention_attrs: tuple[str, ...] = _fact(())  # the attention module's head-count attributes (num_heads, ...)
    transposed: tuple[str, ...] = _fact(())  # a layer's linears storing their weight [input, output] (GPT-2's Conv1D)
    embedding_plain: bool = _fact(True)  # a plain nn.Embedding (else: no vocab-parallel embedding is offered)
    own_forward: bool = _fact(False)  # pipeline stages run the model's own forward (models/facts.py)
    # the base's children its forward runs after the layers (models/beside.py), None where not read (the runtime reads)
    after_layers: tuple[str, ...] | None = _fact(None)
    # what the base holds beside the layers under sequence parallelism (models/beside.py `sequence_beside`): (full path,
    # "split": a position table whose output is cut to the shard | "before" / "after": a per-token module on the shard)
    beside: tuple[tuple[str, str], ...] = _fact(())
    # modules outside the base its forward never runs on token ids (models/beside.py `idle_modules`: a multimodal
    # wrapper's vision tower and projector), full paths: the first pipeline stage holds them
    idle_modules: tuple[str, ...] = _fact(())
    # attention features read at HF's attention-interface call (models/facts.py): the window of the layers
    # that attend within one (sliding_window tokens; Mistral all layers, Gemma-2/3 and GPT-OSS alternate ones)
    sliding_window: int = _fact(0)
    window_layers: int = _fact(0)  # how many of the layers attend within sliding_window
    tp_pairs: tuple[tuple[str, str, str], ...] = _fact(())  # a model declaring no tp plan: the layer's Megatron
    #   pairs found on its graph, (path, "region" | "colwise" | "rowwise", piece length) (passes/capture/tp_proposal.py)
    # the MoE layout, read off the module tree (models/facts.py `_moe_modules`): (router, routed experts, shared
    # expert or "", *the shared expert's linears and the block's one-output gate), paths inside a layer
    moe_paths: tuple[str, ...] = _fact(())
    # the layer's own residual-stream norms where they are not LLaMA's two (models/facts.py `residual_norms`): the
    # table's `sequence` roles, replicated, on the sequence shard under sequence parallelism (rules/sharding.py)
    sequence_norms: tuple[str, ...] = _fact(())
    # a hybrid's second sequence mixer (models/layered.py `beside_facts`), for the KV cache / SSM state its layers
    # hold in serving: the attention layers of a stack read as SSD (Bamba, Nemotron-H: heads, kv_heads, head_dim),
    # or the Mamba-2 mixers beside attention (Falcon-H1: heads, head_dim, state, groups, conv, expand)
    attention_beside: tuple[int, ...] = _fact(())
    ssd_beside: tuple[int, ...] = _fact(())
    # a hybrid's layers by their parts (attention, Mamba-2 mixer, MLP, MoE in any mix, per layer): the sharding
    # table is built from them (rules/layer_parts.py `parts_table`) instead of one family's table
    parts: tuple[LayerPart, ...] = _fact(())
    # multi-head latent attention (DeepSeek-V2/V3, models/layered.py `kv_latent`): the elements per token one layer
    # caches, its compressed KV and the shared RoPE key (kv_lora_rank + qk_rope_head_dim), whole on every tp rank
    kv_latent: int = _fact(0)
    # (layer list, input embedding, final norm or "", LM head): the model's own module paths where they are not
    # LLaMA's (model.layers, model.embed_tokens, model.norm, lm_head), which the sharding table's roles then sit at
    # (models/facts.py `stack_paths`: GPT-NeoX's gpt_neox.layers, gpt_neox.embed_in, ..., embed_out)
    stack: tuple[str, ...] = _fact(())
    # one layer kind of a mixed stack some other kind of which passes a state under cp (passes/cost/compiled.py
    # `kind_spec` sets it): the whole stack's sequence is cut into contiguous chunks (`cp_contiguous`)
    passes_state: bool = _fact(False)

    def mixer_spec(self, mixer: Mixer, layers: tuple[int, ...] = ()) -> ModelSpec | None:
        """A spec of the numbers of this model's `mixer` layers alone (its own mixer's, or a hybrid's second
        mixer's from `attention_beside` / `ssd_beside`), or None when the model holds no such mixer the spec
        knows: what serving prices a layer's KV cache / SSM state from, by that mixer family's sharding rule
        (KV heads over tp; Mamba-2 heads and groups), whatever table the model's layers are split by. `layers`:
        those of one layer kind; where a part of `parts` is their attention, its own heads, head_dim and window
        (Gemma-4's sliding and full-attention layers differ in all three)."""
        common = dict(name=self.name, vocab=self.vocab, hidden=self.hidden, layers=self.layers, tied=self.tied)
        part = next((p for p in self.parts if p.kind == "attention" and set(p.layers) & set(layers)), None)
        if mixer is Mixer.ATTENTION and part is not None:
            sizes = dict(part.sizes)
            head_dim, window = sizes["kv"] // sizes["kv_heads"], sizes.get("window", 0)
            return ModelSpec(mixer=mixer, heads=sizes["heads"], kv_heads=sizes["kv_heads"],
                             head_dim=0 if head_dim * sizes["heads"] == self.hidden else head_dim,
                             sliding_window=window, window_layers=self.layers if window else 0, **common)
        if mixer is Mixer.ATTENTION:
            own = (self.heads, self.kv_heads, self.attention_head_dim) if mixer is self.mixer else ()
            if not (own or self.attention_beside):
                return None
            heads, kv_heads, head_dim = own or self.attention_beside
            return ModelSpec(mixer=mixer, heads=heads, kv_heads=kv_heads,
                             head_dim=0 if head_dim * heads == self.hidden else head_dim, kv_latent=self.kv_latent,
                             sliding_window=self.sliding_window, window_layers=self.window_layers, **common)
        own = (self.heads, self.head_dim, self.state, self.groups, self.conv, self.expand) if mixer is self.mixer else ()
        if not (own or self.ssd_beside):
            return None
        heads, head_dim, state, groups, conv, expand = own or self.ssd_beside
        return ModelSpec(mixer=mixer, heads=heads, head_dim=head_dim, state=state, groups=groups, conv=conv,
                         expand=expand, chunk=self.chunk, **common)

    def attended_tokens(self, tokens: float) -> float:
        """The keys one query attends to (and one layer's KV cache holds) at `tokens` of context, the mean
        over the layers: min(tokens, sliding_window) in a windowed layer, all of them elsewhere."""
        if not (self.sliding_window and self.window_layers):
            return tokens
        windowed = min(tokens, self.sliding_window)
        return ((self.layers - self.window_layers) * tokens + self.window_layers * windowed) / self.layers

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def expert_params(self) -> int:
        """Parameters of the routed experts of ONE layer (gate, up and down of each expert, and any biases)."""
        return self.expert_numel or self.experts * 3 * self.hidden * self.ffn

    @property
    def attention_head_dim(self) -> int:
        """Attention layers: one attention head's width, HF's head_dim (hidden / heads unless the config sets
        another, e.g. Gemma-style head_dim=256 at hidden 3072: q_proj then has heads x head_dim rows)."""
        return self.head_dim or self.hidden // self.heads

    @property
    def cp_contiguous(self) -> bool:
        """Whether cp cuts the sequence into contiguous chunks, not balanced ones: a layer passes a state or a conv's
        last tokens from rank to rank (a Mamba-2 or Mamba-1 scan, a gated DeltaNet, a short convolution), in this
        spec's layers or another kind's of its stack (runtime/context_parallel.py `layout_of` reads the modules)."""
        return self.mixer is Mixer.SSD or self.passes_state or any(p.kind in STATE_PASSING for p in self.parts)

    @property
    def cp_halo(self) -> int:
        """The most tokens a causal conv of the layers reads of the rank before it under cp (its kernel - 1)."""
        kernels = [self.conv, *(p.size("conv") for p in self.parts if p.kind in STATE_PASSING)]
        return max(max(kernels) - 1, 0)

    @property
    def intermediate(self) -> int:
        """The SSD mixer's inner width (expand * hidden); for attention layers, the MLP's width."""
        return self.expand * self.hidden if self.mixer is Mixer.SSD else self.ffn

    def hf_config(self):
        """The Hugging Face config this spec describes."""
        if self.is_moe:
            return _moe_config(self)
        if self.mixer is Mixer.ATTENTION:
            from transformers import LlamaConfig

            return LlamaConfig(
                vocab_size=self.vocab,
                hidden_size=self.hidden,
                intermediate_size=self.ffn,
                num_hidden_layers=self.layers,
                num_attention_heads=self.heads,
                num_key_value_heads=self.kv_heads,
                **({"head_dim": self.head_dim} if self.head_dim else {}),  # absent: hidden / heads
                tie_word_embeddings=self.tied,
                max_position_embeddings=MAX_POSITIONS,
                attn_implementation="sdpa",
            )
        from transformers import Mamba2Config

        return Mamba2Config(
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            num_hidden_layers=self.layers,
            state_size=self.state,
            expand=self.expand,
            head_dim=self.head_dim,
            num_heads=self.heads,
            n_groups=self.groups,
            conv_kernel=self.conv,
            chunk_size=self.chunk,
            tie_word_embeddings=self.tied,
        )


MAX_POSITIONS = 2 * 65536  # the presets' max_position_embeddings (LLaMA family): 128k-token sequences
EXPERTS_IMPLEMENTATION = "grouped_mm"  # fixed shapes: traces on fake tensors (docs/modules/models.md, presets.py)


def _moe_config(spec: ModelSpec):
    common = dict(vocab_size=spec.vocab, hidden_size=spec.hidden, num_hidden_layers=spec.layers,
                  num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
                  num_experts_per_tok=spec.top_k, tie_word_embeddings=spec.tied,
                  max_position_embeddings=MAX_POSITIONS, attn_implementation="sdpa",
                  experts_implementation=EXPERTS_IMPLEMENTATION,
                  **({"head_dim": spec.head_dim} if spec.head_dim else {}))  # absent: hidden / heads
    if not spec.shared_ffn:  # routed experts alone (Mixtral's layout); else a shared expert beside them (Qwen2-MoE's)
        from transformers import MixtralConfig

        return MixtralConfig(intermediate_size=spec.ffn, num_local_experts=spec.experts, sliding_window=None,
                             **common)
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig(moe_intermediate_size=spec.ffn, intermediate_size=spec.shared_ffn,
                          shared_expert_intermediate_size=spec.shared_ffn, num_experts=spec.experts,
                          decoder_sparse_step=1, mlp_only_layers=[], use_sliding_window=False, **common)


def config_violation(spec: ModelSpec) -> str | None:
    """Why a model of `spec` cannot run its own forward, or None: counts HF's constructors accept and
    its forward then fails on with a shape error deep inside (reported as a trace failure before)."""
    if spec.mixer is Mixer.ATTENTION and spec.kv_heads and spec.heads % spec.kv_heads:
        return (f"num_attention_heads ({spec.heads}) is not a multiple of num_key_value_heads ({spec.kv_heads}): "
                "grouped-query attention shares each KV head among an equal number of query heads; use a "
                f"num_key_value_heads that divides {spec.heads}")
    if spec.mixer is Mixer.SSD and spec.heads % spec.groups:
        return (f"num_heads ({spec.heads}) is not a multiple of n_groups ({spec.groups}): each group's B and C "
                f"serve an equal number of heads; use an n_groups that divides {spec.heads}")
    if spec.is_moe and not 0 < spec.top_k <= spec.experts:
        return (f"num_experts_per_tok ({spec.top_k}) must be between 1 and the number of experts ({spec.experts})")
    return None
