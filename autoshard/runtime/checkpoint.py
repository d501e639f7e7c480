"""Checkpoints through `torch.distributed.checkpoint` (DCP), loadable under any plan and world size.

The whole contract: docs/modules/runtime.md (runtime/checkpoint.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from autoshard.errors import CheckpointError
from autoshard.runtime.agreement import gather_bytes
from autoshard.runtime.data_parallel import ShardedOptimizer
from autoshard.runtime.expert_parallel import ShardedOptimizers
from autoshard.runtime.zero3 import full_tensor, like

DistributedModel = Any  # runtime/dist_model.py's, whose methods call these functions (no import back)

FORMAT_VERSION = 2  # 2: `digests` of every file
META_FILE = "autoshard.json"


# -- paths and atomic publication -------------------------------------------------------------------

def _directory(path, what: str, *, writing: bool) -> Path:
    """`path` as an absolute Path, refused (CheckpointError, on every rank alike) when it is not a path, or,
    `writing`, when a file that is not a directory stands there."""
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise CheckpointError(f"{what} takes a directory path (a str or pathlib.Path), got {path!r}")
    final = Path(path).absolute()
    if writing and final.exists() and not final.is_dir():
        raise CheckpointError(f"{what} writes a directory, but {final} is a file; give a directory path "
                              "(it is created, and replaced atomically when it exists)")
    return final


def _siblings(path: Path) -> tuple[Path, Path]:
    return path.parent / f".{path.name}.partial", path.parent / f".{path.name}.old"


def _publish(tmp: Path, final: Path, old: Path) -> None:
    """Rename the complete `tmp` to `final` (rank 0), keeping the previous checkpoint until the end."""
    if final.exists():
        if old.exists():
            shutil.rmtree(old)
        final.rename(old)
    tmp.rename(final)
    if old.exists():
        shutil.rmtree(old)


def _fsync_tree(root: Path) -> None:
    for file in root.iterdir():
        if file.is_file():
            with open(file, "rb") as f:
                os.fsync(f.fileno())


def _resolve(path: Path) -> Path:
    """The checkpoint to read: `path`, or the previous one when a save crashed between its renames."""
    _, old = _siblings(path)
    if (path / META_FILE).exists():
        return path
    if not path.exists() and (old / META_FILE).exists():
        return old
    raise CheckpointError(f"{path} is not an autoshard checkpoint ({META_FILE} missing); save one with "
                          "dm.save_checkpoint(path), or give the directory it was saved to")


# -- save -------------------------------------------------------------------------------------------

def save_checkpoint(dm: DistributedModel, path: str | os.PathLike) -> Path:
    """Write `dm`'s model, optimizer, steps and RNG to `path` (collective; see docs/modules/runtime.md)."""
    final = _directory(path, "save_checkpoint", writing=True)
    tmp, old = _siblings(final)
    rank, device = dist.get_rank(), dm.device
    _together(_on_rank0(rank, lambda: _fresh_directory(tmp)), final, device)
    state = _state_to_save(dm)
    import torch.distributed.checkpoint as dcp  # here: it loads SymPy (through DTensor), which the runtime must not
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        metadata = dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True))
    except (Exception, CheckpointException) as e:  # DCP gathers every rank's failure: rank 0 tells them all
        cause = _cause(e) + _space_note(tmp, state) if rank == 0 else None
        _on_rank0(rank, lambda: shutil.rmtree(tmp, ignore_errors=True))  # a full disk gets its space back
        _together(cause, final, device)
        raise  # not reached: _together raised
    digests = _digest_files(sorted({i.relative_path for i in (metadata.storage_data or {}).values()}) + [".metadata"],
                            tmp, device)

    def publish() -> None:
        (tmp / META_FILE).write_text(json.dumps({**_meta(dm), "digests": digests}, indent=1))
        _fsync_tree(tmp)
        _publish(tmp, final, old)

    _together(_on_rank0(rank, publish), final, device)
    return final


