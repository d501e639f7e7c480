"""`autoshard verify` verdicts: per model class, transformers version and verify method, which parallel axes ran a tiny
model of the class exactly like one process, and which did not (with why).

Contract: `store(model_class, verdicts)` writes {axis: (status, detail)}; `failed_axes(model_class)` ->
((axis, why), ...) of the axes a stored verdict says failed (status "failed" or "error"). The spec of a
model (`presets.spec_from_hf_config`) adds those to `ModelSpec.refused`, so `plan` / `sweep` do not
search them and `parallelize` refuses a plan that uses one, naming the verdict. `clear(model_class)`
drops the verdict (verify re-proves a class from scratch). Entries live in the on-disk cache
(passes/capture/table_cache.py `cache_dir`, under `verdicts/`); with the cache off nothing is stored or read.
"""

from __future__ import annotations

import json
from importlib import metadata

FAILED = ("failed", "error")
# how verify proves a class; a verdict stored by another method is not read (2: dropout off, `tiny.without_dropout`:
# method 1 stored "failed" for classes whose only difference from one process was their dropout masks; 3: SGD steps,
# method 2's AdamW stored "failed" for Gemma-4's tp / cp, exact but for float32 noise its second step amplified)
METHOD = 3


def _key(model_class: type) -> dict:
    return {"class": f"{model_class.__module__}.{model_class.__qualname__}",
            "transformers": metadata.version("transformers"), "method": METHOD}


def _path(model_class: type):
    from autoshard.passes.capture import table_cache

    root = table_cache.cache_dir()
    return None if root is None else root / "verdicts" / f"{table_cache.digest(_key(model_class))}.json"


def store(model_class: type, verdicts: dict[str, tuple[str, str]]) -> None:
    path = _path(model_class)
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"key": _key(model_class), "verdicts": {a: list(v) for a, v in verdicts.items()}}))
    tmp.replace(path)


def load(model_class: type) -> dict[str, tuple[str, str]]:
    path = _path(model_class)
    if path is None or not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if data.get("key") != _key(model_class):
        return {}
    return {a: (v[0], v[1]) for a, v in data.get("verdicts", {}).items()}


def failed_axes(model_class: type) -> tuple[tuple[str, str], ...]:
    """(axis, why) of every axis the stored verdict of `model_class` says is not exact."""
    return tuple((axis, f"autoshard verify found it not exact for {model_class.__name__} ({detail}); fix and "
                        "re-run autoshard verify, or plan without it")
                 for axis, (status, detail) in load(model_class).items() if status in FAILED)


def clear(model_class: type) -> None:
    path = _path(model_class)
    if path is not None and path.is_file():
        path.unlink()
