"""Expert parallelism: each ep rank holds experts/ep of every MoE layer; tokens travel by all-to-all.

Contract
--------
`apply_expert_parallel(model, spec, ep_group, ep=, ep_rank=)` replaces, in place, every HF experts
module (the `expert` roles of the sharding table, rules/sharding.py: `<base>.layers.<i>.mlp.experts`)
by a `ParallelExperts` running HF's own experts module cut to this rank's contiguous slice of the
experts (rank r of ep: experts [r*E/ep, (r+1)*E/ep); every parameter, weights and biases, sliced on
dim 0), under HF's parameter names. It returns the names of the expert parameters (`expert_param_names`).

The whole contract: docs/modules/runtime.md (runtime/expert_parallel.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed._functional_collectives import all_to_all_single_autograd

from autoshard.errors import InvalidConfigError
from autoshard.ir import Shard
from autoshard.model_spec import ModelSpec
from autoshard.models.facts import experts_ep_refusal, experts_scattered, experts_tp_split_refusal
from autoshard.runtime.data_parallel import GradSync, ShardedOptimizer
from autoshard.runtime.tensor_parallel import shard_tensor


def experts_modules(model: nn.Module, spec: ModelSpec) -> list[tuple[str, nn.Module]]:
    """(path, module) of every routed-experts module: the `expert` roles of the sharding table."""
    from autoshard.rules.sharding import Strategy, modules

    return [(path, model.get_submodule(path)) for path in modules(spec, Strategy.EXPERT)]


def expert_param_names(model: nn.Module, spec: ModelSpec) -> frozenset[str]:
    """Names of the routed experts' parameters (sharded over ep, reduced over dp x cp)."""
    return frozenset(f"{path}.{name}" for path, m in experts_modules(model, spec) for name, _ in m.named_parameters())


