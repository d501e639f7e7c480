"""Placement propagation over the traced joint graph: the proof of a tensor-parallel strategy.

Contract: `propagate(captured, params, *, regions, rowwise, counts) -> Proof`.

The whole contract: docs/modules/capture.md (passes/capture/propagate.py).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Mapping

from torch import fx

from autoshard.passes.capture.capture import Captured
from autoshard.passes.capture.placement_rules import RULES
from autoshard.passes.capture.placements import (P, R, X, Z, Context, Partial, Placement, Replicate, Shard, Unknown,
                                                  Unprovable, fill_zeros, flatten)


@dataclass(frozen=True, slots=True, kw_only=True)
class Finding:
    """An op the strategy's placements cannot pass: where (a module path inside the layer, as
    "layers.*.self_attn.q_norm", or a full path outside one), the op, the phase, what was found."""

    kind: str
    where: str
    op: str
    phase: str
    detail: str

    def message(self) -> str:
        return f"{self.where}: {self.detail} ({self.kind}, in {'backward' if self.phase == 'bwd' else 'forward'})"


@dataclass(frozen=True, slots=True, kw_only=True)
class Proof:
    """What the propagation found (docs/modules/capture.md). Parameter names and module paths are relative to
    a layer ("self_attn.q_norm.weight")."""

    placements: tuple[tuple[str, str], ...]
    grads: tuple[tuple[str, str], ...]
    grad_sums: tuple[str, ...]  # modules whose replicated parameters' gradients are partial: summed over tp
    summed_numel: int = 0  # elements of one layer's parameters in `grad_sums` (what the sum all-reduces)
    reduces: tuple[tuple[str, str], ...]  # (phase, module) of each all-reduce the strategy needs
    handled: tuple[str, ...]
    findings: tuple[Finding, ...]

    @property
    def proven(self) -> bool:
        return not self.findings

    def refusal(self) -> str | None:
        """The first finding, worded as the reason tp is refused, or None."""
        if self.proven:
            return None
        f = self.findings[0]
        more = f" (and {len(self.findings) - 1} more)" if len(self.findings) > 1 else ""
        return (f"{f.message()}{more}: the placement propagation over the traced graph cannot prove the tp "
                "strategy; tp is not offered for this model (dp, pp, cp and ep still plan)")


def propagate(captured: Captured, params: Mapping[str, Placement], *, regions: tuple[str, ...] = (),
              rowwise: tuple[str, ...] = (), counts: frozenset[int] = frozenset(),
              repeats: tuple[tuple[str, int], ...] = ()) -> Proof:
    """Place every node of `captured`'s joint graph under the strategy; see docs/modules/capture.md. `repeats`:
    (attention module inside a layer, its KV heads' repeat count the rewrite sets per rank)."""
    walk = _Walk(captured, params, regions, rowwise, counts, repeats)
    for node in captured.graph_module.graph.nodes:
        walk.visit(node)
    return walk.proof()


class _Walk:
    """One pass over the graph: the placement of every node so far, and what was found."""

    def __init__(self, cap: Captured, params, regions, rowwise, counts, repeats) -> None:
        self.cap, self.params, self.regions, self.rowwise, self.counts = cap, params, regions, rowwise, counts
        self.repeats = repeats
        self.prefixes = tuple(r.prefix for r in cap.repeated)
        self.inputs = (*cap.param_names, *cap.buffer_names) + ("",) * cap.num_inputs
        self.place: dict[fx.Node, object] = {}
        self.origin: dict[fx.Node, str] = {}  # a node that is a parameter or a view of one: its relative name
        self.source: dict[fx.Node, str] = {}  # a split or partial node: the layer module whose parameter split it
        self.reduces: dict[tuple[str, str], None] = {}
        self.findings: dict[tuple[str, str, str], Finding] = {}
        self.handled: dict[str, None] = {}
        self.grads: dict[str, str] = {}
        self.mismatch: list[Finding] = []
        self.grad_sums: dict[str, None] = {}
        self.summed_numel = 0
        self.n_placeholder = 0
        self.joined: set[fx.Node] = set()  # sums of region gradients (`joins`), all-reduced as they entered

    # -- where a node sits -------------------------------------------------------------------
    def rel(self, path: str) -> str | None:
        """`path` inside its layer ("" for the layer's own ops), None outside every layer."""
        for prefix in self.prefixes:
            if path.startswith(prefix + "."):
                head, _, rest = path[len(prefix) + 1:].partition(".")
                if head.isdigit():
                    return rest
        return None

    def where(self, path: str) -> str:
        rel = self.rel(path)
        return path or "the model's top level" if rel is None else f"layers.*.{rel}" if rel else "layers.*"

    @staticmethod
    def under(rel: str | None, modules: tuple[str, ...]) -> str | None:
        if rel is None:
            return None
        return next((m for m in modules if rel == m or rel.startswith(m + ".")), None)

    # -- visiting --------------------------------------------------------------------------
    def visit(self, node: fx.Node) -> None:
        if node.op == "placeholder":
            name = self.inputs[self.n_placeholder] if self.n_placeholder < len(self.inputs) else ""
            self.n_placeholder += 1
            self.place[node] = self.params.get(name, R)
            rel = self.rel(name.rpartition(".")[0]) if name else None
            if rel is not None:
                self.origin[node] = f"{rel}.{name.rpartition('.')[2]}".lstrip(".")
                if self.place[node] is not R:
                    self.source[node] = rel
        elif node.op == "get_attr":
            self.place[node] = R
        elif node.op == "call_function":
            self.place[node] = self.call(node)
            src = next((self.source[a] for a in node.all_input_nodes if a in self.source
                        and self.place.get(a, R) is not R), None)
            if src is not None:
                self.source[node] = src
        elif node.op == "output":
            self.outputs(node)

    def call(self, node: fx.Node):
        site = self.cap.sites.get(node.name)
        path, phase = (site.module_path, site.phase) if site else ("", "fwd")
        join = phase == "bwd" and self.joins(node)
        if join:
            self.joined.add(node)  # its partial inputs were all-reduced on the way in: whole, and rightly so
        ins = fill_zeros(fx.node.map_arg(node.args, lambda a: self.read(a, path, phase, join=join)))
        val = node.meta.get("val")
        rel = self.rel(path)
        ctx = Context(shapes=_shapes(node.args), out=_shape(val), phase=phase, counts=self.counts,
                      repeats=frozenset(n for m, n in self.repeats if self.under(rel, (m,))),
                      rowwise=phase == "fwd" and self.under(rel, self.rowwise) is not None,
                      names=fx.node.map_arg(node.args, lambda a: self.origin.get(a)), handled=[])
        name = "getitem" if node.target is operator.getitem else \
            getattr(getattr(node.target, "overloadpacket", None), "__name__", str(node.target))
        if node.target in (operator.getitem,) or name in ("t", "view", "_unsafe_view", "transpose", "expand",
                                                             "unsqueeze", "detach", "_to_copy", "alias", "clone"):
            origin = self.origin.get(node.args[0]) if node.args and isinstance(node.args[0], fx.Node) else None
            if origin:
                self.origin[node] = origin
        rule = RULES.get(name) or RULES.get(name.rstrip("_"))  # an in-place variant places as its op
        flat = [a for a in flatten(ins) if isinstance(a, (Replicate, Partial, Shard, Unknown))]  # Zeros filled
        if rule is None:
            if all(a is R for a in flat):
                return _each(val, R)
            if any(a is X for a in flat):
                return _each(val, X)
            self.find(Finding(kind="no placement rule", where=self.where(path), op=f"aten.{name}", phase=phase,
                              detail=f"aten.{name} has no placement rule and takes {', '.join(map(str, flat))}; "
                                     "add one to passes/capture/placement_rules.py RULES"))
            return _each(val, X)
        try:
            out = rule(node, ins, ctx)
        except Unprovable as e:
            src = next((self.source[a] for a in node.all_input_nodes if a in self.source
                        and self.place.get(a, R) is not R), None)
            by = f" (split by layers.*.{src})" if src else ""
            self.find(Finding(kind=e.kind, where=self.where(path), op=f"aten.{name}", phase=phase, detail=e.detail + by))
            return _each(val, X)
        for note in ctx.handled:
            self.handled[f"{self.where(path)}: {note}"] = None
        return out

    def joins(self, node: fx.Node) -> bool:
        """Whether `node` is autograd's sum of a region's partial input gradient with a whole one (the residual
        stream read by a region directly, Exaone-4's post-norm MLP; the attention and the MLP side by side,
        Cohere's parallel block): the region's share is all-reduced as it leaves, whatever module the sum is
        attributed to."""
        if getattr(node.target, "overloadpacket", None) is None or node.target.overloadpacket.__name__ != "add":
            return False
        return any(self.place.get(a, R) is R for a in node.all_input_nodes) or len({
            self.under(self.rel(self.cap.sites[a.name].module_path), self.regions)
            for a in node.all_input_nodes if a.name in self.cap.sites}) > 1

    def read(self, arg: fx.Node, path: str, phase: str, *, join: bool = False):
        """The placement of `arg` as its consumer at `path` sees it: a partial sum leaving a row-parallel
        linear (forward) or a tp region (backward; `join`: into a sum of gradients of several regions, `joins`)
        is all-reduced on the way."""
        p = self.place.get(arg, R)
        if p not in (P, R) or arg.op != "call_function":
            return p
        site = self.cap.sites.get(arg.name)
        if site is None:
            return p
        modules = self.rowwise if site.phase == "fwd" else self.regions
        m = self.under(self.rel(site.module_path), modules)
        leaves = m is not None and (self.under(self.rel(path), (m,)) is None or (join and site.phase == "bwd"))
        if leaves and p is R and self.rel(path) is not None and arg not in self.joined:
            # the runtime all-reduces what leaves there: a whole tensor would come out tp times itself
            what = "output of the row-parallel linear" if site.phase == "fwd" else "input gradient of the tp region"
            self.find(Finding(kind="whole value all-reduced", where=f"layers.*.{m}", op="all_reduce", phase=site.phase,
                              detail=f"the {what} layers.*.{m} is whole on every rank, yet the runtime all-reduces "
                                     "it there (it would come out tp times itself): nothing the strategy splits "
                                     "reaches it"))
            return X
        if leaves and p is P:
            self.reduces[(site.phase, f"layers.*.{m}")] = None
            return R
        return p

    def find(self, f: Finding) -> None:
        self.findings.setdefault((f.where, f.kind, f.op), f)

    def outputs(self, node: fx.Node) -> None:
        outs = node.args[0]
        names = self.cap.outputs
        for name, arg in zip(names, outs):
            if not isinstance(arg, fx.Node):
                continue
            got = self.place.get(arg, R)
            if not name.startswith("grad:"):
                if got not in (R, X):
                    self.find(Finding(kind="split result", where=name, op="output", phase="bwd",
                                      detail=f"the model's {name} comes out {got}, not whole"))
                continue
            param = name.removeprefix("grad:")
            rel = self.rel(param.rpartition(".")[0])
            if rel is None:
                continue
            short = f"{rel}.{param.rpartition('.')[2]}".lstrip(".")
            want = self.params.get(param, R)
            if got is X:
                continue
            got = want if got is Z else got
            if want is R and got is P:
                self.grad_sums[rel] = None
                if short not in self.grads:
                    self.summed_numel += arg.meta["val"].numel() if "val" in arg.meta else 0
            elif got != want and not (isinstance(want, Shard) and isinstance(got, Shard) and want.dim == got.dim):
                self.find(Finding(kind="gradient placement", where=f"layers.*.{rel}", op="output", phase="bwd",
                                  detail=f"the gradient of {short} comes out {got} while the parameter is {want}"))
            self.grads.setdefault(short, str(got))

    def proof(self) -> Proof:
        placed = {}
        for name in self.cap.param_names:
            rel = self.rel(name.rpartition(".")[0])
            if rel is not None:
                placed.setdefault(f"{rel}.{name.rpartition('.')[2]}".lstrip("."), str(self.params.get(name, R)))
        return Proof(placements=tuple(placed.items()), grads=tuple(self.grads.items()),
                     grad_sums=tuple(self.grad_sums), summed_numel=int(self.summed_numel), reduces=tuple(self.reduces), handled=tuple(self.handled),
                     findings=tuple(self.findings.values()))


def _shape(val):
    if isinstance(val, (list, tuple)):
        return [_shape(v) for v in val]
    shape = getattr(val, "shape", None)
    return tuple(int(s) for s in shape) if shape is not None else None


def _shapes(args) -> tuple:
    return tuple(fx.node.map_arg(a, lambda n: _shape(n.meta.get("val"))) if isinstance(a, (fx.Node, list, tuple))
                 else None for a in args)


def _each(val, p):
    return tuple(p for _ in val) if isinstance(val, (list, tuple)) else p
