"""Mamba-2 memory on the Ascend 910B: what the cost model prices, per term, against what MindSpeed-LLM runs.

  python bench/bench_mamba2_910b.py            mamba2-7b on 8 x 910B (the paper's setup: global batch 1024,
                                               seq 4096, micro-batch 1, ZeRO-1) and the two public MindSpeed rows
  python bench/bench_mamba2_910b.py --quick    the (4,1,2,1) layout only (no trace of the two public configs)

Three prices of every layout, each from the cost model's own functions (passes/cost/cost.py `estimate`):

* `fused`    the `ascend-910b` profile: the SSD as autoshard's runtime/ssd.py keeps it (`ssd_chunk_scan`);
* `torch`    the SSD as MindSpeed-LLM's StateSpaceProcessor keeps it under autograd
             (`ssd_chunk_scan_torch`, passes/capture/kernels.py), no recompute;
* `recipe`   the same SSD under the settings of MindSpeed-LLM's 64-layer Mamba-2 recipe
             (examples/mcore/mamba2/pretrain_mamba2_2.7b_4k_ptd.sh before its removal in f35bfccc):
             `--recompute-granularity full --recompute-method block --recompute-num-layers 48` (the first 48
             layers of each pipeline stage keep only their input), `--sequence-parallel`, and
             `--reuse-fp32-param` with the distributed optimizer (MindSpeed docs/zh/features/reuse-fp32-param.md:
             saves 2 B x parameters / dp). autoshard plans have neither block recompute nor the reused fp32
             copy: `recipe` composes them here from the NONE and FULL estimates, it is not a plan.

The public check (no held-out row is read here): MindSpeed-LLM's own CI baselines on 8 NPUs
(tests/st/baseline_results/mamba2_8b_tp4_pp1_cp2_recompute_4k_ptd.json and
tests/pipeline/st/baseline/mamba2_2.7b_tp1_pp1.json at commit 3b457672; "memo info", MiB), priced with the
settings of their scripts.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from autoshard.hardware import load_hardware
from autoshard.ir import Mesh, Recompute
from autoshard.models.presets import get_spec
from autoshard.passes.capture.shapes import build_cost_table
from autoshard.passes.cost.cost import Layout, compile_table, estimate
from autoshard.rules.validity import valid_meshes

GB = 1e9
MIB = 2**20

# (name, spec changes from mamba2-7b, mesh, micro-batch, global batch, layers recomputed per stage,
#  measured allocated after the step (state) MiB, measured max allocated MiB)
PUBLIC = (
    ("MindSpeed CI mamba2-8b tp4 cp2 mb2 (recompute 1 of 56)",
     dict(name="mamba2-8b-mindspeed", vocab=256000, layers=56, chunk=128), Mesh(tp=4, cp=2), 2, 8, 1,
     21636.57, 48114.83),
    ("MindSpeed CI mamba2-2.7b dp4 cp2 mb1 (recompute 48 of 64)",
     dict(name="mamba2-2.7b-mindspeed", vocab=256000, hidden=2560, heads=80, groups=1, layers=64, chunk=256,
          tied=True), Mesh(dp=4, cp=2), 1, 8, 48, 22327.53, 37752.81),
)


def price(ct, spec, hw, mesh, *, micro_batch, global_batch, seq_len, recompute, sp=False):
    layout = Layout(mesh=mesh, micro_batch=micro_batch, zero=1, recompute=recompute, sequence_parallel=sp)
    return estimate(ct, spec, hw, layout, global_batch=global_batch, seq_len=seq_len)


def recipe(ct, spec, hw, mesh, *, micro_batch, global_batch, seq_len, recompute_layers):
    """Peak-stage memory terms (GB) of MindSpeed's recipe: block recompute of `recompute_layers` layers of each
    stage, sequence parallelism, the reused fp32 copy (2 B per parameter / dp), composed from two estimates."""
    kw = dict(micro_batch=micro_batch, global_batch=global_batch, seq_len=seq_len, sp=mesh.tp > 1)
    none, full = (price(ct, spec, hw, mesh, recompute=r, **kw) for r in (Recompute.NONE, Recompute.FULL))
    per_stage = spec.layers / mesh.pp
    kept = max(per_stage - recompute_layers, 0) / per_stage  # share of the stage's layers that keep everything
    act = full.memory.activations + (none.memory.activations - full.memory.activations) * kept
    reuse = none.memory.weights / (mesh.dp * mesh.cp)  # 2 B x params / dp: the bf16 copy folded into the fp32 one
    m = none.memory
    terms = dict(weights=m.weights, grads=m.grads, optimizer=m.optimizer - reuse, activations=act,
                 logits=m.logits, buffers=m.buffers)
    return {k: v / GB for k, v in terms.items()}


def terms(e) -> dict:
    m = e.memory
    return {k: getattr(m, k) / GB for k in ("weights", "grads", "optimizer", "activations", "logits", "buffers")}


def show(label, t: dict) -> str:
    return f"{label:7s} " + " ".join(f"{k[:5]} {v:6.2f}" for k, v in t.items()) + f" | total {sum(t.values()):6.1f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the (4,1,2,1) layout only")
    args = ap.parse_args(argv)
    old = load_hardware("ascend-910b")  # the profile: the SSD as autoshard's runtime/ssd.py keeps it
    hw = replace(old, kernels=("ssd_chunk_scan_torch",))  # MindSpeed-LLM's StateSpaceProcessor
    spec = get_spec("mamba2-7b")
    setup = dict(micro_batch=1, global_batch=1024, seq_len=4096)
    tables = {h.name + str(h.kernels): compile_table(build_cost_table(spec, kernels=h.kernels), spec) for h in (old, hw)}
    meshes = [Mesh(dp=4, tp=2)] if args.quick else valid_meshes(spec, 8, micro_batch=1, global_batch=1024,
                                                                   seq_len=4096)
    cap = hw.memory_bytes / GB
    print(f"mamba2-7b on 8 x ascend-910b, global batch 1024, seq 4096, micro-batch 1, ZeRO-1; peak stage, GB "
          f"(fits: <= {cap:.0f})")
    for mesh in meshes:
        print(f"\n(dp {mesh.dp}, pp {mesh.pp}, tp {mesh.tp}, cp {mesh.cp})")
        for label, h in (("fused", old), ("torch", hw)):
            e = price(tables[h.name + str(h.kernels)], spec, h, mesh, recompute=Recompute.NONE, **setup)
            print(show(label, terms(e)))
        r = recipe(tables[hw.name + str(hw.kernels)], spec, hw, mesh, recompute_layers=48, **setup)
        print(show("recipe", r) + ("  fits" if sum(r.values()) <= cap else "  does not fit"))
    if args.quick:
        return 0
    print("\nPublic MindSpeed-LLM rows (8 NPUs, seq 4096), priced with their scripts' settings:")
    for label, changes, mesh, mb, gb, k, state_mib, peak_mib in PUBLIC:
        s = replace(spec, **changes)
        ct = compile_table(build_cost_table(s, kernels=hw.kernels), s)
        r = recipe(ct, s, hw, mesh, micro_batch=mb, global_batch=gb, seq_len=4096, recompute_layers=k)
        state = r["weights"] + r["grads"] + r["optimizer"]
        print(f"{label}: state {state:5.2f} GB predicted / {state_mib * MIB / GB:5.2f} measured; peak "
              f"{sum(r.values()):5.2f} predicted / {peak_mib * MIB / GB:5.2f} measured (max allocated)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
