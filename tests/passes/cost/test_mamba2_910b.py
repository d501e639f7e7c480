"""Mamba-2 on the Ascend 910B priced as the target's stack runs it (issue 25 item 4).

The `ascend-910b` profile names its stack (MindSpeed-LLM) and what that stack's Mamba-2 recipe runs beyond a
plan's keys (hardware.StackRecipe: block recompute of 48 layers per stage, sequence parallelism, the reused fp32
copy) and the SSD it runs (the recipe's `kernels`: `ssd_chunk_scan_torch`); `cost.as_stack_runs` gives the layout
such a run has and `DeviceProfile.stack_kernels` the kernels its cost table is built with. The profile's own
`kernels` are what autoshard's runtime runs there (`ssd_chunk_scan`, runtime/ssd.py): its plans are priced so.
Nothing here is fitted: the held-out tables (the paper's Mamba-2 rows, `ascend910b_mamba2*.json` beside the LLaMA
table in shared/reference) are only read by `test_heldout_rows`, which skips where they are not.
"""

import json
import statistics
from dataclasses import replace

import pytest

from autoshard.errors import InvalidConfigError
from autoshard.hardware import StackRecipe, load_hardware
from autoshard.ir import Mesh, Recompute, Stage, even_stages
from autoshard.models.presets import get_spec
from autoshard.passes.capture.kernels import ssd_cost, ssd_torch_cost
from autoshard.passes.capture.shapes import build_cost_table
from autoshard.passes.cost.compiled import compile_table
from autoshard.passes.cost.cost import as_stack_runs, block_segments, estimate
from autoshard.passes.cost.layout import Layout
from autoshard.passes.cost.state import state_bytes

from tests.passes.cost.test_calibration import CANDIDATES

SETUP = dict(global_batch=1024, seq_len=4096)
HW = load_hardware("ascend-910b")


@pytest.fixture(scope="module")
def mamba():
    """mamba2-7b and its table as MindSpeed-LLM runs it (the stack's kernels)."""
    spec = get_spec("mamba2-7b")
    return spec, compile_table(build_cost_table(spec, kernels=HW.stack_kernels("ssd")), spec)


@pytest.fixture(scope="module")
def own(mamba):
    """mamba2-7b's table as autoshard's runtime runs it on the 910B (the profile's kernels)."""
    spec = mamba[0]
    return compile_table(build_cost_table(spec, kernels=HW.kernels), spec)


def priced(ct, spec, mesh, **kw):
    return estimate(ct, spec, HW, as_stack_runs(ct, HW, Layout(mesh=mesh, micro_batch=1, zero=1, **kw)), **SETUP)


def test_the_profile_names_what_its_stack_runs_for_mamba2_and_nothing_for_attention():
    assert HW.stack == "MindSpeed-LLM"
    assert HW.kernels == ("ssd_chunk_scan",)  # autoshard's runtime there: runtime/ssd.py's memory-efficient scan
    assert HW.recipe("ssd") == StackRecipe(mixer="ssd", recompute_layers=48, sequence_parallel=True,
                                           reuse_fp32_param=True, kernels=("ssd_chunk_scan_torch",))
    assert HW.stack_kernels("ssd") == ("ssd_chunk_scan_torch",)  # MindSpeed's StateSpaceProcessor
    assert HW.recipe("attention") is None  # the LLaMA recipe: neither (the calibration's setting)
    assert HW.stack_kernels("attention") == HW.kernels
    for field in ("stack", "recipes"):
        assert "MindSpeed" in HW.source(field)
    assert "runtime/ssd.py" in HW.source("kernels")
    h100 = load_hardware("h100")
    assert h100.recipes is None and h100.stack is None and h100.stack_kernels("ssd") == h100.kernels


def test_llama_on_the_910b_is_priced_as_its_plan_states():
    spec = get_spec("llama-tiny")
    ct = compile_table(build_cost_table(spec), spec)
    lay = Layout(mesh=Mesh(dp=2, tp=2), micro_batch=1, zero=1)
    assert as_stack_runs(ct, HW, lay) == lay