def _fresh_directory(tmp: Path) -> None:
    if tmp.exists():  # a crashed save's leftovers
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)


def _on_rank0(rank: int, step) -> str | None:
    """Run `step()` on rank 0; the cause of its failure (an OSError: read-only, no space, permission, a
    path through a file), or None."""
    if rank != 0:
        return None
    try:
        step()
    except OSError as e:
        return _cause(e)
    return None


def _cause(e: BaseException) -> str:
    """One line naming what failed: an OSError's errno text and file, the first rank DCP reports."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        rank = min(failures)
        return f"rank {rank}: {_cause(failures[rank][0])}"
    if isinstance(e, OSError) and e.strerror:
        where = f": {e.filename}" if e.filename else ""
        return f"{type(e).__name__} [Errno {e.errno}] {e.strerror}{where}"
    text = " ".join(str(e).split()) or type(e).__name__
    return f"{type(e).__name__}: {text[:300]}"


def _together(cause: str | None, final: Path, device: torch.device) -> None:
    """Every rank's outcome of a step only some ranks took (collective): a failure anywhere is the same
    CheckpointError on every rank (where a barrier left the others waiting for the collective timeout)."""
    causes = [b.decode() for b in gather_bytes((cause or "").encode(), device=device)]
    failed = [(r, c) for r, c in enumerate(causes) if c]
    if failed:
        rank, text = failed[0]
        where = "" if text.startswith("rank ") else f"rank {rank}: "  # DCP's failures name their rank
        raise CheckpointError(f"save_checkpoint {final} failed: {where}{text}; the previous checkpoint there (if any) "
                              "is untouched")


def _space_note(tmp: Path, state: Mapping[str, Tensor]) -> str:
    """Where a write failed on a file system without room for this rank's state (a lower bound of the
    checkpoint: every key it holds is written by some rank), say so: torch's writer reports a full disk as
    'unexpected pos'."""
    try:
        free = shutil.disk_usage(tmp if tmp.exists() else tmp.parent).free
    except OSError:
        return ""
    needed = sum(t.numel() * t.element_size() for t in state.values())
    return (f" (no space left: {free} bytes free on the file system of {tmp.parent}, this rank's part of the "
            f"checkpoint alone is {needed} bytes)") if free < needed else ""


def _digest_files(names: list[str], root: Path, device: torch.device) -> dict[str, str]:
    """{file name: sha256 hex} of `names` under `root`, each rank hashing every world-th file (collective).
    A file that cannot be read has the digest "" (its loader then names it)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = {}
    for name in names[rank::world]:
        try:
            h = hashlib.sha256()
            with open(root / name, "rb") as f:
                while chunk := f.read(1 << 22):
                    h.update(chunk)
            mine[name] = h.hexdigest()
        except OSError:
            mine[name] = ""
    out: dict[str, str] = {}
    for data in gather_bytes(json.dumps(mine).encode(), device=device):
        out.update(json.loads(data))
    return out


def _state_to_save(dm: DistributedModel) -> dict[str, Tensor]:
    params = dm.master_weights()  # bf16-mixed: the fp32 masters, not the bf16 parameters
    state = {f"model.{n}": t for n, t in dm.gather_shards(params).items()}
    optim = _optimizer_states(dm)
    for key in sorted({k for s in optim.values() for k in s}):
        shaped = {n: s[key] for n, s in sorted(optim.items()) if key in s and s[key].dim() > 0}
        for name, tensor in dm.gather_shards(shaped).items():
            state[f"optim.state.{name}.{key}"] = tensor
        for name, s in optim.items():
            if key in s and s[key].dim() == 0:
                state[f"optim.state.{name}.{key}"] = s[key].detach().clone()
    for key, value in _hparams(dm.optimizer).items():
        state[f"optim.hparams.{key}"] = value
    state["train.steps"] = torch.tensor(dm.steps, dtype=torch.int64)
    state["rng.cpu"] = torch.get_rng_state()
    if torch.cuda.is_available() and dm.device.type == "cuda":
        state["rng.cuda"] = torch.cuda.get_rng_state(dm.device)
    return state


