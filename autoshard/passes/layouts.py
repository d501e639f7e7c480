"""Layouts: every valid (dp, pp, tp, cp, ep) mesh for a model on N devices.

Contract: `valid_meshes(spec, devices, *, global_batch, seq_len, micro_batch=1) -> tuple[Mesh, ...]`
lists every mesh with dp*pp*tp*cp*ep == devices that passes the rules below, in a fixed order
(dp descending, then pp, tp, cp). If none passes it raises `InvalidConfigError` saying which
rule ruled each candidate out. `mesh_violation(spec, mesh, ...)` gives the first rule one mesh
breaks (None if valid), so the planner and the runtime can check a single mesh the same way.

Rules (the runtime's, see DESIGN.md):
  ep    must be 1: the supported models (LLaMA, Mamba-2) have no experts.
  tp    LLaMA: divides the attention heads, and either divides the KV heads (KV heads split) or
        is a multiple of them (each KV head replicated on tp / kv_heads ranks).
        Mamba-2: divides the SSM heads and the B/C groups (in_proj split by heads and groups).
  pp    at most the number of layers (every stage holds at least one layer).
  dp    dp x micro_batch divides the global batch.
  cp    LLaMA: 2*cp divides the sequence (load-balanced causal split, chunks i and 2cp-1-i).
        Mamba-2: cp divides the sequence (state passing needs no balancing).
  ZeRO  levels 2 and 3 need pp = 1 (`zero_violation`): they reduce gradients after every
        micro-batch, which a pipeline schedule's accumulation does not allow (DeepSpeed's rule too).
        The runtime runs levels 0-2 (`RUNTIME_ZERO`, what the planner searches); `sweep` also
        prices ZeRO-3.
"""

from __future__ import annotations

from autoshard.errors import InvalidConfigError
from autoshard.ir import Mesh
from autoshard.models.presets import Family, ModelSpec


def divisors(n: int) -> tuple[int, ...]:
    return tuple(d for d in range(1, n + 1) if n % d == 0)


def factorizations(devices: int) -> tuple[Mesh, ...]:
    """Every (dp, pp, tp, cp, ep) with product `devices`, dp descending then pp, tp, cp."""
    if not isinstance(devices, int) or isinstance(devices, bool) or devices <= 0:
        raise InvalidConfigError(f"devices must be a positive integer, got {devices!r}")
    out = []
    for dp in reversed(divisors(devices)):
        r1 = devices // dp
        for pp in divisors(r1):
            r2 = r1 // pp
            for tp in divisors(r2):
                r3 = r2 // tp
                for cp in divisors(r3):
                    out.append(Mesh(dp=dp, pp=pp, tp=tp, cp=cp, ep=r3 // cp))
    return tuple(out)


def mesh_violation(spec: ModelSpec, mesh: Mesh, *, global_batch: int, seq_len: int,
                   micro_batch: int = 1) -> str | None:
    """The first divisibility rule `mesh` breaks for this model and batch, or None."""
    if mesh.ep != 1:
        return f"ep={mesh.ep}: {spec.name} has no experts, so ep must be 1"
    tp = mesh.tp
    if spec.family is Family.LLAMA:
        if spec.heads % tp:
            return f"tp={tp} does not divide the {spec.heads} attention heads"
        if spec.kv_heads % tp and tp % spec.kv_heads:
            return (f"tp={tp} neither divides the {spec.kv_heads} KV heads nor is a multiple of them "
                    "(KV heads are split or replicated)")
    else:
        if spec.heads % tp:
            return f"tp={tp} does not divide the {spec.heads} Mamba-2 heads"
        if spec.groups % tp:
            return f"tp={tp} does not divide the {spec.groups} Mamba-2 groups (n_groups)"
    if mesh.pp > spec.layers:
        return f"pp={mesh.pp} exceeds the {spec.layers} layers (each stage needs a layer)"
    if global_batch % (mesh.dp * micro_batch):
        return f"dp={mesh.dp} x micro_batch={micro_batch} does not divide the global batch {global_batch}"
    if mesh.cp > 1:
        if spec.family is Family.LLAMA and seq_len % (2 * mesh.cp):
            return f"2*cp={2 * mesh.cp} does not divide the sequence length {seq_len} (load-balanced causal split)"
        if spec.family is Family.MAMBA2 and seq_len % mesh.cp:
            return f"cp={mesh.cp} does not divide the sequence length {seq_len}"
    return None


RUNTIME_ZERO = (0, 1, 2)  # the ZeRO levels runtime/data_parallel.py runs


def zero_violation(mesh: Mesh, zero: int) -> str | None:
    """Why ZeRO level `zero` cannot go with `mesh` (see the module docstring), or None."""
    if zero >= 2 and mesh.pp > 1:
        return (f"ZeRO-{zero} with pp={mesh.pp}: gradients are reduce-scattered after every micro-batch, which "
                "a pipeline schedule does not allow; use ZeRO-1 with pp > 1")
    return None


def valid_meshes(spec: ModelSpec, devices: int, *, global_batch: int, seq_len: int,
                 micro_batch: int = 1) -> tuple[Mesh, ...]:
    """Every valid mesh; raises InvalidConfigError naming each candidate's broken rule if none."""
    for name, value in (("global batch", global_batch), ("sequence length", seq_len), ("micro-batch", micro_batch)):
        if not isinstance(value, int) or value <= 0:
            raise InvalidConfigError(f"{name} must be a positive integer, got {value!r}")
    if global_batch % micro_batch:
        raise InvalidConfigError(f"micro-batch {micro_batch} does not divide the global batch {global_batch}; "
                                 "no dp x micro-batch can divide it: pick a micro-batch that divides it")
    candidates = factorizations(devices)
    good, bad = [], []
    for mesh in candidates:
        why = mesh_violation(spec, mesh, global_batch=global_batch, seq_len=seq_len, micro_batch=micro_batch)
        (bad if why else good).append((mesh, why))
    if good:
        return tuple(m for m, _ in good)
    shown = [f"({m.dp},{m.pp},{m.tp},{m.cp},{m.ep}): {why}" for m, why in bad if m.ep == 1]
    more = "" if len(shown) <= 12 else f"; ... and {len(shown) - 12} more"
    raise InvalidConfigError(
        f"no valid (dp,pp,tp,cp,ep) factorisation of {devices} devices for {spec.name} "
        f"(global batch {global_batch}, seq {seq_len}, micro-batch {micro_batch}); ep>1 ruled out everywhere "
        f"(no experts); " + "; ".join(shown[:12]) + more + ". Change the device count, global batch or sequence length"
    )


def mesh_micro_batches(spec: ModelSpec, devices: int, *, global_batch: int, seq_len: int,
                       micro_batches: tuple[int, ...] = (1, 2, 4, 8)) -> tuple[tuple[Mesh, int], ...]:
    """Every (valid mesh, micro-batch) pair the planner searches: for each mesh of
    `factorizations` with ep == 1 and each micro-batch in `micro_batches`, the pair when
    `mesh_violation` finds no broken rule (so dp x micro-batch divides the global batch).
    Empty when no pair is valid (the caller words the error)."""
    out = []
    for mesh in factorizations(devices):
        if mesh.ep != 1:
            continue
        for mb in micro_batches:
            if mesh_violation(spec, mesh, global_batch=global_batch, seq_len=seq_len, micro_batch=mb) is None:
                out.append((mesh, mb))
    return tuple(out)
