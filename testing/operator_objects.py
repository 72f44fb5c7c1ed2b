"""Operator test data and helpers: sample pools and vLLM Deployments, and what tests ask of them.

The emulated cluster and the operator running against it live in ``testing.kube_api``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from kvpool.operator import names
from kvpool.operator.consumers import FLAG
from kvpool.operator.names import POOLS, api_resource_of
from testing.kube_api import (
    DEPLOYMENTS_PATH,
    NAMESPACE,
    Cluster,
    OperatorThread,
    eventually,
)
from testing.server_side import builtin_defaults


@dataclass
class Operator:
    """A running operator and where to reach its endpoints."""

    thread: OperatorThread
    liveness_url: str
    metrics_url: str
    webhook_url: str | None = None


def pool_manifest(name: str = "pool", spec: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": f"{POOLS.group}/{POOLS.version}",
        "kind": POOLS.kind,
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": spec if spec is not None else pool_spec(),
    }


def layout(*groups: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """A whole declaration, as ``kvpool-layout`` prints one: every group's page size, the
    model, a concrete dtype and the cache block size (``extra`` replaces any of them)."""
    whole = [{"page_size_bytes": 65536, **g} for g in (groups or [full_group()])]
    block = min(g["block_size"] for g in whole)
    return {"model": "org/model", "dtype": "bfloat16", "cache_block_size": block, "groups": whole, **extra}


def full_group(block_size: int = 16) -> dict[str, Any]:
    return {"kind": "full", "block_size": block_size}


def consumer(name: str = "llm") -> dict[str, Any]:
    """A consumer of a hybrid model (full attention and a sliding window) in container ``vllm``."""
    return {
        "name": name,
        "container": "vllm",
        "layout": layout(full_group(), {"kind": "sliding_window", "block_size": 16, "sliding_window": 4096}),
    }


def pool_spec(**overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "image": "registry.example/mooncake:0.3.13",
        "store": {"segmentSize": "1GB", "replicas": 2},
        "connector": {"cache_prefix": "team-a"},
        "consumers": [consumer()],
    }
    spec.update(overrides)
    return spec


ORIGINAL_KV_CONFIG = '{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both"}'


def vllm_deployment(
    name: str = "llm", allow_pool: str | None = "pool", kv_config: str | None = None
) -> dict[str, Any]:
    """A vLLM Deployment whose owner lets pool ``allow_pool`` patch it (None: no pool), with
    its own ``--kv-transfer-config`` when ``kv_config`` is given (a pool refuses that one)."""
    labels = {"app": name}
    own_flag = ["--kv-transfer-config", kv_config] if kv_config is not None else []
    if allow_pool is not None:
        labels[names.LABEL_ALLOW_POOL] = allow_pool
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": labels},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {
                    "containers": [
                        {
                            "name": "vllm",
                            "image": "vllm/vllm-openai:v0.11.0",
                            "args": [
                                "--model",
                                "org/model",
                                *own_flag,
                                "--port",
                                "8000",
                            ],
                            "env": [
                                {"name": "HF_HOME", "value": "/cache"},
                                {"name": "PYTHONHASHSEED", "value": "42"},
                            ],
                        },
                        {"name": "sidecar", "image": "busybox", "args": ["sleep", "inf"]},
                    ],
                },
            },
        },
    }


def stored(obj: dict[str, Any]) -> dict[str, Any]:
    """``obj`` as the API server stores it: with the server-side defaults of its kind."""
    return builtin_defaults(obj)


def path_of(obj: dict[str, Any]) -> str:
    resource = api_resource_of(obj)
    return f"{resource.api_version}/{resource.plural}"


def template(deployment: dict[str, Any] | None) -> dict[str, Any]:
    assert deployment is not None
    return deployment["spec"]["template"]


def kv_flags(deployment: dict[str, Any] | None) -> list[str]:
    container = template(deployment)["spec"]["containers"][0]
    return [a for a in container.get("args", []) if a.startswith(FLAG)]


def as_created(cluster: Cluster, name: str) -> dict[str, Any]:
    first = cluster.history(DEPLOYMENTS_PATH, name)[0]
    return copy.deepcopy(first.raw)


async def converge(cluster: Cluster, name: str = "pool", generation: int | None = None) -> dict:
    """Play the Deployment controller until the pool is Ready (at ``generation``) and
    kopf has finished handling its spec."""

    def ready() -> dict[str, Any]:
        cluster.settle()
        status = cluster.pool_status(name)
        phase, seen, handled = status.get("phase"), status.get("observedGeneration"), cluster.handled(name)
        if phase != "Ready" or (generation is not None and seen != generation) or not handled:
            unmet = [
                f"{c.get('type')}={c.get('status')} ({c.get('reason')})"
                for c in status.get("conditions") or []
            ]
            # The last of these is what a failure reports.
            raise AssertionError(f"phase {phase}, observedGeneration {seen}, handled {handled}: {unmet}")
        return status

    return await eventually(ready, what=f"{name} is Ready")


def pool_pod(
    name: str,
    ip: str,
    component: str,
    pool: str = "pool",
    phase: str | None = None,
    ready: bool | None = None,
    all_ips: bool = False,
) -> dict[str, Any]:
    """A Pod of ``pool``'s ``component`` (``names.MASTER``/``names.STORE``) at ``ip``, as the API
    would hold it: ``phase`` and a Ready condition when given, ``podIPs`` too with ``all_ips``."""
    status: dict[str, Any] = {"podIP": ip}
    if all_ips:
        status["podIPs"] = [{"ip": ip}]
    if phase is not None:
        status["phase"] = phase
    if ready is not None:
        status["conditions"] = [{"type": "Ready", "status": "True" if ready else "False"}]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": NAMESPACE,
            "labels": {names.LABEL_POOL: pool, names.LABEL_COMPONENT: component},
        },
        "spec": {"containers": [{"name": component, "image": "mooncake"}]},
        "status": status,
    }
