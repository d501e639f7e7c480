"""`plan --inference --emit vllm|sglang` and `price --inference`.

Neither engine installs on a CPU machine with pip (both pin CUDA builds of torch and kernels), so the
launch commands are checked against their documented flags: vLLM's engine arguments (docs.vllm.ai,
"Engine Arguments"; disaggregated prefill: docs/features/disagg_prefill.md) and SGLang 0.5.23's
server arguments (sglang/srt/server_args.py and its arg_groups/fields). Where SGLang's own parser is
importable (its wheel with --no-deps plus msgspec, pybase64, starlette, pyzmq) it parses them too."""

from __future__ import annotations

import json


from autoshard.cli import main
from autoshard.engines.serving import commands
from autoshard.inference_plan import InferencePlan, Pool

VLLM_FLAGS = {"--tensor-parallel-size", "--pipeline-parallel-size", "--data-parallel-size", "--enable-expert-parallel",
              "--max-num-seqs", "--max-model-len", "--kv-transfer-config"}
SGLANG_FLAGS = {"--model-path", "--tp-size", "--pp-size", "--ep-size", "--dp-size", "--enable-dp-attention",
                "--max-running-requests", "--context-length", "--disaggregation-mode",
                "--disaggregation-transfer-backend"}


def _plan(pools) -> InferencePlan:
    return InferencePlan(model="mixtral-8x7b", fingerprint="", hardware="h100", devices=sum(p.devices for p in pools),
                         prompt_len=2048, output_len=256, ttft_slo_s=1.0, tpot_slo_s=0.05, pools=tuple(pools))


DISAGG = _plan([Pool(role="prefill", tp=1, pp=1, ep=2, replicas=2, batch=8), Pool(role="decode", tp=2, pp=2, replicas=3, batch=64)])


def _flags(words) -> dict:
    out, i = {}, 0
    while i < len(words):
        if words[i].startswith("--"):
            value = words[i + 1] if i + 1 < len(words) and not words[i + 1].startswith("--") else True
            out[words[i]] = value
            i += 1 if value is True else 2
        else:
            i += 1
    return out


def test_vllm_commands_use_documented_flags():
    prefill, decode = commands("vllm", DISAGG, model_path="/models/mixtral")
    assert prefill.words[:3] == ("vllm", "serve", "/models/mixtral")
    for launch in (prefill, decode):
        assert set(_flags(launch.words)) <= VLLM_FLAGS
    p, d = _flags(prefill.words), _flags(decode.words)
    assert (p["--data-parallel-size"], p["--enable-expert-parallel"], p["--max-num-seqs"], prefill.copies) == ("2", True, "4", 2)
    assert (d["--tensor-parallel-size"], d["--pipeline-parallel-size"], d["--data-parallel-size"], d["--max-num-seqs"],
            d["--max-model-len"]) == ("2", "2", "3", "64", "2304")
    assert json.loads(p["--kv-transfer-config"])["kv_role"] == "kv_producer"
    assert json.loads(d["--kv-transfer-config"])["kv_role"] == "kv_consumer"


def test_sglang_commands_use_its_flags():
    prefill, decode = commands("sglang", DISAGG, model_path="/models/mixtral")
    for launch in (prefill, decode):
        assert set(_flags(launch.words)) <= SGLANG_FLAGS
    p, d = _flags(prefill.words), _flags(decode.words)
    assert (p["--tp-size"], p["--ep-size"], p["--dp-size"], p["--disaggregation-mode"]) == ("2", "2", "2", "prefill")
    assert (d["--tp-size"], d["--pp-size"], d["--dp-size"], d["--max-running-requests"], d["--context-length"],
            d["--disaggregation-mode"]) == ("2", "2", "3", "64", "2304", "decode")
    try:
        import argparse

        from sglang.srt.server_args import ServerArgs
    except ImportError:
        return  # SGLang not importable here: the documented flags above are the check
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(list(decode.words[3:]))
    assert (args.tp_size, args.pp_size, args.dp_size, args.max_running_requests, args.context_length,
            args.disaggregation_mode) == (2, 2, 3, 64, 2304, "decode")


def test_plan_emit_vllm_and_price_inference(capsys):
    serve = ["--model", "llama-tiny", "--hardware", "h100", "--devices", "2", "--inference", "--prompt-len", "64",
             "--output-len", "16"]
    assert main(["plan", *serve, "--ttft-slo", "1", "--tpot-slo", "0.05", "--emit", "vllm"]) == 0
    out = capsys.readouterr().out
    assert "vllm serve ./llama-tiny" in out and "--max-model-len 80" in out
    assert main(["price", *serve, "--tp", "2", "--batch", "4", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["layout"]["tp"] == 2 and got["layout"]["ttft_s"] > 0 and got["layout"]["tpot_s"] > 0
    assert got["best"]["throughput_ratio"] >= 1.0  # the best plan meets the layout's own latencies, at least as fast
    assert main(["price", *serve, "--tp", "2", "--batch", "4", "--zero", "1"]) == 2
    assert "--zero" in capsys.readouterr().err
    assert main(["plan", *serve[:6], "--global-batch", "8", "--seq-len", "64", "--emit", "vllm"]) == 2
    assert "--inference" in capsys.readouterr().err
