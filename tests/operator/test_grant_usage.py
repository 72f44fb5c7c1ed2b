"""Usage per grant: each grant's tenant as the pool's master counts it, in the grant's status,
the pool's status, the operator's metrics and a printer column.

Pure tests of the parsing and the status, then the real operator on the emulated API asking a
stand-in master on loopback (its ``/metrics`` text is the shape a real 0.3.13 master with
``--enable_multi_tenants`` answers; ``test_real_tenancy.py`` checks the numbers against a real
one)."""

from __future__ import annotations

import urllib.request
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from kvpool.connector.local.ports import free_port
from kvpool.operator import names
from kvpool.operator.capacity import apply_observation, capacity_status
from kvpool.operator.crd import build_grant_crd
from kvpool.operator.grant_usage import grant_usage, with_changed_at
from kvpool.operator.grants import grant_status, plan_tenancy, read_grant
from kvpool.operator.master_view import MAX_TENANTS, parse_metrics
from kvpool.operator.metric_names import GRANT_QUOTA_BYTES, GRANT_REJECTED_WRITES, GRANT_USED_BYTES
from kvpool.operator.metrics import OperatorMetrics, grant_numbers
from kvpool.operator.names import GRANTS
from kvpool.operator.observation import Observation
from kvpool.operator.policy import OperatorPolicy
from kvpool.operator.spec import GrantStatus, PoolStatus
from testing.kube_api import GRANTS_PATH, NAMESPACE, Cluster, eventually
from testing.operator_objects import Operator, consumer, pool_manifest, pool_pod, pool_spec, vllm_deployment
from tests.operator.test_capacity import MASTER_TEXT, ready_status

MiB = 1 << 20
TEAM_A, TEAM_B = f"{NAMESPACE}.team-a", f"{NAMESPACE}.team-b"


def tenant_text(
    tenant: str, charged: int, effective: int = 16 * MiB, rejects: dict[str, int] | None = None
) -> str:
    """A tenant's lines as a real 0.3.13 master writes them (checked in ``test_real_tenancy.py``)."""
    lines = [
        f'mooncake_tenant_quota_requested_bytes{{tenant_id="{tenant}"}} {24 * MiB}',
        f'mooncake_tenant_quota_effective_bytes{{tenant_id="{tenant}"}} {effective}',
        f'mooncake_tenant_quota_charged_bytes{{tenant_id="{tenant}"}} {charged}',
        f'mooncake_tenant_quota_admission_closed{{tenant_id="{tenant}"}} 0',
        f'mooncake_tenant_quota_over_quota{{tenant_id="{tenant}"}} {int(charged > effective)}',
        f'mooncake_tenant_quota_explicit_policy{{tenant_id="{tenant}"}} 1',
    ]
    for reason, count in (rejects or {}).items():
        lines.append(f'mooncake_tenant_quota_reject_total{{tenant_id="{tenant}",reason="{reason}"}} {count}')
    return "\n".join(lines) + "\n"


TENANCY_HEAD = """\
# HELP mooncake_tenant_quota_requested_bytes Requested tenant quota policy in bytes
# TYPE mooncake_tenant_quota_requested_bytes gauge
# TYPE mooncake_tenant_quota_effective_bytes gauge
# TYPE mooncake_tenant_quota_charged_bytes gauge
# TYPE mooncake_tenant_quota_admission_closed gauge
# TYPE mooncake_tenant_quota_over_quota gauge
# TYPE mooncake_tenant_quota_explicit_policy gauge
# TYPE mooncake_tenant_quota_reject_total counter
# TYPE mooncake_tenant_quota_allocatable_capacity_bytes gauge
mooncake_tenant_quota_allocatable_capacity_bytes 33554432
"""


def grant(name: str, ceiling: str = "24MB", domain: str | None = None) -> Any:
    spec: dict[str, Any] = {"pool": "pool", "ceiling": ceiling}
    if domain:
        spec["reuseDomain"] = domain
    return read_grant({"metadata": {"name": name, "namespace": NAMESPACE, "generation": 1}, "spec": spec})


def answered(text: str) -> Observation:
    return Observation("t1", "pool-master.ns.svc:9003", parse_metrics(text))


