"""Every bad-input probe of issue 16 against the CLI, in-process: one line on stderr, exit 2, no traceback."""

from __future__ import annotations

import json
import threading

import pytest

from autoshard.cli import main
from autoshard.passes.capture import table_cache

PLAN = ["--hardware", "cpu", "--global-batch", "8", "--seq-len", "64"]


def _fails(capsys, argv, *needles: str) -> str:
    """Run `autoshard argv`; assert exit 2 with one line naming every needle; return the line."""
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own errors
        code = e.code
    out, err = capsys.readouterr()
    assert code == 2, f"{argv}: exit {code}, stderr {err!r}"
    assert err.count("\n") == 1 and "Traceback" not in err, f"{argv}: {err!r}"
    for needle in needles:
        assert needle in err, f"{argv}: {needle!r} not in {err!r}"
    return err


def raising_factory():
    raise RuntimeError("weights server unreachable")


def multiline_factory():  # as HF's config validators raise: the message spans lines
    raise ValueError("Class validation error:\n    hidden_size * expand (128) must equal num_heads * head_dim (64)")


def tiny_llama():
    from autoshard.models.presets import build_model, get_spec

    return build_model(get_spec("llama-tiny"), device="meta")


NOT_A_MODULE = 42


@pytest.mark.parametrize("command", ["sweep", "plan"])
def test_a_billion_devices_is_refused_at_once(capsys, command):
    # factor-based divisor search: the answer (no valid layout) comes in milliseconds (bench/bench_devices.py)
    _fails(capsys, [command, "--model", "llama-tiny", "--devices", "1000000000", *PLAN],
           "no valid", "1000000000")


def test_plan_out_to_a_missing_directory_fails_before_solving(tmp_path, capsys):
    _fails(capsys, ["plan", "--model", "llama-tiny", "--devices", "2", *PLAN, "--out",
                    str(tmp_path / "missing" / "plan.json")], "does not exist")
    _fails(capsys, ["plan", "--model", "llama-tiny", "--devices", "2", *PLAN, "--out", str(tmp_path)],
           "is a directory")
    _fails(capsys, ["sweep", "--model", "llama-tiny", "--devices", "2", *PLAN, "--plot",
                    str(tmp_path / "missing" / "f.png")], "does not exist")


@pytest.mark.parametrize("argv, needle", [
    (["--time-limit", "-1"], "--time-limit"),
    (["--time-limit", "inf"], "--time-limit"),
    (["--time-limit", "soon"], "--time-limit"),
])
def test_plan_time_limit_must_be_positive(capsys, argv, needle):
    _fails(capsys, ["plan", "--model", "llama-tiny", "--devices", "2", *PLAN, *argv], needle)


def _good_plan() -> dict:
    return {
        "schema_version": 1, "model": "llama-tiny", "fingerprint": "caf040d3ceb36fe0", "hardware": "cpu",
        "devices": 2, "global_batch": 4, "seq_len": 16, "mesh": {"dp": 1, "pp": 2}, "micro_batch": 1, "zero": 1,
        "recompute": "none",
        "stages": [{"first_layer": 0, "end_layer": 2, "embed": True, "head": False},
                   {"first_layer": 2, "end_layer": 4, "embed": False, "head": True}],
        "placements": {"all": "replicate"},
        "predicted": {"step_time_s": 0.5, "tokens_per_s": 100.0, "mfu": 0.3, "memory_gb": 1.0,
                      "stage_time_s": [0.2, 0.2], "time_breakdown_s": {"compute": 0.4}},
        "solver": {"status": "optimal", "gap": 0.0, "solve_time_s": 1.0, "layouts": 3, "layouts_solved": 2,
                   "runner_up": {"mesh": {"dp": 2}, "zero": 1, "step_time_s": 0.6, "why": "dp comm"}},
    }


def _with(path: str, value):
    data = _good_plan()
    *parents, last = path.split(".")
    node = data
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    if isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return data


