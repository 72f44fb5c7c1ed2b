"""Tenants on one pool, on real Mooncake processes: the master enforces each tenant's quota,
tenants miss each other's blocks, a shared reuse domain (one tenant) shares hits, and layouts
that differ miss, within a tenant and across tenants.

``pool``: a master run with ``--enable_multi_tenants`` whose two tenants ask for 24 MiB each
of a 32 MiB store: the master cuts both to 16 MiB. The session's ``local_pool`` runs without
multi-tenancy: there only the tenant in every key keeps tenants apart (docs/tenancy.md).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvpool.connector.contract.identity import KVIdentity, key_fingerprint
from kvpool.connector.contract.keys import KeySpace
from kvpool.connector.contract.layout import GroupKind, KVGroup, KVLayout
from kvpool.connector.contract.settings import ConnectorSettings, SettingsError
from kvpool.connector.local.pool import LocalPool
from kvpool.connector.metadata import GroupTransfer, PoolConnectorMetadata, RequestSave
from kvpool.connector.observability.pool_events import ObservedClient, WorkerReports
from kvpool.connector.observability.records import StatsCollector
from kvpool.connector.pool_client import (
    CODE_OBJECT_NOT_FOUND,
    CODE_TENANT_NOT_REGISTERED,
    CODE_TENANT_QUOTA_EXCEEDED,
    Outcome,
    PoolClient,
    classify,
    open_client,
    scoped_pattern,
)
from kvpool.connector.worker.side import WorkerSide

pytestmark = pytest.mark.mooncake

MIB = 1 << 20
STORE = 32 * MIB
ASKED = 24 * MIB  # each tenant's request: together more than the store holds
CUT = STORE // 2  # what the master grants each, in proportion to the requests


# A lookup or read leases an object (Mooncake's default: 10 s): until it ends, the object is
# neither evicted nor removed. Short here, so a test's objects are gone before the next test.
LEASE_MS = 100


@pytest.fixture(scope="module")
def pool() -> Iterator[LocalPool]:
    with LocalPool(
        segment_size="32MB",
        tenant_quotas={"team-a": ASKED, "team-b": ASKED},
        master_args=(f"--default_kv_lease_ttl={LEASE_MS}",),
    ) as local:
        yield local


def empty(pool: LocalPool, client: PoolClient) -> None:
    """Remove every object of ``client``'s tenant, once their leases end (the master's charge: 0)."""
    assert pool.master is not None
    deadline = time.monotonic() + 50 * LEASE_MS / 1000
    while True:
        client.remove_matching("^")
        if pool.master.tenant_quotas()[client.tenant].charged == 0:
            return
        assert time.monotonic() < deadline, f"{client.tenant}'s objects stay"
        time.sleep(LEASE_MS / 1000)


def client_of(address: str, tenant: str, prefix: str = "tenancy") -> PoolClient:
    settings = ConnectorSettings.parse(
        {"master_server_address": address, "cache_prefix": prefix, "tenant": tenant}
    )
    return open_client(settings, global_segment_size=0)


@pytest.fixture(scope="module")
def team_a(pool) -> Iterator[PoolClient]:
    client = client_of(pool.address, "team-a")
    yield client
    client.close()


@pytest.fixture(scope="module")
def team_a_again(pool) -> Iterator[PoolClient]:
    """Another consumer of team-a: the same reuse domain."""
    client = client_of(pool.address, "team-a")
    yield client
    client.close()


@pytest.fixture(scope="module")
def team_b(pool) -> Iterator[PoolClient]:
    client = client_of(pool.address, "team-b")
    yield client
    client.close()


class Objects:
    """Registered memory to store objects from and read them into, on one client."""

    def __init__(self, client: PoolClient, size: int):
        self.client, self.size = client, size
        self.buffer = np.zeros(size, dtype=np.uint8)
        self.ptr = int(self.buffer.ctypes.data)
        client.register(self.ptr, size)

    def put(self, key: str, fill: int) -> int:
        """Reserve, write and publish one object of ``fill`` bytes; 0, or the first failing code."""
        self.buffer[:] = fill
        code = self.client.reserve([key], [self.size])[0]
        if code != 0:
            return code
        assert self.client.write([key], [[self.ptr]], [[self.size]], [[0]]) == [self.size]
        return self.client.publish([key])[0]

    def get(self, key: str) -> int | None:
        """The fill byte of ``key``'s object as this client loads it; None when it misses."""
        self.buffer[:] = 0
        code = self.client.get_into([key], [[self.ptr]], [[self.size]])[0]
        if classify(code, self.size) is not Outcome.OK:
            assert code == CODE_OBJECT_NOT_FOUND, code
            return None
        values = set(np.unique(self.buffer).tolist())
        assert len(values) == 1, "an object is one fill byte throughout"
        return values.pop()

    def close(self) -> None:
        self.client.unregister(self.ptr, self.size)


