"""The Kubernetes API resources the operator reads and writes, and their URLs."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import quote


@dataclass(frozen=True)
class Resource:
    """One API resource: group, version, plural name, kind."""

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


GROUP = "kvpool.mooncake.io"
VERSION = "v1alpha1"

POOLS = Resource(GROUP, VERSION, "mooncakekvpools", "MooncakeKVPool")
POOL_SINGULAR = "mooncakekvpool"
POOL_SHORT_NAMES = ("mkvp",)

DEPLOYMENTS = Resource("apps", "v1", "deployments", "Deployment")
SERVICES = Resource("", "v1", "services", "Service")
CONFIGMAPS = Resource("", "v1", "configmaps", "ConfigMap")
NETWORK_POLICIES = Resource("networking.k8s.io", "v1", "networkpolicies", "NetworkPolicy")
EVENTS = Resource("", "v1", "events", "Event")

BY_KIND: dict[tuple[str, str], Resource] = {
    (r.api_version, r.kind): r for r in (POOLS, DEPLOYMENTS, SERVICES, CONFIGMAPS, NETWORK_POLICIES, EVENTS)
}


def resource_of(obj: dict) -> Resource:
    """The resource of a manifest, from its ``apiVersion`` and ``kind``."""
    return BY_KIND[(obj["apiVersion"], obj["kind"])]
