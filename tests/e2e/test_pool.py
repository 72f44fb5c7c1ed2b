"""A pool and its vLLM consumer, end to end: from ``MooncakeKVPool`` to an engine that hits the pool.

One pool (a master, two stores) and one consumer Deployment for the module, in order:
the pool comes up and serves (outputs equal the reference, hits on the consumer's own
``/metrics``), a connector setting rolls the consumer, deleting the pool stops it and
gives the consumer back as it was.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.operator import names
from kvpool.operator.consumer_hits import percent_text
from kvpool.operator.names import POOLS
from testing.node import PodInfo
from testing.prompts import MAX_TOKENS, PREFIX_HIT
from tests.e2e import harness
from tests.e2e.conftest import E2E, PROMPTS, VLLM_START_S
from tests.e2e.harness import Completion, complete, metric_total, path, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(3600)]

POOL = "pool"
CONSUMER = "llm"
MASTER = names.master_name(POOL)
STORE = names.store_name(POOL)
CONSUMER_PATH = path("apps/v1", "Deployment", CONSUMER)
POOL_PATH = path(POOLS.api_version, POOLS.kind, POOL)
HIT_TOKENS = "vllm:kvpool_lookup_hit_tokens_total"
QUERY_TOKENS = "vllm:kvpool_lookup_query_tokens_total"
LOAD_BLOCKS = "vllm:kvpool_transfer_blocks_total"
MISMATCHES = "vllm:kvpool_layout_mismatches_total"


def status(e2e: E2E) -> dict:
    return (e2e.kube.pool(POOL) or {}).get("status") or {}


def true(e2e: E2E, *conditions: str) -> bool:
    return all(e2e.kube.condition(POOL, kind).get("status") == "True" for kind in conditions)


def settled_keys(e2e: E2E, prefix: str) -> list[str]:
    """The pool's keys under ``prefix``, once a request's saves have all landed."""
    (master,) = [p for p in e2e.pods(MASTER) if p.ready]
    return harness.settled(lambda: harness.pool_keys(master.ip, prefix), f"the pool's keys under {prefix}")


def kv_config(container_argv: tuple[str, ...]) -> dict | None:
    """The ``--kv-transfer-config`` a process runs with, if any."""
    for token in container_argv:
        if token.startswith("--kv-transfer-config="):
            return json.loads(token.split("=", 1)[1])
    return None


@pytest.fixture(scope="module")
def consumer(e2e: E2E, model: Path, reference_server: None) -> Iterator[None]:
    """The consumer Deployment (opted in to ``pool``), created scaled to zero so that its first
    pod already runs with the pool's settings; deleted with its pool at the end."""
    e2e.kube.create(harness.vllm_deployment(CONSUMER, model, allow_pool=POOL, replicas=0))
    try:
        yield
    finally:
        e2e.remove(CONSUMER_PATH, POOL_PATH)
        wait_for(lambda: not e2e.pods(CONSUMER), 120, "the consumer's pods gone")


@pytest.fixture(scope="module")
def serving(e2e: E2E, layout: dict, consumer: None) -> PodInfo:
    """The pool, up from real probes, and its consumer's ready pod."""
    e2e.kube.create(harness.pool_manifest(POOL, harness.pool_spec(CONSUMER, layout)))
    wait_for(lambda: true(e2e, "MasterReady", "StoreReady"), 120, "master and stores ready")
    wait_for(
        lambda: (
            names.ANNOTATION_CONFIG_HASH
            in (e2e.kube.deployment(CONSUMER)["spec"]["template"]["metadata"].get("annotations") or {})
        ),
        60,
        "the consumer patched",
    )
    e2e.kube.patch(CONSUMER_PATH, {"spec": {"replicas": 1}})
    pod = e2e.ready_pod(CONSUMER)
    wait_for(lambda: status(e2e).get("phase") == "Ready", 60, "the pool Ready")
    return pod