def _meta(dm: DistributedModel) -> dict:
    optimizer = _optimizer_class(dm.optimizer)
    return {"format": "autoshard-checkpoint", "version": FORMAT_VERSION, "model": dm.plan.model,
            "fingerprint": dm.fingerprint, "steps": dm.steps, "optimizer": optimizer,
            "parameters": {n: list(s) for n, s in dm.full_shapes.items()}, "plan": dm.plan.to_json()}


# -- load -------------------------------------------------------------------------------------------

def load_checkpoint(dm: DistributedModel, path: str | os.PathLike, *, missing_ok: bool = False) -> int:
    """Restore `dm` from the checkpoint at `path`; the number of steps it had taken (collective).
    `missing_ok`: no checkpoint there (a first start) returns 0 and leaves `dm` as it is."""
    path = _directory(path, "load_checkpoint", writing=False)
    if missing_ok and not path.exists() and not (_siblings(path)[1] / META_FILE).exists():
        return 0
    root = _resolve(path)
    meta = _read_meta(root)
    _check_model(meta, dm, root)
    import torch.distributed.checkpoint as dcp  # here: it loads SymPy (through DTensor)
    from torch.distributed.checkpoint.api import CheckpointException

    reader = dcp.FileSystemReader(root)
    metadata = _check_files(reader, root, meta, dm.device)
    entries = metadata.state_dict_metadata
    names = [dm.param_name(p) for p in dm.local_params()]
    state = {f"model.{n}": _empty(entries[f"model.{n}"]) for n in names}
    optimizer = _optimizer_class(dm.optimizer)
    if optimizer is not None:
        if meta.get("optimizer") != optimizer:
            raise CheckpointError(f"checkpoint {root} holds the state of optimizer {meta.get('optimizer')}, this "
                                  f"model steps {optimizer}; build the model with the same optimizer to resume")
        prefixes = {n: f"optim.state.{n}." for n in names}
        for key in entries:
            for name, prefix in prefixes.items():
                if key.startswith(prefix) and "." not in key[len(prefix):]:
                    state[key] = _empty(entries[key])
        state.update({k: _empty(v) for k, v in entries.items() if k.startswith("optim.hparams.")})
    state["train.steps"] = _empty(entries["train.steps"])
    for key in ("rng.cpu", "rng.cuda"):
        if key in entries and (key == "rng.cpu" or dm.device.type == "cuda"):
            state[key] = _empty(entries[key])
    try:
        dcp.load(state, storage_reader=reader)
    except (Exception, CheckpointException) as e:
        raise CheckpointError(f"checkpoint {root} cannot be read: {_cause(e)}; load an earlier checkpoint") from None
    _load_params(dm, {n: state[f"model.{n}"] for n in names})
    if optimizer is not None:
        per_param = {n: {k[len(p):]: v for k, v in state.items() if k.startswith(p)} for n, p in prefixes.items()}
        _load_optimizer(dm, per_param)
        _set_hparams(dm.optimizer, {k[len("optim.hparams."):]: v for k, v in state.items()
                                    if k.startswith("optim.hparams.")})
    torch.set_rng_state(state["rng.cpu"])
    if "rng.cuda" in state:
        torch.cuda.set_rng_state(state["rng.cuda"], dm.device)
    dm.steps = int(state["train.steps"])
    dist.barrier()
    return dm.steps


def _empty(entry) -> Tensor:
    return torch.empty(tuple(entry.size), dtype=entry.properties.dtype)


def _read_meta(root: Path) -> dict:
    try:
        meta = json.loads((root / META_FILE).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {root}: {META_FILE} is unreadable ({e}); the checkpoint is damaged") from None
    if meta.get("format") != "autoshard-checkpoint" or not isinstance(meta.get("parameters"), dict):
        raise CheckpointError(f"checkpoint {root}: {META_FILE} is not an autoshard checkpoint description")
    if meta.get("version", 0) > FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {root} has format version {meta['version']}, this autoshard reads up to "
                              f"{FORMAT_VERSION}; upgrade autoshard")
    return meta


