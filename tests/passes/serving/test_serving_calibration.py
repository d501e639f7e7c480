"""Acceptance (issue 29 item 1): decode priced as serving engines run it, against the two fixed-batch
vLLM runs the issue hands out for calibration (autoshard.models.published.SERVING_CALIBRATION).
Criterion: the whole batch's time (TTFT + (O - 1) TPOT) within 5% of the measured one. The held-out
rows are checked by bench/bench_serving.py, which prints their errors; nothing is fitted to them.
"""

import pytest

from autoshard.hardware import load_hardware
from autoshard.models.published import SERVING_CALIBRATION
from autoshard.passes.serving.inference_cost import ServeLayout, estimate_serving
from autoshard.passes.capture.shapes import build_cost_table


@pytest.mark.parametrize("run", SERVING_CALIBRATION, ids=lambda r: r.id)
def test_given_serving_rows_within_5_percent(run):
    e = estimate_serving(build_cost_table(run.spec), run.spec, load_hardware(run.hardware),
                         ServeLayout(tp=run.tp, batch=run.batch), prompt_len=run.prompt_len, output_len=run.output_len)
    total = e.ttft_s + (run.output_len - 1) * e.tpot_s
    assert total == pytest.approx(run.total_s, rel=0.05), (run.id, total, e.decode.as_dict())
    assert e.decode.fixed > 0 and e.fits  # the kernel floors are priced; the layout that ran fits
