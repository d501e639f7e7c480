"""Context parallelism against the full-sequence computation (gloo, fp32, values and gradients).

Each world size is spawned once; every case runs inside the same processes.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from autoshard.errors import InvalidConfigError, UnsupportedOpError
from autoshard.models.presets import build_model, get_spec
from autoshard.runtime.context_parallel import enable_context_parallel, layout_of, split_batch
from autoshard.runtime.cp_sequence import (CPContext, SeqLayout, check_seq_len, gather_sequence, sequence_positions,
                                           split_sequence)
from autoshard.runtime.cp_attention import balanced_causal_attention
from autoshard.runtime.cp_mamba import cp_mixer_forward, ssd_chunk_scan
from autoshard.runtime.loss import causal_lm_loss
from tests.runtime.dist_harness import run_ranks
from tests.runtime.equivalence import check_plan

TOL = dict(rtol=1e-4, atol=1e-5)
_PLANS = {2: [dict(cp=2), dict(cp=2, recompute="full", micro_batch=2)],
          4: [dict(cp=4), dict(dp=2, cp=2), dict(tp=2, cp=2, zero=1), dict(pp=2, cp=2)],
          8: [dict(dp=2, tp=2, cp=2)]}


# -- single process ------------------------------------------------------------------------

def test_balanced_layout_covers_sequence_once():
    for cp in (1, 2, 3, 4):
        held = torch.cat([sequence_positions(24, cp, r, SeqLayout.BALANCED) for r in range(cp)])
        assert sorted(held.tolist()) == list(range(24))
    assert sequence_positions(16, 4, 1, SeqLayout.BALANCED).tolist() == [2, 3, 12, 13]
    assert sequence_positions(16, 4, 1, SeqLayout.CONTIGUOUS).tolist() == [4, 5, 6, 7]


def test_bad_input_is_named():
    with pytest.raises(InvalidConfigError, match=r"not divisible by 2\*cp = 8 \(cp=4\)"):
        check_seq_len(20, 4, SeqLayout.BALANCED)
    with pytest.raises(InvalidConfigError, match="fewer than conv_kernel-1 = 3"):
        check_seq_len(8, 4, SeqLayout.CONTIGUOUS, min_local=3)
    with pytest.raises(UnsupportedOpError, match="no rule for _FakeModel: it holds no HF attention module"):
        layout_of(_FakeModel("gpt2"))
    with pytest.raises(UnsupportedOpError, match="no rule"):
        enable_context_parallel(torch.nn.Linear(2, 2), CPContext(group=None, rank=0, size=1))
    # the recurrent mixers' CP substitutes: no cache, no packed sequences (named before any collective)
    from autoshard.runtime.cp_delta import cp_delta_rule
    from autoshard.runtime.cp_scan import cp_scan

    ctx, x = CPContext(group=None, rank=0, size=1), torch.zeros(1, 4, 1, 2)
    with pytest.raises(InvalidConfigError, match="no packed sequences"):
        cp_delta_rule(None, ctx)(x, x, x, x[..., 0], x[..., 0], cu_seqlens=torch.tensor([0, 2, 4]))
    with pytest.raises(InvalidConfigError, match="training forwards only"):
        cp_delta_rule(None, ctx)(x, x, x, x[..., 0], x[..., 0], initial_state=x)
    with pytest.raises(InvalidConfigError, match="training forwards only"):
        cp_scan(None, ctx)(x, x, x, x, x, return_last_state=True)


def test_plan_check_rejects_bad_cp_before_any_collective():
    from autoshard.ir import Mesh, Plan
    from autoshard.rules.validity import check_plan as check

    def plan(name, seq, **mesh):
        m = Mesh(**mesh)
        return Plan(model=name, fingerprint="", hardware="cpu", devices=m.size, global_batch=8, seq_len=seq, mesh=m)

    with pytest.raises(InvalidConfigError, match=r"sequence length 20 is not divisible by 2\*cp = 8"):
        check(plan("llama-tiny", 20, cp=4), get_spec("llama-tiny"), world_size=4)
    with pytest.raises(InvalidConfigError, match="conv_kernel-1 = 3"):
        check(plan("mamba2-tiny", 8, cp=4), get_spec("mamba2-tiny"), world_size=4)
    check(plan("mamba2-tiny", 12, cp=4), get_spec("mamba2-tiny"), world_size=4)  # not a multiple of 2*cp: fine


class _FakeModel(torch.nn.Module):
    def __init__(self, model_type):
        super().__init__()
        self.config = type("Config", (), {"model_type": model_type})()


def test_ssd_scan_matches_hf_reference():
    from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan

    torch.manual_seed(0)
    b, L, h, p, n, g, q = 2, 40, 4, 8, 6, 2, 16  # L not a multiple of the chunk: padding path
    x, dt, B, C = torch.randn(b, L, h, p), torch.randn(b, L, h), torch.randn(b, L, g, n), torch.randn(b, L, g, n)
    A, bias = -torch.rand(h) * 2, torch.randn(h)
    ref, ref_final = mamba2_chunk_scan(x, dt, A, B, C, chunk_size=q, dt_bias=bias, dt_softplus=True,
                                       return_final_states=True)
    y, final = ssd_chunk_scan(x, F.softplus(dt + bias), A, B.repeat_interleave(2, 2), C.repeat_interleave(2, 2), q)
    torch.testing.assert_close(y, ref, **TOL)
    torch.testing.assert_close(final, ref_final, **TOL)


# -- distributed ---------------------------------------------------------------------------

def _run_all(rank: int, world: int) -> None:
    if world <= 4:  # the CP functions alone, the whole world as one CP group
        ctx = CPContext.from_group(dist.group.WORLD)
        _case_attention(ctx, seq=8 * world, heads=4, kv_heads=2, batch=2)
        _case_attention(ctx, seq=2 * world, heads=2, kv_heads=2, batch=1)  # one token per chunk, no GQA
        for name, seq in (("llama-tiny", 4 * world), ("llama-tiny", 24 * world), ("mamba2-tiny", 12 * world),
                          ("mamba2-tiny", 40 * world)):  # 40: local slices that are not whole SSD chunks
            _case_model(ctx, name, seq)
        _case_mixer_with_mask(ctx, seq=6 * world)
        _case_swapped_mixers(ctx, seq=6 * world)
    for preset in ("llama-tiny", "mamba2-tiny"):  # the runtime: two AdamW steps against one process
        for plan in _PLANS[world]:
            check_plan(preset, plan, logits=plan is _PLANS[world][0] or "pp" in plan)
    if world == 4:  # Mamba-1's scans and gated DeltaNets by state passing (runtime/cp_scan.py, cp_delta.py), with
        from tests.runtime.families import SCANS  # tp's splits and pp's stages; Jamba's and Qwen3-Next's beside
        from tests.runtime.hybrids import HYBRIDS  # attention (contiguous chunks) and MoE layers

        for source in (SCANS["mamba"], HYBRIDS["jamba"], HYBRIDS["qwen3_next"]):
            for plan in (dict(tp=2, cp=2), dict(pp=2, cp=2, micro_batch=2)):
                check_plan(source, plan, logits=True)


def _case_attention(ctx: CPContext, *, seq: int, heads: int, kv_heads: int, batch: int) -> None:
    torch.manual_seed(1)
    q = torch.randn(batch, heads, seq, 8, requires_grad=True)
    k = torch.randn(batch, kv_heads, seq, 8, requires_grad=True)
    v = torch.randn(batch, kv_heads, seq, 8, requires_grad=True)
    w = torch.randn(batch, seq, heads, 8)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2)
    (ref * w).sum().backward()

    lay = SeqLayout.BALANCED
    local = [split_sequence(t.detach(), ctx, lay, dim=2).requires_grad_() for t in (q, k, v)]
    out = balanced_causal_attention(*local, ctx)
    torch.testing.assert_close(out, split_sequence(ref.detach(), ctx, lay, dim=1), **TOL)
    (out * split_sequence(w, ctx, lay, dim=1)).sum().backward()
    for full, part in zip((q, k, v), local):
        torch.testing.assert_close(part.grad, split_sequence(full.grad, ctx, lay, dim=2), **TOL)


def _reference(name: str, seq: int, batch: int = 2):
    spec = get_spec(name, layers=2)
    torch.manual_seed(5)
    ids = torch.randint(0, spec.vocab, (batch, seq))
    labels = ids.clone()
    labels[0, : seq // 3] = -100  # some ignored tokens, unevenly spread over the ranks
    model = build_model(spec, seed=0)
    out = model(ids, use_cache=False)
    loss = F.cross_entropy(out.logits[:, :-1].reshape(-1, spec.vocab), labels[:, 1:].reshape(-1))
    loss.backward()
    return spec, ids, labels, out.logits.detach(), loss.detach(), model


def _case_model(ctx: CPContext, name: str, seq: int) -> None:
    spec, ids, labels, ref_logits, ref_loss, ref_model = _reference(name, seq)
    model = build_model(spec, seed=0)
    layout = enable_context_parallel(model, ctx)
    local_ids, positions, targets = split_batch(ids, labels, ctx, layout)
    kwargs = {"position_ids": positions} if layout is SeqLayout.BALANCED else {}
    logits = model(local_ids, **kwargs).logits
    num_tokens = int((labels[:, 1:] != -100).sum())
    loss = causal_lm_loss(logits, targets, num_tokens=num_tokens, shifted=True)  # what train_step runs
    loss.backward()
    torch.testing.assert_close(gather_sequence(logits.detach(), ctx, layout), ref_logits, **TOL)
    total = loss.detach().clone()
    dist.all_reduce(total, group=ctx.group)
    torch.testing.assert_close(total, ref_loss, **TOL)
    ref_grads = dict(ref_model.named_parameters())
    for pname, param in model.named_parameters():
        grad = param.grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        torch.testing.assert_close(grad, ref_grads[pname].grad, **TOL, msg=lambda m: f"{name} S={seq} {pname}: {m}")


def _case_mixer_with_mask(ctx: CPContext, *, seq: int) -> None:
    """The mixer alone, with a padding mask, against HF's own torch path: Mamba2Mixer and every hybrid's
    mixer class (Bamba, Nemotron-H, Granite-4, Zamba2, Falcon-H1's multipliers and norm variants), which
    state passing finds by the SSD pattern."""
    from tests.runtime.test_ssd import HYBRID_MIXERS, hybrid_mixer

    spec = get_spec("mamba2-tiny", layers=1)
    mixers = [("mamba2-tiny", build_model(spec, seed=3).backbone.layers[0].mixer)]
    mixers += [(name, hybrid_mixer(name, seed=3)[0]) for name in HYBRID_MIXERS]
    for name, mixer in mixers:
        hidden = mixer.in_proj.in_features
        torch.manual_seed(2)
        x = torch.randn(2, seq, hidden, requires_grad=True)
        mask = torch.ones(2, seq)
        mask[1, : seq // 4] = 0
        ref = type(mixer).forward(mixer, x, attention_mask=mask)
        w = torch.randn_like(ref)
        params = [p for _, p in mixer.named_parameters()]
        ref_grads = torch.autograd.grad((ref * w).sum(), [x, *params])
        lay = SeqLayout.CONTIGUOUS
        xl = split_sequence(x.detach(), ctx, lay).requires_grad_()
        out = cp_mixer_forward(mixer, ctx, xl, attention_mask=split_sequence(mask, ctx, lay))
        torch.testing.assert_close(out, split_sequence(ref.detach(), ctx, lay), **TOL, msg=lambda m: f"{name}: {m}")
        grads = torch.autograd.grad((out * split_sequence(w, ctx, lay)).sum(), [xl, *params])
        torch.testing.assert_close(grads[0], split_sequence(ref_grads[0], ctx, lay), **TOL)
        for pname, got, want in zip([n for n, _ in mixer.named_parameters()], grads[1:], ref_grads[1:]):
            got = got.clone()
            dist.all_reduce(got, group=ctx.group)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name} grad {pname}: {m}")


def _case_swapped_mixers(ctx: CPContext, *, seq: int) -> None:
    """Recurrent mixers whose own forward runs with its kernels swapped (runtime/cp_scan.py, cp_delta.py), alone,
    with a padding mask, against HF's own torch path: Mamba-1's (Mamba's, Falcon-Mamba's B / C / dt norms, Jamba's),
    the entering state's contribution in pieces shorter than a rank's slice (CHUNK 5), and gated DeltaNets
    (Qwen3-Next's fused projections, Qwen3.5's separate ones, OLMo-hybrid's with q / k norms)."""
    import copy

    from autoshard.models.dispatch import delta_mixers, scan_mixers
    from autoshard.models.tiny import build_tiny, tiny_config
    from autoshard.runtime import cp_scan
    from autoshard.runtime.cp_delta import install_cp_delta_rules

    cases = [(t, scan_mixers, cp_scan.install_cp_scans) for t in ("mamba", "falcon_mamba", "jamba")]
    cases += [(t, delta_mixers, install_cp_delta_rules) for t in ("qwen3_next", "qwen3_5_text", "olmo_hybrid")]
    chunk, cp_scan.CHUNK = cp_scan.CHUNK, 5
    try:
        for model_type, found, install in cases:
            model = build_tiny(tiny_config(model_type), seed=3)
            mixer = copy.deepcopy(found(model)[0][1])
            torch.manual_seed(2)
            x = torch.randn(2, seq, model.config.hidden_size, requires_grad=True)
            mask = torch.ones(2, seq)
            mask[1, : seq // 4] = 0
            ref = type(mixer).forward(mixer, x, attention_mask=mask)
            w = torch.randn_like(ref)
            names, params = zip(*mixer.named_parameters())
            ref_grads = torch.autograd.grad((ref * w).sum(), [x, *params])
            assert install(mixer, ctx) == 1
            lay = SeqLayout.CONTIGUOUS
            xl = split_sequence(x.detach(), ctx, lay).requires_grad_()
            out = mixer(xl, attention_mask=split_sequence(mask, ctx, lay))
            torch.testing.assert_close(out, split_sequence(ref.detach(), ctx, lay), **TOL, msg=lambda m: f"{model_type}: {m}")
            grads = torch.autograd.grad((out * split_sequence(w, ctx, lay)).sum(), [xl, *params])
            torch.testing.assert_close(grads[0], split_sequence(ref_grads[0], ctx, lay), **TOL)
            for pname, got, want in zip(names, grads[1:], ref_grads[1:]):
                got = got.clone()
                dist.all_reduce(got, group=ctx.group)
                torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"{model_type} grad {pname}: {m}")
    finally:
        cp_scan.CHUNK = chunk


@pytest.mark.parametrize("world", [2, 4])
def test_cp_matches_full_sequence(world):
    run_ranks(world, _run_all)


@pytest.mark.slow
def test_dp_tp_cp_on_eight_ranks():
    run_ranks(8, _run_all)
