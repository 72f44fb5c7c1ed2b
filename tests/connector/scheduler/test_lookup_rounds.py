"""A partial hit in one round trip: a lookup whose every block is few more keys than its
first round asks about asks about all of them at once, and finds the same hit.

The master is a set of present keys here (``exists`` as the presence service calls it): the
point is the calls made and the hit found, which ``test_batched_lookups`` and
``test_hybrid_hit`` check against vLLM's own coordinator on drawn cases.
"""

from __future__ import annotations

import os
import time

import pytest

from kvpool.connector.contract.keys import hash_digest
from kvpool.connector.scheduler import lookups
from kvpool.connector.scheduler.hybrid_hit import HybridHitCoordinator
from kvpool.connector.scheduler.lookups import Lookup, LookupQuery, answer_together
from testing.kv_cache import GroupDesc, make_coordinator

FULL_SWA = [GroupDesc("full", 32), GroupDesc("sliding_window", 32, window=64)]
BLOCKS = 12
HELD_PREFIX = 8  # full attention holds blocks 0..7: the hit is 8 blocks, shorter than the longest


def _partial_hit() -> tuple[int, list[int], int]:
    """(existence calls, keys per call, hit tokens) of one lookup of a partial hit."""
    ours = HybridHitCoordinator.from_vllm_coordinator(make_coordinator(FULL_SWA))
    block_hashes = [os.urandom(32) for _ in range(BLOCKS)]
    present = {f"g0/{hash_digest(h)}" for h in block_hashes[:HELD_PREFIX]}
    present |= {f"g1/{hash_digest(h)}" for h in block_hashes}
    now = time.perf_counter()
    query = LookupQuery("r", block_hashes, BLOCKS * 32, 0, {}, now, 0, now + 3600)
    lookup = Lookup(ours, query, lambda g: (f"g{g}/",), lambda g: 1)
    sizes: list[int] = []

    def exists(keys: list[str], deadline: float) -> tuple[list[bool], str | None]:
        sizes.append(len(keys))
        return [k in present for k in keys], None

    calls = answer_together([lookup], exists)
    assert lookup.result is not None
    hit, _ = lookup.result
    return calls, sizes, hit.hit_tokens


def test_a_partial_hit_takes_one_round_trip(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fails when the lookup asks round by round (two calls for this hit)."""
    calls, sizes, hit_tokens = _partial_hit()
    assert hit_tokens == HELD_PREFIX * 32
    assert calls == 1 and sizes == [2 * (BLOCKS - 1)]  # every block of both groups up to the longest hit

    monkeypatch.setattr(lookups, "ASK_AHEAD_KEYS", 0)  # round by round: the same hit, a second call
    round_by_round, sizes, same_hit = _partial_hit()
    assert same_hit == hit_tokens and round_by_round == 2 and sizes[0] < 2 * (BLOCKS - 1)


def test_past_the_ask_ahead_keys_the_first_round_stays_lean(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lookups, "ASK_AHEAD_KEYS", 8)  # one fewer than the 9 blocks more than round 1
    calls, sizes, hit_tokens = _partial_hit()
    assert hit_tokens == HELD_PREFIX * 32 and calls == 2 and sizes[0] < 2 * (BLOCKS - 1)
