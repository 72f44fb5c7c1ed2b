"""The hit rate a pool's consumers report: their own ``/metrics``, summed per consumer.

Each consumer pod's vLLM serves the connector's counters on its API port (``--port`` of
the container that runs the connector; vLLM's default 8000 without it). The operator's
observation timer asks each ready consumer pod of the pool for ``GET /metrics`` at the
pod's own IP (as its API object says), within the poll's deadline, and keeps two numbers
per pod (never a label, prompt text or token id):

* ``vllm:kvpool_lookup_query_tokens_total``: prompt tokens past the local hit that lookups
  asked the pool for;
* ``vllm:kvpool_lookup_hit_tokens_total``: the tokens the reconciled hybrid hit granted.

A consumer's hit rate is their ratio summed over its pods, since each pod started (the
dashboards show it over a window). ``status.hits`` holds it per consumer and for the pool
(the ``Hit rate`` column of ``kubectl get``). A pod that does not answer (a NetworkPolicy
of the namespace that keeps the operator out, a pod still starting) is counted as asked but
not answered, with the first reason; it never fails the pool.
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvpool.connector.contract import metric_names as m
from kvpool.operator.consumers import FLAG_SPELLINGS, container_tokens, flag_values
from kvpool.operator.grant_usage import with_changed_at
from kvpool.operator.leader import excerpt

HIT_TOKENS = m.LOOKUP_HIT_TOKENS.exported
QUERY_TOKENS = m.LOOKUP_QUERY_TOKENS.exported
METRICS_PATH = "/metrics"
VLLM_DEFAULT_PORT = 8000
# vLLM's /metrics is a few hundred kilobytes at most; a larger body is not read.
MAX_BODY = 8 << 20
# At most this many pods are asked per pass (the rest count as not asked).
MAX_PODS = 256


class ConsumerTextError(ValueError):
    """A consumer's answer has none of the connector's lookup counters."""


@dataclass(frozen=True)
class PodHits:
    """One pod's counters: tokens looked up past its local hit, and tokens the pool served."""

    query_tokens: float
    hit_tokens: float


@dataclass(frozen=True)
class ConsumerPod:
    """Whom to ask: a consumer's pod, at its IP and API port."""

    consumer: str
    pod: str
    ip: str
    port: int

    @property
    def url(self) -> str:
        host = f"[{self.ip}]" if ":" in self.ip else self.ip
        return f"http://{host}:{self.port}{METRICS_PATH}"


@dataclass(frozen=True)
class PodAnswer:
    """What one pod said: its counters, or why there are none."""

    pod: ConsumerPod
    hits: PodHits | None = None
    problem: str | None = None


def parse_hits(text: str) -> PodHits:
    """The lookup counters of a vLLM ``/metrics`` text, summed over every series (engines,
    models); raises ``ConsumerTextError`` when neither is there (no connector loaded)."""
    sums = {HIT_TOKENS: 0.0, QUERY_TOKENS: 0.0}
    seen = False
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in sums:
                    sums[sample.name] += float(sample.value)
                    seen = True
    except ValueError as exc:
        raise ConsumerTextError(f"not Prometheus text: {exc}") from exc
    if not seen:
        raise ConsumerTextError(f"no {QUERY_TOKENS} series: is the connector loaded?")
    return PodHits(query_tokens=sums[QUERY_TOKENS], hit_tokens=sums[HIT_TOKENS])


def connector_container(pod: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The pod's container that runs vLLM with a ``--kv-transfer-config`` (the operator's)."""
    for container in (pod.get("spec") or {}).get("containers") or []:
        if flag_values(container_tokens(container), FLAG_SPELLINGS):
            return container
    return None


def api_port(container: Mapping[str, Any]) -> int | None:
    """The container's vLLM API port: its ``--port`` (the last one, as vLLM reads it; vLLM's
    default 8000 without one); None when the flag's value is not a port."""
    values = flag_values(container_tokens(container), ("--port",))
    if not values:
        return VLLM_DEFAULT_PORT
    try:
        port = int(values[-1])
    except ValueError:
        return None
    return port if 0 < port < 65536 else None


def pod_ready(pod: Mapping[str, Any]) -> bool:
    status = pod.get("status") or {}
    if (pod.get("metadata") or {}).get("deletionTimestamp") or status.get("phase") != "Running":
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])


def consumer_pods(consumer: str, pods: Sequence[Mapping[str, Any]]) -> list[ConsumerPod]:
    """The ready pods of one consumer to ask: each at its own IP (a valid address, from the
    pod's status) and the API port of its connector container. A pod on the host's network is
    never asked: its IP is the node's, and the port is the pod author's to choose."""
    out = []
    for pod in pods:
        container = connector_container(pod)
        if not pod_ready(pod) or container is None or (pod.get("spec") or {}).get("hostNetwork"):
            continue
        port = api_port(container)
        try:
            ip = ipaddress.ip_address(str((pod.get("status") or {}).get("podIP")))
        except ValueError:
            continue
        if port is not None:
            out.append(ConsumerPod(consumer, str((pod.get("metadata") or {}).get("name")), str(ip), port))
    return out


