"""Ranks that disagree, bad batches and bad plans: the same clear error on every rank, never a hang.

One world of 2 gloo ranks runs every case (start-up costs seconds); each case asserts that every
rank raised an error of the expected class whose text is the same on both ranks.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.distributed as dist

import autoshard
from autoshard.errors import AutoshardError, InvalidConfigError, PlanFileError
from autoshard.ir import Mesh, Plan, Stage
from autoshard.models.presets import build_model, get_spec
from autoshard.runtime.agreement import batch_facts
from tests.runtime.dist_harness import run_ranks

SPEC = get_spec("llama-tiny")  # vocabulary 256
BATCH, SEQ = 4, 16


def _batch(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, SPEC.vocab, (BATCH, SEQ), generator=gen)
    labels = ids.clone()
    labels[0, :4] = -100
    return ids, labels


def _same_error(rank: int, fn, cls: type, *needles: str) -> str:
    """fn() must raise `cls` on this rank, with the same text as on every other rank, naming `needles`."""
    try:
        fn()
    except AutoshardError as e:
        error = e
    else:
        raise AssertionError(f"rank {rank}: no error, expected {cls.__name__} naming {needles}")
    text = f"{type(error).__name__}: {error}"
    texts = [None] * dist.get_world_size()
    dist.all_gather_object(texts, text)
    assert isinstance(error, cls), f"rank {rank}: {text}"
    assert len(set(texts)) == 1, f"rank {rank}: the ranks raised different errors: {texts}"
    for needle in needles:
        assert needle in str(error), f"rank {rank}: {needle!r} not in {text}"
    return str(error)


def _parallelize(plan, **kw):
    return autoshard.parallelize(build_model(SPEC, seed=0), _batch()[0], plan=plan, global_batch=BATCH, **kw)


PLANS = (dict(dp=2), dict(tp=2), dict(pp=2), dict(cp=2))


def _batches_under(rank: int, plan: dict) -> None:
    dm = _parallelize(plan)
    ids, labels = _batch()
    expected = dm.train_step(ids, labels)
    bad_id = ids.clone()
    bad_id[1, 3] = SPEC.vocab + 244  # 500: under tp the vocab-parallel embedding used to train on it silently
    _same_error(rank, lambda: dm.train_step(bad_id, labels), InvalidConfigError,
                "input_ids[1, 3] = 500 is outside the vocabulary", "[0, 256)")
    for value in (SPEC.vocab, -5):
        bad_label = labels.clone()
        bad_label[2, 5] = value
        _same_error(rank, lambda: dm.train_step(ids, bad_label), InvalidConfigError,
                    f"labels[2, 5] = {value} is outside the vocabulary", "-100")
    _same_error(rank, lambda: dm(bad_id), InvalidConfigError, "input_ids[1, 3] = 500")
    if plan == dict(tp=2):  # the prompt of generate too (one replica: dp = cp = 1)
        _same_error(rank, lambda: dm.generate(bad_id, max_new_tokens=2), InvalidConfigError, "input_ids[1, 3] = 500")
    if plan != dict(tp=2):  # the checks below do not depend on the plan: one plan runs them
        torch.testing.assert_close(dm.train_step(ids, labels), expected)
        return
    # only one rank holds the bad token: its error reaches the other rank
    one_bad = bad_id if rank == 1 else ids
    _same_error(rank, lambda: dm.train_step(one_bad, labels), InvalidConfigError,
                "input_ids[1, 3] = 500", "(rank 1 of 2; rank 0 found none: the ranks were not given the same global batch)")
    # same shape, different data on one rank: caught by the digests, not a silently wrong loss
    other = _batch(seed=rank)
    _same_error(rank, lambda: dm.train_step(*other), InvalidConfigError,
                "ranks disagree on the global batch", "input_ids digest: rank 0 ", ", rank 1 ")
    swapped = labels.clone()
    if rank == 1:
        swapped[[0, 1]] = swapped[[1, 0]]  # the same tokens in another order: equal plain sums
    _same_error(rank, lambda: dm.train_step(ids, swapped), InvalidConfigError, "labels digest")
    nudged = ids.clone()
    if rank == 1:  # +1, -2, +1 on three adjacent tokens kept sum(x) and sum(x * (2i + 1)) equal
        nudged[2, 4:7] += torch.tensor([1, -2, 1])
    _same_error(rank, lambda: dm.train_step(nudged.clamp(0, SPEC.vocab - 1), labels), InvalidConfigError,
                "input_ids digest")
    # past the model's positions (its config's max_position_embeddings, here 16): one error everywhere
    short = build_model(SPEC, seed=0)
    short.config.max_position_embeddings = SEQ
    short = autoshard.parallelize(short, ids, plan=plan, global_batch=BATCH)
    long = torch.cat([ids, ids], dim=1)
    _same_error(rank, lambda: short.train_step(long, long), InvalidConfigError,
                "train_step: a sequence of 32 tokens needs 32 positions, more than the model's 16")
    # a different number of rows on one rank: its error, on both ranks
    rows = ids[:2] if rank == 0 else ids
    rows_labels = labels[:2] if rank == 0 else labels
    _same_error(rank, lambda: dm.train_step(rows, rows_labels), InvalidConfigError,
                "global_batch=4", "got (2, 16)", "(rank 0 of 2; rank 1 found none")
    longer = torch.cat([ids, ids], dim=1) if rank == 1 else ids
    longer_labels = torch.cat([labels, labels], dim=1) if rank == 1 else labels
    _same_error(rank, lambda: dm.train_step(longer, longer_labels), InvalidConfigError,
                "ranks disagree on the global batch", "columns: rank 0 16, rank 1 32")
    _same_error(rank, lambda: dm.train_step(ids.float(), labels), InvalidConfigError, "integer tensor")
    # after all of that the ranks are still in step: the same loss as the first step's
    torch.testing.assert_close(dm.train_step(ids, labels), expected)


def _plans_that_disagree(rank: int, tmp: str) -> None:
    _same_error(rank, lambda: _parallelize(dict(dp=2) if rank == 0 else dict(tp=2)), InvalidConfigError,
                "ranks disagree on the plan", "dp: rank 0 2, rank 1 1", "tp: rank 0 1, rank 1 2")
    _same_error(rank, lambda: _parallelize(dict(dp=2), schedule="gpipe" if rank else "1f1b"), InvalidConfigError,
                "ranks disagree on the plan", "plan: rank 0 ")
    # rank 0 asks for a solve, rank 1 brings a plan: caught before rank 0 solves (was: mismatched collectives)
    _same_error(rank, lambda: _parallelize(None if rank == 0 else dict(dp=2)), InvalidConfigError,
                "ranks disagree on the plan", "solved on rank 0 (plan=None): rank 0 1, rank 1 0")
    # a plan only one rank refuses: its error on both ranks (was: a hang in the other's collective)
    _same_error(rank, lambda: _parallelize(dict(dp=2, zero="one" if rank == 1 else 1)), InvalidConfigError,
                "plan key 'zero' must be 0, 1, 2 or 3, got 'one'", "(rank 1 of 2; rank 0 found none")
    _same_error(rank, lambda: _parallelize(dict(dp=2 if rank == 0 else 4)), InvalidConfigError,
                "multiplies to 4, but the world size is 2", "(rank 1 of 2")


def _api_probes(rank: int, tmp: str) -> None:
    """Issue 16's API cases, each refused the same way on every rank."""
    _same_error(rank, lambda: _parallelize(dict(dp=2, zero="one")), InvalidConfigError,
                "plan key 'zero' must be 0, 1, 2 or 3, got 'one'")
    _same_error(rank, lambda: _parallelize(dict(dp=2, micro_batch=1.5)), InvalidConfigError, "'micro_batch'")
    plan = Plan(model=SPEC.name, fingerprint="x", hardware="cpu", devices=2, global_batch=BATCH, seq_len=SEQ,
                mesh=Mesh(pp=2), stages=(Stage(first_layer=0, end_layer=5, embed=True, head=False),
                                         Stage(first_layer=5, end_layer=10, embed=False, head=True)))
    from autoshard.fingerprint import fingerprint_module

    plan = dataclasses.replace(plan, fingerprint=fingerprint_module(build_model(SPEC, device="meta")))
    _same_error(rank, lambda: _parallelize(plan), InvalidConfigError,
                "the stages cover layers 0..10 but the model has 4 layers")
    mamba = Plan(model="mamba2-tiny", fingerprint="", hardware="cpu", devices=2, global_batch=BATCH, seq_len=SEQ,
                 mesh=Mesh(tp=2), placements=(("mixer.in_proj", "colwise"), ("mixer.out_proj", "rowwise")))
    path = os.path.join(tmp, f"mamba-{rank}.json")
    mamba.save(path)
    _same_error(rank, lambda: _parallelize(path), PlanFileError, "blank fingerprint", "'mamba2-tiny'")


