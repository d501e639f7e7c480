"""Price what runs: the bytes a rank keeps after a training step equal the cost model's, bf16-mixed
and fp32 (what CPU / gloo runs).

Each rank measures the tensors it holds once a step is done (distinct storages, so views such as
the main gradients inside their bucket buffer count once): weights (the parameters, ZeRO-3: their
FSDP2 shards), gradients (`.grad`, the main gradients and every flat buffer the gradient sync still
holds: its buckets, reduce-scatter outputs and reduced slices; FSDP2's gradient shards under ZeRO-3)
and optimizer (fp32 master weights where they are a copy, and Adam m, v; scalar `step` counters
left out). Each part must equal `cost.estimate(...).memory` for the same plan: the cost model's
`state_bytes` on its own per-rank parameter count (rules/sharding.py).

While a step runs (the second: the optimizer state exists), `Allocations` charges every allocation
to the code that made it; the peak of what the gradient sync and the ZeRO step (`GradSync`,
`ShardedOptimizer`) hold must equal `estimate(...).memory.buffers` (ZeRO-2's staging buckets, else 0).
One world of 2 runs both checks.
"""

from __future__ import annotations

import contextlib
import functools
import unittest.mock

import torch
from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import autoshard
from autoshard.hardware import load_hardware
from autoshard.ir import Mesh
from autoshard.models.presets import build_model, get_spec
from autoshard.passes.cost.compiled import compile_table
from autoshard.passes.cost.cost import estimate
from autoshard.passes.cost.layout import Layout
from autoshard.passes.capture.shapes import build_cost_table
from autoshard.runtime import data_parallel
from autoshard.runtime.data_parallel import GradSync, ShardedOptimizer

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
    # fp8 (torchao's Float8Linear, runtime/fp8.py): bf16-mixed's state; under ZeRO-3 the float8-gathered weights
    # are still FSDP2's fp32 shards
    dict(dp=2, zero=1, precision="fp8"),
    dict(dp=2, zero=3, precision="fp8"),
)
PARTS = ("weights", "grads", "optimizer")


@functools.cache
def _table(preset: str = PRESET):
    spec = get_spec(preset)
    return compile_table(build_cost_table(spec), spec)


def _memory(plan: dict, preset: str = PRESET):
    spec = get_spec(preset)
    mesh = Mesh(dp=plan.get("dp", 1), tp=plan.get("tp", 1), cp=plan.get("cp", 1))
    layout = Layout(mesh=mesh, zero=plan.get("zero", 0), micro_batch=plan.get("micro_batch", 1),
                    precision=plan["precision"])
    return estimate(_table(preset), spec, load_hardware("h100"), layout, global_batch=GLOBAL_BATCH,
                    seq_len=SEQ).memory


def priced(plan: dict) -> dict[str, float]:
    """The cost model's bytes per rank for `plan` (at its precision), by part."""
    memory = _memory(plan)
    return {part: getattr(memory, part) for part in PARTS}




def measured(dm) -> dict[str, float]:
    """Bytes of the distinct storages of what `dm` keeps, by part (see the module docstring)."""
    def local(t):  # a DTensor: its shard; torchao's float8-gather weight wrapper: the tensor it wraps
        t = t.to_local() if hasattr(t, "to_local") else t
        return getattr(t, "_tensor", t)

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


def _measure_all(rank: int, world: int, expected: list[dict[str, float]], built: dict) -> None:
    """Each plan's state after a step against the price; `built`: {repr(plan): a model that has run steps}."""
    spec = get_spec(PRESET)
    data = batches(spec.vocab, global_batch=GLOBAL_BATCH, seq=SEQ, steps=1)
    for plan, price in zip(PLANS, expected):
        dm = built.get(repr(plan))
        if dm is None:
            dm = autoshard.parallelize(build_model(spec, seed=0), data[0][0], plan=plan, global_batch=GLOBAL_BATCH,
                                       optimizer=functools.partial(torch.optim.AdamW, **ADAM))
            dm.train_step(*data[0])
        got = measured(dm)
        assert got == price, f"{plan} rank {rank}: the runtime keeps {got} bytes, the cost model prices {price}"


# -- transient peaks: what the gradient sync and the optimizer step allocate while a step runs --------------------

PEAK_PLANS = (*((PRESET, p) for p in PLANS if set(p) <= {"dp", "zero", "micro_batch", "precision"} and p.get("zero", 0) < 3
                 and p["precision"] != "fp8"),
              ("mamba2-tiny", dict(dp=2, zero=1, micro_batch=2, precision="fp32")),
              ("mamba2-tiny", dict(dp=2, zero=2, micro_batch=2, precision="fp32")))
SMALL_BUCKETS = 40_000  # parameters: llama-tiny's 217,664 in several buckets, to exercise the staging's reuse
SYNC_METHODS = {GradSync: ("_on_grad", "_launch", "begin", "finish", "_drain"), ShardedOptimizer: ("step",)}


