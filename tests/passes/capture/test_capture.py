"""capture_model on the real tiny HF models: the joint graph reproduces eager loss, logits, gradients."""

import resource

import pytest
import torch
from torch import nn

from autoshard.errors import CaptureError
from autoshard.models import build_model, get_spec
from autoshard.passes.capture.capture import BWD, FWD, RepeatedBlock, capture_model


def _run_captured(cap, model, *inputs):
    params = [p.detach() for p in model.parameters()]
    return cap.graph_module(*params, *model.buffers(), *inputs)


@pytest.mark.parametrize("name,seq", [("llama-tiny", 24), ("mamba2-tiny", 40)])
def test_joint_graph_reproduces_eager_loss_logits_and_gradients(name, seq):
    model = build_model(get_spec(name, layers=2))
    ids = torch.randint(0, model.config.vocab_size, (2, seq), generator=torch.Generator().manual_seed(1))
    labels = torch.roll(ids, 1, dims=1)
    cap = capture_model(model, (ids, labels))
    assert cap.param_names == tuple(n for n, _ in model.named_parameters())
    assert cap.outputs[:2] == ("loss", "logits") and len(cap.outputs) == 2 + len(cap.param_names)

    loss, logits, *grads = _run_captured(cap, model, ids, labels)
    ref = model(ids, labels=labels)
    ref_grads = torch.autograd.grad(ref.loss, list(model.parameters()))
    torch.testing.assert_close(loss, ref.loss)
    torch.testing.assert_close(logits, ref.logits)
    for pname, g, r in zip(cap.param_names, grads, ref_grads):
        torch.testing.assert_close(g, r, msg=lambda m: f"{pname}: {m}")


def test_sites_name_module_path_block_and_phase():
    model = build_model(get_spec("llama-tiny"), device="meta")
    cap = capture_model(model, (torch.zeros(2, 16, dtype=torch.long),))
    assert cap.repeated == (RepeatedBlock(prefix="model.layers", count=4, cls="LlamaDecoderLayer"),)
    sites = [cap.site(n) for n in cap.call_nodes()]
    assert all(s.phase in (FWD, BWD) for s in sites)
    # forward nodes come first, then backward nodes; every layer has both
    phases = [s.phase for s in sites]
    assert phases == sorted(phases, key=lambda p: p == BWD)
    for layer in range(4):
        fwd = {s.module_path for s in sites if s.block == layer and s.phase == FWD}
        bwd = {s.module_path for s in sites if s.block == layer and s.phase == BWD}
        assert f"model.layers.{layer}.self_attn.q_proj" in fwd and f"model.layers.{layer}.mlp.down_proj" in bwd
        assert all(p.startswith(f"model.layers.{layer}") for p in fwd | bwd)
    assert any(s.module_path == "lm_head" and s.phase == BWD for s in sites)
    assert all(s.block is None for s in sites if not s.module_path.startswith("model.layers."))


def test_forward_only_capture_reproduces_logits():
    model = build_model(get_spec("llama-tiny", layers=1))
    ids = torch.randint(0, model.config.vocab_size, (1, 12))
    cap = capture_model(model, (ids,), joint=False)
    assert cap.outputs == ("logits",)
    assert all(cap.site(n).phase == FWD for n in cap.call_nodes())
    (logits,) = _run_captured(cap, model, ids)
    torch.testing.assert_close(logits, model(ids).logits)


def test_meta_model_captures_without_allocating_weights():
    # two llama-70b layers plus its 128256 x 8192 embedding and head: 7.6 GB of fp32 weights if real
    model = build_model(get_spec("llama-70b", layers=2), device="meta")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    cap = capture_model(model, (torch.zeros(1, 32, dtype=torch.long),))
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mb < 1000, f"capture grew the peak RSS by {grown_mb:.0f} MB"
    assert len(cap.param_names) == len(list(model.parameters()))


class _DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.gate = _Gate()

    def forward(self, input_ids, labels=None):
        return self.gate(self.proj(input_ids.float()))


class _Gate(nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # data-dependent Python branch: cannot be traced on fake tensors
            return x
        return -x


def test_untraceable_model_names_the_module_and_construct():
    with pytest.raises(CaptureError) as err:
        capture_model(_DataDependent(), (torch.zeros(2, 8, dtype=torch.long),), joint=False)
    msg = str(err.value)
    assert "'gate'" in msg and "_Gate" in msg and "data-dependent" in msg


class _Looped(nn.Module):
    """Runs its stack of layers twice; each layer keeps its keys between calls, as HF's KV cache does (Dory's looped
    layers), so its second call fails."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([_Keeping(), _Keeping()])

    def forward(self, input_ids, labels=None):
        x, cache = input_ids.float(), {}
        for _ in range(2):
            for i, layer in enumerate(self.layers):
                x = layer(x, cache.setdefault(i, []))
        return x


class _Keeping(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x, cache):
        keys = torch.cat([*cache, x], dim=-1)  # (B, 8 x calls)
        cache.append(x)
        return self.proj(x) + keys  # the second call: (B, 8) + (B, 16)


def test_a_layer_called_twice_is_named_in_the_refusal():
    with pytest.raises(CaptureError) as err:
        capture_model(_Looped(), (torch.zeros(2, 8, dtype=torch.long),), joint=False)
    assert "calls 'layers.0' 2 times" in str(err.value) and "looped or recurrent stack" in str(err.value)


def test_bad_arguments_are_capture_errors():
    model = build_model(get_spec("llama-tiny", layers=1), device="meta")
    with pytest.raises(CaptureError, match="mode"):
        capture_model(model, (torch.zeros(1, 4, dtype=torch.long),), mode="real")
    with pytest.raises(CaptureError, match="example_inputs"):
        capture_model(model, ())