def test_pool_serves_its_consumer_from_real_processes(
    e2e: E2E, serving: PodInfo, reference: dict[str, Completion]
) -> None:
    # The components run as the operator wrote them, ready from their own probes.
    masters, stores = e2e.pods(MASTER), e2e.pods(STORE)
    assert len(masters) == 1 and len(stores) == 2 and all(p.ready for p in [*masters, *stores])
    assert all(true(e2e, kind) for kind in ("ConfigValid", "MasterReady", "StoreReady", "ConsumersRolledOut"))
    assert not status(e2e).get("warnings"), "a pool of the defaults warns of nothing"
    store_args = [p.container().argv for p in stores]
    for pod, argv in zip(stores, store_args, strict=True):
        assert f"--host={pod.ip}" in argv  # $(POD_IP), expanded to the pod's own address
        assert f"--master_server_address={MASTER}.{harness.NAMESPACE}.svc:50051" in argv

    # The consumer process runs with the pool's settings: its own address, the master Service.
    container = serving.container()
    config = kv_config(container.argv)
    assert config is not None and config["kv_connector"] == "KVPoolConnector"
    extra = config["kv_connector_extra_config"]
    assert extra["local_hostname"] == extra["bind_address"] == serving.ip
    assert extra["master_server_address"] == status(e2e)["masterAddress"]
    config_file = Path(container.env["MOONCAKE_CONFIG_PATH"])
    assert config_file == container.path(f"{names.CONNECTOR_MOUNT_PATH}/{names.MOONCAKE_CONFIG_FILE}")
    configmap = e2e.kube.get(path("v1", "ConfigMap", names.connector_configmap_name(POOL)))
    assert config_file.read_text() == configmap["data"][names.MOONCAKE_CONFIG_FILE]

    # A prompt, then (with the server's own prefix cache emptied) one sharing its prefix:
    # that prefix comes from the pool, and every output equals the reference without a pool.
    first = complete(serving.ip, PROMPTS["p1"], MAX_TOKENS)
    assert first == reference["p1"]
    settled_keys(e2e, f"e2e-{CONSUMER}/")
    harness.reset_prefix_cache(serving.ip)
    second = complete(serving.ip, PROMPTS["p2"], MAX_TOKENS)
    assert second.token_ids == reference["p2"].token_ids
    assert second.cached_tokens == PREFIX_HIT  # not computed here: loaded from the pool
    samples = harness.metrics(serving.ip)
    assert metric_total(samples, HIT_TOKENS) >= PREFIX_HIT
    assert metric_total(samples, LOAD_BLOCKS, operation="load") > 0
    # The layout it declared (from kvpool-layout) is the one its engine built: no mismatch.
    assert metric_total(samples, MISMATCHES) == 0

    # The operator reads the same counters from the pod's own /metrics into status.hits.
    hit, looked_up = int(metric_total(samples, HIT_TOKENS)), int(metric_total(samples, QUERY_TOKENS))
    wanted = {
        "name": CONSUMER,
        "hitRate": percent_text(hit, looked_up),
        "hitTokens": hit,
        "lookedUpTokens": looked_up,
        "pods": "1/1",
    }
    wait_for(
        lambda: ((status(e2e).get("hits") or {}).get("consumers") or [None])[0] == wanted,
        60,
        f"the consumer's hits in the status: {wanted}",
    )
    assert status(e2e)["hits"]["hitRate"] == wanted["hitRate"] != "-"


EXTERNAL = "shared"
EXTERNAL_CONSUMER = "llm-elsewhere"


def test_an_external_pool_serves_its_consumer_from_a_master_it_does_not_run(
    e2e: E2E, model: Path, layout: dict, serving: PodInfo, reference: dict[str, Completion]
) -> None:
    """A second pool naming the first one's master (as a platform team's master, run by
    someone else, would be named): the operator runs nothing for it, sees the master serve,
    rolls its own consumer onto it; that consumer's vLLM takes the prefix the first pool's
    consumer stored there (same cache prefix, model and layout: the same keys)."""
    consumer_path = path("apps/v1", "Deployment", EXTERNAL_CONSUMER)
    external_path = path(POOLS.api_version, POOLS.kind, EXTERNAL)
    service = f"{MASTER}.{harness.NAMESPACE}.svc"
    spec = harness.pool_spec(
        EXTERNAL_CONSUMER,
        layout,
        external={"masterServerAddress": f"{service}:50051", "metricsEndpoints": [f"{service}:9003"]},
        connector={"cache_prefix": f"e2e-{CONSUMER}"},
    )
    del spec["image"], spec["store"]  # an external pool runs neither (nor a master)
    e2e.kube.create(harness.vllm_deployment(EXTERNAL_CONSUMER, model, allow_pool=EXTERNAL, replicas=0))
    e2e.kube.create(harness.pool_manifest(EXTERNAL, spec))
    try:
        wait_for(
            lambda: e2e.kube.condition(EXTERNAL, "MasterReady").get("reason") == "ExternalServes",
            60,
            "the external master seen serving",
        )
        wait_for(
            lambda: (
                names.ANNOTATION_CONFIG_HASH
                in (
                    e2e.kube.deployment(EXTERNAL_CONSUMER)["spec"]["template"]["metadata"].get("annotations")
                    or {}
                )
            ),
            60,
            "the external pool's consumer patched",
        )
        # Nothing runs for it: no Deployment of its own, no process of its own.
        for deployment in (names.master_name(EXTERNAL), names.store_name(EXTERNAL)):
            assert e2e.kube.deployment(deployment) is None
        e2e.kube.patch(consumer_path, {"spec": {"replicas": 1}})
        pod = e2e.ready_pod(EXTERNAL_CONSUMER)
        extra = (kv_config(pod.container().argv) or {})["kv_connector_extra_config"]
        assert extra["master_server_address"] == f"{service}:50051"
        # Its first request: the prefix the other pool's consumer stored, loaded, output right.
        answer = complete(pod.ip, PROMPTS["p2"], MAX_TOKENS)
        assert answer.token_ids == reference["p2"].token_ids
        assert answer.cached_tokens >= PREFIX_HIT
        assert metric_total(harness.metrics(pod.ip), HIT_TOKENS) >= PREFIX_HIT
        # Its status shows the master's own capacity: what the first pool's status shows.
        observed = wait_for(
            lambda: (e2e.pool_status(EXTERNAL).get("capacity") or {}).get("capacityBytes"), 60, "capacity"
        )
        assert observed == status(e2e)["capacity"]["capacityBytes"] == 2 * (64 << 20)
        wait_for(lambda: e2e.pool_status(EXTERNAL).get("phase") == "Ready", 60, "the external pool Ready")
    finally:
        # The consumer first: the pool's teardown would otherwise restore it and roll it again.
        e2e.remove(consumer_path, external_path)
        wait_for(lambda: e2e.kube.pool(EXTERNAL) is None, 60, "the external pool gone")
        wait_for(lambda: not e2e.pods(EXTERNAL_CONSUMER), 120, "its consumer's pods gone")
    # Deleting it stopped nothing of the master it named.
    assert all(p.ready for p in e2e.pods(MASTER)) and e2e.pods(MASTER)