class Allocations(TorchDispatchMode):
    """The peak bytes, per region of the code, of the storages that region allocated and still holds.

    Every op's outputs whose storage is none of its inputs' (an allocation, not a view or an in-place
    write) are charged to the innermost `region(...)` open at the time, if any; a storage counts until it
    is freed (weak references, polled at each charged allocation, when a peak can rise). Ops reach the
    mode on the autograd thread too (the gradient hooks); what a backend allocates inside a collective
    (gloo's own staging; NCCL works in place) is not a torch op and is not seen."""

    def __init__(self):
        super().__init__()
        self.stack: list[str] = []
        self.held: dict[int, tuple[StorageWeakRef, int, str]] = {}
        self.live: dict[str, int] = {}
        self.peak: dict[str, int] = {}

    @contextlib.contextmanager
    def region(self, name: str):
        self.stack.append(name)
        try:
            yield
        finally:
            self.stack.pop()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.stack:
            return out
        for key, (ref, size, name) in list(self.held.items()):
            if ref.expired():
                del self.held[key]
                self.live[name] -= size
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)}
        name = self.stack[-1]
        for t in tree_leaves(out):
            if not isinstance(t, Tensor):
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key in inputs or key in self.held or storage.nbytes() == 0:
                continue
            self.held[key] = (StorageWeakRef(storage), storage.nbytes(), name)
            self.live[name] = self.live.get(name, 0) + storage.nbytes()
            self.peak[name] = max(self.peak.get(name, 0), self.live[name])
        return out


@contextlib.contextmanager
def sync_regions(mode: Allocations):
    """Charge what GradSync and ShardedOptimizer allocate to "sync" (build the model inside: the hooks are
    bound when GradSync is made); the context's value charges an optimizer's `step` to "optimizer"."""
    saved = {(cls, m): getattr(cls, m) for cls, methods in SYNC_METHODS.items() for m in methods}

    def charged(fn, name):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            with mode.region(name):
                return fn(*args, **kwargs)
        return run

    for (cls, m), fn in saved.items():
        setattr(cls, m, charged(fn, "sync"))
    try:
        yield lambda opt: setattr(opt, "step", charged(opt.step, "optimizer"))
    finally:
        for (cls, m), fn in saved.items():
            setattr(cls, m, fn)


def _run_measured(preset: str, plan: dict, data):
    """(the model after two steps, the Allocations of its second step: the optimizer state exists by then)."""
    mode = Allocations()
    with sync_regions(mode) as charge_optimizer:
        dm = autoshard.parallelize(build_model(get_spec(preset), seed=0), data[0][0], plan=plan,
                                   global_batch=GLOBAL_BATCH, optimizer=functools.partial(torch.optim.AdamW, **ADAM))
        charge_optimizer(dm.optimizer.optimizer if isinstance(dm.optimizer, ShardedOptimizer) else dm.optimizer)
        dm.train_step(*data[0])
        with mode:
            dm.train_step(*data[1])
    return dm, mode


def _peaks(rank: int, world: int, expected: list[float]) -> dict:
    """Each plan's sync peak against the price; returns {repr(plan): its model} of the llama-tiny plans."""
    data = {preset: batches(get_spec(preset).vocab, global_batch=GLOBAL_BATCH, seq=SEQ, steps=2)
            for preset in dict(PEAK_PLANS)}
    built = {}
    for (preset, plan), price in zip(PEAK_PLANS, expected):
        dm, mode = _run_measured(preset, plan, data[preset])
        got = mode.peak.get("sync", 0)
        assert got == price, f"{preset} {plan} rank {rank}: the gradient sync allocates {got} bytes at its peak, " \
                             f"the cost model prices {price}"
        if preset == PRESET:
            built[repr(plan)] = dm
    # ZeRO-2 in several buckets: two staging buffers at most, and the same training as in one bucket
    plan = dict(dp=2, zero=2, micro_batch=2, precision="fp32")
    with unittest.mock.patch.object(data_parallel, "gradient_bucket_params", lambda group: SMALL_BUCKETS):
        dm, mode = _run_measured(PRESET, plan, data[PRESET])
    sizes = [b.padded * 4 for b in dm._sync.buckets]
    assert len(sizes) > 2 and mode.peak["sync"] == max(a + b for a, b in zip(sizes, sizes[1:])), (sizes, mode.peak)
    got, want = dm.full_state_dict(), built[repr(plan)].full_state_dict()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    return built


def _peak_expected() -> list[float]:
    """While a step runs, the gradient sync and the ZeRO optimizer step allocate nothing but ZeRO-2's
    staging buffers (the persistent grad / param buffers are reduced and gathered in place, as
    Megatron-LM does), which the cost model prices as `buffers`: llama-tiny at ZeRO 0-2 in both
    precisions, mamba2-tiny at ZeRO-1/2; and ZeRO-2 cut into several buckets holds two at most."""
    expected = [_memory(plan, preset).buffers for preset, plan in PEAK_PLANS]
    n = priced(PLANS[0])["weights"] / 2  # llama-tiny's parameters (bf16 weights)
    assert expected[2] == expected[5] == 4 * n  # ZeRO-2: one bucket (< 40M parameters) of fp32 gradients
    assert expected[0] == expected[1] == expected[3] == expected[4] == expected[6] == 0
    return expected


def _state_expected() -> list[dict[str, float]]:
    """What the cost model prices for PLANS, checked against the per-parameter accounting first."""
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
    assert expected[9] == expected[1] and expected[10] == expected[5]  # fp8: bf16-mixed's bytes
    return expected


def _both(rank: int, world: int, state: list[dict[str, float]], peaks: list[float]) -> None:
    _measure_all(rank, world, state, _peaks(rank, world, peaks))


def test_a_rank_keeps_and_allocates_what_the_cost_model_prices():
    """Both checks in one world of 2 (spawned once): the state a rank keeps after a step, part by part,
    and the peak the gradient sync allocates while a step runs."""
    run_ranks(2, _both, _state_expected(), _peak_expected())
