"""The on-disk cost-table cache: exact round trip, hits skip the trace, bad files and the off switch."""

import json
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from autoshard.cli import main
from autoshard.models import get_spec
from autoshard.passes.capture import shapes, table_cache


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(table_cache.ENV, str(tmp_path))
    monkeypatch.setattr(table_cache, "SHIPPED", tmp_path / "none-shipped")  # these tests are about the user cache
    shapes._build_cached.cache_clear()
    shapes._build_for_layers.cache_clear()
    yield tmp_path / "tables"
    shapes._build_cached.cache_clear()
    shapes._build_for_layers.cache_clear()


@pytest.fixture(scope="module")
def tiny_table():
    spec = get_spec("llama-tiny", layers=1)
    kernels = shapes.kernel_table.kernel_for(spec, shapes.kernel_table.KERNEL_NAMES)
    return shapes.trace_table(spec, True, torch.bfloat16, None, kernels)


@pytest.fixture
def count_builds(monkeypatch, tiny_table):
    """Stands in for the trace (these tests are about the cache): counts calls, returns a real table."""
    calls = []
    monkeypatch.setattr(table_cache, "SHIPPED", Path(tempfile.mkdtemp()))  # nothing shipped: the user cache decides

    def counted(spec, *args):
        calls.append(spec.name)
        return replace(tiny_table, model=spec.name)

    monkeypatch.setattr(shapes, "trace_table", counted)
    return calls


@pytest.mark.parametrize("name", ["llama-tiny", "mamba2-tiny"])
def test_json_round_trip_is_exact(name):
    # mamba2 carries ceiling(s/l) terms (the padded length) and rational coefficients
    table = shapes.build_cost_table(get_spec(name))
    back = table_cache.table_from_json(json.loads(json.dumps(table_cache.table_to_json(table))))
    assert back == table


def test_second_build_reads_the_file_and_does_not_trace(cache, count_builds):
    spec = get_spec("llama-tiny")
    first = shapes.build_cost_table(spec)
    assert count_builds == ["llama-tiny"] and len(list(cache.glob("*.json"))) == 1
    shapes._build_cached.cache_clear()
    shapes._build_for_layers.cache_clear()
    second = shapes.build_cost_table(spec)
    assert count_builds == ["llama-tiny"]  # no second trace
    assert second == first
    # another layer count shares the 1-layer table; another width does not
    shapes.build_cost_table(replace(spec, layers=7))
    assert count_builds == ["llama-tiny"]
    shapes.build_cost_table(replace(spec, hidden=96))
    assert count_builds == ["llama-tiny", "llama-tiny"] and len(list(cache.glob("*.json"))) == 2


def test_a_spec_with_tuple_facts_hits_its_file(cache, count_builds):
    # tuples (moe_paths, refused) are lists once read back from JSON: the key must compare equal all the same
    spec = replace(get_spec("mixtral-tiny"), refused=(("tp", "a reason"),))
    first = shapes.build_cost_table(spec)
    shapes._build_cached.cache_clear()
    shapes._build_for_layers.cache_clear()
    assert shapes.build_cost_table(spec) == first and count_builds == ["mixtral-tiny"]


def test_corrupt_or_foreign_file_is_rebuilt(cache, count_builds):
    spec = get_spec("llama-tiny")
    good = shapes.build_cost_table(spec)
    (path,) = cache.glob("*.json")
    for damage in ("{ not json", json.dumps({"format": table_cache.FORMAT, "key": {"other": 1}, "value": {}}),
                   json.dumps({"format": table_cache.FORMAT, "key": json.loads(path.read_text())["key"],
                               "value": {"model": "x"}})):
        path.write_text(damage)
        shapes._build_cached.cache_clear()
        shapes._build_for_layers.cache_clear()
        assert shapes.build_cost_table(spec) == good
        assert json.loads(path.read_text())["value"]["model"] == "llama-tiny"  # replaced by a good file
    assert len(count_builds) == 4


def test_off_switch_and_unwritable_dir(tmp_path, monkeypatch, count_builds):
    spec = get_spec("llama-tiny")
    for setting in ("off", str(tmp_path / "file-not-dir")):
        (tmp_path / "file-not-dir").write_text("")
        monkeypatch.setenv(table_cache.ENV, setting)
        shapes._build_cached.cache_clear()
        shapes._build_for_layers.cache_clear()
        assert shapes.build_cost_table(spec).model == "llama-tiny"
    assert len(count_builds) == 2
    assert table_cache.cache_dir() == tmp_path / "file-not-dir"
    shapes._build_cached.cache_clear()
    shapes._build_for_layers.cache_clear()


