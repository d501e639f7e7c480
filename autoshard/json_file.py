"""JSON files users write by hand (plan files, hardware profiles), read strictly.

Contract: `load_json(raw, source=, error=)` parses bytes as UTF-8 JSON and raises `error` (an
`AutoshardError` class) naming `source` where Python's json module would guess: an object that gives
one key twice (json keeps the last silently: a hand-edited `"tp": 2, ... "tp": 1` ran tp 1), text
that is not UTF-8, or not JSON at all. NaN and Infinity parse, so that the field checks that
follow can name the field they sit in (every numeric field refuses them). `read_plan_json(path)`:
a plan file's JSON (training or inference plan), or `PlanFileError`; the one reader of plan files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from autoshard.errors import InvalidConfigError, PlanFileError


def load_json(raw: bytes, *, source: str, error: type[InvalidConfigError] = InvalidConfigError) -> Any:
    """The JSON value of `raw`, with every object's keys unique (module docstring)."""
    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise error(f"{source}: key {key!r} appears twice in one object ({out[key]!r} and {value!r}); "
                            "keep one: JSON keys are unique, and which one counts would be a guess")
            out[key] = value
        return out

    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=unique)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise error(f"{source} is not valid JSON: {e}") from None


def read_plan_json(path: str | Path) -> Any:
    """The JSON of a plan file (training or inference), or PlanFileError."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise PlanFileError(f"cannot read plan file {path}: {e.strerror}") from None
    if raw[:1] == b"\x80" or raw[:2] in (b"PK",):
        raise PlanFileError(f"{path} looks like a pickle/zip, not JSON; autoshard plan files are JSON only "
                            "(write one with `autoshard plan ... --out plan.json`)")
    return load_json(raw, source=f"plan file {path}", error=PlanFileError)
