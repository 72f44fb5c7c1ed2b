"""Engine runs for the tests and the benchmarks, and public ways into an engine's connector.

On top of the demo's runner (:mod:`kvpool.connector.local.engine`: engines, greedy
generation, fresh processes): the log-probability of each generated token, requests
carrying W3C trace headers, vLLM's own metrics, a summary of the KV-cache layout, the
recording connector's records, and accessors to an in-process engine's connector
(:func:`scheduler_connector`, :func:`worker_connector`) and to the connector's two sides
(:func:`scheduler_of`, :func:`worker_of`), so tests need no private names to reach them.
:func:`run_engine_subprocess` runs ``python -m testing.engine`` in a fresh process.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Self

from kvpool.connector.local.engine import (
    ENGINE_ENV,
    EngineOptions,
    EngineRun,
    Prompt,
    apply_engine_env,
    connector_recordings,
    connector_records,
    create_llm,
    recorded,
    run_module,
    serve_module,
    shutdown_llm,
)
from kvpool.connector.local.engine import RequestResult as GreedyResult
from testing import engine_forks
from testing.engine_forks import run_module_forked

__all__ = [
    "ENGINE_ENV",
    "EngineOptions",
    "EngineReport",
    "EngineRun",
    "Prompt",
    "RequestResult",
    "apply_engine_env",
    "connector_records",
    "create_llm",
    "engine_core",
    "engine_env",
    "generate",
    "reference_tokens",
    "run_engine",
    "run_engine_subprocess",
    "sampling_params",
    "scheduler_connector",
    "scheduler_of",
    "shutdown_llm",
    "transfer_config",
    "worker_connector",
    "worker_of",
]

REPO_ROOT = Path(__file__).resolve().parents[1]
MODULE = "testing.engine"


@dataclass
class RequestResult(GreedyResult):
    """One finished request, with the log-probability of each generated token if asked for."""

    logprobs: list[float] | None = None


#: Log-probabilities of one token from the same KV agree within this (float32 KV).
LOGPROB_TOLERANCE = 1e-3


def output_difference(got: RequestResult, want: RequestResult) -> str | None:
    """How ``got`` differs from ``want`` (tokens, then log-probabilities), or None."""
    if got.token_ids != want.token_ids:
        return f"tokens {got.token_ids} != {want.token_ids}"
    assert got.logprobs is not None and want.logprobs is not None, "generated with logprobs=True"
    worst = max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs, strict=True))
    return f"log-probabilities differ by up to {worst:.3g}" if worst >= LOGPROB_TOLERANCE else None


def engine_core(llm: Any) -> Any | None:
    """The in-process ``EngineCore`` (scheduler, executor), or None if multiprocess."""
    client = llm.llm_engine.engine_core
    return getattr(client, "engine_core", None)


def scheduler_connector(llm: Any) -> Any | None:
    """The scheduler-side KV connector of an in-process engine, if any."""
    core = engine_core(llm)
    return None if core is None else core.scheduler.get_kv_connector()


def worker_connector(llm: Any = None) -> Any | None:
    """The worker-side KV connector of the in-process engine, if any (vLLM keeps one per process)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    return get_kv_transfer_group() if has_kv_transfer_group() else None


def scheduler_of(target: Any) -> Any:
    """The connector's scheduler side (``SchedulerSide``) of an in-process engine or of a connector."""
    from kvpool.connector.connector import KVPoolConnector

    connector = target if isinstance(target, KVPoolConnector) else scheduler_connector(target)
    assert connector is not None, "the engine has no KV connector"
    return connector._sched()


def worker_of(target: Any = None) -> Any:
    """The connector's worker side (``WorkerSide``) of a connector, else of this process's engine."""
    from kvpool.connector.connector import KVPoolConnector

    connector = target if isinstance(target, KVPoolConnector) else worker_connector()
    assert connector is not None and connector._worker is not None, "no worker-side KV connector"
    return connector._worker


def sampling_params(max_tokens: int, *, logprobs: bool = False) -> Any:
    """Greedy sampling of exactly ``max_tokens`` tokens (with each one's log-probability if asked)."""
    from vllm import SamplingParams

    return SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        ignore_eos=True,
        detokenize=False,
        logprobs=0 if logprobs else None,
    )


def request_results(
    prompts: list[Prompt], outputs: list[Any], *, logprobs: bool = False
) -> list[RequestResult]:
    """``RequestResult`` of each vLLM ``RequestOutput``, in the order of ``prompts``."""
    results = []
    for prompt, out in zip(prompts, outputs, strict=True):
        completion = out.outputs[0]
        chosen = None
        if logprobs and completion.logprobs is not None:
            chosen = [
                float(step[token].logprob)
                for token, step in zip(completion.token_ids, completion.logprobs, strict=True)
            ]
        results.append(
            RequestResult(
                prompt_len=len(prompt),
                token_ids=list(completion.token_ids),
                num_cached_tokens=out.num_cached_tokens,
                finish_reason=completion.finish_reason,
                logprobs=chosen,
            )
        )
    return results