SHOW_CASES = [
    ("predicted", 5, "'predicted' must be an object"),
    ("predicted", [], "'predicted' must be an object"),
    ("predicted.step_time_s", "fast", "'predicted.step_time_s' must be a finite number"),
    ("predicted.stage_time_s", [0.1, None], "'predicted.stage_time_s'"),
    ("predicted.time_breakdown_s", {"compute": "x"}, "'predicted.time_breakdown_s'"),
    ("solver", "optimal", "'solver' must be an object"),
    ("solver.gap", {}, "'solver.gap'"),
    ("solver.runner_up", {"mesh": {"dp": 2}}, "'solver.runner_up' must be an object with mesh, step_time_s, why"),
    ("solver.runner_up.mesh", {"dp": "two"}, "'solver.runner_up.mesh'"),
    ("solver.runner_up.step_time_s", None, "'solver.runner_up.step_time_s'"),
    ("seq_len", -16, "seq_len must be a positive integer, got -16"),
    ("seq_len", 1, "sequence length 1: training predicts each next token, so a sequence needs at least 2 tokens"),
    ("global_batch", -4, "global_batch must be a positive integer, got -4"),
    ("global_batch", 0, "global_batch must be a positive integer, got 0"),
    ("devices", True, "devices must be a positive integer, got True"),  # one message shape: Plan's own check
    ("micro_batch", "2", "micro_batch must be a positive integer, got '2'"),
    ("zero", True, "zero must be 0, 1, 2 or 3, got True"),
    ("model", 7, "model must be a string, got 7"),
    ("stages.1.first_layer", 5, "first layer is after the end"),
    ("stages.0.first_layer", -1, "non-negative"),
    ("stages.0.end_layer", 3, "does not follow the previous stage"),
    ("stages.0.embed", "yes", "stage 0 must be an object"),
    ("stages", {"first_layer": 0}, "'stages' must be a list"),
    ("placements.all", 7, "'placements' must be an object"),
    ("recompute", "sometimes", "recompute must be one of 'none', 'selective', 'full'; got 'sometimes'"),
    ("schema_version", True, "'schema_version' must be a positive integer, found True"),
    ("schema_version", -1, "'schema_version' must be a positive integer, found -1"),
    ("schema_version", 1.0, "'schema_version' must be a positive integer"),
    # a misspelt field once took its default silently (micro-batch 1, no recompute)
    ("micro_batchs", 2, "unknown field(s) ['micro_batchs']; a plan file has"),
    ("kind", "training", "unknown field(s) ['kind']"),
    ("stages.0.recompue", "full", "stage 0 has unknown field(s) ['recompue']"),
]


def test_show_warns_of_a_fingerprint_that_is_not_the_model_s(tmp_path, capsys):
    # the fingerprint of another model (mamba2-tiny's) under this model's name: parallelize will refuse it
    path = tmp_path / "p.json"
    path.write_text(json.dumps(_with("fingerprint", "fb918840d625ea60")))
    assert main(["show", str(path)]) == 0
    err = capsys.readouterr().err
    assert "warning" in err and err.count("\n") == 1
    assert "names model 'llama-tiny', but its fingerprint fb918840d625ea60 is not that model's (caf040d3ceb36fe0)" in err
    path.write_text(json.dumps(_good_plan()))
    assert main(["show", str(path)]) == 0
    assert capsys.readouterr().err == ""


def test_show_refuses_every_malformed_field(tmp_path, capsys):
    good = tmp_path / "good.json"
    good.write_text(json.dumps(_good_plan()))
    assert main(["show", str(good)]) == 0
    assert "runner-up" in capsys.readouterr().out
    for i, (path, value, needle) in enumerate(SHOW_CASES):
        bad = tmp_path / f"bad{i}.json"
        bad.write_text(json.dumps(_with(path, value)))
        _fails(capsys, ["show", str(bad)], str(bad), needle)
    nonfinite = tmp_path / "inf.json"  # Python's json reads Infinity and NaN; a plan may not hold them
    nonfinite.write_text(json.dumps(_good_plan()).replace("0.5", "Infinity"))
    _fails(capsys, ["show", str(nonfinite)], "'predicted.step_time_s' must be a finite number")


def test_show_refuses_a_malformed_inference_plan(tmp_path, capsys):
    good = tmp_path / "serve.json"
    assert main(["plan", "--model", "llama-tiny", "--hardware", "cpu", "--devices", "2", "--inference",
                 "--prompt-len", "16", "--output-len", "4", "--ttft-slo", "1", "--tpot-slo", "1", "--out",
                 str(good), "--json"]) == 0
    capsys.readouterr()
    data = json.loads(good.read_text())
    pool = data["pools"][0]
    for i, (change, needle) in enumerate([
        ({"pools": [{**pool, "batch": -1}]}, "pool 0: field 'batch' must be a positive integer, found -1"),
        ({"pools": [{**pool, "tp": 1.5}]}, "pool 0: field 'tp' must be a positive integer, found 1.5"),  # int() took 1
        ({"pools": [{**pool, "replicas": True}]}, "field 'replicas' must be a positive integer, found True"),
        ({"pools": [{**pool, "tpp": 2}]}, "pool 0: unknown field(s) ['tpp']"),
        ({"pools": "both"}, "field 'pools' must be a list of pool objects"),
        ({"prompt_len": "16"}, "field 'prompt_len' must be a positive integer, found '16'"),
        ({"tpot_slo_s": 0}, "field 'tpot_slo_s' must be a positive finite number of seconds"),
        ({"extra": 1}, "unknown field(s) ['extra']"),
    ]):
        bad = tmp_path / f"bad{i}.json"
        bad.write_text(json.dumps(data | change))
        _fails(capsys, ["show", str(bad)], str(bad), needle)


