"""`autoshard plan --inference` / `autoshard show` end to end, and their one-line errors."""

import json

from autoshard.cli import main
from autoshard.inference_plan import InferencePlan

ARGS = ["plan", "--model", "llama-tiny", "--hardware", "h100", "--devices", "4", "--inference",
        "--prompt-len", "512", "--output-len", "64"]


def test_plan_inference_then_show(tmp_path, capsys):
    out, png = tmp_path / "serve.json", tmp_path / "serve.png"
    assert main([*ARGS, "--ttft-slo", "0.5", "--tpot-slo", "0.01", "--out", str(out), "--json",
                 "--plot", str(png)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["kind"] == "inference" and data["mesh"].keys() == {"dp", "pp", "tp", "cp", "ep"}
    pred = data["predicted"]
    assert pred["ttft_s"] <= 0.5 and pred["tpot_s"] <= 0.01 and pred["throughput_tokens_per_s"] > 0
    assert pred["memory_breakdown_gb"].keys() == {"weights", "cache", "activations"}
    assert data["batch"] >= 1 and "why" in data["solver"]["runner_up"]
    assert sum(p["tp"] * p["pp"] * p["replicas"] for p in data["pools"]) == 4
    assert InferencePlan.load(out).to_json() == json.loads(out.read_text())
    assert png.stat().st_size > 0
    assert main(["show", str(out)]) == 0
    shown = capsys.readouterr().out
    assert "TTFT" in shown and "runner-up" in shown and "pool" in shown


def test_unmeetable_targets_exit_2_with_one_line(capsys):
    assert main([*ARGS, "--ttft-slo", "1e-9", "--tpot-slo", "0.01"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "best reachable TTFT" in err and "binds" in err


def test_missing_inference_options_exit_2(capsys):
    assert main([*ARGS[:-4], "--ttft-slo", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--prompt-len" in err and "--tpot-slo" in err
    assert main(["plan", "--model", "llama-tiny", "--hardware", "h100", "--devices", "4"]) == 2
    assert "--global-batch" in capsys.readouterr().err


def test_plan_inference_for_a_mixture_of_experts(capsys):
    assert main(["plan", "--model", "mixtral-tiny", "--hardware", "h100", "--devices", "2", "--inference",
                 "--prompt-len", "128", "--output-len", "16", "--ttft-slo", "0.5", "--tpot-slo", "0.01",
                 "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["predicted"]["tpot_s"] <= 0.01
    assert "notes" not in data["solver"]  # ep is searched (generate slices the experts over ep)
    (pool,) = data["pools"] if data["mode"] == "colocated" else data["pools"][-1:]
    assert data["mesh"]["ep"] == pool["ep"] and pool["ep"] in (1, 2)


def test_plan_inference_prices_continuous_batching_at_a_request_rate(tmp_path, capsys):
    out = tmp_path / "serve.json"
    assert main([*ARGS, "--ttft-slo", "0.05", "--tpot-slo", "0.005", "--request-rate", "50", "--json",
                 "--out", str(out)]) == 0
    cont = json.loads(capsys.readouterr().out)["predicted"]["continuous_batching"]
    best = cont["best"]
    assert cont["request_rate"] == 50 and best["meets_slos"] and best["max_request_rate"] >= 50
    assert best["ttft_p50_s"] <= best["ttft_p99_s"] <= 0.05 and best["tpot_p50_s"] <= best["tpot_p99_s"] <= 0.005
    assert sum(r["tp"] * r["pp"] * r["ep"] * r["replicas"] for r in cont["layouts"]) == 4 * len(cont["layouts"])
    assert main(["show", str(out)]) == 0  # the plan file carries it; show prints it
    shown = capsys.readouterr().out
    assert "continuous batching at 50 requests/s" in shown and "p99" in shown and "sustains" in shown
    assert main(["plan", "--model", "llama-tiny", "--hardware", "h100", "--devices", "4", "--global-batch", "8",
                 "--seq-len", "128", "--request-rate", "5"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--request-rate" in err and "--inference" in err
