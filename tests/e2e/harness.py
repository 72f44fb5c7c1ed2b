"""The end-to-end cluster: the emulated API, the real operator and the test node, each on a
thread of its own, so a test is plain synchronous code that talks to them over HTTP.

Also what the scenarios share: the API paths of the kinds they write, waiting, completions
and metrics from a vLLM server, and the manifests (a pool, a vLLM Deployment, an etcd
StatefulSet).
"""

from __future__ import annotations

import asyncio
import copy
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import kmock

from kvpool.operator import names
from kvpool.operator.names import GRANTS, POOLS
from kvpool.operator.rbac import implied_permissions
from testing.kube_api import WRITE_METHODS, ApiServer, by_operator, emulated_cluster
from tests.chart.grants import Grant, refused

NAMESPACE = "team-a"
TENANT_NAMESPACE = "team-b"  # another namespace the operator watches: a tenant's grants
T = TypeVar("T")
# (apiVersion, kind) -> (API path prefix, plural)
PATHS = {
    ("apps/v1", "Deployment"): ("/apis/apps/v1", "deployments"),
    ("apps/v1", "StatefulSet"): ("/apis/apps/v1", "statefulsets"),
    ("v1", "Service"): ("/api/v1", "services"),
    ("v1", "ConfigMap"): ("/api/v1", "configmaps"),
    ("v1", "Pod"): ("/api/v1", "pods"),
    ("v1", "Event"): ("/api/v1", "events"),
    (POOLS.api_version, POOLS.kind): (f"/apis/{POOLS.group}/{POOLS.version}", POOLS.plural),
    (GRANTS.api_version, GRANTS.kind): (f"/apis/{GRANTS.group}/{GRANTS.version}", GRANTS.plural),
}


def path(api_version: str, kind: str, name: str | None = None, namespace: str = NAMESPACE) -> str:
    prefix, plural = PATHS[(api_version, kind)]
    out = f"{prefix}/namespaces/{namespace}/{plural}"
    return f"{out}/{name}" if name else out


def wait_for(check: Callable[[], T], timeout: float, what: str, interval: float = 0.5) -> T:
    """Poll ``check`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            result = check()
            if result:
                return result
            last = result
        except (AssertionError, KeyError, IndexError, OSError, ValueError) as exc:
            last = exc
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached in {timeout:g}s: {what} (last: {last!r})")
        time.sleep(interval)


def settled(look: Callable[[], list[str]], what: str, timeout: float = 60.0) -> list[str]:
    """What ``look`` returns once it is not empty and two looks a second apart agree (e.g. the
    pool's keys once a request's saves have all landed)."""

    def steady() -> list[str] | None:
        first = look()
        time.sleep(1.0)
        second = look()
        return second if second and first == second else None

    return wait_for(steady, timeout, what)


def pool_keys(master_ip: str, prefix: str) -> list[str]:
    """Keys under ``prefix`` in the pool, from the master's admin API (its metrics port)."""
    with urllib.request.urlopen(f"http://{master_ip}:9003/get_all_keys", timeout=10) as response:
        return [k for k in response.read().decode().split() if k.startswith(prefix)]


class SessionApiServer(ApiServer):
    """The emulated API for a whole session: kmock's request history (matched against every
    new request, so ever slower) cut to the current request, and what the RBAC check needs of
    the operator's requests kept instead."""

    @property
    def operator_requests(self) -> list[tuple[str, str, Any]]:
        """(method, URL, body) of each request the operator sent."""
        return self.__dict__.setdefault("operator_requests", [])

    async def _handle(self, request: kmock.Request) -> Any:
        if by_operator(request):
            body = request.data if request.method.upper() in WRITE_METHODS else None
            self.operator_requests.append((request.method.upper(), str(request.url), copy.deepcopy(body)))
        del self._requests[:-1]
        return await super()._handle(request)

    def unauthorised(self, granted: set[Grant]) -> list[str]:
        """The operator's requests that ``granted`` (what the chart's rendered roles give its
        ServiceAccount, namespace by namespace) and the admission checks on them would refuse."""
        requests = [(m, url, implied_permissions(m, body)) for m, url, body in self.operator_requests]
        return refused(requests, granted)


class ApiThread:
    """The emulated API (``SessionApiServer``) on 127.0.0.1, on its own thread."""

    def __init__(self) -> None:
        self.api: SessionApiServer | None = None
        self.url = ""
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), name="kmock", daemon=True)

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        async with emulated_cluster(SessionApiServer) as cluster:
            assert isinstance(cluster.api, SessionApiServer)
            self.api = cluster.api
            self.url = cluster.url
            self._ready.set()
            await self._stop.wait()

    def start(self) -> ApiThread:
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the emulated API did not start")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)


