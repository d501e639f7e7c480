"""Each rank checks a parallelized model against a single-process run it computes itself."""

from __future__ import annotations

import functools

import torch
from torch.testing import assert_close

import autoshard
from autoshard.models.presets import build_model, get_spec

TOL = dict(rtol=1e-4, atol=1e-5)
# Adam's update is lr * m / (sqrt(v) + eps): a gradient element of ~1e-9 (it happens: 7.6e-10 in
# llama-tiny's layer 2 o_proj) moves by up to lr whatever its sign noise, so tp's different
# summation order flips it. eps=1e-6 keeps such elements' updates proportional to their size.
ADAM = dict(lr=1e-3, eps=1e-6)


def optimizer_factory(sgd: bool = False):
    """AdamW (ADAM) by default; `sgd`: plain SGD, whose update is lr x the gradient, for a layout whose
    summation order leaves gradient elements near Adam's eps (a ~1e-6 gradient's Adam step flips with its
    last bits of noise, so only SGD compares the weights after a step at fp32 tolerance there)."""
    return functools.partial(torch.optim.SGD, lr=1e-2) if sgd else functools.partial(torch.optim.AdamW, **ADAM)


def batches(vocab: int, *, global_batch: int, seq: int, steps: int):
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, vocab, (global_batch, seq), generator=gen)
        labels = ids.clone()
        labels[0, : seq // 2] = -100  # uneven valid-token counts across dp ranks
        out.append((ids, labels))
    return out


# bf16-mixed: a bf16 GEMM rounds its output to 8 bits of mantissa, and a distributed run sums in
# another order, so it agrees with the single-process bf16-mixed run to bf16 precision, not fp32's.
# How far bf16 itself is from fp32 differs by tensor (on these tiny models: gradients 1.4% of their
# norm for LLaMA's median tensor, up to 7.5% for a Mamba-2 A_log). Two bf16 runs that round in
# different places each carry an error of about that size, so they differ by up to ~sqrt(2) of it:
# each gradient may differ from the single bf16 run by twice its own bf16-vs-fp32 distance (measured
# in the same test) plus 2% of its norm; a missing reduction or a wrong scale is off by 50% or more.
# The loss agrees to 1%. Weights after AdamW are not compared in bf16: Adam moves an element by about
# lr whatever its gradient's size, so bf16 noise in a tiny gradient is a full-size update difference;
# the second step's loss and gradients, taken at the updated weights, check the step instead.
BF16_LOSS = dict(rtol=1e-2, atol=1e-3)
BF16_NORM = 2e-2
# fp8 (runtime/fp8.py): each rank scales its own slice of the batch and of the weights, so the distributed
# FP8 step rounds elsewhere than the single-process FP8 step, by float8's 3-bit mantissa: FP8 is 10% of the
# norm from fp32 on LLaMA's median tensor here and 15-50% on Mamba-2's dt_bias / A_log / D (whose gradients
# come through float8 in_proj outputs); a dp=2 Mamba-2 run measured 0.36 of dt_bias's norm from the single
# FP8 run where that run is 0.16 from fp32. So three times FP8's own error (plus 2% of the norm): a dropped
# reduction over tp or dp is off by 50% or more; the loss still agrees to 1%.
FP8_NOISE = 3.0


def assert_bf16_close(actual, expected, fp32, *, msg: str, noise_factor: float = 2.0) -> None:
    """||actual - expected|| <= noise_factor ||expected - fp32|| + 2% ||expected|| (`fp32`: the fp32 run's
    tensor; `noise_factor` 2 for bf16-mixed, FP8_NOISE for fp8)."""
    actual, expected, fp32 = actual.float(), expected.float(), fp32.float()
    err, noise, scale = ((actual - expected).norm().item(), (expected - fp32).norm().item(), expected.norm().item())
    assert err <= noise_factor * noise + BF16_NORM * scale + 1e-7, \
        (f"{msg}: |dist - single-process run| = {err:.3g}, above {noise_factor:g} x its own error against fp32 "
         f"{noise:.3g} + 2% of the norm {scale:.3g}")


class Tiny:
    """A tiny model of any HF decoder class (autoshard/models/tiny.py): `config` built by `build()`;
    `spec` read off it as `parallelize` reads it (models/facts.py)."""

    def __init__(self, name: str, config):
        self.name, self.config = name, config

    def build(self):
        from autoshard.models.tiny import build_tiny

        return build_tiny(self.config, seed=0)

    @functools.cached_property
    def spec(self):
        from dataclasses import replace

        from autoshard.models.presets import spec_from_hf_config

        model = self.build()
        return replace(spec_from_hf_config(model.config, name=self.name, model=model), name=self.name)

    def __repr__(self):
        return self.name


def reference(spec, data, *, bf16: bool = False, fp8_recipe: str | None = None, prepare=None, sgd: bool = False):
    """Losses, last gradients and final weights of one process running the HF model.

    bf16: the single-process bf16-mixed run, the recipe the runtime runs (runtime/precision.py):
    bf16 parameters, the forward under torch.autocast(bfloat16), the gradient taken into fp32, AdamW
    stepping fp32 master weights that are copied back into the bf16 parameters. The gradients and
    weights returned are then the fp32 main gradients and masters. `fp8_recipe` (with bf16): that run
    with the layers' projections swapped for torchao's Float8Linear by torchao's own
    `convert_to_float8_training` (what a torchao user runs on one device)."""
    model = _built(spec, prepare)
    if fp8_recipe is not None:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        from autoshard.rules.sharding import float8_modules

        wanted = set(float8_modules(spec))
        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(fp8_recipe),
                                   module_filter_fn=lambda module, path: path in wanted)
    if not bf16:
        opt = optimizer_factory(sgd)(model.parameters())
        losses = []
        for ids, labels in data:
            opt.zero_grad()
            loss = model(ids, labels=labels, use_cache=False).loss  # a training step: no cache
            loss.backward()
            losses.append(loss.detach())
            opt.step()
        return model, losses, _grads(model.named_parameters())
    names = [n for n, _ in model.named_parameters()]
    masters = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
    for p in model.parameters():  # parameters only: buffers (RoPE inv_freq) stay as HF keeps them
        p.data = p.data.to(torch.bfloat16)
    opt = torch.optim.AdamW(masters, **ADAM)
    losses = []
    for ids, labels in data:
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(ids, labels=labels, use_cache=False).loss
        loss.backward()
        losses.append(loss.detach())
        for master, p in zip(masters, model.parameters()):
            master.grad = p.grad.float() if p.grad is not None else None  # AdamW skips it, as for p
        opt.step()
        with torch.no_grad():
            for master, p in zip(masters, model.parameters()):
                p.copy_(master)
    final = _built(spec, prepare)
    final.load_state_dict({n: m.detach() for n, m in zip(names, masters)}, strict=False)
    return final, losses, _grads(zip(names, masters))


