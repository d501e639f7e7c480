"""`autoshard price`: NVIDIA's published Llama-3.1-70B layout priced as it ran, a plan file priced to its own
prediction, sweep under a given schedule, and bad flags as one-line errors."""

from __future__ import annotations

import json

import pytest

from autoshard.cli import main


def _price(capsys, *argv):
    rc = main(["price", "--hardware", "h100", "--no-best", *argv])
    return rc, capsys.readouterr()


def test_nvidia_llama31_70b_layout_as_it_ran(capsys):
    # dgxc-benchmarking: 64 H100, TP4 PP4 CP2 VP5 SP, GBS 128, seq 8192, measured 14.66 s per step
    rc, out = _price(capsys, "--model", "llama-70b", "--devices", "64", "--global-batch", "128", "--seq-len", "8192",
                     "--tp", "4", "--pp", "4", "--cp", "2", "--virtual-stages", "5", "--sequence-parallel", "--json")
    assert rc == 0
    flags = json.loads(out.out)
    assert "interleaved-1f1b x5" in flags["layout"] and flags["predicted"]["fits"]
    assert flags["predicted"]["step_time_s"] == pytest.approx(14.66, rel=0.10)
    megatron = ("--tensor-model-parallel-size 4 --pipeline-model-parallel-size 4 --context-parallel-size 2 "
                "--num-layers-per-virtual-pipeline-stage 4 --sequence-parallel --micro-batch-size 1 "
                "--global-batch-size 128 --seq-length 8192 --use-distributed-optimizer --bf16 --lr 1e-4")
    rc, out = _price(capsys, "--model", "llama-70b", "--devices", "64", "--from-megatron", megatron, "--json")
    assert rc == 0
    assert json.loads(out.out)["predicted"]["step_time_s"] == pytest.approx(flags["predicted"]["step_time_s"], rel=1e-12)


@pytest.mark.parametrize("argv, names", [
    (["--devices", "64", "--dp", "2", "--tp", "4", "--pp", "4"], "--devices 64"),
    (["--devices", "64", "--tp", "4", "--pp", "4", "--virtual-stages", "3"], "--virtual-stages 3"),
    (["--devices", "64", "--from-megatron", "--tensor-model-parallel-size 4 --frobnicate 2"], "--frobnicate"),
    (["--devices", "64", "--tp", "4", "--from-megatron", "--tensor-model-parallel-size 4"], "--tp"),
    (["--devices", "64", "--pp", "4", "--sequence-parallel"], "--sequence-parallel"),
])
def test_bad_flags_are_one_line_errors(capsys, argv, names):
    rc, out = _price(capsys, "--model", "llama-70b", "--global-batch", "128", "--seq-len", "8192", *argv)
    assert rc == 2 and names in out.err and len(out.err.strip().splitlines()) == 1


def test_sweep_prices_the_schedule_asked_for(capsys):
    common = ["--model", "llama-70b", "--hardware", "h100", "--devices", "64", "--global-batch", "128", "--seq-len", "8192"]
    assert main(["sweep", *common, "--schedule", "interleaved-1f1b", "--virtual-stages", "5", "--zero", "1",
                 "--recompute", "none", "--sequence-parallel", "on", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    nemo = next(r for r in rows if (r["dp"], r["pp"], r["tp"], r["cp"]) == (2, 4, 4, 2))
    assert (nemo["schedule"], nemo["virtual_stages"]) == ("interleaved-1f1b", 5)
    rc, out = _price(capsys, *common[:1], "llama-70b", "--devices", "64", "--global-batch", "128", "--seq-len", "8192",
                     "--tp", "4", "--pp", "4", "--cp", "2", "--virtual-stages", "5", "--sequence-parallel", "--json")
    assert nemo["step_time_s"] == pytest.approx(json.loads(out.out)["predicted"]["step_time_s"], rel=1e-12)
    assert all(r["virtual_stages"] == 5 for r in rows if r["pp"] > 1)
    assert main(["sweep", *common, "--schedule", "1f1b", "--virtual-stages", "2"]) == 2
    assert "--virtual-stages" in capsys.readouterr().err


def test_price_a_plan_file_reproduces_its_prediction(capsys, tmp_path):
    plan = tmp_path / "plan.json"
    # a plan with recompute chosen per stage (priced from the planner's per-stage tables)
    assert main(["plan", "--model", "qwen2-moe", "--hardware", "ascend-910b", "--devices", "64", "--global-batch", "256",
                 "--seq-len", "2048", "--out", str(plan), "--json"]) == 0
    solved = json.loads(capsys.readouterr().out)
    assert len({st["recompute"] for st in solved["stages"]}) > 1
    predicted = solved["predicted"]["step_time_s"]
    assert main(["price", "--hardware", "ascend-910b", "--no-best", "--plan", str(plan), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["predicted"]["step_time_s"] == pytest.approx(predicted, rel=1e-12)
    rc, out = _price(capsys, "--plan", str(plan))  # h100
    assert rc == 2 and "--hardware h100" in out.err
