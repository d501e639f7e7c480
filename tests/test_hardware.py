"""Device profiles: every constant sourced, the paper's platform, JSON profiles and their errors."""

import dataclasses
import json

import pytest

from autoshard.errors import AutoshardError, InvalidConfigError, UnknownNameError
from autoshard.hardware import PROFILES, DeviceProfile, hardware_names, load_hardware

NUMERIC = [f.name for f in dataclasses.fields(DeviceProfile) if f.name not in ("name", "sources")]


def test_builtin_profiles_exist_and_cite_every_constant():
    assert set(hardware_names()) == {"ascend-910b", "a100-80g", "h100", "h200", "cpu"}
    for name, hw in PROFILES.items():
        assert load_hardware(name) is hw
        for field in NUMERIC:
            # a host link may be unknown (None): the planner then does not offload on that profile
            assert getattr(hw, field) is None or hw.source(field), f"{name}.{field} has no source"


def test_paper_platform():
    hw = load_hardware("ascend-910b")
    assert hw.peak_flops == pytest.approx(378.88e12)
    assert hw.memory_bytes == pytest.approx(60e9)
    assert hw.devices_per_node == 8
    h100, h200 = load_hardware("h100"), load_hardware("h200")
    assert h200.peak_flops == h100.peak_flops and h200.memory_bytes > h100.memory_bytes


def test_unknown_name_lists_known_profiles():
    with pytest.raises(UnknownNameError) as e:
        load_hardware("tpu-v9")
    assert "tpu-v9" in str(e.value) and "ascend-910b" in str(e.value) and "h100" in str(e.value)


def test_json_profile_round_trip(tmp_path):
    data = load_hardware("h100").to_json()
    data["name"] = "my-gpu"
    data["memory_bytes"] = 40e9
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(data))
    hw = load_hardware(str(path))
    assert hw.name == "my-gpu" and hw.memory_bytes == 40e9 and hw.peak_flops == 989e12


@pytest.mark.parametrize("change, needle", [
    ({"drop": "peak_flops"}, "peak_flops"),
    ({"set": ("hbm_bandwidth", -1)}, "hbm_bandwidth"),
    ({"set": ("intra_bandwidth", "fast")}, "intra_bandwidth"),
    ({"set": ("gemm_efficiency", 1.5)}, "gemm_efficiency"),
    ({"set": ("bogus_field", 1)}, "bogus_field"),
    # a nameless profile was accepted (plans and tables then named the device '')
    ({"set": ("name", "")}, "field 'name' must be a non-empty one-line name"),
    ({"set": ("name", "  ")}, "field 'name' must be a non-empty one-line name"),
    ({"set": ("name", "a\nb")}, "field 'name' must be a non-empty one-line name"),
    ({"set": ("name", 5)}, "field 'name' must be a non-empty one-line name"),
])
def test_bad_json_profile_names_the_field(tmp_path, change, needle):
    data = load_hardware("a100-80g").to_json()
    if "drop" in change:
        del data[change["drop"]]
    else:
        key, value = change["set"]
        data[key] = value
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(InvalidConfigError) as e:
        load_hardware(str(path))
    assert needle in str(e.value)


def test_malformed_json_profile(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    with pytest.raises(AutoshardError, match="not valid JSON"):
        load_hardware(str(path))
    with pytest.raises(AutoshardError, match="cannot read"):
        load_hardware(str(tmp_path / "missing.json"))


def test_serving_fields_are_optional_sourced_and_checked():
    import dataclasses

    import pytest

    from autoshard.errors import InvalidConfigError
    from autoshard.hardware import SERVING_FIELDS, load_hardware

    h100 = load_hardware("h100")
    assert all(getattr(h100, f) is not None and h100.source(f) for f in SERVING_FIELDS)
    assert all(getattr(load_hardware("ascend-910b"), f) is None for f in SERVING_FIELDS)  # HCCL: none published
    assert dataclasses.replace(h100, kernel_floor_s=0).kernel_floor_s == 0
    with pytest.raises(InvalidConfigError, match="'intra_ll_latency' must be a non-negative finite number"):
        dataclasses.replace(h100, intra_ll_latency=-1e-6)
    with pytest.raises(InvalidConfigError, match="'step_input_broadcasts' counts the collectives"):
        dataclasses.replace(h100, step_input_broadcasts=9.5)
