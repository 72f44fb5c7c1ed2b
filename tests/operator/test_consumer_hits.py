"""The hit rate the consumers report, in the pool's status, its printer column and the
operator's gauges.

Pure tests of the parsing, the pods asked and the status; then the asking itself against
stand-in pods on loopback (their ``/metrics`` written by prometheus_client as vLLM's registry
writes it), and the real operator on the emulated API. Real vLLM pods are asked in
``tests/e2e/test_pool.py``, whose status must equal the pod's own counters.
"""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvpool.connector.local.ports import free_port
from kvpool.operator import consumer_hits, names
from kvpool.operator.consumer_hits import (
    ConsumerPod,
    ConsumerTextError,
    api_port,
    consumer_pods,
    hits_status,
    parse_hits,
    percent_text,
    poll_consumers,
    with_hits,
)
from kvpool.operator.crd import build_crd
from kvpool.operator.metric_names import (
    CONSUMER_HIT_TOKENS,
    CONSUMER_LOOKED_UP_TOKENS,
    GRANT_HIT_TOKENS,
    GRANT_LOOKED_UP_TOKENS,
)
from kvpool.operator.metrics import consumer_hit_numbers, grant_hit_numbers
from kvpool.operator.spec import PoolStatus
from testing.kube_api import GRANTS_PATH, NAMESPACE, TENANT_NAMESPACE, Cluster, eventually
from testing.operator_objects import Operator, pool_manifest, pool_spec, vllm_deployment
from tests.operator.test_grants_on_the_api import create_shared_pool, tenant_deployment


def vllm_text(per_engine: list[tuple[float, float]], other: bool = True) -> str:
    """A vLLM ``/metrics`` text with the connector's lookup counters, one series per engine:
    ``(looked-up tokens, hit tokens)``; ``other``: with an unrelated series too."""
    registry = CollectorRegistry()
    labels = ["model_name", "engine"]
    queried = Counter("vllm:kvpool_lookup_query_tokens", "looked up", labels, registry=registry)
    hit = Counter("vllm:kvpool_lookup_hit_tokens", "hit", labels, registry=registry)
    for engine, (q, h) in enumerate(per_engine):
        queried.labels("m", str(engine)).inc(q)
        hit.labels("m", str(engine)).inc(h)
    if other:
        Counter("vllm:prompt_tokens", "prompt", labels, registry=registry).labels("m", "0").inc(999)
    return generate_latest(registry).decode()


def pod(
    name: str,
    ip: str = "127.0.0.1",
    args: tuple[str, ...] = ("--kv-transfer-config", "{}", "--port", "8123"),
    ready: bool = True,
    labels: dict[str, str] | None = None,
    namespace: str = NAMESPACE,
) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": labels or {}},
        "spec": {
            "containers": [
                {"name": "sidecar", "image": "proxy", "args": ["--port", "9"]},
                {"name": "vllm", "image": "vllm", "args": list(args)},
            ]
        },
        "status": {
            "phase": "Running",
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


# --- pure --------------------------------------------------------------------------------------


def test_a_pods_counters_are_summed_over_its_engines_and_nothing_else() -> None:
    hits = parse_hits(vllm_text([(100, 60), (50, 15)]))
    assert (hits.query_tokens, hits.hit_tokens) == (150, 75)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (vllm_text([], other=True), "is the connector loaded"),
        ("this is { not prometheus", "not Prometheus text"),
    ],
)
def test_an_answer_without_the_counters_is_an_error(text: str, says: str) -> None:
    with pytest.raises(ConsumerTextError, match=says):
        parse_hits(text)


@pytest.mark.parametrize(
    ("args", "port"),
    [
        (["--port", "8123"], 8123),
        (["--port=8124"], 8124),
        ([], 8000),  # vLLM's default
        (["--port", "http"], None),
        (["--port", "70000"], None),
        (["--port", "8123", "--port=8125"], 8125),  # the last one, as vLLM reads it
    ],
)
def test_the_api_port_is_the_containers_port_flag(args: list[str], port: int | None) -> None:
    assert api_port({"command": ["python", "-m", "vllm.entrypoints.openai.api_server"], "args": args}) == port


