"""Names, labels and annotations of everything a pool creates or touches."""

from __future__ import annotations

from kvpool.operator.resources import GROUP

PREFIX = GROUP
LABEL_POOL = f"{PREFIX}/pool"
LABEL_COMPONENT = f"{PREFIX}/component"
LABEL_CONSUMER_OF = f"{PREFIX}/consumer-of"  # on consumer Deployments the pool patched
ANNOTATION_CONFIG_HASH = f"{PREFIX}/config-hash"
ANNOTATION_LAST_APPLIED = f"{PREFIX}/last-applied"
ANNOTATION_RESTORE = f"{PREFIX}/restore"
FINALIZER = f"{PREFIX}/finalizer"
MANAGER = "kvpool-operator"

MASTER = "master"
STORE = "store"
CONSUMER = "consumer"

CONNECTOR_VOLUME = "kvpool-connector"
CONNECTOR_MOUNT_PATH = "/etc/kvpool"
MOONCAKE_CONFIG_FILE = "mooncake.json"
KV_TRANSFER_CONFIG_FILE = "kv-transfer-config.json"

# Longest pool name whose derived names ("<pool>-master", ...) stay valid DNS-1035 labels.
MAX_POOL_NAME = 63 - len("-connector")


def master_name(pool: str) -> str:
    return f"{pool}-master"


def store_name(pool: str) -> str:
    return f"{pool}-store"


def connector_configmap_name(pool: str) -> str:
    return f"{pool}-connector"


def network_policy_name(pool: str) -> str:
    return f"{pool}-kvpool"


def selector(pool: str, component: str) -> dict[str, str]:
    """The labels that select a pool component's pods (stable: never change them)."""
    return {LABEL_POOL: pool, LABEL_COMPONENT: component}


def labels(pool: str, component: str) -> dict[str, str]:
    """Recommended labels of a pool component's objects and pods."""
    return {
        "app.kubernetes.io/name": "mooncake",
        "app.kubernetes.io/instance": pool,
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/part-of": "mooncake-kvpool",
        "app.kubernetes.io/managed-by": MANAGER,
        **selector(pool, component),
    }
