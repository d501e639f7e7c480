"""runtime/loss.py: the in-place cross-entropy gives HF's loss and gradient, keeps one float32
copy of the logits for backward (what `cost.logits_bytes` prices), and leaves the logits as given."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from autoshard.runtime.loss import IGNORE_INDEX, causal_lm_loss, shift_labels


def _reference(logits, labels):
    target = shift_labels(labels).reshape(-1)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target, ignore_index=IGNORE_INDEX)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_loss_and_gradient_match_torch_cross_entropy(dtype):
    torch.manual_seed(0)
    logits = (torch.randn(3, 7, 50) * 4).to(dtype).requires_grad_()
    labels = torch.randint(0, 50, (3, 7))
    labels[1, 2:5] = IGNORE_INDEX
    before = logits.detach().clone()
    ref = _reference(logits, labels)
    (ref_grad,) = torch.autograd.grad(ref * 3.0, logits)
    loss = causal_lm_loss(logits, labels)
    (grad,) = torch.autograd.grad(loss * 3.0, logits)
    assert loss.dtype == torch.float32 and grad.dtype == dtype
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=0)  # F.cross_entropy's backward, to the bit
    assert torch.equal(logits.detach(), before)  # worked on a copy


def test_it_is_hfs_loss_for_a_real_model():
    from autoshard.models.presets import build_model, get_spec

    torch.manual_seed(0)
    model = build_model(get_spec("llama-tiny"))
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    out = model(ids, labels=ids)
    torch.testing.assert_close(causal_lm_loss(out.logits, ids), out.loss, rtol=1e-6, atol=1e-6)


def test_it_saves_one_float32_copy_of_the_logits():
    logits = torch.randn(4, 16, 300, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 300, (4, 16))
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = causal_lm_loss(logits, labels)
    big = [n for n in saved.values() if n >= logits.numel()]
    assert big == [logits.numel() * 4]  # the log-softmax; not the bf16 logits, not a softmax beside it
    assert sum(saved.values()) - big[0] < 64 * 8 * 4  # and per-token vectors
    loss = causal_lm_loss(logits, labels)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="inplace"):  # backward turned the log-softmax into the gradient
        loss.backward()


def test_its_peak_is_one_float32_copy_and_the_gradient(monkeypatch):
    """Forward and backward allocate the fp32 copy (4 B per logit), the gradient in the logits' dtype
    (2 B) and float32 temporaries of a block of rows: what `cost.logits_bytes` prices beside the graph's
    log-softmax, where `F.cross_entropy(logits.float())` holds fp32 logits, log-softmax and gradient
    (here: 6.5 B per logit against 12)."""
    from autoshard.runtime import loss as loss_module
    from tests.runtime.test_state_bytes import Allocations

    n, vocab, rows = 64, 1000, 8
    monkeypatch.setattr(loss_module, "_BLOCK_BYTES", rows * vocab * 4)
    logits = torch.randn(1, n, vocab, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, vocab, (1, n))

    def peak(loss_fn) -> int:
        logits.grad = None
        mode = Allocations()
        with mode, mode.region("loss"):
            loss_fn(logits, labels).backward()
        return mode.peak["loss"]

    ours, plain = peak(causal_lm_loss), peak(_reference)
    per_logit = n * vocab
    assert ours <= per_logit * (4 + 2) + 2 * rows * vocab * 4 + 64 * n, ours / per_logit
    assert plain >= per_logit * (4 + 4 + 4), plain / per_logit
