"""ZeRO-3 with optimizer offload and checkpoints on one CUDA device (NCCL, a world of one): the
offloaded run equals the single-process run, its optimizer state lives in host memory, and a
checkpoint saved under it resumes under a plain plan with the uninterrupted run's weights."""

from __future__ import annotations

import functools

import pytest
import torch
from torch.testing import assert_close

import autoshard
from autoshard.models.presets import build_model, get_spec
from tests.runtime.equivalence import ADAM, batches, reference

pytestmark = pytest.mark.gpu
GPU_TOL = dict(rtol=1e-3, atol=1e-4)  # cuBLAS and CPU sum in different orders


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_zero3_offload_and_checkpoint_on_cuda(tmp_path):
    spec = get_spec("llama-tiny")
    data = batches(spec.vocab, global_batch=8, seq=16, steps=4)
    ref, _, _ = reference(spec, data)
    adamw = functools.partial(torch.optim.AdamW, **ADAM)
    plan = dict(zero=3, offload_optimizer=True, precision="fp32")
    dm = autoshard.parallelize(build_model(spec, seed=0), data[0][0], plan=plan, global_batch=8, optimizer=adamw,
                               device="cuda:0")
    for ids, labels in data[:2]:
        dm.train_step(ids, labels)
    states = [s for s in dm.optimizer.state.values()]
    assert states and all(v.device.type == "cpu" for s in states for v in s.values() if v.dim() > 0)
    assert all(p.device.type == "cpu" for p in dm.model.parameters())  # the shards live in host memory
    dm.save_checkpoint(tmp_path / "ckpt")
    resumed = autoshard.parallelize(build_model(spec, seed=3), data[0][0], plan=dict(precision="fp32"),
                                    global_batch=8, optimizer=adamw, device="cuda:0")
    assert resumed.load_checkpoint(tmp_path / "ckpt") == 2
    for ids, labels in data[2:]:
        resumed.train_step(ids, labels)
    state = resumed.full_state_dict()
    for name, param in ref.named_parameters():
        assert_close(state[name].cpu(), param.detach(), **GPU_TOL, msg=lambda m: f"{name}: {m}")
