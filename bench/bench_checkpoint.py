"""What the shard digests cost on save and load (runtime/checkpoint.py), as a share of each.

A save hashes every file it wrote (sha256; each rank a share of the files) and records the digests in
autoshard.json; a load hashes them again (each rank a share) before DCP reads anything. On one spawned
world of 2 gloo ranks, a dp 2 LLaMA of bench_runtime's shape (widened by --hidden / --layers) with its
AdamW state is saved and loaded `--steps` times; each save and load is timed whole (between barriers),
and the digest pass inside it (`_digest_files` over the same files) is timed on its own, so the share
is median(digests) / median(whole). Only ratios mean anything; the milliseconds are this run's.

    python bench/bench_checkpoint.py [--steps 5] [--hidden 512] [--layers 8] ...  (bench_runtime's options)
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_pipeline import _timed  # noqa: E402
from bench_runtime import Options, _adamw, _batch, _model, parse_args  # noqa: E402

import autoshard  # noqa: E402
from autoshard.runtime import checkpoint  # noqa: E402


def _measure(opts: Options, root: Path) -> dict:
    ids, labels = _batch(opts)
    dm = autoshard.parallelize(_model(opts), ids, plan=dict(dp=2), global_batch=opts.batch, optimizer=_adamw(opts))
    dm.train_step(ids, labels)  # the optimizer state exists
    path = root / "ckpt"
    rows = {"save_s": [], "load_s": [], "digest_s": []}
    for _ in range(opts.steps):
        rows["save_s"].append(_timed(lambda: dm.save_checkpoint(path)))
        rows["load_s"].append(_timed(lambda: dm.load_checkpoint(path)))
        names = sorted(json.loads((path / checkpoint.META_FILE).read_text())["digests"])
        rows["digest_s"].append(_timed(lambda: checkpoint._digest_files(names, path, dm.device)))
    rows["bytes"] = sum((path / n).stat().st_size for n in names)
    return rows


def _worker(rank: int, world: int, store: str, opts: Options, root: str, out: str) -> None:
    torch.set_num_threads(opts.threads)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    try:
        rows = _measure(opts, Path(root))
        if rank == 0:
            Path(out).write_text(json.dumps(rows))
    finally:
        dist.destroy_process_group()


def main(argv=None) -> None:
    _, opts = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        mp.spawn(_worker, args=(2, os.path.join(tmp, "store"), opts, tmp, out), nprocs=2, join=True)
        rows = json.loads(Path(out).read_text())
    save, load, digest = (statistics.median(rows[k]) for k in ("save_s", "load_s", "digest_s"))
    print(f"llama: hidden {opts.hidden}, ffn {opts.ffn}, {opts.layers} layers, vocab {opts.vocab}; dp 2 on 2 gloo "
          f"ranks; checkpoint {rows['bytes'] / 1e6:.1f} MB; {opts.steps} saves and loads")
    print(f"save {1e3 * save:.0f} ms, load {1e3 * load:.0f} ms (medians); the digests alone {1e3 * digest:.0f} ms "
          f"({rows['bytes'] / 1e6 / digest:.0f} MB/s over 2 ranks)")
    print(f"digest share: {digest / save:.3f} of a save, {digest / load:.3f} of a load")


if __name__ == "__main__":
    main()
