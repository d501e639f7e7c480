"""Ranks that disagree: every rank checks that it holds what the others hold, with one small collective.

Every rank runs the same program on what it was given (a plan, a global batch). When one rank is
given something else, the collectives pair up wrongly: a silently wrong loss, an error on one
rank and "connection closed" on the others, or a hang until the process group's timeout. So
before the first collective that depends on them, the ranks compare.

The whole contract: docs/modules/runtime.md (runtime/agreement.py).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from autoshard import errors
from autoshard.errors import AutoshardError, InvalidConfigError
from autoshard.models.presets import position_violation

IGNORE_INDEX = -100  # the label HF's loss skips (runtime/loss.py)

PLAN_FIELDS = ("solved on rank 0 (plan=None)", "plan", "model", "settings", "dp", "pp", "tp", "cp", "ep", "micro_batch", "zero", "global_batch",
               "seq_len")
BATCH_FIELDS = ("rows", "columns", "input_ids digest", "labels digest")


def stable_hash(text: str) -> int:
    """A signed 64-bit integer from sha256 of `text` (the same on every machine, unlike hash())."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big", signed=True)


def tensor_digest(t: Tensor) -> int:
    """A signed 64-bit BLAKE2b digest of `t`'s values as int64, row-major (on the host: one copy)."""
    data = t.detach().reshape(-1).to(device="cpu", dtype=torch.int64).numpy().tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big", signed=True)


def plan_facts(plan, *, fingerprint: str, settings: Mapping[str, object], solved: bool = False) -> dict[str, int]:
    """What every rank must hold the same of a run: the plan (hash of its JSON, and the numbers that
    make a readable message), the model's fingerprint, the other settings of `parallelize`. `solved`:
    the plan came from rank 0's solver (plan=None); with `plan` None, only that is compared (the
    ranks agree on it before rank 0 solves, so a rank given a plan never meets the solver's broadcast)."""
    if plan is None:
        return {PLAN_FIELDS[0]: int(solved)}
    return {PLAN_FIELDS[0]: int(solved), "plan": stable_hash(json.dumps(plan.to_json(), sort_keys=True)),
            "model": stable_hash(fingerprint),
            "settings": stable_hash(json.dumps(dict(settings), sort_keys=True, default=str)),
            **plan.mesh.as_dict(), "micro_batch": plan.micro_batch, "zero": plan.zero,
            "global_batch": plan.global_batch, "seq_len": plan.seq_len}


def batch_facts(input_ids: Tensor, labels: Tensor | None, *, vocab: int, global_batch: int | None,
                training: bool = False, positions: int | None = None, where: str = "train_step") -> dict[str, int]:
    """The shape and digests of a global batch, after checking it: InvalidConfigError for a shape that is
    not (global_batch, seq), a dtype other than int64 / int32 (what an embedding takes), a token id / label
    outside the vocabulary (labels may also be -100), and for `training` missing labels or labels with
    no token to predict (the loss would divide by zero and turn every weight into NaN), and a sequence longer
    than `positions` (`presets.max_positions`; `where` names the call in the error). One host sync."""
    if training and labels is None:
        raise InvalidConfigError("train_step needs labels: a (global_batch, seq) integer tensor, usually input_ids "
                                 "itself (the model predicts token t + 1 from tokens up to t; -100 skips a position)")
    tensors = {"input_ids": input_ids} if labels is None else {"input_ids": input_ids, "labels": labels}
    for name, t in tensors.items():
        if not isinstance(t, Tensor) or t.dim() != 2 or t.dtype not in (torch.int64, torch.int32):
            what = f"{t.dtype} of shape {tuple(t.shape)}" if isinstance(t, Tensor) else type(t).__name__
            raise InvalidConfigError(f"{name} must be an integer tensor (torch.long or torch.int32) of shape "
                                     f"(batch, seq), got {what}")
    if labels is not None and input_ids.shape != labels.shape:
        raise InvalidConfigError(f"input_ids {tuple(input_ids.shape)} and labels {tuple(labels.shape)} differ in "
                                 "shape; give both as (global_batch, seq)")
    if input_ids.numel() == 0:
        raise InvalidConfigError(f"input_ids of shape {tuple(input_ids.shape)} hold no tokens")
    if global_batch is not None and input_ids.shape[0] != global_batch:
        raise InvalidConfigError(f"train_step expects input_ids and labels of shape (global_batch={global_batch}, "
                                 f"seq), got {tuple(input_ids.shape)}; give the whole global batch on every rank")
    why = position_violation(positions, prompt=input_ids.shape[1], where=where)
    if why:
        raise InvalidConfigError(why)
    stats = []
    for name, t in tensors.items():
        flat = t.reshape(-1).to(torch.int64)
        valid = flat if name == "input_ids" else torch.where(flat == IGNORE_INDEX, 0, flat)
        stats += [valid.min(), valid.max()]
    if labels is not None:  # the tokens the loss counts (runtime/loss.count_tokens: shifted labels != -100)
        stats.append((labels[:, 1:] != IGNORE_INDEX).sum())
    values = torch.stack(stats).tolist()  # the one host sync
    for i, (name, t) in enumerate(tensors.items()):
        low, high = values[2 * i], values[2 * i + 1]
        if low < 0 or high >= vocab:
            raise InvalidConfigError(_out_of_vocabulary(name, t, vocab))
    if training and values[-1] == 0:
        raise InvalidConfigError(f"labels of shape {tuple(labels.shape)} hold no token to predict: every label after "
                                 "the first position is -100 (a causal LM's loss skips labels[:, 0]), so the mean loss "
                                 "would be 0 / 0 and the step would turn every weight into NaN; skip this batch or "
                                 "give it unmasked labels")
    facts = {"rows": input_ids.shape[0], "columns": input_ids.shape[1], "input_ids digest": tensor_digest(input_ids)}
    if labels is not None:
        facts["labels digest"] = tensor_digest(labels)
    return facts


