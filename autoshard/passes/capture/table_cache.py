"""An on-disk cache of cost tables, so a model is traced once per machine, not once per command.

The whole contract: docs/modules/capture.md (passes/capture/table_cache.py).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import tempfile
from dataclasses import replace
from enum import Enum
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

import sympy

from autoshard.errors import InvalidConfigError
from autoshard.cost_table import B, S, BlockCost, CostTable, NodeCost, RegionTag
from autoshard.ir import BlockKind, OpKind

FORMAT = 1
# of the shipped tables' contents and keys: bump when capture / shapes semantics or the spec's fields change, then
# rebuild. 2: the spec's key names its mixer ("attention" / "ssd", not "llama" / "mamba2") and its MoE layout
# (`moe_paths`, no "moe" family name); the tables' contents are unchanged. 3: nodes carry the fused region the
# graph's patterns put them in (passes/capture/fused_patterns.py; NodeCost.region)
SHIPPED_FORMAT = 3
SHIPPED = Path(__file__).resolve().parents[2] / "shipped"
ENV = "AUTOSHARD_CACHE_DIR"
OFF = "off"
_log = logging.getLogger("autoshard.cache")


def cache_dir() -> Path | None:
    """The cache directory (not created here), or None when the cache is turned off."""
    configured = os.environ.get(ENV)
    if configured is not None:
        return None if configured.strip().lower() in (OFF, "") else Path(configured).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "autoshard"


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """sha256 of autoshard's Python sources: any edit to the package makes every old table a miss."""
    root = Path(__file__).resolve().parents[2]
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def digest(key_parts: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key_parts, sort_keys=True).encode()).hexdigest()[:40]


def content_digest(value: Any) -> str:
    """sha256 of a stored value's canonical JSON: what an entry's `digest` field holds."""
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def _spec_fields(spec: Any) -> dict[str, Any]:
    fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)
              if not (f.metadata.get("omit_default") and getattr(spec, f.name) == f.default)}
    if "parts" in fields:  # a hybrid's layer parts (ModelSpec.parts): frozen records, as their fields
        fields["parts"] = [dataclasses.asdict(p) for p in fields["parts"]]
    # in JSON's own form (tuples as lists), so that a key read back from a file compares equal to a fresh one
    return json.loads(json.dumps({k: v.value if isinstance(v, Enum) else v for k, v in fields.items()}))


def spec_key(spec: Any) -> dict[str, Any]:
    """The key parts every entry about a model spec starts from (docs/modules/capture.md)."""
    import torch  # here, not at import: a shipped table is read without torch

    return {"spec": _spec_fields(spec), "torch": torch.__version__,
            "transformers": metadata.version("transformers"), "autoshard": source_digest()}


def shipped_key(spec: Any, **options: Any) -> dict[str, Any]:
    """The key of a shipped entry about `spec` (see "Shipped tables" above): its fields, `options`
    (JSON values) and `SHIPPED_FORMAT`."""
    return {"shipped_format": SHIPPED_FORMAT, "spec": _spec_fields(spec), **options}


KeyParts = dict[str, Any] | Callable[[], dict[str, Any]]  # a callable: computed only when the shipped entry misses


def cached_table(key_parts: KeyParts, build: Callable[[], CostTable], *,
                 shipped: dict[str, Any] | None = None) -> CostTable:
    """The shipped table for `shipped` (a `shipped_key`), else the stored table for `key_parts`, else
    `build()` (stored for next time)."""
    return cached_value("tables", key_parts, build, shipped=shipped, encode=table_to_json, decode=table_from_json)


def cached_value(kind: str, key_parts: KeyParts, build: Callable[[], Any], *,
                 shipped: dict[str, Any] | None = None, encode: Callable[[Any], Any] = lambda v: v,
                 decode: Callable[[Any], Any] = lambda v: v) -> Any:
    """The value shipped under `kind/` for `shipped` (when given), else the value stored under `kind/`
    for `key_parts`, else `build()` (stored for next time); `encode` / `decode` map the value to and
    from JSON."""
    if shipped is not None:
        value = _read(SHIPPED / kind / f"{digest(shipped)}.json", shipped, decode, digest_required=False)
        if value is not None:
            return value
    root = cache_dir()
    if root is None:
        return build()
    key_parts = key_parts() if callable(key_parts) else key_parts
    path = root / kind / f"{digest(key_parts)}.json"
    value = _read(path, key_parts, decode)
    if value is not None:
        return value
    value = build()
    write_entry(path, key_parts, value, encode)
    return value


