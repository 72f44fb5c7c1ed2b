"""A request aborted while its asynchronous pool load is in flight (a client that hangs up).

Hybrid layouts always load asynchronously, so this happens whenever a client disconnects
or times out during a pool hit. The engine must free the request's blocks exactly once
and keep serving. Its own engine: if the connector breaks the scheduler, nothing else
shares the wreck.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from testing.engine import transfer_config
from testing.worker import before_each_load
from tests.faults.helpers import PREFIX_TOKENS, Engine, prompt

pytestmark = [pytest.mark.faults, pytest.mark.engine, pytest.mark.mooncake, pytest.mark.timeout(180)]

SLOW_LOAD_S = 1.0


def test_abort_during_async_load_frees_once_and_serving_goes_on(
    gemma_dir: Path, references: dict, pool_settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = Engine(gemma_dir, transfer_config(pool_settings))
    try:
        engine.serve((0, 0))  # stores the prefix
        before_each_load(monkeypatch, lambda: time.sleep(SLOW_LOAD_S))
        llm_engine = engine.llm.llm_engine
        assert llm_engine.reset_prefix_cache()
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False)
        llm_engine.add_request("doomed", {"prompt_token_ids": prompt(0, 1)}, params)
        llm_engine.step()  # lookup hits the pool; the asynchronous load starts
        llm_engine.abort_request(["doomed"])
        monkeypatch.undo()
        # The next request runs the steps that see the aborted load finish.
        time.sleep(SLOW_LOAD_S)
        after = engine.serve((0, 2), deadline_s=60)
        assert after.tokens == references[(0, 2)]
        assert after.cached == PREFIX_TOKENS
    finally:
        engine.close()
