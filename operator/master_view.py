"""What a Mooncake master says about its pool, parsed from its own text (pure: no I/O).

The master's HTTP port (``--metrics_port``) serves ``/health`` (JSON: ``role``,
``service_ready``, ``leader_address``) and ``/metrics`` (Prometheus text). Of the metrics,
the status uses (names checked against a real 0.3.13 master in the tests):

* ``master_total_capacity_bytes`` / ``master_allocated_bytes``: mounted and allocated memory;
* ``segment_total_capacity_bytes`` / ``segment_allocated_bytes`` ``{segment="<ip>:<port>"}``:
  the same per mounted segment, one per store process (or vLLM rank, embedded); the segment
  is named by its transfer engine's address, so its host is the store pod's IP;
* ``master_key_count``: objects; ``master_soft_pin_key_count``;
* ``master_successful_evictions_total``, ``master_evicted_key_count``,
  ``master_evicted_size_bytes``: eviction passes, evicted objects and bytes since the master
  started (counters);
* ``master_put_start_alloc_failures_total``: puts that found no room even after evicting;
* with ``--enable_multi_tenants``, per tenant (``{tenant_id="<tenant>"}``):
  ``mooncake_tenant_quota_{requested,effective,charged}_bytes`` (the policy's quota, the
  quota the master admits after its proportional cut, the memory of the tenant's objects and
  reservations in flight), ``mooncake_tenant_quota_over_quota`` and
  ``..._admission_closed`` (0/1), ``mooncake_tenant_quota_reject_total{reason}`` and
  ``mooncake_tenant_evict_bytes_total`` (counters, present once they count). The same
  numbers as the admin API's ``GET /api/v1/tenant_quotas``, without asking the admin API.

The master counts objects for the whole pool only: there is no per-segment object count.
A standby master (HA) reports zero capacity: only the serving leader's numbers count.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

CAPACITY = "master_total_capacity_bytes"
ALLOCATED = "master_allocated_bytes"
KEYS = "master_key_count"
SOFT_PIN_KEYS = "master_soft_pin_key_count"
EVICTIONS = "master_successful_evictions_total"
EVICTED_KEYS = "master_evicted_key_count"
EVICTED_BYTES = "master_evicted_size_bytes"
ALLOC_FAILURES = "master_put_start_alloc_failures_total"
SEGMENT_CAPACITY = "segment_total_capacity_bytes"
SEGMENT_ALLOCATED = "segment_allocated_bytes"
TENANT_REQUESTED = "mooncake_tenant_quota_requested_bytes"
TENANT_EFFECTIVE = "mooncake_tenant_quota_effective_bytes"
TENANT_CHARGED = "mooncake_tenant_quota_charged_bytes"
TENANT_OVER_QUOTA = "mooncake_tenant_quota_over_quota"
TENANT_ADMISSION_CLOSED = "mooncake_tenant_quota_admission_closed"
TENANT_REJECTS = "mooncake_tenant_quota_reject_total"
TENANT_EVICTED_BYTES = "mooncake_tenant_evict_bytes_total"
TENANT_LABEL = "tenant_id"
# At most this many tenants are kept from one answer (a policy names far fewer).
MAX_TENANTS = 4096
# What a master must export for its numbers to be read at all.
REQUIRED = (CAPACITY, ALLOCATED, KEYS)


class MasterTextError(ValueError):
    """The master's answer is not what a Mooncake master says."""


@dataclass(frozen=True)
class Segment:
    """One mounted segment: its name (``<ip>:<port>``), capacity and allocated bytes."""

    name: str
    capacity_bytes: int
    allocated_bytes: int

    @property
    def host(self) -> str:
        """The segment's host: a store pod's IP (brackets of an IPv6 address removed)."""
        host = self.name.rsplit(":", 1)[0] if ":" in self.name else self.name
        return host[1:-1] if host.startswith("[") and host.endswith("]") else host


@dataclass(frozen=True)
class TenantNumbers:
    """One tenant as a multi-tenant master counts it (bytes; counters since it started)."""

    tenant: str
    requested_bytes: int
    effective_bytes: int  # the quota the master enforces: the requested one, cut when oversubscribed
    charged_bytes: int  # memory of the tenant's objects and its reservations in flight
    over_quota: bool = False
    admission_closed: bool = False
    rejected_writes: int = 0
    evicted_bytes: int = 0