def _read(path: Path, key_parts: dict[str, Any], decode: Callable[[Any], Any], *, digest_required: bool = True) -> Any:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        _log.debug("autoshard cache: unreadable %s (%s); rebuilding", path, e)
        return None
    try:
        if data.get("format") != FORMAT or data.get("key") != key_parts:
            return None
        if (digest_required or "digest" in data) and data.get("digest") != content_digest(data["value"]):
            _log.warning("autoshard cache: %s does not match its content digest (edited or damaged); not used, "
                         "rebuilding it", path)
            return None
        return decode(data["value"])
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        _log.debug("autoshard cache: malformed %s (%s); rebuilding", path, e)
        return None


def write_entry(path: Path, key_parts: dict[str, Any], value: Any, encode: Callable[[Any], Any]) -> None:
    try:
        encoded = encode(value)
        payload = json.dumps({"format": FORMAT, "key": key_parts, "value": encoded, "digest": content_digest(encoded)})
    except ValueError as e:  # e.g. an expression outside the polynomial form: not cached, still correct
        _log.debug("autoshard cache: not storing %s (%s)", path.name, e)
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            f.write(payload)
        os.replace(tmp, path)
    except OSError as e:
        _log.debug("autoshard cache: cannot write %s (%s)", path, e)


def _entries() -> list[Path]:
    root = cache_dir()
    return sorted(root.glob("*/*.json")) if root is not None and root.is_dir() else []


def clear() -> tuple[int, int]:
    """Delete every stored entry: (files removed, bytes freed)."""
    root = cache_dir()
    if root is not None and root.is_dir() and not os.access(root, os.R_OK | os.W_OK | os.X_OK):
        raise InvalidConfigError(f"cannot clear the cache: no permission to change {root}; fix its permissions or "
                                 f"point {ENV} at a directory you own")
    removed = freed = 0
    for f in _entries():
        try:
            size = f.stat().st_size
            f.unlink()
        except FileNotFoundError:  # another `cache --clear` removed it first
            continue
        except PermissionError as e:
            raise InvalidConfigError(f"cannot clear the cache: {e.strerror} deleting {f}; fix the permissions of "
                                     f"{f.parent} or point {ENV} at a directory you own") from None
        removed, freed = removed + 1, freed + size
    return removed, freed


def usage() -> tuple[int, int]:
    """(stored entries, bytes) in the cache directory."""
    sizes = []
    for f in _entries():
        try:
            sizes.append(f.stat().st_size)
        except FileNotFoundError:  # removed by a concurrent `cache --clear`
            continue
    return len(sizes), sum(sizes)


# -- JSON form of a CostTable ------------------------------------------------------------------------

def table_to_json(table: CostTable) -> dict[str, Any]:
    encode = functools.lru_cache(maxsize=None)(_encode)  # the same expression recurs across nodes
    out = {"model": table.model, "blocks": [
        {"name": blk.name, "kind": blk.kind.value, "count": blk.count, "params": blk.params,
         "nodes": [_node_to_json(n, encode) for n in blk.nodes]}
        for blk in table.blocks]}
    if table.layer_kinds:  # several layer kinds only: a one-kind table's JSON is what it always was
        out["layer_kinds"] = list(table.layer_kinds)
    if table.shared_params:
        out["shared_params"] = table.shared_params
    return out


def table_from_json(data: dict[str, Any]) -> CostTable:
    decode = functools.lru_cache(maxsize=None)(_decode)
    return CostTable(model=data["model"], blocks=tuple(
        BlockCost(name=blk["name"], kind=BlockKind(blk["kind"]), count=int(blk["count"]), params=int(blk["params"]),
                  nodes=tuple(_node_from_json(n, decode) for n in blk["nodes"]))
        for blk in data["blocks"]), layer_kinds=tuple(data.get("layer_kinds", ())),
        shared_params=int(data.get("shared_params", 0)))


