"""The lookup path's parts that cost nothing unless used: spans, per-group statistics, keys."""

from __future__ import annotations

import copy
import hashlib
import os
from dataclasses import asdict

import pytest
from opentelemetry import trace

from kvpool.connector.contract.keys import KeySpace, hash_digest, hash_digests
from kvpool.connector.observability import tracing
from kvpool.connector.observability.records import Deferred, LookupRecord
from kvpool.connector.scheduler.hybrid_hit import HybridHitCoordinator
from testing.engine import scheduler_of
from testing.hit_oracle import find_hit, find_hit_indexed
from testing.kv_cache import GroupDesc, make_coordinator
from testing.pool_store import put_bytes


def test_span_is_a_shared_no_op_without_a_tracer_provider(monkeypatch) -> None:
    monkeypatch.setattr(trace, "get_tracer_provider", trace.ProxyTracerProvider)
    # This process may have installed a provider for another test, and tracing believes
    # "on" for good once seen: forget it, as in a process that never had one.
    monkeypatch.setattr(tracing, "_on", False)
    monkeypatch.setattr(tracing, "_off_until", 0.0)
    assert not tracing.enabled()
    first = tracing.span("kvpool.lookup", {"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}, a=1)
    assert first is tracing.span("kvpool.load")
    with first as span:
        assert not span.is_recording()
        tracing.set_attributes(span, hit_tokens=3)
        tracing.mark_failed(span, {"timeout": 1})


def test_deferred_counts_are_computed_once_on_first_read() -> None:
    calls: list[int] = []

    def compute() -> tuple[int, ...]:
        calls.append(1)
        return (64, 32)

    counts = Deferred(compute)
    assert calls == []
    assert counts[0] == 64 and list(counts) == [64, 32] and len(counts) == 2
    assert counts == (64, 32) and calls == [1]
    record = LookupRecord(
        query_tokens=1,
        hit_tokens=0,
        group_kinds=("full", "sliding_window"),
        looked_up_blocks=(2, 2),
        present_blocks=(0, 0),
        needed_blocks=(0, 0),
        group_hit_tokens=Deferred(lambda: (5, 6)),
        seconds=0.0,
        keys=4,
    )
    # Copied (as the local engine's recording hands records out), it is the plain counts.
    assert asdict(record)["group_hit_tokens"] == (5, 6)
    assert copy.deepcopy(counts) == (64, 32) and type(copy.deepcopy(counts)) is tuple


def test_per_group_hits_are_computed_only_when_read() -> None:
    groups = [GroupDesc("full", 32), GroupDesc("sliding_window", 32, window=64)]
    ours = HybridHitCoordinator.from_vllm_coordinator(make_coordinator(groups))
    block_hashes = [os.urandom(32) for _ in range(12)]
    present = {
        0: {bytes(h): i for i, h in enumerate(block_hashes)},
        1: {bytes(h): i for i, h in enumerate(block_hashes[:6])},
    }
    hit = find_hit_indexed(ours, block_hashes, present, 12 * 32 - 1)
    assert "group_hit_tokens" not in vars(hit)
    assert hit.hit_tokens == 6 * 32 and hit.needed_blocks[1] == (4, 5)
    assert hit.group_hit_tokens == (11 * 32, 6 * 32)
    assert hit == find_hit(ours, block_hashes, {g: set(p) for g, p in present.items()}, 12 * 32 - 1)


def test_rank_prefix_plus_digest_is_the_key() -> None:
    keyspace = KeySpace("pool", "f" * 16)
    digest = hash_digest(b"block")
    prefixes = keyspace.rank_prefixes(2, tp_size=2, pp_size=2)
    assert [p + digest for p in prefixes] == [
        keyspace.key(2, tp, pp, digest) for pp in range(2) for tp in range(2)
    ]
    assert keyspace.rank_keys(2, 2, 2, digest) == [p + digest for p in prefixes]


def test_a_block_hash_is_named_by_its_hex_and_a_merged_one_by_its_blake2b() -> None:
    sha = hashlib.sha256(b"prefix").digest()  # vLLM's default block hash: 32 bytes
    assert hash_digest(sha) == sha.hex()
    assert hash_digest(bytearray(sha)) == sha.hex()  # any bytes-like hash
    merged = sha + hashlib.sha256(b"next").digest()  # a group spanning two hash blocks
    assert hash_digest(merged) == hashlib.blake2b(merged, digest_size=32).hexdigest()
    assert len(hash_digest(merged)) == len(hash_digest(sha)) == 64
    assert hash_digest(merged) != hash_digest(merged[:32]) != hash_digest(merged[32:])
    hashes = [sha, merged, hashlib.sha256(b"x").digest()]
    assert hash_digests(hashes, [2, 0, 1]) == [hash_digest(hashes[i]) for i in (2, 0, 1)]


def test_lookups_share_one_read_only_marker_per_block_index() -> None:
    from kvpool.connector.scheduler.hybrid_hit import AskingBlockPool

    known = {0: {0: True, 1: False}}
    index_of = {0: {b"a": 0, b"b": 1, b"c": 2}}
    first = AskingBlockPool(32, index_of, known, assume_present=True)
    second = AskingBlockPool(32, index_of, known, assume_present=False)
    [marker] = first.get_cached_block(b"a", [0])
    assert marker.block_id == 0 and not marker.is_null
    assert second.get_cached_block(b"a", [0])[0] is marker
    assert first.get_cached_block(b"b", [0]) is None  # asked: absent
    assert first.get_cached_block(b"c", [0])[0].block_id == 2  # not asked: taken as present, noted
    assert first.read_unknown == {0: {2: None}}
    assert second.get_cached_block(b"c", [0]) is None and second.read_unknown == {}
    assert first.get_cached_block(b"a", [0, 0]) == [marker, marker]  # groups sharing a spec


# --- statistics over every looked-up block, asked about off the lookup's path ------------
# (The presence service that asks: test_presence.py.)


@pytest.mark.mooncake
def test_statistics_count_blocks_the_lookup_did_not_ask_about(
    tmp_path_factory, pool_settings, pool_client, monkeypatch
) -> None:
    from kvpool.connector.scheduler import lookups
    from testing.models import build_gemma3
    from testing.scheduler import local_pool_transfer, make_request, make_scheduler, matched_tokens

    # Round by round, as a prompt whose blocks are more than ASK_AHEAD_KEYS past its first round.
    monkeypatch.setattr(lookups, "ASK_AHEAD_KEYS", 0)

    groups = [GroupDesc("full", 32), GroupDesc("sliding_window", 32, window=64)]
    transfer = local_pool_transfer(pool_settings)
    scheduler = make_scheduler(build_gemma3(tmp_path_factory.mktemp("gemma3-stats")), groups, transfer)
    try:
        connector = scheduler.connector
        request = make_request(scheduler, list(range(10, 10 + 12 * 32 + 5)))
        coord = scheduler_of(connector).coordinator
        # Full attention holds 4 blocks, the window group all 12.
        for group_id, count in ((0, 4), (1, 12)):
            view = coord.group_block_hashes(group_id, request.block_hashes)
            for i in range(count):
                key = connector.keyspace.key(group_id, 0, 0, hash_digest(bytes(view[i])))
                assert put_bytes(pool_client, key, b"kv" * 8) == 0

        hit, _ = matched_tokens(connector, request)
        assert hit == 4 * 32
        record = connector.stats.lookups[-1]
        # Asked: full attention's 12 blocks, the window at the longest hit's end and at 4 blocks.
        assert record.keys == 12 + 2 + 2
        assert record.looked_up_blocks == (12, 12)
        assert tuple(record.present_blocks) == (4, 12)
        # Alone, the window group could have served all 12 blocks.
        assert tuple(record.group_hit_tokens) == (4 * 32, 12 * 32)
    finally:
        scheduler.shutdown()


def test_statistics_ask_nothing_more_of_a_lookup_that_asked_about_every_block(monkeypatch) -> None:
    """A lookup that asked about every block its hit could use has all its statistics: no
    second existence check (issue #32: each lookup asked one, of no keys, and computed its
    statistics on the presence thread a second time); one that did not asks about the rest."""
    import time

    from kvpool.connector.scheduler import lookups
    from kvpool.connector.scheduler.lookup_statistics import lookup_statistics
    from kvpool.connector.scheduler.lookups import Lookup, LookupQuery, answer_together
    from kvpool.connector.scheduler.presence import Question

    ours = HybridHitCoordinator.from_vllm_coordinator(
        make_coordinator([GroupDesc("full", 32), GroupDesc("sliding_window", 32, window=64)])
    )
    block_hashes = [os.urandom(32) for _ in range(12)]
    held = {f"p/{g}/{hash_digest(h)}" for g in (0, 1) for h in block_hashes[:4]}
    # Asking ahead, the first round asks about all 24 blocks; without, the window group's rest
    # is left to the statistics.
    for ask_ahead, questions_asked in ((256, 0), (0, 1)):
        monkeypatch.setattr(lookups, "ASK_AHEAD_KEYS", ask_ahead)
        now = time.perf_counter()
        query = LookupQuery("r", block_hashes, 12 * 32, 0, {}, now, 0, now + 60)
        lookup = Lookup(ours, query, lambda g: (f"p/{g}/",), lambda g: 1)
        answer_together([lookup], lambda keys, deadline: ([k in held for k in keys], None))
        assert lookup.result is not None
        hit, known = lookup.result
        asked: list[list[str]] = []

        def ask(make_keys, asked=asked):
            keys = make_keys()
            asked.append(keys)
            question = Question(lambda: keys, time.perf_counter() + 60, time.perf_counter)
            question._answer([k in held for k in keys])
            return question

        statistics = lookup_statistics(lookup, known, ask, lambda g: 1)
        # Nothing left to ask: the numbers themselves, not a function waiting for an answer.
        assert callable(statistics) == bool(questions_asked)
        present, group_hits = statistics() if callable(statistics) else statistics
        assert len(asked) == questions_asked
        assert hit.hit_tokens == 4 * 32 and present == (4, 4) and group_hits == (4 * 32, 4 * 32)


# --- a request vLLM could not allocate yet keeps its lookup ----------------------------------


@pytest.mark.mooncake
def test_a_request_retried_under_memory_pressure_is_looked_up_and_counted_once(
    tmp_path_factory, pool_settings, pool_client
) -> None:
    from vllm.v1.request import RequestStatus

    from testing.models import build_gemma3
    from testing.scheduler import local_pool_transfer, make_request, make_scheduler, schedule_answered

    groups = [GroupDesc("full", 32), GroupDesc("sliding_window", 32, window=64)]
    transfer = local_pool_transfer(pool_settings)
    model = build_gemma3(tmp_path_factory.mktemp("gemma3-retry"))
    scheduler = make_scheduler(model, groups, transfer, num_blocks=24)
    try:
        connector = scheduler.connector
        coord = scheduler_of(connector).coordinator
        # A occupies most of the blocks; B's prompt is in the pool but does not fit yet.
        first = make_request(scheduler, [1] * (7 * 32), max_tokens=64)
        second = make_request(scheduler, list(range(10, 10 + 8 * 32 + 5)))
        for group_id in (0, 1):
            view = coord.group_block_hashes(group_id, second.block_hashes)
            for i in range(8):
                key = connector.keyspace.key(group_id, 0, 0, hash_digest(bytes(view[i])))
                assert put_bytes(pool_client, key, b"kv" * 8) == 0
        scheduler.add_request(first)
        scheduler.schedule()
        scheduler.add_request(second)
        for _ in range(3):
            schedule_answered(scheduler)
            assert second.status == RequestStatus.WAITING
        looked_up = [r for r in connector.stats.lookups if r.query_tokens == second.num_tokens]
        assert len(looked_up) == 1 and looked_up[0].hit_tokens == 8 * 32

        # Room again: B is admitted with the hit it was looked up with, and loads it.
        scheduler.finish_requests([first.request_id], RequestStatus.FINISHED_ABORTED)
        output = scheduler.schedule()
        assert second.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        (load,) = [x for x in output.kv_connector_metadata.loads if x.req_id == second.request_id]
        assert load.hit_tokens == 8 * 32 and len(load.groups[0].block_ids) == 8
        assert len([r for r in connector.stats.lookups if r.query_tokens == second.num_tokens]) == 1
        # Allocated: a later lookup of it would ask the master again.
        assert scheduler_of(connector).requests[second.request_id].looked_up is None
    finally:
        scheduler.shutdown()