@dataclass(frozen=True)
class MasterNumbers:
    """The pool as its master counts it."""

    capacity_bytes: int
    allocated_bytes: int
    objects: int
    soft_pinned_objects: int = 0
    evictions: int = 0
    evicted_objects: int = 0
    evicted_bytes: int = 0
    alloc_failures: int = 0
    segments: tuple[Segment, ...] = field(default_factory=tuple)
    # Every tenant the master reports (none: tenancy off, or no tenant in its policy).
    tenants: Mapping[str, TenantNumbers] = field(default_factory=dict)


def _count(value: float, name: str) -> int:
    if math.isnan(value) or math.isinf(value) or value < 0:
        raise MasterTextError(f"{name} is {value}, not a count")
    return int(value)


def parse_metrics(text: str) -> MasterNumbers:
    """The numbers of a master's ``/metrics`` text; ``MasterTextError`` when it is not a
    Mooncake master's (unparseable, or without the pool's capacity, use and object count)."""
    totals: dict[str, float] = {}
    segments: dict[str, dict[str, float]] = {}
    tenants: dict[str, dict[str, float]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                tenant = sample.labels.get(TENANT_LABEL)
                if tenant and sample.name.startswith("mooncake_tenant_"):
                    if tenant in tenants or len(tenants) < MAX_TENANTS:
                        values = tenants.setdefault(tenant, {})
                        # Counters by reason (rejects) add up; each gauge is one sample.
                        values[sample.name] = values.get(sample.name, 0.0) + sample.value
                elif sample.name in (SEGMENT_CAPACITY, SEGMENT_ALLOCATED):
                    name = sample.labels.get("segment")
                    if name:
                        segments.setdefault(name, {})[sample.name] = sample.value
                elif not sample.labels:
                    totals[sample.name] = sample.value
    except (ValueError, TypeError, IndexError):
        # Never the text itself: whatever answered may say anything, and this lands in a status.
        raise MasterTextError("not Prometheus text") from None
    missing = [name for name in REQUIRED if name not in totals]
    if missing:
        raise MasterTextError("not a Mooncake master's metrics: no " + ", ".join(missing))

    def total(name: str) -> int:
        # The parser names every counter's sample ``..._total``, also those Mooncake names
        # without it (``master_evicted_key_count``).
        return _count(totals.get(name, totals.get(name + "_total", 0.0)), name)

    return MasterNumbers(
        capacity_bytes=total(CAPACITY),
        allocated_bytes=total(ALLOCATED),
        objects=total(KEYS),
        soft_pinned_objects=total(SOFT_PIN_KEYS),
        evictions=total(EVICTIONS),
        evicted_objects=total(EVICTED_KEYS),
        evicted_bytes=total(EVICTED_BYTES),
        alloc_failures=total(ALLOC_FAILURES),
        segments=tuple(
            Segment(
                name,
                _count(values.get(SEGMENT_CAPACITY, 0.0), SEGMENT_CAPACITY),
                _count(values.get(SEGMENT_ALLOCATED, 0.0), SEGMENT_ALLOCATED),
            )
            for name, values in sorted(segments.items())
        ),
        tenants={
            tenant: _tenant(tenant, values)
            for tenant, values in sorted(tenants.items())
            if TENANT_EFFECTIVE in values and TENANT_CHARGED in values
        },
    )


def _tenant(tenant: str, values: Mapping[str, float]) -> TenantNumbers:
    def count(name: str) -> int:
        return _count(values.get(name, values.get(name.removesuffix("_total"), 0.0)), name)

    return TenantNumbers(
        tenant=tenant,
        requested_bytes=count(TENANT_REQUESTED),
        effective_bytes=count(TENANT_EFFECTIVE),
        charged_bytes=count(TENANT_CHARGED),
        over_quota=count(TENANT_OVER_QUOTA) > 0,
        admission_closed=count(TENANT_ADMISSION_CLOSED) > 0,
        rejected_writes=count(TENANT_REJECTS),
        evicted_bytes=count(TENANT_EVICTED_BYTES),
    )


@dataclass(frozen=True)
class MasterHealth:
    """A master's ``/health``: whether it leads and serves, and the leader it names."""

    role: str
    service_ready: bool
    leader_address: object = None

    @property
    def serves(self) -> bool:
        return self.role == "leader" and self.service_ready


def parse_health(text: str) -> MasterHealth:
    """A master's ``/health`` answer; ``MasterTextError`` when it is not one."""
    try:
        body = json.loads(text)
    except ValueError:
        raise MasterTextError("/health is not JSON") from None
    if not isinstance(body, Mapping) or not isinstance(body.get("role"), str):
        raise MasterTextError("/health names no role")
    return MasterHealth(str(body["role"]), body.get("service_ready") is True, body.get("leader_address"))
