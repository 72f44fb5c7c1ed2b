"""A store pod's disk tier: its volume, mount and Mooncake offload settings (pure).

The options are the local pool's own (``kvpool.connector.local.disk_tier.DiskTier``), so
the variables a store pod gets are those measured on real processes (docs/tenancy.md).
The volume is the pod's (a generic ephemeral volume or an ``emptyDir``), never a host
path: it is deleted with its pod, and the pods with the pool (owner references).
"""

from __future__ import annotations

from typing import Any

from kvpool.connector.contract.layout import Problem
from kvpool.connector.local.disk_tier import DiskTier
from kvpool.operator.spec import DiskTierSpec, PoolSpec, format_bytes

VOLUME = "disk-tier"
MOUNT_PATH = "/var/lib/kvpool/disk-tier"
# Master and store flags of a pool with a tier: the same on both.
OFFLOAD_FLAG = "--enable_offload=true"
_FIELDS = {
    "capacity": "capacity",
    "key_limit": "keyLimit",
    "eviction": "evictionPolicy",
    "watermarks": "lowWatermark",
    "bucket_bytes": "capacity",
}


def tier_options(spec: DiskTierSpec) -> DiskTier:
    """The tier's options as the local pool takes them; ``ValueError`` naming the rule."""
    return DiskTier(
        capacity=spec.capacity,
        key_limit=spec.key_limit,
        eviction=spec.eviction_policy,
        high_watermark=spec.high_watermark,
        low_watermark=spec.low_watermark,
    )


def check_disk_tier(spec: PoolSpec) -> list[Problem]:
    """Every rule the tier breaks, by field (the local pool's own rules)."""
    tier = spec.store.disk_tier
    if tier is None:
        return []
    problems = []
    try:
        tier_options(tier)
    except ValueError as error:
        for part in str(error).split("; "):
            name, _, rule = part.partition(": ")
            field = f"spec.store.diskTier.{_FIELDS.get(name, name)}"
            problems.append(Problem(field=field, rule="disk-tier", message=rule))
    if tier.volume.size is not None and tier.volume.size < tier.capacity:
        # Mooncake fills the tier up to its capacity: a smaller volume runs out of space (an
        # emptyDir past its sizeLimit gets the pod evicted, with the memory it holds).
        problems.append(
            Problem(
                field="spec.store.diskTier.volume.size",
                rule="disk-tier-volume",
                message=f"{format_bytes(tier.volume.size)} cannot hold the tier's capacity "
                f"{format_bytes(tier.capacity)}: set at least that (or leave it out: the capacity "
                "and a quarter more)",
            )
        )
    return problems


def volume_size(tier: DiskTierSpec) -> int:
    """The volume's bytes: as given, or the capacity and a quarter more."""
    return tier.volume.size or tier.capacity + tier.capacity // 4


def tier_volume(tier: DiskTierSpec) -> dict[str, Any]:
    """The pod volume of the tier: a claim made per pod from a template, or an ``emptyDir``."""
    size = format_bytes(volume_size(tier))
    if tier.volume.type == "emptyDir":
        return {"name": VOLUME, "emptyDir": {"sizeLimit": size}}
    claim: dict[str, Any] = {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": size}}}
    if tier.volume.storage_class_name:
        claim["storageClassName"] = tier.volume.storage_class_name
    return {"name": VOLUME, "ephemeral": {"volumeClaimTemplate": {"spec": claim}}}


def tier_mount() -> dict[str, Any]:
    return {"name": VOLUME, "mountPath": MOUNT_PATH}


def tier_env(tier: DiskTierSpec) -> list[dict[str, Any]]:
    """The store container's Mooncake offload variables, sorted by name."""
    env = tier_options(tier).offload_env(MOUNT_PATH)
    return [{"name": name, "value": env[name]} for name in sorted(env)]


def master_tier_args(spec: PoolSpec) -> list[str]:
    return [OFFLOAD_FLAG] if spec.store.disk_tier is not None else []
