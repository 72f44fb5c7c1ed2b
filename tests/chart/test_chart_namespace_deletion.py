"""A watched namespace deleted with its pools in it: the operator lets them go.

``kubectl delete namespace team-a`` in the chart's default (namespaced) mode: the namespace
controller deletes the operator's Role and RoleBinding there at once (they have no finalizer),
then waits for the pools' finalizers. The operator can then do nothing in team-a but what the
chart grants cluster-wide (``patch`` on pools: removing the finalizer). These tests run the
real operator against the emulated API with the chart's rendered RBAC enforced: each operator
request that the bindings left do not allow is answered 403, as the API server would.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kmock
import pytest

from kvpool.operator.app import OperatorOptions
from kvpool.operator.names import POOLS
from kvpool.operator.rbac import RULES, Permission, implied_permissions
from testing.kube_api import (
    DEPLOYMENTS_PATH,
    GRANTS_PATH,
    NAMESPACE,
    POOLS_PATH,
    TENANT_NAMESPACE,
    ApiServer,
    by_operator,
    emulated_cluster,
    eventually,
    quick_options,
    running_operator,
    write_kubeconfig,
)
from testing.operator_objects import converge, kv_flags
from tests.chart.grants import Grant, allows, grants_by_binding, needed_by
from tests.chart.helm import Helm
from tests.operator.test_grants_on_the_api import create_shared_pool, tenant_deployment

CONFIGMAPS_PATH = "v1/configmaps"
WATCHED = (NAMESPACE, TENANT_NAMESPACE)
# How long the pool may take to go once its namespace's rights are gone: a few retries of
# kopf's (0.3 s apart here), far below kopf's 54 s of retrying a refused request.
LET_GO_S = 20.0

Binding = tuple[str, str | None, str]


class EnforcedApi(ApiServer):
    """The emulated API server with RBAC: an operator request is allowed only by the grants of
    the bindings that still exist (``bindings``; delete one to revoke it), else 403. As on a
    real API server, a request is authorised when it starts: a watch already open goes on."""

    @property
    def bindings(self) -> dict[Binding, set[Grant]]:
        return self.__dict__.setdefault("bindings", {})

    @property
    def refused(self) -> list[kmock.Request]:
        return self.__dict__.setdefault("refused", [])

    async def _handle(self, request: kmock.Request) -> Any:
        if by_operator(request):
            permission, namespace = needed_by(request.method, str(request.url))
            wanted = [permission] if permission is not None else []
            wanted += implied_permissions(request.method, request.data)
            granted = set().union(*self.bindings.values())
            if any(not any(allows(g, p, namespace) for g in granted) for p in wanted):
                self.refused.append(request)
                raise kmock.KubernetesError(status=403, reason="Forbidden", message="forbidden by RBAC")
        return await super()._handle(request)


def watched_sets() -> list[str]:
    return [f"watchNamespaces[{i}]={n}" for i, n in enumerate(WATCHED)]


def namespaced_install(helm: Helm) -> list[dict[str, Any]]:
    """The chart's default install, watching team-a and team-b."""
    return helm.template(sets=watched_sets())


def namespace_rights(bindings: dict[Binding, set[Grant]], namespace: str) -> Iterator[Binding]:
    """The bindings a deletion of ``namespace`` takes away (those in it)."""
    return (key for key in list(bindings) if key[1] == namespace)