TEXT = MASTER_TEXT + TENANCY_HEAD + tenant_text(TEAM_A, 5 * MiB, rejects={"quota_exceeded": 8, "other": 1})
TENANTS = {"team-a": TEAM_A, "team-b": TEAM_B}


def test_the_masters_text_gives_each_tenants_quota_and_charge() -> None:
    numbers = parse_metrics(
        TEXT + tenant_text(TEAM_B, 0) + f'mooncake_tenant_evict_bytes_total{{tenant_id="{TEAM_B}"}} 7\n'
    )
    a, b = numbers.tenants[TEAM_A], numbers.tenants[TEAM_B]
    assert (a.requested_bytes, a.effective_bytes, a.charged_bytes) == (24 * MiB, 16 * MiB, 5 * MiB)
    assert a.rejected_writes == 9 and not a.over_quota and not a.admission_closed  # every reason counts
    assert (b.charged_bytes, b.rejected_writes, b.evicted_bytes) == (0, 0, 7)
    assert parse_metrics(MASTER_TEXT).tenants == {}  # tenancy off: no tenant at all
    # A tenant with only some lines (no quota, no charge) is no tenant; the number kept is bounded.
    partial = parse_metrics(MASTER_TEXT + 'mooncake_tenant_quota_over_quota{tenant_id="x"} 1\n')
    assert partial.tenants == {}
    many = "".join(tenant_text(f"t{i}", 1) for i in range(MAX_TENANTS + 5))
    assert len(parse_metrics(MASTER_TEXT + many).tenants) == MAX_TENANTS


def test_a_grant_shows_its_tenants_charge_and_the_quota_the_master_enforces() -> None:
    usage = grant_usage("team-a", TENANTS, answered(TEXT), asked=True)
    assert usage["state"] == "Observed" and usage["used"] == "5Mi (31%)"
    assert (usage["usedBytes"], usage["quotaBytes"], usage["requestedBytes"]) == (5 * MiB, 16 * MiB, 24 * MiB)
    assert usage["rejectedWrites"] == 9 and usage["quota"] == "16Mi" and "sharedWith" not in usage


@pytest.mark.parametrize(
    ("observation", "asked", "reason"),
    [
        (None, False, "NotAsked"),
        (None, True, "NotYet"),
        (Observation("t1", problem="no answer within 3 s", reason="Unreachable"), True, "Unreachable"),
        (answered(MASTER_TEXT), True, "NoTenancyAtMaster"),
        (answered(TEXT), True, "TenantNotAtMaster"),  # team-b: a grant the master was not told of
    ],
)
def test_usage_not_observed_is_unknown_never_zero(
    observation: Observation | None, asked: bool, reason: str
) -> None:
    usage = grant_usage("team-b", TENANTS, observation, asked=asked)
    assert usage["state"] == "Unknown" and usage["reason"] == reason and usage["used"] == "unknown"
    assert not {"usedBytes", "quotaBytes", "rejectedWrites"} & set(usage), usage
    assert usage["message"]


def test_grants_of_one_reuse_domain_show_their_tenants_numbers_and_name_each_other() -> None:
    grants = [grant("team-a", domain="shared"), grant("team-b", "16MB", domain="shared"), grant("team-c")]
    tenancy = plan_tenancy("pool", NAMESPACE, grants, 32 * MiB)
    text = MASTER_TEXT + TENANCY_HEAD + tenant_text("domain.shared", 3 * MiB)
    a = grant_usage("team-a", tenancy.tenants, answered(text), asked=True)
    b = grant_usage("team-b", tenancy.tenants, answered(text), asked=True)
    assert a["usedBytes"] == b["usedBytes"] == 3 * MiB
    assert (a["sharedWith"], b["sharedWith"]) == (["team-b"], ["team-a"])
    assert "sharedWith" not in grant_usage("team-c", tenancy.tenants, answered(text), asked=True)


