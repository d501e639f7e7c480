"""Context-parallel causal attention for HF LLaMA, registered as a HF attention function.

Contract: `install_cp_attention(model, ctx)` registers `cp_attention_forward` under the name
`ATTN_NAME` in transformers' `AttentionInterface`, points every attention module's config at
it and attaches `ctx` to each attention module. The unmodified `LlamaAttention` then calls
it with this rank's q (b, hq, 2c, d) and k, v (b, hkv, 2c, d), already rotated with this rank's
real position ids (c = S / (2 cp), balanced layout: local chunks i and 2cp-1-i).

The whole contract: docs/modules/runtime.md (runtime/cp_attention.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from autoshard.errors import InvalidConfigError
from autoshard.runtime.cp_sequence import (CPContext, SeqLayout, all_gather_autograd, gathered_order,
                                           sequence_positions)

ATTN_NAME = "autoshard_cp"
_CTX_ATTR = "autoshard_cp_context"
_LAYOUT_ATTR = "autoshard_cp_layout"
_TEMPERATURE_ATTR = "autoshard_cp_temperature"  # Llama-4 NoPE layers: queries scaled at their real positions


def cp_attention_forward(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                         attention_mask: Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                         **kwargs) -> tuple[Tensor, None]:
    """HF attention-function signature; returns ((b, 2c, hq, d) output, None)."""
    ctx: CPContext | None = getattr(module, _CTX_ATTR, None)
    if ctx is None:
        raise InvalidConfigError(f"{type(module).__name__} uses attn_implementation={ATTN_NAME!r} but has no CP "
                                 "context; call autoshard.runtime.context_parallel.enable_context_parallel(model, ctx)")
    if dropout:
        raise InvalidConfigError(f"CP attention does not implement attention dropout ({dropout}); "
                                 "set config.attention_dropout = 0")
    if attention_mask is not None:
        raise InvalidConfigError("CP attention takes no attention_mask (padding masks are not split over CP); "
                                 "mark padding with label -100 instead")
    # a sliding window: Mixtral passes its config's, a Qwen2-MoE sliding layer keeps its own on the module; a
    # window passed (even None: ExaOne-MoE's full layers, whose module holds the config's) is the layer's own
    window = kwargs["sliding_window"] if "sliding_window" in kwargs else getattr(module, "sliding_window", None)
    # the attention kwargs HF passes besides (Gemma-2's softcap, GPT-OSS's sinks as s_aux): each is applied, and
    # one this function does not know is refused rather than dropped
    softcap = kwargs.pop("softcap", None)
    sinks = kwargs.pop("s_aux", None)
    unknown = sorted(k for k, v in kwargs.items()  # flags (bools) ride along to other modules; values change scores
                     if isinstance(v, (Tensor, float)) and k not in _IGNORED_KWARGS)
    if unknown:
        raise InvalidConfigError(f"{type(module).__name__} passes the attention kwargs {unknown}, which context-"
                                 "parallel attention does not implement; run this model with cp=1")
    layout = getattr(module, _LAYOUT_ATTR, SeqLayout.BALANCED)
    if getattr(module, _TEMPERATURE_ATTR, False):
        query = _tempered(module, query, sequence_positions(query.shape[2] * ctx.size, ctx.size, ctx.rank, layout))
    return causal_attention(query, key, value, ctx, layout, scale=scaling, window=window, softcap=softcap,
                            sinks=sinks, chunk=_attention_chunk(module)), None


def _tempered(module: nn.Module, query: Tensor, positions: Tensor) -> Tensor:
    """Llama-4's attention temperature tuning on a layer without rope, at the tokens' real `positions`: each query
    scaled by log1p(floor((position + 1) / floor_scale)) x attn_scale + 1, as HF's forward scales it from positions
    it counts from 0 over the tokens it is handed (a cp rank's chunk: so `install_cp_attention` turns that off and
    this applies it here). query (b, hq, L, d)."""
    scales = torch.log1p(torch.floor((positions.to(query.device).float() + 1.0) / module.floor_scale))
    return (query * (scales * module.attn_scale + 1.0)[None, None, :, None]).to(query.dtype)


def _attention_chunk(module: nn.Module) -> int | None:
    """The chunk of a chunked-attention layer (its config's layer_types entry "chunked_attention": Llama-4's, a query
    sees the causal keys of its own attention_chunk_size tokens, HF's create_chunked_causal_mask), else None."""
    config, index = getattr(module, "config", None), getattr(module, "layer_idx", None)
    types = getattr(config, "layer_types", None) or ()
    return config.attention_chunk_size if index is not None and index < len(types) and \
        types[index] == "chunked_attention" else None


# kwargs HF's attention modules pass that do not change the result of causal attention over positions
_IGNORED_KWARGS = frozenset({"sliding_window", "position_ids", "is_causal", "cu_seq_lens_q", "cu_seq_lens_k",
                             "max_length_q", "max_length_k", "output_attentions", "use_cache", "cache_position",
                             "layer_idx", "dropout"})


def balanced_causal_attention(query: Tensor, key: Tensor, value: Tensor, ctx: CPContext, *,
                              scale: float | None = None, window: int | None = None, softcap: float | None = None,
                              sinks: Tensor | None = None) -> Tensor:
    """Causal attention of this rank's balanced-layout slice over the whole sequence; `window`: a
    sliding window (a query sees the keys less than `window` positions back, HF's sliding_window_overlay).

    query (b, hq, 2c, d), key/value (b, hkv, 2c, d) -> (b, 2c, hq, d).
    """
    return causal_attention(query, key, value, ctx, SeqLayout.BALANCED, scale=scale, window=window,
                            softcap=softcap, sinks=sinks)


def causal_attention(query: Tensor, key: Tensor, value: Tensor, ctx: CPContext, layout: SeqLayout, *,
                     scale: float | None = None, window: int | None = None, softcap: float | None = None,
                     sinks: Tensor | None = None, chunk: int | None = None) -> Tensor:
    """`balanced_causal_attention` for this rank's slice in `layout`: balanced (chunks r and 2cp-1-r of
    2cp) or contiguous (chunk r of cp); `chunk`: a query attends within its own chunk of that many positions
    (Llama-4's chunked attention). query (b, hq, L, d), key/value (b, hkv, L, d) -> (b, L, hq, d)."""
    b, hkv, local, d = key.shape
    balanced = layout is SeqLayout.BALANCED
    if balanced and local % 2:
        raise InvalidConfigError(f"CP attention got {local} local tokens; the balanced layout needs an even count")
    seq = local * ctx.size
    # one collective for both, packed along the features: the value head width may differ from the key's
    # (MiMo-V2-Flash's v_head_dim)
    kv = torch.cat([key, value], dim=3)  # (b, hkv, L, dk + dv)
    kv = all_gather_autograd(kv, ctx, dim=2)  # (b, hkv, S, dk + dv), rank order
    kv = kv.index_select(2, gathered_order(seq, ctx.size, layout).to(kv.device))  # natural order
    chunks = (ctx.rank, 2 * ctx.size - 1 - ctx.rank) if balanced else (ctx.rank,)
    return _attend_chunks(query, kv, chunks, key_dim=d, scale=scale, window=window, softcap=softcap, sinks=sinks,
                          attention_chunk=chunk)


def local_causal_attention(query: Tensor, kv: Tensor, *, rank: int, cp: int, scale: float | None = None,
                           window: int | None = None, softcap: float | None = None,
                           sinks: Tensor | None = None) -> Tensor:
    """Rank `rank`'s share of the work: its two query chunks (b, hq, 2c, d) against the key prefixes
    they can see in `kv` (b, hkv, S, 2d), K then V along the features, natural order; `window` as in
    `balanced_causal_attention`. -> (b, 2c, hq, d)."""
    return _attend_chunks(query, kv, (rank, 2 * cp - 1 - rank), key_dim=query.shape[-1], scale=scale,
                          window=window, softcap=softcap, sinks=sinks)


def _attend_chunks(query: Tensor, kv: Tensor, chunk_ids: tuple[int, ...], *, key_dim: int, scale: float | None,
                   window: int | None, softcap: float | None, sinks: Tensor | None,
                   attention_chunk: int | None = None) -> Tensor:
    """Query chunks `chunk_ids` (of equal size, held in that order in `query` (b, hq, L, d)) against the
    key prefixes they can see in `kv` (b, hkv, S, dk + dv), K (`key_dim` wide) then V along the features,
    natural order. -> (b, L, hq, dv)."""
    chunk, hkv = query.shape[2] // len(chunk_ids), kv.shape[1]
    outs = []
    for part, chunk_id in enumerate(chunk_ids):
        q = query[:, :, part * chunk:(part + 1) * chunk]  # (b, hq, c, d)
        end = (chunk_id + 1) * chunk
        k, v = kv[:, :, :end, :key_dim], kv[:, :, :end, key_dim:]  # (b, hkv, end, dk) and (b, hkv, end, dv)
        q_pos = torch.arange(chunk_id * chunk, end, device=q.device)
        k_pos = torch.arange(end, device=q.device)[None, :]
        mask = k_pos <= q_pos[:, None]  # (c, end) causal on real positions
        if window:
            mask &= k_pos > q_pos[:, None] - window
        if attention_chunk:  # Llama-4's chunked attention: keys of the query's own chunk only
            mask &= k_pos // attention_chunk == q_pos[:, None] // attention_chunk
        if softcap or sinks is not None:
            outs.append(_explicit_attention(q, k, v, mask, scale=scale, softcap=softcap, sinks=sinks))
            continue
        outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                                   enable_gqa=q.shape[1] != hkv))
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous()  # (b, L, hq, d)


