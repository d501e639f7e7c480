"""Sweep every causal-LM class of transformers through autoshard: does each run or get refused by name?

For every model type of `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` (196 in transformers 5.24), a fresh process
builds `tiny_config(model_type)` (on meta: no weights) behind a generated `package.module:factory` and runs
what a user runs:

    autoshard inspect --model <factory> --seq-len 64 --json
    autoshard plan --model <factory> --hardware h100 --devices 4 --global-batch 8 --seq-len 64 --json
    autoshard plan --model <factory> --hardware h100 --devices 4 --inference --prompt-len 64 --output-len 16 ...

(the CLI's `main` in that process, one after the other, against a cost-table cache fresh for the sweep).
Each class is one of:
* `ok`: inspect's `params` equal HF's `num_parameters()` and plan emits a plan;
* `refused`: a command ends in one clean line `autoshard <command>: error: ...` (exit 2, no traceback);
* `WRONG`: inspect's `params` differ from HF's: a silent wrong answer;
* `crash`: a Python traceback, or the process ran past `--timeout`, instead of a clean error.
The serving plan's outcome (ok / refused / crash, the same rules) is kept beside, as `serving`, and counted apart.

The table (model type -> status and one line of reason) goes to `bench/families_sweep.json`; `--types`
re-measures some classes and keeps the others' rows. Printed: the counts per status and the crash / WRONG list.

    python bench/bench_families.py                        # all classes, one at a time (2 shared cores)
    python bench/bench_families.py --types llama,bart --jobs 2
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

OUT = pathlib.Path(__file__).with_name("families_sweep.json")
INSPECT = ["inspect", "--seq-len", "64", "--json"]
PLAN = ["plan", "--hardware", "h100", "--devices", "4", "--global-batch", "8", "--seq-len", "64", "--json"]
SERVE = ["plan", "--hardware", "h100", "--devices", "4", "--inference", "--prompt-len", "64", "--output-len", "16",
         "--ttft-slo", "1", "--tpot-slo", "0.05"]
FACTORY = """from autoshard.models.tiny import build_tiny, tiny_config


def build():
    return build_tiny(tiny_config({model_type!r}), device="meta")
"""
# the child: HF's own count, then inspect and plan in-process; one JSON line per step on stdout
CHILD = r"""
import contextlib, io, json, sys, traceback
import torch
from autoshard.cli import main

model_type, factory = sys.argv[1], sys.argv[2]
inspect, plan, serve = (json.loads(a) for a in sys.argv[3:6])


def say(step, **row):
    print(json.dumps({"step": step, **row}), flush=True)


try:
    import importlib
    with torch.device("meta"):
        say("hf", params=importlib.import_module(factory.partition(":")[0]).build().num_parameters())
except Exception as e:
    say("hf", error=f"{type(e).__name__}: {e}")
for command, argv in (("inspect", inspect), ("plan", plan), ("serve", serve)):
    say("start", command=command)
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main([argv[0], "--model", factory, *argv[1:]])
    except SystemExit as e:  # argparse's own errors
        code = e.code if isinstance(e.code, int) else 1
    except BaseException as e:
        say(command, code=None, traceback=traceback.format_exc(), stderr=err.getvalue())
        continue
    say(command, code=code, stdout=out.getvalue(), stderr=err.getvalue())
"""


def _line(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _outcome(command: str, row: dict) -> tuple[str, str]:
    """(status, reason) of one command's row from the child."""
    if row.get("code") is None:
        last = [line for line in row["traceback"].strip().splitlines() if line.strip()][-1]
        return "crash", f"{command}: traceback: {_line(last)}"
    err = [line for line in row["stderr"].splitlines() if line.strip()]
    if row["code"] == 0:
        return "ok", ""
    clean = f"autoshard {'plan' if command == 'serve' else command}: error:"
    if row["code"] == 2 and err and err[-1].startswith(clean) and "Traceback" not in row["stderr"]:
        return "refused", f"{command}: {_line(err[-1][len(clean):])}"
    return "crash", f"{command}: exit {row['code']}: {_line(err[-1] if err else '(no stderr)')}"


