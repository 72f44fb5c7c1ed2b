"""Layouts that check themselves, without an engine: the comparison, the settings that carry a
declared layout, the operator's rendering of it, and the connector's verdict at start-up.

The whole path on real engines is ``tests/connector/integrity/test_layout_whole_path.py``.
"""

from __future__ import annotations

import json
import logging

import pytest

from kvpool.connector.contract.declared_layout import LayoutDifference, differences, mismatch_message
from kvpool.connector.contract.layout import GroupKind, KVGroup, KVLayout, fingerprint
from kvpool.connector.contract.settings import ConnectorSettings, SettingsError
from kvpool.operator import names
from kvpool.operator.plan import build_plan
from kvpool.operator.spec import PoolSpec
from testing.operator_objects import pool_spec

BUILT = KVLayout(
    model="org/model",
    dtype="bfloat16",
    groups=[
        KVGroup(kind=GroupKind.SLIDING_WINDOW, block_size=32, sliding_window=1024, num_layers=52,
                page_size_bytes=65536),
        KVGroup(kind=GroupKind.FULL, block_size=32, num_layers=10, page_size_bytes=65536),
    ],
    hash_block_size=32,
    cache_block_size=32,
    tp_size=2,
)  # fmt: skip


def declared(**changes: object) -> KVLayout:
    return BUILT.model_copy(update=changes)


def test_equal_layouts_have_no_differences() -> None:
    assert differences(BUILT, declared()) == []
    assert differences(BUILT, None, fingerprint(BUILT)) == []
    assert differences(BUILT) == []  # nothing declared: nothing to check


def test_every_differing_field_is_named() -> None:
    wrong_group = BUILT.groups[0].model_copy(update={"sliding_window": 512, "num_layers": 50})
    found = differences(BUILT, declared(dtype="float16", tp_size=1, groups=[wrong_group, BUILT.groups[1]]))
    assert {d.field for d in found} == {
        "dtype",
        "tp_size",
        "groups[0].sliding_window",
        "groups[0].num_layers",
    }
    by_field = {d.field: d for d in found}
    assert by_field["groups[0].sliding_window"] == LayoutDifference("groups[0].sliding_window", 512, 1024)
    message = mismatch_message(BUILT, found)
    for d in found:
        assert str(d) in message
    assert "staying out of the pool" in message and fingerprint(BUILT) in message


def test_a_missing_group_and_an_unset_field_are_differences() -> None:
    found = differences(BUILT, declared(groups=[BUILT.groups[1]], cache_block_size=None))
    fields = {d.field for d in found}
    assert "groups (count)" in fields
    assert "cache_block_size" in fields
    assert "groups[0].kind" in fields  # the declared first group is the full one
    # A hash block size left to its default is the one the fingerprint resolves: no difference.
    assert "hash_block_size" not in {d.field for d in differences(BUILT, declared(hash_block_size=None))}


def test_a_fingerprint_alone_is_compared_whole() -> None:
    (only,) = differences(BUILT, None, "0123456789abcdef")
    assert only.field == "fingerprint" and only.built == fingerprint(BUILT)


def test_settings_carry_a_declared_layout_and_its_fingerprint() -> None:
    base = {"master_server_address": "m:1"}
    plain = ConnectorSettings.parse(base)
    assert "declared_layout" not in plain.extra_config()
    assert "declared_layout_fingerprint" not in plain.extra_config()

    data = {
        **base,
        "declared_layout": BUILT.model_dump(mode="json"),
        "declared_layout_fingerprint": fingerprint(BUILT),
    }
    settings = ConnectorSettings.parse(data)
    assert settings.declared_layout == BUILT
    assert ConnectorSettings.parse(settings.extra_config()) == settings
    assert (
        json.loads(settings.kv_transfer_config_json())["kv_connector_extra_config"] == settings.extra_config()
    )

    with pytest.raises(SettingsError) as bad_print:
        ConnectorSettings.parse({**data, "declared_layout_fingerprint": "ffffffffffffffff"})
    assert set(bad_print.value.problems) == {"declared_layout_fingerprint"}
    with pytest.raises(SettingsError) as bad_layout:
        ConnectorSettings.parse({**base, "declared_layout": {"groups": []}})
    assert set(bad_layout.value.problems) == {"declared_layout.groups"}
    with pytest.raises(SettingsError) as not_hex:
        ConnectorSettings.parse({**base, "declared_layout_fingerprint": "not-a-fingerprint"})
    assert set(not_hex.value.problems) == {"declared_layout_fingerprint"}


