"""Capacity in the status, pure: the master's text parsed, conditions, phase, what a
scale-down loses, the printer columns. (The numbers against a real master's own:
``test_real_mooncake.py``.)"""

from __future__ import annotations

from typing import Any

import pytest

from kvpool.operator.capacity import (
    apply_observation,
    capacity_status,
    degraded_condition,
    external_conditions,
    quantity,
    scale_down_message,
)
from kvpool.operator.crd import build_crd
from kvpool.operator.master_view import MasterTextError, parse_health, parse_metrics
from kvpool.operator.observation import Observation
from kvpool.operator.status import condition_of, valid_status

# The shape of a real 0.3.13 master's /metrics (abridged): two stores of 32 and 64 MiB.
MASTER_TEXT = """\
# HELP master_allocated_bytes Total allocated memory
# TYPE master_allocated_bytes gauge
master_allocated_bytes 12582912
# TYPE master_total_capacity_bytes gauge
master_total_capacity_bytes 100663296
# TYPE segment_allocated_bytes gauge
segment_allocated_bytes{segment="10.0.0.5:15001"} 4194304
segment_allocated_bytes{segment="10.0.0.6:15002"} 8388608
# TYPE segment_total_capacity_bytes gauge
segment_total_capacity_bytes{segment="10.0.0.5:15001"} 33554432
segment_total_capacity_bytes{segment="10.0.0.6:15002"} 67108864
# TYPE master_key_count gauge
master_key_count 96
# TYPE master_soft_pin_key_count gauge
master_soft_pin_key_count 0
# TYPE master_successful_evictions_total counter
master_successful_evictions_total 3
# TYPE master_evicted_key_count counter
master_evicted_key_count 40
# TYPE master_evicted_size_bytes counter
master_evicted_size_bytes 5242880
# TYPE master_active_clients gauge
master_active_clients 2
"""
PODS = {"10.0.0.5": "pool-store-a", "10.0.0.6": "pool-store-b"}


def answered(text: str = MASTER_TEXT, pods: dict[str, str] | None = None) -> Observation:
    pods = PODS if pods is None else pods
    return Observation("t1", "pool-master.ns.svc:9003", parse_metrics(text), store_pods=pods)


def test_the_masters_text_is_parsed_into_its_numbers() -> None:
    numbers = parse_metrics(MASTER_TEXT)
    assert (numbers.capacity_bytes, numbers.allocated_bytes, numbers.objects) == (100663296, 12582912, 96)
    assert (numbers.evictions, numbers.evicted_objects, numbers.evicted_bytes) == (3, 40, 5242880)
    assert [(s.name, s.host, s.capacity_bytes, s.allocated_bytes) for s in numbers.segments] == [
        ("10.0.0.5:15001", "10.0.0.5", 33554432, 4194304),
        ("10.0.0.6:15002", "10.0.0.6", 67108864, 8388608),
    ]


@pytest.mark.parametrize(
    "text",
    ["", "<html>not found</html>", "master_total_capacity_bytes 1\n", "master_key_count -1\n" * 1],
)
def test_text_that_is_not_a_masters_is_refused(text: str) -> None:
    with pytest.raises(MasterTextError):
        parse_metrics(text)


def test_health_is_parsed_and_refused_when_it_is_not_a_masters() -> None:
    health = parse_health('{"status":"ok","role":"leader","ha_state":"serving","service_ready":true}')
    assert health.serves
    assert not parse_health(
        '{"role":"standby","service_ready":false,"leader_address":"10.0.0.9:50051"}'
    ).serves
    for text in ("[]", "{}", "nope"):
        with pytest.raises(MasterTextError):
            parse_health(text)


def test_capacity_names_each_segments_store_pod() -> None:
    capacity = capacity_status(answered(), expected=2)
    assert capacity is not None
    assert (capacity["capacity"], capacity["used"], capacity["stores"]) == ("96Mi", "12Mi (12%)", "2/2")
    assert capacity["segments"] == [
        {"segment": "10.0.0.5:15001", "pod": "pool-store-a", "capacityBytes": 33554432, "usedBytes": 4194304},
        {"segment": "10.0.0.6:15002", "pod": "pool-store-b", "capacityBytes": 67108864, "usedBytes": 8388608},
    ]
    assert quantity(3 << 29) == "1.5Gi" and quantity(1000) == "1000"


def test_a_store_down_is_degraded_and_named() -> None:
    one_left = MASTER_TEXT.replace('segment="10.0.0.6:15002"', 'segment="10.0.0.7:15002"')
    degraded = degraded_condition(answered(one_left), expected=2)
    assert (degraded.status, degraded.reason) == ("True", "StoreDown")
    assert "1/2 store pods" in degraded.message and "pool-store-b" in degraded.message
    none = degraded_condition(answered(pods={}), expected=2)
    assert (none.status, none.reason) == ("True", "NoStoreMounted")
    assert degraded_condition(answered(), expected=2).status == "False"
    assert degraded_condition(answered(), expected=None).status == "False"


