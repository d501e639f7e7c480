"""The validity rules as a table: every rule of `validity.RULES` and `BACKEND_RULES` is listed with its
name and what it checks, and each fires, first, on a question built to break it alone, with its message
(one line saying what was found and what to do). A new rule needs a case here."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from autoshard.errors import InvalidConfigError
from autoshard.ir import Mesh, Plan, Precision, Schedule, Stage
from autoshard.models.presets import get_spec
from autoshard.rules.validity import BACKEND_RULES, RULES, PlanQuestion, backend_violation, broken_rule, check_plan

LLAMA, MAMBA, MIXTRAL = get_spec("llama-tiny"), get_spec("mamba2-tiny"), get_spec("mixtral-tiny")  # 4 layers


def _refusing(spec, axis):
    return replace(spec, refused=((axis, "this model's facts refuse it (test)"),))


def _ask(spec=LLAMA, mesh=Mesh(), **fields) -> PlanQuestion:
    return PlanQuestion(spec=spec, mesh=mesh, **{"global_batch": 8, "seq_len": 16, **fields})


# rule name -> (the question that breaks it alone, a piece of its message)
CASES = {
    "world-size": (_ask(mesh=Mesh(dp=2), world_size=4), r"multiplies to 2, but the world size is 4"),
    "one-replica": (_ask(mesh=Mesh(dp=2), generate=True), r"generate runs one model replica: the plan has dp=2"),
    "serving-refused": (_ask(_refusing(LLAMA, "inference"), generate=True), r"inference is refused for llama-tiny"),
    "sizes-positive": (_ask(global_batch=0), r"global batch must be a positive integer, got 0"),
    "sequence-predicts": (_ask(seq_len=1), r"a sequence needs at least 2 tokens"),
    "ep-refused": (_ask(_refusing(MIXTRAL, "ep"), Mesh(ep=2)), r"ep is refused for mixtral-tiny"),
    "ep-divides-experts": (_ask(mesh=Mesh(ep=2)), r"ep=2: llama-tiny has no experts"),
    "tp-refused": (_ask(_refusing(LLAMA, "tp"), Mesh(tp=2)), r"tp is refused for llama-tiny"),
    "tp-divides": (_ask(mesh=Mesh(tp=3)), r"tp"),
    "pp-refused": (_ask(_refusing(LLAMA, "pp"), Mesh(pp=2)), r"pp is refused for llama-tiny"),
    "pp-layers": (_ask(mesh=Mesh(pp=8)), r"pp \(8\) is larger than the number of blocks"),
    "dp-refused": (_ask(_refusing(LLAMA, "dp"), Mesh(dp=2)), r"dp is refused for llama-tiny"),
    "dp-divides-batch": (_ask(mesh=Mesh(dp=3)), r"global batch 8 is not divisible by dp \(3\) x micro_batch"),
    "cp-refused": (_ask(_refusing(MAMBA, "cp"), Mesh(cp=2)), r"cp is refused for mamba2-tiny"),
    "cp-splits-sequence": (_ask(mesh=Mesh(cp=3)), r"sequence length 16 is not divisible by 2\*cp = 6"),
    "ep-divides-batch": (_ask(MIXTRAL, Mesh(dp=2, ep=2), global_batch=6),
                         r"global batch 6 is not divisible by dp \(2\) x ep \(2\) x micro_batch \(1\) = 4"),
    "zero-without-pipeline": (_ask(mesh=Mesh(pp=2), zero=2), r"ZeRO-2 with pp=2"),
    "sequence-parallel": (_ask(mesh=Mesh(dp=2), sequence_parallel=True), r"sequence_parallel needs tp > 1"),
    "intra-op-choices": (_ask(mesh=Mesh(tp=2), strategies=(("embedding", "sideways"),)), r"embedding"),
    "zero-runtime": (_ask(zero=3, zeros=(0, 1)), r"zero=3 \(parameter sharding\) is not supported by the runtime"),
    "schedule-microbatches": (_ask(mesh=Mesh(pp=2), global_batch=1, schedule=Schedule.ONE_F_ONE_B, stages=()),
                              r"1f1b needs at least as many micro-batches \(1\) as stages \(2\)"),
    "stage-split": (_ask(mesh=Mesh(pp=2), chunks=8, virtual_stages=4, stages=()),
                    r"= 8 model chunks, more than the 4 blocks of llama-tiny"),
}


def _plan(**fields) -> Plan:
    mesh = fields.pop("mesh", Mesh())
    return Plan(model="llama-tiny", fingerprint="", hardware="cpu", devices=mesh.size, global_batch=8, seq_len=16,
                mesh=mesh, **fields)


BACKEND_CASES = {
    "backend-dp-tp-only": ((_plan(mesh=Mesh(pp=2)), LLAMA), r"pp=2 is not supported by the torch.compile backend"),
    "backend-no-sequence-parallel": ((_plan(mesh=Mesh(tp=2), sequence_parallel=True), LLAMA),
                                     r"sequence_parallel is not supported by the torch.compile backend"),
    "backend-zero-0": ((_plan(mesh=Mesh(dp=2), zero=1), LLAMA), r"zero=1: the torch.compile backend"),
    "backend-no-fp8": ((_plan(precision=Precision.FP8), LLAMA), r"precision 'fp8' is not supported"),
    "backend-tp-attention": ((_plan(mesh=Mesh(tp=2)), MAMBA), r"tp=2 for mamba2"),
}


def test_every_rule_is_named_and_listed():
    for table, cases in ((RULES, CASES), (BACKEND_RULES, BACKEND_CASES)):
        names = [rule.name for rule in table]
        assert len(set(names)) == len(names), names
        assert set(names) == set(cases), f"rules without a breaking case (or cases without a rule): " \
                                         f"{sorted(set(names) ^ set(cases))}"
        for rule in table:
            assert rule.checks and re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", rule.name), rule


@pytest.mark.parametrize("name", list(CASES))
def test_each_rule_fires_first_on_its_case(name):
    question, message = CASES[name]
    found = broken_rule(question)
    assert found is not None, f"{name}: nothing broken"
    rule, why = found
    assert rule.name == name, f"{name}'s case broke {rule.name} first: {why}"
    assert re.search(message, why) and "\n" not in why, why


def test_each_backend_rule_fires_first_on_its_case():
    for name, (question, message) in BACKEND_CASES.items():
        broken = [rule.name for rule in BACKEND_RULES if rule.violation(question)]
        assert broken[:1] == [name], (name, broken)
        why = backend_violation(question[1], question[0])
        assert re.search(message, why) and "\n" not in why, why


def test_check_plan_raises_the_tables_message():
    """check_plan walks the same table: a whole plan's first broken rule, raised with its message."""
    plan = _plan(mesh=Mesh(pp=2), micro_batch=8)
    with pytest.raises(InvalidConfigError) as info:
        check_plan(plan, LLAMA, world_size=2)
    question = replace(CASES["schedule-microbatches"][0], global_batch=8, micro_batch=8)
    assert str(info.value) == broken_rule(question)[1]
    stages = (Stage(first_layer=0, end_layer=3, embed=True, head=False), Stage(first_layer=3, end_layer=4, embed=False,
                                                                               head=True))
    check_plan(_plan(mesh=Mesh(pp=2), stages=stages), LLAMA, world_size=2)  # nothing broken
