"""Data parallelism: bucketed gradient reduction overlapped with backward, and ZeRO-1/2.

The whole contract: docs/modules/runtime.md (runtime/data_parallel.py).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from autoshard.rules.buckets import gradient_bucket_params

# zero=2: buckets holding a staging buffer at once (DeepSpeed stage 2's double-buffered `ipg_buffer`
# under overlap_comm): one filling while the previous one is reduce-scattered (passes/cost/cost.py prices them)
STAGING_BUFFERS = 2
# flat-tensor collectives: the *_single names from torch 2.13 on (the old ones warn there), same signatures.
# Both run in place here, as Megatron-LM's do (NCCL: "in-place" when the output is the input's own slice,
# reduce-scatter, or the input is the output's own slice, all-gather; gloo does the same)
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def take_grad(param: nn.Parameter) -> Tensor | None:
    """The gradient the runtime reduces and steps: `.grad`, or under main gradients the fp32
    `main_grad`, into which whatever autograd left in `.grad` is first added (then `.grad` is dropped;
    `got_grad` marks that it came: `GradSync.unused`)."""
    if not hasattr(param, "main_grad"):
        return param.grad
    if param.grad is not None:
        param.got_grad = True
        if param.main_grad is None:  # (not reached by GradSync, which gives every gradient a buffer first)
            param.main_grad = param.grad.float()
        else:
            param.main_grad.add_(param.grad)
        param.grad = None
    return param.main_grad


class _Bucket:
    def __init__(self, params: list[nn.Parameter], world: int):
        self.params = params
        self.numel = sum(p.numel() for p in params)
        self.padded = -(-self.numel // world) * world
        self.ready = 0
        self.work = None
        self.main: Tensor | None = None  # zero 0/1: the persistent flat fp32 gradient buffer (main gradients' storage)
        self.staging: Tensor | None = None  # zero=2: this micro-batch's flat fp32 gradient buffer, until reduced
        self.launched = False  # zero=2: its reduce-scatter was issued this micro-batch
        self.acc: Tensor | None = None  # zero=2: this rank's slice summed over the step's micro-batches
        self.weights: Tensor | None = None  # ShardedOptimizer: the flat buffer the parameters are views of

    def mine(self, flat: Tensor, rank: int, world: int) -> Tensor:
        """Rank `rank`'s slice of a flat (padded) tensor of the bucket: a view."""
        length = self.padded // world
        return flat[rank * length:(rank + 1) * length]

    def grads_into(self, flat: Tensor) -> None:
        """Make each parameter's `main_grad` its view into `flat` (Megatron-LM's grad buffer)."""
        offset = 0
        for p in self.params:
            p.main_grad = flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()

    def hold_params(self, flat: Tensor) -> Tensor:
        """Make each parameter a view of `flat` (padded; Megatron-LM's param buffer: the optimizer
        steps slices of it in place and the all-gather writes into it)."""
        self.weights = flat
        offset = 0
        for p in self.params:
            p.data = flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        return flat

    def flatten_params(self) -> Tensor:
        flat = torch.cat([p.detach().reshape(-1) for p in self.params])
        return torch.nn.functional.pad(flat, (0, self.padded - self.numel)) if self.padded > self.numel else flat


def _weak_hook(method: Callable[[nn.Parameter], None]) -> Callable[[nn.Parameter], None]:
    """A gradient hook that calls `method` while its object lives. A parameter holds its hooks from C++,
    where the garbage collector cannot see them: a bound method there would keep its object, the buffers
    and the process group (gloo's threads) alive after the model is dropped."""
    ref = weakref.WeakMethod(method)

    def hook(param: nn.Parameter) -> None:
        bound = ref()
        if bound is not None:
            bound(param)
    return hook


