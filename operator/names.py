"""Every name the operator uses: the API resources it reads and writes, its children, labels, annotations.

Imports nothing beyond the standard library, so the dashboards can use the label names.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

GROUP = "kvpool.mooncake.io"
VERSION = "v1alpha1"


@dataclass(frozen=True)
class ApiResource:
    """One Kubernetes API resource: group, version, plural name, kind."""

    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool = True

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    def path(
        self, namespace: str | None = None, name: str | None = None, subresource: str | None = None
    ) -> str:
        """The URL path of the collection, or of one object (and its subresource)."""
        root = f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"
        parts = [root]
        if namespace is not None and self.namespaced:
            parts.append(f"namespaces/{quote(namespace, safe='')}")
        parts.append(self.plural)
        if name is not None:
            parts.append(quote(name, safe=""))
            if subresource:
                parts.append(subresource)
        return "/".join(parts)


POOLS = ApiResource(GROUP, VERSION, "mooncakekvpools", "MooncakeKVPool")
POOL_SINGULAR = "mooncakekvpool"
POOL_SHORT_NAMES = ("mkvp",)
GRANTS = ApiResource(GROUP, VERSION, "mooncakekvpoolgrants", "MooncakeKVPoolGrant")
GRANT_SINGULAR = "mooncakekvpoolgrant"
GRANT_SHORT_NAMES = ("mkvpg",)

DEPLOYMENTS = ApiResource("apps", "v1", "deployments", "Deployment")
SERVICES = ApiResource("", "v1", "services", "Service")
CONFIGMAPS = ApiResource("", "v1", "configmaps", "ConfigMap")
NETWORK_POLICIES = ApiResource("networking.k8s.io", "v1", "networkpolicies", "NetworkPolicy")
POD_DISRUPTION_BUDGETS = ApiResource("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget")
EVENTS = ApiResource("", "v1", "events", "Event")
PODS = ApiResource("", "v1", "pods", "Pod")
LEASES = ApiResource("coordination.k8s.io", "v1", "leases", "Lease")
#: The operator's leader-election Lease (``--leader-election-id``; the chart's Role names it).
LEASE_NAME = "kvpool-operator"

_BY_KIND: dict[tuple[str, str], ApiResource] = {
    (r.api_version, r.kind): r
    for r in (
        POOLS,
        GRANTS,
        DEPLOYMENTS,
        SERVICES,
        CONFIGMAPS,
        NETWORK_POLICIES,
        POD_DISRUPTION_BUDGETS,
        EVENTS,
        PODS,
        LEASES,
    )
}


def api_resource_of(obj: dict) -> ApiResource:
    """The API resource of a manifest, from its ``apiVersion`` and ``kind``."""
    return _BY_KIND[(obj["apiVersion"], obj["kind"])]


PREFIX = GROUP
LABEL_POOL = f"{PREFIX}/pool"
LABEL_COMPONENT = f"{PREFIX}/component"
# On the pods of a consumer in another namespace than its pool's (with LABEL_POOL): the pool's namespace.
LABEL_POOL_NAMESPACE = f"{PREFIX}/pool-namespace"
LABEL_CONSUMER_OF = f"{PREFIX}/consumer-of"  # on consumer Deployments the pool patched
# A consumer Deployment's consent: the pool it lets patch it (set by the Deployment's owner).
LABEL_ALLOW_POOL = f"{PREFIX}/allow-pool"
# ...and, for a pool in another namespace (a grant's consumer), that pool's namespace.
LABEL_ALLOW_POOL_NAMESPACE = f"{PREFIX}/allow-pool-namespace"
LABEL_PART_OF = "app.kubernetes.io/part-of"
PART_OF = "mooncake-kvpool"  # on every object of this project: pool children and the operator
ANNOTATION_CONFIG_HASH = f"{PREFIX}/config-hash"
# On the master's pod template: the digest of the quota policy it starts with (a change rolls it).
ANNOTATION_TENANT_POLICY = f"{PREFIX}/tenant-policy"
ANNOTATION_LAST_APPLIED = f"{PREFIX}/last-applied"
ANNOTATION_RESTORE = f"{PREFIX}/restore"
# On a Pod the admission webhook injected: what it added (JSON; the Deployment is unchanged).
ANNOTATION_INJECTED = f"{PREFIX}/injected"
# On a pool: "true" pauses it (nothing applied, rolled or patched; teardown still runs).
ANNOTATION_PAUSED = f"{PREFIX}/paused"
# On a pool: "true" lets a pool being deleted go without teardown (the escape hatch).
ANNOTATION_SKIP_TEARDOWN = f"{PREFIX}/skip-teardown"
FINALIZER = f"{PREFIX}/finalizer"
MANAGER = "kvpool-operator"

MASTER = "master"
STORE = "store"

CONNECTOR_VOLUME = "kvpool-connector"
CONNECTOR_MOUNT_PATH = "/etc/kvpool"
MOONCAKE_CONFIG_FILE = "mooncake.json"
KV_TRANSFER_CONFIG_FILE = "kv-transfer-config.json"

# Longest pool name whose derived names ("<pool>-master", ...) stay valid DNS-1035 labels.
MAX_POOL_NAME = 63 - len("-connector")


def component_name(pool: str, component: str) -> str:
    """The name of a component's Deployment (and the master's Service)."""
    return f"{pool}-{component}"


def master_name(pool: str) -> str:
    return component_name(pool, MASTER)


def store_name(pool: str) -> str:
    return component_name(pool, STORE)


def connector_configmap_name(pool: str) -> str:
    return f"{pool}-connector"


def grant_connector_configmap_name(pool: str, grant: str) -> str:
    """The connector ConfigMap in a grant's namespace (its consumers mount it)."""
    name = f"{pool}-{grant}-connector"
    if len(name) <= 253:
        return name
    return f"{pool}-{hashlib.sha256(grant.encode()).hexdigest()[:16]}-connector"


def tenants_configmap_name(pool: str) -> str:
    """The master's tenant quota policy (pools with tenancy)."""
    return f"{pool}-tenants"


# Where the master reads its tenant quota policy.
TENANTS_MOUNT_PATH = "/etc/kvpool/tenants"


def network_policy_name(pool: str) -> str:
    return f"{pool}-kvpool"


def consumers_network_policy_name(pool: str) -> str:
    return f"{pool}-consumers"


def etcd_network_policy_name(pool: str) -> str:
    return f"{pool}-etcd"


def selector(pool: str, component: str) -> dict[str, str]:
    """The labels that select a pool component's pods (stable: never change them)."""
    return {LABEL_POOL: pool, LABEL_COMPONENT: component}


def label_selector(pool: str, component: str) -> str:
    """``selector`` as a list call's ``labelSelector``."""
    return ",".join(f"{key}={value}" for key, value in selector(pool, component).items())


def labels(pool: str, component: str) -> dict[str, str]:
    """Recommended labels of a pool component's objects and pods."""
    return {
        "app.kubernetes.io/name": "mooncake",
        "app.kubernetes.io/instance": pool,
        "app.kubernetes.io/component": component,
        LABEL_PART_OF: PART_OF,
        "app.kubernetes.io/managed-by": MANAGER,
        **selector(pool, component),
    }


def child_metadata(pool: str, namespace: str, name: str, component: str) -> dict[str, Any]:
    """``metadata`` of an object the pool owns: its name, namespace and the component's labels."""
    return {"name": name, "namespace": namespace, "labels": labels(pool, component)}