def test_usage_that_holds_still_keeps_its_time_and_the_status_is_valid() -> None:
    usage = grant_usage("team-a", TENANTS, answered(TEXT), asked=True)
    first = with_changed_at(usage, None, "t1")
    assert with_changed_at(usage, first, "t2")["changedAt"] == "t1"
    moved = grant_usage(
        "team-a", TENANTS, answered(TEXT.replace(f"}} {5 * MiB}", f"}} {6 * MiB}")), asked=True
    )
    assert moved["usedBytes"] == 6 * MiB and with_changed_at(moved, first, "t2")["changedAt"] == "t2"
    # The grant's status with its usage is what the CRD's schema describes.
    tenancy = plan_tenancy("pool", NAMESPACE, [grant("team-a"), grant("team-b")], 32 * MiB)
    status = {**grant_status(grant("team-a"), tenancy), "usage": first}
    assert GrantStatus.model_validate(status).usage is not None


def test_the_pools_status_lists_each_grant_and_the_printer_columns_read_the_grants() -> None:
    capacity = capacity_status(answered(TEXT), None, TENANTS)
    assert capacity is not None
    assert capacity["grants"] == [
        {
            "grant": "team-a",
            "tenant": TEAM_A,
            "used": "5Mi (31%)",
            "usedBytes": 5 * MiB,
            "quotaBytes": 16 * MiB,
            "rejectedWrites": 9,
        },
        {"grant": "team-b", "tenant": TEAM_B, "used": "unknown"},
    ]
    assert "grants" not in (capacity_status(answered(TEXT), None) or {})  # tenancy off
    status = apply_observation(
        ready_status(),
        {},
        answered(TEXT),
        asked=True,
        external=False,
        expected=None,
        now="t1",
        tenants=TENANTS,
    )
    assert PoolStatus.model_validate(status).capacity is not None
    columns = {
        c["name"]: c["jsonPath"] for c in build_grant_crd()["spec"]["versions"][0]["additionalPrinterColumns"]
    }
    assert columns["Used"] == ".status.usage.used" and columns["Rejected"] == ".status.usage.rejectedWrites"
    # A failed poll keeps the pool's last numbers (Observed False says so) ...
    failed = Observation("t2", problem="no answer", reason="Unreachable")
    kept = apply_observation(
        status, status, failed, asked=True, external=False, expected=None, now="t2", tenants=TENANTS
    )
    assert kept["capacity"]["grants"] == status["capacity"]["grants"]
    # ... and the operator's gauges carry a grant's numbers only while the master answers.
    assert grant_numbers(status) == {"team-a": (5 * MiB, 16 * MiB, 9)}
    assert grant_numbers(kept) == {}


def test_the_operators_gauges_carry_each_grants_numbers() -> None:
    metrics = OperatorMetrics()
    status = apply_observation(
        ready_status(),
        {},
        answered(TEXT),
        asked=True,
        external=False,
        expected=None,
        now="t1",
        tenants=TENANTS,
    )
    metrics.observe_pool(NAMESPACE, "pool", status)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in metrics.registry.collect()
        for s in family.samples
        if s.name.startswith("kvpool_operator_grant_")
    }
    labels = (("grant", "team-a"), ("namespace", NAMESPACE), ("pool", "pool"))
    assert samples == {
        (GRANT_USED_BYTES.exported, labels): 5 * MiB,
        (GRANT_QUOTA_BYTES.exported, labels): 16 * MiB,
        (GRANT_REJECTED_WRITES.exported, labels): 9,
    }
    metrics.forget_pool(NAMESPACE, "pool")
    assert not [
        s
        for f in metrics.registry.collect()
        for s in f.samples
        if s.name.startswith("kvpool_operator_grant_")
    ]


# --- The real operator on the emulated API, a stand-in master on loopback ------------------

STORE_PODS = {"pool-store-a": "10.0.0.5", "pool-store-b": "10.0.0.6"}  # MASTER_TEXT's segments


class StandIn:
    """A master's /health and /metrics on loopback; ``text`` is what /metrics says (None: HTTP 500)."""

    def __init__(self) -> None:
        self.text: str | None = MASTER_TEXT
        self.port = 0

    async def health(self, _: web.Request) -> web.StreamResponse:
        return web.json_response({"role": "leader", "service_ready": True, "leader_address": None})

    async def metrics(self, _: web.Request) -> web.StreamResponse:
        if self.text is None:
            return web.Response(status=500)
        return web.Response(text=self.text)


