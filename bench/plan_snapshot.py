"""What users see, recorded so a refactor can be checked to change none of it.

`record DIR` runs the README's commands and an `autoshard plan` of every preset (training, and
serving for a few), a `sweep --json`, `show` and `inspect --json`, each in a fresh process with an
empty cost cache, and keeps every command's stdout and plan file under DIR. `compare A B` says,
file by file, whether two recordings are the same once timing fields are masked (`solve_time_s`
in plan JSON, the solver's and the serving search's seconds in the summary); it exits 1 naming each file that differs.

Run: python bench/plan_snapshot.py record /tmp/before   (on the old commit)
     python bench/plan_snapshot.py record /tmp/after    (on the new one)
     python bench/plan_snapshot.py compare /tmp/before /tmp/after
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

README_TRAIN = ["--model", "llama-7b", "--hardware", "ascend-910b", "--devices", "8", "--global-batch", "1024",
                "--seq-len", "4096"]
README_SERVE = ["--model", "llama-70b", "--hardware", "h100", "--devices", "8", "--inference", "--prompt-len", "2048",
                "--output-len", "256", "--ttft-slo", "1", "--tpot-slo", "0.05"]

# preset -> (hardware, devices, global batch, seq len): a size each preset is planned at in practice
TRAINING = {
    "llama-1b": ("h100", 8, 256, 2048),
    "llama-7b": ("ascend-910b", 8, 1024, 4096),
    "llama-13b": ("a100-80g", 16, 512, 4096),
    "llama-70b": ("h100", 64, 1024, 4096),
    "llama-tiny": ("cpu", 4, 8, 64),
    "mamba2-1b": ("h200", 8, 256, 2048),
    "mamba2-7b": ("ascend-910b", 16, 512, 4096),
    "mamba2-tiny": ("cpu", 2, 8, 64),
    "mixtral-8x7b": ("h100", 16, 256, 4096),
    "qwen2-moe": ("h200", 8, 256, 4096),
    "mixtral-tiny": ("cpu", 4, 8, 32),
    "qwen2-moe-tiny": ("cpu", 4, 8, 32),
}
SERVING = {  # preset -> (hardware, devices, prompt, output, ttft slo, tpot slo)
    "mamba2-7b": ("h200", 4, 1024, 256, 1, 0.05),
    "mixtral-8x7b": ("h100", 8, 2048, 256, 1, 0.05),
    "llama-tiny": ("cpu", 2, 32, 8, 10, 1),
}


def commands() -> dict[str, list[str]]:
    """name -> autoshard arguments; `{out}` stands for the plan file of that name."""
    cmds = {"readme-plan": ["plan", *README_TRAIN, "--out", "{out}"],
            "readme-serve": ["plan", *README_SERVE, "--out", "{out}"],
            "readme-plan-json": ["plan", *README_TRAIN, "--json"]}
    for name, (hw, n, gb, seq) in TRAINING.items():
        cmds[f"plan-{name}"] = ["plan", "--model", name, "--hardware", hw, "--devices", str(n),
                                "--global-batch", str(gb), "--seq-len", str(seq), "--out", "{out}"]
    for name, (hw, n, p, o, ttft, tpot) in SERVING.items():
        cmds[f"serve-{name}"] = ["plan", "--model", name, "--hardware", hw, "--devices", str(n), "--inference",
                                 "--prompt-len", str(p), "--output-len", str(o), "--ttft-slo", str(ttft),
                                 "--tpot-slo", str(tpot), "--out", "{out}"]
    cmds["sweep-llama-7b"] = ["sweep", *README_TRAIN, "--json"]
    cmds["sweep-mamba2-tiny"] = ["sweep", "--model", "mamba2-tiny", "--hardware", "cpu", "--devices", "4",
                                 "--global-batch", "8", "--seq-len", "64", "--json"]
    cmds["inspect-llama-tiny"] = ["inspect", "--model", "llama-tiny", "--json"]
    return cmds


def record(out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, args in commands().items():
        plan_file = out_dir / f"{name}.plan.json"
        argv = [a.replace("{out}", str(plan_file)) for a in args]
        _run(name, argv, out_dir)
        if plan_file.exists() and name.startswith(("readme-plan", "plan-", "readme-serve", "serve-")):
            _run(f"show-{name}", ["show", str(plan_file)], out_dir)


def _run(name: str, argv: list[str], out_dir: Path) -> None:
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, AUTOSHARD_CACHE_DIR=cache, COLUMNS="120")
        r = subprocess.run([sys.executable, "-m", "autoshard.cli", *argv], capture_output=True, text=True, env=env)
    text = r.stdout.replace(str(out_dir), "<DIR>")
    (out_dir / f"{name}.stdout").write_text(f"rc {r.returncode}\n{text}\n--- stderr\n{r.stderr.replace(str(out_dir), '<DIR>')}")
    print(f"{name}: rc {r.returncode}", flush=True)


TIMING_KEYS = {"solve_time_s"}
TIMING_TEXT = [(re.compile(r"(solver: [^,]+, gap [0-9.]+%, )[0-9.]+ s"), r"\1<T> s"),
               (re.compile(r"(points in )[0-9.]+ s"), r"\1<T> s"),
               (re.compile(r'"solve_time_s": [0-9.e+-]+'), '"solve_time_s": <T>')]


def _masked(path: Path) -> str:
    text = path.read_text()
    if path.name.endswith(".json"):
        return json.dumps(_drop_timing(json.loads(text)), indent=1, sort_keys=True)
    for pattern, repl in TIMING_TEXT:
        text = pattern.sub(repl, text)
    return text.rstrip()  # a progress line that a slow solve leaves on stderr ends in a bare newline


def _drop_timing(value):
    if isinstance(value, dict):
        return {k: _drop_timing(v) for k, v in value.items() if k not in TIMING_KEYS}
    if isinstance(value, list):
        return [_drop_timing(v) for v in value]
    return value


def compare(a: Path, b: Path) -> int:
    names = sorted({p.name for p in a.iterdir()} | {p.name for p in b.iterdir()})
    differ = [n for n in names if not (a / n).exists() or not (b / n).exists() or _masked(a / n) != _masked(b / n)]
    for n in differ:
        print(f"differs: {n}")
    print(f"{len(names) - len(differ)} of {len(names)} files the same (timing fields masked)")
    return 1 if differ else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="verb", required=True)
    sub.add_parser("record").add_argument("dir", type=Path)
    c = sub.add_parser("compare")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    args = parser.parse_args()
    if args.verb == "record":
        record(args.dir)
        return 0
    return compare(args.a, args.b)


if __name__ == "__main__":
    sys.exit(main())