class GradSync:
    """Bucketed, overlapped gradient all-reduce (or ZeRO reduce-scatter) over the dp group."""

    def __init__(self, params: Sequence[nn.Parameter], group: dist.ProcessGroup | None, *, zero: int,
                 bucket_params: int | None = None,
                 prepare: Callable[[Sequence[nn.Parameter]], None] | None = None, main_grads: bool = False):
        self.group = group
        self.prepare = prepare  # called on a bucket's parameters just before it is reduced
        self.world = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        if zero not in (0, 1, 2):
            raise ValueError(f"GradSync runs ZeRO levels 0, 1 and 2, got {zero!r}")
        self.zero = zero > 0  # gradients end as this rank's slices (reduce-scatter)
        self.every_micro_batch = zero == 2
        # the gradients live in the flat buffers whenever there is something to reduce (or main gradients are
        # asked for); fp32 ZeRO 0 then shows them as `p.grad`, views of the buffer (DDP's gradient_as_bucket_view)
        self.expose_grads = not (main_grads or self.zero) and self.world > 1
        self.main_grads = main_grads or self.zero or self.world > 1
        self.enabled = False
        self.buckets: list[_Bucket] = []
        limit = gradient_bucket_params(self.world) if bucket_params is None else bucket_params
        current, size = [], 0
        for p in reversed([p for p in params if p.requires_grad]):
            current.append(p)
            size += p.numel()
            if size >= limit:
                self.buckets.append(_Bucket(current, self.world))
                current, size = [], 0
        if current:
            self.buckets.append(_Bucket(current, self.world))
        if self.main_grads:
            for b in self.buckets:
                device = b.params[0].device
                if self.every_micro_batch:
                    for p in b.params:
                        p.main_grad = None  # a view of the bucket's staging buffer while one is held
                    b.acc = torch.zeros(b.padded // self.world, dtype=torch.float32, device=device)
                else:
                    b.main = torch.zeros(b.padded, dtype=torch.float32, device=device)
                    b.grads_into(b.main)
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._next = 0
        self._staged: list[_Bucket] = []  # zero=2: the buckets holding a staging buffer, oldest first
        # id(param) of the parameters no rank of the group got a gradient for in the last step (HF's unused
        # ones, e.g. DeepSeek-V3.2's indexer): `.grad` stays None and the optimizer leaves them, as one process does
        self.unused: frozenset[int] = frozenset()
        on_grad = _weak_hook(self._on_grad)
        self._hooks = [p.register_post_accumulate_grad_hook(on_grad) for b in self.buckets for p in b.params]

    def begin(self, *, last: bool, first: bool = True) -> None:
        """Start the backward of a micro-batch (`first`/`last` of the step): the reductions launch as
        gradients become ready on the last one, or on every one under zero=2. Under zero=2 this also
        completes the previous micro-batch (launches the buckets it left, e.g. of unused parameters)."""
        if self.enabled and self.every_micro_batch:
            for bucket in self.buckets[self._next:]:
                self._launch(bucket)
        self._drain()
        self.enabled = last or self.every_micro_batch
        self._next = 0
        for b in self.buckets:
            if first:
                for buffer in (b.main, b.acc):
                    if buffer is not None:
                        buffer.zero_()
                for p in b.params:  # `take_grad` marks a gradient as it moves it into the main gradient
                    p.got_grad = False
            b.ready, b.work = 0, None

    @property
    def shard_world(self) -> int:
        """How many slices each bucket's optimizer state is cut into: dp under ZeRO, 1 otherwise."""
        return self.world if self.zero else 1

    @property
    def shard_rank(self) -> int:
        return self.rank if self.zero else 0

    def _on_grad(self, param: nn.Parameter) -> None:
        bucket = self._bucket_of[id(param)]
        if self.every_micro_batch and bucket.staging is None:
            self._stage(bucket)
        if self.main_grads:  # every micro-batch: into the fp32 main gradient
            take_grad(param)
        if not self.enabled:
            return
        bucket.ready += 1
        while self._next < len(self.buckets) and self.buckets[self._next].ready == len(self.buckets[self._next].params):
            self._launch(self.buckets[self._next])
            self._next += 1

    def _stage(self, bucket: _Bucket) -> None:
        """zero=2: give `bucket` a zeroed staging buffer, its parameters' main gradients views of it; with
        STAGING_BUFFERS held already, first finish the oldest bucket in flight (its buffer is freed). Only
        when every held buffer still waits for gradients (they come out of bucket order) is one more made."""
        while len(self._staged) >= STAGING_BUFFERS:
            oldest = next((b for b in self._staged if b.launched), None)
            if oldest is None:
                break
            self._retire(oldest)
        bucket.staging = torch.zeros(bucket.padded, dtype=torch.float32, device=bucket.params[0].device)
        bucket.grads_into(bucket.staging)
        self._staged.append(bucket)

    def _retire(self, bucket: _Bucket) -> None:
        """zero=2: wait for the bucket's reduce-scatter, add its slice into the sum and free the buffer."""
        if bucket.work is not None:
            bucket.work.wait()
            bucket.work = None
        bucket.acc.add_(bucket.mine(bucket.staging, self.rank, self.world))
        bucket.staging, bucket.launched = None, False
        self._staged.remove(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        if self.every_micro_batch and bucket.staging is None:  # none of its parameters got a gradient
            self._stage(bucket)
        if self.main_grads:  # what autograd left in `.grad` (zero-bubble's weight pass writes it directly)
            for p in bucket.params:
                take_grad(p)
        if self.prepare is not None:
            self.prepare(bucket.params)
        if self.every_micro_batch:  # the staging buffer now belongs to the reduce-scatter (into its own slice)
            for p in bucket.params:
                p.main_grad = None
            bucket.launched = True
            if self.world > 1:
                bucket.work = _reduce_scatter(bucket.mine(bucket.staging, self.rank, self.world), bucket.staging,
                                              group=self.group, async_op=True)
        elif self.world > 1 and self.zero:  # this rank's reduced slice lands in its own part of the buffer
            bucket.work = _reduce_scatter(bucket.mine(bucket.main, self.rank, self.world), bucket.main,
                                          group=self.group, async_op=True)
        elif self.world > 1:
            bucket.work = dist.all_reduce(bucket.main, group=self.group, async_op=True)

    def finish(self) -> None:
        """Launch the buckets not launched yet, wait for all; then gradients are reduced."""
        for bucket in self.buckets[self._next:]:
            self._launch(bucket)
        self._next = len(self.buckets)
        self.enabled = False
        self._drain()
        if self.main_grads:
            self._find_unused()
        if self.expose_grads:
            for bucket in self.buckets:
                for p in bucket.params:
                    p.grad = None if id(p) in self.unused else p.main_grad

    def _find_unused(self) -> None:
        """`unused`: the parameters no rank of the group got a gradient for this step, agreed in one small
        all-reduce (a rank's unused one may be another's used one: a MoE expert no token of this rank reached)."""
        params = [p for b in self.buckets for p in b.params]
        if not params:
            self.unused = frozenset()
            return
        got = torch.tensor([getattr(p, "got_grad", False) for p in params], dtype=torch.int32, device=params[0].device)
        if self.world > 1:
            dist.all_reduce(got, op=dist.ReduceOp.MAX, group=self.group)
        self.unused = frozenset(id(p) for p, g in zip(params, got.tolist()) if not g)

    def _drain(self) -> None:
        """Wait for the reductions in flight; under zero=2 add them to the slices summed so far."""
        for bucket in list(self._staged):
            if bucket.launched:
                self._retire(bucket)
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
                bucket.work = None

    def buffers(self) -> list[Tensor]:
        """The flat gradient tensors this sync holds (buffers, summed slices, staging buffers in flight): with
        the parameters' `.grad` / `main_grad`, what a rank keeps of its gradients between steps
        (tests/runtime/test_state_bytes.py measures them against the cost model)."""
        return [t for b in self.buckets for t in (b.main, b.staging, b.acc) if t is not None]

    def shard_grads(self) -> list[Tensor]:
        """ZeRO: this rank's slice of every bucket's reduced gradient (after `finish`); else the buffers."""
        if self.every_micro_batch:
            return [b.acc for b in self.buckets]
        if not self.zero:  # main gradients under zero=0: the whole all-reduced buffers
            return [b.main for b in self.buckets]
        return [b.mine(b.main, self.rank, self.world) for b in self.buckets]

    def reduced_grads(self) -> dict[int, Tensor]:
        """id(param) -> its dp-reduced gradient (collective over dp under ZeRO); {} for a group of one
        without main gradients (the gradients are `.grad`)."""
        if not self.main_grads:
            return {}
        if not self.zero:
            return {id(p): p.main_grad for b in self.buckets for p in b.params if id(p) not in self.unused}
        out = {}
        for bucket, shard in zip(self.buckets, self.shard_grads()):
            flat = shard
            if self.world > 1:
                flat = shard.new_empty(bucket.padded)
                _all_gather(flat, shard, group=self.group)
            offset = 0
            for p in bucket.params:
                if id(p) not in self.unused:
                    out[id(p)] = flat[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
        return out


class ShardedOptimizer:
    """ZeRO-1/2: the optimizer state of each dp rank covers 1/dp of every gradient bucket, and each
    bucket's parameters become views of one flat buffer (Megatron-LM's param buffer) that the step's
    all-gather writes into in place. `masters` (bf16-mixed): the optimizer steps fp32 copies of this
    rank's slices, the master weights (zero=0: whole buckets), and the parameters are held in
    `param_dtype`; `factory` may be None (no optimizer: the masters are still what `full_params` and
    checkpoints read). Without (fp32: the weights are their own masters) the slices are views of the
    param buffer, stepped in place, as Megatron-LM's distributed optimizer does for fp32 parameters
    (no second copy)."""

    def __init__(self, sync: GradSync, factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None, *,
                 masters: bool = True, param_dtype: torch.dtype = torch.bfloat16):
        self.sync = sync
        self.world, self.rank = sync.shard_world, sync.shard_rank
        self.masters = masters
        self.shards = []
        for bucket in sync.buckets:
            flat = bucket.flatten_params()
            if masters:  # fp32 copies of this rank's slice; the parameters turn `param_dtype`
                self.shards.append(nn.Parameter(bucket.mine(flat.float(), self.rank, self.world).clone()))
                bucket.hold_params(flat.to(param_dtype))
            else:
                self.shards.append(nn.Parameter(bucket.mine(bucket.hold_params(flat), self.rank, self.world)))
        self.optimizer = factory(self.shards) if factory is not None else None

    def step(self) -> None:
        for shard, grad in zip(self.shards, self.sync.shard_grads()):
            shard.grad = grad
        kept = self._unused_slices()
        self.optimizer.step()
        self._restore(kept)
        for shard, bucket in zip(self.shards, self.sync.buckets):
            mine = bucket.mine(bucket.weights, self.rank, self.world)
            if self.masters:  # the stepped masters into this rank's slice of the param buffer (cast)
                with torch.no_grad():
                    mine.copy_(shard)
            if self.world > 1:  # the other ranks' slices, in place (fp32: `mine` is what the optimizer stepped)
                _all_gather(bucket.weights, mine, group=self.sync.group)

    def zero_grad(self) -> None:
        for shard in self.shards:
            shard.grad = None

    def _unused_slices(self) -> list[tuple[Tensor, slice, Tensor, dict[str, Tensor | None]]]:
        """Before a step: the parts of this rank's shards that hold parameters no rank got a gradient for
        (`GradSync.unused`), with their values and optimizer state, so that `_restore` undoes the step there:
        one process's optimizer skips a parameter whose `.grad` is None (no weight decay, no moment update)."""
        kept = []
        if not self.sync.unused:
            return kept
        for shard, bucket in zip(self.shards, self.sync.buckets):
            start = self.rank * (bucket.padded // self.world)
            offset = 0
            for p in bucket.params:
                lo, hi = max(offset, start) - start, min(offset + p.numel(), start + shard.numel()) - start
                offset += p.numel()
                if id(p) not in self.sync.unused or lo >= hi:
                    continue
                part = slice(lo, hi)
                state = self.optimizer.state.get(shard, {})
                saved = {k: v[part].clone() for k, v in state.items()
                         if isinstance(v, Tensor) and v.shape == shard.shape}
                kept.append((shard, part, shard.detach()[part].clone(), saved))
        return kept

    def _restore(self, kept) -> None:
        """After a step: the kept parts as they were (a state tensor the step created: zeros there, the state
        of a parameter never stepped)."""
        with torch.no_grad():
            for shard, part, value, saved in kept:
                shard[part].copy_(value)
                for key, v in self.optimizer.state.get(shard, {}).items():
                    if isinstance(v, Tensor) and v.shape == shard.shape:
                        if key in saved:
                            v[part].copy_(saved[key])
                        else:
                            v[part].zero_()

    # -- master weights and state in per-parameter terms (checkpoints: runtime/checkpoint.py) ------
    def full_params(self) -> dict[int, Tensor]:
        """id(param) -> its fp32 master value shaped like the param (collective over dp under ZeRO)."""
        out = {}
        for shard, bucket in zip(self.shards, self.sync.buckets):
            self._cut(out, bucket, self._gather(shard.detach(), bucket))
        return out

    def set_params(self, values: dict[int, Tensor]) -> None:
        """Masters and parameters from {id(param): full (tp-local) value} (local, no collective)."""
        for shard, bucket in zip(self.shards, self.sync.buckets):
            flat = torch.cat([values[id(p)].reshape(-1).to(shard.device, torch.float32) for p in bucket.params])
            flat = torch.nn.functional.pad(flat, (0, bucket.padded - bucket.numel))
            with torch.no_grad():
                shard.copy_(bucket.mine(flat, self.rank, self.world))
                bucket.weights.copy_(flat)

    def param_states(self) -> dict[int, dict[str, Tensor]]:
        """id(param) -> {state key: tensor shaped like the param, or the shard's scalar} (collective over dp).

        Each bucket's flat state slices are all-gathered over dp and cut back into parameters."""
        out: dict[int, dict[str, Tensor]] = {}
        for shard, bucket in zip(self.shards, self.sync.buckets):
            for key, value in self.optimizer.state.get(shard, {}).items():
                if not isinstance(value, Tensor):
                    continue
                if value.dim() == 0:
                    for p in bucket.params:
                        out.setdefault(id(p), {})[key] = value.detach().clone()
                    continue
                cut: dict[int, Tensor] = {}
                self._cut(cut, bucket, self._gather(value.detach().contiguous(), bucket))
                for pid, tensor in cut.items():
                    out.setdefault(pid, {})[key] = tensor
        return out

    def load_param_states(self, states: dict[int, dict[str, Tensor]]) -> None:
        """The inverse of `param_states` (local, no collective); the masters come from `set_params`."""
        for shard, bucket in zip(self.shards, self.sync.buckets):
            held = [states.get(id(p), {}) for p in bucket.params]
            length = bucket.padded // self.world
            new = {}
            for key, first in held[0].items():
                if first.dim() == 0:
                    new[key] = first.clone()
                    continue
                flat = torch.cat([s[key].reshape(-1).to(shard.dtype) for s in held])
                flat = torch.nn.functional.pad(flat, (0, bucket.padded - bucket.numel))
                new[key] = flat[self.rank * length:(self.rank + 1) * length].clone()
            if new:
                self.optimizer.state[shard] = new

    def _gather(self, piece: Tensor, bucket: _Bucket) -> Tensor:
        if self.world == 1:
            return piece
        flat = piece.new_empty(bucket.padded)
        _all_gather(flat, piece, group=self.sync.group)
        return flat

    @staticmethod
    def _cut(out: dict[int, Tensor], bucket: _Bucket, flat: Tensor) -> None:
        offset = 0
        for p in bucket.params:
            out[id(p)] = flat[offset:offset + p.numel()].view_as(p).clone()
            offset += p.numel()
