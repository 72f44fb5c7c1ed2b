"""HA end to end: two masters on a real three-member etcd cluster, the leader's process SIGKILLed.

etcd runs as a StatefulSet on the test node (Debian's ``etcd``, members named through a
headless Service), the pool's masters as the operator writes them. After the kill the other
master (or the killed one's container, restarted at once as the kubelet does) leads,
``MasterReady`` drops and comes back from the masters' own ``/health``, and the consumer
keeps serving: no output differs from the reference, and hits resume.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.operator import names
from kvpool.operator.names import POOLS
from testing.node import PodInfo
from testing.prompts import MAX_TOKENS, PREFIX_HIT
from tests.e2e import harness
from tests.e2e.conftest import E2E, PROMPTS
from tests.e2e.harness import Completion, complete, path, wait_for

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(3600),
    pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd is not installed (Debian's etcd-server)"),
]

POOL = "ha"
CONSUMER = "llm-ha"
ETCD = "etcd"
MASTER = names.master_name(POOL)
CONSUMER_PATH = path("apps/v1", "Deployment", CONSUMER)
POOL_PATH = path(POOLS.api_version, POOLS.kind, POOL)
FAILOVER_S = 180.0
PREFIX = f"e2e-{CONSUMER}/"  # the consumer's keys (its pool's cache_prefix)


def health(pod: PodInfo) -> dict:
    with urllib.request.urlopen(f"http://{pod.ip}:9003/health", timeout=5) as response:
        return json.loads(response.read())


def leader(e2e: E2E) -> PodInfo | None:
    """The master pod whose own ``/health`` says it leads and serves."""
    for pod in e2e.pods(MASTER):
        try:
            answer = health(pod)
        except OSError:
            continue
        if answer.get("role") == "leader" and answer.get("service_ready"):
            return pod
    return None


def master_ready(e2e: E2E) -> dict:
    return e2e.kube.condition(POOL, "MasterReady")


class ConditionWatcher:
    """Notes each change of the pool's MasterReady, looking five times a second."""

    def __init__(self, e2e: E2E):
        self.e2e = e2e
        self.seen: list[tuple[str, str]] = []  # (status, message), each change once
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> ConditionWatcher:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            condition = master_ready(self.e2e)
            current = (condition.get("status", ""), condition.get("message", ""))
            if not self.seen or self.seen[-1][0] != current[0]:
                self.seen.append(current)
            self._stop.wait(0.2)

    def recovered(self) -> bool:
        """MasterReady went False, then True again."""
        statuses = [status for status, _ in self.seen]
        return "False" in statuses and statuses[-1] == "True" and statuses.index("False") < len(statuses) - 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


@pytest.fixture(scope="module")
def ha_pool(e2e: E2E, model: Path, layout: dict, reference_server: None) -> Iterator[PodInfo]:
    """etcd, an HA pool on it and its consumer's ready pod; all deleted at the end."""
    for obj in harness.etcd_manifests(ETCD):
        e2e.kube.create(obj)
    e2e.kube.create(harness.vllm_deployment(CONSUMER, model, allow_pool=POOL, replicas=0))
    members = [
        f"{ETCD}-{i}.{ETCD}.{harness.NAMESPACE}.svc.cluster.local:{harness.ETCD_CLIENT_PORT}"
        for i in range(3)
    ]
    spec = harness.pool_spec(
        CONSUMER,
        layout,
        master={"replicas": 2, "ha": {"enabled": True, "etcdEndpoints": members}},
        store={"replicas": 1, "segmentSize": "64MB"},
    )
    try:
        wait_for(
            lambda: len([p for p in e2e.pods(ETCD, kind="StatefulSet") if p.ready]) == 3,
            120,
            "etcd members ready",
        )
        e2e.kube.create(harness.pool_manifest(POOL, spec))
        wait_for(lambda: master_ready(e2e).get("status") == "True", 180, "a leader serving")
        wait_for(
            lambda: e2e.kube.condition(POOL, "StoreReady").get("status") == "True", 120, "the store ready"
        )
        # The store waited for a serving leader (``store_wait``, through the Service and the
        # leader a standby names) and started once.
        (store,) = [p for p in e2e.pods(names.store_name(POOL)) if p.ready]
        (wait,) = store.init_containers
        # (A slow election may outlast the wait's deadline once: the kubelet runs it again.)
        assert (wait.exit_codes[-1], store.container().restarts) == (0, 0), (
            wait.log(),
            store.container().log(),
        )
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
        wait_for(lambda: e2e.kube.pool(POOL)["status"].get("phase") == "Ready", 60, "the pool Ready")
        yield pod
    finally:
        # The consumer first: the pool's teardown would otherwise restore it and roll it again.
        e2e.remove(CONSUMER_PATH, POOL_PATH)
        wait_for(lambda: e2e.kube.pool(POOL) is None, 60, "the HA pool gone")
        e2e.remove(path("apps/v1", "StatefulSet", ETCD), path("v1", "Service", ETCD))
        wait_for(lambda: not e2e.pods(CONSUMER) and not e2e.pods(ETCD, kind="StatefulSet"), 120, "pods gone")


