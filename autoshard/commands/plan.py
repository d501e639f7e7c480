"""`autoshard plan`: solve for the fastest plan with CP-SAT and write it as JSON."""

from __future__ import annotations

import json
import re
import sys
import time
from dataclasses import replace

from autoshard.commands.common import positive_int


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="solve for the fastest plan (CP-SAT) and export it as JSON",
                       description="Capture the model, build its cost table, and solve (per candidate mesh, one "
                       "CP-SAT model over pipeline stage boundaries, per-stage recomputation, ZeRO level and "
                       "micro-batch size) for the fastest training step that fits in device memory.")
    p.add_argument("--model", required=True, help="preset name (e.g. llama-7b, mamba2-tiny)")
    p.add_argument("--hardware", required=True, help="device profile name (e.g. ascend-910b, h100) or a JSON file")
    p.add_argument("--devices", required=True, type=positive_int, help="number of devices (world size)")
    p.add_argument("--global-batch", required=True, type=positive_int, help="sequences per training step")
    p.add_argument("--seq-len", required=True, type=positive_int, help="tokens per sequence")
    p.add_argument("--time-limit", type=float, default=10.0, metavar="SEC",
                   help="CP-SAT work budget per layout in deterministic seconds (default 10); the result "
                   "does not depend on the machine or its load, and the search over layouts always finishes")
    p.add_argument("--out", help="write the plan to this JSON file")
    p.add_argument("--json", action="store_true", help="print the plan as JSON instead of a summary")
    p.set_defaults(run=run)


def run(args) -> int:
    from autoshard.hardware import load_hardware
    from autoshard.models.presets import get_spec
    from autoshard.passes.solve import solve

    spec = get_spec(args.model)
    hw = load_hardware(args.hardware)
    with _progress(enabled=not args.json) as progress:
        plan = solve(spec, hw, devices=args.devices, global_batch=args.global_batch, seq_len=args.seq_len,
                     time_limit_s=args.time_limit, progress=progress, fingerprint=fingerprint(spec))
    if args.out:
        plan.save(args.out)
    if args.json:
        print(json.dumps(plan.to_json(), indent=2))
    else:
        from autoshard.commands.show import render

        render(plan)
        if args.out:
            print(f"plan written to {args.out}")
    return 0


_LAYER0 = re.compile(r"((?:^|\.)layers\.)0(?=\.|$)")


def fingerprint(spec) -> str:
    """`fingerprint_spec(spec)` without building every layer (seconds for llama-70b on meta): the
    one-layer model on meta, its `layers.0` entries repeated for every layer, in the order
    `named_modules` / `named_parameters` give them (layer by layer, each contiguous). Kept in the
    on-disk cache (passes/table_cache.py) with the spec's cost table, so a cached run builds no model."""
    from autoshard.passes import table_cache

    return table_cache.cached_value("fingerprints", table_cache.spec_key(spec), lambda: _fingerprint(spec))


def _fingerprint(spec) -> str:
    from autoshard.fingerprint import fingerprint_module
    from autoshard.models.presets import build_model

    one = build_model(replace(spec, layers=1), device="meta")

    class Repeated:
        def named_modules(self):
            return _repeat(list(one.named_modules()), spec.layers)

        def named_parameters(self):
            return _repeat(list(one.named_parameters()), spec.layers)

    return fingerprint_module(Repeated())


def _repeat(items: list, layers: int) -> list:
    where = [k for k, (name, _) in enumerate(items) if _LAYER0.search(name)]
    if not where:
        return items
    start, end = where[0], where[-1] + 1
    body = [(_LAYER0.sub(rf"\g<1>{i}", name), v) for i in range(layers) for name, v in items[start:end]]
    return items[:start] + body + items[end:]


class _progress:
    """A rich progress line while the search runs longer than a second (stderr, TTY or not)."""

    def __init__(self, *, enabled: bool) -> None:
        self.enabled, self.start, self.bar, self.task = enabled, time.perf_counter(), None, None

    def __enter__(self):
        return self.update

    def update(self, done: int, total: int, best: float) -> None:
        if not self.enabled or time.perf_counter() - self.start < 1.0:
            return
        if self.bar is None:
            from rich.console import Console
            from rich.progress import Progress

            self.bar = Progress(console=Console(file=sys.stderr), transient=True)
            self.bar.start()
            self.task = self.bar.add_task("solving layouts", total=total)
        self.bar.update(self.task, completed=done, description=f"solving layouts (best {best:.3g} s/step)")

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.stop()