def test_show_with_a_zero_predicted_step_time(tmp_path, capsys):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(_with("predicted.step_time_s", 0)))
    assert main(["show", str(path)]) == 0
    assert "runner-up: dp2" in capsys.readouterr().out


MODEL_CASES = [
    ("os:system", "os:system() failed with TypeError"),
    ("torch.nn:Linear", "torch.nn:Linear() failed with TypeError"),
    (":foo", "expected package.module:factory"),
    ("os:", "expected package.module:factory"),
    ("no_such_pkg_xyz:build", "cannot load model factory"),
    ("tests.test_cli_bad_input:nope", "cannot load model factory"),
    ("tests.test_cli_bad_input:NOT_A_MODULE", "not a callable"),
    ("tests.test_cli_bad_input:raising_factory", "RuntimeError: weights server unreachable"),
    ("sys:exit", "failed with SystemExit"),
    ("os:getcwd", "returned str, expected an nn.Module"),
    ("tests.test_cli_bad_input:multiline_factory", "Class validation error:; hidden_size * expand (128)"),
]


@pytest.mark.parametrize("command", ["inspect", "sweep", "plan"])
def test_bad_model_factories(capsys, command):
    extra = {"inspect": [], "sweep": ["--devices", "2", *PLAN], "plan": ["--devices", "2", *PLAN]}[command]
    for model, needle in MODEL_CASES:
        err = _fails(capsys, [command, "--model", model, *extra], needle)
        assert "unknown model preset" not in err


def test_plan_takes_a_factory(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "tests.test_cli_bad_input:tiny_llama", "--devices", "1", *PLAN,
                 "--time-limit", "1", "--out", str(out), "--json"]) == 0
    from autoshard.fingerprint import fingerprint_module

    assert json.loads(out.read_text())["fingerprint"] == fingerprint_module(tiny_llama())
    _fails(capsys, ["plan", "--model", "llama-nope", "--devices", "2", *PLAN], "unknown model preset 'llama-nope'")
    # a model that is no preset: one line telling how to bring it (a factory building it from its HF config)
    err = _fails(capsys, ["plan", "--model", "qwen3-8b", "--devices", "2", *PLAN], "unknown model preset 'qwen3-8b'")
    assert "--model package.module:factory" in err and "AutoModelForCausalLM.from_config" in err, err


INFERENCE = ["--prompt-len", "16", "--output-len", "4", "--ttft-slo", "1", "--tpot-slo", "1"]


@pytest.mark.parametrize("argv, needle", [
    ([*PLAN, "--inference", *INFERENCE], "--global-batch, --seq-len only apply to training plans"),
    (["--hardware", "cpu", "--time-limit", "3", "--inference", *INFERENCE], "--time-limit only applies to training"),
    (["--hardware", "cpu", "--moe-imbalance", "2", "--inference", *INFERENCE], "--moe-imbalance only applies"),
    ([*PLAN, "--no-disaggregation"], "--no-disaggregation only applies with --inference"),
    ([*PLAN, "--plot", "x.png", "--prompt-len", "5"], "--prompt-len, --plot only apply with --inference"),
    ([*PLAN, "--ttft-slo", "1", "--tpot-slo", "1"], "--ttft-slo, --tpot-slo only apply with --inference"),
])
def test_plan_flags_of_the_other_kind_of_plan_are_refused(capsys, argv, needle):
    # before: silently ignored (a training plan with --plot drew nothing, a serving plan ignored --seq-len)
    _fails(capsys, ["plan", "--model", "llama-tiny", "--devices", "2", *argv], needle)


def test_an_option_s_prefix_is_no_option(capsys):
    # before: argparse took `plan --tp 2` for `--tpot-slo 2` and said that one only applies with --inference
    _fails(capsys, ["plan", "--model", "llama-tiny", "--devices", "2", *PLAN, "--tp", "2"],
           "autoshard plan: error: unrecognized arguments: --tp 2", "autoshard price --tp")
    _fails(capsys, ["sweep", "--model", "llama-tiny", "--hardware", "cpu", "--dev", "2", "--global-batch", "8",
                    "--seq-len", "64"], "required: --devices")  # (was read as --devices 2)


