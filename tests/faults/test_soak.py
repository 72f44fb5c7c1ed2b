"""Soak: minutes of mixed shared-prefix requests on a real engine over a real pool.

Runs only with ``KVPOOL_SOAK=1`` (``KVPOOL_SOAK_SECONDS``, default 180, sets its length;
``KVPOOL_SOAK_REPORT=path.json`` keeps every sample). Requests mix the suite's prompts
(60 %, outputs checked against their references), fresh suffixes on the same prefixes
(25 %) and fresh prefixes (15 %, no hit possible, ~30 new blocks each, so the 16 MB store
fills and evicts within the first minute). Every few seconds the RSS,
thread count and open file descriptors of every process are sampled: the engine (this
process), the master and the store. After a warm-up they must stay flat, and the hit
rate of the requests that can hit must stay the same from one third of the run to the next.
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path
from typing import Any

import pytest

from kvpool.connector.contract.settings import ConnectorSettings
from testing.engine import transfer_config
from tests.faults.helpers import (
    PREFIXES,
    UNIVERSE,
    Engine,
    ProcSample,
    SinglePool,
    check_outputs,
    failures_by_reason,
    sample,
)

SOAK_SECONDS = float(os.environ.get("KVPOOL_SOAK_SECONDS", "180"))
pytestmark = [
    pytest.mark.faults,
    pytest.mark.soak,
    pytest.mark.engine,
    pytest.mark.mooncake,
    pytest.mark.timeout(int(SOAK_SECONDS) + 300),
]

SAMPLE_EVERY_S = 5.0
WARM_UP = 0.25  # share of the run before the baseline
MAX_RSS_GROWTH = {"engine": 64 << 20, "master": 32 << 20, "store": 32 << 20}
MAX_THREAD_GROWTH = 2
MAX_FD_GROWTH = 8
MAX_HIT_RATE_DRIFT = 0.15


def test_soak(gemma_dir: Path, references: dict, record_property: pytest.RecordProperty) -> None:
    pool = SinglePool(segment_size="16MB").start()  # small: it fills and evicts within minutes
    try:
        settings = ConnectorSettings.parse({"master_server_address": pool.address, "cache_prefix": "soak"})
        engine = Engine(gemma_dir, transfer_config(settings), log_stats=True)
        try:
            run = _soak(engine, pool)
            transfers = engine.transfers()
            failures = failures_by_reason(transfers)
            run["pool_keys_at_end"] = pool.key_count()
        finally:
            engine.close()
    finally:
        pool.stop()
    report = _judge(run, references)
    report["failures"] = dict(failures)
    report["pool_keys_at_end"] = run["pool_keys_at_end"]
    record_property("soak", report)
    print(f"soak: {json.dumps(report)}")
    if path := os.environ.get("KVPOOL_SOAK_REPORT"):
        Path(path).write_text(json.dumps({**report, "samples": run["samples"]}, indent=1))


def _soak(engine: Engine, pool: SinglePool) -> dict[str, Any]:
    assert pool.master is not None and pool.store is not None
    assert pool.master.process is not None and pool.store.process is not None
    pids = {"engine": os.getpid(), "master": pool.master.process.pid, "store": pool.store.process.pid}
    rng = random.Random(7)
    started = time.monotonic()
    next_sample = started
    served: list[dict[str, Any]] = []
    checked = []
    samples: list[dict[str, Any]] = []
    fresh = 1000
    while time.monotonic() - started < SOAK_SECONDS:
        now = time.monotonic()
        if now >= next_sample:
            samples.append({"t": round(now - started, 1), **{n: vars(sample(p)) for n, p in pids.items()}})
            next_sample = now + SAMPLE_EVERY_S
        draw = rng.random()
        fresh += 1
        if draw < 0.6:
            key = rng.choice(UNIVERSE)
        elif draw < 0.85:
            key = (rng.randrange(PREFIXES), fresh)  # a shared prefix, a new suffix
        else:
            key = (fresh, 0)  # a new prefix: no hit, ~30 new blocks
        result = engine.serve(key, deadline_s=60)
        if key in UNIVERSE:
            checked.append(result)
        served.append(
            {
                "t": round(result.started - started, 2),
                "cached": result.cached,
                "seconds": result.seconds,
                "new_prefix": key[0] >= PREFIXES,
            }
        )
    samples.append(
        {"t": round(time.monotonic() - started, 1), **{n: vars(sample(p)) for n, p in pids.items()}}
    )
    return {"served": served, "checked": checked, "samples": samples, "seconds": time.monotonic() - started}


def _judge(run: dict[str, Any], references: dict) -> dict[str, Any]:
    check_outputs(run["checked"], references)
    samples, served = run["samples"], run["served"]
    cut = run["seconds"] * WARM_UP
    base = [s for s in samples if s["t"] >= cut]
    assert len(base) >= 3, "too few samples after the warm-up"
    growth: dict[str, dict[str, int]] = {}
    for name, limit in MAX_RSS_GROWTH.items():
        first, rest = ProcSample(**base[0][name]), [ProcSample(**s[name]) for s in base]
        growth[name] = {
            "rss_mb": round((max(s.rss_bytes for s in rest) - first.rss_bytes) / 2**20, 1),
            "threads": max(s.threads for s in rest) - first.threads,
            "fds": max(s.fds for s in rest) - first.fds,
        }
        assert max(s.rss_bytes for s in rest) - first.rss_bytes <= limit, (name, growth[name])
        assert growth[name]["threads"] <= MAX_THREAD_GROWTH, (name, growth[name])
        assert growth[name]["fds"] <= MAX_FD_GROWTH, (name, growth[name])
    after = [r for r in served if r["t"] >= cut and not r["new_prefix"]]
    thirds = [after[i * len(after) // 3 : (i + 1) * len(after) // 3] for i in range(3)]
    rates = [sum(r["cached"] > 0 for r in part) / max(1, len(part)) for part in thirds]
    overall = sum(r["cached"] > 0 for r in after) / max(1, len(after))
    assert overall > 0.5, f"hit rate {overall:.2f}"
    assert all(abs(rate - overall) <= MAX_HIT_RATE_DRIFT for rate in rates), rates
    return {
        "seconds": round(run["seconds"], 1),
        "requests": len(served),
        "checked_outputs": len(run["checked"]),
        "new_prefix_requests": sum(r["new_prefix"] for r in served),
        "hit_rate_by_third": [round(r, 3) for r in rates],
        "slowest_request_s": round(max(r["seconds"] for r in served), 2),
        "mean_request_s": round(sum(r["seconds"] for r in served) / len(served), 3),
        "growth_after_warm_up": growth,
        "rss_mb_at_end": {n: round(samples[-1][n]["rss_bytes"] / 2**20, 1) for n in MAX_RSS_GROWTH},
    }
