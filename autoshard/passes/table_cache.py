"""An on-disk cache of cost tables, so a model is traced once per machine, not once per command.

Contract
--------
`cached_table(key_parts, build) -> CostTable`: the table stored under the digest of `key_parts`
(a JSON-able dict that names everything the table depends on), or `build()`'s result, which is
then stored. `key_parts` is made by `passes/shapes`; besides the model it carries the versions of
torch and transformers and a digest of autoshard's own source, so a new release or a local edit
never reads a stale table.

* Where: `$AUTOSHARD_CACHE_DIR`, else `$XDG_CACHE_HOME/autoshard`, else `~/.cache/autoshard`;
  tables are `tables/<digest>.json`. `AUTOSHARD_CACHE_DIR=off` turns the cache off.
  `autoshard cache` prints where it is and how big; `autoshard cache --clear` empties it.
* Format: JSON (never pickle), one file per table, written atomically (temporary file, then
  rename). Each expression is stored as the terms of a polynomial in `B`, `S` and
  `ceiling(S/l)` (Mamba-2's padded length) with integer or rational coefficients; decoding
  rebuilds the same SymPy expression (tests/passes/test_table_cache.py checks equality).
* A file that cannot be read or decoded is a miss: the table is rebuilt and the file replaced.
  A directory that cannot be written only costs the speed-up; nothing fails.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import sympy

from autoshard.ir import B, S, BlockCost, BlockKind, CostTable, NodeCost, OpKind

FORMAT = 1
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
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def digest(key_parts: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key_parts, sort_keys=True).encode()).hexdigest()[:40]


def cached_table(key_parts: dict[str, Any], build: Callable[[], CostTable]) -> CostTable:
    """The stored table for `key_parts`, or `build()` (stored for next time)."""
    root = cache_dir()
    if root is None:
        return build()
    path = root / "tables" / f"{digest(key_parts)}.json"
    table = _read(path, key_parts)
    if table is not None:
        return table
    table = build()
    _write(path, key_parts, table)
    return table


def _read(path: Path, key_parts: dict[str, Any]) -> CostTable | None:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        _log.debug("cost-table cache: unreadable %s (%s); rebuilding", path, e)
        return None
    try:
        if data.get("format") != FORMAT or data.get("key") != key_parts:
            return None
        return table_from_json(data["table"])
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        _log.debug("cost-table cache: malformed %s (%s); rebuilding", path, e)
        return None


def _write(path: Path, key_parts: dict[str, Any], table: CostTable) -> None:
    try:
        payload = json.dumps({"format": FORMAT, "key": key_parts, "table": table_to_json(table)})
    except ValueError as e:  # an expression outside the polynomial form: not cached, still correct
        _log.debug("cost-table cache: not storing %s (%s)", table.model, e)
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            f.write(payload)
        os.replace(tmp, path)
    except OSError as e:
        _log.debug("cost-table cache: cannot write %s (%s)", path, e)


def clear() -> tuple[int, int]:
    """Delete every stored table: (files removed, bytes freed)."""
    root = cache_dir()
    files = sorted((root / "tables").glob("*.json")) if root is not None else []
    freed = 0
    for f in files:
        freed += f.stat().st_size
        f.unlink()
    return len(files), freed


def usage() -> tuple[int, int]:
    """(stored tables, bytes) in the cache directory."""
    root = cache_dir()
    files = list((root / "tables").glob("*.json")) if root is not None else []
    return len(files), sum(f.stat().st_size for f in files)


# -- JSON form of a CostTable ------------------------------------------------------------------------

def table_to_json(table: CostTable) -> dict[str, Any]:
    encode = functools.lru_cache(maxsize=None)(_encode)  # the same expression recurs across nodes
    return {"model": table.model, "blocks": [
        {"name": blk.name, "kind": blk.kind.value, "count": blk.count, "params": blk.params,
         "nodes": [_node_to_json(n, encode) for n in blk.nodes]}
        for blk in table.blocks]}


def table_from_json(data: dict[str, Any]) -> CostTable:
    decode = functools.lru_cache(maxsize=None)(_decode)
    return CostTable(model=data["model"], blocks=tuple(
        BlockCost(name=blk["name"], kind=BlockKind(blk["kind"]), count=int(blk["count"]), params=int(blk["params"]),
                  nodes=tuple(_node_from_json(n, decode) for n in blk["nodes"]))
        for blk in data["blocks"]))


_EXPR_FIELDS = ("flops", "bytes_read", "bytes_written", "saved_bytes")


def _node_to_json(n: NodeCost, encode: Callable) -> dict[str, Any]:
    out = {"name": n.name, "target": n.target, "kind": n.kind.value, "phase": n.phase,
           "module_path": n.module_path, "block": n.block}
    out.update({f: encode(getattr(n, f)) for f in _EXPR_FIELDS})
    out["gemm"] = None if n.gemm is None else [encode(e) for e in n.gemm]
    return out


def _node_from_json(data: dict[str, Any], decode: Callable) -> NodeCost:
    node = NodeCost(name=data["name"], target=data["target"], kind=OpKind(data["kind"]), phase=data["phase"],
                    module_path=data["module_path"], block=data["block"],
                    **{f: decode(_frozen(data[f])) for f in _EXPR_FIELDS})
    if data["gemm"] is not None:
        node = replace(node, gemm=tuple(decode(_frozen(e)) for e in data["gemm"]))
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
    poly = sympy.Poly(expr, B, S, *ceilings)
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
