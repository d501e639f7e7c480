"""`autoshard plan` / `autoshard show` end to end, and their one-line errors."""

import json

import pytest

from autoshard.cli import main


def test_plan_then_show(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "llama-tiny", "--hardware", "cpu", "--devices", "4", "--global-batch", "8",
                 "--seq-len", "64", "--time-limit", "10", "--out", str(out), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["mesh"].keys() == {"dp", "pp", "tp", "cp", "ep"} and data["schema_version"] == 2
    assert json.loads(out.read_text())["fingerprint"] == data["fingerprint"]
    assert main(["show", str(out)]) == 0
    shown = capsys.readouterr().out
    assert "pipeline stages" in shown and "predicted" in shown and "runner-up" in shown


@pytest.mark.parametrize("content", [b"\x80\x04\x95junk", b"{not json", b'{"schema_version": 99}', b"[]"])
def test_show_refuses_bad_files(tmp_path, capsys, content):
    bad = tmp_path / "bad.json"
    bad.write_bytes(content)
    assert main(["show", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("args", [["--model", "nope", "--hardware", "cpu"], ["--model", "llama-tiny", "--hardware", "tpu9"]])
def test_plan_unknown_names(capsys, args):
    assert main(["plan", *args, "--devices", "2", "--global-batch", "4", "--seq-len", "64"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_plan_nonpositive_devices(capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "--model", "llama-tiny", "--hardware", "cpu", "--devices", "0", "--global-batch", "4",
              "--seq-len", "64"])
    assert e.value.code == 2


@pytest.mark.parametrize("name, layers", [("llama-tiny", 5), ("mamba2-tiny", 3), ("llama-7b", 4)])
def test_fingerprint_spec_equals_the_full_model_one(name, layers):
    """`fingerprint_spec` (cached) gives the hash of the full model."""
    from dataclasses import replace

    from autoshard.fingerprint import fingerprint_module
    from autoshard.passes.capture.shipped import fingerprint_spec
    from autoshard.models.presets import build_model, get_spec

    spec = replace(get_spec(name), layers=layers)
    assert fingerprint_spec(spec) == fingerprint_module(build_model(spec, device="meta"))


def test_show_interleaved_plan_prices_each_chunk_by_its_rank(tmp_path, capsys):
    """Interleaved 1F1B: a row per model chunk, with the time and memory of the rank that runs it
    (the predictions are per rank; chunk i runs on rank i mod pp)."""
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "llama-7b", "--hardware", "ascend-910b", "--devices", "8", "--global-batch",
                 "1024", "--seq-len", "4096", "--out", str(out), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    pp, v = data["mesh"]["pp"], data["virtual_stages"]
    assert pp > 1 and v > 1 and len(data["stages"]) == pp * v  # the README's plan interleaves
    assert main(["show", str(out)]) == 0
    rows = [line.split("│")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("│")]
    rows = [[cell.strip() for cell in row] for row in rows if row[0].strip().isdigit()]
    assert len(rows) == pp * v
    times = data["predicted"]["stage_time_s"]
    for chunk, row in enumerate(rows):
        assert int(row[-3]) == chunk % pp and float(row[-2]) == pytest.approx(times[chunk % pp], rel=1e-3)