@pytest.mark.parametrize("field, value", [("kernels", 5), ("kernels", None), ("kernels", {"rope": 1}),
                                          ("log_collectives", 5), ("log_collectives", None),
                                          ("log_collectives", [1])])
def test_hardware_file_lists_of_the_wrong_type(tmp_path, capsys, field, value):
    from autoshard.hardware import load_hardware

    data = load_hardware("cpu").to_json() | {field: value}
    path = tmp_path / "hw.json"
    path.write_text(json.dumps(data))
    _fails(capsys, ["sweep", "--model", "llama-tiny", "--hardware", str(path), "--devices", "2", *PLAN[2:]],
           f"field {field!r} must be a list of")


def test_hardware_file_with_infinity(tmp_path, capsys):
    from autoshard.hardware import load_hardware

    data = load_hardware("cpu").to_json()
    for field, value in (("hbm_bandwidth", "Infinity"), ("peak_flops", "NaN"), ("inter_latency", "-Infinity")):
        path = tmp_path / f"{field}.json"
        path.write_text(json.dumps(data).replace(json.dumps(data[field]), value, 1))
        _fails(capsys, ["sweep", "--model", "llama-tiny", "--hardware", str(path), "--devices", "2",
                        "--global-batch", "8", "--seq-len", "64"], field, "positive finite number")


def _fill_cache(root, n: int) -> None:
    (root / "tables").mkdir(parents=True)
    for i in range(n):
        (root / "tables" / f"{i}.json").write_text("{}")


