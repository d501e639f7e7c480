"""The cost tables and fingerprints shipped in the package, and the command that rebuilds them.

`python -m autoshard.passes.capture.shipped` traces every preset and writes its entries under
`autoshard/shipped/<kind>/<digest>.json` in the cache's own format (passes/capture/table_cache.py,
"Shipped tables", says how they are keyed and read); tests/passes/capture/test_shipped_tables.py
fails, naming this command, when a shipped entry is stale.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from autoshard.passes.capture import kernels as kernel_table
from autoshard.passes.capture import shapes, table_cache

REBUILD = "python -m autoshard.passes.capture.shipped"


def shipped_entries() -> list[tuple[str, dict[str, Any], Callable[[], Any], Callable[[Any], Any]]]:
    """(kind, shipped key, build, encode) of every entry the package ships: per preset, the training
    table of its 1-layer copy for each set of substituted kernels a built-in device profile (or the
    default, or a profile's stack: `DeviceProfile.stack_kernels`) asks for, and its fingerprint (transformers' version in the key: see table_cache's docstring)."""
    import torch

    from autoshard.fingerprint import fingerprint_module
    from autoshard.hardware import hardware_names, load_hardware
    from autoshard.models.presets import PRESETS, build_model

    out = []
    for spec in PRESETS.values():
        one = replace(spec, layers=1)
        profiles = [load_hardware(h) for h in hardware_names()]
        options = {kernel_table.kernel_for(one, names) for names in
                   [kernel_table.KERNEL_NAMES, *(hw.kernels for hw in profiles),
                    *(hw.stack_kernels(one.mixer.value) for hw in profiles)]}
        for kernels in sorted(options):
            key = shapes.shipped_table_key(one, True, torch.bfloat16, kernels)
            out.append(("tables", key, functools.partial(shapes.trace_table, one, True, torch.bfloat16, None, kernels),
                        table_cache.table_to_json))
        out.append(("fingerprints", table_cache.fingerprint_key(spec),
                    functools.partial(lambda s: fingerprint_module(build_model(s, device="meta")), spec),
                    lambda v: v))
    return out


def build_shipped(root: Path = table_cache.SHIPPED) -> list[Path]:
    """Rebuild every shipped entry under `root` (tracing each preset) and delete the ones no preset
    has any more; the paths written."""
    written = []
    for kind, key, build, encode in shipped_entries():
        path = root / kind / f"{table_cache.digest(key)}.json"
        table_cache.write_entry(path, key, build(), encode)
        if not path.is_file():
            raise OSError(f"could not write {path}")
        path.chmod(0o644)  # package data: readable by everyone (the cache's files are private)
        written.append(path)
    for stale in set(root.glob("*/*.json")) - set(written):
        stale.unlink()
    return written


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m autoshard.passes.capture.shipped",
                                 description="Rebuild the cost tables and fingerprints shipped in the package.")
    ap.parse_args(argv)
    paths = build_shipped()
    size = sum(p.stat().st_size for p in paths)
    print(f"{len(paths)} shipped entries written under {table_cache.SHIPPED} ({size / 1e6:.2f} MB)")
    return 0


def fingerprint_spec(spec) -> str:
    """The fingerprint of the model `spec` describes (built on the meta device: no weights; 0.16 s
    for llama-70b), shipped in the package for the presets and else kept in the on-disk cache
    (passes/capture/table_cache.py), so that `autoshard plan` of a preset neither builds a model nor imports
    transformers."""
    from autoshard.fingerprint import fingerprint_module
    from autoshard.models.presets import build_model

    return table_cache.cached_value("fingerprints", lambda: table_cache.spec_key(spec),
                                    lambda: fingerprint_module(build_model(spec, device="meta")),
                                    shipped=table_cache.fingerprint_key(spec))



if __name__ == "__main__":
    raise SystemExit(main())

