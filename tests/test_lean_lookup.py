"""The lookup path's parts that cost nothing unless used: spans, per-group statistics, keys."""

from __future__ import annotations

import copy
import os
from dataclasses import asdict

from opentelemetry import trace

from kvpool.connector import tracing
from kvpool.connector.contract.keys import KeySpace, hash_digest
from kvpool.connector.hybrid_hit import HybridHitCoordinator
from kvpool.connector.records import Deferred, LookupRecord
from tests.support.kv_cache import GroupDesc, make_coordinator


def test_span_is_a_shared_no_op_without_a_tracer_provider(monkeypatch) -> None:
    monkeypatch.setattr(trace, "get_tracer_provider", trace.ProxyTracerProvider)
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
    hit = ours.find_hit_indexed(block_hashes, present, 12 * 32 - 1)
    assert "group_hit_tokens" not in vars(hit)
    assert hit.hit_tokens == 6 * 32 and hit.needed_blocks[1] == (4, 5)
    assert hit.group_hit_tokens == (11 * 32, 6 * 32)
    assert hit == ours.find_hit(block_hashes, {g: set(p) for g, p in present.items()}, 12 * 32 - 1)


def test_rank_prefix_plus_digest_is_the_key() -> None:
    keyspace = KeySpace("pool", "f" * 16)
    digest = hash_digest(b"block")
    prefixes = keyspace.rank_prefixes(2, tp_size=2, pp_size=2)
    assert [p + digest for p in prefixes] == [
        keyspace.key(2, tp, pp, digest) for pp in range(2) for tp in range(2)
    ]
    assert keyspace.rank_keys(2, 2, 2, digest) == [p + digest for p in prefixes]