def test_concurrent_cache_clears(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(table_cache.ENV, str(tmp_path))
    _fill_cache(tmp_path, 300)
    results, errors = [], []

    def clear():
        try:
            results.append(table_cache.clear()[0])
        except Exception as e:  # noqa: BLE001  (the test reports it)
            errors.append(e)

    threads = [threading.Thread(target=clear) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and sum(results) == 300
    # a file another clear removed between the listing and the unlink is skipped, not a traceback
    _fill_cache(tmp_path / "again", 2)
    monkeypatch.setenv(table_cache.ENV, str(tmp_path / "again"))
    listed = table_cache._entries()
    listed[0].unlink()
    monkeypatch.setattr(table_cache, "_entries", lambda: listed)
    assert main(["cache", "--clear", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["removed"] == 1


def test_cache_clear_without_permission(tmp_path, monkeypatch, capsys):
    import pathlib

    monkeypatch.setenv(table_cache.ENV, str(tmp_path))
    _fill_cache(tmp_path, 2)

    def refuse(self, missing_ok=False):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(pathlib.Path, "unlink", refuse)  # as a user who does not own the directory
    _fails(capsys, ["cache", "--clear"], "cannot clear the cache: Permission denied", table_cache.ENV)


@pytest.mark.parametrize("command", ["sweep", "plan"])
def test_a_sequence_of_one_token_is_refused(capsys, command):
    # a next-token loss has nothing to predict in one token (plan used to accept --seq-len 1)
    _fails(capsys, [command, "--model", "llama-tiny", "--devices", "2", "--hardware", "cpu", "--global-batch", "8",
                    "--seq-len", "1"], "sequence length 1", "at least 2 tokens")


def test_a_key_given_twice_is_refused(tmp_path, capsys):
    # Python's json keeps the last of a repeated key silently: a hand-edited "zero": 3, ..., "zero": 0 ran ZeRO-0
    text = json.dumps(_good_plan())
    path = tmp_path / "twice.json"
    path.write_text(text.replace('"zero": 1', '"zero": 3, "zero": 1'))
    _fails(capsys, ["show", str(path)], str(path), "key 'zero' appears twice in one object (3 and 1)")
    path.write_text(text.replace('"dp": 1', '"dp": 2, "dp": 1'))  # inside the mesh too
    _fails(capsys, ["show", str(path)], "key 'dp' appears twice")
    from autoshard.errors import PlanFileError
    from autoshard.ir import Plan

    with pytest.raises(PlanFileError, match="appears twice"):  # parallelize(plan=path) loads it so
        Plan.load(path)
    from autoshard.hardware import load_hardware

    hw = tmp_path / "hw.json"
    hw.write_text(json.dumps(load_hardware("cpu").to_json()).replace('"name": "cpu"', '"name": "a", "name": "b"'))
    _fails(capsys, ["sweep", "--model", "llama-tiny", "--hardware", str(hw), "--devices", "2", *PLAN[2:]],
           "key 'name' appears twice")


def test_show_says_when_it_cannot_check_a_plan(tmp_path, capsys):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(_with("model", "llama-huge")))
    assert main(["show", str(path)]) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "warning" in err and "shown unchecked" in err and "'llama-huge'" in err


@pytest.mark.parametrize("command", ["sweep", "plan"])
def test_moe_imbalance_of_a_dense_model_is_refused(capsys, command):
    # it was ignored silently: a dense model has no experts to be imbalanced
    _fails(capsys, [command, "--model", "llama-tiny", "--devices", "2", *PLAN, "--moe-imbalance", "2"],
           "--moe-imbalance 2: llama-tiny has no experts")
    assert main([command, "--model", "llama-tiny", "--devices", "2", *PLAN, "--moe-imbalance", "1", "--json"]) == 0


def test_serving_plan_within_max_position_embeddings(capsys):
    # dm.generate refuses prompt + new tokens past max_position_embeddings, so the planner may not plan them
    args = ["plan", "--model", "llama-tiny", "--hardware", "cpu", "--devices", "2", "--inference", "--ttft-slo", "1",
            "--tpot-slo", "1", "--prompt-len", "131000", "--output-len"]
    _fails(capsys, [*args, "100"], "131000 tokens + 100 new tokens = 131100 positions", "(131072)",
           "at most 72 new tokens")


def test_plot_must_be_a_png_before_any_work(tmp_path, capsys):
    # sweep refused it only after pricing every layout; plan --inference wrote whatever the suffix said
    _fails(capsys, ["sweep", "--model", "llama-tiny", "--devices", "2", *PLAN, "--plot", str(tmp_path / "f.jpg")],
           "--plot writes a PNG")
    _fails(capsys, ["plan", "--model", "llama-tiny", "--hardware", "cpu", "--devices", "2", "--inference",
                    *INFERENCE, "--plot", str(tmp_path / "f.svg")], "--plot writes a PNG")
    assert not list(tmp_path.iterdir())


def test_show_checks_an_inference_plan_against_its_model(tmp_path, capsys):
    # hand-edited pools that parallelize / generate refuse were shown as if they ran
    good = tmp_path / "serve.json"
    assert main(["plan", "--model", "llama-tiny", "--hardware", "cpu", "--devices", "2", "--inference", *INFERENCE,
                 "--out", str(good), "--json"]) == 0
    capsys.readouterr()
    data = json.loads(good.read_text())
    pool = data["pools"][0]
    for i, (change, needle) in enumerate([
        (dict(tp=3), "tp (3) does not divide the number of heads of llama-tiny (4)"),
        (dict(pp=8), "pp (8) is larger than the number of blocks"),
        (dict(ep=2), "llama-tiny has no experts"),
    ]):
        edited = {**pool, **change, "replicas": 1}
        size = edited["tp"] * edited["pp"] * edited["ep"]
        bad = tmp_path / f"bad{i}.json"
        bad.write_text(json.dumps(data | {"pools": [edited], "devices": size,
                                          "mesh": {"dp": 1, "pp": edited["pp"], "tp": edited["tp"], "cp": 1,
                                                   "ep": edited["ep"]}}))
        _fails(capsys, ["show", str(bad)], str(bad), "parallelize would refuse this plan: the both pool's replica",
               needle)


def short_yarn_llama():
    """llama-tiny with 64 positions that HF's yarn rope scaling (factor 4) stretches to 256."""
    from autoshard.models.presets import get_spec

    config = get_spec("llama-tiny").hf_config()
    config.max_position_embeddings = 64
    config.rope_parameters = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    from transformers import LlamaForCausalLM

    with __import__("torch").device("meta"):
        return LlamaForCausalLM(config)


@pytest.mark.parametrize("command", ["sweep", "plan"])
def test_training_past_the_model_s_positions_is_refused(capsys, command):
    # plan trained a llama-7b on 1,000,000-token sequences (tp8, ZeRO-3, offload) that plan --inference refused
    argv = [command, "--devices", "2", "--hardware", "cpu", "--global-batch", "8", "--json"]
    _fails(capsys, [*argv, "--model", "llama-7b", "--seq-len", "1000000"], f"{command} --seq-len: a sequence of "
           "1000000 tokens needs 1000000 positions, more than the model's 131072", "at most 131072 tokens")
    factory = f"{__name__}:short_yarn_llama"
    _fails(capsys, [*argv, "--model", factory, "--seq-len", "257"], "more than the model's 256")
    assert main([*argv, "--model", factory, "--seq-len", "256"]) == 0  # yarn lifts 64 positions to 256