def _grads(named) -> dict:
    """{name: gradient}, zeros for a parameter the loss does not reach (`full_grads` reports it so)."""
    return {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in named}


def _built(spec, prepare):
    model = spec.build() if isinstance(spec, Tiny) else build_model(spec, seed=0)
    if prepare is not None:  # e.g. a config switch or a router made to route every token alike
        prepare(model)
    return model


def check_axes(sources: dict, plans, refused: dict, *, sgd: bool = False) -> None:
    """Every model of `sources` ({name: source}) under each plan of `plans(name)`: exact against one process,
    logits included, or, where `refused` names (name, axis), refused on every rank with that reason. `sgd`: see
    `optimizer_factory`."""
    import re

    import pytest

    from autoshard.errors import InvalidConfigError

    for name, source in sources.items():
        for plan in plans(name):
            axis = next(iter(plan))
            if (name, axis) in refused:
                with pytest.raises(InvalidConfigError, match=f"{axis} is refused for .*: .*" + re.escape(refused[name, axis])):
                    check_plan(source, plan)
                continue
            check_plan(source, plan, logits=True, sgd=sgd)


def check_plan(preset, plan: dict, *, global_batch: int = 8, seq: int = 16, steps: int = 2,
               logits: bool = False, prepare=None, sgd: bool = False, compile=None) -> None:
    """`preset`: a preset name or a ModelSpec (e.g. of a user-built config). `prepare(model)`: applied
    to the reference model and the distributed one before anything runs."""
    source = preset if isinstance(preset, Tiny) else None
    spec = source.spec if source else get_spec(preset) if isinstance(preset, str) else preset
    preset = spec.name
    data = batches(spec.vocab, global_batch=global_batch, seq=seq, steps=steps)
    precision = plan.get("precision") if isinstance(plan, dict) else None
    bf16 = precision in ("bf16-mixed", "fp8")  # fp8 is bf16-mixed with float8 projections (runtime/fp8.py)
    fp8_recipe = plan.get("fp8_recipe", "tensorwise") if precision == "fp8" else None
    ref, ref_losses, ref_grads = reference(source or spec, data, bf16=bf16, fp8_recipe=fp8_recipe, prepare=prepare,
                                           sgd=sgd)
    dm = autoshard.parallelize(_built(source or spec, prepare), data[0][0], plan=plan, global_batch=global_batch,
                               optimizer=optimizer_factory(sgd), compile=compile)
    gemm_dtypes = _record_linear_outputs(dm.model)
    norm_tokens = _record_norm_tokens(dm.model, spec) if dm.plan.sequence_parallel else None
    for (ids, labels), expected in zip(data, ref_losses):
        assert_close(dm.train_step(ids, labels), expected, **(BF16_LOSS if bf16 else TOL),
                     msg=lambda m: f"{preset} {plan} loss: {m}")
    if norm_tokens is not None:  # the norms of a sequence-parallel stage ran on this rank's 1/tp shard of its cp
        on = set(dm._setup.program.sequence_paths)  # chunk, the others (a plan mixing stages) on the whole chunk
        local = seq // dm.plan.mesh.cp
        want = {path: local // dm.plan.mesh.tp if path in on else local for path in norm_tokens}
        assert norm_tokens == {p: {n} for p, n in want.items()}, f"{preset} {plan}: {norm_tokens}"
    expected_dtype = torch.bfloat16 if bf16 else torch.float32
    assert gemm_dtypes == {expected_dtype}, f"{preset} {plan}: linears output {gemm_dtypes}, expected {expected_dtype}"
    if fp8_recipe is not None:
        _check_float8(dm, spec, f"{preset} {plan}")
    if bf16:
        _check_bf16(dm, ref_grads, reference(source or spec, data, prepare=prepare)[2], f"{preset} {plan}",
                    noise_factor=FP8_NOISE if fp8_recipe else 2.0)
        return
    if dm.plan.zero == 2:  # ZeRO-2 keeps no full gradient once a step is done, only this rank's slices
        assert all(p.grad is None for p in dm.model.parameters()), f"{preset} {plan}: a full gradient was kept"
    if dm.plan.zero == 3:  # ZeRO-3: parameters and gradients are FSDP2 shards over dp (x cp)
        from torch.distributed.tensor import DTensor

        # (a parameter the loss does not reach keeps no gradient, as in one process: DeepSeek-V3.2's indexer)
        assert all(isinstance(p, DTensor) and isinstance(p.grad, (DTensor, type(None))) for p in dm.model.parameters())
        mesh = dm.plan.mesh  # ep > 1: the experts sharded over the ranks holding them, the dense weights over all
        expected = {True: mesh.dp * mesh.cp, False: mesh.dp * mesh.ep * mesh.cp}
        meshes = {n in dm._setup.expert_names: p.device_mesh.size() for n, p in dm.model.named_parameters()}
        assert meshes == {k: expected[k] for k in meshes}, f"{preset} {plan}: FSDP2 mesh sizes {meshes}"
        from torch.distributed.fsdp import CPUOffloadPolicy

        policy = dm.model._get_fsdp_state()._fsdp_param_group.offload_policy
        assert isinstance(policy, CPUOffloadPolicy) == dm.plan.offload_optimizer, f"{preset} {plan}: {policy}"
    grads = dm.full_grads()
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        assert_close(grad, ref_grads[name], **TOL, msg=lambda m: f"{preset} {plan} grad {name}: {m}")
    state = dm.full_state_dict()
    for name, param in ref.named_parameters():
        assert_close(state[name], param.detach(), **TOL, msg=lambda m: f"{preset} {plan} weight {name}: {m}")
    if logits:  # the forward alone, on the weights the run ended with
        ref.load_state_dict(state, strict=False)
        with torch.no_grad():
            expected = ref(data[0][0], use_cache=False).logits
        assert_close(dm(data[0][0]), expected, **TOL, msg=lambda m: f"{preset} {plan} logits: {m}")


def _check_bf16(dm, grads_ref, grads32, what: str, *, noise_factor: float) -> None:
    """bf16-mixed: bf16 parameters (ZeRO-3: FSDP2's fp32 shards), fp32 masters and main gradients, equal to
    the single-process bf16-mixed run's (`grads_ref`) to bf16 precision (`grads32`: the fp32 run's)."""
    held = {p.dtype for p in dm.local_params()}
    assert held == ({torch.float32} if dm.plan.zero == 3 else {torch.bfloat16}), f"{what}: parameters are {held}"
    assert all(t.dtype == torch.float32 for t in dm.full_state_dict().values()), f"{what}: masters not fp32"
    grads = dm.full_grads()
    assert grads.keys() == grads_ref.keys()
    for name, grad in grads.items():
        assert grad.dtype == torch.float32, f"{what} grad {name} is {grad.dtype}, not fp32"
        assert_bf16_close(grad, grads_ref[name], grads32[name], msg=f"{what} grad {name}", noise_factor=noise_factor)


def _check_float8(dm, spec, what: str) -> None:
    """fp8: exactly the projections of `float8_modules` run torchao's Float8Linear (the row-parallel ones with
    their tp reduction); under ZeRO-3 with the tensorwise recipe FSDP2 all-gathers their weights in float8."""
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    from autoshard.rules.sharding import float8_modules

    swapped = {path for path, m in dm.model.named_modules() if isinstance(m, Float8Linear)}
    assert swapped == set(float8_modules(spec)), f"{what}: float8 linears {sorted(swapped ^ set(float8_modules(spec)))}"
    if dm.plan.zero == 3:
        fp8_gather = {isinstance(dm.model.get_submodule(p).weight._local_tensor, WeightWithDynamicFloat8CastTensor)
                      for p in swapped}
        assert fp8_gather == {dm.plan.fp8_recipe.value == "tensorwise"}, f"{what}: float8 all-gather {fp8_gather}"


def _record_norm_tokens(model, spec) -> set:
    """{norm path: the sequence lengths it sees from now on} of the norms outside the TP regions that run on
    this rank (sequence parallelism), and of a MoE block (its router and experts take its tokens flattened:
    (b, s, h) only at the block)."""
    from autoshard.rules.sharding import sequence_modules

    seen: dict[str, set] = {}

    def record(mod, args, out, path):
        if args and isinstance(args[0], torch.Tensor) and args[0].dim() == 3:
            seen.setdefault(path, set()).add(args[0].shape[1])

    for path in sequence_modules(spec):
        model.get_submodule(path).register_forward_hook(functools.partial(record, path=path))
    return seen


def _record_linear_outputs(model) -> set:
    """The dtypes every nn.Linear (and HF's Conv1D, GPT-2's transposed linear) of `model` outputs from now on
    (bf16-mixed: bf16 GEMMs); a Linear subclass returning a tuple (Llama-4's router: scores and logits) is skipped."""
    from transformers.pytorch_utils import Conv1D

    seen = set()
    for module in model.modules():
        if isinstance(module, (torch.nn.Linear, Conv1D)):
            module.register_forward_hook(lambda mod, args, out: seen.add(out.dtype) if isinstance(out, torch.Tensor) else None)
    return seen
