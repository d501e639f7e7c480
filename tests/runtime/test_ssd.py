"""runtime/ssd.py: the memory-efficient SSD is HF's math, trains like HF, and saves what the cost
model's fused `ssd_chunk_scan` says it saves (passes/capture/kernels.py)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from autoshard.model_spec import Mixer, ModelSpec
from autoshard.models.presets import build_model, get_spec
from autoshard.passes.capture.shapes import build_cost_table
from tests.runtime.measure import saved_activation_bytes
from autoshard.runtime.ssd import install_ssd_mixers, ssd_scan
from tests.runtime.equivalence import TOL

# a mid-size Mamba-2: mamba2-1b's shape (one group, head_dim 64) at a quarter of its width
MID = ModelSpec(name="mamba2-mid", mixer=Mixer.SSD, vocab=2048, hidden=512, layers=2, tied=True, state=64,
                expand=2, head_dim=64, heads=16, groups=1, conv=4, chunk=64)


def test_scan_and_its_gradients_match_hf():
    from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan

    torch.manual_seed(0)
    b, L, h, p, n, g, q = 2, 40, 4, 8, 6, 2, 16  # L not a multiple of the chunk: the padding path
    x, dt, Bm, C = torch.randn(b, L, h, p), torch.randn(b, L, h), torch.randn(b, L, g, n), torch.randn(b, L, g, n)
    A, bias, D = -torch.rand(h) * 2, torch.randn(h), torch.randn(h)
    inputs = [t.requires_grad_() for t in (x, dt, A, Bm, C, D, bias)]
    ref, ref_final = mamba2_chunk_scan(x, dt, A, Bm, C, chunk_size=q, D=D, dt_bias=bias, dt_softplus=True,
                                       return_final_states=True)
    w, wf = torch.randn_like(ref), torch.randn_like(ref_final)
    expected = torch.autograd.grad((ref * w).sum() + (ref_final * wf).sum(), inputs)
    y, final = ssd_scan(x, dt, A, Bm, C, chunk=q, D=D, dt_bias=bias, final_state=True)
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(final, ref_final, rtol=1e-4, atol=1e-5)
    got = torch.autograd.grad((y * w).sum() + (final * wf).sum(), inputs)
    for name, a, e in zip(("x", "dt", "A", "B", "C", "D", "dt_bias"), got, expected):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-4, msg=lambda m: f"grad {name}: {m}")


def test_scan_is_float32_under_bf16_autocast():
    """bf16-mixed runs the forward under autocast; the scan stays in float32 (its backward too)."""
    torch.manual_seed(0)
    b, L, h, p, n, g, q = 2, 32, 4, 8, 6, 2, 16
    x, dt, Bm, C = (torch.randn(*s, dtype=torch.bfloat16) for s in ((b, L, h, p), (b, L, h), (b, L, g, n),
                                                                    (b, L, g, n)))
    A, D = -torch.rand(h) * 2, torch.randn(h)
    inputs = [t.requires_grad_() for t in (x, dt, A, Bm, C, D)]
    ref = ssd_scan(*inputs[:5], chunk=q, D=D)
    expected = torch.autograd.grad(ref.square().sum(), inputs)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = ssd_scan(*inputs[:5], chunk=q, D=D)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, ref, rtol=0, atol=0)
    for a, e in zip(torch.autograd.grad(y.square().sum(), inputs), expected):
        torch.testing.assert_close(a, e, rtol=0, atol=0)


def test_mixers_train_exactly_like_hf():
    spec = get_spec("mamba2-tiny")
    ref = build_model(spec, seed=0)
    ours = copy.deepcopy(ref)
    assert install_ssd_mixers(ours) == spec.layers
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-6) for m in (ref, ours)]
    gen = torch.Generator().manual_seed(3)
    for _ in range(2):
        ids = torch.randint(0, spec.vocab, (2, 40), generator=gen)  # 40: not a multiple of the chunk (16)
        losses = []
        for model, opt in zip((ref, ours), opts):
            opt.zero_grad()
            loss = model(ids, labels=ids).loss
            loss.backward()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
        for (name, a), (_, b) in zip(ref.named_parameters(), ours.named_parameters()):
            torch.testing.assert_close(b.grad, a.grad, **TOL, msg=lambda m: f"grad {name}: {m}")
        for opt in opts:
            opt.step()
    for (name, a), (_, b) in zip(ref.named_parameters(), ours.named_parameters()):
        torch.testing.assert_close(b, a, **TOL, msg=lambda m: f"weight {name}: {m}")


@pytest.mark.parametrize("spec,seq", [(get_spec("mamba2-tiny"), 64), (MID, 256)], ids=["tiny", "mid"])
def test_saved_bytes_equal_the_cost_model(spec, seq):
    """The runtime's saved tensors (hooks on a bf16 training step) vs the table the cost model prices:
    within 5%. Without the substitution the HF fallback saves several times more."""
    model = build_model(spec, seed=0, dtype=torch.bfloat16)
    install_ssd_mixers(model)
    ids = torch.randint(0, spec.vocab, (1, seq), generator=torch.Generator().manual_seed(0))
    measured = saved_activation_bytes(model, ids)
    table = build_cost_table(spec)
    priced = table.saved_bytes(1, seq)
    assert priced == pytest.approx(measured, rel=0.05)
    assert any(n.target == "autoshard.ssd_chunk_scan" for blk in table.blocks for n in blk.nodes)


def test_mid_size_spec_is_a_valid_hf_model():
    model = build_model(dataclasses.replace(MID, layers=1), device="meta")
    assert model.config.n_groups == 1 and model.config.num_heads * model.config.head_dim == 2 * MID.hidden


def test_cached_mixer_is_hfs_cached_path():
    """`cached_mixer_forward` (generation): a prompt, then one token at a time, gives HF's own cached
    mixer outputs and leaves the same conv and SSM states (mamba2-tiny: 2 groups, 2 chunks of prompt)."""
    from transformers import DynamicCache

    from autoshard.runtime.ssd import cached_mixer_forward

    spec = get_spec("mamba2-tiny")
    model = build_model(spec, seed=0).eval()
    mixer = model.backbone.layers[0].mixer
    ours, theirs = DynamicCache(config=model.config), DynamicCache(config=model.config)
    torch.manual_seed(1)
    steps = [torch.randn(2, 20, spec.hidden)] + [torch.randn(2, 1, spec.hidden) for _ in range(3)]
    with torch.no_grad():
        for h in steps:
            got = cached_mixer_forward(mixer, h, ours)
            want = type(mixer).forward(mixer, h, cache=theirs)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    for get in ("get_conv_state", "get_recurrent_state"):
        torch.testing.assert_close(getattr(ours, get)(0), getattr(theirs, get)(0), rtol=1e-4, atol=1e-5)


def test_the_fused_kernel_gets_the_arguments_of_the_torch_scan(monkeypatch):
    """On CUDA with mamba_ssm, `ssd_scan` calls `mamba_chunk_scan_combined`; HF's `mamba2_chunk_scan`
    is its reference with the same signature, so standing it in for the kernel checks the arguments,
    the per-head gather of a grouping the kernel cannot express, and the gradients through it."""
    from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan

    import autoshard.runtime.ssd as ssd

    torch.manual_seed(1)
    b, L, h, p, n, g, q = 2, 24, 4, 4, 6, 2, 8
    for head_group in (None, torch.tensor([1, 1, 0, 1])):
        x, dt, Bm, C = torch.randn(b, L, h, p), torch.randn(b, L, h), torch.randn(b, L, g, n), torch.randn(b, L, g, n)
        A, bias, D = -torch.rand(h) * 2, torch.randn(h), torch.randn(h)
        inputs = [t.requires_grad_() for t in (x, dt, A, Bm, C, D, bias)]
        results = []
        for kernel in (None, mamba2_chunk_scan):
            monkeypatch.setattr(ssd, "fused_scan", lambda device, k=kernel: k)
            y, final = ssd.ssd_scan(x, dt, A, Bm, C, chunk=q, D=D, dt_bias=bias, dt_limit=(0.0, 5.0),
                                    head_group=head_group, final_state=True)
            loss = (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum() + final.square().sum()
            results.append((y, final, torch.autograd.grad(loss, inputs)))
        (y0, f0, g0), (y1, f1, g1) = results
        torch.testing.assert_close(y1.float(), y0, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(f1.float(), f0, rtol=1e-4, atol=1e-5)
        for name, a, e in zip(("x", "dt", "A", "B", "C", "D", "dt_bias"), g1, g0):
            torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-4, msg=lambda m: f"grad {name}: {m}")


def test_the_torch_scan_runs_where_no_fused_kernel_is_installed():
    import autoshard.runtime.ssd as ssd

    assert ssd.fused_scan(torch.device("cpu")) is None
    if ssd._mamba_ssm_scan() is None:  # CUDA without mamba_ssm: warned, since the plan prices the kernel
        ssd._warn_unfused.cache_clear()
        with pytest.warns(UserWarning, match="pip install mamba-ssm"):
            assert ssd.fused_scan(torch.device("cuda")) is None


def test_a_triton_only_mamba_ssm_install_gives_the_fused_kernel(tmp_path, monkeypatch):
    """mamba_ssm's package __init__ imports its CUDA extensions, which an install without the CUDA build
    lacks; the Triton SSD is still found (its module imported with the package's __init__ not run).
    A stand-in package with the same layout: an __init__ that fails as the real one does there."""
    import sys

    import autoshard.runtime.ssd as ssd

    pkg = tmp_path / "mamba_ssm"
    (pkg / "ops" / "triton").mkdir(parents=True)
    (pkg / "utils").mkdir()
    (pkg / "__init__.py").write_text("from mamba_ssm.utils.torch import helper\nimport selective_scan_cuda\n")
    for d in (pkg / "ops", pkg / "ops" / "triton", pkg / "utils"):
        (d / "__init__.py").write_text("")
    (pkg / "utils" / "torch.py").write_text("def helper():\n    return 'helped'\n")
    (pkg / "ops" / "triton" / "ssd_combined.py").write_text(
        "from mamba_ssm.utils.torch import helper\n\ndef mamba_chunk_scan_combined(*a, **k):\n    return helper()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for key in [k for k in sys.modules if k.split(".")[0] == "mamba_ssm"]:
        monkeypatch.delitem(sys.modules, key)
    ssd._mamba_ssm_scan.cache_clear()
    try:
        with pytest.raises(ImportError, match="selective_scan_cuda"):
            import mamba_ssm  # noqa: F401  (the package as such does not import)
        kernel = ssd._mamba_ssm_scan()
        assert kernel is not None and kernel() == "helped"
        # a package whose Triton module is missing too: nothing found, nothing left registered
        (pkg / "ops" / "triton" / "ssd_combined.py").unlink()
        for key in [k for k in sys.modules if k.split(".")[0] == "mamba_ssm"]:
            del sys.modules[key]
        ssd._mamba_ssm_scan.cache_clear()
        assert ssd._mamba_ssm_scan() is None
        assert not [k for k in sys.modules if k.split(".")[0] == "mamba_ssm"]
    finally:
        for key in [k for k in sys.modules if k.split(".")[0] == "mamba_ssm"]:
            del sys.modules[key]
        ssd._mamba_ssm_scan.cache_clear()


# the hybrids' Mamba-2 mixers (other classes than Mamba2Mixer, found by the SSD pattern); Falcon-H1 with its mup
# multipliers exaggerated and each of its norm variants (none: the gate alone; after / before the gate)
_FALCON_MUP = dict(ssm_in_multiplier=1.7, ssm_multipliers=[0.6, 1.9, 0.7, 1.4, 2.3])
HYBRID_MIXERS = {"bamba": {}, "nemotron_h": {}, "granitemoehybrid": {}, "zamba2": {},
                 "falcon_h1": _FALCON_MUP,
                 "falcon_h1-norm": dict(_FALCON_MUP, mamba_rms_norm=True, mamba_norm_before_gate=False),
                 "falcon_h1-norm-first": dict(_FALCON_MUP, mamba_rms_norm=True, mamba_norm_before_gate=True)}


def hybrid_mixer(name: str, seed: int = 0):
    """The first Mamba-2 mixer of the tiny hybrid `name` (tests/models/hybrid_models.py) and its config."""
    from autoshard.models.facts import ssd_mixers
    from tests.models import hybrid_models

    torch.manual_seed(seed)
    model = hybrid_models.build(name.partition("-")[0], **HYBRID_MIXERS[name])
    with torch.no_grad():  # HF initialises D to ones and dt_bias to ones / log-spaced: random, so each shows
        for _, mixer in ssd_mixers(model):
            mixer.D.normal_()
            mixer.dt_bias.normal_()
            if getattr(mixer.norm, "weight", None) is not None:
                mixer.norm.weight.normal_(1.0, 0.5)
    return ssd_mixers(model)[0][1], model.config


@pytest.mark.parametrize("name", list(HYBRID_MIXERS))
def test_hybrid_mixers_are_hfs_forward(name):
    """`mixer_forward` (training) and `cached_mixer_forward` (a prompt, then tokens) on every hybrid's mixer
    class give HF's own torch forward: outputs, the gradients of the input and every mixer parameter, and the
    conv / SSM states left in the cache. L = 40: not a multiple of the chunk (16)."""
    from transformers import DynamicCache

    from autoshard.runtime.ssd import cached_mixer_forward, install_ssd_mixers, mixer_forward

    mixer, config = hybrid_mixer(name)
    x = torch.randn(2, 40, config.hidden_size, generator=torch.Generator().manual_seed(1), requires_grad=True)
    weight = torch.randn(2, 40, config.hidden_size, generator=torch.Generator().manual_seed(2))
    params = [p for _, p in mixer.named_parameters()]
    results = []
    for forward in (type(mixer).forward, mixer_forward):
        out = forward(mixer, x)
        results.append((out, torch.autograd.grad((out * weight).sum(), [x, *params])))
    (want, want_grads), (got, got_grads) = results
    torch.testing.assert_close(got, want, **TOL)
    for pname, a, e in zip(["input", *(n for n, _ in mixer.named_parameters())], got_grads, want_grads):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name} grad {pname}: {m}")
    ours, theirs = DynamicCache(config=config), DynamicCache(config=config)
    steps = [x.detach()[:, :20]] + [x.detach()[:, 20 + i:21 + i] for i in range(3)]
    with torch.no_grad():
        for h in steps:
            torch.testing.assert_close(cached_mixer_forward(mixer, h, ours), type(mixer).forward(mixer, h, cache=theirs),
                                       rtol=1e-4, atol=1e-5, msg=lambda m: f"{name} cached: {m}")
    layer = mixer.layer_idx
    for get in ("get_conv_state", "get_recurrent_state"):
        torch.testing.assert_close(getattr(ours, get)(layer), getattr(theirs, get)(layer), rtol=1e-4, atol=1e-5)
    from tests.models import hybrid_models

    model = hybrid_models.build(name.partition("-")[0], **HYBRID_MIXERS[name])
    from autoshard.models.facts import ssd_mixers

    assert install_ssd_mixers(model) == len(ssd_mixers(model)) > 0


@pytest.mark.parametrize("model_type", ["mamba", "falcon_mamba", "jamba"])
def test_mamba1_mixers_decline_the_fused_whole_mixer_kernel(model_type, monkeypatch):
    """mamba_ssm's `mamba_inner_fn` reads the mixer's weights directly, so tp's shards would skip their all-reduces
    and fp8's linears their float8 GEMMs: the runtime makes every Mamba-1 mixer decline it (runtime/ssd.py
    `install_unfused_scans`), found by its signature, while HF's own forward runs; the model's output is unchanged,
    and the kernel's global is back once the forward is done (Jamba's forward calls none)."""
    import sys

    from autoshard.models.dispatch import scan_mixers, takes_fused
    from autoshard.models.tiny import build_tiny, tiny_config
    from autoshard.runtime.ssd import install_unfused_scans

    model = build_tiny(tiny_config(model_type), seed=0)
    mixer = scan_mixers(model)[0][1]
    where = sys.modules[type(mixer).__module__].__dict__
    name = next(n for n, f in where.items() if callable(f) and not isinstance(f, type) and
                takes_fused(tuple(__import__("inspect").signature(f).parameters)))

    def fused(xz, conv1d_weight, conv1d_bias, x_proj_weight, delta_proj_weight, out_proj_weight, *args, **kwargs):
        raise AssertionError("the fused whole-mixer kernel ran")  # mamba_ssm's signature; it must not be reached

    monkeypatch.setitem(where, name, fused)
    ids = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    model.train()
    from autoshard.models.dispatch import dispatch_points

    if model_type == "jamba":  # its forward calls none (its dt norm sits where the fused kernel has none)
        assert not dispatch_points(mixer, takes_fused, object())
    else:
        with pytest.raises(AssertionError, match="the fused whole-mixer kernel ran"):
            model(ids, use_cache=False)
    with monkeypatch.context() as m:
        m.setitem(where, name, lambda *a, **k: None)
        want = model(ids, use_cache=False).logits
    assert install_unfused_scans(model) == len(scan_mixers(model))
    torch.testing.assert_close(model(ids, use_cache=False).logits, want)
    assert where[name] is fused