def _run(rank: int, world: int, tmp: str) -> None:
    for plan in PLANS:
        try:
            _batches_under(rank, plan)
        except AssertionError as e:
            raise AssertionError(f"plan {plan}: {e}") from None
    _plans_that_disagree(rank, tmp)
    _api_probes(rank, tmp)


def test_every_rank_raises_the_same_error(tmp_path):
    run_ranks(2, _run, str(tmp_path))


def test_batch_digests_see_every_change():
    ids, labels = _batch()
    base = batch_facts(ids, labels, vocab=SPEC.vocab, global_batch=BATCH)
    seen = {base["input_ids digest"]}
    for i in range(ids.numel() - 2):  # one token changed anywhere, and +1 -2 +1 on three adjacent tokens
        for delta in ((1 + i,), (1, -2, 1)):
            changed = ids.clone().reshape(-1)
            changed[i:i + len(delta)] = (changed[i:i + len(delta)] + torch.tensor(delta)) % SPEC.vocab
            facts = batch_facts(changed.reshape(ids.shape), labels, vocab=SPEC.vocab, global_batch=BATCH)
            seen.add(facts["input_ids digest"])
    assert len(seen) == 1 + 2 * (ids.numel() - 2)  # every change a digest of its own
    assert batch_facts(ids.int(), labels.int(), vocab=SPEC.vocab, global_batch=BATCH) == base  # int32 == int64