def test_oversubscribed_quotas_are_cut_by_the_master(pool, team_a, team_b) -> None:
    quotas = pool.master.tenant_quotas()
    assert {t: (q.requested, q.effective) for t, q in quotas.items()} == {
        "team-a": (ASKED, CUT),
        "team-b": (ASKED, CUT),
    }


def test_reservations_past_the_quota_are_refused_by_mooncake(pool, team_b) -> None:
    keys = [f"over-{i}" for i in range(ASKED // MIB)]
    codes = team_b.reserve(keys, [MIB] * len(keys))
    admitted = [k for k, c in zip(keys, codes) if c == 0]
    refused = [k for k, c in zip(keys, codes) if c == CODE_TENANT_QUOTA_EXCEEDED]
    try:
        assert len(admitted) + len(refused) == len(keys)
        assert len(admitted) * MIB <= CUT < (len(admitted) + 1) * MIB
        assert {classify(c) for c in codes[len(admitted) :]} == {Outcome.QUOTA_EXCEEDED}
        quota = pool.master.tenant_quotas()["team-b"]
        assert quota.charged <= quota.effective == CUT
        # A refused reservation stores nothing: it is never found, never loaded.
        assert team_b.exists(refused) == [False] * len(refused)
        objects = Objects(team_b, MIB)
        try:
            assert all(objects.get(key) is None for key in refused)
        finally:
            objects.close()
    finally:
        team_b.revoke(admitted)
    assert pool.master.tenant_quotas()["team-b"].charged == 0


def test_a_tenant_at_its_quota_evicts_only_its_own_objects(pool, team_a, team_b) -> None:
    b_objects = Objects(team_b, MIB)
    a_objects = Objects(team_a, MIB)
    try:
        for i in range(4):
            assert b_objects.put(f"b-keeps-{i}", 0xB0 + i) == 0
        for i in range(ASKED // MIB):  # more than team-a's cut quota
            assert a_objects.put(f"a-fills-{i}", 0xA0) == 0
        quotas = pool.master.tenant_quotas()
        assert quotas["team-a"].charged <= quotas["team-a"].effective
        held = sum(team_a.exists([f"a-fills-{i}" for i in range(ASKED // MIB)]))
        assert held <= CUT // MIB
        # Team-a's writes past its quota cost team-b nothing.
        assert [b_objects.get(f"b-keeps-{i}") for i in range(4)] == [0xB0 + i for i in range(4)]
    finally:
        empty(pool, team_a)
        empty(pool, team_b)
        a_objects.close()
        b_objects.close()


def test_tenants_miss_each_others_objects_and_a_shared_domain_hits(
    pool, team_a, team_a_again, team_b
) -> None:
    a, a_again, b = Objects(team_a, 4096), Objects(team_a_again, 4096), Objects(team_b, 4096)
    try:
        assert a.put("shared-prefix-block", 0x11) == 0
        assert team_b.exists(["shared-prefix-block"]) == [False]
        assert b.get("shared-prefix-block") is None
        # Team-b's object under the same key is its own; neither overwrites the other.
        assert b.put("shared-prefix-block", 0x22) == 0
        assert a.get("shared-prefix-block") == 0x11
        assert b.get("shared-prefix-block") == 0x22
        # Another consumer of team-a (the same reuse domain) hits team-a's object.
        assert team_a_again.exists(["shared-prefix-block"]) == [True]
        assert a_again.get("shared-prefix-block") == 0x11
        # Removing by pattern stays within a tenant (once the reads' leases end).
        time.sleep(2 * LEASE_MS / 1000)
        assert team_b.remove_matching("^shared-prefix-") == 1
        assert a.get("shared-prefix-block") == 0x11
    finally:
        empty(pool, team_a)
        empty(pool, team_b)
        for objects in (a, a_again, b):
            objects.close()


def _layout(dtype: str) -> KVLayout:
    group = KVGroup(kind=GroupKind.FULL, block_size=16, page_size_bytes=4096)
    return KVLayout(model="m", dtype=dtype, groups=[group], tp_size=1)


def test_layouts_that_differ_miss_within_and_across_tenants(pool, team_a, team_a_again, team_b) -> None:
    half, full = (
        KeySpace("tenancy", key_fingerprint(_layout(d), KVIdentity())) for d in ("float16", "float32")
    )
    digest = "ab" * 16
    writer = Objects(team_a, 4096)
    try:
        assert writer.put(half.key(0, 0, 0, digest), 0x33) == 0
        # The same reuse domain, another layout: a miss, never the other layout's bytes.
        assert team_a_again.exists([full.key(0, 0, 0, digest)]) == [False]
        assert team_a_again.exists([half.key(0, 0, 0, digest)]) == [True]
        # Another tenant misses with either layout.
        assert team_b.exists([half.key(0, 0, 0, digest), full.key(0, 0, 0, digest)]) == [False, False]
    finally:
        empty(pool, team_a)
        writer.close()


def test_a_tenant_without_a_quota_is_refused_and_says_so(pool, caplog) -> None:
    from kvpool.connector import pool_client

    stranger = client_of(pool.address, "team-c")
    log = logging.getLogger(pool_client.logger.name)
    log.addHandler(caplog.handler)
    try:
        (code,) = stranger.reserve(["anything"], [4096])
        assert code == CODE_TENANT_NOT_REGISTERED
        assert classify(code) is Outcome.TENANT_NOT_REGISTERED
        assert stranger.reserve(["more"], [4096]) == [CODE_TENANT_NOT_REGISTERED]
        # (Each record once: the handler may see it directly and through propagation.)
        records = {id(r): r for r in caplog.records if "refused" in r.getMessage()}
        warnings = [r.getMessage() for r in records.values()]
        # One line for both refusals: at most one a minute.
        assert warnings == [
            "Mooncake refused 1 of 1 reservation(s) of tenant 'team-c' (tenant_not_registered): "
            "those blocks are not stored"
        ]
    finally:
        log.removeHandler(caplog.handler)
        stranger.close()


def test_a_save_past_the_quota_fails_as_quota_exceeded_and_stores_nothing(pool, team_b) -> None:
    """The worker's save path: Mooncake refuses, the save counts the refusal by its reason,
    announces nothing, and a later lookup misses (the request recomputes)."""
    from tests.connector.worker.test_worker_transfer import GROUP_LAYERS, NUM_BLOCKS, make_caches

    # Another consumer of team-b holds the whole quota in a reservation in flight.
    filler = client_of(pool.address, "team-b")
    assert filler.reserve(["filler"], [CUT]) == [0]
    reports = WorkerReports(rank=0)
    keyspace = KeySpace("tenancy-save", "fp")
    worker = WorkerSide(
        client=ObservedClient(team_b, reports),
        keyspace=keyspace,
        tp_rank=0,
        pp_rank=0,
        group_layers=GROUP_LAYERS,
        num_blocks=NUM_BLOCKS,
        stats=StatsCollector(group_kinds=("full", "sliding_window")),
    )
    worker.register_kv_caches(make_caches())
    digest = "e" * 32
    try:
        worker.start_saves(PoolConnectorMetadata(saves=[RequestSave("r", [GroupTransfer(0, [digest], [1])])]))
        worker.before_forward()
        worker.wait_for_saves()
        (record,) = worker.stats.drain()[1]
        assert record.blocks == (0,)
        assert record.failures == {Outcome.QUOTA_EXCEEDED.value: 1}
        assert reports.take() is None
        assert team_b.exists([keyspace.key(0, 0, 0, digest)]) == [False]
    finally:
        worker.shutdown()
        filler.revoke(["filler"])
        filler.close()


# --- a master without multi-tenancy: the tenant in every key keeps tenants apart ---------------


def test_without_multi_tenancy_the_key_prefix_keeps_tenants_apart(local_pool, cache_prefix) -> None:
    one, other = (
        client_of(local_pool.address, "one", cache_prefix),
        client_of(local_pool.address, "other", cache_prefix),
    )
    untenanted = open_client(
        ConnectorSettings.parse({"master_server_address": local_pool.address, "cache_prefix": cache_prefix}),
        global_segment_size=0,
    )
    a, b = Objects(one, 4096), Objects(other, 4096)
    key = f"{cache_prefix}/block"
    try:
        assert a.put(key, 0x44) == 0
        assert other.exists([key]) == [False]
        assert b.get(key) is None
        assert b.put(key, 0x55) == 0
        assert a.get(key) == 0x44 and b.get(key) == 0x55
        # As Mooncake holds them: one object per tenant, each behind its tenant.
        assert untenanted.exists([key, f"one/{key}", f"other/{key}"]) == [False, True, True]
        # A tenant's removal by pattern removes its own objects only (two objects no one has
        # read: a read leases an object for 10 s, and a leased object is not removed).
        assert a.put(f"{key}-unread", 0x46) == 0 and b.put(f"{key}-unread", 0x56) == 0
        assert other.remove_matching(f"^{cache_prefix}/block-") == 1
        assert untenanted.exists([f"one/{key}-unread", f"other/{key}-unread"]) == [True, False]
    finally:
        one.remove_matching(f"^{cache_prefix}/")
        other.remove_matching(f"^{cache_prefix}/")
        a.close()
        b.close()
        for client in (one, other, untenanted):
            client.close()


def test_patterns_are_scoped_to_the_tenant() -> None:
    assert scoped_pattern("", "^p/") == "^p/"
    assert scoped_pattern("team.a", "^p/fp/") == "^team\\.a/p/fp/"
    assert scoped_pattern("team-a", "fp") == "^team-a/.*(?:fp)"


@pytest.mark.parametrize("tenant", ["_reserved", "Team", "a/b", "a" * 64, "-a", "a b"])
def test_a_bad_tenant_names_the_field_and_the_rule(tenant: str) -> None:
    with pytest.raises(SettingsError) as caught:
        ConnectorSettings.parse({"master_server_address": "127.0.0.1:1", "tenant": tenant})
    assert set(caught.value.problems) == {"tenant"}
    assert "lowercase letters, digits, '.' or '-'" in caught.value.problems["tenant"]


def test_the_quota_policy_is_mooncakes_schema() -> None:
    from kvpool.connector.local.tenant_quotas import policy_yaml

    assert (
        policy_yaml({"team-a": 1 << 30}) == "version: 1\ntenants:\n  - name: team-a\n    quota: 1073741824\n"
    )
    with pytest.raises(ValueError, match="is not a tenant"):
        policy_yaml({"_system": 1})
    with pytest.raises(ValueError, match="a quota is at least 1 byte"):
        policy_yaml({"team-a": 0})