def test_the_operator_renders_each_consumers_declared_layout() -> None:
    plan = build_plan("pool", "team-a", pool_spec())
    (injection,) = plan.consumers
    consumer = PoolSpec.model_validate(pool_spec()).consumers[0]
    extra = json.loads(injection.kv_transfer_config)["kv_connector_extra_config"]
    rendered = ConnectorSettings.parse(extra)
    assert rendered.declared_layout == consumer.layout
    assert (
        rendered.declared_layout_fingerprint == fingerprint(consumer.layout) == injection.layout_fingerprint
    )
    # The pool's ConfigMap (shared by every consumer) carries no consumer's layout.
    (configmap,) = [c for c in plan.children if c["kind"] == "ConfigMap"]
    shared = json.loads(configmap["data"][names.KV_TRANSFER_CONFIG_FILE])["kv_connector_extra_config"]
    assert "declared_layout" not in shared


def test_verdict_keeps_a_mismatched_connector_out_of_the_pool(caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("vllm")
    from kvpool.connector.contract import metric_names as m
    from kvpool.connector.integrity.layout_verdict import OutOfPool, verify_declared_layout
    from kvpool.connector.observability.vllm_metrics import series_key

    wrong = declared(dtype="float16")
    settings = ConnectorSettings.parse(
        {"master_server_address": "m:1", "declared_layout": wrong.model_dump()}
    )
    with caplog.at_level(logging.ERROR, logger="vllm.kvpool"):
        verdict = verify_declared_layout(settings, BUILT, scheduler=True)
    assert not verdict.in_pool
    assert "dtype: declared 'float16', vLLM built 'bfloat16'" in caplog.text
    assert verdict.take_counters() == {series_key(m.LAYOUT_MISMATCHES, field="dtype"): 1.0}
    assert verdict.take_counters() == {}  # counted once

    worker = verify_declared_layout(settings, BUILT, scheduler=False)
    assert not worker.in_pool and worker.take_counters() == {}  # the scheduler side counts
    matching = ConnectorSettings.parse(
        {"master_server_address": "m:1", "declared_layout": BUILT.model_dump()}
    )
    assert verify_declared_layout(matching, BUILT, scheduler=True).in_pool

    stand_in = OutOfPool()
    stand_in.register(1, 2)  # registering memory is harmless
    with pytest.raises(RuntimeError, match="out of the pool"):
        stand_in.exists(["k"])


def test_a_scheduler_out_of_the_pool_starts_without_calling_its_client() -> None:
    """The scheduler side of a connector out of the pool starts (the engine serves without it)."""
    pytest.importorskip("vllm")
    from kvpool.connector.contract.keys import KeySpace
    from kvpool.connector.integrity.layout_verdict import OutOfPool
    from kvpool.connector.observability.records import StatsCollector
    from kvpool.connector.scheduler.side import SchedulerSide

    side = SchedulerSide(
        client=OutOfPool(),  # type: ignore[arg-type]
        keyspace=KeySpace("p", "0123456789abcdef"),
        tp_size=1,
        pp_size=1,
        can_load=False,
        can_save=False,
        stats=StatsCollector(group_kinds=("full",)),
    )
    side.close()


def test_a_pipeline_stage_compares_all_but_its_layer_counts() -> None:
    """Each pipeline stage builds only its layers: their count is not compared there."""
    stage = BUILT.model_copy(
        update={"pp_size": 2, "groups": [g.model_copy(update={"num_layers": 5}) for g in BUILT.groups]}
    )
    whole = stage.model_copy(update={"groups": BUILT.groups})
    assert differences(stage, whole, per_stage=True) == []
    assert {d.field for d in differences(stage, whole)} == {"groups[0].num_layers", "groups[1].num_layers"}
    wrong = whole.model_copy(update={"dtype": "float16"})
    assert [d.field for d in differences(stage, wrong, per_stage=True)] == ["dtype"]
    assert differences(stage, None, "0123456789abcdef", per_stage=True) == []  # not checkable per stage
