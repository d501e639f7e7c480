"""`autoshard` command line: inspect, sweep, plan, price, show, cache.

Each command lives in `autoshard/commands/<name>.py` with `add_parser(subparsers)` and
`run(args) -> int`. User errors (`AutoshardError`) print one line and exit 2, no traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from autoshard.errors import AutoshardError

COMMANDS = ("inspect", "sweep", "plan", "price", "show", "verify", "cache")


class _Parser(argparse.ArgumentParser):
    """argparse, with its usage errors on one line (exit 2) like autoshard's own, and no abbreviated options (`plan
    --tp 2` read as `--tpot-slo 2`: an option's prefix is no option)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        hint = ""
        if "unrecognized arguments" in message and self.prog.endswith(" plan") and any(
                f"--{axis}" in message.split() for axis in ("dp", "tp", "pp", "cp", "ep")):
            hint = "; plan searches the layout itself: price a given one with `autoshard price --tp ... --pp ...`"
        self.exit(2, f"{self.prog}: error: {message}{hint} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    import importlib

    parser = _Parser(
        prog="autoshard",
        description="Automatic parallelization for PyTorch training: capture a model, price every "
        "(DP, PP, TP, CP, EP) layout on a cluster, solve for the fastest plan, and run it.",
        epilog="Run `autoshard COMMAND --help` for the options of each command.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        importlib.import_module(f"autoshard.commands.{name}").add_parser(sub)
    parser.commands = sub.choices  # name -> the command's parser (its errors name it)
    return parser


def main(argv: list[str] | None = None) -> int:
    # HF's notes (e.g. "falling back to the reference implementation") are not the user's concern here;
    # set before transformers is imported, so a command that needs no model never imports it
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    # transformers' quantizers import torchao where it is installed (autoshard's fp8 runs on it): its notes
    # on CUDA extensions a CPU build cannot load, and torch's deprecation notes on the enums it registers
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # said by the command's own parser, which can tell what was meant
        parser.commands[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return int(args.run(args) or 0)
    except AutoshardError as e:
        # one line, whatever the message holds (a model factory's own multi-line exception, say)
        message = "; ".join(line.strip() for line in str(e).splitlines() if line.strip())
        print(f"autoshard {args.command}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
