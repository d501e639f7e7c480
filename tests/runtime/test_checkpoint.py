"""Checkpoints reshard across plans and world sizes: save under one plan, load under another, train on,
and the weights equal an uninterrupted single-process run. Each world size is spawned once.

The chain: 4 ranks train 2 steps under dp 2 x tp 2 and save `a`; still on 4 ranks, `a` is loaded
under dp 4 ZeRO-1 (flat optimizer shards) and saved again as `b`, which is resumed under dp 4 ZeRO-1
and dp 2 x tp 2 ZeRO-3. 2 ranks resume `b` under pp 2 and `a` under dp 2 ZeRO-2, and load `a` under
dp 2 ZeRO-3 (FSDP2) to save it as `c`; 1 rank resumes `c` with a plain optimizer. Every resumed run
takes steps 3-4 and ends with the weights of 4 uninterrupted single-process steps. A bf16-mixed run
(2 ranks) saves its fp32 masters, which tp 2, ZeRO-2 and fp32 plans load exactly.

Failures (2 ranks, in a mount namespace of their own where the system allows one: `unshare -m`):
saves into a read-only bind mount, a full tmpfs and a path through a file each end on every rank within
seconds with the same one-line CheckpointError naming the path and the cause; the previous checkpoint
still loads and training goes on. Shards corrupted in place (256 bytes, sizes unchanged: they loaded
silently before) or swapped are refused by their digests, naming the files, on every rank.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

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


def _world2(rank, world, root, mounted=False):
    spec, data = _setup()
    ref, _, _ = reference(spec, data)
    _failed_saves(rank, spec, data, root, mounted)
    _resume_and_check(spec, data, dict(pp=2, micro_batch=2), os.path.join(root, "b"), ref)
    _resume_and_check(spec, data, dict(dp=2, zero=2, micro_batch=2), os.path.join(root, "a"), ref)
    zero3 = _parallel(spec, data, dict(dp=2, zero=3), seed=3)
    assert zero3.load_checkpoint(os.path.join(root, "a")) == SAVED_AT
    zero3.save_checkpoint(os.path.join(root, "c"))  # FSDP2's DTensor shards, in global terms
    _bf16_masters(spec, data, os.path.join(root, "m"))


def _fails_alike(rank, fn, *needles):
    """fn() raises CheckpointError on this rank within seconds, with the same text as on the other ranks."""
    import torch.distributed as dist

    start = time.perf_counter()
    with pytest.raises(CheckpointError) as err:
        fn()
    took, text = time.perf_counter() - start, str(err.value)
    texts = [None] * dist.get_world_size()
    dist.all_gather_object(texts, text)
    assert len(set(texts)) == 1, f"rank {rank}: the ranks raised different errors: {texts}"
    assert "\n" not in text and took < 20, f"rank {rank}: {took:.1f} s: {text}"
    for needle in needles:
        assert needle in text, f"rank {rank}: {needle!r} not in {text}"


def _failed_saves(rank, spec, data, root, mounted):
    """Saves that cannot be written, and shards that are not what was saved (module docstring)."""
    import torch.distributed as dist

    dm = _parallel(spec, data, dict(dp=2))
    dm.train_step(*data[0])
    targets = [(os.path.join(root, "a_file", "ck"), "rank 0: NotADirectoryError [Errno 20] Not a directory")]
    if mounted:  # the previous checkpoint sits in the read-only directory: it must still load afterwards
        targets += [(os.path.join(root, "ro", "a"), "Read-only file system"),
                    (os.path.join(root, "full", "ck"), "no space left: ")]
    for target, cause in targets:
        _fails_alike(rank, lambda: dm.save_checkpoint(target), f"save_checkpoint {target} failed", cause)
        dm.train_step(*data[1])  # every rank still in step: training goes on
    if mounted:
        assert _parallel(spec, data, dict(dp=2), seed=3).load_checkpoint(os.path.join(root, "ro", "a")) == SAVED_AT
    dm.save_checkpoint(os.path.join(root, "after"))  # and a good save works after the failed ones
    damaged = {name: os.path.join(root, name) for name in ("corrupt", "swapped", "unverified")}
    shards = sorted(f for f in os.listdir(os.path.join(root, "a")) if f.endswith(".distcp"))  # 4: saved by tp2 x dp2
    if rank == 0:
        for path in damaged.values():
            shutil.copytree(os.path.join(root, "a"), path)
        for name in shards:  # 256 bytes in the middle, the size unchanged
            with open(os.path.join(damaged["corrupt"], name), "r+b") as f:
                f.seek(os.path.getsize(f.name) // 2)
                f.write(bytes(256))
        first, second = (os.path.join(damaged["swapped"], n) for n in shards[:2])
        os.rename(first, first + ".tmp"), os.rename(second, first), os.rename(first + ".tmp", second)
        meta_file = os.path.join(damaged["unverified"], "autoshard.json")  # a checkpoint of format 1: no digests,
        meta = json.loads(open(meta_file).read())                          # so DCP meets the damage itself
        meta.pop("digests"), meta.update(version=1)
        open(meta_file, "w").write(json.dumps(meta))
        with open(os.path.join(damaged["unverified"], shards[0]), "r+b") as f:
            f.write(bytes(4096))
    dist.barrier()
    loader = _parallel(spec, data, dict(dp=2), seed=3)
    _fails_alike(rank, lambda: loader.load_checkpoint(damaged["corrupt"]),
                 f"{len(shards)} of its {len(shards) + 1} files do not hold what was saved", *shards)
    _fails_alike(rank, lambda: loader.load_checkpoint(damaged["swapped"]), f"2 of its {len(shards) + 1} files",
                 f"{shards[0]}", f"{shards[1]}")
    _fails_alike(rank, lambda: loader.load_checkpoint(damaged["unverified"]), "cannot be read")
    assert loader.load_checkpoint(os.path.join(root, "a")) == SAVED_AT


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
    with pytest.raises(CheckpointError, match=rf"{data_file} is truncated: {size // 2} bytes, its metadata needs {size}"):
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


MOUNTS = ("mount --make-rprivate / && mount --bind {ro} {ro} && mount -o remount,ro,bind {ro} && "
          "mount -t tmpfs -o size=64k tmpfs {full}")


def _world2_mounted(root: Path) -> None:
    """_world2 on 2 ranks, in a mount namespace with `root/ro` read-only and `root/full` a full tmpfs when
    `unshare -m` works here (root, or CAP_SYS_ADMIN); else without those two cases (said on stderr)."""
    (root / "a_file").write_text("a file, not a directory")
    (root / "ro").mkdir()
    (root / "full").mkdir()
    shutil.copytree(root / "a", root / "ro" / "a")
    mounts = MOUNTS.format(ro=root / "ro", full=root / "full")
    if shutil.which("unshare") and subprocess.run(["unshare", "-m", "sh", "-c", mounts], capture_output=True).returncode == 0:
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
        done = subprocess.run(["unshare", "-m", "sh", "-c", f"{mounts} && exec {sys.executable} -m "
                               f"tests.runtime.test_checkpoint {root}"], env=env, capture_output=True, text=True)
        assert done.returncode == 0, (done.stdout + done.stderr)[-8000:]
        return
    print("no mount namespace here (unshare -m): the read-only and full-disk saves are not tried", file=sys.stderr)
    run_ranks(2, _world2, str(root), False)


def test_checkpoint_reshards_across_plans_and_world_sizes(tmp_path):
    run_ranks(4, _world4, str(tmp_path))
    _world2_mounted(tmp_path)
    run_ranks(1, _world1, str(tmp_path))


if __name__ == "__main__":  # _world2_mounted's job, inside the mount namespace
    run_ranks(2, _world2, sys.argv[1], True)
