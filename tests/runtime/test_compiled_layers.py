"""runtime/compiled.py: which runs compile their decoder layers, and compiled layers train like one process.

The CPU runs Dynamo and AOTAutograd with the "aot_eager" backend (Inductor's code generation is what
CUDA adds, and a C++ compile per test is too slow here); the equivalence is the usual one: loss,
every gradient and the weights after AdamW steps equal the single-process HF run."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

import autoshard
from autoshard.errors import InvalidConfigError
from autoshard.models.presets import get_spec
from autoshard.runtime.compiled import compile_backend
from tests.runtime.equivalence import TOL, _built, batches, optimizer_factory, reference


@pytest.mark.parametrize("setting, preset, device, expected", [
    (None, "llama-tiny", "cuda", "inductor"),  # auto: the fused kernels the GPU profiles price
    (None, "llama-tiny", "cpu", None),
    (None, "llama-tiny", "npu", None),
    (None, "mamba2-tiny", "cuda", None),  # Inductor cannot generate the SSD's cumulative sums (torch 2.11)
    (None, "mixtral-tiny", "cuda", None),  # data-dependent routing
    (False, "llama-tiny", "cuda", None),
    (True, "mamba2-tiny", "cpu", "inductor"),
    ("aot_eager", "llama-tiny", "cpu", "aot_eager"),
])
def test_compile_backend(setting, preset, device, expected):
    assert compile_backend(setting, get_spec(preset), device) == expected


def test_generation_replicas_stay_eager_unless_asked():
    spec = get_spec("llama-tiny")
    assert compile_backend(None, spec, "cuda", training=False) is None
    assert compile_backend(True, spec, "cuda", training=False) == "inductor"


def test_bad_compile_setting_is_named():
    with pytest.raises(InvalidConfigError, match="compile must be None"):
        compile_backend(3, get_spec("llama-tiny"), "cuda")


@pytest.fixture
def world_of_one():
    """parallelize creates this process's world of one; later tests expect none (they check that bad
    plans fail before any process group exists), so it goes when the test ends."""
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    torch._dynamo.reset()


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_compiled_layers_train_like_one_process(recompute, world_of_one):
    spec = get_spec("llama-tiny")
    data = batches(spec.vocab, global_batch=4, seq=16, steps=2)
    ref, ref_losses, ref_grads = reference(spec, data)
    dm = autoshard.parallelize(_built(spec, None), data[0][0], plan=dict(recompute=recompute), global_batch=4,
                               optimizer=optimizer_factory(), compile="aot_eager")
    assert all(layer._compiled_call_impl is not None for layer in dm.model.model.layers)
    for (ids, labels), expected in zip(data, ref_losses):
        assert_close(dm.train_step(ids, labels), expected, **TOL)
    grads = {n: p.grad for n, p in dm.model.named_parameters()}
    for name, p in ref.named_parameters():
        assert_close(grads[name], ref_grads[name], **TOL, msg=lambda m: f"grad {name}: {m}")
        assert_close(dm.model.get_parameter(name), p, **TOL, msg=lambda m: f"weight {name}: {m}")
