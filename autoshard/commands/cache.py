"""`autoshard cache`: where the cost-table cache lives, how big it is, and how to empty it."""

from __future__ import annotations

import json


def add_parser(sub) -> None:
    p = sub.add_parser("cache", help="show or clear the on-disk cache of cost tables",
                       description="Cost tables (the traced, symbolic per-node costs of a model) and preset "
                       "fingerprints are stored on disk after the first trace, so later inspect/sweep/plan runs on "
                       "the same model skip the trace. "
                       "The cache is keyed by the model config, the torch and transformers versions and autoshard's "
                       "source. Location: $AUTOSHARD_CACHE_DIR, else $XDG_CACHE_HOME/autoshard, else "
                       "~/.cache/autoshard; AUTOSHARD_CACHE_DIR=off turns it off.")
    p.add_argument("--clear", action="store_true", help="delete every stored entry")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def run(args) -> int:
    from autoshard.passes.capture import table_cache

    root = table_cache.cache_dir()
    if args.clear:
        removed, freed = table_cache.clear()
        info = {"dir": None if root is None else str(root), "removed": removed, "bytes_freed": freed}
        text = f"removed {_entries(removed)}, {freed / 2**20:.1f} MiB, from {root}" if root else "the cache is off"
    else:
        entries, size = table_cache.usage()
        info = {"dir": None if root is None else str(root), "enabled": root is not None, "entries": entries,
                "bytes": size}
        text = (f"{root}: {_entries(entries)} (cost tables, fingerprints), {size / 2**20:.1f} MiB" if root is not None else
                f"the cache is off ({table_cache.ENV}={table_cache.OFF})")
    print(json.dumps(info, indent=2) if args.json else text)
    return 0


def _entries(n: int) -> str:
    return f"{n} entry" if n == 1 else f"{n} entries"