def test_only_ready_pods_at_a_valid_ip_are_asked_on_the_connector_containers_port() -> None:
    pods = [
        pod("a"),
        pod("b", ready=False),
        pod("c", ip="not-an-ip"),
        pod("d", args=("--port", "8123")),  # no connector in it
        pod("e", ip="fd00::5", args=("--kv-transfer-config={}",)),
    ]
    asked = consumer_pods("llm", pods)
    assert asked == [
        ConsumerPod("llm", "a", "127.0.0.1", 8123),
        ConsumerPod("llm", "e", "fd00::5", 8000),
    ]
    assert asked[1].url == "http://[fd00::5]:8000/metrics"
    terminating = pod("f")
    terminating["metadata"]["deletionTimestamp"] = "2026-12-03T00:00:00Z"
    # On the host's network its IP is the node's: never asked, whatever port it names.
    host_network = pod("g")
    host_network["spec"]["hostNetwork"] = True
    assert consumer_pods("llm", [terminating, host_network]) == []


def answer(consumer: str, name: str, queried: float | None, hit: float = 0.0) -> consumer_hits.PodAnswer:
    target = ConsumerPod(consumer, name, "127.0.0.1", 1)
    if queried is None:
        return consumer_hits.PodAnswer(target, problem=f"{name}: no answer")
    return consumer_hits.PodAnswer(target, hits=consumer_hits.PodHits(queried, hit))


def test_the_status_has_each_consumers_rate_and_the_pools_and_is_valid() -> None:
    answers = [answer("a", "a-1", 200, 150), answer("a", "a-2", None), answer("b", "b-1", 200, 50)]
    hits = with_hits({}, hits_status(["a", "b", "c"], answers, {"a": 2, "b": 1}), "t0")["hits"]
    assert hits == {
        "changedAt": "t0",
        "hitRate": "50.0%",
        "hitTokens": 200,
        "lookedUpTokens": 400,
        "consumers": [
            {
                "name": "a",
                "hitRate": "75.0%",
                "hitTokens": 150,
                "lookedUpTokens": 200,
                "pods": "1/2",
                "problem": "a-2: no answer",
            },
            {"name": "b", "hitRate": "25.0%", "hitTokens": 50, "lookedUpTokens": 200, "pods": "1/1"},
            {"name": "c", "hitRate": "-", "hitTokens": 0, "lookedUpTokens": 0, "pods": "0/0"},
        ],
    }
    PoolStatus.model_validate({"hits": hits})
    # The gauges: a consumer none of whose pods answered has no numbers (unknown, not zero).
    assert consumer_hit_numbers({"hits": hits}) == {"a": (150, 200), "b": (50, 200)}
    assert percent_text(1, 3) == "33.3%"


def test_with_tenancy_each_consumer_names_its_grant_and_each_grant_has_its_rate() -> None:
    answers = [answer("a", "a-1", 200, 150), answer("team-b/c", "c-1", 100, 10), answer("b", "b-1", 100, 40)]
    grants = {"a": "own", "b": "own", "team-b/c": "team-b/llm"}
    hits = hits_status(["a", "team-b/c", "b"], answers, {"a": 1, "b": 1, "team-b/c": 1}, grants)
    assert [(c["name"], c["grant"]) for c in hits["consumers"]] == [
        ("a", "own"),
        ("team-b/c", "team-b/llm"),
        ("b", "own"),
    ]
    assert hits["grants"] == [
        {"grant": "own", "hitRate": "63.3%", "hitTokens": 190, "lookedUpTokens": 300},
        {"grant": "team-b/llm", "hitRate": "10.0%", "hitTokens": 10, "lookedUpTokens": 100},
    ]
    assert (hits["hitTokens"], hits["lookedUpTokens"]) == (200, 400)
    PoolStatus.model_validate({"hits": {**hits, "changedAt": "t0"}})
    # The gauges per grant: its consumers that answered, summed; a grant whose consumers
    # all went unanswered has no numbers (unknown, not zero).
    assert grant_hit_numbers({"hits": hits}) == {"own": (190, 300), "team-b/llm": (10, 100)}
    silent = hits_status(["a", "team-b/c"], answers[:1], {"a": 1, "team-b/c": 1}, grants)
    assert grant_hit_numbers({"hits": silent}) == {"own": (150, 200)}
    # Without tenancy: no grant anywhere.
    assert "grants" not in hits_status(["a"], answers[:1], {"a": 1})
    assert grant_hit_numbers({"hits": hits_status(["a"], answers[:1], {"a": 1})}) == {}


def test_numbers_that_hold_still_keep_their_time_and_none_removes_them() -> None:
    def hits(queried: float) -> dict[str, Any]:
        return hits_status(["a"], [answer("a", "a-1", queried, 5)], {"a": 1})

    status = with_hits({"phase": "Ready"}, hits(10), "t0")
    again = with_hits(status, hits(10), "t1")
    assert again == status and again["hits"]["changedAt"] == "t0"
    moved = with_hits(status, hits(20), "t2")
    assert moved["hits"]["changedAt"] == "t2" and moved["hits"]["hitRate"] == "25.0%"
    assert with_hits(status, None, "t3") == {"phase": "Ready"}


