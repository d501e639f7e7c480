"""Price what runs: the bytes a rank keeps after a training step equal the cost model's, bf16-mixed
and fp32 (what CPU / gloo runs).

Each rank measures the tensors it holds once a step is done (distinct storages, so views such as
the main gradients inside their bucket buffer count once): weights (the parameters, ZeRO-3: their
FSDP2 shards), gradients (`.grad`, the main gradients and every flat buffer the gradient sync still
holds: its buckets, reduce-scatter outputs and reduced slices; FSDP2's gradient shards under ZeRO-3)
and optimizer (fp32 master weights where they are a copy, and Adam m, v; scalar `step` counters
left out). Each part must equal `cost.estimate(...).memory` for the same plan: the cost model's
`state_bytes` on its own per-rank parameter count (passes/sharding.py).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

import autoshard
from autoshard.hardware import load_hardware
from autoshard.ir import Mesh
from autoshard.models.presets import build_model, get_spec
from autoshard.passes.cost import Layout, compile_table, estimate
from autoshard.passes.shapes import build_cost_table

from tests.runtime.dist_harness import run_ranks
from tests.runtime.equivalence import ADAM, batches

PRESET, GLOBAL_BATCH, SEQ = "llama-tiny", 8, 16
PLANS = (  # world 2
    dict(dp=2, zero=0, precision="bf16-mixed"),
    dict(dp=2, zero=1, precision="bf16-mixed"),
    dict(dp=2, zero=2, micro_batch=2, precision="bf16-mixed"),
    dict(tp=2, precision="bf16-mixed"),
    # the optimizer shards over dp x cp (Megatron's distributed optimizer under CP)
    dict(cp=2, zero=1, precision="bf16-mixed"),
    dict(dp=2, zero=3, precision="bf16-mixed"),
    # fp32: the weights are their own masters (ZeRO-1/2 step slices of their flat buffer in place)
    dict(dp=2, zero=0, precision="fp32"),
    dict(dp=2, zero=1, micro_batch=2, precision="fp32"),
    dict(dp=2, zero=2, micro_batch=2, precision="fp32"),
)
PARTS = ("weights", "grads", "optimizer")


@functools.cache
def _table():
    spec = get_spec(PRESET)
    return compile_table(build_cost_table(spec), spec)


def priced(plan: dict) -> dict[str, float]:
    """The cost model's bytes per rank for `plan` (at its precision), by part."""
    spec = get_spec(PRESET)
    mesh = Mesh(dp=plan.get("dp", 1), tp=plan.get("tp", 1), cp=plan.get("cp", 1))
    layout = Layout(mesh=mesh, zero=plan.get("zero", 0), micro_batch=plan.get("micro_batch", 1),
                    precision=plan["precision"])
    memory = estimate(_table(), spec, load_hardware("h100"), layout, global_batch=GLOBAL_BATCH,
                      seq_len=SEQ).memory
    return {part: getattr(memory, part) for part in PARTS}


def measured(dm) -> dict[str, float]:
    """Bytes of the distinct storages of what `dm` keeps, by part (see the module docstring)."""
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731  (a DTensor: its shard)
    params = dm.local_params()
    opt = dm.optimizer
    masters = list(getattr(opt, "shards", ()))  # ShardedOptimizer: the fp32 masters
    inner = opt.optimizer if masters else opt
    state = [v for s in inner.state.values() for v in s.values() if isinstance(v, Tensor) and v.dim() > 0]
    groups = {"weights": params,
              "grads": [*(p.grad for p in params), *(getattr(p, "main_grad", None) for p in params),
                        *(m.grad for m in masters), *dm._sync.buffers()],  # what the gradient sync holds
              "optimizer": [*masters, *state]}
    seen, out = set(), {}
    for part in PARTS:
        total = 0
        for t in groups[part]:
            if t is None:
                continue
            storage = local(t).untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        out[part] = float(total)
    return out


def _measure_all(rank: int, world: int, expected: list[dict[str, float]]) -> None:
    spec = get_spec(PRESET)
    data = batches(spec.vocab, global_batch=GLOBAL_BATCH, seq=SEQ, steps=1)
    for plan, price in zip(PLANS, expected):
        dm = autoshard.parallelize(build_model(spec, seed=0), data[0][0], plan=plan,
                                   global_batch=GLOBAL_BATCH, optimizer=functools.partial(torch.optim.AdamW, **ADAM))
        dm.train_step(*data[0])
        got = measured(dm)
        assert got == price, f"{plan} rank {rank}: the runtime keeps {got} bytes, the cost model prices {price}"


def test_a_rank_keeps_what_the_cost_model_prices():
    expected = [priced(plan) for plan in PLANS]
    # bf16-mixed at ZeRO 0-2: 2 B weights + 4 B main grads + 12 B masters and Adam, sharded as ZeRO says
    n = expected[0]["weights"] / 2
    assert expected[0] == dict(weights=2 * n, grads=4 * n, optimizer=12 * n)
    assert expected[2] == dict(weights=2 * n, grads=4 * n / 2, optimizer=12 * n / 2)
    assert expected[4] == expected[1]
    assert expected[5] == dict(weights=4 * n / 2, grads=4 * n / 2, optimizer=8 * n / 2)  # FSDP2: fp32 shards
    # fp32 at ZeRO 0-2: 4 B weights + 4 B gradients + 8 B Adam (no master copy), sharded as ZeRO says
    assert expected[6] == dict(weights=4 * n, grads=4 * n, optimizer=8 * n)
    assert expected[7] == dict(weights=4 * n, grads=4 * n, optimizer=8 * n / 2)
    assert expected[8] == dict(weights=4 * n, grads=4 * n / 2, optimizer=8 * n / 2)
    run_ranks(2, _measure_all, expected)
