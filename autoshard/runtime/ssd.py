"""Memory-efficient chunked SSD for HF Mamba-2 mixers: what the cost model's `ssd_chunk_scan` prices.

The whole contract: docs/modules/runtime.md (runtime/ssd.py).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from autoshard.errors import InvalidConfigError


# -- the math, in phases ------------------------------------------------------------------------------

def _chunked(t: Tensor, chunk: int) -> Tensor:
    b, L = t.shape[:2]
    pad = (-L) % chunk
    if pad:  # dt = 0 on padding: no decay, no input, so states are unchanged
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))
    return t.reshape(b, (L + pad) // chunk, chunk, *t.shape[2:])


def _prepare(x, dt, A, B, C, chunk):
    """(x dt, B, C, log-decay from chunk start) chunked: (b, c, l, h, p), (b, c, l, h, n) x2, (b, c, l, h)."""
    return (_chunked(x * dt[..., None], chunk), _chunked(B, chunk), _chunked(C, chunk),
            _chunked(dt * A, chunk).cumsum(2))


def _intra(xd: Tensor, Bc: Tensor, Cc: Tensor, acs: Tensor) -> Tensor:
    """Diagonal blocks: y_l = sum_{s<=l} (C_l . B_s) exp(acs_l - acs_s) x_s dt_s, within each chunk."""
    chunk = xd.shape[2]
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=xd.device).tril()
    seg = (acs[:, :, :, None] - acs[:, :, None]).masked_fill(~lower[:, :, None], float("-inf"))
    scores = torch.einsum("bclhn,bcshn->bclsh", Cc, Bc) * seg.exp()  # (b, c, l, l, h)
    return torch.einsum("bclsh,bcshp->bclhp", scores, xd)


def _entering(xd: Tensor, Bc: Tensor, acs: Tensor, initial: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """States entering every chunk (b, c, h, p, n) and after the last one (b, h, p, n)."""
    to_end = (acs[:, :, -1:] - acs).exp()  # (b, c, l, h)
    states = torch.einsum("bcshn,bcsh,bcshp->bchpn", Bc, to_end, xd)  # each chunk's own contribution
    total = acs[:, :, -1]  # (b, c, h)
    ends = total.cumsum(1)
    starts = ends - total
    nc = xd.shape[1]
    strict = torch.ones(nc, nc, dtype=torch.bool, device=xd.device).tril(-1)
    w = (starts[:, :, None] - ends[:, None]).masked_fill(~strict[..., None], float("-inf")).exp()  # (b, c, z, h)
    entering = torch.einsum("bczh,bzhpn->bchpn", w, states)
    final = torch.einsum("bzh,bzhpn->bhpn", (ends[:, -1:] - ends).exp(), states)
    if initial is not None:
        entering = entering + starts.exp()[..., None, None] * initial[:, None]
        final = final + ends[:, -1].exp()[..., None, None] * initial
    return entering, final


def _off(Cc: Tensor, entering: Tensor, acs: Tensor) -> Tensor:
    """Off-diagonal blocks: the state entering the chunk read out by C, decayed to position l."""
    return torch.einsum("bclhn,bchpn->bclhp", Cc, entering) * acs.exp()[..., None]


def ssd_chunk_scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, chunk: int) -> tuple[Tensor, Tensor]:
    """The SSD scan from a zero state with plain autograd. x (b, L, h, p), dt (b, L, h) already
    softplus-ed and clamped, A (h,) negative, B, C (b, L, h, n) expanded to heads. Returns y
    (b, L, h, p) without the D skip, and the final state (b, h, p, n). All float32."""
    b, L, h, p = x.shape
    xd, Bc, Cc, acs = _prepare(x, dt, A, B, C, chunk)
    entering, final = _entering(xd, Bc, acs)
    y = _intra(xd, Bc, Cc, acs) + _off(Cc, entering, acs)
    return y.reshape(b, -1, h, p)[:, :L], final


# -- the memory-efficient Function -----------------------------------------------------------------------

def _per_head(x, dt, A, B, C, D, dt_bias, dt_limit, head_group):
    """float32 inputs of the scan: dt discretised as HF does, B and C gathered to heads."""
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    dt = F.softplus(dt).clamp(min=dt_limit[0], max=dt_limit[1]).float()
    B, C = (t.float().index_select(2, head_group) for t in (B, C))
    return x.float(), dt, A.float(), B, C


def _scan(x, dt, A, B, C, D, dt_bias, head_group, chunk, dt_limit, initial=None):
    """The scan without autograd: y (b, L, h, p) float32 with the D skip, the final state (b, h, p, n)
    and the states entering every chunk; `initial` (b, h, p, n): the state before the first token."""
    b, L, h, p = x.shape
    xf, dtf, Af, Bh, Ch = _per_head(x, dt, A, B, C, D, dt_bias, dt_limit, head_group)
    xd, Bc, Cc, acs = _prepare(xf, dtf, Af, Bh, Ch, chunk)
    entering, final = _entering(xd, Bc, acs, None if initial is None else initial.float())
    y = (_intra(xd, Bc, Cc, acs) + _off(Cc, entering, acs)).reshape(b, -1, h, p)[:, :L]
    if D is not None:
        y = y + D.float()[:, None] * xf
    return y, final, entering


class _SSDScan(torch.autograd.Function):
    """Saves the inputs and the float32 chunk states; recomputes the rest in backward."""

    @staticmethod
    def forward(ctx, x, dt, A, B, C, D, dt_bias, head_group, chunk, dt_limit, want_final):
        # float32 throughout, as the fused kernels accumulate: under bf16-mixed the forward runs inside
        # autocast, which would run these einsums in bf16 (and the backward, outside it, in float32)
        with torch.no_grad(), torch.autocast(x.device.type, enabled=False):
            y, final, entering = _scan(x, dt, A, B, C, D, dt_bias, head_group, chunk, dt_limit)
        ctx.save_for_backward(x, dt, A, B, C, D, dt_bias, head_group, entering)
        ctx.chunk, ctx.dt_limit, ctx.want_final = chunk, dt_limit, want_final
        return (y.contiguous(), final) if want_final else y.contiguous()

    @staticmethod
    def backward(ctx, dy, dfinal=None):
        x, dt, A, B, C, D, dt_bias, head_group, entering = ctx.saved_tensors
        chunk = ctx.chunk
        inputs = (x, dt, A, B, C, D, dt_bias)
        leaves = [t.detach().requires_grad_(need) if t is not None else None
                  for t, need in zip(inputs, ctx.needs_input_grad[:7])]
        wanted = [t for t in leaves if t is not None and t.requires_grad]
        b, L, h, p = x.shape
        with torch.enable_grad():
            # phase 1: outputs from the saved chunk states (the l x l work, recomputed chunk by chunk)
            xf, dtf, Af, Bh, Ch = _per_head(*leaves[:5], leaves[5], leaves[6], ctx.dt_limit, head_group)
            xd, Bc, Cc, acs = _prepare(xf, dtf, Af, Bh, Ch, chunk)
            state_in = entering.detach().requires_grad_()
            y = (_intra(xd, Bc, Cc, acs) + _off(Cc, state_in, acs)).reshape(b, -1, h, p)[:, :L]
            if leaves[5] is not None:
                y = y + leaves[5].float()[:, None] * xf
            grads = torch.autograd.grad(y, [*wanted, state_in], dy, allow_unused=True)
            del xd, Bc, Cc, acs, y
            # phase 2: the chunk states (and the final state) from the inputs, without the l x l tensors
            xf, dtf, Af, Bh, Ch = _per_head(*leaves[:5], leaves[5], leaves[6], ctx.dt_limit, head_group)
            xd, Bc, _, acs = _prepare(xf, dtf, Af, Bh, Ch, chunk)
            again, final = _entering(xd, Bc, acs)
            outs, douts = [again], [grads[-1]]
            if dfinal is not None:
                outs.append(final)
                douts.append(dfinal)
            more = torch.autograd.grad(outs, wanted, douts, allow_unused=True)
        total = iter([_add(g1, g2) for g1, g2 in zip(grads[:-1], more)])
        result = [next(total) if t is not None and t.requires_grad else None for t in leaves]
        return (*result, None, None, None, None)


def _add(a: Tensor | None, b: Tensor | None) -> Tensor | None:
    if a is None:
        return b
    return a if b is None else a + b


def ssd_scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, *, chunk: int, D: Tensor | None = None,
             dt_bias: Tensor | None = None, dt_limit: tuple[float, float] = (0.0, float("inf")),
             head_group: Tensor | None = None, final_state: bool = False):
    """See docs/modules/runtime.md. x (b, L, h, p), dt (b, L, h) before softplus, A (h,), B, C (b, L, g, n);
    `head_group` None: head i reads group i // (h / g). On CUDA with mamba_ssm installed, its fused
    kernel runs instead (`fused_scan`)."""
    kernel = fused_scan(x.device)
    if kernel is not None:
        if head_group is not None:  # a grouping the kernel's i // (h / g) does not express: B, C per head
            B, C = B.index_select(2, head_group), C.index_select(2, head_group)
        return kernel(x, dt, A, B, C, chunk, D=D, dt_bias=dt_bias, dt_softplus=True, dt_limit=tuple(dt_limit),
                      return_final_states=final_state)
    h, g = x.shape[2], B.shape[2]
    if head_group is None:
        head_group = torch.arange(h, device=x.device) // (h // g)
    return _SSDScan.apply(x, dt, A, B, C, D, dt_bias, head_group, chunk, tuple(dt_limit), final_state)


_SSD_MODULE = "mamba_ssm.ops.triton.ssd_combined"


@functools.cache
def _mamba_ssm_scan():
    """mamba_ssm's `mamba_chunk_scan_combined` (Triton), or None where it is not installed.

    The kernel is Triton alone, but mamba_ssm's package `__init__` imports its compiled CUDA
    extensions (`selective_scan_cuda`, Mamba-1's scan), which a Triton-only install
    (`MAMBA_SKIP_CUDA_BUILD=TRUE pip install mamba-ssm`, seconds instead of a long nvcc build) lacks:
    then the package is registered without running its `__init__` and the Triton module imported
    from it (`_without_package_init`)."""
    try:
        return importlib.import_module(_SSD_MODULE).mamba_chunk_scan_combined
    except ImportError:
        pass
    except Exception:  # installed, but without a usable Triton / CUDA build
        return None
    return _without_package_init("mamba_ssm", _SSD_MODULE, "mamba_chunk_scan_combined")


def _without_package_init(package: str, module: str, name: str):
    """`module`.`name` of an installed `package` whose `__init__` fails to import, imported with the
    package registered but its `__init__` not run; None (and nothing left registered) where that fails."""
    spec = importlib.util.find_spec(package) if package not in sys.modules else None
    if spec is None or spec.submodule_search_locations is None:
        return None
    sys.modules[package] = importlib.util.module_from_spec(spec)  # its __path__, not its __init__
    try:
        return getattr(importlib.import_module(module), name)
    except Exception:
        for key in [k for k in sys.modules if k == package or k.startswith(package + ".")]:
            del sys.modules[key]
        return None


def fused_scan(device: torch.device):
    """The fused SSD kernel that runs on `device`, or None for `_SSDScan`'s torch ops: mamba_ssm's
    `mamba_chunk_scan_combined` on CUDA where it is installed (what production Mamba-2 training runs,
    and what the GPU profiles price: passes/capture/kernels.py `ssd_chunk_scan`). Without it the torch scan
    runs, measured 4.4-6.5x slower than the priced kernel on an H200 (docs/cost_model.md): warned once."""
    if device.type != "cuda":
        return None
    kernel = _mamba_ssm_scan()
    if kernel is None:
        _warn_unfused()
    return kernel


@functools.cache
def _warn_unfused() -> None:
    warnings.warn("Mamba-2's SSD scan runs as torch ops on CUDA because mamba_ssm is not installed: a step "
                  "takes several times what the plan predicts (the plan prices mamba_ssm's fused "
                  "mamba_chunk_scan_combined; 4.4-6.5x measured on an H200); pip install mamba-ssm "
                  "(MAMBA_SKIP_CUDA_BUILD=TRUE installs the Triton kernels alone, without a CUDA build)",
                  stacklevel=3)


# -- the HF mixer ---------------------------------------------------------------------------------------

def local_sizes(mixer: nn.Module) -> tuple[int, int, int, int]:
    """(heads, head_dim, groups, state) this mixer holds, read off its parameters (TP may have split them)."""
    heads, n = mixer.dt_bias.shape[0], mixer.ssm_state_size
    inner = heads * mixer.head_dim
    groups = (mixer.conv1d.weight.shape[0] - inner) // (2 * n)
    return heads, mixer.head_dim, groups, n


def head_groups(mixer: nn.Module, heads: int, groups: int, device) -> Tensor:
    """The group each local head reads: `mixer.ssd_head_offset` / `ssd_heads_per_group` when tensor
    parallelism replicated the groups (runtime/tensor_parallel.py), else heads split evenly."""
    offset = getattr(mixer, "ssd_head_offset", 0)
    per_group = getattr(mixer, "ssd_heads_per_group", heads // groups)
    return (torch.arange(heads, device=device) + offset) // per_group


def scan_head_group(mixer: nn.Module, heads: int, groups: int, device) -> Tensor | None:
    """`head_groups` as `ssd_scan` takes it: None where it is the even split i // (heads / groups), which
    the fused kernel reads from B and C per group without gathering them to heads."""
    per_group = heads // groups
    if getattr(mixer, "ssd_head_offset", 0) == 0 and getattr(mixer, "ssd_heads_per_group", per_group) == per_group:
        return None
    return head_groups(mixer, heads, groups, device)


def projected(mixer: nn.Module, hidden_states: Tensor) -> Tensor:
    """The mixer's in_proj output (b, L, 2 d_in + 2 g n + h), with Falcon-H1's mup multipliers where the
    mixer has them: `ssm_in_multiplier` on the input, `mup_vector` (1, 1, channels) on the output."""
    scale = getattr(mixer, "ssm_in_multiplier", None)
    if scale is not None:
        hidden_states = hidden_states * scale
    proj = mixer.in_proj(hidden_states)
    mup = getattr(mixer, "mup_vector", None)
    if mup is None:
        return proj
    if mup.shape[-1] != proj.shape[-1]:
        raise InvalidConfigError(f"{type(mixer).__name__}: mup_vector has {mup.shape[-1]} channels and in_proj "
                                 f"{proj.shape[-1]} on this rank: the multipliers were not split with in_proj")
    return proj * mup


def mixer_forward(mixer: nn.Module, hidden_states: Tensor, cache=None, attention_mask: Tensor | None = None,
                  **kwargs) -> Tensor:
    """HF's Mamba-2 mixer forward (torch path, training, no cache) with `ssd_scan` for the chunk scan."""
    if cache is not None:
        return cached_mixer_forward(mixer, hidden_states, cache, attention_mask)
    from transformers.models.mamba2.modeling_mamba2 import apply_mask_to_padding_states, causal_conv1d_fn

    b, L, _ = hidden_states.shape
    dtype = hidden_states.dtype
    heads, head_dim, groups, n = local_sizes(mixer)
    inner = heads * head_dim
    hidden_states = apply_mask_to_padding_states(hidden_states, attention_mask)
    proj = projected(mixer, hidden_states)  # (b, L, 2 d_in + 2 g n + h)
    A = -torch.exp(mixer.A_log.float())
    gate, xbc, dt = proj.split([inner, inner + 2 * groups * n, heads], dim=-1)
    xbc = causal_conv1d_fn(xbc.transpose(1, 2), mixer.conv1d.weight.squeeze(1), mixer.conv1d.bias,
                           activation=mixer.activation)
    xbc = apply_mask_to_padding_states(xbc.transpose(1, 2), attention_mask)
    x, B, C = torch.split(xbc, [inner, groups * n, groups * n], dim=-1)
    y = ssd_scan(x.view(b, L, heads, head_dim), dt, A, B.view(b, L, groups, n), C.view(b, L, groups, n),
                 chunk=mixer.chunk_size, D=mixer.D, dt_bias=mixer.dt_bias, dt_limit=mixer.time_step_limit,
                 head_group=scan_head_group(mixer, heads, groups, x.device))
    y = gated_norm(mixer, y.reshape(b, L, -1), gate)
    return mixer.out_proj(y.to(dtype))


def cached_mixer_forward(mixer: nn.Module, hidden_states: Tensor, cache, attention_mask: Tensor | None = None) -> Tensor:
    """HF Mamba2Mixer.forward with a cache (its torch path: generation, no gradient), each local head
    reading its own group (`head_groups`) where HF assumes heads // (heads / n_groups) -- wrong on a
    rank that keeps the groups whole under tp. A prompt runs the chunked scan from the cached state
    (`_scan`) and stores its final state; one token runs the recurrent update (`recurrent_step`).
    The conv state (b, conv channels of this rank, d_conv) and the SSM state (b, heads of this rank,
    head_dim, d_state) live in `cache` (HF's `DynamicCache`), sharded as the weights are."""
    from transformers.models.mamba2.modeling_mamba2 import (apply_mask_to_padding_states, causal_conv1d_fn,
                                                            causal_conv1d_update)

    b, L, _ = hidden_states.shape
    dtype, layer = hidden_states.dtype, mixer.layer_idx
    heads, head_dim, groups, n = local_sizes(mixer)
    inner = heads * head_dim
    conv_state = cache.get_conv_state(layer, state_idx=0)
    ssm_state = cache.get_recurrent_state(layer, state_idx=0)
    hidden_states = apply_mask_to_padding_states(hidden_states, attention_mask)
    gate, xbc, dt = projected(mixer, hidden_states).split([inner, inner + 2 * groups * n, heads], dim=-1)
    A = -torch.exp(mixer.A_log.float())
    xbc = xbc.transpose(1, 2)  # (b, channels, L)
    weight, bias = mixer.conv1d.weight.squeeze(1), mixer.conv1d.bias
    if conv_state is not None and L == 1 and not cache.is_recording_past(layer):
        xbc = causal_conv1d_update(xbc, conv_state, weight, bias, activation=mixer.activation)
    else:  # the cache returns its past channels before the new ones, and keeps the last d_conv
        xbc = cache.update_conv_state(xbc, layer, conv_kernel_size=mixer.conv_kernel_size)
        xbc = causal_conv1d_fn(xbc, weight, bias, activation=mixer.activation)[:, :, -L:]
    xbc = apply_mask_to_padding_states(xbc.transpose(1, 2), attention_mask)
    x, B, C = torch.split(xbc, [inner, groups * n, groups * n], dim=-1)
    group_of = head_groups(mixer, heads, groups, x.device)
    if ssm_state is not None and L == 1:
        y = recurrent_step(ssm_state, x.view(b, heads, head_dim), dt[:, 0], A, B.view(b, groups, n),
                           C.view(b, groups, n), D=mixer.D, dt_bias=mixer.dt_bias, head_group=group_of)
    else:
        y, final, _ = _scan(x.view(b, L, heads, head_dim), dt, A, B.view(b, L, groups, n), C.view(b, L, groups, n),
                            mixer.D, mixer.dt_bias, group_of, mixer.chunk_size, tuple(mixer.time_step_limit),
                            initial=ssm_state)
        cache.update_recurrent_state(final, layer_idx=layer)
    y = gated_norm(mixer, y.reshape(b, L, -1), gate)
    return mixer.out_proj(y.to(dtype))


def recurrent_step(state: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, *, D: Tensor,
                   dt_bias: Tensor, head_group: Tensor) -> Tensor:
    """One token of the SSM (HF `mamba2_selective_state_update`, mamba_ssm's `selective_state_update`):
    state (b, h, p, n) updated in place to state * exp(dt A) + dt B x, output y = C . state + D x.
    x (b, h, p), dt (b, h) before softplus (no clamp, as both), A (h,), B, C (b, g, n): head i reads
    group head_group[i]. Returns y (b, h, p) in x's dtype."""
    dt = F.softplus(dt + dt_bias.to(dt.dtype))  # (b, h)
    dA = torch.exp(dt.float() * A.float())  # (b, h)
    Bh, Ch = B.index_select(1, head_group), C.index_select(1, head_group)  # (b, h, n)
    dBx = dt[..., None, None] * Bh[:, :, None] * x[..., None]  # (b, h, p, n)
    new = state * dA[..., None, None] + dBx
    state.copy_(new.to(state.dtype))
    y = torch.matmul(new.to(Ch.dtype), Ch[..., None])[..., 0]  # (b, h, p)
    return (y + x * D[:, None]).to(x.dtype)


def gated_norm(mixer: nn.Module, y: Tensor, gate: Tensor) -> Tensor:
    """The mixer's gated RMSNorm (HF's *RMSNormGated: y * silu(gate), RMS per group of channels; Falcon-H1
    may normalise before the gate, `norm_before_gate`, or have no norm, `mamba_rms_norm` False: the gate
    alone). When tensor parallelism kept the groups whole (`mixer.ssd_norm_group_size`, the global group
    width), a group's channels lie on several ranks: each rank sums the squares of its heads per
    group and the sums are added over the tp group (`comm.sum_over_group`) before normalising."""
    norm = mixer.norm
    if getattr(norm, "weight", None) is None:  # Falcon-H1 with mamba_rms_norm False: nn.Identity
        return y * F.silu(gate)
    size = getattr(mixer, "ssd_norm_group_size", None)
    if size is None:
        return norm(y, gate)
    from autoshard.runtime.comm import sum_over_group

    dtype = y.dtype
    before = bool(getattr(norm, "norm_before_gate", False))
    h = y.float() if before else y.float() * F.silu(gate.float())  # (b, L, heads p)
    heads, head_dim, groups, _ = local_sizes(mixer)
    per_head = h.view(*h.shape[:-1], heads, head_dim)
    group_of = head_groups(mixer, heads, groups, y.device)
    squares = per_head.pow(2).sum(-1)  # (b, L, heads)
    sums = squares.new_zeros(*squares.shape[:-1], groups).index_add(-1, group_of, squares)
    sums = sum_over_group(sums, getattr(mixer, "ssd_tp_group", None))  # (b, L, groups), all ranks
    rstd = torch.rsqrt(sums / size + norm.variance_epsilon).index_select(-1, group_of)  # (b, L, heads)
    h = (per_head * rstd[..., None]).reshape(h.shape)
    if before:
        return (norm.weight * h * F.silu(gate.float())).to(dtype)
    return norm.weight * h.to(dtype)


def install_ssd_mixers(model: nn.Module) -> int:
    """Run every Mamba-2 SSD mixer of `model` (by pattern, models/facts.py `ssd_mixers`) through
    `mixer_forward`; returns how many."""
    return install_mixer_forward(model, mixer_forward)


def install_unfused_scans(model: nn.Module) -> int:
    """Make every Mamba-1 mixer of `model` (models/dispatch.py `scan_mixers`) decline mamba_ssm's fused whole-mixer
    kernel (`mamba_inner_fn`, which reads the weights directly: tp's shards would skip their all-reduces, fp8's
    linears their float8 GEMMs), so it runs its linears as modules and its conv and scan kernels, as the cost model
    prices them; returns how many. Without mamba_ssm (a CPU) HF takes that path already."""
    from autoshard.models.dispatch import declined, scan_mixers, swapping_forward, takes_fused

    found = scan_mixers(model)
    for _, mixer in found:
        swapping_forward(mixer, ((takes_fused, declined),), lambda args, kwargs: None)
    return len(found)


def install_mixer_forward(model: nn.Module, forward_of) -> int:
    """Replace the forward of every SSD mixer of `model` by `forward_of(mixer, hidden_states, cache,
    attention_mask, **kwargs)`; returns how many (the HF keyword `cache_params` read as `cache`)."""
    from autoshard.models.facts import ssd_mixers

    mixers = ssd_mixers(model)
    for _, module in mixers:
        def forward(hidden_states, cache=None, attention_mask=None, _mixer=module, **kwargs):
            cache = kwargs.pop("cache_params", None) if cache is None else cache
            return forward_of(_mixer, hidden_states, cache, attention_mask, **kwargs)

        module.forward = forward
    return len(mixers)