async def _ask(session: aiohttp.ClientSession, pod: ConsumerPod) -> PodAnswer:
    try:
        async with session.get(pod.url, allow_redirects=False) as response:
            if response.status != 200:
                return PodAnswer(pod, problem=f"{pod.pod}: HTTP {response.status}")
            body = await response.content.read(MAX_BODY + 1)
            if len(body) > MAX_BODY:
                return PodAnswer(pod, problem=f"{pod.pod}: /metrics larger than {MAX_BODY} bytes")
            return PodAnswer(pod, hits=parse_hits(body.decode("utf-8", "replace")))
    except ConsumerTextError as exc:
        return PodAnswer(pod, problem=f"{pod.pod}: {exc}")
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        return PodAnswer(pod, problem=f"{pod.pod}: no answer: {excerpt(str(exc) or type(exc).__name__)}")


async def poll_consumers(pods: Sequence[ConsumerPod], *, timeout: float) -> list[PodAnswer]:
    """Ask every pod at once, all within ``timeout`` seconds; never raises for an answer."""
    asked = list(pods)[:MAX_PODS]
    if not asked:
        return []
    client_timeout = aiohttp.ClientTimeout(total=timeout)
    async with aiohttp.ClientSession(timeout=client_timeout) as session:
        tasks = [asyncio.create_task(_ask(session, pod)) for pod in asked]
        done, pending = await asyncio.wait(tasks, timeout=timeout)
        for task in pending:
            task.cancel()
        answers = []
        for pod, task in zip(asked, tasks, strict=True):
            if task in done and not task.cancelled():
                answers.append(task.result())
            else:
                answers.append(PodAnswer(pod, problem=f"{pod.pod}: no answer within {timeout:g} s"))
        return answers


def percent_text(hit: float, queried: float) -> str:
    """A hit rate for people: ``"62.5%"``, or ``"-"`` before any lookup."""
    return f"{100.0 * hit / queried:.1f}%" if queried > 0 else "-"


def _totals(entries: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    hit = sum(e["hitTokens"] for e in entries)
    queried = sum(e["lookedUpTokens"] for e in entries)
    return {"hitRate": percent_text(hit, queried), "hitTokens": hit, "lookedUpTokens": queried}


def _entry(name: str, answers: Sequence[PodAnswer], expected: int) -> dict[str, Any]:
    got = [a.hits for a in answers if a.hits is not None]
    queried = sum(h.query_tokens for h in got)
    hit = sum(h.hit_tokens for h in got)
    problems = [a.problem for a in answers if a.problem]
    entry: dict[str, Any] = {
        "name": name,
        "hitRate": percent_text(hit, queried),
        "hitTokens": int(hit),
        "lookedUpTokens": int(queried),
        "pods": f"{len(got)}/{expected}",
    }
    if problems:
        entry["problem"] = problems[0][:512]
    return entry


def hits_status(
    consumers: Sequence[str],
    answers: Sequence[PodAnswer],
    asked: Mapping[str, int],
    grants: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """``status.hits`` from one poll (without ``changedAt``): per consumer (in ``consumers``'
    order), per grant (``grants``: consumer -> its grant, where tenancy is on; in the order
    of their first consumer) and for the pool; ``asked``: the ready pods of each consumer."""
    by_consumer: dict[str, list[PodAnswer]] = {name: [] for name in consumers}
    for answer in answers:
        by_consumer.setdefault(answer.pod.consumer, []).append(answer)
    entries = [_entry(name, by_consumer[name], asked.get(name, 0)) for name in consumers]
    grants = grants or {}
    by_grant: dict[str, list[dict[str, Any]]] = {}
    for entry in entries:
        if grants.get(entry["name"]):
            entry["grant"] = grants[entry["name"]]
            by_grant.setdefault(entry["grant"], []).append(entry)
    out: dict[str, Any] = {**_totals(entries), "consumers": entries}
    if by_grant:
        out["grants"] = [{"grant": grant, **_totals(own)} for grant, own in by_grant.items()]
    return out


def with_hits(status: Mapping[str, Any], hits: dict[str, Any] | None, now: str) -> dict[str, Any]:
    """``status`` with ``hits`` (None: none kept) and its ``changedAt``: the same numbers keep
    theirs, so consumers whose counters hold still are not written."""
    out = {k: v for k, v in status.items() if k != "hits"}
    if hits is not None:
        out["hits"] = with_changed_at(hits, status.get("hits"), now)
    return out
