"""`DistributedModel`: one rank's part of the training step a Plan describes.

The whole contract: docs/modules/runtime.md (runtime/dist_model.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from autoshard.errors import AutoshardError, InvalidConfigError
from autoshard.ir import Plan
from autoshard.model_spec import Mixer, ModelSpec
from autoshard.models.presets import max_positions
from autoshard.ir import Replicate, ShardProgram
from autoshard.runtime.agreement import BATCH_FIELDS, agree, batch_facts
from autoshard.runtime.comm import gather_last_dim
from autoshard.runtime.context_parallel import CPRuntime
from autoshard.runtime.data_parallel import GradSync, ShardedOptimizer
from autoshard.runtime.expert_parallel import GradSyncs, load_balancing_loss, replicated_tokens
from autoshard.runtime.loss import causal_lm_loss, count_tokens
from autoshard.runtime.mesh import Groups, peer_lost
from autoshard.runtime.precision import autocast
from autoshard.runtime.stages import whole_sequence_mask
from autoshard.runtime.tensor_parallel import partial_grad_reducer, sequence_parallel_off, shard_tensor, unshard
from autoshard.runtime.zero3 import full_tensor

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


@dataclass(frozen=True, slots=True, kw_only=True)
class RankSetup:
    """Everything a rank needs to run its part (built by `autoshard.api.parallelize`)."""

    model: nn.Module  # already sliced for tp, in place
    spec: ModelSpec
    plan: Plan
    groups: Groups
    program: ShardProgram
    pipeline: object | None = None  # runtime.pipeline.PipelineRunner when pp > 1
    cp: CPRuntime | None = None  # context parallelism when cp > 1
    expert_names: frozenset[str] = frozenset()  # ep > 1: parameters of this rank's experts
    expert_tp: tuple = ()  # (name, Shard) of expert weights split over tp (serving replicas of MoE models)
    fingerprint: str = ""  # of the model before it was sliced (fingerprint.fingerprint_module)
    full_shapes: Mapping[str, tuple[int, ...]] | None = None  # original name -> global shape
    generate_only: bool = False  # built from an inference plan: checked by generate's rules, not training's


class DistributedModel:
    """See docs/modules/runtime.md."""

    def __init__(self, setup: RankSetup, *, optimizer: OptimizerFactory | None = None):
        self._setup = setup
        self.model = setup.model
        self.plan = setup.plan
        self._groups = setup.groups
        self._tp_group = setup.groups.tp if setup.plan.mesh.tp > 1 else None
        # vocab-parallel LM head: logits are this rank's vocab slice (vocab-parallel loss, gathered for
        # evaluation); a replicated head (the plan's "head" choice) gives full logits on every rank
        self._logits_group = self._tp_group if setup.program.vocab_head else None
        self._runner = setup.pipeline
        self._cp = setup.cp
        self.precision = setup.plan.precision.resolve(setup.groups.device.type)  # bf16-mixed: runtime/precision.py
        # cp > 1: replicated gradients are summed (and ZeRO shards) over dp x cp, not dp alone
        self._grad_group = setup.cp.grad_group if setup.cp is not None else setup.groups.dp
        params = list(self._runner.parameters()) if self._runner is not None else list(self.model.parameters())
        self._params = list(dict.fromkeys(params))
        self._names = {id(p): n for n, p in self.model.named_parameters()}
        prepare = partial_grad_reducer(self.model, setup.program, self._tp_group)
        mesh = setup.plan.mesh
        self._replicas = mesh.dp * mesh.ep * mesh.cp  # ranks that split the batch (rows or sequence)
        # ZeRO-3: FSDP2 (runtime/zero3.py, applied by parallelize) reduce-scatters over dp; GradSync
        # only sums the tp-partial gradients then, and the optimizer steps the DTensor shards
        self._zero3 = setup.plan.zero == 3
        zero = 1 <= setup.plan.zero <= 2
        # bf16-mixed under ZeRO 0-2: Megatron's layout (runtime/precision.py): bf16 parameters, fp32 main
        # gradients, fp32 masters in the (sharded) optimizer; ZeRO-3 is FSDP2's own (runtime/zero3.py)
        self._main_grads = self.precision.mixed and not self._zero3
        # the gradients live in one flat buffer per bucket (Megatron-LM's grad buffer, `main_grad`) under
        # bf16-mixed, and under ZeRO-1/2 at any precision (GradSync's own rule)
        if self._zero3:  # FSDP2 reduces the gradients (ep > 1: the dense ones over dp x ep x cp, runtime/zero3.py)
            self._sync = GradSync(self._params, None, zero=0, prepare=prepare)
            self._loss_group = setup.groups.replicas if mesh.ep > 1 else self._grad_group
        elif mesh.ep > 1:  # experts over dp x cp (the grad group), dense over dp x ep x cp
            expert_ids = {id(p) for n, p in self.model.named_parameters() if n in setup.expert_names}
            self._sync = GradSyncs(self._params, expert_ids, dense_group=setup.groups.replicas,
                                   expert_group=self._grad_group, zero=setup.plan.zero, prepare=prepare,
                                   main_grads=self._main_grads)
            self._loss_group = setup.groups.replicas
        else:
            self._sync = GradSync(self._params, self._grad_group, zero=setup.plan.zero, prepare=prepare,
                                  main_grads=self._main_grads)
            self._loss_group = self._grad_group
        # HF keeps the coefficient on the model (read from the config when it was built)
        self._aux_coef = getattr(self.model, "router_aux_loss_coef", getattr(self.model.config, "router_aux_loss_coef", 0))
        self._optimizer = None
        # the ShardedOptimizer (ZeRO-1/2, or bf16-mixed at any ZeRO < 3); it holds fp32 masters under bf16-mixed,
        # while fp32 weights are their own masters (stepped in place as slices of a flat buffer)
        self._masters = None
        self._generator = None  # runtime.generate.Generator, built on the first generate()
        if zero or self._main_grads:
            if optimizer is not None or self._main_grads:
                masters = self._main_grads
                self._masters = (self._sync.sharded_optimizer(optimizer, masters=masters) if mesh.ep > 1
                                 else ShardedOptimizer(self._sync, optimizer, masters=masters))
            self._optimizer = self._masters if optimizer is not None else None
        elif optimizer is not None:
            self._optimizer = optimizer(self._params)
        # a frozen parameter (requires_grad False: AFMoE's expert_bias) has no master in the optimizer: its fp32
        # value is kept here, what master_weights and checkpoints read (one process's bf16-mixed run keeps it so)
        self._frozen = {id(p): p.detach().float().clone() for p in self._params
                        if self._main_grads and not p.requires_grad}
        if self._main_grads:  # the masters hold the fp32 values now: the model keeps bf16 copies
            with torch.no_grad():
                for p in self._params:
                    p.data = p.data.to(torch.bfloat16)
        self.steps = 0  # optimizer steps taken (restored by load_checkpoint)
        self._positions = max_positions(setup.spec, getattr(self.model, "config", None))  # the position rule
        self.fingerprint = setup.fingerprint
        self.full_shapes = dict(setup.full_shapes or {})
        self.device = setup.groups.device

    # -- training -----------------------------------------------------------------------------
    def train_step(self, input_ids: Tensor, labels: Tensor) -> Tensor:
        """One training step on the global batch; the global mean loss on every rank. The batch is checked
        first, on every rank alike (runtime/agreement.py): shape, vocabulary, and that all ranks hold it."""
        if self._setup.generate_only:  # the same on every rank: nothing hangs
            raise InvalidConfigError("this model runs an inference plan (one replica for dm.generate and evaluation, "
                                     "checked by generation's rules, not training's); train under a training plan "
                                     "(`autoshard plan`, or plan=dict(dp=..., tp=..., ...))")
        try:
            self._check_batch(input_ids, labels, global_batch=self.plan.global_batch, training=True,
                              where="train_step")
            return self._step(input_ids, labels)
        except RuntimeError as e:  # a collective that failed: name the ranks that are gone
            if isinstance(e, dist.DistError) or any(w in str(e) for w in ("gloo", "NCCL", "HCCL", "Connection")):
                raise peer_lost(e) from e
            raise

    def _check_batch(self, input_ids: Tensor, labels: Tensor | None, *, global_batch: int | None,
                     training: bool = False, where: str = "") -> None:
        """`where` (train_step, dm(input_ids)): the sequence is also held to the model's positions."""
        try:
            facts = batch_facts(input_ids, labels, vocab=self._setup.spec.vocab, global_batch=global_batch,
                                training=training, positions=self._positions if where else None, where=where)
            error = None
        except AutoshardError as e:
            facts, error = None, e
        agree("global batch", BATCH_FIELDS, facts, error=error, device=self._groups.device,
              hint="give every rank the same global batch (each rank takes its own slice of it)")

    def _step(self, input_ids: Tensor, labels: Tensor) -> Tensor:
        """`train_step` without the checks (bench/bench_agreement.py times the difference)."""
        plan, groups = self.plan, self._groups
        num_tokens = count_tokens(labels)
        rows = plan.global_batch // (plan.mesh.dp * plan.mesh.ep)  # ep peers take their own rows
        start = (groups.coords.dp * plan.mesh.ep + groups.coords.ep) * rows
        ids = input_ids[start:start + rows].to(groups.device)
        lbl = labels[start:start + rows].to(groups.device)
        for p in self._params:
            p.grad = None
        if self._runner is not None:
            self._sync.begin(last=False)  # the schedule runs every micro-batch; finish() reduces
            loss = self._runner.step(ids, lbl, num_tokens=num_tokens)
        else:
            loss = self._local_step(ids, lbl, num_tokens)
        self._sync.finish()
        if self._replicas > 1:
            dist.all_reduce(loss, group=self._loss_group)
        if self._optimizer is not None:
            self._optimizer.step()
        self.steps += 1
        return loss

    def _local_step(self, ids: Tensor, labels: Tensor, num_tokens: int) -> Tensor:
        micro = self.plan.micro_batch
        chunks = ids.shape[0] // micro
        total = torch.zeros((), device=ids.device)
        for i in range(chunks):
            rows = slice(i * micro, (i + 1) * micro)
            self._sync.begin(last=i == chunks - 1, first=i == 0)
            mb_ids, mb_labels, kwargs = ids[rows], labels[rows], {}
            if self._cp is not None:  # this rank's slice of the sequence, shifted targets
                mb_ids, positions, mb_labels = self._cp.local_inputs(mb_ids, mb_labels)
                kwargs = self._cp.model_kwargs(positions)
            with autocast(self.precision, ids.device):
                logits, router_logits = self._forward(mb_ids, **kwargs)
            loss = causal_lm_loss(logits, mb_labels, num_tokens=num_tokens,
                                  tp_group=self._logits_group, shifted=self._cp is not None)
            del logits  # the loss keeps its own fp32 copy (runtime/loss.py), not the logits
            if router_logits:  # HF's router auxiliary loss, statistics over all replicas, mean over micro-batches
                spec = self._setup.spec
                aux = load_balancing_loss(router_logits, experts=spec.experts, top_k=spec.top_k,
                                          group=self._loss_group if self._replicas > 1 else None,
                                          sequence_group=self._tp_group if self.plan.sequence_parallel else None)
                loss = loss + self._aux_coef * aux / chunks
            loss.backward()
            total += loss.detach()
        return total

    def _logits(self, ids: Tensor, **kwargs) -> Tensor:
        """This rank's logits (vocab slice under tp) for a batch, through the model's own modules."""
        return self._forward(ids, **kwargs)[0]

    def _forward(self, ids: Tensor, **kwargs) -> tuple[Tensor, tuple[Tensor, ...] | None]:
        """This rank's logits, and the router logits of every MoE layer when the config asks for them.

        Through the model's own root forward, always: whatever `ForCausalLM.forward` does around its LM
        head (Granite's logits_scaling, Cohere's logit_scale, Gemma-2's final softcap) runs as in one
        process; under tp those are elementwise on this rank's vocab slice of the logits."""
        if self.plan.sequence_parallel and self._setup.spec.mixer is Mixer.ATTENTION and "position_ids" not in kwargs:
            # HF would number the positions, and size the masks, of the 1/tp shard it sees between layers
            b, s = ids.shape
            kwargs = {**kwargs, "position_ids": torch.arange(s, device=ids.device)[None],
                      "attention_mask": whole_sequence_mask(self.model, self._setup.spec.layers, b, s, ids.device)}
        if getattr(self.model.config, "output_router_logits", False) and torch.is_grad_enabled() and not self._zero3:
            kwargs = {**kwargs, "output_router_logits": True}
        out = self.model(input_ids=ids, use_cache=False, **kwargs)
        return out.logits, getattr(out, "router_logits", None)  # (b, s, V / tp)

    # -- checks and evaluation ------------------------------------------------------------------
    def __call__(self, input_ids: Tensor) -> Tensor:
        """Full logits (b, s, V) of `input_ids` on every rank (no gradient)."""
        self._check_batch(input_ids, None, global_batch=None, where="dm(input_ids)")
        ids = input_ids.to(self._groups.device)
        with torch.no_grad(), autocast(self.precision, ids.device):
            if self._runner is not None:  # (with cp: the runner takes this rank's slice of the sequence)
                local = self._runner.forward(ids)
            elif self._cp is not None:  # each cp rank computes its slice of the sequence
                local_ids, positions, _ = self._cp.local_inputs(ids, None)
                local = self._logits(local_ids, **self._cp.model_kwargs(positions))
            else:
                local = self._logits(ids)
            full = gather_last_dim(local, self._logits_group)
            return self._cp.full_sequence(full) if self._cp is not None else full

    def generate(self, input_ids: Tensor, *, max_new_tokens: int) -> Tensor:
        """Prompt + greedy new tokens (b, s + n), n <= max_new_tokens, on every rank (collective)."""
        from autoshard.rules.validity import generate_violation

        mesh, spec = self.plan.mesh, self._setup.spec
        # the rule the inference planner checks its layouts with
        why = generate_violation(spec, mesh, strategies=self.plan.strategies, chunks=self.plan.chunks)
        if why:
            raise InvalidConfigError(why)
        self._check_batch(input_ids, None, global_batch=None)  # prompt ids in the vocabulary, the same on every rank
        if self._generator is None:
            from autoshard.ir import Stage
            from autoshard.runtime.generate import Generator
            from autoshard.runtime.stages import build_stage_module

            if self._runner is not None:  # this rank's chunks (several under virtual stages) and every chunk's rank
                chunks, placement = dict(zip(self._runner.local, self._runner.chunks)), self._runner.placement
            else:
                chunks = {0: build_stage_module(self.model, spec, Stage(first_layer=0, end_layer=spec.layers,
                                                                        embed=True, head=True))}
                placement = (0,)
            self._generator = Generator(self.model, spec, chunks, placement, tp_group=self._logits_group,
                                        pp_group=self._groups.pp if mesh.pp > 1 else None, device=self._groups.device)
        # bf16-mixed plans decode in bf16 too; ep > 1: every ep rank holds the same sequences, so the
        # experts are sliced over ep and summed by all-reduce (expert_parallel.replicated_tokens); a
        # sequence-parallel plan (any stage) runs with the sequence whole (tensor_parallel.sequence_parallel_off)
        with autocast(self.precision, self._groups.device), replicated_tokens(self.model), \
                sequence_parallel_off(self.model):
            return self._generator.generate(input_ids, max_new_tokens=max_new_tokens)

    def full_grads(self) -> dict[str, Tensor]:
        """{original name: full gradient of the last train_step} on every rank (collective)."""
        reduced = self._sync.reduced_grads()
        local = {}
        for p in self._params:
            grad = reduced.get(id(p), p.grad)
            if grad is None:  # no rank's loss reaches it (DeepSeek-V3.2's indexer): zeros, as a main gradient
                grad = torch.zeros_like(p, dtype=torch.float32 if self._main_grads else p.dtype)
            local[self._names[id(p)]] = full_tensor(grad)
        return self._assemble(local)

    def full_state_dict(self) -> dict[str, Tensor]:
        """{original name: full parameter} on every rank (collective); bf16-mixed: the fp32 masters."""
        return self._assemble(self.master_weights())

    def master_weights(self) -> dict[str, Tensor]:
        """{original name: this rank's (tp-local) weight}: the fp32 masters under bf16-mixed (collective over
        dp under ZeRO), else the parameters themselves (ZeRO-3: gathered from their FSDP2 shards)."""
        if not self._main_grads:
            return {self._names[id(p)]: full_tensor(p.detach()) for p in self._params}
        masters = {**self._frozen, **self._masters.full_params()}
        return {self._names[id(p)]: masters[id(p)] for p in self._params}

    def load_weights(self, values: Mapping[int, Tensor]) -> None:
        """Set every local parameter from {id(param): value cut as the param is held} (local), and the
        masters of the (sharded) optimizer from the same values."""
        with torch.no_grad():
            for p in self._params:
                p.copy_(values[id(p)])
        if self._masters is not None:
            self._masters.set_params(dict(values))
        for key in self._frozen:
            self._frozen[key] = values[key].detach().float().clone()

    # -- checkpoints (runtime/checkpoint.py) ----------------------------------------------------
    def save_checkpoint(self, path) -> None:
        """Model, optimizer, step count and RNG to directory `path` with torch.distributed.checkpoint,
        atomically; loadable under any plan and world size (collective)."""
        from autoshard.runtime.checkpoint import save_checkpoint

        save_checkpoint(self, path)

    def load_checkpoint(self, path, *, missing_ok: bool = False) -> int:
        """Restore what `save_checkpoint` wrote (under any plan); the number of steps taken (collective).
        `missing_ok=True`: no checkpoint at `path` returns 0 (a job's first start)."""
        from autoshard.runtime.checkpoint import load_checkpoint

        return load_checkpoint(self, path, missing_ok=missing_ok)

    def save_pretrained(self, path) -> None:
        """The full weights as a Hugging Face model directory (config + safetensors) (collective)."""
        from autoshard.runtime.checkpoint import save_pretrained

        save_pretrained(self, path)

    @property
    def optimizer(self) -> torch.optim.Optimizer | ShardedOptimizer | None:
        return self._optimizer

    def local_params(self) -> list[nn.Parameter]:
        """The parameters this rank holds (its pipeline stage's; tp slices), each once."""
        return self._params

    def param_name(self, param: nn.Parameter) -> str:
        return self._names[id(param)]

    def placement(self, name: str):
        """The tp placement of parameter `name` (Replicate when it is not split)."""
        return self._tp_placements().get(name, Replicate()) if self._tp_group is not None else Replicate()

    def _tp_placements(self) -> dict:
        """Every tp-split parameter's placement: the shard program's and the experts split over tp (serving)."""
        return {**dict(self._setup.program.placements), **dict(self._setup.expert_tp)}

    def _assemble(self, local: Mapping[str, Tensor]) -> dict[str, Tensor]:
        if self._runner is not None:
            local = self._runner.gather(local)
        return self.gather_shards(local)  # every ep rank's experts, concatenated along the expert dim

    def gather_shards(self, local: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """{name: full tensor} of this stage from this rank's pieces: the experts gathered over ep,
        then every tensor over tp (collective over ep and tp; checkpoints)."""
        if self.plan.mesh.ep > 1:
            local = {name: self._gather_experts(t) if name in self._setup.expert_names else t
                     for name, t in local.items()}
        return self.gather_tp(local)

    def local_piece(self, name: str, full: Tensor) -> Tensor:
        """This rank's piece of parameter `name` (or a tensor shaped like it) from its full value:
        its experts (ep > 1), then its tp slice. The inverse of `gather_shards` (local)."""
        if self.plan.mesh.ep > 1 and name in self._setup.expert_names:
            count = full.shape[0] // self.plan.mesh.ep
            full = full.narrow(0, dist.get_rank(self._groups.ep) * count, count)
        return shard_tensor(full, self.placement(name))

    def gather_tp(self, local: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """{name: full tensor} from this rank's tp slices (collective over tp; the same names on every tp rank)."""
        placements = self._tp_placements()
        out = {}
        for name, tensor in local.items():
            placement = placements.get(name, Replicate())
            if self._tp_group is None or isinstance(placement, Replicate):
                out[name] = tensor.detach().clone()
                continue
            slices = [torch.empty_like(tensor) for _ in range(self.plan.mesh.tp)]
            dist.all_gather(slices, tensor.detach().contiguous(), group=self._tp_group)
            out[name] = unshard(slices, placement)
        return out

    def _gather_experts(self, tensor: Tensor) -> Tensor:
        parts = [torch.empty_like(tensor) for _ in range(self.plan.mesh.ep)]
        dist.all_gather(parts, tensor.detach().contiguous(), group=self._groups.ep)
        return torch.cat(parts, dim=0)
