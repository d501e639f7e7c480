"""Checkpoints reshard across plans and world sizes: save under one plan, load under another, train on,
and the weights equal an uninterrupted single-process run. Each world size is spawned once.

The chain: 4 ranks train 2 steps under dp 2 x tp 2 and save `a`; still on 4 ranks, `a` is loaded
under dp 4 ZeRO-1 (flat optimizer shards) and saved again as `b`, which is resumed under dp 4 ZeRO-1
and dp 2 x tp 2 ZeRO-3. 2 ranks resume `b` under pp 2 and `a` under dp 2 ZeRO-2, and load `a` under
dp 2 ZeRO-3 (FSDP2) to save it as `c`; 1 rank resumes `c` with a plain optimizer. Every resumed run
takes steps 3-4 and ends with the weights of 4 uninterrupted single-process steps. A bf16-mixed run
(2 ranks) saves its fp32 masters, which tp 2, ZeRO-2 and fp32 plans load exactly.
"""

from __future__ import annotations

import functools
import os
import shutil

import pytest
import torch
from torch.testing import assert_close

import autoshard
from autoshard.errors import CheckpointError
from autoshard.models.presets import build_model, get_spec
from tests.runtime.dist_harness import run_ranks
from tests.runtime.equivalence import ADAM, TOL, batches, reference

PRESET, BATCH, SEQ, STEPS, SAVED_AT = "llama-tiny", 8, 16, 4, 2
ADAMW = functools.partial(torch.optim.AdamW, **ADAM)


def _setup():
    spec = get_spec(PRESET)
    data = batches(spec.vocab, global_batch=BATCH, seq=SEQ, steps=STEPS)
    return spec, data


def _parallel(spec, data, plan, *, preset=None, seed=0):
    model = build_model(get_spec(preset) if preset else spec, seed=seed)
    return autoshard.parallelize(model, data[0][0], plan=plan, global_batch=BATCH, optimizer=ADAMW)


def _resume_and_check(spec, data, plan, path, ref, *, seed=7):
    """Load `path` into a model initialised differently, train the remaining steps, compare with `ref`."""
    dm = _parallel(spec, data, plan, seed=seed)
    assert dm.load_checkpoint(path) == SAVED_AT
    for ids, labels in data[SAVED_AT:]:
        dm.train_step(ids, labels)
    state = dm.full_state_dict()
    for name, param in ref.named_parameters():
        assert_close(state[name], param.detach(), **TOL, msg=lambda m: f"{plan} from {path}: {name}: {m}")
    return dm


def _world4(rank, world, root):
    spec, data = _setup()
    ref, _, _ = reference(spec, data)
    dm = _parallel(spec, data, dict(dp=2, tp=2, micro_batch=2))
    for ids, labels in data[:SAVED_AT]:
        dm.train_step(ids, labels)
    dm.save_checkpoint(os.path.join(root, "a"))
    zero1 = _parallel(spec, data, dict(dp=4, zero=1), seed=3)
    assert zero1.load_checkpoint(os.path.join(root, "a")) == SAVED_AT
    zero1.save_checkpoint(os.path.join(root, "b"))  # the sharded optimizer's state, in global terms
    _resume_and_check(spec, data, dict(dp=4, zero=1), os.path.join(root, "b"), ref)
    _resume_and_check(spec, data, dict(dp=2, tp=2, zero=3), os.path.join(root, "b"), ref)


def _world2(rank, world, root):
    spec, data = _setup()
    ref, _, _ = reference(spec, data)
    _resume_and_check(spec, data, dict(pp=2, micro_batch=2), os.path.join(root, "b"), ref)
    _resume_and_check(spec, data, dict(dp=2, zero=2, micro_batch=2), os.path.join(root, "a"), ref)
    zero3 = _parallel(spec, data, dict(dp=2, zero=3), seed=3)
    assert zero3.load_checkpoint(os.path.join(root, "a")) == SAVED_AT
    zero3.save_checkpoint(os.path.join(root, "c"))  # FSDP2's DTensor shards, in global terms
    _bf16_masters(spec, data, os.path.join(root, "m"))


