"""Every example runs (CI runs them through this file): torchrun ones on gloo, the rest in-process."""

from __future__ import annotations

import os
import re
import runpy
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def _torchrun(nproc: int, script: str, *args: str, timeout: int = 600) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(EXAMPLES / script), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return done.stdout


def _losses(out: str) -> list[float]:
    return [float(x) for x in re.findall(r"loss (\d+\.\d+)", out)]


def _run_in_process(script: str, *args: str, monkeypatch) -> None:
    monkeypatch.setattr(sys, "argv", [script, *args])
    runpy.run_path(str(EXAMPLES / script), run_name="__main__")


def test_train_llama_example(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    losses = _losses(_torchrun(4, "train_llama.py", "--plan", "dp=2,tp=2", "--steps", "3", "--checkpoint", ckpt))
    assert len(losses) == 3 and losses[-1] < losses[0]
    assert (tmp_path / "ckpt" / "autoshard.json").is_file()


def test_train_mamba2_example():
    losses = _losses(_torchrun(4, "train_mamba2.py", "--plan", "dp=2,tp=2", "--steps", "3"))
    assert len(losses) == 3 and losses[-1] < losses[0]


def test_train_mixtral_example():
    out = _torchrun(2, "train_mixtral.py", "--plan", "ep=2", "--aux-loss", "--steps", "3")
    losses = _losses(out)
    assert "2 experts per rank" in out and len(losses) == 3 and losses[-1] < losses[0]


def test_compile_backend_example():
    losses = _losses(_torchrun(2, "compile_backend.py", "--plan", "dp=2", "--steps", "2"))
    assert len(losses) == 2


def test_plan_offline_example(tmp_path, monkeypatch, capsys):
    plan = tmp_path / "plan.json"
    _run_in_process("plan_offline.py", "plan", "--devices", "2", "--out", str(plan), monkeypatch=monkeypatch)
    assert plan.is_file() and "mesh" in capsys.readouterr().out
    losses = _losses(_torchrun(2, "plan_offline.py", "run", str(plan), "--steps", "2"))
    assert len(losses) == 2


def test_paper_case_study_example(tmp_path, monkeypatch, capsys):
    png = tmp_path / "case.png"
    _run_in_process("paper_case_study.py", "--plot", str(png), monkeypatch=monkeypatch)
    out = capsys.readouterr().out
    assert png.stat().st_size > 10_000
    assert "predicted best: dp4 pp2" in out
    if "pairs ordered as measured" in out:
        agree, total = map(int, re.search(r"pairs ordered as measured: (\d+)/(\d+)", out).groups())
        assert agree >= 0.9 * total


def test_serve_plan_example(tmp_path, monkeypatch, capsys):
    plan = tmp_path / "serve.json"
    _run_in_process("serve_plan.py", "plan", "--out", str(plan), monkeypatch=monkeypatch)
    assert plan.is_file() and "TPOT" in capsys.readouterr().out
    import json

    pool = json.loads(plan.read_text())["pools"][-1]
    out = _torchrun(pool["tp"] * pool["pp"] * pool["ep"], "serve_plan.py", "run", str(plan))
    assert "matches HF generate: True" in out