@pytest.mark.parametrize("change, needle", [
    (lambda ids, labels: (ids.to(torch.uint8), labels), "input_ids must be an integer tensor (torch.long or "
     "torch.int32) of shape (batch, seq), got torch.uint8"),  # the embedding would raise a bare RuntimeError
    (lambda ids, labels: (ids, None), "train_step needs labels"),
    (lambda ids, labels: (ids, torch.full_like(labels, -100)), "hold no token to predict"),  # 0 / 0: NaN weights
    (lambda ids, labels: (ids, torch.cat([labels[:, :1], torch.full_like(labels[:, 1:], -100)], 1)),
     "hold no token to predict"),  # only labels[:, 0], which the shifted loss never reads
    (lambda ids, labels: (ids[:, :1], labels[:, :1]), "labels of shape (4, 1) hold no token to predict"),
])
def test_a_batch_the_step_cannot_train_is_refused(change, needle):
    ids, labels = change(*_batch())
    with pytest.raises(InvalidConfigError) as err:
        batch_facts(ids, labels, vocab=SPEC.vocab, global_batch=BATCH, training=True)
    assert needle in str(err.value)
    assert batch_facts(*_batch(), vocab=SPEC.vocab, global_batch=BATCH, training=True)["rows"] == BATCH
    assert batch_facts(_batch()[0][:, :1], None, vocab=SPEC.vocab, global_batch=None)["columns"] == 1  # dm(ids)


def test_a_world_of_one_refuses_a_bad_plan_without_a_process_group():
    with pytest.raises(InvalidConfigError, match="plan key 'zero' must be 0, 1, 2 or 3, got 'one'"):
        autoshard.parallelize(build_model(SPEC, seed=0), _batch()[0], plan=dict(zero="one"), global_batch=BATCH)
    assert not dist.is_initialized()