@pytest.mark.asyncio
async def test_a_pool_in_a_deleted_namespace_goes_and_other_namespaces_are_released(
    helm: Helm, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    objects = namespaced_install(helm)
    async with emulated_cluster(EnforcedApi) as cluster:
        api = cluster.api
        assert isinstance(api, EnforcedApi)
        api.bindings.update(grants_by_binding(objects))
        kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", cluster.url)
        options = OperatorOptions(**quick_options(kubeconfig, namespaces=WATCHED))
        async with running_operator(cluster, options):
            # A pool in team-a with a consumer there and one of a grant in team-b.
            await create_shared_pool(cluster, tenant_deployment(TENANT_NAMESPACE, "chat"))
            await converge(cluster)
            await eventually(
                lambda: kv_flags(cluster.get(DEPLOYMENTS_PATH, "chat", TENANT_NAMESPACE)) != [],
                what="chat patched",
            )
            assert api.refused == []  # the chart's rules allow everything the operator did so far

            # kubectl delete namespace team-a: its Role and RoleBinding go first, then the
            # namespace controller deletes the pool (its finalizer holds it).
            for key in namespace_rights(api.bindings, NAMESPACE):
                del api.bindings[key]
            start = cluster.mark()
            await cluster.delete_pool("pool")
            await eventually(
                lambda: cluster.get(POOLS_PATH, "pool") is None, timeout=LET_GO_S, what="the pool gone"
            )

            # team-b's rights are intact: its consumer is released, the grant's ConfigMap is
            # deleted, and the grant stays, told its pool is gone.
            assert kv_flags(cluster.get(DEPLOYMENTS_PATH, "chat", TENANT_NAMESPACE)) == []
            assert cluster.get(CONFIGMAPS_PATH, "pool-llm-connector", TENANT_NAMESPACE) is None
            kept = cluster.get(GRANTS_PATH, "llm", TENANT_NAMESPACE)
            assert kept is not None
            assert [c["reason"] for c in kept["status"]["conditions"]] == ["PoolNotFound"]
            # team-a's consumer could not be reached: it goes with its namespace.
            assert kv_flags(cluster.get(DEPLOYMENTS_PATH, "llm"))

            # In team-a, what was allowed once its rights were gone: patches of the pool's
            # metadata (kopf's finalizer), never of its spec...
            allowed = [
                r
                for r in cluster.requests(start)
                if r.namespace == NAMESPACE and all(r is not refused for refused in api.refused)
            ]
            assert allowed and {(r.method.upper(), r.resource.plural) for r in allowed if r.resource} == {
                ("PATCH", POOLS.plural)
            }, [f"{r.method} {r.url.path}" for r in allowed]
            assert all(patched_fields(r) == {"metadata"} for r in allowed), [r.body for r in allowed]
            # ...and it tried no write there that it may not make (children, Events): reads only.
            assert {r.method.upper() for r in api.refused} == {"GET"}


def patched_fields(request: kmock.Request) -> set[str]:
    """The top-level fields a merge patch sets, or a JSON patch's operations touch, as sent."""
    sent = json.loads(request.body)
    if isinstance(sent, dict):
        return set(sent)
    return {op["path"].split("/")[1] for op in sent if op["op"] != "test"}


def test_outside_its_roles_the_operator_may_only_patch_pools(helm: Helm) -> None:
    """What the chart's default install lets the operator do in a watched namespace whose Role
    is gone, and in a namespace it does not watch: ``patch`` on pools, for kopf's finalizer
    removal, and nothing else (no get, list or watch of pools, not their status, nothing of any
    other kind). RBAC cannot narrow that patch to the finalizer: the operator never patches a
    pool's spec (the test above checks its traffic), and ``rbac.finalizerClusterRole=false``
    leaves the right out."""
    bindings = grants_by_binding(namespaced_install(helm))
    left = set().union(*(g for key, g in bindings.items() if key[1] != NAMESPACE))
    every = {
        Permission(r.api_group, resource, verb) for r in RULES for resource in r.resources for verb in r.verbs
    }
    for namespace in (NAMESPACE, "team-c"):
        allowed = {p for p in every if any(allows(g, p, namespace) for g in left)}
        assert allowed == {Permission(POOLS.group, POOLS.plural, "patch")}, namespace
    assert {g for g in left if g.namespace is None} == {Grant(POOLS.group, POOLS.plural, "patch", None)}
    assert not any(allows(g, Permission("", "secrets", "get"), "team-c") for g in left)

    opted_out = helm.template(sets=["rbac.finalizerClusterRole=false", *watched_sets()])
    assert {g.namespace for g in set().union(*grants_by_binding(opted_out).values())} == set(WATCHED)
