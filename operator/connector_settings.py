"""The connector's settings as a pool renders them (the contract's ``ConnectorSettings``),
and the ``<pool>-connector`` ConfigMap that carries them to consumer pods.

Not to be confused with the operator's own run options (``app.OperatorOptions``).
"""

from __future__ import annotations

import json
from typing import Any

from kvpool.connector.contract.layout import KVLayout, fingerprint
from kvpool.connector.contract.settings import ConnectorSettings
from kvpool.operator import names
from kvpool.operator.components import POD_IP_ENV, ha_cluster_id, master_address
from kvpool.operator.spec import PoolSpec

CONFIG_PATH = f"{names.CONNECTOR_MOUNT_PATH}/{names.MOONCAKE_CONFIG_FILE}"
# vLLM hashes blocks with Python's hash() when so configured: every consumer of a
# pool must use the same seed, or equal prefixes would get different keys.
PYTHONHASHSEED = "0"

# Where each contract field comes from in the pool spec (for error messages).
SPEC_FIELDS = {
    "master_server_address": "spec.master",
    "cluster_id": "spec.master.ha.clusterId",
    "protocol": "spec.store.protocol",
    "device_name": "spec.store.rdmaDevices",
    "global_segment_size": "spec.store.segmentSize",
    "local_hostname": "spec.consumers",
    "bind_address": "spec.consumers",
}


def pool_connector_settings(pool: str, namespace: str, spec: PoolSpec) -> ConnectorSettings:
    """The pool's connector settings; ``SettingsError`` when the contract rejects them.

    Standalone pools leave ``global_segment_size`` at 0 (vLLM contributes no memory);
    embedded pools give every vLLM rank a segment of ``store.segmentSize``.
    """
    data: dict[str, Any] = dict(spec.connector.model_dump())
    data.update(
        master_server_address=master_address(pool, namespace, spec),
        cluster_id=ha_cluster_id(pool, namespace, spec),
        protocol=spec.store.protocol,
        device_name=",".join(spec.store.rdma_devices),
        global_segment_size=spec.store.segment_size if spec.store.mode == "embedded" else 0,
    )
    return ConnectorSettings.parse(data)


def consumer_connector_settings(
    settings: ConnectorSettings, layout: KVLayout | None = None, tenant: str = ""
) -> ConnectorSettings:
    """Settings as a consumer pod uses them: it serves and binds on its own pod IP.

    ``$(POD_IP)`` is expanded by the kubelet in the container's args (``POD_IP`` comes
    from the downward API; ``consumers`` injects it). With the consumer's declared
    ``layout``, they carry it and its fingerprint: the connector compares them with the
    layout vLLM builds and stays out of the pool on any difference. ``tenant``: the
    Mooncake tenant of the consumer's grant (pools with tenancy).
    """
    pod_ip = f"$({POD_IP_ENV})"
    declared: dict[str, object] = {}
    if layout is not None:
        declared = {
            "declared_layout": layout.model_dump(mode="json", exclude_defaults=True),
            "declared_layout_fingerprint": fingerprint(layout),
        }
    if tenant:
        declared["tenant"] = tenant
    return ConnectorSettings.parse(
        {**settings.extra_config(), "local_hostname": pod_ip, "bind_address": pod_ip, **declared}
    )


def explicit_extra_config(settings: ConnectorSettings) -> dict[str, Any]:
    """``kv_connector_extra_config`` with the settings that differ from the contract's
    defaults, and every field of the mounted Mooncake config file.

    The connector in the consumer's image applies its own defaults, so a release that adds
    a setting with its default renders (and rolls) nothing new. The file's fields are always
    explicit: the ConfigMap is rewritten as soon as the pool changes, before the rollout
    reaches a consumer, and a Pod of the old template that restarts in between would
    otherwise take the new file's value for each field its flag leaves out (a new protocol
    against stores of the old one). With them pinned, a Pod's settings are its template's.
    """
    everything = settings.model_dump(mode="json")
    pinned = {field: everything[field] for field in settings.mooncake_config()}
    return {**settings.model_dump(mode="json", exclude_defaults=True), **pinned}


def kv_transfer_config_json(settings: ConnectorSettings, kv_role: str = "kv_both") -> str:
    """The ``--kv-transfer-config`` value: the contract's, with only the explicit settings."""
    config = {
        **settings.kv_transfer_config(kv_role),
        "kv_connector_extra_config": explicit_extra_config(settings),
    }
    return json.dumps(config, sort_keys=True, separators=(",", ":"))


def spec_field_of(setting: str) -> str:
    """The spec path a contract settings field comes from."""
    return SPEC_FIELDS.get(setting, f"spec.connector.{setting}")


def connector_configmap(pool: str, namespace: str, settings: ConnectorSettings) -> dict[str, Any]:
    """ConfigMap ``<pool>-connector``: the Mooncake config file and the transfer config."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": names.child_metadata(pool, namespace, names.connector_configmap_name(pool), "connector"),
        "data": {
            names.MOONCAKE_CONFIG_FILE: json.dumps(settings.mooncake_config(), indent=2, sort_keys=True)
            + "\n",
            names.KV_TRANSFER_CONFIG_FILE: kv_transfer_config_json(settings),
        },
    }
