"""A Megatron-style tensor-parallel layout found on the traced graph, for a model that declares none.

Contract: `propose(captured, layer, spec) -> Proposal`: where the config has no `base_model_tp_plan`,
the layer's column-then-row pairs as the forward graph shows them (attention q/k/v colwise -> o rowwise,
MLP up/gate colwise -> down rowwise), whatever the projections are called, by data flow between the
layer's linears; where no consistent pairing exists, why, naming the module. `tp_proof.prove_tp` then
proves the proposal like a declared plan. The whole contract: docs/modules/capture.md
(passes/capture/tp_proposal.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from autoshard.passes.capture.capture import Captured


@dataclass(frozen=True, slots=True)
class Proposal:
    """The layer's roles ((path, "colwise" | "rowwise" | "region", piece length), in graph order) or, where
    no consistent Megatron pairing exists, why (naming the module)."""

    roles: tuple[tuple[str, str, str], ...] = ()
    refusal: str | None = None


def propose(cap: Captured, layer, spec) -> Proposal:
    """The Megatron-style layout of `layer` (layer 0 of the captured model) read off `cap` (module docstring)."""
    from autoshard.models.facts import linear_widths

    if not cap.repeated:
        return Proposal(refusal="the traced graph shows no repeated layer stack to pair projections in")
    prefix = f"{cap.repeated[0].prefix}.0"
    linears = {p: w for p, m in layer.named_modules() if p and (w := linear_widths(m)) is not None}  # (in, out)
    feeders = _feeders(cap, prefix, linears)
    rowwise = [b for b in feeders if feeders[b]]
    if not rowwise:
        return Proposal(refusal=f"{prefix}: no linear of the layer feeds another (no colwise -> rowwise pair on the "
                                "graph), so there is no Megatron split to propose")
    owner: dict[str, str] = {}
    for b in rowwise:
        for a in feeders[b]:
            if a in owner:
                return Proposal(refusal=f"layers.*.{a} feeds both layers.*.{owner[a]} and layers.*.{b}: a projection "
                                        "shared by two row-parallel outputs has no Megatron pairing; tp is not "
                                        "offered for this model")
            owner[a] = b
    order = list(feeders)  # graph order of first use
    roles: list[tuple[str, str, str]] = []
    for b in rowwise:
        group = sorted(feeders[b], key=order.index)
        region = _common_parent([*group, b])
        entry = not region and len(group) == 1  # a lone colwise linear in the layer itself (OPT's, BioGPT's fc1)
        if entry:
            region = group[0]  # its own input enters the tp region; the ops up to the rowwise one run on the shard
        if not region:
            return Proposal(refusal=f"layers.*.{group[0]} -> layers.*.{b}: no module of the layer holds the pair, "
                                    "so the tp region has no input to enter at; tp is not offered for this model")
        attention = _is_attention(layer.get_submodule(region))
        own = not attention and region == spec.attention_path  # attention in its own forward (Falcon's): whole, by
        attention = attention or own  # no head count its forward views by that the rewrite could set per rank
        pieces = [(a, "colwise", _length(spec, linears[a][1], attention)) for a in group]
        pieces.append((b, "rowwise", _length(spec, linears[b][0], attention, rowwise=True)))
        odd = next((p for p in pieces if p[2] is None), None)
        gathered = _gathered_group(spec, pieces, linears) if (odd is not None or own) and attention else None
        if gathered is not None:  # (StarCoder's [q; k; v] of one KV head): HF's gathered styles, attention whole
            roles += gathered
            continue
        if own:
            return Proposal(refusal=f"layers.*.{region}: its attention is computed in its own forward, so it runs whole "
                                    "on every rank, but a width of its projections is no size of the config to gather "
                                    "it by; tp is not offered for this model")
        if odd is not None:
            width = linears[odd[0]][1 if odd[1] == "colwise" else 0]
            counts = ("heads x head_dim (or KV heads x head_dim, or one fused q/k/v)" if attention
                      else "the MLP width (intermediate_size)")
            return Proposal(refusal=f"layers.*.{odd[0]}: its {odd[1]} width {width} is not {counts} of the config, "
                                    "so no count splits it; tp is not offered for this model")
        if entry:  # the linear's own role first: the table's innermost role at its path (`sharding.role_of`)
            roles += [pieces[0], (region, "region", "ffn"), pieces[1]]
            continue
        roles.append((region, "region", "heads" if attention else "ffn"))
        roles += pieces
    return Proposal(roles=tuple(roles))


def declared(layer, spec, tp_plan: tuple[tuple[str, str], ...], *, packed: bool = False) -> Proposal:
    """HF's declared plan `tp_plan` of a model where it gathers (colwise_gather_output / rowwise_split_input) as the
    layer's roles: a gathered linear by its whole width (q, kv, qkv, ffn or gate_up, `_gathered_length`), the module
    around it whole on every rank; plain colwise / rowwise linears as Megatron pairs in their parent, a tp region
    (attention by heads, else the MLP width). Where a gathered linear sits in such a region, or a width is no size of
    the config, why. `packed`: a module outside attention holding just a gathered [gate; up] (2 x the MLP width) and
    the gathered linear it feeds runs as a Megatron pair instead, the fused linear `packed_colwise` (gate and up each
    split by the MLP width): a claim the proof must find chunked (`packed_pairs`)."""
    from torch import nn

    from autoshard.models.facts import GATHERED_STYLES

    roles: list[tuple[str, str, str]] = []
    for pattern, style in tp_plan:
        if not pattern.startswith("layers.*."):
            continue  # the embedding / LM head: the table's own vocab-parallel roles
        rel = pattern.removeprefix("layers.*.")
        module = layer.get_submodule(rel) if rel != pattern and _has(layer, rel) else None
        if not isinstance(module, nn.Linear):
            return Proposal(refusal=f"{pattern}: HF declares it {style!r}, but it names no linear of the layer")
        parent = rel.rpartition(".")[0]
        gathered = style in GATHERED_STYLES
        row = style.startswith("rowwise")
        width = module.in_features if row else module.out_features
        attention = _is_attention(layer.get_submodule(parent)) if parent else False
        length = _gathered_length(spec, width) if gathered else _length(spec, width, attention, rowwise=row)
        if length is None:
            return Proposal(refusal=f"{pattern}: its {'input' if row else 'output'} width {width} is no size of the "
                                    "config autoshard splits by; tp is not offered for this model")
        if not gathered and not parent:
            return Proposal(refusal=f"{pattern}: a {style} linear outside any module of the layer has no tp region")
        if not gathered and (parent, "region", "heads" if attention else "ffn") not in roles:
            roles.append((parent, "region", "heads" if attention else "ffn"))
        roles.append((rel, style, length))
    if packed:
        roles = list(packed_pairs(layer, roles))
    regions = [p for p, s, _ in roles if s == "region"]
    inside = next(((p, r) for p, s, _ in roles if s in GATHERED_STYLES for r in regions if p.startswith(r + ".")), None)
    if inside is not None:  # it would enter tp inside a region that entered already
        return Proposal(refusal=f"layers.*.{inside[0]}: HF declares it gathered inside layers.*.{inside[1]}, a tp region "
                                "of plain colwise / rowwise linears; tp is not offered for this model")
    return Proposal(roles=tuple(roles))


def packed_pairs(layer, roles) -> tuple[tuple[str, str, str], ...]:
    """`roles` with each module (not attention) that holds exactly a gathered gate_up linear and a gathered MLP-width
    rowwise one turned into a Megatron region: the first `packed_colwise`, the second plain rowwise."""
    out = list(roles)
    parents = dict.fromkeys(p.rpartition(".")[0] for p, _, _ in roles)  # in order: the same on every rank
    for parent in parents:
        mine = [r for r in roles if r[0].rpartition(".")[0] == parent]
        shape = sorted((s, n) for _, s, n in mine)
        if not parent or _is_attention(layer.get_submodule(parent)) or \
                shape != [("colwise_gather_output", "gate_up"), ("rowwise_split_input", "ffn")]:
            continue
        at = out.index(mine[0])
        out = [r for r in out if r not in mine]
        pair = [(p, "packed_colwise" if s == "colwise_gather_output" else "rowwise", n) for p, s, n in mine]
        out[at:at] = [(parent, "region", "ffn"), *pair]
    return tuple(out)


def _gathered_group(spec, pieces, linears) -> list[tuple[str, str, str]] | None:
    """An attention group whose fused projection no head count splits (multi-query [q; k; v] of one KV head: its
    width heads x head_dim + 2 x head_dim) as HF's gathered styles: each colwise linear `colwise_gather_output` by its
    whole width, the rowwise one `rowwise_split_input`, the attention whole on every rank (what HF declares for
    Phi-3's qkv_proj); None where a width is no size of the config."""
    out = [(a, "colwise_gather_output" if style == "colwise" else "rowwise_split_input",
            _gathered_length(spec, linears[a][1 if style == "colwise" else 0])) for a, style, _ in pieces]
    return None if any(n is None for _, _, n in out) else out


def _has(layer, path: str) -> bool:
    try:
        layer.get_submodule(path)
    except AttributeError:
        return False
    return True


def _gathered_length(spec, width: int) -> str | None:
    """The size name (rules/sharding.py) of a gathered linear's width, or None."""
    head_dim = spec.attention_head_dim
    sizes = {"q": spec.heads * head_dim, "kv": spec.kv_heads * head_dim,
             "qkv": (spec.heads + 2 * spec.kv_heads) * head_dim, "ffn": spec.ffn, "gate_up": 2 * spec.ffn}
    return next((name for name, n in sizes.items() if n and n == width), None)


def _feeders(cap: Captured, prefix: str, linears) -> dict[str, frozenset[str]]:
    """{linear path inside the layer: the linears whose output reaches its input}, in graph order of first use."""
    sources: dict[object, frozenset[str]] = {}
    out: dict[str, frozenset[str]] = {}
    for node in cap.graph_module.graph.nodes:
        site = cap.sites.get(node.name) if node.op == "call_function" else None
        if site is None or site.phase != "fwd":
            continue
        own = _linear_of(cap, node, prefix, linears)
        found = frozenset().union(*(sources.get(a, frozenset()) for a in node.all_input_nodes
                                    if own is None or _linear_of(cap, a, prefix, linears) != own))
        if own is not None:
            out[own] = out.get(own, frozenset()) | found
            if not out[own]:  # a rowwise output is whole after its all-reduce: the residual stream again
                sources[node] = frozenset({own})
        elif found:
            sources[node] = found
    return out


def _linear_of(cap: Captured, node, prefix: str, linears) -> str | None:
    site = cap.sites.get(node.name)
    if site is None or not site.module_path.startswith(prefix + "."):
        return None
    rel = site.module_path[len(prefix) + 1:]
    return next((p for p in linears if rel == p or rel.startswith(p + ".")), None)


def _common_parent(paths: list[str]) -> str:
    parts = [p.split(".")[:-1] for p in paths]
    common = []
    for names in zip(*parts):
        if len(set(names)) > 1:
            break
        common.append(names[0])
    return ".".join(common)


def _is_attention(module) -> bool:
    from autoshard.models.facts import is_attention

    return is_attention(module)


def _length(spec, width: int, attention: bool, *, rowwise: bool = False) -> str | None:
    """The piece length (a size name of rules/sharding.py) a projection of `width` splits by, or None."""
    if not attention:
        return "ffn" if spec.ffn and width == spec.ffn else None
    head_dim = spec.attention_head_dim
    q, kv = spec.heads * head_dim, spec.kv_heads * head_dim
    if width == q:
        return "q"
    if rowwise:
        return None
    if width == kv:
        return "kv"
    if width == q + 2 * kv and spec.kv_heads == spec.heads:  # interleaved per head or packed [q; k; v] (GPT-2's:
        return "qkv"  # presets._proposed_layout)
    return None
