"""`autoshard inspect`: the table, --json, and one-line errors with exit code 2."""

import json

import pytest
import torch
from transformers import LlamaForCausalLM

from autoshard.cli import main
from autoshard.models import build_model, get_spec


def _inspect(capsys, *argv):
    code = main(["inspect", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_json_has_params_flops_and_blocks(capsys):
    code, out, err = _inspect(capsys, "--model", "llama-tiny", "--seq-len", "256", "--micro-batch", "2", "--json")
    assert code == 0, err
    data = json.loads(out)
    spec = get_spec("llama-tiny")
    n = build_model(spec, device="meta").num_parameters()
    assert data["params"] == n and isinstance(data["params"], int)
    assert [b["name"] for b in data["blocks"]] == ["embed", "layer", "head"]
    assert data["blocks"][1]["count"] == spec.layers
    expected = 6 * (n - spec.vocab * spec.hidden) + 12 * spec.layers * spec.hidden * 256
    assert data["flops_per_token"] == pytest.approx(expected, rel=0.05)
    assert data["model_flops_per_token"] == 6 * n + 12 * spec.layers * spec.hidden * 256
    assert sum(b["flops_per_token"] for b in data["blocks"]) == pytest.approx(data["flops_per_token"])
    assert 0 < data["blocks"][1]["matmul_share"] < 1 and data["saved_bytes_per_token"] > 0


def test_table_lists_blocks_and_totals(capsys):
    code, out, _ = _inspect(capsys, "--model", "llama-tiny", "--seq-len", "128")
    assert code == 0
    for word in ("embed", "layer", "head", "total", "FLOPs", "matmul", "saved"):
        assert word in out


@pytest.mark.parametrize("argv,needle", [
    (["--model", "llama-8x"], "unknown model preset 'llama-8x'"),
    (["--model", "llama-tiny", "--seq-len", "0"], "--seq-len must be a positive integer, got 0"),
    (["--model", "llama-tiny", "--micro-batch", "-3"], "--micro-batch must be a positive integer, got -3"),
    (["--model", "tests.test_cli_inspect:untraceable_llama"], "'model.layers.0.self_attn'"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, needle):
    code, out, err = _inspect(capsys, *argv)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("autoshard inspect: error:"), err
    assert needle in err and "Traceback" not in err


class _ItemAttention(torch.nn.Module):
    """Wraps an attention module with a data-dependent branch (what real code does with .item())."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, hidden_states, *args, **kwargs):
        if hidden_states.abs().max().item() > 1e4:
            hidden_states = hidden_states.clamp(-1e4, 1e4)
        return self.inner(hidden_states, *args, **kwargs)


class UntraceableLlama(LlamaForCausalLM):
    def __init__(self, config):
        super().__init__(config)
        for layer in self.model.layers:
            layer.self_attn = _ItemAttention(layer.self_attn)


def untraceable_llama():
    return UntraceableLlama(get_spec("llama-tiny", layers=1).hf_config())
