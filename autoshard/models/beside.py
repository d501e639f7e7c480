"""What a decoder's base model holds beside its layers, and on which side of them its forward runs it.

Contract: `beside_layers(model) -> (before, after, why)`: the base's children with parameters other than the input
embedding, the layer list and the final norm, split by where the traced forward graph first runs them (before the
layers: the first pipeline stage holds them; after: the last), or why pipeline stages of the model's own forward
cannot place them. `idle_modules(model)`: the modules outside the base its forward never runs on token ids (a
multimodal wrapper's vision tower), which the first stage holds. `stand_in_width(module)`: what a later stage runs
in place of a module it does not hold. The whole contract: docs/modules/models.md (models/beside.py).
"""

from __future__ import annotations

from autoshard.models.facts import final_norm, layer_list, linear_widths


def after_layers(model) -> tuple[str, ...]:
    """The names of the base's children `beside_layers` finds run after the layers (OPT's project_out), read off the
    traced graph: what `ModelSpec.after_layers` keeps for the runtime, whose model may not trace (under cp)."""
    before, after, why = beside_layers(model)
    base = model.get_submodule(layer_list(model)[0].rpartition(".")[0])
    return () if why else tuple(n for n, m in base.named_children() if any(m is a for a in after))


def sequence_beside(model, after: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """How each module `beside_layers` finds runs under sequence parallelism, as (full path, how): an embedding before
    the layers (GPT-2's learned positions) "split" (looked up for the whole sequence, its output cut to the rank's
    shard), a linear or per-channel norm "before" the layers (OPT's project_in) per token on the shard (its gradient
    summed over tp), one "after" them (project_out) past the final norm, where the sequence leaves the shard (the
    norm runs whole: rules/sharding.py); () where there are none, one is none of those, or there is no final norm
    (OPT-350m's) for the sequence to leave the shard at."""
    from torch import nn

    from autoshard.errors import InvalidConfigError

    before, later, why = beside_layers(model, after=after)
    path, layers = layer_list(model)
    try:
        final_norm(model.get_submodule(path.rpartition(".")[0]), layers)
    except InvalidConfigError:
        return ()
    if why:
        return ()
    paths = {id(m): n for n, m in model.named_modules()}
    out = [(paths[id(m)], "split" if isinstance(m, nn.Embedding) else "before") for m in before]
    out += [(paths[id(m)], "after") for m in later]
    per_token = all(how == "split" or stand_in_width(model.get_submodule(p)) is not False for p, how in out)
    return tuple(out) if per_token else ()


def idle_modules(model) -> tuple[str, ...]:
    """The full paths of the outermost modules holding parameters outside the base, the input embedding and the LM
    head that the model's forward on token ids never runs, read off its traced graph (a multimodal wrapper's vision
    tower and projector: Gemma-3's, GOT-OCR2's, Fuyu's vision embedding); the first pipeline stage holds them (they
    would run before the layers, on image inputs). () where there are none or the graph does not trace (then
    `beside_layers` names them as parameters no stage holds)."""
    found = layer_list(model)
    if found is None:
        return ()
    held = [found[1], model.get_input_embeddings(), model.get_output_embeddings()]
    placed = {id(p) for m in held if m is not None for p in m.parameters()}
    base = model.get_submodule(found[0].rpartition(".")[0])
    placed |= {id(p) for p in base.parameters()}  # the base's own children: `beside_layers` places them
    outer = []
    for path, module in model.named_modules():
        params = list(module.parameters())
        if path and params and not any(id(p) in placed for p in params) \
                and not any(path.startswith(f"{o}.") for o in outer):
            outer.append(path)
    if not outer:
        return ()
    return _never_run(model, tuple(outer))


def _never_run(model, paths: tuple[str, ...]) -> tuple[str, ...]:
    """Those of `paths` no forward op of the traced graph runs, () if any is run or the graph does not trace.
    Memoised per model class and config."""
    key = (type(model), model.config.to_json_string(use_diff=False), "idle", paths)
    if key not in _RUN_AFTER:
        from autoshard.errors import CaptureError
        from autoshard.passes.capture.tp_proof import traced

        try:
            cap = traced(model)[1]
        except CaptureError:
            _RUN_AFTER[key] = ()
        else:
            run = {cap.site(n).module_path for n in cap.call_nodes() if cap.site(n).phase == "fwd"}
            busy = any(m == p or m.startswith(f"{p}.") for p in paths for m in run)
            _RUN_AFTER[key] = () if busy else paths
    return _RUN_AFTER[key]


def beside_layers(model, after: tuple[str, ...] | None = None,
                  idle: tuple[str, ...] | None = None) -> tuple[list, list, str]:
    """(before, after, why): the base model's children with parameters beside the input embedding, the layers and
    the final norm, by where its forward runs them (`_run_after`): `before` the layers (GPT-2's and OPT's learned
    positions, BLOOM's embedding norm, OPT's project_in), which the first pipeline stage holds, `after` them (OPT's
    project_out, past the final norm), which the last stage holds; and why pp cannot place them, naming the first
    module no stand-in can replace on a later stage (`stand_in_width`: one neither an embedding, a linear nor a
    per-channel norm), or a parameter no stage holds (outside the base, the input embedding and the LM head: BERT's
    head transform), or "": the modules the forward never runs (`idle_modules`: a multimodal wrapper's vision tower)
    the first stage holds. `after`: the names run after the layers, known already (`ModelSpec.after_layers`), else
    read off the graph; `idle`: the idle modules' paths, known already (`ModelSpec.idle_modules`), else read."""
    from torch import nn

    from autoshard.errors import InvalidConfigError

    path, layers = layer_list(model)
    base_path = path.rpartition(".")[0]
    base = model.get_submodule(base_path)
    try:
        norm = final_norm(base, layers)
    except InvalidConfigError as e:  # none (OPT-350m's): every stage enters at a layer of its own
        norm, missing = None, str(e).removesuffix("; use pp=1")
    else:
        missing = ""
    held = {id(layers), id(model.get_input_embeddings()), id(norm)}
    found = [(n, m) for n, m in base.named_children() if id(m) not in held and any(True for _ in m.parameters())]
    # every parameter must sit where a stage holds it (BERT's head transform, Fuyu's vision projection do not)
    idle = tuple(model.get_submodule(p) for p in (idle_modules(model) if idle is None else idle))  # the first stage
    placed = {id(p) for m in (layers, model.get_input_embeddings(), model.get_output_embeddings(), norm,
                              *(m for _, m in found), *idle) if m is not None for p in m.parameters()}
    stray = next((n for n, p in model.named_parameters() if id(p) not in placed), None)
    stray_why = "" if stray is None else (f"{missing + ', and ' if norm is None else ''}{stray.rpartition('.')[0]} "
                                          f"holds parameters outside {base_path}, the input embedding and the LM "
                                          "head, which no pipeline stage holds")
    # embeddings are looked up before the layers (GPT-2's learned positions); where else the others run: the graph
    other = tuple(n for n, m in found if not isinstance(m, nn.Embedding))
    after = frozenset(after) if after is not None else _run_after(model, path, other) if other else frozenset()
    if isinstance(after, str):
        return [], [], after
    odd = next(((n, m) for n, m in found if n not in after and stand_in_width(m) is False), None)
    if odd is not None:
        return [], [], (f"{base_path}.{odd[0]} ({type(odd[1]).__name__}) holds parameters beside the embedding, the "
                        "layers and the final norm, run before the layers, that is no embedding, linear or norm: the "
                        "pipeline stages of the model's own forward have no stand-in for it on a later stage")
    return [m for n, m in found if n not in after], [m for n, m in found if n in after], stray_why


def stand_in_width(module):
    """What a later pipeline stage runs in place of `module`, a child of the base run before the layers whose
    weights it does not hold (its output is replaced by the received hidden states at the stage's first layer):
    zeros of (indices' shape, width) for an embedding (("lookup", width)), of the input's shape with the last
    dimension `width` for a linear, None (the input's width) for a per-channel norm; False: none of those."""
    from torch import nn

    if isinstance(module, nn.Embedding):
        return "lookup", module.embedding_dim
    widths = linear_widths(module)
    if widths is not None:
        return widths[1]
    params = list(module.parameters())
    return None if params and all(p.dim() == 1 and p.shape == params[0].shape for p in params) else False


def _run_after(model, layers_path: str, names: tuple[str, ...]):
    """The names (children of the base holding the layers at `layers_path`) whose first op on the traced forward
    graph comes after the layers' first, or why the graph cannot say (it does not trace). Memoised per model class
    and config."""
    key = (type(model), model.config.to_json_string(use_diff=False), layers_path, names)
    if key not in _RUN_AFTER:
        _RUN_AFTER[key] = _first_ops_after(model, layers_path, names)
    return _RUN_AFTER[key]


_RUN_AFTER: dict = {}  # a memo, not state: a model class and config trace to the same graph


def _first_ops_after(model, layers_path: str, names: tuple[str, ...]):
    from autoshard.errors import CaptureError
    from autoshard.passes.capture.tp_proof import traced

    base, _, layers_name = layers_path.rpartition(".")
    try:
        cap = traced(model)[1]
    except CaptureError as e:
        return (f"{base} holds modules beside the layers ({', '.join(names)}), and where its forward runs them cannot "
                f"be read off its graph, which does not trace ({e})")
    first: dict[str, int] = {}
    for i, node in enumerate(cap.call_nodes()):
        site = cap.site(node)
        if site.phase == "fwd":
            for n in (*names, layers_name):
                if site.module_path == f"{base}.{n}" or site.module_path.startswith(f"{base}.{n}."):
                    first.setdefault(n, i)
    layer = first.pop(layers_name, None)
    if layer is None:
        return f"{base}: no op of its layers shows on its traced graph, so where the modules beside them run is unknown"
    return frozenset(n for n, i in first.items() if i > layer)
