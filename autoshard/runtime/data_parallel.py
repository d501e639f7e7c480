"""Data parallelism: bucketed gradient reduction overlapped with backward, and ZeRO-1/2.

Contract:
* `GradSync(params, group, zero=0|1|2)` groups the parameters (in reverse order, the order
  backward produces their gradients) into buckets of about `bucket_bytes`. Between `begin(...)`
  and `finish()`, a post-accumulate-grad hook counts each parameter's gradient as ready; a bucket
  whose gradients are all ready is flattened and its reduction launched asynchronously
  (buckets launch strictly in order, so every dp rank issues the same collectives in the same
  order) while backward continues. `finish()` launches what is left and waits.
  * zero=0: an all-reduce (sum) on the last micro-batch; `p.grad` holds the reduced gradient, a
    view of the all-reduced bucket (DDP's `gradient_as_bucket_view`: no second copy; a group of one
    flattens and copies nothing: the gradients stay in `p.grad`).
  * zero=1: a reduce-scatter on the last micro-batch: dp rank i receives slice i of every (padded)
    bucket, written back into its part of the gradient buffer (main gradients, below: ZeRO-1/2
    always use them); the rest of the buffer keeps the local (unreduced) gradient, as in Megatron's
    distributed optimizer.
  * zero=2 (DeepSpeed stage 2): a reduce-scatter on EVERY micro-batch, summed into this rank's
    slices; `p.grad` is dropped as soon as its bucket is flattened, so a full gradient lives only
    while its bucket is in flight. The price is one reduce-scatter per micro-batch (the cost model
    charges it, passes/cost.py). Needs pp = 1 (passes/layouts.py; DeepSpeed has the same rule):
    a pipeline schedule accumulates gradients over micro-batches inside its own loop.
* Gradients are summed, not averaged: the loss is already divided by the global token count
  (`runtime/loss.py`), so the sum over dp ranks is the gradient of the global mean.
* `ShardedOptimizer` (ZeRO-1/2): the optimizer is built over this rank's slices of the flat
  buckets; `step()` steps them and all-gathers the updated parameters. Element-wise optimizers
  (SGD, Adam, AdamW) then give the same weights as one process stepping everything.

`begin(last=False)` (an earlier micro-batch of gradient accumulation) lets the hooks do nothing
except under zero=2.

Main gradients (Megatron-LM's `main_grad` in its contiguous grad buffer: `main_grads=True`, which
`DistributedModel` asks for under bf16-mixed, runtime/precision.py, and always under zero=1/2, at
any precision): each parameter has an fp32 `main_grad` (under bf16-mixed the parameters are bf16). The hook adds every micro-batch's
`.grad` into it in fp32 and drops `.grad` (`take_grad`), so the gradient lives in fp32 only.
Under zero=0/1 a bucket's main gradients are views of one persistent flat fp32 buffer (padded to
a multiple of dp), all-reduced in place (zero=0) or reduce-scattered, this rank's reduced slice
written back into its part of the buffer (zero=1); under zero=2 a micro-batch's fp32 gradient
exists only until its bucket is reduce-scattered into the fp32 slices. Reductions are fp32.
`ShardedOptimizer` then holds the fp32 MASTER weights: this rank's slice of every bucket
(zero=1/2), or every bucket whole (zero=0: a shard world of one); it steps them on the fp32
gradient slices and all-gathers the result over dp in the parameters' dtype (bf16) into them.
With fp32 parameters (`masters=False`) there is no copy: each bucket's parameters become views of
one flat buffer (Megatron-LM's param buffer), the optimizer steps this rank's slice of it in place
and the other slices are all-gathered into it. Between steps a rank then keeps what the cost model
prices (passes/cost.py `state_bytes`; tests/runtime/test_state_bytes.py, both precisions).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

DEFAULT_BUCKET_BYTES = 25 * 2**20
# flat-tensor collectives: the *_single names from torch 2.13 on (the old ones warn there), same signatures
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def take_grad(param: nn.Parameter) -> Tensor | None:
    """The gradient the runtime reduces and steps: `.grad`, or under main gradients the fp32
    `main_grad`, into which whatever autograd left in `.grad` is first added (then `.grad` is dropped)."""
    if not hasattr(param, "main_grad"):
        return param.grad
    if param.grad is not None:
        if param.main_grad is None:  # zero=2: this micro-batch's fp32 gradient, until its bucket is reduced
            param.main_grad = param.grad.float()
        else:
            param.main_grad.add_(param.grad)
        param.grad = None
    return param.main_grad


def _drop_grad(param: nn.Parameter) -> None:
    param.grad = None
    if hasattr(param, "main_grad"):
        param.main_grad = None


class _Bucket:
    def __init__(self, params: list[nn.Parameter], world: int):
        self.params = params
        self.numel = sum(p.numel() for p in params)
        self.padded = -(-self.numel // world) * world
        self.ready = 0
        self.flat: Tensor | None = None  # the buffer being reduced
        self.out: Tensor | None = None  # all-reduce: == flat; reduce-scatter: this rank's slice
        self.work = None
        self.acc: Tensor | None = None  # zero=2: this rank's slice summed over finished micro-batches
        self.main: Tensor | None = None  # main gradients under zero 0/1: the flat fp32 buffer they are views of
        self.weights: Tensor | None = None  # weights that are their own masters (fp32 ZeRO-1/2): their flat buffer

    def hold_main_grads(self) -> None:
        """One flat fp32 buffer for the bucket; each parameter's `main_grad` is its view into it."""
        self.main = torch.zeros(self.padded, dtype=torch.float32, device=self.params[0].device)
        offset = 0
        for p in self.params:
            p.main_grad = self.main[offset:offset + p.numel()].view_as(p)
            offset += p.numel()

    def hold_params(self) -> Tensor:
        """One flat buffer holding the bucket's parameters (padded); each parameter becomes its view
        (Megatron-LM's param buffer: the optimizer then steps slices of it in place)."""
        self.weights = self.flatten_params().contiguous()
        offset = 0
        for p in self.params:
            p.data = self.weights[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        return self.weights

    def flatten_grads(self) -> Tensor:
        grads = [g.reshape(-1) if (g := take_grad(p)) is not None else p.new_zeros(p.numel(), dtype=torch.float32)
                 for p in self.params]
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
            if into_grad:  # a view: the bucket is the gradient's storage (DDP's gradient_as_bucket_view)
                p.grad = chunk
            else:
                with torch.no_grad():
                    p.copy_(chunk)


class GradSync:
    """Bucketed, overlapped gradient all-reduce (or ZeRO reduce-scatter) over the dp group."""

    def __init__(self, params: Sequence[nn.Parameter], group: dist.ProcessGroup | None, *, zero: int,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 prepare: Callable[[Sequence[nn.Parameter]], None] | None = None, main_grads: bool = False):
        self.group = group
        self.prepare = prepare  # called on a bucket's parameters just before it is reduced
        self.world = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        if zero not in (0, 1, 2):
            raise ValueError(f"GradSync runs ZeRO levels 0, 1 and 2, got {zero!r}")
        self.zero = zero > 0  # gradients end as this rank's slices (reduce-scatter)
        self.every_micro_batch = zero == 2
        self.main_grads = main_grads or self.zero  # ZeRO-1/2: the gradients live in the buffer at any precision
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
        if self.main_grads:
            for b in self.buckets:
                if self.every_micro_batch:
                    for p in b.params:
                        p.main_grad = None
                else:
                    b.hold_main_grads()
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._next = 0
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for b in self.buckets for p in b.params]

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
                b.acc = None
                if b.main is not None:
                    b.main.zero_()
            b.ready, b.flat, b.out, b.work = 0, None, None, None

    @property
    def shard_world(self) -> int:
        """How many slices each bucket's optimizer state is cut into: dp under ZeRO, 1 otherwise."""
        return self.world if self.zero else 1

    @property
    def shard_rank(self) -> int:
        return self.rank if self.zero else 0

    def _on_grad(self, param: nn.Parameter) -> None:
        if self.main_grads:  # every micro-batch: into the fp32 main gradient
            take_grad(param)
        if not self.enabled:
            return
        self._bucket_of[id(param)].ready += 1
        while self._next < len(self.buckets) and self.buckets[self._next].ready == len(self.buckets[self._next].params):
            self._launch(self.buckets[self._next])
            self._next += 1

    def _launch(self, bucket: _Bucket) -> None:
        if self.main_grads:  # what autograd left in `.grad` (zero-bubble's weight pass writes it directly)
            for p in bucket.params:
                take_grad(p)
        if self.prepare is not None:
            self.prepare(bucket.params)
        if self.world == 1 and not self.zero:  # nothing to reduce: `p.grad` / `main_grad` already holds the result
            return
        bucket.flat = bucket.main if bucket.main is not None else bucket.flatten_grads()
        if self.every_micro_batch:  # the flat copy is all that is kept of the full gradient
            for p in bucket.params:
                _drop_grad(p)
        if self.world == 1:
            bucket.out = bucket.flat
        elif self.zero:
            bucket.out = bucket.flat.new_empty(bucket.padded // self.world)
            bucket.work = _reduce_scatter(bucket.out, bucket.flat, group=self.group, async_op=True)
        else:
            bucket.out = bucket.flat
            bucket.work = dist.all_reduce(bucket.flat, group=self.group, async_op=True)

    def finish(self) -> None:
        """Launch the buckets not launched yet, wait for all; then gradients are reduced."""
        for bucket in self.buckets[self._next:]:
            self._launch(bucket)
        self._next = len(self.buckets)
        self.enabled = False
        self._drain()
        for bucket in self.buckets:
            if bucket.main is not None:  # reduced in place; ZeRO: the reduced slice back into the buffer
                if self.zero and bucket.out is not None and bucket.out is not bucket.main:
                    length = bucket.padded // self.world
                    bucket.out = bucket.main[self.rank * length:(self.rank + 1) * length].copy_(bucket.out)
            elif not self.zero and bucket.out is not None:
                bucket.scatter_back(bucket.out, into_grad=True)

    def _drain(self) -> None:
        """Wait for the reductions in flight; under zero=2 add them to the slices summed so far."""
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
                bucket.work = None
            if self.every_micro_batch and bucket.out is not None:
                bucket.acc = bucket.out if bucket.acc is None else bucket.acc.add_(bucket.out)
                bucket.flat = bucket.out = None

    def buffers(self) -> list[Tensor]:
        """The flat gradient tensors this sync holds (buffers, reduced slices, buckets in flight): with
        the parameters' `.grad` / `main_grad`, what a rank keeps of its gradients between steps
        (tests/runtime/test_state_bytes.py measures them against the cost model)."""
        return [t for b in self.buckets for t in (b.main, b.flat, b.out, b.acc) if t is not None]

    def shard_grads(self) -> list[Tensor]:
        """ZeRO: this rank's slice of every bucket's reduced gradient (after `finish`)."""
        if self.every_micro_batch:
            return [b.acc for b in self.buckets]
        if not self.zero:  # main gradients under zero=0: the whole all-reduced buffers
            return [b.main for b in self.buckets]
        return [b.out if self.world > 1 else b.flat for b in self.buckets]

    def reduced_grads(self) -> dict[int, Tensor]:
        """id(param) -> its dp-reduced gradient (collective over dp under ZeRO)."""
        if self.main_grads and not self.zero:
            return {id(p): p.main_grad for b in self.buckets for p in b.params}
        out = {}
        for bucket, shard in zip(self.buckets, self.shard_grads() if self.zero else [b.out for b in self.buckets]):
            if shard is None:
                continue
            flat = shard
            if self.zero and self.world > 1:
                flat = shard.new_empty(bucket.padded)
                _all_gather(flat, shard, group=self.group)
            offset = 0
            for p in bucket.params:
                out[id(p)] = flat[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
        return out


class ShardedOptimizer:
    """ZeRO-1/2: the optimizer state of each dp rank covers 1/dp of every gradient bucket. `masters`
    (bf16-mixed): its fp32 slices are copies, the master weights (zero=0: whole buckets), and
    `factory` may be None (no optimizer: the masters are still what `full_params` and checkpoints
    read). Without (fp32: the weights are their own masters) each bucket's parameters become views
    of one flat buffer and the slices are views of it, stepped in place, as Megatron-LM's
    distributed optimizer does for fp32 parameters (its param buffer; no second copy)."""

    def __init__(self, sync: GradSync, factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None, *,
                 masters: bool = True):
        self.sync = sync
        self.world, self.rank = sync.shard_world, sync.shard_rank
        self.masters = masters
        self.shards = []
        for bucket in sync.buckets:
            length = bucket.padded // self.world
            mine = slice(self.rank * length, (self.rank + 1) * length)
            if masters:  # fp32 copies (built before the params turn bf16)
                self.shards.append(nn.Parameter(bucket.flatten_params().float()[mine].clone()))
            else:
                self.shards.append(nn.Parameter(bucket.hold_params()[mine]))
        self.optimizer = factory(self.shards) if factory is not None else None

    def step(self) -> None:
        for shard, grad in zip(self.shards, self.sync.shard_grads()):
            shard.grad = grad
        self.optimizer.step()
        for shard, bucket in zip(self.shards, self.sync.buckets):
            if not self.masters:  # stepped in place: gather the other ranks' slices into the param buffer
                if self.world > 1:
                    _all_gather(bucket.weights, shard.detach().clone(), group=self.sync.group)
                continue
            piece = shard.detach().to(bucket.params[0].dtype)  # the all-gather moves the parameters' dtype
            full = piece
            if self.world > 1:
                full = piece.new_empty(bucket.padded)
                _all_gather(full, piece, group=self.sync.group)
            bucket.scatter_back(full, into_grad=False)

    def zero_grad(self) -> None:
        for shard in self.shards:
            shard.grad = None

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
            length = bucket.padded // self.world
            with torch.no_grad():
                shard.copy_(flat[self.rank * length:(self.rank + 1) * length])
            bucket.scatter_back(flat, into_grad=False)

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
