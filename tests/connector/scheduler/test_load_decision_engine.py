"""The load decision in a real vLLM CPU engine: a hit over a slow link recomputes, as a miss.

One in-process engine with KVPoolConnector (``load_decision_min_samples: 1``) over a real
Mooncake pool. Its reads of the pool are slowed by an emulated link (``RateCap``: the
engine's own process cannot be put behind a real one here). After a warm-up request, P1 is
a miss and saves the shared prefix. With vLLM's local cache reset, P2's hit loads (the
rates rest on no load yet: the floor), as the default does; reset again, P2's hit, whose
load the measured rates now say takes longer than its prefill, recomputes: no load, no
cached token, the reference output.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpool.connector.contract import metric_names as m
from testing.engine import (
    EngineOptions,
    collect_metrics,
    create_llm,
    generate,
    reference_tokens,
    scheduler_of,
    shutdown_llm,
    transfer_config,
    worker_connector,
    worker_of,
)
from testing.models import build_gemma3
from testing.prompts import BLOCK, MAX_TOKENS, P1, P2, PREFIX_HIT
from testing.slow_link import RateCap

pytestmark = [pytest.mark.engine, pytest.mark.mooncake]

#: The emulated link: the prefix's ~0.4 MiB take ~7 s, where its prefill takes about a second
#: on this 2-core machine under load (its first step, which warms the engine up, aside).
LINK_BYTES_PER_S = 64 << 10
WARM_UP = [5 + (i * 7) % 400 for i in range(100)]


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_gemma3(tmp_path_factory.mktemp("gemma3"))


def test_a_hit_slower_to_load_than_to_recompute_recomputes(gemma_dir, pool_settings, monkeypatch) -> None:
    (reference,) = reference_tokens(gemma_dir, [P2], MAX_TOKENS)
    link = RateCap(LINK_BYTES_PER_S).install(monkeypatch)
    config = transfer_config(pool_settings, load_policy="auto", load_decision_min_samples=1)
    llm = create_llm(EngineOptions(model=str(gemma_dir), kv_transfer_config=config, disable_log_stats=False))
    try:
        side = scheduler_of(llm)
        generate(llm, [WARM_UP], MAX_TOKENS)  # the engine's first prefill: no sample
        generate(llm, [P1], MAX_TOKENS)  # a miss: saves the prefix
        worker_of(worker_connector()).wait_for_saves()

        assert llm.reset_prefix_cache()
        (loaded,) = generate(llm, [P2], MAX_TOKENS)
        assert loaded.num_cached_tokens == PREFIX_HIT, "below the floor the hit loads"
        assert loaded.token_ids == reference
        moved = link.moved
        assert moved > 0
        rates = side.rates.rates(side.transport)
        assert rates.load_samples >= 1 and rates.prefill_samples >= 1
        assert 0 < rates.load_bytes_per_s < LINK_BYTES_PER_S * 1.01

        assert llm.reset_prefix_cache()
        (recomputed,) = generate(llm, [P2], MAX_TOKENS)
        assert link.moved == moved, "nothing loaded"
        assert recomputed.num_cached_tokens == 0
        assert recomputed.token_ids == reference
        loads = [t for t in worker_connector().recording.transfers if t.operation == m.LOAD]
        assert len(loads) == 1, "the first P2's load only"

        metrics = collect_metrics(llm)
        decisions = m.LOAD_DECISIONS.name
        assert metrics[f"{decisions}{{basis=floor,decision=load}}"] == 1
        assert metrics[f"{decisions}{{basis=estimate,decision=recompute}}"] == 1
        # The first P2 saved its own last whole block: the pool held all of P2's blocks.
        assert metrics[m.LOAD_SKIPPED_TOKENS.name] == (len(P2) - 1) // BLOCK * BLOCK
        assert metrics[m.PREFILL_RATE.name] > 0
        assert 0 < metrics[f"{m.LOAD_RATE.name}{{transport=tcp}}"] < LINK_BYTES_PER_S * 1.01
    finally:
        shutdown_llm(llm)