def test_kubectl_get_shows_the_pools_hit_rate() -> None:
    columns = build_crd()["spec"]["versions"][0]["additionalPrinterColumns"]
    assert {"name": "Hit rate", "type": "string", "jsonPath": ".status.hits.hitRate"} in columns


# --- asking stand-in pods on loopback ----------------------------------------------------------


class StandInPods:
    """Pods' ``/metrics`` on loopback, one port each: text, an HTTP error, or no answer."""

    def __init__(self) -> None:
        self.texts: dict[int, str | int | None] = {}  # port -> text, HTTP status, or None (hang)
        self.runners: list[web.AppRunner] = []
        self.release = asyncio.Event()

    async def add(self, answer: str | int | None) -> int:
        port = free_port()
        self.texts[port] = answer

        async def metrics(_: web.Request) -> web.StreamResponse:
            said = self.texts[port]
            if said is None:
                await self.release.wait()
                return web.Response(text="")
            if isinstance(said, int):
                return web.Response(status=said)
            return web.Response(text=said)

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        self.runners.append(runner)
        return port


@pytest_asyncio.fixture
async def pods() -> AsyncIterator[StandInPods]:
    stand_in = StandInPods()
    yield stand_in
    stand_in.release.set()
    for runner in stand_in.runners:
        await runner.cleanup()


