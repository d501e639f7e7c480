"""parallelize with no plan (rank 0 solves and broadcasts) and with an offline plan file."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import autoshard
from autoshard.errors import CaptureError, PlanFileError

from autoshard.api import _hardware_name
from autoshard.hardware import load_hardware
from autoshard.models.presets import build_model, get_spec
from autoshard.passes.solve.planner import solve
from tests.runtime.dist_harness import run_ranks
from tests.test_cli_inspect import untraceable_llama
from tests.runtime.equivalence import check_plan


def _auto_and_offline(rank: int, world: int, plan_path: str) -> None:
    check_plan("llama-tiny", None)  # solved on rank 0, broadcast as JSON, run on every rank
    with pytest.raises(CaptureError, match=r"model\.layers\.0\.self_attn"):  # rank 0's trace error, on every rank
        autoshard.parallelize(untraceable_llama(), torch.zeros(8, 16, dtype=torch.long))
    if rank == 0:
        solve(get_spec("mamba2-tiny"), load_hardware("cpu"), devices=world, global_batch=8, seq_len=16).save(plan_path)
    dist.barrier()
    check_plan("mamba2-tiny", plan_path)
    llama = build_model(get_spec("llama-tiny"))
    with pytest.raises(PlanFileError, match="another model"):  # on every rank, before any collective
        autoshard.parallelize(llama, torch.zeros(8, 16, dtype=torch.long), plan=plan_path)


def test_auto_plan_and_offline_plan_match_one_process(tmp_path):
    run_ranks(2, _auto_and_offline, str(tmp_path / "plan.json"))


def test_auto_hardware_on_cpu_is_the_cpu_profile():
    assert _hardware_name("auto", torch.device("cpu")) == "cpu"
    assert _hardware_name("h100", torch.device("cpu")) == "h100"