def test_leader_killed_standby_leads_and_the_consumer_keeps_serving(
    e2e: E2E, ha_pool: PodInfo, reference: dict[str, Completion]
) -> None:
    consumer = ha_pool
    address = e2e.kube.pool(POOL)["status"]["masterAddress"]
    assert address.startswith("etcd://") and f"{ETCD}-0.{ETCD}" in address
    masters = e2e.pods(MASTER)
    assert len(masters) == 2 and all(f"--rpc_address={p.ip}" in p.container().argv for p in masters)
    first = leader(e2e)
    assert first is not None
    assert f"the leader at {first.ip}:" in master_ready(e2e)["message"]

    # Served from the pool before the failover.
    assert complete(consumer.ip, PROMPTS["p1"], MAX_TOKENS) == reference["p1"]
    harness.settled(lambda: harness.pool_keys(first.ip, PREFIX), "p1's blocks in the pool")
    harness.reset_prefix_cache(consumer.ip)
    hit = complete(consumer.ip, PROMPTS["p2"], MAX_TOKENS)
    assert hit.token_ids == reference["p2"].token_ids and hit.cached_tokens == PREFIX_HIT

    # SIGKILL the leader's process: no word to anyone. A watcher notes every MasterReady it
    # sees, while requests go on through the failover (each from an empty local cache, so each
    # asks the pool); none may differ from the reference.
    pid = first.container().pid
    assert pid is not None
    watcher = ConditionWatcher(e2e).start()
    os.kill(pid, signal.SIGKILL)
    answers: list[Completion] = []
    deadline = time.monotonic() + FAILOVER_S
    try:
        while not (watcher.recovered() and (now_leader := leader(e2e)) is not None):
            assert time.monotonic() < deadline, f"no failover seen: {watcher.seen}"
            harness.reset_prefix_cache(consumer.ip)
            for key in ("p1", "p2"):
                answer = complete(consumer.ip, PROMPTS[key], MAX_TOKENS)
                assert answer.token_ids == reference[key].token_ids, f"{key} differs during the failover"
                answers.append(answer)
    finally:
        watcher.stop()
    # A live process leads: the standby, or the killed master's container restarted at once
    # (as the kubelet restarts it), whichever etcd's election takes first.
    assert now_leader.container().pid not in (None, pid)
    assert pid not in [c.pid for p in e2e.pods(MASTER) for c in p.containers]
    assert f"the leader at {now_leader.ip}:" in master_ready(e2e)["message"]
    assert answers, "no request ran during the failover"

    # Hits resume on the new leader: a new prefix is saved there, then served from it.
    def resumed() -> bool:
        assert complete(consumer.ip, PROMPTS["q1"], MAX_TOKENS).token_ids == reference["q1"].token_ids
        harness.reset_prefix_cache(consumer.ip)
        answer = complete(consumer.ip, PROMPTS["q2"], MAX_TOKENS)
        assert answer.token_ids == reference["q2"].token_ids
        harness.reset_prefix_cache(consumer.ip)
        return answer.cached_tokens >= PREFIX_HIT

    wait_for(resumed, FAILOVER_S, "hits after the failover", interval=1.0)
    assert harness.pool_keys(now_leader.ip, PREFIX)