def test_key_names_versions_and_source(cache):
    key = shapes._cache_key(get_spec("llama-tiny"), True, torch.bfloat16, None, ())
    assert key["torch"] == torch.__version__ and key["transformers"] and len(key["autoshard"]) == 64
    assert key["spec"]["mixer"] == "attention" and key["dtype"] == "torch.bfloat16"
    assert table_cache.digest(key) != table_cache.digest({**key, "autoshard": "0" * 64})


def test_user_model_is_keyed_by_class_and_config(cache, count_builds):
    from autoshard.models import build_model

    spec = get_spec("llama-tiny")
    model = build_model(spec, device="meta")
    key = shapes._cache_key(spec, True, model.dtype, model, ())
    assert key["class"].endswith("LlamaForCausalLM") and '"hidden_size": 64' in key["config"]
    shapes.build_cost_table(spec, model=model)
    shapes._build_cached.cache_clear()
    shapes._build_for_layers.cache_clear()
    shapes.build_cost_table(spec, model=build_model(spec, device="meta"))  # another instance, same config
    assert len(count_builds) == 1
    odd = build_model(spec, device="meta")
    odd.config.note = object()  # a value JSON cannot hold: traced, not cached, no error
    assert shapes._cache_key(spec, True, odd.dtype, odd, ()) is None


def test_cli_cache_shows_and_clears(cache, count_builds, capsys):
    shapes.build_cost_table(get_spec("llama-tiny"))
    assert main(["cache", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["entries"] == 1 and info["bytes"] > 0 and info["dir"] == str(cache.parent)
    assert main(["cache", "--clear"]) == 0
    assert "removed 1 entry," in capsys.readouterr().out
    assert not list(cache.glob("*.json"))


def test_plan_fingerprint_is_cached_and_exact(cache, monkeypatch):
    from autoshard import fingerprint
    from autoshard.models import build_model
    from autoshard.passes.capture.shipped import fingerprint_spec

    spec = get_spec("llama-tiny", layers=3)
    full = fingerprint.fingerprint_module(build_model(spec, device="meta"))
    assert fingerprint_spec(spec) == full
    assert len(list(cache.parent.glob("fingerprints/*.json"))) == 1
    monkeypatch.setattr(fingerprint, "fingerprint_module", lambda model: pytest.fail("fingerprinted a model on a hit"))
    assert fingerprint_spec(spec) == full


def test_an_expression_outside_the_stored_form_is_not_cached(cache, tiny_table):
    import sympy

    from autoshard.cost_table import S

    odd = sympy.floor(S / 3) * 2  # not a polynomial in b, s and ceiling(s/l)
    with pytest.raises(ValueError, match="not a polynomial"):
        table_cache._encode(odd)
    first = tiny_table.blocks[0]
    weird = replace(tiny_table, blocks=(replace(first, nodes=(replace(first.nodes[0], flops=odd),)),
                                        *tiny_table.blocks[1:]))
    assert table_cache.cached_table({"k": 1}, lambda: weird) is weird  # built and returned, not stored
    assert not (cache / f"{table_cache.digest({'k': 1})}.json").exists()


def test_an_edited_entry_is_rebuilt_with_one_warning(cache, count_builds, caplog):
    # one "params" number changed by hand (valid JSON) moved a plan's predicted step from 0.007 s to 0.47 s
    spec = get_spec("llama-tiny")
    good = shapes.build_cost_table(spec)
    (path,) = cache.glob("*.json")
    data = json.loads(path.read_text())
    assert data["digest"] == table_cache.content_digest(data["value"])
    for edit in ("params", "digest"):
        edited = json.loads(path.read_text())
        if edit == "params":
            edited["value"]["blocks"][0]["params"] += 1000
        else:  # no digest at all: not trusted either
            del edited["digest"]
        path.write_text(json.dumps(edited))
        shapes._build_cached.cache_clear()
        shapes._build_for_layers.cache_clear()
        caplog.clear()
        assert shapes.build_cost_table(spec) == good
        warnings = [r for r in caplog.records if r.levelname == "WARNING"]
        assert len(warnings) == 1 and "does not match its content digest" in warnings[0].getMessage()
        assert json.loads(path.read_text())["value"] == data["value"]  # replaced by the good table
    assert len(count_builds) == 3
