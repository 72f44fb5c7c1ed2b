"""vLLM's real ``Scheduler``, with KVPoolConnector by module path, another connector, or none;
and public ways to wait for, and measure, its scheduler side's presence service.

The connector's lookups are batched: a request's first ``get_num_new_matched_tokens``
queues its lookup, the step's lookups go to the presence service's thread when the step
ends, and the request's next call takes the answer. (A lookup answered within the step's
``lookup_budget_ms`` is taken in the same call; :func:`make_scheduler` sets that budget to 0
unless the test names it, so a test counts the same steps however loaded the machine is.)
:func:`answer_lookups` and :func:`settle` stand in for the step's end (and the model's
forward, while which the thread answers); :func:`matched_tokens` asks and waits;
:class:`PresenceMeter` counts the existence checks and times the idle steps' pauses for lookups.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from testing.engine import scheduler_of
from testing.kv_cache import GroupDesc, block_sizes, ensure_registry, make_kv_cache_config
from testing.prompts import hashed_request

_ids = itertools.count()


def pool_transfer(extra_config: Mapping[str, Any], kv_role: str = "kv_both") -> dict[str, Any]:
    """``KVTransferConfig`` fields loading KVPoolConnector by module path with ``extra_config``."""
    return {
        "kv_connector": "KVPoolConnector",
        "kv_connector_module_path": "kvpool.connector",
        "kv_role": kv_role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": dict(extra_config),
    }


def local_pool_transfer(pool_settings: Any, kv_role: str = "kv_both", **extra: Any) -> dict[str, Any]:
    """``pool_transfer`` to the master and key namespace of ``pool_settings``, plus ``extra``."""
    return pool_transfer(
        {
            "master_server_address": pool_settings.master_server_address,
            "cache_prefix": pool_settings.cache_prefix,
            **extra,
        },
        kv_role,
    )


def engine_config(
    model_dir: Path,
    transfer: dict[str, Any] | None,
    *,
    max_model_len: int = 4096,
    max_num_seqs: int | None = None,
    max_num_batched_tokens: int | None = None,
) -> Any:
    """vLLM's ``VllmConfig`` for ``model_dir`` (32-token blocks, float32, caching on); a limit left
    None is vLLM's default."""
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    limits = {"max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens}
    args = EngineArgs(
        model=str(model_dir),
        skip_tokenizer_init=True,
        block_size=32,
        max_model_len=max_model_len,
        enable_prefix_caching=True,
        enforce_eager=True,
        dtype="float32",
        kv_transfer_config=None if transfer is None else KVTransferConfig(**transfer),
        **{name: value for name, value in limits.items() if value is not None},
    )
    return args.create_engine_config()


def make_scheduler(
    model_dir: Path,
    groups: list[GroupDesc],
    transfer: dict[str, Any] | None,
    *,
    num_blocks: int = 2048,
    max_model_len: int = 4096,
    max_num_seqs: int | None = None,
    max_num_batched_tokens: int | None = None,
) -> Any:
    """vLLM's ``Scheduler`` over ``groups`` with the connector ``transfer`` names (None: no connector).

    KVPoolConnector gets ``lookup_budget_ms`` 0 unless ``transfer`` sets it: every new request
    defers a step for its lookup, deterministically (a test of the budget sets its own).
    """
    ensure_registry()
    if transfer is not None and transfer.get("kv_connector") == "KVPoolConnector":
        extra = transfer.get("kv_connector_extra_config", {})
        transfer = {**transfer, "kv_connector_extra_config": {"lookup_budget_ms": 0, **extra}}
    vllm_config = engine_config(
        model_dir,
        transfer,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
    )
    kv_cache_config = make_kv_cache_config(groups, num_blocks=num_blocks)
    return scheduler_over(vllm_config, kv_cache_config, *block_sizes(groups))


def scheduler_over(vllm_config: Any, kv_cache_config: Any, block_size: int, hash_block_size: int) -> Any:
    """vLLM's ``Scheduler`` of ``vllm_config`` over ``kv_cache_config``, as the engine core makes it."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    vllm_config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block_size,
        hash_block_size=hash_block_size,
        log_stats=True,
    )


def make_request(scheduler: Any, prompt: list[int], max_tokens: int = 4) -> Any:
    """A greedy ``Request`` hashed as ``scheduler``'s engine would hash it (sha256)."""
    from vllm.sampling_params import SamplingParams

    return hashed_request(
        prompt,
        scheduler.kv_cache_manager.block_pool.hash_block_size,
        request_id=f"req-{next(_ids)}",
        sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )


def answer_lookups(target: Any, timeout_s: float = 30.0) -> bool:
    """Hand the lookups ``target``'s scheduler side queued to its presence service and wait
    until they are answered (not their statistics); False past ``timeout_s``."""
    presence = scheduler_of(target).presence
    presence.flush()
    return bool(presence.wait_idle(timeout_s, lookups_only=True))


def settle(target: Any, timeout_s: float = 30.0) -> bool:
    """As :func:`answer_lookups`, and wait for the statistics' existence checks too: the
    presence service is idle; False past ``timeout_s``."""
    presence = scheduler_of(target).presence
    presence.flush()
    return bool(presence.wait_idle(timeout_s))


def matched_tokens(connector: Any, request: Any, num_computed_tokens: int = 0) -> tuple[int, bool]:
    """``get_num_new_matched_tokens`` of a scheduler-side connector, past its batched lookup:
    the first call queues the lookup (None), the second, once it is answered, takes the hit."""
    got = connector.get_num_new_matched_tokens(request, num_computed_tokens)
    if got[0] is None:
        assert answer_lookups(connector), "the lookup was never answered"
        got = connector.get_num_new_matched_tokens(request, num_computed_tokens)
    assert got[0] is not None
    return got


def schedule_answered(scheduler: Any) -> Any:
    """``scheduler.schedule()``, then wait until the lookups it queued are answered, so the
    next step admits with their hits (as a real engine does a step or so later)."""
    output = scheduler.schedule()
    connector = scheduler.connector
    if connector is not None:
        assert answer_lookups(connector), "the lookups were never answered"
    return output


def admit(scheduler: Any) -> Any:
    """Two steps: the first queues the waiting requests' lookups (vLLM skips those requests)
    and waits for the answers; the second admits them with their hits. The second's output."""
    schedule_answered(scheduler)
    return scheduler.schedule()


class PresenceMeter:
    """Counts the existence checks of ``target``'s scheduler side and times the pauses its idle
    steps take for their lookups, and its waits for answers within a step's lookup budget
    (benchmarks).

    It wraps three public members of that side: its client's ``presence`` (every check the
    presence service makes: lookups' and statistics'; a client the process shares counts
    its other users' checks too) and its presence service's ``wait_idle`` (calls for lookups
    only: an idle step's pause, which :func:`answer_lookups` also takes) and ``wait_answered``
    (a request's wait for its lookup inside ``get_num_new_matched_tokens``).
    """

    def __init__(self, target: Any):
        self.checks = 0
        self.idle_paused_s = 0.0
        self.budget_waited_s = 0.0
        side = scheduler_of(target)
        presence, wait_idle = side.client.presence, side.presence.wait_idle
        wait_answered = side.presence.wait_answered

        def counted(keys: list[str]) -> tuple[list[bool], str | None]:
            self.checks += 1
            return presence(keys)

        def timed(timeout_s: float, *, lookups_only: bool = False) -> bool:
            if not lookups_only:
                return bool(wait_idle(timeout_s))
            started = time.perf_counter()
            try:
                return bool(wait_idle(timeout_s, lookups_only=True))
            finally:
                self.idle_paused_s += time.perf_counter() - started

        def timed_answer(pending: Any, timeout_s: float) -> bool:
            started = time.perf_counter()
            try:
                return bool(wait_answered(pending, timeout_s))
            finally:
                self.budget_waited_s += time.perf_counter() - started

        side.client.presence = counted
        side.presence.wait_idle = timed
        side.presence.wait_answered = timed_answer


def note_save_plans(side: Any) -> list[str]:
    """A list that from now on gets the request id of each save ``side`` (a ``SchedulerSide``) plans."""
    planned: list[str] = []
    plan_save = side._plan_save

    def noting(tracked: Any, req_id: str, *args: Any) -> Any:
        planned.append(req_id)
        return plan_save(tracked, req_id, *args)

    side._plan_save = noting
    return planned
