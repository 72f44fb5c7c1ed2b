"""Engine runs for the tests and benchmarks: the local runner plus what they check.

On top of :mod:`kvpool.connector.local.engine` (engines, greedy generation,
fresh processes): requests carrying W3C trace headers, vLLM's own metrics, a
summary of the KV-cache layout, and the recording connector's records.
:func:`run_engine_subprocess` runs ``python -m tests.support.engine`` in a
fresh process.
"""

from __future__ import annotations

import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvpool.connector.local.engine import (
    EngineOptions,
    EngineRun,
    Prompt,
    RequestResult,
    connector_records,
    create_llm,
    engine_core,
    request_results,
    run_module,
    sampling_params,
    serve_module,
    shutdown_llm,
)
from kvpool.connector.local.engine import generate as generate_greedy

REPO_ROOT = Path(__file__).resolve().parents[2]
MODULE = "tests.support.engine"

#: Labels dropped from metric keys (the same for every series of one engine).
_ENGINE_LABELS = frozenset({"model_name", "engine"})


def transfer_config(settings: Any, kv_role: str = "kv_both", **extra: Any) -> dict[str, Any]:
    """``--kv-transfer-config`` for the recording connector against ``settings``' pool, plus ``extra``."""
    from kvpool.connector.local.recording import recording_transfer_config

    config = recording_transfer_config(settings, kv_role)
    config["kv_connector_extra_config"].update(extra)
    return config


@dataclass
class EngineReport(EngineRun):
    """An :class:`EngineRun` with vLLM's metrics (if logged) and the KV-cache layout."""

    metrics: dict[str, float] | None = None
    kv_cache_config: dict[str, Any] | None = None


def generate(
    llm: Any,
    prompts: list[Prompt],
    max_tokens: int = 16,
    *,
    logprobs: bool = False,
    trace_headers: dict[str, str] | None = None,
) -> list[RequestResult]:
    """Greedy generation; with ``trace_headers`` every request carries them, as an API server passes them."""
    if not trace_headers:
        return generate_greedy(llm, prompts, max_tokens, logprobs=logprobs)
    engine = llm.llm_engine
    params = sampling_params(max_tokens, logprobs=logprobs)
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


def run_engine(
    opts: EngineOptions,
    batches: list[list[Prompt]],
    max_tokens: int = 16,
    *,
    logprobs: bool = False,
    trace_headers: dict[str, str] | None = None,
    reset_local_cache: bool = False,
) -> EngineReport:
    """Create an engine, run each batch as one ``generate`` call (in order), report, shut down.

    ``reset_local_cache``: vLLM's own prefix cache is emptied after each batch (the pool is
    not touched), so every batch's hit comes from the pool.
    """
    llm = create_llm(opts)
    try:
        core = engine_core(llm)
        layout = None if core is None else kv_cache_config_summary(core.scheduler.kv_cache_config)
        results = []
        for batch in batches:
            results.append(generate(llm, batch, max_tokens, logprobs=logprobs, trace_headers=trace_headers))
            if reset_local_cache:
                assert llm.reset_prefix_cache(), "vLLM's prefix cache was reset"
        metrics = None if opts.disable_log_stats else collect_metrics(llm)
        lookups, transfers = connector_records(llm)
        return EngineReport(results, lookups, transfers, metrics, layout)
    finally:
        shutdown_llm(llm)


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
    """Like :func:`run_engine`, in a fresh Python process; ``env`` is added to its environment."""
    spec = {
        "opts": asdict(opts),
        "batches": batches,
        "max_tokens": max_tokens,
        "logprobs": logprobs,
        "trace_headers": trace_headers,
        "reset_local_cache": reset_local_cache,
    }
    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    child_env = {"PYTHONPATH": path, **(env or {})}
    data = run_module(MODULE, spec, env=child_env, timeout=timeout, log_path=log_path)
    return EngineReport.from_json(data)


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
    """``python -m tests.support.engine SPEC.json RESULT.json``."""
    return serve_module(argv, _run_spec)


if __name__ == "__main__":
    sys.exit(main())
