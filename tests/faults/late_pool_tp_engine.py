"""The TP=2 engine of ``test_master_down_at_start.py``, in a process of its own (vLLM's
TP=2 CPU workers are processes): it serves a prompt while its master is down, says so (a
file the test waits for), then serves a sharer of the prompt's prefix and the prompt again,
its prefix cache emptied before each, until the prompt hits the pool or its deadline passes.

``python -m tests.faults.late_pool_tp_engine SPEC.json RESULT.json``
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from kvpool.connector.local.engine import serve_module

#: Between the sharer's run and the prompt's: the sharer's saves land in the pool meanwhile.
SAVE_WAIT_S = 2.0


def run(spec: dict[str, Any]) -> dict[str, Any]:
    from testing.engine import EngineOptions, create_llm, generate, shutdown_llm

    llm = create_llm(EngineOptions(**spec["opts"]))
    try:
        max_tokens = spec["max_tokens"]
        (alone,) = generate(llm, [spec["prompt"]], max_tokens)
        Path(spec["served_alone"]).write_text("")
        deadline = time.monotonic() + spec["deadline_s"]
        again, cached = alone, []
        while time.monotonic() < deadline and not (cached and cached[-1]):
            llm.reset_prefix_cache()
            generate(llm, [spec["sharer"]], max_tokens)
            time.sleep(SAVE_WAIT_S)
            llm.reset_prefix_cache()
            (again,) = generate(llm, [spec["prompt"]], max_tokens)
            cached.append(again.num_cached_tokens or 0)
        return {
            "alone": {"tokens": alone.token_ids, "cached": alone.num_cached_tokens or 0},
            "tokens": again.token_ids,
            "cached": cached,
        }
    finally:
        shutdown_llm(llm)


if __name__ == "__main__":
    sys.exit(serve_module(None, run))
