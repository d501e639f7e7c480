"""FP8's bad input (runtime/fp8.py): a missing torchao and a device without float8 GEMMs, each one clear error."""

import sys

import pytest
import torch

from autoshard.errors import InvalidConfigError
from autoshard.runtime.fp8 import check_fp8_device, torchao_float8


def test_missing_torchao_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # import then raises ImportError
    with pytest.raises(InvalidConfigError, match=r"precision 'fp8' runs torchao's float8 training.*autoshard\[fp8\]"):
        torchao_float8()


def test_a_device_without_float8_gemms_is_refused():
    check_fp8_device(torch.device("cpu"))  # torch's reference float8 GEMM: the tests' numerics
    with pytest.raises(InvalidConfigError, match=r"device 'meta' has none; use precision 'bf16-mixed'"):
        check_fp8_device(torch.device("meta"))
