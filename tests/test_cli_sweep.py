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
    # ZeRO-2/3 reduce-scatter gradients every micro-batch: no pipeline schedule (layouts.zero_violation)
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