def _out_of_vocabulary(name: str, t: Tensor, vocab: int) -> str:
    ignored = t == IGNORE_INDEX if name == "labels" else torch.zeros_like(t, dtype=torch.bool)
    bad = ((t < 0) | (t >= vocab)) & ~ignored
    where = bad.nonzero()
    row, col = (int(x) for x in where[0])
    allowed = f"[0, {vocab})" + (" or -100 (ignored)" if name == "labels" else "")
    return (f"{name}[{row}, {col}] = {int(t[row, col])} is outside the vocabulary: expected {allowed}; "
            f"{len(where)} such entr{'y' if len(where) == 1 else 'ies'} in the batch. Fix the tokenizer/data "
            f"pipeline or the model's vocab_size ({vocab})")


def agree(what: str, names: Sequence[str], values: Mapping[str, int] | None, *, error: AutoshardError | None,
          device: torch.device, hint: str = "") -> None:
    """See docs/modules/runtime.md. Collective over the default process group."""
    world = dist.get_world_size()
    if (error is None) == (values is None):
        raise ValueError("agree: give values, or the error this rank's checks raised, not both")
    text = b"" if error is None else f"{type(error).__name__}\0{error}".encode()
    mine = torch.tensor([int(error is not None), len(text), *(0 if values is None else values.get(n, 0)
                                                                for n in names)], dtype=torch.int64)
    gathered = [torch.empty_like(mine, device=device) for _ in range(world)]
    dist.all_gather(gathered, mine.to(device))
    rows = [g.tolist() for g in gathered]
    failed = [r for r, row in enumerate(rows) if row[0]]
    if failed:
        _raise_failure(failed, text, world=world, device=device, what=what)
    differing = [(i, n) for i, n in enumerate(names) if len({row[2 + i] for row in rows}) > 1]
    if not differing:
        return
    parts = []
    for i, name in differing:
        holders: dict[int, list[int]] = {}
        for r, row in enumerate(rows):
            holders.setdefault(row[2 + i], []).append(r)
        parts.append(f"{name}: " + ", ".join(f"{_ranks(rs)} {v}" for v, rs in holders.items()))
    raise InvalidConfigError(f"ranks disagree on the {what} ({'; '.join(parts)}); "
                             f"{hint or f'give every rank the same {what}'}")


def _raise_failure(failed: list[int], text: bytes, *, world: int, device: torch.device, what: str) -> None:
    """Every rank raises the same error: the texts of the failing ranks travel in two more all_gathers."""
    gathered = gather_bytes(text, device=device)
    texts = {r: gathered[r].decode() for r in failed}
    kind, _, message = texts[failed[0]].partition("\0")
    error = getattr(errors, kind, AutoshardError)
    if not (isinstance(error, type) and issubclass(error, AutoshardError)):
        error = AutoshardError
    if len(failed) == world and len(set(texts.values())) == 1:
        raise error(message)  # every rank found the same problem: the error each would raise alone
    others = [r for r in failed[1:] if texts[r] != texts[failed[0]]]
    same = [r for r in failed if r not in others]
    ok = [r for r in range(world) if r not in failed]
    note = f"{_ranks(same)} of {world}"
    if others:
        note += f"; {_ranks(others)} found other problems"
    if ok:
        note += f"; {_ranks(ok)} found none: the ranks were not given the same {what}"
    raise error(f"{message} ({note})")


def gather_bytes(data: bytes, *, device: torch.device) -> list[bytes]:
    """Every rank's `data` (collective over the default group): its length, then the padded bytes, in two
    all_gathers. Plain bytes (JSON, text), never pickle."""
    world = dist.get_world_size()
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(size) for _ in range(world)]
    dist.all_gather(sizes, size)
    lengths = [int(t.item()) for t in sizes]
    buf = torch.zeros(max(lengths), dtype=torch.uint8)
    if data:
        buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    gathered = [torch.empty(max(lengths), dtype=torch.uint8, device=device) for _ in range(world)]
    dist.all_gather(gathered, buf.to(device))
    return [bytes(g[:n].cpu().tolist()) for g, n in zip(gathered, lengths)]


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))