@pytest_asyncio.fixture
async def standin() -> AsyncIterator[StandIn]:
    master = StandIn()
    app = web.Application()
    app.router.add_get("/health", master.health)
    app.router.add_get("/metrics", master.metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    master.port = free_port()
    await web.TCPSite(runner, "127.0.0.1", master.port).start()
    yield master
    await runner.cleanup()


OBSERVING = {
    "master_health_url": "http://127.0.0.1:{port}/health",
    "observe_interval": 0.3,
    "observe_timeout": 1.0,
    "policy": OperatorPolicy(operator_namespace="kvpool-system", operator_pod_labels=(("app", "op"),)),
}


def grant_manifest(name: str, ceiling: str = "24MB") -> dict[str, Any]:
    return {
        "apiVersion": f"{GRANTS.group}/{GRANTS.version}",
        "kind": GRANTS.kind,
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {"pool": "pool", "ceiling": ceiling},
    }


def store_pod(name: str, ip: str) -> dict[str, Any]:
    return pool_pod(name, ip, names.STORE)


def operator_grant_series(url: str) -> dict[tuple[str, str], float]:
    """The operator's per-grant gauges: (metric, grant) -> value."""
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    return {
        (s.name, s.labels["grant"]): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("kvpool_operator_grant_")
    }


@pytest.mark.asyncio
@pytest.mark.parametrize("operator_config", [OBSERVING])
async def test_the_operator_shows_each_grants_usage_and_unknown_when_the_master_fails(
    cluster: Cluster, operator: Operator, standin: StandIn
) -> None:
    standin.text = TEXT
    for name, ip in STORE_PODS.items():
        await cluster.create(store_pod(name, ip))
    await cluster.create(vllm_deployment())
    await cluster.create(grant_manifest("team-a"))
    await cluster.create(grant_manifest("team-b"))
    spec = pool_spec(
        tenancy={"enabled": True},
        master={"metricsPort": standin.port},
        store={"segmentSize": "16MB", "replicas": 2},
        consumers=[{**consumer(), "grant": "team-a"}],
    )
    await cluster.create(pool_manifest(spec=spec))

    def usage(name: str) -> dict[str, Any]:
        cluster.settle()
        return ((cluster.get(GRANTS_PATH, name) or {}).get("status") or {}).get("usage") or {}

    a = await eventually(
        lambda: usage("team-a").get("usedBytes") == 5 * MiB and usage("team-a"), what="usage"
    )
    assert a["state"] == "Observed" and a["quotaBytes"] == 16 * MiB and a["rejectedWrites"] == 9
    b = await eventually(
        lambda: usage("team-b").get("reason") == "TenantNotAtMaster" and usage("team-b"), what="b"
    )
    assert b["used"] == "unknown" and "usedBytes" not in b
    grants = await eventually(
        lambda: cluster.pool_status("pool").get("capacity", {}).get("grants"), what="the pool's grants"
    )
    assert [g["grant"] for g in grants] == ["team-a", "team-b"] and grants[0]["usedBytes"] == 5 * MiB
    series = await eventually(lambda: operator_grant_series(operator.metrics_url), what="the grant gauges")
    assert series == {
        (GRANT_USED_BYTES.exported, "team-a"): 5 * MiB,
        (GRANT_QUOTA_BYTES.exported, "team-a"): 16 * MiB,
        (GRANT_REJECTED_WRITES.exported, "team-a"): 9,
    }

    # The tenant writes more: the next poll shows it.
    standin.text = TEXT.replace(f"}} {5 * MiB}\n", f"}} {7 * MiB}\n")
    await eventually(lambda: usage("team-a").get("usedBytes") == 7 * MiB, what="7 MiB used")

    # The master stops answering: unknown (not zero, not the old number), and passes go on.
    standin.text = None
    a = await eventually(
        lambda: usage("team-a").get("state") == "Unknown" and usage("team-a"), what="unknown"
    )
    assert a["reason"] == "Unreachable" and a["used"] == "unknown" and "usedBytes" not in a
    await eventually(lambda: not operator_grant_series(operator.metrics_url), what="no grant series")
    await cluster.create(grant_manifest("team-c"))
    c = await eventually(
        lambda: ((cluster.get(GRANTS_PATH, "team-c") or {}).get("status") or {}).get("usage"), what="team-c"
    )
    assert c["state"] == "Unknown" and c["reason"] == "Unreachable"
