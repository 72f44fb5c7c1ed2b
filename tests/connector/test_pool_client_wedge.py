"""``PoolClient.exists`` against a wedged existence call: a real master and store, one fake
(the wedge, :mod:`testing.exists_wedge`: Mooncake's call on the client's own store object
never ends until released).

A check waits at most ``exists_deadline_s`` (then: every key absent, counted, and
``presence`` says it timed out); while that
call stays inside Mooncake, a spare client answers; once it returns, the client answers
again; closing the client ends both existence lanes.
"""

from __future__ import annotations

import threading
import time

import pytest

from kvpool.connector.pool_client import open_client
from testing.exists_wedge import Wedge
from testing.pool_store import put_bytes, raw_store

pytestmark = pytest.mark.mooncake

KEYS = ["a", "b", "c"]


def existence_lanes() -> set[threading.Thread]:
    """The existence lanes alive in this process now."""
    return {t for t in threading.enumerate() if t.name.startswith("kvpool-exists")}


def test_a_spare_answers_while_an_existence_call_is_wedged(pool_settings, monkeypatch) -> None:
    lanes_before = existence_lanes()
    settings = pool_settings.model_copy(update={"store_timeout_s": 1})
    client = open_client(settings, global_segment_size=0)
    wedge: Wedge | None = None
    try:
        assert put_bytes(client, KEYS[0], b"kv" * 8) == 0
        assert client.presence(KEYS) == ([True, False, False], None), "absent keys are no failure"
        wedge = Wedge(raw_store(client)).install(monkeypatch)

        # The call wedges: its caller gets misses at the deadline, counted, a timeout.
        assert client.presence(KEYS) == ([False, False, False], "timeout")
        assert wedge.in_flight == 1 and client.wedged_exists == 1
        assert client.answering_from_spare

        # A spare answers, byte-true to the pool, while the wedged call holds.
        assert put_bytes(client, KEYS[1], b"kv" * 8) == 0
        assert client.presence(KEYS) == ([True, True, False], None)
        assert wedge.in_flight == 1

        # The wedged call returns: the client answers again.
        wedge.release()
        for _ in range(200):
            if not wedge.in_flight and not client.answering_from_spare:
                break
            time.sleep(0.05)
        assert not client.answering_from_spare
        assert client.exists(KEYS) == [True, True, False]
        assert wedge.entered == 2 and client.wedged_exists == 1
    finally:
        if wedge is not None:
            wedge.release()
        client.close()
    lanes = [t for t in existence_lanes() if t not in lanes_before]  # clients of other tests keep theirs
    for thread in lanes:
        thread.join(10)
    assert not [t for t in lanes if t.is_alive()], "every existence lane ends with its client"
