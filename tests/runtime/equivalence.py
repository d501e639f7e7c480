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


def batches(vocab: int, *, global_batch: int, seq: int, steps: int):
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, vocab, (global_batch, seq), generator=gen)
        labels = ids.clone()
        labels[0, : seq // 2] = -100  # uneven valid-token counts across dp ranks
        out.append((ids, labels))
    return out


def reference(spec, data):
    """Losses, last gradients and final weights of one process running the HF model."""
    model = build_model(spec, seed=0)
    opt = torch.optim.AdamW(model.parameters(), **ADAM)
    losses = []
    for ids, labels in data:
        opt.zero_grad()
        loss = model(ids, labels=labels).loss
        loss.backward()
        losses.append(loss.detach())
        opt.step()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return model, losses, grads


def check_plan(preset, plan: dict, *, global_batch: int = 8, seq: int = 16, steps: int = 2,
               logits: bool = False) -> None:
    """`preset`: a preset name or a ModelSpec (e.g. of a user-built config)."""
    spec = get_spec(preset) if isinstance(preset, str) else preset
    preset = spec.name
    data = batches(spec.vocab, global_batch=global_batch, seq=seq, steps=steps)
    ref, ref_losses, ref_grads = reference(spec, data)
    dm = autoshard.parallelize(build_model(spec, seed=0), data[0][0], plan=plan, global_batch=global_batch,
                               optimizer=functools.partial(torch.optim.AdamW, **ADAM))
    for (ids, labels), expected in zip(data, ref_losses):
        assert_close(dm.train_step(ids, labels), expected, **TOL, msg=lambda m: f"{preset} {plan} loss: {m}")
    if dm.plan.zero == 2:  # ZeRO-2 keeps no full gradient once a step is done, only this rank's slices
        assert all(p.grad is None for p in dm.model.parameters()), f"{preset} {plan}: a full gradient was kept"
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
            expected = ref(data[0][0]).logits
        assert_close(dm(data[0][0]), expected, **TOL, msg=lambda m: f"{preset} {plan} logits: {m}")
