"""`autoshard sweep` end to end on the real (captured) tiny LLaMA and Mamba-2 cost tables."""

import json

import pytest

from autoshard.cli import main

BASE = ["sweep", "--model", "llama-tiny", "--hardware", "h100", "--devices", "8", "--global-batch", "16",
        "--seq-len", "64"]
KEYS = {"dp", "pp", "tp", "cp", "ep", "zero", "recompute", "micro_batch", "step_time_s", "tokens_per_s",
        "memory_gb", "mfu", "fits"}


def run_json(capsys, argv):
    assert main(argv + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_lists_every_valid_layout_best_first(capsys):
    rows = run_json(capsys, BASE + ["--zero", "1", "--recompute", "none"])
    assert rows and all(KEYS <= set(r) for r in rows)
    assert all(r["dp"] * r["pp"] * r["tp"] * r["cp"] * r["ep"] == 8 for r in rows)
    assert all(r["zero"] == 1 and r["recompute"] == "none" and r["micro_batch"] == 1 for r in rows)
    assert len({(r["dp"], r["pp"], r["tp"], r["cp"]) for r in rows}) == len(rows)
    # llama-tiny: 4 heads, 2 KV heads, 4 layers: tp <= 4, pp <= 4
    assert max(r["tp"] for r in rows) == 4 and max(r["pp"] for r in rows) == 4
    key = [(not r["fits"], r["step_time_s"]) for r in rows]
    assert key == sorted(key)
    best = rows[0]
    assert best["tokens_per_s"] == pytest.approx(16 * 64 / best["step_time_s"])
    assert 0 < best["mfu"] < 1


def test_zero2_and_3_only_without_pipeline(capsys):
    # ZeRO-2/3 reduce-scatter gradients every micro-batch: no pipeline schedule (validity.zero_violation)
    for zero in ("2", "3"):
        rows = run_json(capsys, BASE + ["--zero", zero, "--recompute", "none"])
        assert rows and all(r["pp"] == 1 and r["zero"] == int(zero) for r in rows)
    auto = run_json(capsys, BASE + ["--recompute", "none"])
    assert any(r["pp"] > 1 for r in auto) and all(r["zero"] < 2 for r in auto if r["pp"] > 1)


def test_auto_options_and_non_fitting_layouts(capsys, tmp_path):
    hw = tmp_path / "small.json"
    from autoshard.hardware import load_hardware

    data = load_hardware("h100").to_json()
    data.update(name="tiny-mem", memory_bytes=1e5)
    hw.write_text(json.dumps(data))
    rows = run_json(capsys, BASE[:4] + [str(hw)] + BASE[5:])
    assert rows and not any(r["fits"] for r in rows)
    assert all(r["peak_memory_gb"] > 1e5 / 1e9 for r in rows)
    assert {r["zero"] for r in rows} <= {0, 1, 2, 3}
    assert main(BASE[:4] + [str(hw)] + BASE[5:]) == 0  # the table: megabytes, not "0.0 GB" (it printed that)
    out = capsys.readouterr().out
    assert "0.0 GB" not in out and "0 GB" not in out and "(100 kB)" in out
    assert "no layout fits in 100 kB; the smallest needs" in out and " MB" in out


def test_memory_and_seconds_text():
    from autoshard.commands.common import memory_text, seconds_text

    assert [memory_text(x) for x in (49.6, 1.0, 0.782, 7.82e-4, 3.5e-6, 0)] == [
        "49.6 GB", "1.0 GB", "782 MB", "782 kB", "3.5 kB", "0 B"]
    assert [seconds_text(x) for x in (107.72, 1.0, 0.000166)] == ["107.72", "1.00", "0.000166"]


def test_table_and_plot(capsys, tmp_path):
    png = tmp_path / "sweep.png"
    assert main(BASE + ["--zero", "1", "--recompute", "none", "--plot", str(png), "--limit", "5"]) == 0
    out = capsys.readouterr().out
    assert "best first" in out and "MFU" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_mamba2(capsys):
    rows = run_json(capsys, ["sweep", "--model", "mamba2-tiny", "--hardware", "ascend-910b", "--devices", "4",
                             "--global-batch", "8", "--seq-len", "64", "--zero", "0", "--recompute", "none"])
    # mamba2-tiny: 8 heads, 2 groups: tp 4 keeps the groups whole (issue 11); CP priced by state passing
    assert max(r["tp"] for r in rows) == 4
    cp = [r for r in rows if r["cp"] > 1]
    assert cp and all(r["time_breakdown_s"]["cp_comm"] > 0 for r in cp)


@pytest.mark.parametrize("argv, needle", [
    (["--hardware", "tpu-v9"], "known profiles"),
    (["--devices", "7", "--global-batch", "4"], "no valid"),
    (["--global-batch", "5", "--micro-batch", "2"], "micro-batch"),
])
def test_bad_input_one_line_exit_2(capsys, argv, needle):
    args = list(BASE)
    for flag, value in zip(argv[::2], argv[1::2]):
        if flag in args:
            args[args.index(flag) + 1] = value
        else:
            args += [flag, value]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1


def test_devices_must_be_positive(capsys):
    with pytest.raises(SystemExit) as e:
        main([a if a != "8" else "0" for a in BASE])
    assert e.value.code == 2
    assert "positive" in capsys.readouterr().err


def test_sequence_parallel(capsys):
    """--sequence-parallel on: every tp > 1 layout with SP (lower memory), tp = 1 ones without; auto
    keeps per layout the better of the two."""
    argv = BASE + ["--zero", "1", "--recompute", "none"]
    off = {(r["dp"], r["pp"], r["tp"], r["cp"]): r for r in run_json(capsys, argv)}
    on = {(r["dp"], r["pp"], r["tp"], r["cp"]): r for r in run_json(capsys, argv + ["--sequence-parallel", "on"])}
    assert on.keys() == off.keys()
    for key, row in on.items():
        assert row["sequence_parallel"] == (key[2] > 1) and not off[key]["sequence_parallel"]
        if key[2] > 1:
            assert row["peak_memory_gb"] < off[key]["peak_memory_gb"]
    auto = run_json(capsys, argv + ["--sequence-parallel", "auto"])
    assert len(auto) == len(on)


def test_sequence_parallel_per_stage(capsys, tmp_path):
    """--sequence-parallel auto also chooses it per pipeline stage. llama-tiny on 4 h100s cut to 9.9 MB
    (global batch 4, seq 1024, micro-batch 2): pp2 x tp2 runs SP on stage 0 only (it holds the most
    micro-batches in flight and needs SP's smaller activations; stage 1 fits without and runs faster so),
    faster than either uniform choice. The row is the best of every per-stage choice of its ZeRO level
    and recompute (a brute force over the planner's tables), and a plan the one validator passes."""
    from dataclasses import replace

    from autoshard.commands.sweep import stage_mix, sweep
    from autoshard.hardware import load_hardware
    from autoshard.ir import Mesh, Plan, Recompute
    from autoshard.models.presets import get_spec
    from autoshard.passes.cost import cost
    from autoshard.passes.cost.compiled import compile_table
    from autoshard.rules.validity import check_plan
    from autoshard.passes.capture.shapes import build_cost_table
    from autoshard.passes.solve.solve_model import Assignment, evaluate, mesh_problem

    spec, hw = get_spec("llama-tiny"), replace(load_hardware("h100"), memory_bytes=9.9e6)
    kw = dict(global_batch=4, seq_len=1024)
    ct = compile_table(build_cost_table(spec), spec)
    rows = sweep(spec, ct, hw, devices=4, micro_batch=2, zeros=(0, 1), recomputes=tuple(Recompute),
                 sequence_parallel=(False, True), **kw)
    row = next(e for e in rows if e.layout.mesh == Mesh(pp=2, tp=2))
    assert row.stage_sequence_parallel == (True, False) and row.fits
    lay = row.layout
    uniform = [cost.estimate(ct, spec, hw, replace(lay, sequence_parallel=sp), **kw) for sp in (False, True)]
    assert all(row.step_time_s < u.step_time_s * (1 - 1e-3) for u in uniform if u.fits)
    problem = mesh_problem(ct, hw, replace(lay, stage_choices=("sequence_parallel",)), recomputes=(lay.recompute,),
                           **kw)
    evs = [evaluate(problem, Assignment(layers=(2, 2), recompute=(lay.recompute,) * 2, variant=v))
           for v in ((0, 0), (0, 1), (1, 0), (1, 1))]
    best = min((e for e in evs if e.peak_bytes <= hw.memory_bytes), key=lambda e: e.step_s)
    assert row.step_time_s == pytest.approx(best.step_s, rel=1e-12)
    assert stage_mix(ct, hw, lay, dict(zip((False, True), uniform)), **kw) == row
    check_plan(Plan(model=spec.name, fingerprint="x", hardware=hw.name, devices=4, mesh=lay.mesh, micro_batch=2,
                    zero=lay.zero, recompute=lay.recompute, sequence_parallel=list(row.stage_sequence_parallel),
                    **kw), spec, world_size=4)
    # the command: JSON lists each stage's choice, the table shows it
    data = load_hardware("h100").to_json()
    data.update(name="h100-9.9MB", memory_bytes=9.9e6)
    (tmp_path / "hw.json").write_text(json.dumps(data))
    argv = ["sweep", "--model", "llama-tiny", "--hardware", str(tmp_path / "hw.json"), "--devices", "4",
            "--global-batch", "4", "--seq-len", "1024", "--micro-batch", "2", "--sequence-parallel", "auto"]
    got = next(r for r in run_json(capsys, argv) if (r["pp"], r["tp"]) == (2, 2))
    assert got["sequence_parallel"] == [True, False]
    assert main(argv) == 0 and "on/-" in capsys.readouterr().out


def test_every_sweep_row_is_a_plan_the_runtime_runs():
    """What sweep lists (per-stage sequence parallelism included) passes the one validator, as the plan it
    names: tiny LLaMA and Mamba-2, several device counts, global batch 4, every ZeRO level and recompute,
    full memory and cut to 9.9 MB (where a per-stage row appears)."""
    from dataclasses import replace

    from autoshard.commands.sweep import sweep
    from autoshard.hardware import load_hardware
    from autoshard.ir import Plan, Recompute
    from autoshard.models.presets import get_spec
    from autoshard.passes.cost.compiled import compile_table
    from autoshard.rules.validity import check_plan
    from autoshard.passes.capture.shapes import build_cost_table

    h100 = load_hardware("h100")
    mixed = 0
    for preset, devices, seq_len in (("llama-tiny", 4, 1024), ("llama-tiny", 8, 256), ("mamba2-tiny", 4, 512)):
        spec = get_spec(preset)
        ct = compile_table(build_cost_table(spec), spec)
        for hw in (h100, replace(h100, memory_bytes=9.9e6)):
            for mb in (1, 2):
                rows = sweep(spec, ct, hw, devices=devices, global_batch=4, seq_len=seq_len, micro_batch=mb,
                             zeros=(0, 1, 2, 3), recomputes=tuple(Recompute), sequence_parallel=(False, True))
                for e in rows:
                    lay = e.layout
                    plan = Plan(model=spec.name, fingerprint="x", hardware=hw.name, devices=devices, global_batch=4,
                                seq_len=seq_len, mesh=lay.mesh, micro_batch=lay.micro_batch, zero=lay.zero,
                                recompute=lay.recompute, schedule=lay.schedule,
                                sequence_parallel=list(e.stage_sequence_parallel) or lay.sequence_parallel)
                    check_plan(plan, spec, world_size=devices)
                    mixed += plan.per_stage
    assert mixed >= 1  # llama-tiny pp2 x tp2 at 9.9 MB, micro-batch 2 (test_sequence_parallel_per_stage)


def odd_vocab_llama():
    """llama-tiny with a vocabulary of 257, as a user config may have (32001): no tp > 1 divides it."""
    from dataclasses import replace

    from autoshard.models.presets import build_model, get_spec

    return build_model(replace(get_spec("llama-tiny"), vocab=257), device="meta")


def test_a_vocabulary_tp_does_not_divide(capsys):
    """Its tp rows replicate the embedding and LM head; the JSON row and a note say so, so that a plan
    written from a row names the strategies the default layout lacks there."""
    argv = ["sweep", "--model", "tests.test_cli_sweep:odd_vocab_llama", "--hardware", "h100", "--devices", "4", *BASE[7:]]
    rows = run_json(capsys, argv)
    both = {"embedding": "replicate", "head": "replicate"}
    assert {r["tp"] for r in rows} == {1, 2, 4}
    assert all(r["strategies"] == (both if r["tp"] > 1 else {}) for r in rows)
    assert main(argv) == 0
    assert "tp 2, 4: do not divide the vocabulary of tests.test_cli_sweep:odd_vocab_llama (257)" in \
        capsys.readouterr().out