def _check_model(meta: Mapping, dm: DistributedModel, root: Path) -> None:
    saved = {n: tuple(s) for n, s in meta["parameters"].items()}
    ours = dict(dm.full_shapes)
    if saved == ours:
        return
    missing = sorted(set(ours) - set(saved))
    extra = sorted(set(saved) - set(ours))
    shapes = [f"{n} {saved[n]} vs {ours[n]}" for n in sorted(set(saved) & set(ours)) if saved[n] != ours[n]]
    details = []
    if missing:
        details.append(f"{len(missing)} parameters of this model are not in it (first: {missing[0]})")
    if extra:
        details.append(f"{len(extra)} of its parameters are not in this model (first: {extra[0]})")
    if shapes:
        details.append(f"{len(shapes)} shapes differ, checkpoint vs model (first: {shapes[0]})")
    raise CheckpointError(f"checkpoint {root} is of another model: it holds {meta.get('model')} (fingerprint "
                          f"{meta.get('fingerprint')}, {len(saved)} parameters), this is {dm.plan.model} (fingerprint "
                          f"{dm.fingerprint}, {len(ours)} parameters); {'; '.join(details)}")


def _check_files(reader, root: Path, meta: Mapping, device: torch.device):
    """DCP's metadata, after checking every file the save wrote against its digest (collective: the ranks
    hash a share each), and every data file the metadata names is there and long enough."""
    digests, bad, found = meta.get("digests"), [], {}
    if meta.get("version", 1) >= 2:
        if not isinstance(digests, dict) or not digests:
            raise CheckpointError(f"checkpoint {root}: {META_FILE} lists no digests of its files; the checkpoint is "
                                  "damaged, load an earlier one")
        found = _digest_files(sorted(digests), root, device)
        bad = [name for name in sorted(digests) if found.get(name) != digests[name]]
        if ".metadata" in bad:  # never unpickled when it is not the file the save wrote
            bad = [".metadata"]
    if bad == [".metadata"] and found.get(".metadata"):
        raise CheckpointError(f"checkpoint {root}: .metadata does not hold what was saved (sha256 differs from "
                              f"{META_FILE}'s); the checkpoint is corrupted, load an earlier one")
    try:
        metadata = reader.read_metadata()
    except Exception as e:  # noqa: BLE001  (a missing or truncated .metadata: any unpickling error)
        raise CheckpointError(f"checkpoint {root}: DCP's .metadata cannot be read ({type(e).__name__}: {e}); "
                              "the checkpoint is incomplete") from None
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    sizes = {name: (root / name).stat().st_size if (root / name).exists() else None for name in needed}
    short = [name for name, size in sorted(needed.items()) if sizes[name] is None or sizes[name] < size]
    bad = sorted(set(bad) | set(short))
    if bad:
        def why(name: str) -> str:
            if sizes.get(name, 0) is None:
                return f"{name}: no file"
            if name in short:
                return f"{name} is truncated: {sizes[name]} bytes, its metadata needs {needed[name]}"
            return f"{name}: content differs"
        raise CheckpointError(f"checkpoint {root}: {len(bad)} of its {len(needed) + 1} files do not hold what was "
                              f"saved ({'; '.join(why(n) for n in bad[:4])}); the checkpoint is damaged, load an "
                              "earlier one")
    return metadata


# -- optimizer state in per-parameter terms ---------------------------------------------------------

def _inner(optimizer):
    """The torch optimizer (under ep: the dense group's; the expert group's is of the same class)."""
    if isinstance(optimizer, ShardedOptimizers):
        optimizer = optimizer.optimizers[0]
    return optimizer.optimizer if isinstance(optimizer, ShardedOptimizer) else optimizer