def test_the_run_that_fit_is_priced_to_fit(mamba, own):
    """(4,1,2,1) ran on 60 GB 910Bs (issue 25): as MindSpeed runs it, priced to fit; the plain layout (recompute
    none) on MindSpeed's SSD keeps far more and does not. An autoshard plan of the same layout runs runtime/ssd.py's
    scan, which keeps the inputs and chunk states only: less than the torch scan, more than the recipe's recompute."""
    spec, ct = mamba
    mesh = Mesh(dp=4, tp=2)
    run = priced(ct, spec, mesh)
    assert run.layout.recompute_layers == 48 and run.layout.reuse_fp32_param and run.layout.sequence_parallel
    assert run.fits and 50 < run.memory_gb <= HW.memory_gb
    plain = estimate(ct, spec, HW, Layout(mesh=mesh, micro_batch=1, zero=1), **SETUP)
    assert not plain.fits and plain.memory.activations > 3 * run.memory.activations
    plan = estimate(own, spec, HW, Layout(mesh=mesh, micro_batch=1, zero=1), **SETUP)
    assert run.memory.activations < plan.memory.activations < plain.memory.activations
    # the difference per layer is the two SSD rules' saved bytes at the rank's heads (tp 2) and the padded length
    local = replace(spec, heads=spec.heads // 2, groups=max(1, spec.groups // 2))
    per_layer = ssd_torch_cost(local, 1, 4096).state_bytes - ssd_cost(local, 1, 4096).state_bytes
    assert plain.memory.activations - plan.memory.activations == pytest.approx(spec.layers * per_layer, rel=0.02)


def test_reused_fp32_copy_saves_two_bytes_per_parameter_over_the_optimizer_group():
    """MindSpeed's reuse-fp32-param doc: sizeof(bf16) x parameters / dp with the distributed optimizer,
    x parameters without it; nothing under fp32 (no separate master)."""
    params = 3.0e9
    for zero, group in ((0, 1), (1, 8), (2, 8)):
        lay = Layout(mesh=Mesh(dp=4, cp=2), zero=zero, precision="bf16-mixed")
        saved = state_bytes(params, lay).optimizer - state_bytes(params, replace(lay, reuse_fp32_param=True)).optimizer
        assert saved == pytest.approx(2 * params / group)
    lay = Layout(mesh=Mesh(dp=4), zero=1, precision="fp32")
    assert state_bytes(params, lay) == state_bytes(params, replace(lay, reuse_fp32_param=True))
    with pytest.raises(InvalidConfigError, match="reuse_fp32_param with zero 3"):
        Layout(mesh=Mesh(dp=4), zero=3, reuse_fp32_param=True)


def test_block_recompute_is_full_for_its_layers_and_the_stage_level_for_the_rest(mamba):
    spec, ct = mamba
    st = even_stages(spec.layers, 2)[0]
    first, rest = block_segments(st, 10)
    assert (first[0].layers, first[1], first[0].embed) == (10, Recompute.FULL, False)
    assert (rest[0].layers, rest[1], rest[0].embed) == (st.layers - 10, Recompute.NONE, st.embed)
    assert block_segments(st, 0) == ((st, Recompute.NONE),)
    assert block_segments(replace(st, recompute=Recompute.FULL), 10) == ((replace(st, recompute=Recompute.FULL),
                                                                         Recompute.FULL),)
    base = Layout(mesh=Mesh(dp=4, pp=2), micro_batch=1, zero=1)
    none, full = (estimate(ct, spec, HW, replace(base, recompute=r), **SETUP) for r in (Recompute.NONE, Recompute.FULL))
    # as many layers as a stage holds, or more: FULL recompute, in time and memory
    every = estimate(ct, spec, HW, replace(base, recompute_layers=spec.layers), **SETUP)
    assert every.memory.activations == pytest.approx(full.memory.activations)
    assert every.step_time_s == pytest.approx(full.step_time_s)
    # k of the stage's 32 layers: the activations k / 32 of the way from none to full
    half = estimate(ct, spec, HW, replace(base, recompute_layers=16), **SETUP)
    act = lambda e: e.memory.activations  # noqa: E731
    assert act(half) == pytest.approx(act(full) + (act(none) - act(full)) / 2, rel=1e-9)
    assert full.time.recompute > half.time.recompute > 0 == none.time.recompute


def test_a_mixed_stack_is_refused_by_name_where_the_stack_has_recipes():
    class Mixed:  # the one thing as_stack_runs reads of a mixed table before refusing
        kinds = (object(), object())
        spec = get_spec("mamba2-tiny")

    with pytest.raises(InvalidConfigError, match="several layer kinds.*MindSpeed-LLM.*ssd"):
        as_stack_runs(Mixed, HW, Layout(mesh=Mesh(dp=2)))
    assert as_stack_runs(Mixed, load_hardware("h100"), Layout(mesh=Mesh(dp=2))) == Layout(mesh=Mesh(dp=2))


def _heldout():
    for folder in dict.fromkeys(p.parent for p in CANDIDATES):
        for path in sorted(folder.glob("*mamba*.json")):
            return json.loads(path.read_text())
    pytest.skip("held-out Mamba-2 910B table not found (*mamba*.json beside "
                f"{', '.join(str(p) for p in CANDIDATES)})")


def _measured_gb(row):
    """The row's measured memory (GB), None for a layout that did not run (no figure, or marked OOM)."""
    value = row.get("mem_gb", row.get("memory_gb"))
    return value if isinstance(value, (int, float)) and not row.get("oom") else None


def test_heldout_rows(mamba):
    """The paper's Mamba-2 rows, priced as MindSpeed runs them: median memory error at most 20% (the device
    average, as the paper reports and the LLaMA check compares), every layout that ran priced to fit."""
    table = _heldout()
    setup = table.get("setup", {})
    spec = get_spec(setup.get("model", table.get("model", "mamba2-7b")))
    ct = mamba[1] if spec.name == "mamba2-7b" else compile_table(
        build_cost_table(spec, kernels=HW.stack_kernels(spec.mixer.value)), spec)
    errors, unfit = [], []
    for r in table["rows"]:
        mesh = Mesh(dp=r["dp"], pp=r["pp"], tp=r["tp"], cp=r["cp"])
        layout = as_stack_runs(ct, HW, Layout(mesh=mesh, micro_batch=setup.get("micro_batch", 1), zero=1))
        e = estimate(ct, spec, HW, layout, global_batch=setup.get("global_batch", 1024),
                     seq_len=setup.get("seq_len", 4096))
        measured = _measured_gb(r)
        if measured is not None:  # it ran
            errors.append(abs(e.mean_memory_gb - measured) / measured)
            if not e.fits:
                unfit.append((mesh, round(e.memory_gb, 1)))
    assert errors, "no row of the held-out table has a measured memory"
    assert statistics.median(errors) <= 0.20, f"median memory error {statistics.median(errors):.1%}"
    assert not unfit, f"layouts that ran priced not to fit: {unfit}"


def test_stage_input_given_whole_stays_whole():
    st = Stage(first_layer=0, end_layer=4, embed=True, head=True)
    assert block_segments(st, 4)[0][0].layers == 4 and len(block_segments(st, 4)) == 2
    assert block_segments(st, 4)[1][0].layers == 0 and block_segments(st, 4)[1][0].head


def test_a_json_profile_carries_its_stack_and_a_bad_recipe_is_named(tmp_path):
    path = tmp_path / "npu.json"
    path.write_text(json.dumps(HW.to_json()))
    assert load_hardware(path) == HW
    for recipes, message in (([{"mixer": "ssd", "recompute": 4}], "unexpected keyword argument 'recompute'.*the "
                                                                    "keys are mixer"),
                             ([{"mixer": "mamba"}], "'mixer' must be one of attention, ssd"),
                             ([{"mixer": "ssd"}, {"mixer": "ssd"}], r"gives mixer\(s\) \['ssd'\] twice"),
                             ([{"mixer": "ssd", "recompute_layers": -1}], "recompute_layers"),
                             ([{"mixer": "ssd", "kernels": ["flash_ssd"]}], r"stack recipe 'ssd': unknown fused "
                                                                            r"kernel\(s\) \['flash_ssd'\]"),
                             ([{"mixer": "ssd", "kernels": "ssd_chunk_scan"}], "'kernels' must be a list")):
        path.write_text(json.dumps(HW.to_json() | {"recipes": recipes}))
        with pytest.raises(InvalidConfigError, match=message):
            load_hardware(path)
    path.write_text(json.dumps(HW.to_json() | {"stack": None}))
    with pytest.raises(InvalidConfigError, match="name it in field 'stack'"):
        load_hardware(path)


RECIPE_ARGS = ("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 --sequence-parallel "
               "--micro-batch-size 1 --global-batch-size 1024 --seq-length 4096 --recompute-granularity full "
               "--recompute-method block --recompute-num-layers 48 --use-distributed-optimizer --reuse-fp32-param "
               "--bf16")


def test_a_mindspeed_command_line_states_the_recipe_and_prices_as_the_stack_runs(mamba):
    """`autoshard price --from-megatron` of MindSpeed's flags: the same figures as `as_stack_runs` (planner.predict
    prices block recompute by estimate alone), and the arguments read back to the same run."""
    from autoshard.engines import megatron
    from autoshard.engines.training_run import TrainingRun, price

    spec, ct = mamba
    parsed = megatron.parse(RECIPE_ARGS, spec=spec, devices=8)
    run = parsed.run
    assert (run.recompute_layers, run.reuse_fp32_param, run.recompute) == (48, True, (Recompute.NONE,))
    assert "block (48 layers per stage) + reused fp32 copy" in run.describe()
    got = price(ct, HW, spec, run, global_batch=1024, seq_len=4096)
    want = priced(ct, spec, Mesh(dp=4, tp=2))
    assert got["memory_gb"] == pytest.approx(want.memory_gb) and got["fits"] == want.fits is True
    assert got["step_time_s"] == pytest.approx(want.step_time_s)
    assert got["stage_memory_gb"] == pytest.approx(list(want.stage_memory_gb))
    words = megatron.arguments(spec, run, global_batch=1024, seq_len=4096)
    assert {"--recompute-method block", "--recompute-num-layers 48", "--reuse-fp32-param"} <= set(words)
    assert megatron.parse(" ".join(words), spec=spec, devices=8).run == run
    for bad, message in ((RECIPE_ARGS.replace(" --recompute-num-layers 48", ""), "block needs --recompute-num-layers"),
                         (RECIPE_ARGS.replace("--use-distributed-optimizer", "--use-megatron-fsdp"),
                          "--reuse-fp32-param with --use-megatron-fsdp")):
        with pytest.raises(InvalidConfigError, match=message):
            megatron.parse(bad, spec=spec, devices=8)
    with pytest.raises(InvalidConfigError, match="block recompute of 4 layers per stage with recompute full"):
        TrainingRun(mesh=Mesh(dp=8), recompute=(Recompute.FULL,), recompute_layers=4)


def test_price_from_megatron_prices_the_stacks_kernels_and_the_best_plan_the_runtimes(mamba, own, capsys):
    """`autoshard price --from-megatron` on the 910B: the command line is a MindSpeed-LLM run, so its cost table
    holds the recipe's kernels (the torch SSD); the same flags on the runtime's table would price less memory."""
    from autoshard.cli import main

    spec, ct = mamba
    argv = ["price", "--hardware", "ascend-910b", "--model", "mamba2-7b", "--devices", "8", "--from-megatron",
            RECIPE_ARGS, "--no-best", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    want = priced(ct, spec, Mesh(dp=4, tp=2))
    assert out["predicted"]["memory_gb"] == pytest.approx(want.memory_gb, rel=1e-9)
    assert "MindSpeed-LLM's kernels (ssd_chunk_scan_torch)" in out["source"]
    runtime = estimate(own, spec, HW, as_stack_runs(own, HW, Layout(mesh=Mesh(dp=4, tp=2), micro_batch=1, zero=1)),
                       **SETUP)
    assert runtime.memory_gb < want.memory_gb - 1


def test_block_recompute_counts_per_model_chunk_under_virtual_stages(mamba):
    """With v model chunks per rank, Megatron's block recompute reruns the first k layers of EACH chunk (each chunk
    is a TransformerBlock of its own: megatron/core/transformer/transformer_block.py `_checkpointed_forward`), so a
    rank of 32 layers in two chunks of 16 recomputes 2k of them: k = 16 is full recompute, k = 8 half of it; and a
    Megatron command line saying so is priced so and read back to the same flags."""
    from autoshard.engines import megatron
    from autoshard.engines.training_run import price
    from autoshard.ir import Schedule

    spec, ct = mamba  # 64 layers: pp 2 x v 2 = chunks of 16
    st = even_stages(spec.layers, 2)[0]
    segs = block_segments(st, 8, (16, 16))
    assert [(s.layers, lv) for s, lv in segs] == [(8, Recompute.FULL), (8, Recompute.NONE)] * 2
    assert [s.embed for s, _ in segs] == [False, True, False, False] and segs[0][0].end_layer == segs[1][0].first_layer
    base = Layout(mesh=Mesh(dp=4, pp=2), micro_batch=1, zero=1, schedule=Schedule.INTERLEAVED_1F1B, virtual_stages=2)
    none, full = (estimate(ct, spec, HW, replace(base, recompute=r), **SETUP) for r in (Recompute.NONE, Recompute.FULL))
    every = estimate(ct, spec, HW, replace(base, recompute_layers=16), **SETUP)  # a chunk's 16: every layer
    assert every.memory.activations == pytest.approx(full.memory.activations)
    assert every.step_time_s == pytest.approx(full.step_time_s)
    half = estimate(ct, spec, HW, replace(base, recompute_layers=8), **SETUP)
    assert half.memory.activations == pytest.approx((none.memory.activations + full.memory.activations) / 2, rel=1e-9)
    assert half.time.recompute == pytest.approx(full.time.recompute / 2, rel=1e-9)
    args = ("--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 16 --micro-batch-size 1 "
            "--global-batch-size 1024 --seq-length 4096 --recompute-granularity full --recompute-method block "
            "--recompute-num-layers 8 --use-distributed-optimizer --bf16")
    run = megatron.parse(args, spec=spec, devices=8).run
    assert (run.virtual_stages, run.recompute_layers) == (2, 8) and "block (8 layers per model chunk)" in run.describe()
    got = price(ct, HW, spec, run, global_batch=1024, seq_len=4096)
    assert got["step_time_s"] == pytest.approx(half.step_time_s) and got["memory_gb"] == pytest.approx(half.memory_gb)
    words = megatron.arguments(spec, run, global_batch=1024, seq_len=4096)
    assert {"--recompute-method block", "--recompute-num-layers 8", "--num-layers-per-virtual-pipeline-stage 16"} <= set(words)
    assert megatron.parse(" ".join(words), spec=spec, devices=8).run == run
