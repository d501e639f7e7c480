"""`autoshard verify --model M`: prove a model class exact on gloo before trusting a plan on it.

A tiny config of the same class (models/tiny.py: one layer of each layer type, multipliers and
softcaps exaggerated so a dropped op shows, dropout off: a split run draws other masks than one
process) is trained for two SGD steps on `--ranks` gloo processes under every axis the planner
may choose (dp, tp, pp, cp; ep for a MoE model; tp with sequence_parallel), each rank against one process: the
loss of every step, every gradient and every weight after the steps must agree (rtol 1e-4, atol
1e-5; SGD, whose step is linear in the gradient: why not AdamW, docs/decoders.md). The table says per
axis: exact, refused (the model's facts refuse it, with why: models/facts.py), failed (what differed)
or error (what was raised). The verdict is stored per model
class, transformers version and verify method (models/verdicts.py); `plan` and `sweep` then do not
search a failed axis, and `parallelize` refuses a plan that uses one, naming the verdict.
"""

from __future__ import annotations

import json
import os
import tempfile

AXES = ("dp", "tp", "pp", "cp", "ep", "sequence_parallel")
TOL = dict(rtol=1e-4, atol=1e-5)


def add_parser(sub) -> None:
    from autoshard.commands.common import positive_int

    p = sub.add_parser("verify", help="prove a model class exact on gloo under every axis, against one process",
                       description="Train a tiny model of the same class as --model (one layer of each kind, "
                       "exaggerated multipliers / softcaps) on --ranks gloo processes under dp, tp, pp, cp (ep "
                       "for a MoE model, and tp with sequence_parallel), each against one process: loss, every "
                       "gradient and the weights after two SGD steps. Prints axis -> exact / refused / failed / "
                       "error; the verdict is cached per model class and transformers version, and plan / sweep / "
                       "parallelize then leave out an axis that failed.")
    p.add_argument("--model", required=True, help="preset name or package.module:factory returning the model")
    p.add_argument("--ranks", type=positive_int, default=2, help="gloo processes (2-4; default 2)")
    p.add_argument("--axes", default=",".join(AXES),
                   help=f"comma-separated axes to prove (default all: {','.join(AXES)}; ep only for a MoE model)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def run(args) -> int:
    from autoshard.errors import InvalidConfigError
    from autoshard.models import verdicts
    from autoshard.models.presets import resolve_model
    from autoshard.models.tiny import exaggerated, tiny_config, without_dropout

    if not 2 <= args.ranks <= 4:
        raise InvalidConfigError(f"--ranks {args.ranks}: verify runs 2 to 4 gloo processes; use --ranks 2, 3 or 4")
    axes = tuple(a.strip() for a in args.axes.split(",") if a.strip())
    unknown = [a for a in axes if a not in AXES]
    if unknown or not axes:
        raise InvalidConfigError(f"--axes {args.axes!r}: expected a comma-separated list of {', '.join(AXES)}")
    spec, model = resolve_model(args.model, device="meta")
    config = without_dropout(exaggerated(tiny_config(model.config)))
    kept = {a: v for a, v in verdicts.load(type(model)).items() if a not in axes}
    verdicts.clear(type(model))  # the axes asked for are re-proven from scratch
    results = verify_config(config, ranks=args.ranks, axes=tuple(a for a in axes if a != "ep" or spec.is_moe))
    verdicts.store(type(model), {**kept, **results})
    if args.json:
        print(json.dumps({"model": args.model, "class": type(model).__name__, "ranks": args.ranks,
                          "axes": {a: {"status": s, "detail": d} for a, (s, d) in results.items()}}, indent=2))
    else:
        print(f"{type(model).__name__} ({args.model}), tiny config on {args.ranks} gloo ranks vs one process:")
        for axis, (status, detail) in results.items():
            where = f"tp={args.ranks} sequence_parallel" if axis == "sequence_parallel" else f"{axis}={args.ranks}"
            print(f"  {where}  {status}" + (f": {detail}" if detail else ""))
    return 1 if any(s in verdicts.FAILED for s, _ in results.values()) else 0


def verify_config(config, *, ranks: int, axes: tuple[str, ...]) -> dict[str, tuple[str, str]]:
    """{axis: (status, detail)} of a tiny `config` on `ranks` spawned gloo processes (module docstring)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "verdicts.json")
        mp.spawn(_rank, args=(ranks, os.path.join(tmp, "store"), config, axes, out), nprocs=ranks, join=True)
        with open(out) as f:
            return {a: tuple(v) for a, v in json.load(f).items()}


def _rank(rank: int, ranks: int, store: str, config, axes, out: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ.pop("WORLD_SIZE", None)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, ranks), rank=rank, world_size=ranks)
    try:
        results = {axis: _verdict(config, axis, ranks) for axis in axes}
        if rank == 0:
            with open(out, "w") as f:
                json.dump(results, f)
    finally:
        dist.destroy_process_group()


def _verdict(config, axis: str, ranks: int) -> tuple[str, str]:
    from autoshard.errors import AutoshardError
    from autoshard.rules.validity import refusal

    try:
        source = _Source(config)
        sequence = axis == "sequence_parallel"  # on tp's ranks: refused where tp is
        why = refusal(source.spec, "tp") if sequence else None
        why = why or refusal(source.spec, axis)
        if why:
            return "refused", why.split(": ", 1)[1]
        plan = {"tp": ranks, "sequence_parallel": True} if sequence else \
            {axis: ranks, **({"micro_batch": 2} if axis == "pp" else {})}
        diff = _compare(source, plan)
        return ("exact", "") if diff is None else ("failed", diff)
    except AutoshardError as e:
        return "refused", str(e).splitlines()[0]
    except Exception as e:  # a crash under this axis: the verdict, not the end of the run
        return "error", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]


class _Source:
    def __init__(self, config):
        from autoshard.models.presets import spec_from_hf_config

        self.config = config
        model = self.build()
        self.spec = spec_from_hf_config(model.config, name=type(model).__name__, model=model)

    def build(self):
        from autoshard.models.tiny import build_tiny

        return build_tiny(self.config, seed=0)


def _compare(source: _Source, plan: dict) -> str | None:
    """What differs between `plan` and one process over two SGD steps (module docstring), or None."""
    import functools

    import torch

    import autoshard

    batch, seq = 4 * plan.get("dp", 1) * plan.get("ep", 1), 16
    gen = torch.Generator().manual_seed(1)
    data = [torch.randint(0, source.spec.vocab, (batch, seq), generator=gen) for _ in range(2)]
    optimizer = functools.partial(torch.optim.SGD, lr=1e-2)
    ref = source.build()
    opt = optimizer(ref.parameters())
    losses = []
    for ids in data:
        opt.zero_grad()
        loss = ref(ids, labels=ids, use_cache=False).loss  # a training step keeps no cache
        loss.backward()
        losses.append(loss.detach())
        opt.step()
    # a parameter no loss reaches (a wrapper's vision tower on text) has no gradient: zeros, as full_grads gives it
    grads = {n: torch.zeros_like(p) if p.grad is None else p.grad for n, p in ref.named_parameters()}
    dm = autoshard.parallelize(source.build(), data[0], plan=plan, global_batch=batch, optimizer=optimizer,
                               timeout_s=120)
    for step, (ids, expected) in enumerate(zip(data, losses)):
        why = _differs(dm.train_step(ids, ids), expected, f"loss of step {step + 1}")
        if why:
            return why
    for what, got, want in (("gradient", dm.full_grads(), grads),
                            ("weight after 2 SGD steps", dm.full_state_dict(), dict(ref.named_parameters()))):
        for name, value in want.items():
            why = _differs(got.get(name), value.detach(), f"{what} {name}")
            if why:
                return why
    return None


def _differs(actual, expected, what: str) -> str | None:
    import torch

    if actual is None:
        return f"{what}: missing"
    try:
        torch.testing.assert_close(actual, expected, **TOL)
    except AssertionError:
        err = (actual.float() - expected.float()).norm() / max(expected.float().norm(), 1e-12)
        return f"{what} differs from one process by {float(err):.2%} of its norm"
    return None