class ParallelExperts(nn.Module):
    """This rank's experts of one MoE layer; tokens dispatched and combined by all-to-all.

    It runs HF's own experts module (its class and forward: biases, clamps, gating and layout are HF's),
    sliced to this rank's experts: every parameter on dim 0 (the expert), `num_experts` the local count.
    That module is held unregistered and shares its parameter dict with this one, so `named_parameters()`
    reports HF's names at HF's path and a parameter replaced here (FSDP2, `.to`) is the one HF's forward reads."""

    def __init__(self, experts: nn.Module, *, group: dist.ProcessGroup, ep: int, ep_rank: int,
                 tp_group: dist.ProcessGroup | None = None, tp: int = 1, tp_rank: int = 0, where: str = "experts"):
        super().__init__()
        why = experts_ep_refusal(experts, where) or (experts_tp_split_refusal(experts, where) if tp > 1 else None)
        if why:  # the spec's own ep refusal (models/facts.py), `where`: its path
            raise InvalidConfigError(why)
        total = experts.num_experts  # ep divides it: the plan rule, checked by apply_expert_parallel
        self.num_experts, self.ep, self.group = total, ep, group
        self.tp, self.tp_group = tp, tp_group  # tp > 1 (serving): each expert's GEMMs split over tp
        self.local = total // ep
        self.first = first = ep_rank * self.local
        self.replicated = False  # True inside `replicated_tokens` (generation): expert slicing + all-reduce
        placements = expert_tp_placements(experts.down_proj.shape[-1], tp=tp, tp_rank=tp_rank) if tp > 1 else {}
        for name, param in list(experts.named_parameters(recurse=False)):
            mine = param.detach()[first:first + self.local]  # (E/ep, ...)
            if name in placements:
                mine = shard_tensor(mine, placements[name])
            setattr(experts, name, nn.Parameter(mine.clone()))
        experts.num_experts = self.local
        self._parameters = experts._parameters  # one dict: HF's names, the tensors HF's forward reads
        self.hf = (experts,)  # HF's module, not a child (its parameters are this module's)
        self.scattered = experts_scattered(experts)  # Llama-4's: every token's row for every expert (facts.py)

    def forward(self, hidden: Tensor, top_k_index: Tensor | None = None, top_k_weights: Tensor | None = None) -> Tensor:
        if self.scattered:
            return self._scattered(hidden)
        if self.replicated:
            return self._sliced(hidden, top_k_index, top_k_weights)
        tokens, k = top_k_index.shape
        expert_ids = top_k_index.reshape(-1)  # (T*k,)
        order = torch.argsort(expert_ids, stable=True)
        y, send, recv = self._dispatched(hidden[order // k], expert_ids[order], top_k_weights.dtype)
        back = all_to_all_single_autograd(y, send, recv, self.group)  # (T*k, h), sorted by expert
        weighted = back * top_k_weights.reshape(-1)[order].unsqueeze(-1)
        out = weighted[torch.argsort(order)].view(tokens, k, -1).sum(dim=1)  # HF: reshape + sum over k
        return out.to(hidden.dtype)

    def _dispatched(self, rows: Tensor, expert_ids: Tensor, dtype: torch.dtype) -> tuple[Tensor, list, list]:
        """(this rank's experts' outputs on the rows every peer sent them, send counts, receive counts): `rows`
        (n, h) sorted by their experts `expert_ids` (n,), each sent to the rank holding its expert."""
        counts = torch.bincount(expert_ids, minlength=self.num_experts)  # (E,)
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)  # [peer, local expert], flattened
        per_peer = received.view(self.ep, self.local)
        send = counts.view(self.ep, self.local).sum(1).tolist()
        recv = per_peer.sum(1).tolist()
        x = all_to_all_single_autograd(rows, recv, send, self.group)  # (R, h), peer-major, by expert within
        local_ids = torch.arange(self.local, device=x.device).repeat(self.ep).repeat_interleave(per_peer.reshape(-1))
        y = self._padded(x, local_ids) if self.scattered else self._experts(x, local_ids, dtype)  # (R, h)
        if self.tp > 1:  # each tp rank computed its slice of every expert's intermediate width
            dist.all_reduce(y, group=self.tp_group)  # serving only (no autograd): inference plans do not train
        return y, send, recv

    def _scattered(self, hidden: Tensor) -> Tensor:
        """Llama-4's layout (`models/facts.experts_scattered`): `hidden` (E x T, h) holds every token's row for every
        expert, expert-major, scaled by its router score; a row of zeros (a token not routed to that expert) gives
        zeros and no gradient, so only the nonzero rows travel to their experts' ranks, and the output is zeros
        elsewhere, as HF's dense forward gives. Generation (`replicated`): every ep rank holds the same tokens, its
        experts' blocks run on them, the outputs summed over ep."""
        x = hidden.view(self.num_experts, -1, hidden.shape[-1])  # (E, T, h)
        if self.replicated:
            held = slice(self.first, self.first + self.local)
            mine = torch.zeros_like(x)
            mine[held] = self.hf[0](x[held].reshape(-1, x.shape[-1])).view(self.local, -1, x.shape[-1])
            if self.ep > 1:
                dist.all_reduce(mine, group=self.group)
            return mine.view_as(hidden)
        expert_ids, token_ids = x.ne(0).any(-1).nonzero(as_tuple=True)  # the routed pairs, by expert
        y, send, recv = self._dispatched(x[expert_ids, token_ids], expert_ids, hidden.dtype)
        back = all_to_all_single_autograd(y, send, recv, self.group)  # (n, h), in the order sent
        return x.new_zeros(x.shape).index_put((expert_ids, token_ids), back).view_as(hidden)

    def _padded(self, x: Tensor, local_ids: Tensor) -> Tensor:
        """HF's scattered experts forward on rows `x` (n, h), row i for local expert `local_ids[i]`: each expert's
        rows padded with zero rows to the most any of them received (the module views its input as E equal
        blocks), its output cut back to the rows, in their order."""
        order = torch.argsort(local_ids, stable=True)
        counts = torch.bincount(local_ids, minlength=self.local)
        starts = torch.cumsum(counts, 0) - counts
        ids = local_ids[order]
        slot = torch.arange(len(ids), device=x.device) - starts[ids]
        width = max(int(counts.max()) if len(ids) else 0, 1)
        blocks = x.new_zeros(self.local, width, x.shape[-1]).index_put((ids, slot), x[order])
        out = self.hf[0](blocks.view(-1, x.shape[-1])).view(self.local, width, -1)
        return out[ids, slot][torch.argsort(order)]

    def _sliced(self, hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        """Every ep rank holds the same tokens: this rank's experts on the pairs routed to them, the
        weighted partial sums (T, h) all-reduced over ep (docs/modules/runtime.md, Generation)."""
        token_idx, slot = torch.where((top_k_index >= self.first) & (top_k_index < self.first + self.local))
        y = self._experts(hidden[token_idx], top_k_index[token_idx, slot] - self.first, top_k_weights.dtype)
        out = torch.zeros_like(hidden).index_add_(0, token_idx, (y * top_k_weights[token_idx, slot, None]).to(hidden.dtype))
        if self.ep > 1:
            dist.all_reduce(out, group=self.group)
        if self.tp > 1:  # and over tp: each rank computed its slice of every expert's intermediate width
            dist.all_reduce(out, group=self.tp_group)
        return out

    def _experts(self, x: Tensor, local_ids: Tensor, dtype: torch.dtype) -> Tensor:
        """HF's experts forward on rows `x` (n, h), row i routed to local expert `local_ids[i]` alone with
        weight 1: each row's expert output, unweighted (the caller weighs it, as HF does after the expert)."""
        return self.hf[0](x, local_ids.unsqueeze(-1), torch.ones(len(local_ids), 1, dtype=dtype, device=x.device))


def apply_expert_parallel(model: nn.Module, spec: ModelSpec, ep_group: dist.ProcessGroup, *, ep: int,
                          ep_rank: int, tp_group: dist.ProcessGroup | None = None, tp: int = 1,
                          tp_rank: int = 0) -> frozenset[str]:
    """Swap every experts module for this rank's `ParallelExperts` (docs/modules/runtime.md); the names of
    the expert parameters. The plan rule on ep (rules/validity.ep_violation) is checked first.
    `tp_group` (serving replicas of an inference plan only): each expert's GEMMs split over tp as well
    (`expert_tp_placements`), the partial outputs all-reduced over tp."""
    from autoshard.rules.validity import ep_violation

    why = ep_violation(spec, ep)
    if why:
        raise InvalidConfigError(why)
    if tp > 1 and spec.ffn % tp:
        raise InvalidConfigError(f"tp ({tp}) must divide the experts' intermediate size ({spec.ffn}) of {spec.name} "
                                 f"to split every expert over tp; use a tp that divides {spec.ffn}")
    names = expert_param_names(model, spec)
    for path, experts in experts_modules(model, spec):
        parent, _, attr = path.rpartition(".")
        setattr(model.get_submodule(parent), attr,
                ParallelExperts(experts, group=ep_group, ep=ep, ep_rank=ep_rank, tp_group=tp_group, tp=tp,
                                tp_rank=tp_rank, where=path))
    return names


def expert_tp_names(model: nn.Module, spec: ModelSpec, *, tp: int, tp_rank: int) -> tuple[tuple[str, Shard], ...]:
    """(parameter name, tp placement) of every expert weight split over tp (`full_state_dict` gathers by it)."""
    return tuple((f"{path}.{name}", placement) for path, m in experts_modules(model, spec)
                 for name, placement in expert_tp_placements(m.down_proj.shape[-1] * tp, tp=tp, tp_rank=tp_rank).items())


def expert_tp_placements(ffn: int, *, tp: int, tp_rank: int) -> dict[str, Shard]:
    """How tp rank `tp_rank` slices each expert of a serving replica (Megatron's expert tensor
    parallelism, HF's `moe_tp_experts`): `gate_up_proj` (E, 2f, h) its rows of the gate and of the
    up projection (column-parallel, the [gate; up] halves split alike), `down_proj` (E, h, f) the
    matching columns (row-parallel); the partial outputs are summed over tp."""
    return {"gate_up_proj": Shard(dim=1, index=tp_rank, parts=tp, segments=(ffn, ffn)),
            "down_proj": Shard(dim=2, index=tp_rank, parts=tp, segments=(ffn,))}


@contextmanager
def replicated_tokens(model: nn.Module) -> Iterator[None]:
    """Within: every `ParallelExperts` of `model` slices its experts over identical tokens (generation)."""
    layers = [m for m in model.modules() if isinstance(m, ParallelExperts)]
    for m in layers:
        m.replicated = True
    try:
        yield
    finally:
        for m in layers:
            m.replicated = False


# -- gradients and optimizer: dense over dp x ep x cp, experts over dp x cp -------------------------------

class GradSyncs:
    """Two `GradSync`s with one interface: dense parameters over `dense_group`, experts over `expert_group`."""

    def __init__(self, params: Sequence[nn.Parameter], expert_ids: set[int], *, dense_group, expert_group, zero: int,
                 prepare: Callable | None = None, main_grads: bool = False):
        dense = [p for p in params if id(p) not in expert_ids]
        experts = [p for p in params if id(p) in expert_ids]
        self.syncs = (GradSync(dense, dense_group, zero=zero, prepare=prepare, main_grads=main_grads),
                      GradSync(experts, expert_group, zero=zero, prepare=prepare, main_grads=main_grads))

    def begin(self, *, last: bool, first: bool = True) -> None:
        for sync in self.syncs:
            sync.begin(last=last, first=first)

    def finish(self) -> None:
        for sync in self.syncs:
            sync.finish()

    def reduced_grads(self) -> dict[int, Tensor]:
        return {k: v for sync in self.syncs for k, v in sync.reduced_grads().items()}

    def buffers(self) -> list[Tensor]:
        return [t for sync in self.syncs for t in sync.buffers()]

    def sharded_optimizer(self, factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None, *,
                          masters: bool = True) -> ShardedOptimizers:
        """ZeRO-1/2: the optimizer state of each group sharded over that group (and the fp32 masters under
        bf16-mixed: runtime/data_parallel.py)."""
        return ShardedOptimizers(tuple(ShardedOptimizer(sync, factory, masters=masters) for sync in self.syncs))


class ShardedOptimizers:
    """The ShardedOptimizer of each sync group (dense over dp x ep x cp, experts over dp x cp), stepped
    together; per-parameter state and masters merged over the groups (checkpoints)."""

    def __init__(self, optimizers: tuple[ShardedOptimizer, ...]):
        self.optimizers = optimizers

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self) -> None:
        for opt in self.optimizers:
            opt.zero_grad()

    def full_params(self) -> dict[int, Tensor]:
        return {k: v for opt in self.optimizers for k, v in opt.full_params().items()}

    def set_params(self, values: dict[int, Tensor]) -> None:
        for opt in self.optimizers:
            opt.set_params(values)

    # -- per-parameter state (checkpoints: runtime/checkpoint.py): each group's, in group order ------
    def param_states(self) -> dict[int, dict[str, Tensor]]:
        return {k: v for opt in self.optimizers for k, v in opt.param_states().items()}

    def load_param_states(self, states: dict[int, dict[str, Tensor]]) -> None:
        for opt in self.optimizers:
            opt.load_param_states(states)


# -- the router's auxiliary loss --------------------------------------------------------------------

def load_balancing_loss(router_logits: Sequence[Tensor], *, experts: int, top_k: int,
                        group: dist.ProcessGroup | None, sequence_group: dist.ProcessGroup | None = None) -> Tensor:
    """This rank's share of HF's load-balancing loss (Switch Transformer eq. 4-6, HF's
    `load_balancing_loss_func`) over the rows that all ranks of `group` (dp x ep x cp) process
    together, such that the SUM over the group's ranks is HF's loss on those rows.

    HF: L = E * sum_e f_e * P_e, with f_e = (top-k assignments to e) / R and P_e = (sum of router
    probabilities of e) / R, both summed over every layer (R = rows x layers). The product is not a
    sum over ranks, so: the assignment counts (not differentiable) and R are all-reduced over
    `group` first; P stays local, divided by the global R. Then sum over ranks of
    E * sum_e f_e^global * P_e^local = L exactly, and each rank's gradient is its rows' part of
    dL/dlogits. Each layer's router logits are (rows, E) for this rank's rows (tokens).

    Under gradient accumulation each micro-step's loss is that of the global micro-batch (the
    rows every rank processes at that step), and the runtime averages them over micro-steps
    (Megatron-Core scales its per-micro-batch aux loss the same way): with one micro-batch per
    rank it is HF's loss on the global batch exactly (tests/moe/test_expert_parallel.py).

    `sequence_group` (tp under sequence parallelism: each rank routes its shard of the tokens): the statistics are
    summed over it too, and the loss takes the value of the tp ranks' sum (the same on each, as the cross-entropy
    is) with the gradient of this rank's share (summed over tp with the MoE block's gradients)."""
    counts, probs = 0, 0
    for logits in router_logits:
        p = torch.softmax(logits.float(), dim=-1)  # (rows, E)
        _, chosen = torch.topk(p, top_k, dim=-1)
        counts = counts + torch.bincount(chosen.reshape(-1), minlength=experts).float()
        probs = probs + p.sum(dim=0)
    total = torch.tensor([float(sum(logits.shape[0] for logits in router_logits))], device=probs.device)
    counts = counts.detach().clone()
    for g in (group, sequence_group):
        if g is not None and dist.get_world_size(g) > 1:
            dist.all_reduce(counts, group=g)
            dist.all_reduce(total, group=g)
    share = experts * torch.sum((counts / total) * (probs / total))
    if sequence_group is None or dist.get_world_size(sequence_group) == 1:
        return share
    whole = share.detach().clone()
    dist.all_reduce(whole, group=sequence_group)
    return share + (whole - share.detach())