def _optimizer_class(optimizer) -> str | None:
    inner = _inner(optimizer)
    return None if inner is None else f"{type(inner).__module__}.{type(inner).__qualname__}"


def _optimizer_states(dm: DistributedModel) -> dict[str, dict[str, Tensor]]:
    """{name: {state key: this rank's tp slice, or a scalar}} for the parameters this rank holds."""
    optimizer = dm.optimizer
    if optimizer is None:
        return {}
    if isinstance(optimizer, (ShardedOptimizer, ShardedOptimizers)):  # ZeRO-1/2: gathered over dp, cut
        by_id = optimizer.param_states()
    else:
        by_id = {id(p): {k: full_tensor(v) for k, v in optimizer.state.get(p, {}).items() if isinstance(v, Tensor)}
                 for p in dm.local_params()}
    return {dm.param_name(p): by_id[id(p)] for p in dm.local_params() if by_id.get(id(p))}


def _load_params(dm: DistributedModel, full: Mapping[str, Tensor]) -> None:
    """Parameters and (bf16-mixed, ZeRO-1/2) the fp32 masters from the full tensors."""
    dm.load_weights({id(p): like(dm.local_piece(dm.param_name(p), full[dm.param_name(p)]), p)
                     for p in dm.local_params()})


def _load_optimizer(dm: DistributedModel, full: Mapping[str, Mapping[str, Tensor]]) -> None:
    """Cut {name: {key: full tensor or scalar}} to this rank's slices and hand it to the optimizer."""
    local: dict[int, dict[str, Tensor]] = {}
    for p in dm.local_params():
        name = dm.param_name(p)
        held = full.get(name, {})
        local[id(p)] = {k: v.clone() if v.dim() == 0 else like(dm.local_piece(name, v), p)
                        for k, v in held.items()}
    optimizer = dm.optimizer
    if isinstance(optimizer, (ShardedOptimizer, ShardedOptimizers)):
        optimizer.load_param_states(local)
        return
    for p in dm.local_params():
        if local[id(p)]:
            optimizer.state[p] = local[id(p)]


def _hparams(optimizer) -> dict[str, Tensor]:
    """The numeric hyperparameters of the first parameter group (numbers and tuples of numbers)."""
    inner = _inner(optimizer)
    if inner is None:
        return {}
    out = {}
    for key, value in inner.param_groups[0].items():
        if isinstance(value, bool) or key == "params":
            continue
        if isinstance(value, (int, float)) or (isinstance(value, tuple) and all(isinstance(v, (int, float)) for v in value)):
            out[key] = torch.tensor(value, dtype=torch.float64)
    return out


def _set_hparams(optimizer, values: Mapping[str, Tensor]) -> None:
    inners = [o.optimizer for o in optimizer.optimizers] if isinstance(optimizer, ShardedOptimizers) else [_inner(optimizer)]
    for group in (g for inner in inners for g in inner.param_groups):
        for key, tensor in values.items():
            old = group.get(key)
            if isinstance(old, tuple):
                group[key] = tuple(type(o)(v) for o, v in zip(old, tensor.tolist()))
            elif isinstance(old, (int, float)) and not isinstance(old, bool):
                group[key] = type(old)(tensor.item())


# -- Hugging Face export ----------------------------------------------------------------------------

def save_pretrained(dm: DistributedModel, path: str | os.PathLike) -> Path:
    """HF `config.json` + `model.safetensors` of the full weights at `path` (collective)."""
    from safetensors.torch import save_file

    final = _directory(path, "save_pretrained", writing=True)
    state = dm.full_state_dict()  # every rank takes part in the gather
    if dist.get_rank() == 0:
        tmp, old = _siblings(final)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        dm.model.config.save_pretrained(tmp)
        save_file({n: t.contiguous() for n, t in state.items()}, tmp / "model.safetensors", metadata={"format": "pt"})
        _fsync_tree(tmp)
        _publish(tmp, final, old)
    dist.barrier()
    return final
