"""A store's local disk tier on real Mooncake processes: a working set three times the store's
memory keeps its hits; without the tier the oldest two thirds are gone."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpool.connector.contract.settings import ConnectorSettings
from kvpool.connector.local.disk_tier import DiskTier
from kvpool.connector.local.pool import LocalPool
from kvpool.connector.pool_client import CODE_TENANT_QUOTA_EXCEEDED, open_client
from testing.disk_workload import WorkloadResult, write_and_read

SEGMENT = 16 << 20
OBJECT = 512 << 10
WORKING_SET = 3 * SEGMENT // OBJECT  # objects: three times what the store's memory holds


def _run(tier: DiskTier | None) -> tuple[WorkloadResult, int]:
    """The working set on a fresh pool; its result and the tier's bytes on disk meanwhile."""
    with LocalPool(segment_size=f"{SEGMENT >> 20}MB", disk_tier=tier) as pool:
        client = open_client(
            ConnectorSettings.parse({"master_server_address": pool.address}), global_segment_size=0
        )
        try:
            result = write_and_read(client, [f"ws-{i}" for i in range(WORKING_SET)], OBJECT)
        finally:
            client.close()
        on_disk = 0 if tier is None else tier.usage_bytes()
    return result, on_disk


@pytest.mark.mooncake
def test_without_the_tier_the_oldest_objects_are_gone() -> None:
    result, _ = _run(None)
    assert result.stored == WORKING_SET
    assert result.wrong == 0
    # Memory holds a third of the working set at most: the rest was evicted and misses.
    assert 0 < result.hits <= WORKING_SET // 3
    assert result.misses == {"missing": WORKING_SET - result.hits}


@pytest.mark.mooncake
def test_a_working_set_three_times_memory_keeps_its_hits_through_the_disk_tier(tmp_path: Path) -> None:
    tier = DiskTier(capacity=256 << 20, parent=tmp_path)
    result, on_disk = _run(tier)
    assert result.stored == WORKING_SET
    assert result.wrong == 0
    assert result.hits == WORKING_SET, result.misses
    # At least the part memory could not hold was read from files in the tier's directory.
    assert on_disk >= (WORKING_SET * OBJECT - SEGMENT)
    # Stopping the pool removed the tier's directory; its parent stays.
    assert tier.directory is None and list(tmp_path.iterdir()) == []


@pytest.mark.mooncake
def test_a_full_tier_drops_its_least_recently_used_objects_never_a_wrong_block(tmp_path: Path) -> None:
    """A tier of the store's size under the same working set: the oldest objects leave the
    disk (LRU, under the high watermark: how many stay varies from run to run); the newest
    third still hits; no load is wrong."""
    tier = DiskTier(capacity=SEGMENT, parent=tmp_path, eviction="lru", bucket_bytes=4 << 20)
    with LocalPool(segment_size=f"{SEGMENT >> 20}MB", disk_tier=tier) as pool:
        client = open_client(
            ConnectorSettings.parse({"master_server_address": pool.address}), global_segment_size=0
        )
        try:
            result = write_and_read(
                client, [f"lru-{i}" for i in range(WORKING_SET)], OBJECT, write_deadline_s=20
            )
        finally:
            client.close()
        on_disk = tier.usage_bytes()
    assert result.stored == WORKING_SET and result.wrong == 0
    assert result.hits < WORKING_SET  # the tier could not hold the rest
    assert min(result.missed) < WORKING_SET // 3  # the oldest went first...
    assert all(i < WORKING_SET - WORKING_SET // 3 for i in result.missed)  # ...the newest stay
    assert on_disk <= SEGMENT


@pytest.mark.mooncake
def test_a_tenants_quota_bounds_its_memory_and_the_tier_keeps_the_rest(tmp_path: Path) -> None:
    """A tenant of 8 MiB writes 24 MiB: Mooncake keeps its memory at the quota (writes past it
    are refused until the tier has written older objects), and every object still hits."""
    quota, objects = 8 << 20, 24
    tier = DiskTier(capacity=256 << 20, parent=tmp_path)
    with LocalPool(segment_size="32MB", tenant_quotas={"team-a": quota}, disk_tier=tier) as pool:
        assert pool.master is not None
        settings = ConnectorSettings.parse({"master_server_address": pool.address, "tenant": "team-a"})
        client = open_client(settings, global_segment_size=0)
        try:
            keys = [f"over-quota-{i}" for i in range(objects)]
            result = write_and_read(client, keys, 1 << 20, retry_codes=(CODE_TENANT_QUOTA_EXCEEDED,))
        finally:
            client.close()
        charged = pool.master.tenant_quotas()["team-a"].charged
        on_disk = tier.usage_bytes()
    assert result.stored == objects and result.refusals > 0
    assert result.wrong == 0 and result.hits == objects, result.misses
    assert charged <= quota
    assert on_disk >= objects * (1 << 20) - quota


def test_disk_tier_options_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="watermarks: 0 < low watermark < high watermark <= 1"):
        DiskTier(capacity=1 << 30, high_watermark=0.5, low_watermark=0.7)
    with pytest.raises(ValueError, match="eviction: one of none, fifo, lru"):
        DiskTier(capacity=1 << 30, eviction="random")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="capacity: at least 1 MiB"):
        DiskTier(capacity=1024)
    with pytest.raises(ValueError, match="is not a directory"):
        DiskTier(capacity=1 << 30, parent=tmp_path / "absent")
    with pytest.raises(ValueError, match="at most half the store's memory"):
        LocalPool(segment_size="16MB", disk_tier=DiskTier(capacity=1 << 30, bucket_bytes=16 << 20)).start()


def test_the_store_gets_mooncake_offload_settings(tmp_path: Path) -> None:
    tier = DiskTier(capacity=1 << 30, parent=tmp_path, key_limit=1000, eviction="fifo")
    env = tier.store_env()
    try:
        assert Path(env["MOONCAKE_OFFLOAD_FILE_STORAGE_PATH"]).parent == tmp_path.resolve()
        assert env["MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES"] == str(1 << 30)
        assert env["MOONCAKE_OFFLOAD_TOTAL_KEYS_LIMIT"] == "1000"
        assert env["MOONCAKE_OFFLOAD_BUCKET_EVICTION_POLICY"] == "fifo"
        assert "--enable_offload=true" in tier.master_args()
    finally:
        tier.remove()
    assert list(tmp_path.iterdir()) == []
