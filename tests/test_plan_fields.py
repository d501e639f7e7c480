"""Plan fields precision / schedule / virtual_stages: defaults, JSON round trip, schema-1 files, errors."""

from __future__ import annotations

import dataclasses
import json

import pytest

from autoshard.api import _resolve_plan
from autoshard.cli import main
from autoshard.errors import InvalidConfigError, PlanFileError
from autoshard.ir import Mesh, Plan, Precision, Schedule, even_stages, stage_rank
from autoshard.models.presets import get_spec


def _plan(**kw) -> Plan:
    mesh = kw.pop("mesh", Mesh(pp=2))
    return Plan(model="llama-tiny", fingerprint="0" * 16, hardware="cpu", devices=mesh.size, global_batch=8,
                seq_len=16, mesh=mesh, **kw)


def test_defaults_and_resolution():
    plan = _plan()
    assert (plan.precision, plan.schedule, plan.virtual_stages) == (Precision.AUTO, Schedule.ONE_F_ONE_B, 1)
    assert Precision.AUTO.resolve("cpu") is Precision.FP32
    assert Precision.AUTO.resolve("cuda") is Precision.AUTO.resolve("npu") is Precision.BF16_MIXED
    assert Precision.FP32.resolve("cuda") is Precision.FP32


def test_json_round_trip_and_schema_1():
    plan = _plan(precision="bf16-mixed", schedule="interleaved-1f1b", virtual_stages=2,
                 stages=even_stages(4, 4))
    data = plan.to_json()
    assert (data["precision"], data["schedule"], data["virtual_stages"]) == ("bf16-mixed", "interleaved-1f1b", 2)
    assert Plan.from_json(json.loads(json.dumps(data))) == plan
    old = {k: v for k, v in data.items() if k not in ("precision", "schedule", "virtual_stages")}
    old["schema_version"], old["stages"] = 1, _plan(stages=even_stages(4, 2)).to_json()["stages"]
    loaded = Plan.from_json(old)
    assert (loaded.precision, loaded.schedule, loaded.virtual_stages, loaded.schema_version) == \
        (Precision.AUTO, Schedule.ONE_F_ONE_B, 1, 2)


def test_fp8_recipe_round_trip():
    """precision fp8 takes torchao's recipe names (tensorwise by default); other plans' files carry no recipe."""
    plan = _plan(precision="fp8", fp8_recipe="rowwise")
    data = plan.to_json()
    assert (data["precision"], data["fp8_recipe"]) == ("fp8", "rowwise")
    assert Plan.from_json(json.loads(json.dumps(data))) == plan
    assert _plan(precision="fp8").fp8_recipe.value == "tensorwise"
    assert "fp8_recipe" not in _plan(precision="bf16-mixed").to_json()


@pytest.mark.parametrize("kw, match", [
    (dict(precision="fp16"), r"precision must be one of 'auto', 'bf16-mixed', 'fp32', 'fp8'; got 'fp16'"),
    (dict(precision="fp8", fp8_recipe="blockwise"), r"fp8_recipe must be one of 'tensorwise', 'rowwise'; got 'blockwise'"),
    (dict(precision="bf16-mixed", fp8_recipe="rowwise"), r"fp8_recipe 'rowwise' needs precision 'fp8'"),
    (dict(schedule="zb"), r"schedule must be one of .*'zero-bubble'; got 'zb'"),
    (dict(virtual_stages=0), "virtual_stages must be a positive integer"),
    (dict(schedule="1f1b", virtual_stages=2), "use schedule='interleaved-1f1b' or 'zero-bubble'"),
    (dict(schedule="interleaved-1f1b"), "needs virtual_stages >= 2"),
    (dict(schedule="zero-bubble", virtual_stages=2, mesh=Mesh(dp=2)), r"needs a pipeline \(pp > 1\)"),
    (dict(schedule="zero-bubble", virtual_stages=2, stages=even_stages(4, 2)), r"pp \(2\) x virtual_stages \(2\) = 4"),
])
def test_bad_values(kw, match):
    with pytest.raises(InvalidConfigError, match=match):
        _plan(**kw)


