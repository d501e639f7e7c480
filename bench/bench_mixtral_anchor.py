"""Megatron-Core's published Mixtral-8x7B run priced by the cost model (docs/expert_parallel.md).

The run (megatron/core/transformer/moe/README.md, "Reference Best Parallel Mapping"): 64 H100,
seq 4096, TP1 EP8 PP4, VP 8 (8 one-layer chunks per pipeline rank = autoshard's virtual_stages 8),
micro-batch 1, global batch 256, bf16, distributed optimizer (ZeRO-1), dropless all-to-all
dispatch: 468 TFLOP/s per GPU. Nothing here is fitted to it: the rows print what the cost model
predicts for the layout (interleaved v 8 and plain 1F1B; recompute none / full; a few routing
imbalances), and, as a diagnostic, the no-recompute memory with expert activations at the mean
routed rows instead of the dropless worst case the planner bounds them at.

    PYTHONPATH=. python bench/bench_mixtral_anchor.py
"""

from __future__ import annotations

from unittest import mock

from autoshard.commands.common import cost_table_for
from autoshard.hardware import load_hardware
from autoshard.ir import Mesh
from autoshard.passes.cost import moe_cost
from autoshard.passes.cost.compiled import compile_table
from autoshard.passes.cost.cost import estimate, model_flops_per_token
from autoshard.passes.cost.layout import Layout

MEASURED_TFLOPS = 468.0  # Megatron-Core MoE README, Mixtral 8x7B, 64 H100
MESH = Mesh(dp=2, pp=4, tp=1, ep=8)
GLOBAL_BATCH, SEQ = 256, 4096


def _estimate(ct, spec, hw, *, schedule: str, v: int, recompute: str, imbalance: float):
    layout = Layout(mesh=MESH, micro_batch=1, zero=1, recompute=recompute, precision="bf16-mixed",
                    schedule=schedule, virtual_stages=v, moe_imbalance=imbalance)
    return estimate(ct, spec, hw, layout, global_batch=GLOBAL_BATCH, seq_len=SEQ)


def main() -> None:
    hw = load_hardware("h100")
    spec, table = cost_table_for("mixtral-8x7b", spinner=False, kernels=hw.kernels)
    ct = compile_table(table, spec)
    print(f"model FLOPs {model_flops_per_token(ct, SEQ) / 1e9:.1f} GFLOP/token; measured {MEASURED_TFLOPS:.0f} TFLOP/s")
    print("schedule           v  recompute  imbalance  step_s  TFLOP/s  vs_measured  peak_GB  fits  "
          "ep_comm_s  bubble_s")
    for schedule, v in (("interleaved-1f1b", 8), ("1f1b", 1)):
        for recompute in ("none", "full"):
            for imbalance in ((1.0, 1.1, 1.2) if recompute == "none" and v == 8 else (1.0,)):
                e = _estimate(ct, spec, hw, schedule=schedule, v=v, recompute=recompute, imbalance=imbalance)
                tflops = e.mfu * hw.peak_flops / 1e12
                print(f"{schedule:<18} {v:<2} {recompute:<10} {imbalance:<10} {e.step_time_s:<7.3f} {tflops:<8.0f} "
                      f"{100 * (tflops / MEASURED_TFLOPS - 1):<+12.0f} {e.memory_gb:<8.1f} {str(e.fits):<5} "
                      f"{e.time.ep_comm:<10.3f} {e.time.pp_bubble:.3f}")
    with mock.patch.object(moe_cost, "expert_memory_factor", lambda spec, mesh: 1.0):  # diagnostic only
        e = _estimate(ct, spec, hw, schedule="interleaved-1f1b", v=8, recompute="none", imbalance=1.0)
    print(f"diagnostic: expert activations at the mean routed rows (not the dropless bound): peak "
          f"{e.memory_gb:.1f} GB, fits {e.fits}")


if __name__ == "__main__":
    main()
