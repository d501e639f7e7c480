"""The `ssd_chunk_scan_torch` cost rule (passes/capture/kernels.py): what a chunked SSD written in torch ops keeps
for backward under autograd, as MindSpeed-LLM's StateSpaceProcessor runs it on the 910B, measured here on the
same sequence of ops (bf16 activations, fp32 decays) with `saved_tensors_hooks`, and the 910B profile using it."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from autoshard.hardware import load_hardware
from autoshard.models.presets import get_spec
from autoshard.passes.capture.kernels import kernel_for, ssd_cost, ssd_torch_cost

BF16 = torch.bfloat16


def _segsum(a: torch.Tensor) -> torch.Tensor:
    """(..., T) -> (..., T, T): sum of a[j+1..i] below the diagonal, -inf above (the SSD's log-decay mask)."""
    t = a.size(-1)
    a = a[..., None].expand(*a.shape, t).clone()
    a = a.masked_fill(~torch.tril(torch.ones(t, t, dtype=torch.bool), -1), 0)
    out = torch.cumsum(a, dim=-2)
    return out.masked_fill(~torch.tril(torch.ones(t, t, dtype=torch.bool)), -torch.inf)


def _torch_ssd(x, dt, A, B, C, D, dt_bias, l):
    """The chunked SSD in the order MindSpeed-LLM's StateSpaceProcessor (no context parallelism) runs it.
    x (b, s, h, p), dt (b, s, h), B / C (b, s, g, n) bf16; A (h,) fp32."""
    b, s, h, p = x.shape
    n, r = B.shape[-1], h // B.shape[2]
    B, C = B.repeat_interleave(r, dim=2), C.repeat_interleave(r, dim=2)  # groups -> heads, materialised
    skip = D[None, None, :, None] * x
    dt = F.softplus(dt + dt_bias).clamp(1e-3, 1e-1)
    xd, ad = x * dt[..., None], A * dt  # (b, s, h, p) bf16, (b, s, h) fp32
    c = s // l
    xd, ad, B, C = (t.reshape(b, c, l, *t.shape[2:]) for t in (xd, ad, B, C))
    ad = ad.permute(0, 3, 1, 2)  # (b, h, c, l)
    a_cum = torch.cumsum(ad, dim=-1)
    mask = torch.exp(_segsum(ad)).to(BF16)  # (b, h, c, l, l)
    c_b = C.permute(0, 3, 1, 2, 4).reshape(-1, l, n)
    b_b = B.permute(0, 3, 1, 2, 4).reshape(-1, l, n).transpose(1, 2)
    x_b = xd.permute(0, 3, 1, 2, 4).reshape(-1, l, p)
    y_diag = torch.bmm(torch.bmm(c_b, b_b) * mask.reshape(-1, l, l), x_b)
    decay = torch.exp(a_cum[..., -1:] - a_cum).to(BF16)
    bd_b = (B.permute(0, 3, 1, 2, 4) * decay[..., None]).reshape(-1, l, n).transpose(1, 2)
    states = torch.bmm(bd_b, x_b).transpose(1, 2).reshape(b, h, c, p, n).permute(0, 2, 1, 3, 4).contiguous()
    states = torch.cat([torch.zeros_like(states[:, :1]), states], dim=1)
    chunk_decay = torch.exp(_segsum(F.pad(a_cum[..., -1], (1, 0)))).to(BF16)
    states = torch.einsum("bhzc,bchpn->bzhpn", chunk_decay, states)[:, :-1]
    states_b = states.permute(0, 2, 1, 3, 4).reshape(-1, p, n).transpose(-1, -2)
    y_off = torch.bmm(c_b, states_b) * torch.exp(a_cum).to(BF16).reshape(-1, l)[..., None]
    y = (y_diag + y_off).reshape(b, h, c, l, p).permute(0, 2, 3, 1, 4).reshape(b, s, h, p)
    return y + skip


def _saved_bytes(fn, *args, skip=()) -> int:
    """Bytes of the distinct storages autograd keeps from `fn`'s forward for its backward, beyond `skip`."""
    skip = {t.untyped_storage().data_ptr() for t in skip}
    storages: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in skip:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    out.float().sum().backward()  # the saved tensors were enough
    return sum(storages.values())


def test_torch_ssd_rule_is_what_autograd_keeps():
    spec = dataclasses.replace(get_spec("mamba2-tiny"), heads=8, head_dim=16, state=16, groups=2, chunk=16)
    b, s = 2, 64
    torch.manual_seed(0)
    leaf = lambda *shape, dtype=BF16: torch.randn(*shape, dtype=dtype, requires_grad=True)  # noqa: E731
    x, dt = leaf(b, s, spec.heads, spec.head_dim), leaf(b, s, spec.heads)
    B, C = leaf(b, s, spec.groups, spec.state), leaf(b, s, spec.groups, spec.state)
    A, D, bias = -torch.rand(spec.heads) - 0.5, leaf(spec.heads), leaf(spec.heads)
    args = (x, dt, A, B, C, D, bias, spec.chunk)
    measured = _saved_bytes(_torch_ssd, *args, skip=(x, dt, A, B, C, D, bias))
    predicted = ssd_torch_cost(spec, b, s).state_bytes
    assert predicted == pytest.approx(measured, rel=0.05), (predicted, measured)
    # the l x l tensors are most of it: far more than the fused kernel's chunk states
    assert predicted > 5 * ssd_cost(spec, b, s).state_bytes


def test_the_910b_prices_mindspeeds_torch_ssd_for_its_stack_and_the_runtimes_scan_for_a_plan():
    spec = get_spec("mamba2-7b")
    npu = load_hardware("ascend-910b")
    assert kernel_for(spec, ("ssd_chunk_scan_torch",)) == ("ssd_chunk_scan_torch",)
    assert kernel_for(spec, npu.stack_kernels("ssd")) == ("ssd_chunk_scan_torch",)  # MindSpeed-LLM's run
    assert kernel_for(spec, npu.kernels) == ("ssd_chunk_scan",)  # autoshard's runtime/ssd.py there
    for gpu in ("a100-80g", "h100", "h200"):
        assert kernel_for(spec, load_hardware(gpu).kernels) == ("ssd_chunk_scan",)
    # listing both: the first replaces the region (they share its anchors)
    assert kernel_for(spec, ("ssd_chunk_scan", "ssd_chunk_scan_torch")) == ("ssd_chunk_scan",)
    torch_rule, fused = ssd_torch_cost(spec, 1, 4096), ssd_cost(spec, 1, 4096)
    assert torch_rule.fwd_flops == fused.fwd_flops and torch_rule.bwd_flops == 2 * fused.fwd_flops  # no recompute
