"""A hybrid's sharding table, read from its layers' parts: each part (attention, latent attention, a Mamba-2 or
Mamba-1 mixer, a gated DeltaNet, an MLP, a MoE block, a norm) by its own rule, on the layers holding it.

`parts_table(spec)` -> the roles of `rules/sharding.py`'s table for a spec with `ModelSpec.parts` (models/layered.py
`layer_parts`); `sharding.table` reads it. The rules: docs/decoders.md (Hybrids), docs/modules/rules.md.
"""

from __future__ import annotations

from dataclasses import replace

from autoshard.model_spec import ModelSpec
from autoshard.rules.sharding import (LLAMA, MAMBA2, Piece, Role, Strategy, _E, _H, _L, _LINEAR, _moe_roles)


def parts_table(spec: ModelSpec) -> tuple[Role, ...]:
    """A hybrid's table from its layers' parts (`ModelSpec.parts`, models/layered.py `layer_parts`), each by its own
    rule on the layers that hold it, its sizes named "<part index>.<size>"; the rules: docs/decoders.md (Hybrids)."""
    out: list[Role] = []
    for i, part in enumerate(spec.parts):
        n, at, lay = (lambda name, i=i: f"{i}.{name}"), (lambda p, part=part: f"{part.path}.{p}".lstrip(".")), part.layers
        if part.kind in ("embed", "lm_head"):  # LLaMA's embedding / LM head and loss roles at the part's path
            out += [replace(r, path=r.path and part.path) for r in LLAMA if r.strategy is Strategy.VOCAB
                    and r.block is (_E if part.kind == "embed" else _H)]
        elif part.kind == "final_norm":  # per token: on the sequence shard under sequence parallelism
            out.append(Role(part.path, _H, Strategy.REPLICATE, sequence=True))
        elif part.kind == "attention":  # its output gates by heads; per-head q/k norms whole, gradient summed
            widths = {"o_proj": (Piece(n("o"), n("heads")),), "v_proj": (Piece(n("v"), n("kv_heads"), share=True),)}
            output = next((c for c, how in part.linears if how == "rowwise"), "o_proj")  # its own name (out_proj)
            out += tuple(replace(r, pieces=widths[r.path.rpartition(".")[2]], path=r.path.replace(".o_proj", f".{output}"))
                         if r.path.rpartition(".")[2] in widths
                         else replace(r, params=part.params) if r.strategy is Strategy.REGION  # its sinks, by head
                         else r for r in _at_part(LLAMA, "self_attn", i, part)
                         if not r.path.endswith(".v_proj") or dict(part.sizes)["v"]) + tuple(
                Role(at(g), _L, Strategy.COLWISE, (Piece(n(g), n("heads")),), _LINEAR, fan="hidden", layers=lay)
                for g in part.gates) + tuple(
                Role(at(p), _L, Strategy.REPLICATE, (Piece(n(p), "one"),), _LINEAR, grad_sum=True, layers=lay)
                for p in part.names)
        elif part.kind == "attention_whole":  # whole on every rank: q / k / v gathered, o_proj's input sliced
            out += [Role(at(p), _L, Strategy.ROWWISE if p == "o_proj" else Strategy.COLWISE, (Piece(n(w), n(w)),),
                         ("weight",) if p == "o_proj" else _LINEAR, fan="hidden", gathered=True, layers=lay)
                    for p, w in (("q_proj", "q"), ("k_proj", "kv"), ("v_proj", "v"), ("o_proj", "o"))]
            out += [Role(at(p), _L, Strategy.REPLICATE, (Piece(n(p), "one"),), _LINEAR, layers=lay) for p in part.names]
        elif part.kind == "mla":
            q = "q_b_proj" if "q_a_proj" in part.names else "q_proj"
            out += [Role(part.path, _L, Strategy.REGION, (Piece(n("heads"), n("heads")),), params=(), layers=lay),
                    Role(at(q), _L, Strategy.COLWISE, (Piece(n("q"), n("heads")),), _LINEAR,
                         fan=n("q_rank") if q == "q_b_proj" else "hidden", layers=lay),
                    Role(at("kv_b_proj"), _L, Strategy.COLWISE, (Piece(n("kv_b"), n("heads")),), _LINEAR,
                         fan=n("kv_rank"), layers=lay),
                    Role(at("o_proj"), _L, Strategy.ROWWISE, (Piece(n("o"), n("heads")),), fan="hidden", layers=lay),
                    *(Role(at(p), _L, Strategy.REPLICATE, (Piece(n(p), "one"),), _LINEAR, grad_sum=True, layers=lay)
                      for p in part.names),
                    *(Role(at(g), _L, Strategy.COLWISE, (Piece(n(g), n("heads")),), _LINEAR, fan="hidden", layers=lay)
                      for g in part.gates)]  # an output gate per head (Bailing-hybrid's g_proj)
        elif part.kind == "ssd":
            out += _at_part(MAMBA2, "mixer", i, part)
        elif part.kind == "mamba1":  # Mamba-1's selective scan by its inner channels (vLLM's MambaMixer split)
            inner = Piece(n("inner"), n("inner"))
            out += [Role(part.path, _L, Strategy.REGION, (inner,), ("A_log", "D"), layers=lay),
                    Role(at("in_proj"), _L, Strategy.COLWISE, (inner, inner), _LINEAR, fan="hidden", layers=lay),
                    Role(at("conv1d"), _L, Strategy.COLWISE, (inner,), _LINEAR, fan=n("conv"), layers=lay),
                    Role(at("x_proj"), _L, Strategy.ROWWISE, (inner,), fan=n("x_out"), output_region=True, layers=lay),
                    Role(at("dt_proj"), _L, Strategy.COLWISE, (inner,), _LINEAR, fan=n("dt_rank"), layers=lay),
                    Role(at("out_proj"), _L, Strategy.ROWWISE, (inner,), fan="hidden", layers=lay),
                    *(Role(at(p), _L, Strategy.REPLICATE, (Piece(n(p), "one"),), _LINEAR, grad_sum=True, layers=lay)
                      for p in part.names)]  # dt / B / C norms on the summed x_proj output: gradients partial
        elif part.kind == "delta":  # a gated DeltaNet by key heads, each key head's value heads with it
            by = n("k_heads")
            qkv = (Piece(n("key"), by), Piece(n("key"), by), Piece(n("value"), by))  # conv1d's and a fused [q; k; v]
            out += [Role(part.path, _L, Strategy.REGION, (Piece(n("v_heads"), by),), ("A_log", "dt_bias"), layers=lay),
                    Role(at("conv1d"), _L, Strategy.COLWISE, qkv, _LINEAR, fan=n("conv"), layers=lay),
                    *(Role(at(c), _L, Strategy.ROWWISE, (Piece(n("value"), by),), fan="hidden", layers=lay)
                      if how == "rowwise" else
                      Role(at(c), _L, Strategy.COLWISE, qkv if how == "qkv" else (Piece(n(c), by),), _LINEAR,
                           fan="hidden", layers=lay) for c, how in part.linears),
                    *(Role(at(p), _L, Strategy.REPLICATE, (Piece(n(p), "one"),), _LINEAR, grad_sum=True, layers=lay)
                      for p in part.names)]  # the gated norm over one value head: whole, gradient summed
        elif part.kind == "kda":  # a per-channel gated delta attention by heads (models/layered.py `_kda_part`)
            qkv = Piece(n("qkv"), n("heads"))
            holders = {}
            for v in part.params:  # the vectors of qkv_dim or num_heads elements, by heads (the forget gate's)
                holders.setdefault(v.rpartition(".")[0], []).append(v.rpartition(".")[2])
            out += [Role(part.path, _L, Strategy.REGION, (Piece(n("heads"), n("heads")),), params=(), layers=lay),
                    Role(at("conv1d"), _L, Strategy.COLWISE, (qkv, qkv, qkv), _LINEAR, fan=n("conv"), layers=lay),
                    *(Role(at(c), _L, Strategy.ROWWISE, (qkv,), fan="hidden", layers=lay) if how == "rowwise" else
                      Role(at(c), _L, Strategy.COLWISE, (Piece(n(c), n("heads")),), _LINEAR, fan=n(f"{c}.in"),
                           layers=lay) for c, how in part.linears),
                    *(Role(at(h), _L, Strategy.COLWISE, (qkv,), tuple(held), layers=lay) for h, held in holders.items()),
                    *(Role(at(p), _L, Strategy.REPLICATE, (Piece(n(p), "one"),), _LINEAR, grad_sum=True, layers=lay)
                      for p in part.names)]  # low-rank input projections and one head's norm: whole, gradient summed
        elif part.kind == "mlp":  # its input projections column-parallel, its output projection (the last) row-parallel
            ffn = Piece(n("ffn"), n("ffn"))
            packed = {c for c, how in part.linears if how == "packed"}  # a fused [gate; up]: its two halves
            out += [Role(part.path, _L, Strategy.REGION, (ffn,), params=(), layers=lay),
                    *(Role(at(p), _L, Strategy.ROWWISE if p == part.names[-1] else Strategy.COLWISE,
                           (ffn, ffn) if p in packed else (ffn,), _LINEAR, fan="hidden", layers=lay) for p in part.names)]
        elif part.kind == "short_conv":  # by channels: in_proj's [B; C; x], the depthwise conv, out_proj row-parallel
            into, conv, output = part.names
            ch = Piece(n("width"), n("width"))
            out += [Role(part.path, _L, Strategy.REGION, (ch,), params=(), layers=lay),
                    Role(at(into), _L, Strategy.COLWISE, (ch, ch, ch), _LINEAR, fan="hidden", layers=lay),
                    Role(at(conv), _L, Strategy.COLWISE, (ch,), _LINEAR, fan=n("conv"), layers=lay),
                    Role(at(output), _L, Strategy.ROWWISE, (ch,), fan="hidden", layers=lay)]
        elif part.kind == "moe":  # the shared expert's linears and the block's gate whole, counted as pieces; under
            router, experts, shared, *held = part.names  # sequence parallelism it routes this rank's shard of tokens
            out += [replace(r, sequence=True) for r in _moe_roles(at(router), at(experts), at(shared) if shared else "",
                    tuple(Role(at(p), _L, Strategy.REPLICATE, (Piece(n(p), "one"),), _LINEAR, layers=lay) for p in held),
                    params=part.params, layers=lay)]
        elif part.kind in ("norm", "other"):  # whole on every rank (its elements counted as one piece); a norm runs on
            out.append(Role(part.path, _L, Strategy.REPLICATE, (Piece(n("numel"), "one"),), layers=lay,  # the shard
                            sequence=part.kind == "norm"))
        else:
            raise ValueError(f"layer part kind {part.kind!r} has no sharding rule")
    return tuple(out)


_MODEL_SIZES = ("one", "hidden", "vocab")  # sizes of the whole model, not of one hybrid part


def _at_part(roles: tuple[Role, ...], prefix: str, i: int, part) -> tuple[Role, ...]:
    """A uniform table's roles at `prefix` and below it (LLaMA's `self_attn`, MAMBA2's `mixer`) as hybrid part `i`'s
    (`parts_table`): at its path, on its layers, each of its sizes named "<i>.<size>" (the model's hidden, vocab
    and one kept), so the rule of an attention or Mamba-2 part is the uniform table's, stated once."""
    name = lambda size: size if size in _MODEL_SIZES else f"{i}.{size}"  # noqa: E731
    return tuple(replace(r, path=part.path + r.path[len(prefix):], fan=name(r.fan), layers=part.layers,
                         pieces=tuple(replace(p, length=name(p.length), count=name(p.count)) for p in r.pieces))
                 for r in roles if r.path == prefix or r.path.startswith(prefix + "."))
