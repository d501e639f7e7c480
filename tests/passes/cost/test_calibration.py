"""Acceptance: the cost model against the paper's measured LLaMA-7B table on 8x Ascend 910B.

arXiv 2602.09109, case study: global batch 1024, seq 4096, micro-batch 1, ZeRO-1, no recompute.
Criteria (issue 3): predicted step times order the measured configurations correctly on >= 90%
of pairs, the best predicted layout of the whole sweep is the measured best (4,2,1,1), and every
predicted memory figure is within 20% of the measured one. The paper reports memory averaged over
the devices; the comparison uses the model's device average (`mean_memory_gb`), the peak device
is printed beside it. The table of predicted vs measured is printed (pytest -s) and in
docs/cost_model.md.
"""

import itertools
import json
from pathlib import Path

import pytest

from autoshard.hardware import load_hardware
from autoshard.ir import Mesh, Recompute
from autoshard.models.presets import get_spec
from autoshard.passes.cost.compiled import compile_table
from autoshard.passes.cost.cost import estimate
from autoshard.passes.cost.layout import Layout
from autoshard.rules.validity import valid_meshes

ROOT = Path(__file__).resolve().parents[3]  # the repository (tests/passes/cost/ is three below it)
CANDIDATES = (ROOT.parent / "shared" / "reference" / "ascend910b_llama7b.json",
              ROOT / "shared" / "reference" / "ascend910b_llama7b.json")


@pytest.fixture(scope="module")
def reference():
    for path in CANDIDATES:
        if path.is_file():
            return json.loads(path.read_text())
    pytest.skip(f"reference table not found (looked in {', '.join(map(str, CANDIDATES))})")


@pytest.fixture(scope="module")
def predicted(reference):
    from autoshard.passes.capture.shapes import build_cost_table

    setup = reference["setup"]
    spec = get_spec("llama-7b")
    hw = load_hardware(setup["hardware"])
    ct = compile_table(build_cost_table(spec), spec)
    kw = dict(global_batch=setup["global_batch"], seq_len=setup["seq_len"])

    def run(mesh):
        layout = Layout(mesh=mesh, micro_batch=setup["micro_batch"], zero=1, recompute=Recompute.NONE)
        return estimate(ct, spec, hw, layout, **kw)

    rows = [(r, run(Mesh(dp=r["dp"], pp=r["pp"], tp=r["tp"], cp=r["cp"]))) for r in reference["rows"]]
    sweep = [run(m) for m in valid_meshes(spec, setup["devices"], micro_batch=setup["micro_batch"], **kw)]
    print("\n dp pp tp cp | step s pred/meas | mem GB avg pred/meas (peak) | MFU % pred/meas")
    for r, e in rows:
        print(f" {r['dp']:2} {r['pp']:2} {r['tp']:2} {r['cp']:2} | {e.step_time_s:6.1f} / {r['step_s']:6.1f} | "
              f"{e.mean_memory_gb:5.1f} / {r['mem_gb']:5.1f} ({e.memory_gb:5.1f}) | "
              f"{100 * e.mfu:5.1f} / {r['mfu']:5.1f}")
    return rows, sweep


def test_step_times_order_the_measured_configurations(predicted):
    rows, _ = predicted
    pairs = list(itertools.combinations(rows, 2))
    agree = sum((a["step_s"] < b["step_s"]) == (ea.step_time_s < eb.step_time_s) for (a, ea), (b, eb) in pairs)
    assert agree / len(pairs) >= 0.9, f"only {agree} of {len(pairs)} pairs ordered like the measurements"


def test_best_predicted_layout_is_the_measured_best(predicted):
    _, sweep = predicted
    best = min((e for e in sweep if e.fits), key=lambda e: e.step_time_s)
    m = best.layout.mesh
    assert (m.dp, m.pp, m.tp, m.cp, m.ep) == (4, 2, 1, 1, 1)


def test_memory_within_20_percent(predicted):
    rows, _ = predicted
    for r, e in rows:
        assert e.mean_memory_gb == pytest.approx(r["mem_gb"], rel=0.2), (r, e.mean_memory_gb)


def test_step_times_within_35_percent_and_mfu_convention(predicted, reference):
    rows, _ = predicted
    setup = reference["setup"]
    for r, e in rows:
        assert e.step_time_s == pytest.approx(r["step_s"], rel=0.35), r
        # the paper's MFU is its convention applied to its own step time: check ours is the same formula
        assert 100 * e.mfu * e.step_time_s / r["step_s"] == pytest.approx(r["mfu"], rel=0.01)
    assert setup["devices"] == 8