def _explicit_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, *, scale: float | None,
                        softcap: float | None, sinks: Tensor | None) -> Tensor:
    """Attention with the score transforms SDPA has no argument for, as HF's eager attention applies them:
    `softcap` (Gemma-2: cap * tanh(scores / cap) before the mask) and `sinks` (GPT-OSS: one extra logit per
    head in the softmax, dropped after it). q (b, hq, c, d), k / v (b, hkv, n, d), mask (c, n) -> (b, hq, c, d)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # (b, hq, n, d)
    scores = torch.matmul(q, k.transpose(2, 3)) * (q.shape[-1] ** -0.5 if scale is None else scale)  # (b, hq, c, n)
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    if sinks is None:
        probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
    else:
        sink = sinks.reshape(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1).to(scores.dtype)
        both = torch.cat([scores, sink], dim=-1)
        both = both - both.max(dim=-1, keepdim=True).values
        probs = torch.softmax(both, dim=-1, dtype=both.dtype)[..., :-1].to(v.dtype)
    return torch.matmul(probs, v)


def install_cp_attention(model: nn.Module, ctx: CPContext, layout: SeqLayout = SeqLayout.BALANCED) -> int:
    """Register the CP attention function and switch every attention module of `model` to it, for this
    rank's slice in `layout` (contiguous: a hybrid's attention layers beside state-passing SSD mixers).

    Returns the number of attention modules switched (0 means the model had none: an error).
    """
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, cp_attention_forward)
    count = 0
    from autoshard.models.facts import is_attention

    for module in model.modules():
        if is_attention(module):
            setattr(module, _CTX_ATTR, ctx)
            setattr(module, _LAYOUT_ATTR, layout)
            module.config._attn_implementation = ATTN_NAME
            count += 1
            if getattr(module, "attn_temperature_tuning", False) and not getattr(module, "use_rope", True):
                module.attn_temperature_tuning = False  # applied at the real positions instead (`_tempered`)
                setattr(module, _TEMPERATURE_ATTR, True)
    if count == 0:
        raise InvalidConfigError(f"{type(model).__name__} has no HF attention module (config, layer_idx, scaling); "
                                 "CP attention cannot be installed")
    model.config._attn_implementation = ATTN_NAME
    for module in model.modules():
        rope_type = getattr(module, "rope_type", None)
        if isinstance(rope_type, str) and ("dynamic" in rope_type or rope_type == "longrope"):
            _rotary_over_whole_sequence(module, ctx)
    return count


def _rotary_over_whole_sequence(rotary: nn.Module, ctx: CPContext) -> None:
    """HF's dynamic and longrope RoPE rescale their frequencies from the largest position a forward sees
    (`transformers.modeling_rope_utils.dynamic_rope_update`). A CP rank sees only its chunks (rank 1 of 2:
    at most 3/4 of the sequence), so it would rotate by other frequencies than one process does (a
    silent wrong answer: 25% of the logits off at cp 2). Each forward therefore first updates the
    frequencies from the whole sequence's positions (this rank's count x cp), as one process would,
    then rotates this rank's own positions without updating again."""
    forward, plain = rotary.forward, type(rotary).forward.__wrapped__  # HF's decorated / undecorated rope

    def whole_sequence_forward(x: Tensor, position_ids: Tensor, **kwargs):
        whole = torch.arange(position_ids.shape[-1] * ctx.size, device=position_ids.device)[None]  # (1, S)
        forward(x, whole, **kwargs)  # the frequency update, as for the whole sequence
        return plain(rotary, x, position_ids, **kwargs)

    rotary.forward = whole_sequence_forward
