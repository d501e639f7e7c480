"""`autoshard sweep`: not built yet (see the open issues)."""

from __future__ import annotations

from autoshard.errors import AutoshardError


def add_parser(sub) -> None:
    p = sub.add_parser("sweep", help="(not built yet)")
    p.set_defaults(run=run)


def run(args) -> int:
    raise AutoshardError("'autoshard sweep' is not built yet")