@pytest.mark.asyncio
async def test_each_pod_is_asked_once_within_the_deadline_and_says_why_not(
    pods: StandInPods, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = vllm_text([(40, 30)])
    limit = len(text) + 10
    ok = await pods.add(text)
    error = await pods.add(503)
    hanging = await pods.add(None)
    no_connector = await pods.add(vllm_text([]))
    large = await pods.add("#" * limit + "\n")
    monkeypatch.setattr(consumer_hits, "MAX_BODY", limit)
    targets = [
        ConsumerPod("llm", name, "127.0.0.1", port)
        for name, port in (
            ("ok", ok),
            ("error", error),
            ("hang", hanging),
            ("bare", no_connector),
            ("big", large),
        )
    ]
    answers = await poll_consumers(targets, timeout=1.0)
    by_pod = {a.pod.pod: a for a in answers}
    assert by_pod["ok"].hits == consumer_hits.PodHits(40, 30)
    assert by_pod["error"].problem == "error: HTTP 503"
    assert by_pod["hang"].problem == "hang: no answer within 1 s"
    assert "is the connector loaded" in str(by_pod["bare"].problem)
    assert by_pod["big"].problem == f"big: /metrics larger than {limit} bytes"
    assert [a.pod for a in answers] == targets  # in order, one answer each


# --- the real operator on the emulated API -----------------------------------------------------

OBSERVING = {"observe_interval": 0.3, "observe_timeout": 1.0}


def operator_hit_series(url: str, per: str = "consumer") -> dict[tuple[str, str], float]:
    """The operator's hit gauges per ``per`` ("consumer" or "grant"): (series, label) -> value."""
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    return {
        (s.name, s.labels[per]): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith(f"kvpool_operator_{per}_") and s.name.endswith("_tokens")
    }


@pytest.mark.asyncio
@pytest.mark.parametrize("operator_config", [OBSERVING])
async def test_the_operator_writes_what_the_consumers_pods_report(
    cluster: Cluster, operator: Operator, pods: StandInPods
) -> None:
    serving = await pods.add(vllm_text([(300, 120)]))
    failing = await pods.add(500)
    await cluster.create(vllm_deployment())
    await cluster.create(pool_manifest(spec=pool_spec()))
    consumer_labels = {"app": "llm", names.LABEL_POOL: "pool"}
    for name, port in (("llm-a", serving), ("llm-b", failing)):
        args = ("--kv-transfer-config", "{}", "--port", str(port))
        await cluster.create(pod(name, args=args, labels=consumer_labels))
    # Another Deployment's pod of the same pool label is not the consumer's.
    await cluster.create(pod("other", labels={"app": "other", names.LABEL_POOL: "pool"}))

    def hits() -> dict[str, Any]:
        cluster.settle()
        return cluster.pool_status("pool").get("hits") or {}

    seen = await eventually(lambda: hits().get("hitTokens") == 120 and hits(), what="the consumer's hits")
    assert seen["hitRate"] == "40.0%" and seen["lookedUpTokens"] == 300
    [entry] = seen["consumers"]
    assert entry["name"] == "llm" and entry["pods"] == "1/2" and entry["problem"] == "llm-b: HTTP 500"
    series = await eventually(lambda: operator_hit_series(operator.metrics_url), what="the hit gauges")
    assert series == {(CONSUMER_HIT_TOKENS.name, "llm"): 120, (CONSUMER_LOOKED_UP_TOKENS.name, "llm"): 300}

    # The consumers serve more: the next poll shows it.
    pods.texts[serving] = vllm_text([(400, 220)])
    await eventually(lambda: hits().get("hitRate") == "55.0%", what="55% after more hits")


@pytest.mark.asyncio
@pytest.mark.parametrize("operator_config", [OBSERVING])
async def test_another_namespaces_consumer_is_asked_and_each_grant_sees_its_rate(
    cluster: Cluster, operator: Operator, pods: StandInPods
) -> None:
    tenant = TENANT_NAMESPACE
    await create_shared_pool(cluster, tenant_deployment(tenant, "chat"))
    own, theirs = await pods.add(vllm_text([(300, 120)])), await pods.add(vllm_text([(100, 90)]))
    await cluster.create(pod("llm-a", args=port_args(own), labels={"app": "llm", names.LABEL_POOL: "pool"}))
    granted = {"app": "chat", names.LABEL_POOL: "pool", names.LABEL_POOL_NAMESPACE: NAMESPACE}
    await cluster.create(pod("chat-a", args=port_args(theirs), labels=granted, namespace=tenant))
    # A pod in the tenant's namespace labelled for a pool of the same name there: not asked.
    stranger = await pods.add(vllm_text([(1000, 1000)]))
    same_name = {"app": "chat", names.LABEL_POOL: "pool"}
    await cluster.create(pod("chat-b", args=port_args(stranger), labels=same_name, namespace=tenant))

    def hits() -> dict[str, Any]:
        cluster.settle()
        return cluster.pool_status("pool").get("hits") or {}

    seen = await eventually(lambda: hits().get("hitTokens") == 210 and hits(), what="both consumers' hits")
    by_name = {c["name"]: c for c in seen["consumers"]}
    chat = by_name[f"{tenant}/chat"]
    assert chat["grant"] == f"{tenant}/llm" and chat["pods"] == "1/1"
    assert by_name["llm"]["grant"] == "team-a"
    assert {g["grant"]: g["hitRate"] for g in seen["grants"]} == {"team-a": "40.0%", f"{tenant}/llm": "90.0%"}
    # The tenant reads its own grant's rate on its grant.
    # (A later poll its pod does not answer in time shows the grant's numbers as unknown,
    # "-" and 0, until the next one: wait for them rather than take the first written.)
    want = {"hitRate": "90.0%", "hitTokens": 90, "lookedUpTokens": 100}
    await eventually(
        lambda: ((cluster.get(GRANTS_PATH, "llm", tenant) or {}).get("status") or {}).get("hits") == want,
        what="the grant's hits",
    )
    # Each grant's numbers are written before the pool's: whoever reads the pool's finds the
    # grant's already there (read above at once, as a tenant would).
    order = [
        r.resource.plural
        for r in cluster.writes()
        if r.subresource == "status"
        and r.resource is not None
        and (
            (r.resource.plural == names.GRANTS.plural and r.name == "llm" and hit_tokens_written(r) == 90)
            or (r.resource.plural == names.POOLS.plural and r.name == "pool" and hit_tokens_written(r) == 210)
        )
    ]
    assert order[:2] == [names.GRANTS.plural, names.POOLS.plural], order
    # And the operator exports each grant's numbers, for the Pool dashboard.
    series = await eventually(
        lambda: (
            len(operator_hit_series(operator.metrics_url, "grant")) == 4
            and operator_hit_series(operator.metrics_url, "grant")
        ),
        what="the grant hit gauges",
    )
    assert series == {
        (GRANT_HIT_TOKENS.name, "team-a"): 120,
        (GRANT_LOOKED_UP_TOKENS.name, "team-a"): 300,
        (GRANT_HIT_TOKENS.name, f"{tenant}/llm"): 90,
        (GRANT_LOOKED_UP_TOKENS.name, f"{tenant}/llm"): 100,
    }


def hit_tokens_written(request: Any) -> Any:
    """``status.hits.hitTokens`` as a status write sets it (None: it sets none)."""
    data = request.data if isinstance(request.data, dict) else {}
    return ((data.get("status") or {}).get("hits") or {}).get("hitTokens")


def port_args(port: int) -> tuple[str, ...]:
    return ("--kv-transfer-config", "{}", "--port", str(port))