def _bf16_masters(spec, data, path):
    """bf16-mixed saves the fp32 masters, not the bf16 parameters: any plan (fp32 too) loads them exactly,
    and the same plan resumed takes the very steps of the uninterrupted run."""
    bf16 = dict(precision="bf16-mixed")
    src = _parallel(spec, data, dict(dp=2, zero=1, **bf16))
    for ids, labels in data[:SAVED_AT]:
        src.train_step(ids, labels)
    masters = src.full_state_dict()
    assert all(t.dtype == torch.float32 for t in masters.values())
    assert any(not torch.equal(t, t.bfloat16().float()) for t in masters.values())  # not bf16 values
    src.save_checkpoint(path)
    for plan in (dict(tp=2, **bf16), dict(dp=2, zero=2, micro_batch=2, **bf16), dict(dp=2)):
        dm = _parallel(spec, data, plan, seed=3)
        assert dm.load_checkpoint(path) == SAVED_AT
        state = dm.full_state_dict()
        for name, tensor in masters.items():
            assert torch.equal(state[name], tensor), f"{plan}: {name} not the saved master"
    resumed = _parallel(spec, data, dict(dp=2, zero=1, **bf16), seed=3)
    resumed.load_checkpoint(path)
    for ids, labels in data[SAVED_AT:]:
        assert torch.equal(resumed.train_step(ids, labels), src.train_step(ids, labels))
    after, expected = resumed.full_state_dict(), src.full_state_dict()
    for name, tensor in expected.items():
        assert torch.equal(after[name], tensor), f"resumed bf16-mixed run differs at {name}"


def _world1(rank, world, root):
    spec, data = _setup()
    ref, _, _ = reference(spec, data)
    a = os.path.join(root, "a")
    dm = _resume_and_check(spec, data, dict(dp=1), os.path.join(root, "c"), ref)

    # HF export: from_pretrained gives the same logits
    from transformers import AutoModelForCausalLM

    dm.save_pretrained(os.path.join(root, "hf"))
    hf = AutoModelForCausalLM.from_pretrained(os.path.join(root, "hf"))
    with torch.no_grad():
        assert_close(hf(data[0][0]).logits, dm(data[0][0]), **TOL)

    # a crash during a save leaves the previous checkpoint loadable
    import torch.distributed.checkpoint as dcp

    real_save = dcp.save

    def crash(state, **kwargs):
        real_save({k: v for k, v in list(state.items())[:3]}, **kwargs)
        raise KeyboardInterrupt("killed during save")

    dcp.save = crash
    try:
        with pytest.raises(KeyboardInterrupt):
            dm.save_checkpoint(a)
    finally:
        dcp.save = real_save
    assert _parallel(spec, data, dict(dp=1)).load_checkpoint(a) == SAVED_AT
    # ... and so does one between the two renames (the old checkpoint moved aside, the new not yet in place)
    moved = os.path.join(root, "moved")
    shutil.copytree(a, os.path.join(root, ".moved.old"))
    assert _parallel(spec, data, dict(dp=1)).load_checkpoint(moved) == SAVED_AT

    # another model: both sides named
    mamba = _parallel(spec, data, dict(dp=1), preset="mamba2-tiny")
    with pytest.raises(CheckpointError, match=r"another model: it holds .* \(fingerprint \w+, \d+ parameters\), this is .* \(fingerprint \w+"):
        mamba.load_checkpoint(a)
    # a truncated data file: the file and both sizes named
    cut = os.path.join(root, "cut")
    shutil.copytree(a, cut)
    data_file = next(f for f in sorted(os.listdir(cut)) if f.endswith(".distcp"))
    size = os.path.getsize(os.path.join(cut, data_file))
    os.truncate(os.path.join(cut, data_file), size // 2)
    with pytest.raises(CheckpointError, match=rf"truncated: {data_file} has {size // 2} bytes"):
        dm.load_checkpoint(cut)
    with pytest.raises(CheckpointError, match="not an autoshard checkpoint"):
        dm.load_checkpoint(os.path.join(root, "hf"))
    _bad_calls(dm, spec, data, root)


def _bad_calls(dm, spec, data, root):
    """QA probes at a world of one: each a one-line autoshard error, not a bare TypeError / OSError."""
    from autoshard.errors import InvalidConfigError

    a_file = os.path.join(root, "a_file")
    with open(a_file, "w") as f:
        f.write("not a directory")
    for call, what in ((dm.save_checkpoint, "save_checkpoint"), (dm.save_pretrained, "save_pretrained")):
        with pytest.raises(CheckpointError, match=f"{what} writes a directory, but .*a_file is a file"):
            call(a_file)
    with pytest.raises(CheckpointError, match="load_checkpoint takes a directory path .*got None"):
        dm.load_checkpoint(None)
    prompt = data[0][0][:2]
    for bad in ("3", 2.5, True, -1):
        with pytest.raises(InvalidConfigError, match=f"max_new_tokens must be an integer >= 0, got {bad!r}"):
            dm.generate(prompt, max_new_tokens=bad)
    with pytest.raises(InvalidConfigError, match="the optimizer factory returned NoneType, expected a torch.optim"):
        autoshard.parallelize(build_model(spec), data[0][0], plan=dict(dp=1), optimizer=lambda params: None)


def test_checkpoint_reshards_across_plans_and_world_sizes(tmp_path):
    run_ranks(4, _world4, str(tmp_path))
    run_ranks(2, _world2, str(tmp_path))
    run_ranks(1, _world1, str(tmp_path))