def classify(rows: list[dict]) -> tuple[str, str]:
    """(status, one line of reason) from the child's steps; WRONG over crash over refused over ok."""
    steps = {row["step"]: row for row in rows}
    found = []
    for command in ("inspect", "plan"):
        if command in steps:
            found.append(_outcome(command, steps[command]))
    hf = steps.get("hf", {})
    if "inspect" in steps and found[0][0] == "ok":
        params = json.loads(steps["inspect"]["stdout"])["params"]
        if "params" in hf and params != hf["params"]:
            found.insert(0, ("WRONG", f"inspect params {params:,} != HF num_parameters() {hf['params']:,}"))
    for status in ("WRONG", "crash", "refused"):
        hits = [reason for s, reason in found if s == status]
        if hits:
            return status, hits[0]
    return "ok", f"params {json.loads(steps['inspect']['stdout'])['params']:,}; plan emitted"


def measure(model_type: str, *, workdir: pathlib.Path, timeout: float) -> dict:
    """One class in a fresh process: {"status", "reason", "seconds"}."""
    module = "sweep_" + "".join(c if c.isalnum() else "_" for c in model_type)
    (workdir / f"{module}.py").write_text(FACTORY.format(model_type=model_type))
    env = {**os.environ, "AUTOSHARD_CACHE_DIR": str(workdir / "cache"),
           "PYTHONPATH": os.pathsep.join(p for p in (str(workdir), os.environ.get("PYTHONPATH")) if p)}
    argv = [sys.executable, "-c", CHILD, model_type, f"{module}:build", json.dumps(INSPECT), json.dumps(PLAN),
            json.dumps(SERVE)]
    start = time.perf_counter()
    try:
        done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout)
        out, code = done.stdout, done.returncode
    except subprocess.TimeoutExpired as e:
        out, code = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), "timeout"
    seconds = round(time.perf_counter() - start, 1)
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{\"step\"")]
    finished = [r for r in rows if r["step"] in ("inspect", "plan")]
    why = f"timeout after {timeout:g} s" if code == "timeout" else f"process died (exit {code})"
    if len(finished) < 2:
        running = [r["command"] for r in rows if r["step"] == "start"]
        where = running[-1] if running else "building the model"
        status, reason = classify(rows) if finished else ("ok", "")
        if status not in ("WRONG", "crash"):
            status, reason = "crash", f"{where}: {why}"
        return {"status": status, "reason": reason, "seconds": seconds}
    status, reason = classify(rows)
    serve = next((r for r in rows if r["step"] == "serve"), None)
    serving = _outcome("serve", serve) if serve is not None else ("crash", f"serve: {why}")
    return {"status": status, "reason": reason, "seconds": seconds,
            "serving": {"status": serving[0], "reason": serving[1]}}


def main() -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", help="comma-separated model types (default: every causal-LM class)")
    parser.add_argument("--jobs", type=int, default=1, help="classes measured at once (default 1)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per class (inspect and both plans)")
    parser.add_argument("--out", type=pathlib.Path, default=OUT)
    args = parser.parse_args()
    every = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    types = args.types.split(",") if args.types else every
    unknown = [t for t in types if t not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES]
    if unknown:
        raise SystemExit(f"not causal-LM model types of this transformers: {', '.join(unknown)}")
    table = json.loads(args.out.read_text()) if args.types and args.out.exists() else {}
    with tempfile.TemporaryDirectory(prefix="autoshard-families-") as tmp:
        with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
            futures = {pool.submit(measure, t, workdir=pathlib.Path(tmp), timeout=args.timeout): t for t in types}
            for n, future in enumerate(concurrent.futures.as_completed(futures), 1):
                model_type, row = futures[future], future.result()
                table[model_type] = row
                print(f"[{n}/{len(types)}] {model_type:<28} {row['status']:<8} {row['seconds']:>5.1f} s  "
                      f"{row['reason'][:150]}", flush=True)
                args.out.write_text(json.dumps(dict(sorted(table.items())), indent=1) + "\n")
    counts = collections.Counter(row["status"] for row in table.values())
    print(f"\n{len(table)} classes: " + ", ".join(f"{s} {counts[s]}" for s in ("ok", "refused", "WRONG", "crash")))
    served = collections.Counter(row["serving"]["status"] for row in table.values()
                                 if row["status"] == "ok" and "serving" in row)
    print(f"serving (plan --inference) of the {counts['ok']} that plan: "
          + ", ".join(f"{s} {served[s]}" for s in ("ok", "refused", "crash")))
    for status in ("WRONG", "crash"):
        for model_type, row in sorted(table.items()):
            if row["status"] == status:
                print(f"  {status:<6} {model_type}: {row['reason']}")


if __name__ == "__main__":
    main()