_EXPR_FIELDS = ("flops", "bytes_read", "bytes_written", "saved_bytes")


def _node_to_json(n: NodeCost, encode: Callable) -> dict[str, Any]:
    out = {"name": n.name, "target": n.target, "kind": n.kind.value, "phase": n.phase,
           "module_path": n.module_path, "block": n.block}
    out.update({f: encode(getattr(n, f)) for f in _EXPR_FIELDS})
    out["gemm"] = None if n.gemm is None else [encode(e) for e in n.gemm]
    if n.region is not None:  # a node of a fused region only
        out["region"] = {"kernel": n.region.kernel, "key": n.region.key, "size": list(n.region.size)}
    return out


def _node_from_json(data: dict[str, Any], decode: Callable) -> NodeCost:
    node = NodeCost(name=data["name"], target=data["target"], kind=OpKind(data["kind"]), phase=data["phase"],
                    module_path=data["module_path"], block=data["block"],
                    **{f: decode(_frozen(data[f])) for f in _EXPR_FIELDS})
    if data["gemm"] is not None:
        node = replace(node, gemm=tuple(decode(_frozen(e)) for e in data["gemm"]))
    if "region" in data:
        tag = data["region"]
        node = replace(node, region=RegionTag(kernel=tag["kernel"], key=tag["key"], size=tuple(tag["size"])))
    return node


def _frozen(encoded: Any) -> Any:
    """A hashable copy of an encoded expression (JSON gives lists), for the decode memo."""
    return tuple(_frozen(x) for x in encoded) if isinstance(encoded, list) else encoded


def _encode(expr: sympy.Expr) -> int | list:
    """An integer, or the polynomial's terms [[coefficient, i, j, l, k], ...] meaning
    coefficient * B**i * S**j * ceiling(S/l)**k (l = 0 when k = 0); coefficient is an int or [p, q]."""
    expr = sympy.sympify(expr)
    if expr.is_Integer:
        return int(expr)
    ceilings = sorted(expr.atoms(sympy.ceiling), key=str)
    chunks = [_chunk_of(c) for c in ceilings]
    unknown = expr.free_symbols - {B, S}
    if unknown:
        raise ValueError(f"unexpected symbols {sorted(map(str, unknown))} in {expr}")
    try:
        poly = sympy.Poly(expr, B, S, *ceilings)
    except sympy.PolynomialError as e:  # e.g. floor(s/l) or sqrt(s): not this form, so not cached
        raise ValueError(f"{expr} is not a polynomial in b, s and ceiling(s/l): {e}") from None
    terms = []
    for monom, coeff in poly.terms():
        if not coeff.is_Rational:
            raise ValueError(f"non-rational coefficient {coeff} in {expr}")
        c = int(coeff) if coeff.is_Integer else [int(coeff.p), int(coeff.q)]
        i, j, *ks = monom
        powers = [(chunks[n], k) for n, k in enumerate(ks) if k]
        if len(powers) > 1:
            raise ValueError(f"more than one ceiling in a term of {expr}")
        l, k = powers[0] if powers else (0, 0)
        terms.append([c, i, j, l, k])
    return terms


def _chunk_of(ceiling: sympy.Expr) -> int:
    l = 1 / (ceiling.args[0] / S)
    if not (l.is_Integer and l > 0):
        raise ValueError(f"{ceiling} is not ceiling(s/l) for an integer l")
    return int(l)


def _decode(encoded: Any) -> sympy.Expr:
    if isinstance(encoded, int):
        return sympy.Integer(encoded)
    out = []
    for c, i, j, l, k in encoded:
        coeff = sympy.Integer(c) if isinstance(c, int) else sympy.Rational(*c)
        term = coeff * B**i * S**j
        if k:
            term *= sympy.ceiling(S / l) ** k
        out.append(term)
    return sympy.Add(*out)


def fingerprint_key(spec: Any) -> dict[str, Any]:
    """The shipped key of `spec`'s fingerprint."""
    return shipped_key(spec, transformers=metadata.version("transformers"))
