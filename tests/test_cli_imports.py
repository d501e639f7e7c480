"""`autoshard plan` of a preset whose cost table and fingerprint ship in the package (autoshard/shipped/)
imports neither torch nor transformers (issue 13 item 6: about 2 s of a fresh machine's plan), and the
public names that need torch (`autoshard.parallelize`, `backend`, `DistributedModel`) still load on use.

Each check runs in a fresh interpreter: this test process has torch loaded already."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

FORBIDDEN = ("torch", "transformers")
PLANS = (  # one per family (Mamba-2 reads the SSD kernel substitution's table); training and serving
    ["plan", "--model", "llama-tiny", "--hardware", "h100", "--devices", "8", "--global-batch", "16",
     "--seq-len", "256", "--json"],
    ["plan", "--model", "mamba2-tiny", "--hardware", "h100", "--devices", "4", "--global-batch", "8",
     "--seq-len", "256", "--json"],
    ["plan", "--model", "llama-tiny", "--hardware", "h100", "--devices", "4", "--inference", "--prompt-len",
     "128", "--output-len", "32", "--ttft-slo", "1", "--tpot-slo", "0.1", "--json"],
    ["sweep", "--model", "mamba2-tiny", "--hardware", "h100", "--devices", "4", "--global-batch", "8",
     "--seq-len", "256"],
)


def _fresh(code: str, cache_dir: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={**os.environ, "AUTOSHARD_CACHE_DIR": cache_dir})


def test_plan_of_a_shipped_preset_imports_neither_torch_nor_transformers():
    code = ("import contextlib, io, json, sys\n"
            "from autoshard.cli import main\n"
            "outs = []\n"
            f"for argv in {PLANS!r}:\n"
            "    buf = io.StringIO()\n"
            "    with contextlib.redirect_stdout(buf):\n"
            "        assert main(argv) == 0, argv\n"
            "    outs.append(buf.getvalue())\n"
            f"print(json.dumps([sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r}), outs]))")
    with tempfile.TemporaryDirectory(prefix="autoshard-empty-cache-") as empty:
        out = _fresh(code, empty)
        assert not any(Path(empty).rglob("*.json")), "a shipped preset was traced or cached, not read"
    loaded, outs = json.loads(out.stdout)
    assert loaded == [], f"planning a shipped preset imported {loaded[:8]}"
    assert json.loads(outs[0])["model"] == "llama-tiny" and json.loads(outs[1])["model"] == "mamba2-tiny"
    assert json.loads(outs[2])["model"] == "llama-tiny" and "mamba2-tiny" in outs[3]


def test_public_names_that_need_torch_load_on_use():
    code = ("import sys, autoshard\n"
            "before = 'torch' in sys.modules\n"
            "from autoshard import DistributedModel, backend\n"
            "from autoshard.api import parallelize\n"
            "from autoshard.runtime.dist_model import DistributedModel as D\n"
            "assert autoshard.parallelize is parallelize and DistributedModel is D and callable(backend)\n"
            "assert {'parallelize', 'backend', 'DistributedModel'} <= set(dir(autoshard))\n"
            "print(before)")
    with tempfile.TemporaryDirectory() as empty:
        assert _fresh(code, empty).stdout.strip() == "False"
