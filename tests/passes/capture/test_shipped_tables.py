"""The cost tables and fingerprints shipped in the package (passes/capture/table_cache.py, "Shipped tables"):
one per preset and nothing else, equal to what the current code builds, read before the user cache
so that a preset is planned without a trace; a model no preset names still traces into the user cache."""

import json
from dataclasses import replace

import pytest

from autoshard.models import get_spec
from autoshard.passes.capture import shapes, shipped, table_cache

REBUILD = shipped.REBUILD
# rebuilt in full here (a trace each, seconds): one preset per family and MoE flavour; the
# other presets share their code paths (the listing test below still checks every key)
SAMPLE = ("llama-tiny", "mamba2-tiny", "qwen2-moe-tiny")


@pytest.fixture(scope="module")
def entries():
    return shipped.shipped_entries()


def _path(kind, key):
    return table_cache.SHIPPED / kind / f"{table_cache.digest(key)}.json"


def test_every_preset_ships_its_entries_and_nothing_else(entries):
    expected = {_path(kind, key) for kind, key, _, _ in entries}
    present = set(table_cache.SHIPPED.glob("*/*.json"))
    assert expected <= present, f"shipped entries missing or stale (a preset or SHIPPED_FORMAT changed): run {REBUILD}"
    assert present <= expected, f"shipped entries no preset has: run {REBUILD}"
    for path in present:  # each carries the digest of its content (table_cache "Integrity")
        stored = json.loads(path.read_text())
        assert stored.get("digest") == table_cache.content_digest(stored["value"]), f"{path}: digest; run {REBUILD}"
    size = sum(p.stat().st_size for p in present)
    assert size < 3e6, f"the shipped tables take {size / 1e6:.1f} MB"


@pytest.mark.parametrize("name", SAMPLE)
def test_shipped_table_equals_a_rebuild_with_this_code(entries, name):
    mine = [(kind, key, build, encode) for kind, key, build, encode in entries if key["spec"]["name"] == name]
    assert {kind for kind, *_ in mine} == {"tables", "fingerprints"}
    for kind, key, build, encode in mine:
        stored = json.loads(_path(kind, key).read_text())
        assert stored["key"] == key
        fresh = json.loads(json.dumps(encode(build())))
        assert fresh == stored["value"], (
            f"the shipped {kind[:-1]} of {name} differs from what this code builds: if capture / shapes "
            f"changed what a table holds, bump table_cache.SHIPPED_FORMAT; then run {REBUILD}")


def test_every_shipped_fingerprint_is_the_models(entries):
    from autoshard.fingerprint import fingerprint_module
    from autoshard.models import build_model

    for kind, key, _, _ in entries:
        if kind == "fingerprints":
            spec = get_spec(key["spec"]["name"])
            assert json.loads(_path(kind, key).read_text())["value"] == fingerprint_module(
                build_model(spec, device="meta")), f"stale shipped fingerprint of {spec.name}: run {REBUILD}"


@pytest.fixture
def fresh_machine(tmp_path, monkeypatch):
    """An empty user cache, and a trace or a model build fails the test."""
    monkeypatch.setenv(table_cache.ENV, str(tmp_path))
    for fn in (shapes._build_cached, shapes._build_for_layers):
        fn.cache_clear()
    yield tmp_path
    for fn in (shapes._build_cached, shapes._build_for_layers):
        fn.cache_clear()


def test_a_preset_is_planned_without_a_trace(fresh_machine, monkeypatch):
    from autoshard import fingerprint
    from autoshard.passes.solve.planner import solve

    monkeypatch.setattr(shapes, "trace_table", lambda *a: pytest.fail("traced a preset"))
    monkeypatch.setattr(fingerprint, "fingerprint_module", lambda m: pytest.fail("built a preset to fingerprint it"))
    plan = solve(get_spec("llama-tiny"), "cpu", devices=2, global_batch=4, seq_len=64)
    assert plan.fingerprint and plan.solver["status"] == "optimal"
    # any layer count shares the 1-layer table
    assert shapes.build_cost_table(get_spec("llama-70b", layers=3)).block(shapes.BlockKind.LAYER).count == 3
    assert not list(fresh_machine.glob("*/*.json"))  # nothing written to the user cache


def test_a_model_no_preset_names_traces_into_the_user_cache(fresh_machine, monkeypatch):
    shipped = shapes.build_cost_table(get_spec("llama-tiny"))  # read from the package
    built = []  # the trace is stood in for (test_table_cache covers the user cache with real tables)
    monkeypatch.setattr(shapes, "trace_table", lambda spec, *a: built.append(spec.name) or replace(shipped, model=spec.name))
    spec = replace(get_spec("llama-tiny"), name="my-llama", hidden=96)
    table = shapes.build_cost_table(spec)
    assert built == ["my-llama"] and len(list(fresh_machine.glob("tables/*.json"))) == 1
    for fn in (shapes._build_cached, shapes._build_for_layers):
        fn.cache_clear()
    assert shapes.build_cost_table(spec) == table and built == ["my-llama"]  # read back from the user cache