#: Deadlines a shared 2-core machine does not reach, for tests whose asserted hits must not
#: depend on how busy the machine is (a deadline's own behaviour is tested elsewhere). Load
#: and save deadlines are at their upper bound, 30 s.
PATIENT_DEADLINES: dict[str, Any] = {
    "lookup_timeout_s": 30.0,
    "load_timeout_s": 30.0,
    "save_timeout_s": 30.0,
    "shutdown_timeout_s": 50.0,
    "store_timeout_s": 30,
}


def transfer_config(settings: Any, kv_role: str = "kv_both", **extra: Any) -> dict[str, Any]:
    """``--kv-transfer-config`` for the recording connector against ``settings``' pool, plus ``extra``.

    ``load_policy`` is ``always`` unless ``settings`` or ``extra`` name one: a tiny model
    recomputes a hit faster than it loads it, so the load decision (``auto``) would recompute
    every hit once it has its samples, and a test of what the pool serves would see none.
    Tests of the decision name the policy.
    """
    from kvpool.connector.local.recording import recording_transfer_config

    if "load_policy" not in settings.model_fields_set:
        extra.setdefault("load_policy", "always")
    config = recording_transfer_config(settings, kv_role)
    config["kv_connector_extra_config"].update(extra)
    return config


@dataclass
class EngineReport(EngineRun):
    """An :class:`EngineRun` with vLLM's metrics (if logged) and the KV-cache layout."""

    metrics: dict[str, float] | None = None
    kv_cache_config: dict[str, Any] | None = None

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Self:
        fields = dict(data)
        fields["batches"] = [[RequestResult(**r) for r in batch] for batch in data["batches"]]
        return cls(**fields)


#: Labels dropped from metric keys (the same for every series of one engine).
_ENGINE_LABELS = frozenset({"model_name", "engine"})