def ready_status(old: dict[str, Any] | None = None) -> dict[str, Any]:
    deployment = {
        "metadata": {"generation": 1},
        "spec": {"replicas": 2},
        "status": {"observedGeneration": 1, "updatedReplicas": 2, "availableReplicas": 2},
    }
    return valid_status(
        master_address="m:1",
        master=deployment,
        store=deployment,
        embedded=False,
        consumers=[],
        old=old or {},
        generation=1,
        now="t0",
    )


def observe(observation: Observation | None, asked: bool = True, expected: int | None = 2) -> dict[str, Any]:
    status = ready_status()
    return apply_observation(
        status, status, observation, asked=asked, external=False, expected=expected, now="t1"
    )


def test_phases_from_what_the_master_says() -> None:
    assert observe(answered())["phase"] == "Ready"
    one_left = MASTER_TEXT.replace('segment="10.0.0.6:15002"', 'segment="10.0.0.7:15002"')
    assert observe(answered(one_left))["phase"] == "Degraded"
    silent = Observation("t1", problem="no answer within 3 s", reason="Unreachable")
    errored = observe(silent)
    assert errored["phase"] == "Error"
    assert condition_of(errored, "Observed")["reason"] == "Unreachable"  # type: ignore[index]
    not_asked = observe(None, asked=False)
    assert not_asked["phase"] == "Ready" and "capacity" not in not_asked
    assert condition_of(not_asked, "Observed")["status"] == "Unknown"  # type: ignore[index]


def test_a_failed_poll_keeps_the_last_numbers() -> None:
    first = observe(answered())
    silent = Observation("t2", problem="no answer", reason="Unreachable")
    second = apply_observation(first, first, silent, asked=True, external=False, expected=2, now="t2")
    assert second["capacity"] == first["capacity"] and second["capacity"]["changedAt"] == "t1"
    # The same numbers at a later poll: the status stays as it is (nothing to write).
    again = Observation("t3", "pool-master.ns.svc:9003", parse_metrics(MASTER_TEXT), store_pods=PODS)
    assert apply_observation(first, first, again, asked=True, external=False, expected=2, now="t3") == first


def test_an_external_pool_serves_when_its_master_says_so() -> None:
    master, store = external_conditions(True, answered(), embedded=False)
    assert (master.status, store.status, store.reason) == ("True", "True", "ExternalMemory")
    master, store = external_conditions(True, None, embedded=False)
    assert (master.status, store.status) == ("False", "False")
    silent = Observation("t1", problem="refused", reason="Unreachable")
    assert external_conditions(True, silent, embedded=False)[0].reason == "Unreachable"
    assert external_conditions(False, None, embedded=False)[0].status == "True"  # not asked: trusted


def test_a_scale_down_says_what_the_leaving_stores_hold() -> None:
    message = scale_down_message(2, 1, answered())
    assert "store pods 2 -> 1" in message and "96 objects in 12Mi" in message
    assert "between 4Mi and 8Mi" in message and "(33%-67%" in message
    assert "not known" in scale_down_message(3, 1, None)


def test_the_printer_columns_read_fields_the_status_has() -> None:
    status = observe(answered())
    (version,) = build_crd()["spec"]["versions"]
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    for name in ("Capacity", "Used", "Objects", "Stores"):
        path = columns[name].removeprefix(".status.").split(".")
        value: Any = status
        for part in path:
            value = value[part]
        assert value not in (None, "")
    assert {"Phase", "Observed", "Degraded", "Age"} <= set(columns)
    phases = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]["phase"]["enum"]
    assert {"Degraded", "Error"} <= set(phases)


def test_the_operators_gauges_carry_the_status() -> None:
    from prometheus_client import generate_latest

    from kvpool.operator.metrics import OperatorMetrics

    metrics = OperatorMetrics()
    metrics.observe_pool("ns", "pool", observe(answered()))
    text = generate_latest(metrics.registry).decode()
    for line in (
        'kvpool_operator_pool_phase{namespace="ns",phase="Ready",pool="pool"} 1.0',
        'kvpool_operator_pool_capacity_bytes{namespace="ns",pool="pool"} 1.00663296e+08',
        'kvpool_operator_pool_objects{namespace="ns",pool="pool"} 96.0',
        'kvpool_operator_pool_stores_mounted{namespace="ns",pool="pool"} 2.0',
        'kvpool_operator_pool_stores_expected{namespace="ns",pool="pool"} 2.0',
    ):
        assert line in text, line
    metrics.observe_pool("ns", "pool", observe(None, asked=False))
    assert "kvpool_operator_pool_capacity_bytes{" not in generate_latest(metrics.registry).decode()