def test_bad_value_in_file(tmp_path, capsys):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({**_plan().to_json(), "schedule": "pipedream"}))
    with pytest.raises(PlanFileError, match="schedule must be one of"):
        Plan.load(path)
    assert main(["show", str(path)]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_hand_written_plan_keys():
    spec = get_spec("llama-tiny")
    plan = _resolve_plan(dict(pp=2, precision="bf16-mixed", schedule="zero-bubble", virtual_stages=2), spec=spec,
                         seq_len=16, global_batch=8, hardware="cpu")
    assert (plan.precision, plan.schedule, plan.virtual_stages) == (Precision.BF16_MIXED, Schedule.ZERO_BUBBLE, 2)
    with pytest.raises(InvalidConfigError, match="unknown plan keys \\['schedul'\\]"):
        _resolve_plan(dict(pp=2, schedul="gpipe"), spec=spec, seq_len=16, global_batch=8, hardware="cpu")


def test_stage_rank_placements():
    loop = [stage_rank(i, pp=2, virtual_stages=2, schedule=Schedule.INTERLEAVED_1F1B) for i in range(4)]
    vee = [stage_rank(i, pp=2, virtual_stages=2, schedule=Schedule.ZERO_BUBBLE) for i in range(4)]
    assert loop == [0, 1, 0, 1] and vee == [0, 1, 1, 0]


def test_show_prints_them(tmp_path, capsys):
    path = tmp_path / "plan.json"
    dataclasses.replace(_plan(), precision="fp32", schedule="gpipe").save(path)
    assert main(["show", str(path)]) == 0
    assert "precision: fp32; pipeline schedule: gpipe, 1 virtual stage(s) per rank" in capsys.readouterr().out


def test_sequence_parallel_key():
    """sequence_parallel: off by default (older files load), JSON round trip, hand-written dict key, and the
    validator's rules (tp > 1; tp divides each cp rank's tokens), one clear error each."""
    from autoshard.rules.validity import check_plan

    spec = get_spec("llama-tiny")
    plan = _plan(mesh=Mesh(tp=2), sequence_parallel=True)
    data = plan.to_json()
    assert data["sequence_parallel"] is True and Plan.from_json(json.loads(json.dumps(data))) == plan
    assert Plan.from_json({k: v for k, v in data.items() if k != "sequence_parallel"}).sequence_parallel is False
    check_plan(plan, spec, world_size=2)
    assert _resolve_plan(dict(tp=2, sequence_parallel=True), spec=spec, seq_len=16, global_batch=8,
                         hardware="cpu").sequence_parallel
    with pytest.raises(InvalidConfigError, match="sequence_parallel must be true or false, got 1"):
        _plan(mesh=Mesh(tp=2), sequence_parallel=1)
    with pytest.raises(PlanFileError, match="sequence_parallel must be true or false"):
        Plan.from_json({**data, "sequence_parallel": "yes"})
    with pytest.raises(InvalidConfigError, match=r"sequence_parallel needs tp > 1"):
        check_plan(_plan(mesh=Mesh(dp=2), sequence_parallel=True), spec, world_size=2)
    bad = dataclasses.replace(plan, mesh=Mesh(tp=2, cp=2), devices=4, seq_len=12)  # 6 tokens per cp rank: ok
    check_plan(bad, spec, world_size=4)
    bad = dataclasses.replace(plan, mesh=Mesh(tp=4), devices=4, seq_len=18)
    with pytest.raises(InvalidConfigError, match="sequence length 18 is not divisible by tp=4"):
        check_plan(bad, spec, world_size=4)
    bad = dataclasses.replace(plan, mesh=Mesh(tp=4, cp=2), devices=8, seq_len=20)
    with pytest.raises(InvalidConfigError, match="over cp=2 leaves 10 tokens per rank, which is not divisible by "
                                                 "tp=4; pad the sequence to a multiple of tp x cp = 8"):
        check_plan(bad, spec, world_size=8)


def test_sequence_parallel_bad_input(tmp_path, capsys):
    """parallelize refuses sequence_parallel without tp (one process: no process group is made), and
    `autoshard show` of such a plan file exits 2 with one line."""
    import torch

    import autoshard
    from autoshard.models.presets import build_model

    spec = get_spec("llama-tiny")
    with pytest.raises(InvalidConfigError, match="sequence_parallel needs tp > 1"):
        autoshard.parallelize(build_model(spec), torch.zeros(2, 16, dtype=torch.long),
                              plan=dict(sequence_parallel=True))
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({**_plan(mesh=Mesh(dp=2)).to_json(), "sequence_parallel": True}))
    assert main(["show", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "sequence_parallel needs tp > 1" in err


def test_one_positive_integer_rule_refuses_booleans_everywhere():
    """ir.is_positive_int is the one rule for a count: True (which int() and `value >= 1` take for 1)
    is refused by the mesh, the cost model's layout, the planner, the collective model and the rules."""
    from autoshard.errors import InvalidConfigError
    from autoshard.hardware import load_hardware
    from autoshard.ir import Mesh, is_positive_int
    from autoshard.models.presets import get_spec
    from autoshard.passes.cost.collectives import Collective, collective_time
    from autoshard.passes.cost.layout import Layout
    from autoshard.passes.solve.planner import solve
    from autoshard.rules.validity import valid_meshes

    assert [is_positive_int(v) for v in (1, 7, 0, -1, True, False, 2.0, "2", None)] == [True, True] + [False] * 7
    spec, hw = get_spec("llama-tiny"), load_hardware("cpu")
    refusals = [lambda: Mesh(dp=True), lambda: Layout(mesh=Mesh(), micro_batch=True),
                lambda: Layout(mesh=Mesh(), virtual_stages=True),
                lambda: solve(spec, hw, devices=True, global_batch=8, seq_len=64),
                lambda: collective_time(hw, Collective.ALL_REDUCE, 1e6, size=True, stride=1),
                lambda: valid_meshes(spec, True, global_batch=8, seq_len=64)]
    for refused in refusals:
        with pytest.raises(InvalidConfigError, match="positive integer"):
            refused()


def test_one_positive_number_rule_refuses_booleans_everywhere():
    """ir.is_positive_number is the one rule for a rate, a time or a bandwidth: True (which `0 < value < inf`
    takes for 1) is refused by a device profile, the process group's timeout and continuous batching's rate."""
    from autoshard.hardware import load_hardware
    from autoshard.ir import is_positive_number
    from autoshard.passes.serving.continuous_batching import estimate_continuous
    from autoshard.runtime.mesh import check_timeout

    assert [is_positive_number(v) for v in (1, 0.5, 1e300, 0, -1.0, True, float("inf"), float("nan"), "2", None)] == \
        [True] * 3 + [False] * 7
    hw = load_hardware("cpu")
    refusals = [(lambda: dataclasses.replace(hw, peak_flops=True), "positive finite number"),
                (lambda: dataclasses.replace(hw, host_link_bandwidth=True), "positive finite number"),
                (lambda: check_timeout(True), "positive number of seconds"),
                (lambda: estimate_continuous(None, None, hw, None, request_rate=True, prompt_len=8, output_len=8),
                 "positive number of requests per second")]
    for refused, message in refusals:
        with pytest.raises(InvalidConfigError, match=message):
            refused()


def test_a_config_count_is_read_by_the_one_rule():
    """A Hugging Face config's counts that narrow_config reads (a `*_layer_period`, `decoder_sparse_step`) go
    through ir.is_positive_int too: True is no period (it passed as 1 and made every layer the special one)."""
    from types import SimpleNamespace

    from autoshard.passes.capture.layer_kinds import narrow_config

    config = SimpleNamespace(attn_layer_period=True, attn_layer_offset=0, decoder_sparse_step=True, num_hidden_layers=4)
    out = narrow_config(config, 1, 4)
    assert out.attn_layer_period is True and out.decoder_sparse_step is True  # left as given (1 == True: `is`)
    config.attn_layer_period = config.decoder_sparse_step = 2
    out = narrow_config(config, 1, 4)  # layer 1 of period 2 at offset 0: a plain layer; (1 + 1) % 2 == 0: sparse
    assert (out.attn_layer_period, out.attn_layer_offset, out.decoder_sparse_step, out.num_hidden_layers) == (2, 1, 1, 1)


def test_docs_carry_the_field_tables():
    """docs/plan_format.md's tables are generated from the field definitions: a field added, renamed or
    re-documented without the docs fails here (regenerate with ir.fields_table)."""
    from pathlib import Path

    from autoshard.inference_plan import INFERENCE_FIELDS, POOL_FIELDS
    from autoshard.ir import PLAN_FIELDS, fields_table

    doc = (Path(__file__).parents[1] / "docs" / "plan_format.md").read_text()
    for name, fields in (("PLAN_FIELDS", PLAN_FIELDS), ("INFERENCE_FIELDS", INFERENCE_FIELDS),
                         ("POOL_FIELDS", POOL_FIELDS)):
        assert fields_table(fields) in doc, f"docs/plan_format.md lacks ir.fields_table({name}) as it is now"
    assert {f.name for f in dataclasses.fields(Plan)} == {f.name for f in PLAN_FIELDS}


def test_one_schema_derives_keys_file_and_layout():
    """api.PLAN_KEYS, the plan file's keys and the cost model's Layout come from ir.PLAN_FIELDS."""
    from autoshard.api import PLAN_KEYS
    from autoshard.ir import AXES, PLAN_FIELDS, PLAN_FILE_KEYS
    from autoshard.passes.cost.layout import LAYOUT_FIELDS, Layout

    assert PLAN_KEYS == (*AXES, *(f.name for f in PLAN_FIELDS if f.key))
    assert set(_plan(precision="fp8").to_json()) == PLAN_FILE_KEYS == {f.name for f in PLAN_FIELDS}
    assert list(_plan().to_json()) == [f.name for f in PLAN_FIELDS if f.name != "fp8_recipe"]  # the file's order
    layout_names = {f.name for f in dataclasses.fields(Layout)}
    assert {f.name for f in LAYOUT_FIELDS} <= layout_names
    shared = layout_names & {f.name for f in PLAN_FIELDS}
    assert shared == {f.name for f in LAYOUT_FIELDS} | {"mesh", "fp8_recipe", "sequence_parallel", "strategies"}


BAD_COUNTS = (True, False, 0, -1, 1.0, "2")


def test_a_count_is_refused_alike_on_every_entry_point(capsys):
    """ir.POSITIVE_INT on every way in: Plan(...), the JSON reader, parallelize(plan={...}) (one process:
    no process group is made), the cost model's Layout, an inference plan's file and the CLI flags; each
    says '<what> must be a positive integer, <got|found> <value>'."""
    import re

    import torch

    import autoshard
    from autoshard.inference_plan import InferencePlan, Pool
    from autoshard.models.presets import build_model
    from autoshard.passes.cost.layout import Layout

    spec = get_spec("llama-tiny")
    model, ids = build_model(spec), torch.zeros(2, 16, dtype=torch.long)
    serve = InferencePlan(model="llama-tiny", fingerprint="", hardware="cpu", devices=1, prompt_len=8, output_len=8,
                          ttft_slo_s=1.0, tpot_slo_s=1.0, pools=(Pool(role="both", tp=1, pp=1, replicas=1, batch=1),))
    for value in BAD_COUNTS:
        said = f"must be a positive integer, got {value!r}"
        with pytest.raises(InvalidConfigError, match=re.escape(f"micro_batch {said}")):
            _plan(micro_batch=value)
        with pytest.raises(InvalidConfigError, match=re.escape(f"mesh axis tp {said}")):
            Mesh(tp=value)
        with pytest.raises(PlanFileError, match=re.escape(f"invalid plan: seq_len {said}")):
            Plan.from_json(json.loads(json.dumps({**_plan().to_json(), "seq_len": value})))
        with pytest.raises(InvalidConfigError, match=re.escape(f"plan key 'virtual_stages' {said}")):
            _resolve_plan(dict(virtual_stages=value), spec=spec, seq_len=16, global_batch=8, hardware="cpu")
        with pytest.raises(InvalidConfigError, match=re.escape(f"micro_batch {said}")):
            Layout(mesh=Mesh(), micro_batch=value)
        with pytest.raises(InvalidConfigError, match=re.escape(f"batch {said}")):
            Pool(role="both", tp=1, pp=1, replicas=1, batch=value)
        data = serve.to_json()
        data["pools"][0]["tp"] = value
        with pytest.raises(PlanFileError, match=re.escape(f"pool 0: field 'tp' must be a positive integer, found "
                                                          f"{value!r}")):
            InferencePlan.from_json(json.loads(json.dumps(data)))
        text = str(value)
        if text != "2":  # on the command line "2" is the number 2
            with pytest.raises(SystemExit):
                main(["sweep", "--model", "llama-tiny", "--hardware", "cpu", "--devices", "2", "--global-batch", "8",
                      "--seq-len", "64", "--micro-batch", text])
            err = capsys.readouterr().err
            assert err.count("\n") <= 3 and "argument --micro-batch:" in err and "a positive integer, got" in err, err
    from autoshard.hardware import load_hardware

    cpu = load_hardware("cpu")
    for field_name, bad in (("devices_per_node", 1.5), ("step_input_broadcasts", 2.5)):
        with pytest.raises(InvalidConfigError, match=f"field '{field_name}' .*must be a .*integer, got {bad!r}"):
            dataclasses.replace(cpu, **{field_name: bad})  # a profile's counts: the same rule
    with pytest.raises(InvalidConfigError, match="plan key 'micro_batch' must be a positive integer, got True"):
        autoshard.parallelize(model, ids, plan=dict(micro_batch=True))
    with pytest.raises(InvalidConfigError, match="plan key 'zero' must be 0, 1, 2 or 3, got False"):
        autoshard.parallelize(model, ids, plan=dict(zero=False))
    with pytest.raises(InvalidConfigError, match="plan key 'offload_optimizer' must be true or false, got 1"):
        autoshard.parallelize(model, ids, plan=dict(offload_optimizer=1))
