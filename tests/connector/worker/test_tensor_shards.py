"""Tensor shards: ranks that hold copies of the same KV store it once and share its keys.

Pure parts (the shard split, who writes, the keys and fingerprints it implies, the layout
rules), the scheduler's events per shard, and two real ranks of a replicated group over a
real Mooncake: only the lowest rank stores, the other reads that object.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvpool.connector.contract.identity import KVIdentity, key_fingerprint
from kvpool.connector.contract.keys import KeySpace
from kvpool.connector.contract.layout import GroupKind, KVGroup, KVLayout, check, fingerprint
from kvpool.connector.contract.shards import (
    group_shards,
    kv_shards_of,
    shard_independent,
    shard_of,
    writes_shard,
)
from kvpool.connector.metadata import GroupTransfer, PoolConnectorMetadata, RequestLoad, RequestSave
from kvpool.connector.observability.records import StatsCollector
from testing.worker import run_loads

BLOCK = 32
FULL = KVGroup(kind=GroupKind.FULL, block_size=BLOCK, page_size_bytes=8192)
MAMBA = KVGroup(kind=GroupKind.MAMBA, block_size=BLOCK, mamba_cache_mode="align", page_size_bytes=4096)


def layout(tp: int, shards: int | None, *groups: KVGroup) -> KVLayout:
    return KVLayout(model="m", dtype="float32", groups=list(groups or [FULL]), tp_size=tp, kv_shards=shards)


def keys_fingerprint(value: KVLayout) -> str:
    return key_fingerprint(value, KVIdentity())


@pytest.mark.parametrize(
    ("tp", "heads", "mla", "shards"),
    [(1, 1, False, 1), (2, 1, False, 1), (4, 2, False, 2), (2, 8, False, 2), (8, 8, True, 1)],
)
def test_the_shard_split_is_the_kv_heads_over_the_ranks(tp: int, heads: int, mla: bool, shards: int) -> None:
    assert kv_shards_of(tp, heads, mla) == shards


def test_the_lowest_rank_of_each_shard_writes_it() -> None:
    assert [shard_of(r, 4, 2) for r in range(4)] == [0, 0, 1, 1]
    assert [writes_shard(r, 4, 2) for r in range(4)] == [True, False, True, False]
    assert [shard_of(r, 2, 2) for r in range(2)] == [0, 1]  # no copies: every rank writes its own
    assert all(writes_shard(r, 2, 2) for r in range(2))


def test_attention_groups_are_split_by_shard_mamba_groups_by_rank() -> None:
    assert group_shards(layout(4, 2, FULL, MAMBA)) == (2, 4)
    assert group_shards(layout(4, None, FULL, MAMBA)) == (4, 4)
    eagle = FULL.model_copy(update={"eagle": True})
    assert group_shards(layout(2, 1, FULL, eagle)) == (1, 2)  # a draft's KV heads are its own


def test_engines_with_the_same_shard_split_share_keys_whatever_their_tp_size() -> None:
    # One KV head: TP=1 and TP=2 hold the same single shard.
    assert keys_fingerprint(layout(1, None)) == keys_fingerprint(layout(2, 1))
    # Two KV heads: TP=2 (each rank its own head) and TP=4 (two copies of each).
    assert keys_fingerprint(layout(2, None)) == keys_fingerprint(layout(4, 2))
    # Their keys of a shard are the same string.
    space = KeySpace("p", keys_fingerprint(layout(4, 2)))
    assert space.rank_prefixes(0, group_shards(layout(4, 2))[0], 1) == space.rank_prefixes(0, 2, 1)


def test_what_differs_per_rank_keeps_engines_apart() -> None:
    # Another shard split, another per-rank page size, another meaning of the rank part.
    assert keys_fingerprint(layout(4, 1)) != keys_fingerprint(layout(4, 2))
    half = FULL.model_copy(update={"page_size_bytes": 4096})
    assert keys_fingerprint(layout(2, 1)) != keys_fingerprint(layout(1, None, half))
    assert keys_fingerprint(layout(2, None)) != keys_fingerprint(layout(2, 1))
    # A Mamba group is split per rank: its tensor size stays in the fingerprint.
    assert keys_fingerprint(layout(4, 2, FULL, MAMBA)) != keys_fingerprint(layout(2, None, FULL, MAMBA))
    assert shard_independent(layout(4, 2, FULL, MAMBA)).tp_size == 4


def test_one_shard_per_rank_is_the_layout_without_kv_shards() -> None:
    # Declared layouts without the field keep their fingerprint; copies change it.
    assert fingerprint(layout(2, 2)) == fingerprint(layout(2, None))
    assert fingerprint(layout(2, 1)) != fingerprint(layout(2, None))


@pytest.mark.parametrize(
    ("update", "rule"),
    [
        ({"tp_size": 4, "kv_shards": 3}, "kv-shards-divide-tp"),
        ({"tp_size": 2, "kv_shards": 4}, "kv-shards-divide-tp"),
        ({"tp_size": 2, "kv_shards": 1, "dcp_size": 2}, "kv-shards-context-parallel"),
    ],
)
def test_a_shard_split_the_ranks_cannot_hold_is_refused(update: dict[str, int], rule: str) -> None:
    problems = check(layout(1, None).model_copy(update=update))
    assert [(p.field, p.rule) for p in problems] == [("kv_shards", rule)]
    assert check(layout(4, 2)) == [] and check(layout(2, 1)) == []


def test_a_block_of_a_replicated_group_is_announced_once_its_one_key_is_stored() -> None:
    from vllm.distributed.kv_events import BlockStored

    from kvpool.connector.contract.keys import hash_digest
    from kvpool.connector.observability.pool_events import STORED, PoolKeyReports, SchedulerEvents
    from kvpool.connector.scheduler.hybrid_hit import HybridHitCoordinator
    from testing.kv_cache import GroupDesc, make_coordinator, make_kv_cache_config
    from testing.prompts import hashed_request

    groups = [GroupDesc("full")]
    events = SchedulerEvents(make_kv_cache_config(groups), (1,))  # TP=2, one shard
    coordinator = HybridHitCoordinator.from_vllm_coordinator(make_coordinator(groups))
    request = hashed_request([(5 * i + 1) % 400 for i in range(BLOCK + 3)], BLOCK, request_id="r")
    digest = hash_digest(bytes(request.block_hashes[0]))
    save = RequestSave("r", [GroupTransfer(0, [digest], [4])])
    events.track(request)
    events.on_saves_planned(PoolConnectorMetadata(saves=[save]), lambda _: ([4],), coordinator)
    events.on_reports(PoolKeyReports([(STORED, 0, digest, 0)]))  # rank 0, the shard's writer
    assert [type(e) for e in events.take_events()] == [BlockStored]


def shard_copy_rank(client: Any, keyspace: KeySpace, tp_rank: int) -> Any:
    """Rank ``tp_rank`` of a TP=2 engine whose one group is one shard: rank 1 holds a copy."""
    from kvpool.connector.worker.side import WorkerSide

    return WorkerSide(
        client=client,
        keyspace=keyspace,
        tp_rank=tp_rank,
        pp_rank=0,
        group_layers=[["l0"]],
        num_blocks=8,
        stats=StatsCollector(group_kinds=("full",)),
        tp_size=2,
        group_shards=(1,),
    )


@pytest.mark.mooncake
def test_the_second_rank_of_a_shard_saves_nothing_and_loads_the_first_ranks_object(
    pool_client, cache_prefix
) -> None:
    import torch

    space = KeySpace(cache_prefix, "shards")
    first, second = (shard_copy_rank(pool_client, space, r) for r in (0, 1))
    caches = [torch.randn(2, 8, BLOCK, 1, 8), torch.zeros(2, 8, BLOCK, 1, 8)]
    first.register_kv_caches({"l0": caches[0]})
    second.register_kv_caches({"l0": caches[1]})
    try:
        # Rank 1 first: it holds a copy, so it stores nothing; rank 0 stores the one object.
        for worker in (second, first):
            save = RequestSave("r", [GroupTransfer(0, ["d0", "d1"], [1, 2])])
            worker.start_saves(PoolConnectorMetadata(saves=[save]))
            worker.before_forward()
            worker.wait_for_saves()
            if worker is second:
                assert pool_client.exists([space.key(0, 0, 0, "d0")]) == [False]
        assert pool_client.exists([space.key(0, s, 0, d) for s in (0, 1) for d in ("d0", "d1")]) == [
            True,
            True,
            False,
            False,
        ]
        saved = [r for r in second.stats.drain()[1] if r.operation == "save"]
        assert [r.bytes for r in saved] == [(0,)]  # its bytes are not counted: it moved none
        # Rank 1 loads rank 0's object (header naming shard 0) into its own blocks.
        load = RequestLoad("r", [GroupTransfer(0, ["d0", "d1"], [5, 6])], hit_tokens=2 * BLOCK)
        run_loads(second, [load])
        assert second.take_load_errors() == set()
        assert torch.equal(caches[1][:, 5:7], caches[0][:, 1:3])
    finally:
        first.shutdown()
        second.shutdown()


@pytest.mark.mooncake
def test_a_save_not_made_fails_only_on_the_rank_that_writes_its_shard(pool_client, cache_prefix) -> None:
    """A save dropped (its forward raised) counts its keys failed on the rank that would have
    written them, never on a rank that holds a copy (it writes none: every rank now counts
    its failures, so the copy would count the same keys again)."""
    import torch

    failures = []
    for tp_rank in (0, 1):
        worker = shard_copy_rank(pool_client, KeySpace(cache_prefix, "shards"), tp_rank)
        worker.register_kv_caches({"l0": torch.zeros(2, 8, BLOCK, 1, 8)})
        try:
            worker.drop_saves(
                PoolConnectorMetadata(saves=[RequestSave("r", [GroupTransfer(0, ["d0"], [1])])])
            )
            (record,) = worker.stats.drain()[1]
            failures.append(dict(record.group_failures[0]))
        finally:
            worker.shutdown()
    assert failures == [{"forward_failed": 1}, {}]


def _vllm_config(tp: int, heads: int, mla: bool = False, dcp: int = 1) -> object:
    from types import SimpleNamespace

    model = SimpleNamespace(use_mla=mla, get_total_num_kv_heads=lambda: heads)
    parallel = SimpleNamespace(
        tensor_parallel_size=tp, prefill_context_parallel_size=1, decode_context_parallel_size=dcp
    )
    return SimpleNamespace(model_config=model, parallel_config=parallel)


def _kv_cache_config(*specs: object) -> object:
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    groups = [KVCacheGroupSpec([f"l{i}"], spec) for i, spec in enumerate(specs)]
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)


def test_the_connector_reads_the_shard_split_from_vllms_config_and_specs() -> None:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    from kvpool.connector.vllm_layout import _kv_shards

    def full(heads: int, **extra: object) -> FullAttentionSpec:
        return FullAttentionSpec(
            block_size=BLOCK, num_kv_heads=heads, head_size=64, dtype=torch.float32, **extra
        )

    assert _kv_shards(_vllm_config(2, 1), _kv_cache_config(full(1))) == 1
    assert _kv_shards(_vllm_config(4, 2), _kv_cache_config(full(1))) == 2
    assert _kv_shards(_vllm_config(2, 2), _kv_cache_config(full(1))) is None  # one head per rank: no copies
    mla = MLAAttentionSpec(
        block_size=BLOCK, num_kv_heads=1, head_size=576, dtype=torch.float32, max_tp_shards=1
    )
    assert _kv_shards(_vllm_config(4, 8, mla=True), _kv_cache_config(mla)) == 1
    # Anything that disagrees is one object per rank: per-rank heads, vLLM's word, context parallelism.
    assert _kv_shards(_vllm_config(2, 1), _kv_cache_config(full(2))) is None
    assert _kv_shards(_vllm_config(4, 2), _kv_cache_config(full(1, max_tp_shards=4))) is None
    assert _kv_shards(_vllm_config(2, 1, dcp=2), _kv_cache_config(full(1))) is None