def generate(
    llm: Any,
    prompts: list[Prompt],
    max_tokens: int = 16,
    *,
    logprobs: bool = False,
    trace_headers: dict[str, str] | None = None,
) -> list[RequestResult]:
    """Greedy generation; with ``trace_headers`` every request carries them, as an API server passes them."""
    params = sampling_params(max_tokens, logprobs=logprobs)
    if not trace_headers:
        outputs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        return request_results(prompts, outputs, logprobs=logprobs)
    engine = llm.llm_engine
    ids = [f"traced-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts, strict=True):
        engine.add_request(
            request_id, {"prompt_token_ids": list(prompt)}, params, trace_headers=trace_headers
        )
    done: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return request_results(prompts, [done[i] for i in ids], logprobs=logprobs)


def kv_cache_config_summary(cfg: Any) -> dict[str, Any]:
    """A JSON-able summary of a vLLM ``KVCacheConfig``."""
    groups = []
    for g in cfg.kv_cache_groups:
        spec = g.kv_cache_spec
        groups.append(
            {
                "spec": type(spec).__name__,
                "block_size": spec.block_size,
                "sliding_window": getattr(spec, "sliding_window", None),
                "attention_chunk_size": getattr(spec, "attention_chunk_size", None),
                "num_kv_heads": getattr(spec, "num_kv_heads", None),
                "head_size": getattr(spec, "head_size", None),
                "dtype": str(getattr(spec, "dtype", None)),
                "page_size_bytes": spec.page_size_bytes,
                "layer_names": list(g.layer_names),
                "enable_kv_transfer": g.enable_kv_transfer,
            }
        )
    tensors = [
        {
            "size": t.size,
            "layers": list(t.layers),
            "layer_stride": t.layer_stride,
            "block_stride": t.block_stride,
            "offset": t.offset,
        }
        for t in cfg.kv_cache_tensors
    ]
    return {
        "num_blocks": cfg.num_blocks,
        "hash_block_size": cfg.hash_block_size,
        "kv_cache_layout": cfg.kv_cache_layout,
        "groups": groups,
        "tensors": tensors,
    }


def collect_metrics(llm: Any) -> dict[str, float]:
    """Counters and gauges from ``llm.get_metrics()`` (needs ``disable_log_stats=False``).

    Keys: ``name`` (summed over all label sets) and, for series with labels other
    than model_name/engine, ``name{label=value,...}`` (e.g.
    ``vllm:prompt_tokens_cached_by_source{source=external_unspecified}``).
    """
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        value = getattr(m, "value", None)
        if not isinstance(value, int | float):
            continue
        out[m.name] = out.get(m.name, 0.0) + float(value)
        extra = {k: v for k, v in sorted(m.labels.items()) if k not in _ENGINE_LABELS}
        if extra:
            key = m.name + "{" + ",".join(f"{k}={v}" for k, v in extra.items()) + "}"
            out[key] = out.get(key, 0.0) + float(value)
    return out


def wait_for_saves_here(_worker: Any) -> None:
    """In a worker process (``collective_rpc``): until this process's connector has published
    its saves or given up on them (at once without a connector)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if has_kv_transfer_group():
        side = getattr(get_kv_transfer_group(), "_worker", None)
        if side is not None:
            side.wait_for_saves()


def run_engine(
    opts: EngineOptions,
    batches: list[list[Prompt]],
    max_tokens: int = 16,
    *,
    logprobs: bool = False,
    trace_headers: dict[str, str] | None = None,
    reset_local_cache: bool = False,
) -> EngineReport:
    """Create an engine, run each batch as one ``generate`` call (in order), shut down, report.

    With a connector, each batch's saves have landed before the next batch starts, so the
    next one's lookups see them (every rank's: a save is asynchronous, a lookup is not
    made to wait for it). ``reset_local_cache``: vLLM's own prefix cache is emptied after
    each batch (the pool is not touched), so every batch's hit comes from the pool.
    """
    llm = create_llm(opts)
    try:
        core = engine_core(llm)
        layout = None if core is None else kv_cache_config_summary(core.scheduler.kv_cache_config)
        results = []
        for index, batch in enumerate(batches):
            results.append(generate(llm, batch, max_tokens, logprobs=logprobs, trace_headers=trace_headers))
            if opts.kv_transfer_config is not None and index + 1 < len(batches):
                llm.collective_rpc(wait_for_saves_here)  # the next batch may hit what this one saved
            if reset_local_cache:
                assert llm.reset_prefix_cache(), "vLLM's prefix cache was reset"
        metrics = None if opts.disable_log_stats else collect_metrics(llm)
        recordings = connector_recordings(llm)
    finally:
        shutdown_llm(llm)
    # Read after the shutdown, which drained the saves still in flight (as the demo's runner).
    lookups, transfers, unreported = recorded(*recordings)
    return EngineReport(
        results,
        lookups,
        transfers,
        unreported_saves=unreported,
        metrics=metrics,
        kv_cache_config=layout,
    )


def run_engine_subprocess(
    opts: EngineOptions,
    batches: list[list[Prompt]],
    max_tokens: int = 16,
    *,
    logprobs: bool = False,
    trace_headers: dict[str, str] | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 600.0,
    log_path: str | os.PathLike[str] | None = None,
    reset_local_cache: bool = False,
) -> EngineReport:
    """Like :func:`run_engine`, in a fresh Python process (forked from a warmed parent once
    :func:`fork_engine_runs` is on); ``env`` is added to its environment."""
    spec = {
        "opts": asdict(opts),
        "batches": batches,
        "max_tokens": max_tokens,
        "logprobs": logprobs,
        "trace_headers": trace_headers,
        "reset_local_cache": reset_local_cache,
    }
    child_env = engine_env(env)
    data = run_module_forked(MODULE, spec, env=child_env, timeout=timeout, log_path=log_path)
    if data is None:
        data = run_module(MODULE, spec, env=child_env, timeout=timeout, log_path=log_path)
    return EngineReport.from_json(data)


def engine_env(env: dict[str, str] | None) -> dict[str, str]:
    """What an engine process adds to the environment: this checkout on its path, then ``env``."""
    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, **(env or {})}


def fork_engine_runs() -> None:
    """From now on, this process's :func:`run_engine_subprocess` runs are forked from one
    parent that has imported vLLM (:mod:`testing.engine_forks`), where their environment allows."""
    engine_forks.enable(engine_env(None))


def stop_forking_engine_runs() -> None:
    """Stop the parent of :func:`fork_engine_runs`; later runs start fresh processes."""
    engine_forks.disable()


#: Reference outputs already computed in this process, by what determines them.
_REFERENCES: dict[str, list[list[int]]] = {}


def reference_tokens(
    model: str | os.PathLike[str], prompts: list[Prompt], max_tokens: int = 16, **llm_kwargs: Any
) -> list[list[int]]:
    """Each prompt's greedy output from an engine without any connector, in a fresh process.

    Computed once per test session for each model build (its stamp: family, config, seed,
    dtype, so two directories built alike share it), prompt list, length and engine option:
    the run is deterministic, so a later caller gets the first run's tokens.
    """
    from kvpool.connector.local.tiny_model import STAMP_FILE

    stamp = json.loads((Path(model) / STAMP_FILE).read_text())["sha256"]
    key = json.dumps([stamp, prompts, max_tokens, llm_kwargs], sort_keys=True)
    if key not in _REFERENCES:
        opts = EngineOptions(model=str(model), llm_kwargs=dict(llm_kwargs))
        _REFERENCES[key] = run_engine_subprocess(opts, [prompts], max_tokens).token_ids
    return [list(tokens) for tokens in _REFERENCES[key]]


def _run_spec(spec: dict[str, Any]) -> dict[str, Any]:
    report = run_engine(
        EngineOptions(**spec["opts"]),
        spec["batches"],
        spec["max_tokens"],
        logprobs=spec["logprobs"],
        trace_headers=spec["trace_headers"],
        reset_local_cache=spec.get("reset_local_cache", False),
    )
    return report.to_json()


def main(argv: list[str] | None = None) -> int:
    """``python -m testing.engine SPEC.json RESULT.json``."""
    return serve_module(argv, _run_spec)


if __name__ == "__main__":
    sys.exit(main())