def test_connector_setting_rolls_the_consumer(
    e2e: E2E, serving: PodInfo, reference: dict[str, Completion]
) -> None:
    old_hash = status(e2e)["consumers"][0]["configHash"]
    old_pod = serving.name
    e2e.kube.patch(POOL_PATH, {"spec": {"connector": {"batch_size": 64}}})
    new_hash = wait_for(
        lambda: (h := status(e2e)["consumers"][0]["configHash"]) != old_hash and h, 60, "a new config hash"
    )
    # ConsumersRolledOut turns True for the new settings only once the new pod is ready and
    # the old one on its way out: checked on every look until it does.
    deadline = time.monotonic() + VLLM_START_S
    while True:
        rolled = true(e2e, "ConsumersRolledOut") and status(e2e)["consumers"][0]["configHash"] == new_hash
        pods = [p for p in e2e.pods(CONSUMER) if not p.terminating]
        if rolled:
            assert len(pods) == 1 and pods[0].ready and pods[0].name != old_pod, f"rolled out early: {pods}"
            break
        assert time.monotonic() < deadline, "the consumer never rolled out"
        time.sleep(0.5)
    new = pods[0]
    assert new.annotations[names.ANNOTATION_CONFIG_HASH] == new_hash

    # The new process runs the new setting, in its own argv and in its own mounted files.
    config = kv_config(new.container().argv)
    assert config is not None and config["kv_connector_extra_config"]["batch_size"] == 64
    mounted = new.container().path(f"{names.CONNECTOR_MOUNT_PATH}/{names.KV_TRANSFER_CONFIG_FILE}")
    assert json.loads(mounted.read_text())["kv_connector_extra_config"]["batch_size"] == 64
    wait_for(lambda: all(p.stopped for p in e2e.node.all_pods() if p.name == old_pod), 60, "old pod stopped")

    # A fresh process, an empty local cache: what the old one saved comes from the pool.
    answer = complete(new.ip, PROMPTS["p1"], MAX_TOKENS)
    assert answer.token_ids == reference["p1"].token_ids
    assert answer.cached_tokens >= PREFIX_HIT
    assert metric_total(harness.metrics(new.ip), HIT_TOKENS) >= PREFIX_HIT


def test_deleting_the_pool_stops_it_and_restores_the_consumer(
    e2e: E2E, model: Path, serving: PodInfo, reference: dict[str, Completion]
) -> None:
    components = [p for p in e2e.node.pods(harness.NAMESPACE) if p.owner[1] in (MASTER, STORE)]
    pids = [pid for p in components for c in p.containers for pid in c.pids]
    assert components and pids
    e2e.kube.delete(POOL_PATH)
    wait_for(lambda: e2e.kube.pool(POOL) is None, 60, "the pool gone")
    for deployment in (MASTER, STORE):
        assert e2e.kube.deployment(deployment) is None
    wait_for(
        lambda: all(p.stopped for p in e2e.node.all_pods() if p.owner[1] in (MASTER, STORE)), 60, "stopped"
    )
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)

    # The consumer is as its owner wrote it, and restarts without the connector.
    restored = e2e.kube.deployment(CONSUMER)
    container = restored["spec"]["template"]["spec"]["containers"][0]
    assert container["args"] == harness.vllm_args(model)
    assert names.LABEL_CONSUMER_OF not in restored["metadata"].get("labels", {})
    assert not any(e["name"] == "MOONCAKE_CONFIG_PATH" for e in container.get("env", []))
    pod = wait_for(
        lambda: (
            (p := [x for x in e2e.pods(CONSUMER) if not x.terminating])
            and p[0].ready
            and kv_config(p[0].container().argv) is None
            and p[0]
        ),
        VLLM_START_S,
        "a ready consumer without the connector",
    )
    assert "MOONCAKE_CONFIG_PATH" not in pod.container().env
    for key in ("p1", "p2"):
        assert complete(pod.ip, PROMPTS[key], MAX_TOKENS).token_ids == reference[key].token_ids
    assert metric_total(harness.metrics(pod.ip), HIT_TOKENS) == 0
