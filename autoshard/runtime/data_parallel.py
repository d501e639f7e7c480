"""Data parallelism: bucketed gradient reduction overlapped with backward, and ZeRO-1.

Contract:
* `GradSync(params, group, zero=...)` groups the parameters (in reverse order, the order
  backward produces their gradients) into buckets of about `bucket_bytes`. Between `begin(sync=True)`
  and `finish()`, a post-accumulate-grad hook counts each parameter's gradient as ready; a bucket
  whose gradients are all ready is flattened and its reduction launched asynchronously
  (buckets launch strictly in order, so every dp rank issues the same collectives in the same
  order) while backward continues. `finish()` launches what is left and waits.
  Without ZeRO the reduction is an all-reduce (sum) and `p.grad` holds the reduced gradient
  (a group of one flattens and copies nothing: the gradients stay in `p.grad`).
  With ZeRO-1 it is a reduce-scatter: dp rank i receives slice i of every (padded) bucket.
* Gradients are summed, not averaged: the loss is already divided by the global token count
  (`runtime/loss.py`), so the sum over dp ranks is the gradient of the global mean.
* `ShardedOptimizer` (ZeRO-1): the optimizer is built over this rank's slices of the flat
  buckets; `step()` steps them and all-gathers the updated parameters. Element-wise optimizers
  (SGD, Adam, AdamW) then give the same weights as one process stepping everything.

`begin(sync=False)` (gradient accumulation over micro-batches) lets the hooks do nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

DEFAULT_BUCKET_BYTES = 25 * 2**20


class _Bucket:
    def __init__(self, params: list[nn.Parameter], world: int):
        self.params = params
        self.numel = sum(p.numel() for p in params)
        self.padded = -(-self.numel // world) * world
        self.ready = 0
        self.flat: Tensor | None = None  # the buffer being reduced
        self.out: Tensor | None = None  # all-reduce: == flat; reduce-scatter: this rank's slice
        self.work = None

    def flatten_grads(self) -> Tensor:
        grads = [p.grad.reshape(-1) if p.grad is not None else p.new_zeros(p.numel()) for p in self.params]
        flat = torch.cat(grads)
        return torch.nn.functional.pad(flat, (0, self.padded - self.numel)) if self.padded > self.numel else flat

    def flatten_params(self) -> Tensor:
        flat = torch.cat([p.detach().reshape(-1) for p in self.params])
        return torch.nn.functional.pad(flat, (0, self.padded - self.numel)) if self.padded > self.numel else flat

    def scatter_back(self, flat: Tensor, *, into_grad: bool) -> None:
        offset = 0
        for p in self.params:
            chunk = flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
            if into_grad:
                p.grad = chunk.clone()
            else:
                with torch.no_grad():
                    p.copy_(chunk)


class GradSync:
    """Bucketed, overlapped gradient all-reduce (or ZeRO reduce-scatter) over the dp group."""

    def __init__(self, params: Sequence[nn.Parameter], group: dist.ProcessGroup | None, *, zero: bool,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 prepare: Callable[[Sequence[nn.Parameter]], None] | None = None):
        self.group = group
        self.prepare = prepare  # called on a bucket's parameters just before it is reduced
        self.world = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        self.zero = zero
        self.enabled = False
        self.buckets: list[_Bucket] = []
        current, size = [], 0
        for p in reversed([p for p in params if p.requires_grad]):
            current.append(p)
            size += p.numel() * p.element_size()
            if size >= bucket_bytes:
                self.buckets.append(_Bucket(current, self.world))
                current, size = [], 0
        if current:
            self.buckets.append(_Bucket(current, self.world))
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._next = 0
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for b in self.buckets for p in b.params]

    def begin(self, *, sync: bool) -> None:
        """Start a backward pass; with `sync` the reductions launch as gradients become ready."""
        self.enabled = sync
        self._next = 0
        for b in self.buckets:
            b.ready, b.flat, b.out, b.work = 0, None, None, None

    def _on_grad(self, param: nn.Parameter) -> None:
        if not self.enabled:
            return
        self._bucket_of[id(param)].ready += 1
        while self._next < len(self.buckets) and self.buckets[self._next].ready == len(self.buckets[self._next].params):
            self._launch(self.buckets[self._next])
            self._next += 1

    def _launch(self, bucket: _Bucket) -> None:
        if self.prepare is not None:
            self.prepare(bucket.params)
        if self.world == 1 and not self.zero:  # nothing to reduce: `p.grad` already holds the result
            return
        bucket.flat = bucket.flatten_grads()
        if self.world == 1:
            bucket.out = bucket.flat
        elif self.zero:
            bucket.out = bucket.flat.new_empty(bucket.padded // self.world)
            bucket.work = dist.reduce_scatter_tensor(bucket.out, bucket.flat, group=self.group, async_op=True)
        else:
            bucket.out = bucket.flat
            bucket.work = dist.all_reduce(bucket.flat, group=self.group, async_op=True)

    def finish(self) -> None:
        """Launch the buckets not launched yet, wait for all; then gradients are reduced."""
        for bucket in self.buckets[self._next:]:
            self._launch(bucket)
        self._next = len(self.buckets)
        self.enabled = False
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
            if not self.zero and bucket.out is not None:
                bucket.scatter_back(bucket.out, into_grad=True)

    def shard_grads(self) -> list[Tensor]:
        """ZeRO: this rank's slice of every bucket's reduced gradient (after `finish`)."""
        return [b.out if self.world > 1 else b.flat for b in self.buckets]

    def reduced_grads(self) -> dict[int, Tensor]:
        """id(param) -> its dp-reduced gradient (collective over dp under ZeRO)."""
        out = {}
        for bucket in self.buckets:
            if bucket.out is None:
                continue
            flat = bucket.out
            if self.zero and self.world > 1:
                flat = bucket.out.new_empty(bucket.padded)
                dist.all_gather_into_tensor(flat, bucket.out, group=self.group)
            offset = 0
            for p in bucket.params:
                out[id(p)] = flat[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
        return out


class ShardedOptimizer:
    """ZeRO-1: the optimizer state of each dp rank covers 1/dp of every gradient bucket."""

    def __init__(self, sync: GradSync, factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer]):
        self.sync = sync
        size = sync.world
        self.shards = []
        for bucket in sync.buckets:
            length = bucket.padded // size
            flat = bucket.flatten_params()
            self.shards.append(nn.Parameter(flat[sync.rank * length:(sync.rank + 1) * length].clone()))
        self.optimizer = factory(self.shards)

    def step(self) -> None:
        for shard, grad in zip(self.shards, self.sync.shard_grads()):
            shard.grad = grad
        self.optimizer.step()
        for shard, bucket in zip(self.shards, self.sync.buckets):
            full = shard.detach()
            if self.sync.world > 1:
                full = shard.new_empty(bucket.padded)
                dist.all_gather_into_tensor(full, shard.detach(), group=self.sync.group)
            bucket.scatter_back(full, into_grad=False)

    def zero_grad(self) -> None:
        for shard in self.shards:
            shard.grad = None