class Kube:
    """A plain JSON client of the emulated API (what ``kubectl`` would send)."""

    def __init__(self, url: str):
        self.url = url

    def _request(
        self, method: str, url_path: str, body: Any = None, content: str = "application/json"
    ) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + url_path, data=data, method=method, headers={"Content-Type": content}
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read() or b"null")

    def get(self, url_path: str) -> dict[str, Any] | None:
        try:
            return self._request("GET", url_path)
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise

    def create(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        return self._request(
            "POST", path(obj["apiVersion"], obj["kind"], namespace=meta.get("namespace", NAMESPACE)), obj
        )

    def patch(self, url_path: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        return self._request("PATCH", url_path, patch, "application/merge-patch+json")

    def delete(self, url_path: str) -> None:
        try:
            self._request("DELETE", url_path)
        except urllib.error.HTTPError as exc:
            if exc.code != 404:
                raise

    def pool(self, name: str) -> dict[str, Any] | None:
        return self.get(path(POOLS.api_version, POOLS.kind, name))

    def deployment(self, name: str) -> dict[str, Any] | None:
        return self.get(path("apps/v1", "Deployment", name))

    def events(self, involving: str) -> list[dict[str, Any]]:
        """The namespace's Events about the object named ``involving``, oldest first."""
        listed = self.get(path("v1", "Event")) or {}
        return [
            e for e in listed.get("items") or [] if (e.get("involvedObject") or {}).get("name") == involving
        ]

    def condition(self, pool: str, kind: str) -> dict[str, Any]:
        for item in ((self.pool(pool) or {}).get("status") or {}).get("conditions") or []:
            if item["type"] == kind:
                return item
        return {}


# --- vLLM ----------------------------------------------------------------------------------
SERVED_NAME = "llm"
VLLM_PORT = 8000


@dataclass(frozen=True)
class Completion:
    """One greedy completion: the tokens, and how many prompt tokens vLLM did not compute."""

    token_ids: tuple[int, ...]
    cached_tokens: int


def _post(url: str, body: Mapping[str, Any] | None = None, timeout: float = 120.0) -> Any:
    request = urllib.request.Request(
        url, data=json.dumps(body or {}).encode(), method="POST", headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        raw = response.read()
    return json.loads(raw) if raw.strip() else None


def complete(address: str, prompt: list[int], max_tokens: int) -> Completion:
    """A greedy completion of token ids from the vLLM server at ``address``."""
    body = {
        "model": SERVED_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    answer = _post(f"http://{address}:{VLLM_PORT}/v1/completions", body)
    details = (answer.get("usage") or {}).get("prompt_tokens_details") or {}
    return Completion(tuple(answer["choices"][0]["token_ids"]), int(details.get("cached_tokens") or 0))


def reset_prefix_cache(address: str) -> None:
    """Empty the server's own prefix cache (vLLM's development endpoint)."""
    _post(f"http://{address}:{VLLM_PORT}/reset_prefix_cache")


def metrics(address: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The server's ``/metrics`` samples: (name, labels without model_name/engine) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{address}:{VLLM_PORT}/metrics", timeout=30) as response:
        text = response.read().decode()
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(
                sorted((k, v) for k, v in sample.labels.items() if k not in ("model_name", "engine"))
            )
            out[(sample.name, labels)] = out.get((sample.name, labels), 0.0) + sample.value
    return out


def metric_total(
    samples: Mapping[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str
) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    return sum(
        value
        for (sample, sample_labels), value in samples.items()
        if sample == name and set(labels.items()) <= set(sample_labels)
    )


# --- manifests -----------------------------------------------------------------------------
def vllm_args(model: Path) -> list[str]:
    """How the scenarios' vLLM CPU servers run the tiny model (greedy-comparable, eager, small)."""
    return [
        "--model", str(model),
        "--served-model-name", SERVED_NAME,
        "--port", str(VLLM_PORT),
        "--skip-tokenizer-init",
        "--enforce-eager",
        "--dtype", "float32",
        "--block-size", "32",
        "--max-model-len", "1024",
        "--max-num-seqs", "4",
        "--max-num-batched-tokens", "1024",
        "--seed", "0",
        "--enable-prompt-tokens-details",
        "--disable-uvicorn-access-log",
    ]  # fmt: skip


def vllm_deployment(name: str, model: Path, allow_pool: str | None, replicas: int = 1) -> dict[str, Any]:
    """A vLLM CPU server Deployment, as a user writes it; ``allow_pool``: the pool it lets patch it."""
    labels = {"app": name}
    if allow_pool is not None:
        labels[names.LABEL_ALLOW_POOL] = allow_pool
    health = {"httpGet": {"path": "/health", "port": "http"}}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": labels},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {
                    "terminationGracePeriodSeconds": 15,
                    "containers": [
                        {
                            "name": "vllm",
                            "image": "vllm/vllm-openai-cpu:v0.32.0",
                            "command": ["python", "-m", "vllm.entrypoints.openai.api_server"],
                            "args": vllm_args(model),
                            "env": [
                                {"name": "VLLM_CPU_KVCACHE_SPACE", "value": "1"},
                                # The model's worker in the engine core's process: one
                                # vLLM import fewer per start on the test node's two cores
                                # (the serving benchmark runs servers with both processes).
                                {"name": "VLLM_ENABLE_V1_MULTIPROCESSING", "value": "0"},
                                {
                                    "name": "VLLM_HOST_IP",
                                    "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}},
                                },
                                {"name": "VLLM_SERVER_DEV_MODE", "value": "1"},
                                {"name": "VLLM_NO_USAGE_STATS", "value": "1"},
                                {"name": "DO_NOT_TRACK", "value": "1"},
                                {"name": "HF_HUB_OFFLINE", "value": "1"},
                            ],
                            "ports": [{"name": "http", "containerPort": VLLM_PORT}],
                            "startupProbe": {**health, "periodSeconds": 1, "failureThreshold": 900},
                            "readinessProbe": {**health, "periodSeconds": 2},
                            "livenessProbe": {**health, "periodSeconds": 10, "failureThreshold": 3},
                        }
                    ],
                },
            },
        },
    }


def pool_manifest(name: str, spec: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": POOLS.api_version,
        "kind": POOLS.kind,
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": dict(spec),
    }


def pool_spec(consumer: str, layout: Mapping[str, Any], **overrides: Any) -> dict[str, Any]:
    """A pool of one master and two 64 MiB stores, with ``consumer`` (of ``layout``) using it."""
    spec: dict[str, Any] = {
        "image": "registry.example/mooncake:0.3.7",
        "store": {"replicas": 2, "segmentSize": "64MB"},
        "connector": {"cache_prefix": f"e2e-{consumer}"},
        "consumers": [{"name": consumer, "container": "vllm", "layout": dict(layout)}],
    }
    spec.update(overrides)
    return spec


ETCD_CLIENT_PORT = 2379
ETCD_PEER_PORT = 2380


def etcd_manifests(name: str = "etcd", members: int = 3) -> list[dict[str, Any]]:
    """A headless Service and an etcd StatefulSet of ``members`` (Debian's ``etcd``), each member
    named ``<name>-<i>.<name>`` in cluster DNS and listening on its own pod address."""
    peers = ",".join(
        f"{name}-{i}=http://{name}-{i}.{name}.{NAMESPACE}.svc.cluster.local:{ETCD_PEER_PORT}"
        for i in range(members)
    )
    fqdn = f"$(POD_NAME).{name}.{NAMESPACE}.svc.cluster.local"
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": {"app": name}},
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {"app": name},
            "ports": [
                {"name": "client", "port": ETCD_CLIENT_PORT},
                {"name": "peer", "port": ETCD_PEER_PORT},
            ],
        },
    }
    statefulset = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": {"app": name}},
        "spec": {
            "serviceName": name,
            "replicas": members,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {
                    "terminationGracePeriodSeconds": 5,
                    "containers": [
                        {
                            "name": "etcd",
                            "image": "registry.k8s.io/etcd:3.4.23-0",
                            "command": ["etcd"],
                            "args": [
                                "--name=$(POD_NAME)",
                                "--data-dir=/var/lib/etcd/data",
                                f"--listen-client-urls=http://$(POD_IP):{ETCD_CLIENT_PORT}",
                                f"--advertise-client-urls=http://{fqdn}:{ETCD_CLIENT_PORT}",
                                f"--listen-peer-urls=http://$(POD_IP):{ETCD_PEER_PORT}",
                                f"--initial-advertise-peer-urls=http://{fqdn}:{ETCD_PEER_PORT}",
                                f"--initial-cluster={peers}",
                                "--initial-cluster-state=new",
                                f"--initial-cluster-token={name}-e2e",
                                "--listen-metrics-urls=http://$(POD_IP):2381",
                            ],
                            "env": [
                                {
                                    "name": "POD_NAME",
                                    "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}},
                                },
                                {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                            ],
                            "ports": [
                                {"name": "client", "containerPort": ETCD_CLIENT_PORT},
                                {"name": "peer", "containerPort": ETCD_PEER_PORT},
                                {"name": "metrics", "containerPort": 2381},
                            ],
                            "readinessProbe": {
                                "httpGet": {"path": "/health", "port": "metrics"},
                                "periodSeconds": 1,
                            },
                            "volumeMounts": [{"name": "data", "mountPath": "/var/lib/etcd"}],
                        }
                    ],
                    "volumes": [{"name": "data", "emptyDir": {}}],
                },
            },
        },
    }
    return [service, statefulset]
