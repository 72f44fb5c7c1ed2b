"""What is refused end to end: a pool spec the connector cannot serve starts nothing, and a
consumer whose engine builds another layout than it declares stays out of the pool."""

from __future__ import annotations

import copy
import time
from pathlib import Path

import pytest

from kvpool.operator import names
from kvpool.operator.names import POOLS
from testing.prompts import MAX_TOKENS
from tests.e2e import harness
from tests.e2e.conftest import E2E, PROMPTS
from tests.e2e.harness import Completion, complete, metric_total, path, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(3600)]

MISMATCHES = "vllm:kvpool_layout_mismatches_total"


def deployments_of(e2e: E2E, pool: str) -> list[str]:
    return [
        d for d in (names.master_name(pool), names.store_name(pool)) if e2e.kube.deployment(d) is not None
    ]


def test_a_spec_the_connector_cannot_serve_starts_nothing(e2e: E2E, layout: dict) -> None:
    pool, consumer = "bad", "llm-bad"
    unservable = copy.deepcopy(layout)
    unservable["groups"][0]["block_size"] = 48  # not a multiple of the 32-token hash block
    e2e.kube.create(harness.vllm_deployment(consumer, Path("/models/unused"), allow_pool=pool, replicas=0))
    pool_path = path(POOLS.api_version, POOLS.kind, pool)
    e2e.kube.create(harness.pool_manifest(pool, harness.pool_spec(consumer, unservable)))
    try:
        invalid = wait_for(
            lambda: (c := e2e.kube.condition(pool, "ConfigValid")).get("status") == "False" and c,
            60,
            "ConfigValid False",
        )
        assert invalid["reason"] == "InvalidLayout"
        assert "groups[0].block_size" in invalid["message"] and "hash-block-divisible" in invalid["message"]
        assert e2e.kube.pool(pool)["status"]["phase"] == "Invalid"
        # Nothing was written for it, nothing runs, the consumer is as its owner wrote it.
        time.sleep(2.0)  # a few more passes of the operator
        assert deployments_of(e2e, pool) == []
        assert [p for p in e2e.node.pods(harness.NAMESPACE) if p.owner[1].startswith(f"{pool}-")] == []
        written = e2e.kube.deployment(consumer)
        assert names.LABEL_CONSUMER_OF not in written["metadata"]["labels"]
        assert written["spec"]["template"]["spec"]["containers"][0]["args"] == harness.vllm_args(
            Path("/models/unused")
        )

        # Put right, the same pool comes up from real processes.
        e2e.kube.patch(
            pool_path, {"spec": {"consumers": [{"name": consumer, "container": "vllm", "layout": layout}]}}
        )
        wait_for(
            lambda: all(
                e2e.kube.condition(pool, k).get("status") == "True"
                for k in ("ConfigValid", "MasterReady", "StoreReady")
            ),
            120,
            "the corrected pool up",
        )
        assert all(p.ready for p in e2e.pods(names.master_name(pool)) + e2e.pods(names.store_name(pool)))
    finally:
        e2e.remove(path("apps/v1", "Deployment", consumer), pool_path)
        wait_for(lambda: e2e.kube.pool(pool) is None, 60, "the pool gone")


def test_a_consumer_that_declares_another_layout_stays_out_of_the_pool(
    e2e: E2E, model: Path, layout: dict, reference: dict[str, Completion]
) -> None:
    pool, consumer = "mismatch", "llm-mismatch"
    declared = copy.deepcopy(layout)
    declared["groups"][0]["sliding_window"] = 128  # the model's window is 64
    spec = harness.pool_spec(consumer, declared, store={"replicas": 1, "segmentSize": "64MB"})
    e2e.kube.create(harness.vllm_deployment(consumer, model, allow_pool=pool, replicas=0))
    e2e.kube.create(harness.pool_manifest(pool, spec))
    pool_path = path(POOLS.api_version, POOLS.kind, pool)
    deployment_path = path("apps/v1", "Deployment", consumer)
    try:
        wait_for(
            lambda: (
                names.ANNOTATION_CONFIG_HASH
                in (e2e.kube.deployment(consumer)["spec"]["template"]["metadata"].get("annotations") or {})
            ),
            60,
            "the consumer patched",
        )
        e2e.kube.patch(deployment_path, {"spec": {"replicas": 1}})
        pod = e2e.ready_pod(consumer)
        # It serves, as if it had no connector: the same outputs, nothing from or into the pool.
        for key in ("p1", "p2"):
            harness.reset_prefix_cache(pod.ip)
            assert complete(pod.ip, PROMPTS[key], MAX_TOKENS).token_ids == reference[key].token_ids
        samples = wait_for(
            lambda: (s := harness.metrics(pod.ip)) and metric_total(s, MISMATCHES) > 0 and s,
            60,
            "the mismatch counted on /metrics",
        )
        assert metric_total(samples, MISMATCHES, field="groups[0].sliding_window") == 1
        assert metric_total(samples, "vllm:kvpool_lookup_hit_tokens_total") == 0
        log = pod.container().log()
        assert "groups[0].sliding_window" in log
        (master,) = [p for p in e2e.pods(names.master_name(pool)) if p.ready]
        assert harness.pool_keys(master.ip, f"e2e-{consumer}/") == []
    finally:
        e2e.remove(deployment_path, pool_path)
        wait_for(lambda: e2e.kube.pool(pool) is None, 60, "the pool gone")
        wait_for(lambda: not e2e.pods(consumer), 120, "the consumer's pods gone")
