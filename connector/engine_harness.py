"""Run a real in-process vLLM CPU engine on token-id prompts (tests, benchmarks).

Two ways to run:

* in this process: :func:`create_llm` / :func:`generate` / :func:`shutdown_llm`
  (or :func:`run_engine`, which does all three); engines can be created one
  after another in one process;
* in a fresh Python process: :func:`run_engine_subprocess`, which runs
  ``python -m kvpool.connector.engine_harness SPEC.json RESULT.json`` and reads
  the result back (an "engine B in a new process" for store/load tests).

Generation is greedy (temperature 0, ``ignore_eos``, fixed ``max_tokens``), so
reference runs are deterministic. vLLM is imported lazily; :data:`ENGINE_ENV`
is applied to ``os.environ`` (without overriding) before the first import.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

#: Environment for a fast in-process CPU engine with no hub access.
ENGINE_ENV: dict[str, str] = {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
}

Prompt = list[int]


def apply_engine_env(env: dict[str, str] | None = None) -> None:
    """Set :data:`ENGINE_ENV` (then ``env``) in ``os.environ`` without overriding."""
    for key, value in {**ENGINE_ENV, **(env or {})}.items():
        os.environ.setdefault(key, value)


@dataclass
class EngineOptions:
    """What an engine is built with. JSON-serialisable (crosses processes).

    ``dtype=None`` is vLLM's ``auto``: on CPU a float32 checkpoint runs (and
    caches KV) in bfloat16; pass ``"float32"`` for float32 KV pages.
    """

    model: str
    kv_transfer_config: dict[str, Any] | None = None
    block_size: int = 32
    max_model_len: int = 1024
    max_num_seqs: int = 4
    max_num_batched_tokens: int | None = 1024
    enable_prefix_caching: bool = True
    dtype: str | None = None
    seed: int = 0
    disable_log_stats: bool = True
    llm_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class RequestResult:
    """One finished request."""

    prompt_len: int
    token_ids: list[int]
    num_cached_tokens: int | None
    finish_reason: str | None
    kv_transfer_params: dict[str, Any] | None = None
    logprobs: list[float] | None = None
    """Log-probability of each generated token (only if asked for)."""


@dataclass
class EngineRun:
    """Everything a run returns: per-batch results, metrics and the KV layout."""

    batches: list[list[RequestResult]]
    metrics: dict[str, float] | None = None
    kv_cache_config: dict[str, Any] | None = None
    # KVPoolConnector's own records (lookups on the scheduler, transfers on the worker).
    lookups: list[dict[str, Any]] = field(default_factory=list)
    transfers: list[dict[str, Any]] = field(default_factory=list)

    @property
    def results(self) -> list[RequestResult]:
        """All results, batches flattened, in submission order."""
        return [r for batch in self.batches for r in batch]

    @property
    def token_ids(self) -> list[list[int]]:
        """Output token ids of every request, in submission order."""
        return [r.token_ids for r in self.results]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> EngineRun:
        batches = [[RequestResult(**r) for r in b] for b in data["batches"]]
        return cls(
            batches,
            data.get("metrics"),
            data.get("kv_cache_config"),
            data.get("lookups", []),
            data.get("transfers", []),
        )


def create_llm(opts: EngineOptions) -> Any:
    """Create an in-process ``vllm.LLM`` for ``opts`` (greedy, eager, no tokenizer)."""
    apply_engine_env()
    from vllm import LLM

    kwargs: dict[str, Any] = {
        "model": opts.model,
        "skip_tokenizer_init": True,
        "enforce_eager": True,
        "block_size": opts.block_size,
        "max_model_len": opts.max_model_len,
        "max_num_seqs": opts.max_num_seqs,
        "enable_prefix_caching": opts.enable_prefix_caching,
        "seed": opts.seed,
        "disable_log_stats": opts.disable_log_stats,
    }
    if opts.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = opts.max_num_batched_tokens
    if opts.dtype is not None:
        kwargs["dtype"] = opts.dtype
    if opts.kv_transfer_config is not None:
        kwargs["kv_transfer_config"] = opts.kv_transfer_config
    kwargs.update(opts.llm_kwargs)
    return LLM(**kwargs)


def generate(
    llm: Any,
    prompts: list[Prompt],
    max_tokens: int = 16,
    *,
    logprobs: bool = False,
    trace_headers: dict[str, str] | None = None,
) -> list[RequestResult]:
    """Greedy-generate exactly ``max_tokens`` tokens for each token-id prompt.

    With ``logprobs`` the log-probability of each chosen token is returned too
    (a finer check than token ids that KV loaded from a store is bit-exact).
    With ``trace_headers`` (W3C ``traceparent``) every request carries them,
    as an API server passes a client's headers.
    """
    from vllm import SamplingParams

    params = SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        ignore_eos=True,
        detokenize=False,
        logprobs=0 if logprobs else None,
    )
    if trace_headers:
        outs = _generate_with_headers(llm, prompts, params, trace_headers)
    else:
        outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
    results = []
    for prompt, out in zip(prompts, outs, strict=True):
        comp = out.outputs[0]
        lps = None
        if logprobs and comp.logprobs is not None:
            lps = [float(step[tok].logprob) for tok, step in zip(comp.token_ids, comp.logprobs, strict=True)]
        results.append(
            RequestResult(
                prompt_len=len(prompt),
                token_ids=list(comp.token_ids),
                num_cached_tokens=out.num_cached_tokens,
                finish_reason=comp.finish_reason,
                kv_transfer_params=out.kv_transfer_params,
                logprobs=lps,
            )
        )
    return results


def _generate_with_headers(
    llm: Any, prompts: list[Prompt], params: Any, trace_headers: dict[str, str]
) -> list[Any]:
    """``LLM.generate`` through ``LLMEngine.add_request``, which takes trace headers."""
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
    return [done[i] for i in ids]


def engine_core(llm: Any) -> Any | None:
    """The in-process ``EngineCore`` (scheduler, executor), or None if multiprocess."""
    client = llm.llm_engine.engine_core
    return getattr(client, "engine_core", None)


def scheduler_connector(llm: Any) -> Any | None:
    """The scheduler-side KV connector of an in-process engine, if any."""
    core = engine_core(llm)
    return None if core is None else core.scheduler.get_kv_connector()


def worker_connector() -> Any | None:
    """The worker-side KV connector of the (in-process) engine, if any."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    return get_kv_transfer_group() if has_kv_transfer_group() else None


def connector_records(llm: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """KVPoolConnector's lookup and transfer records of this engine, as dicts."""
    sched, worker = scheduler_connector(llm), worker_connector()
    lookups = [asdict(r) for r in getattr(getattr(sched, "stats", None), "history_lookups", ())]
    transfers = [asdict(r) for r in getattr(getattr(worker, "stats", None), "history_transfers", ())]
    return lookups, transfers


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


#: Labels dropped from metric keys (the same for every series of one engine).
_ENGINE_LABELS = frozenset({"model_name", "engine"})


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


def shutdown_llm(llm: Any) -> None:
    """Shut an in-process engine down so another can be created in this process."""
    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    ensure_kv_transfer_shutdown()
    cleanup_dist_env_and_memory()
    gc.collect()


def run_engine(
    opts: EngineOptions,
    batches: list[list[Prompt]],
    max_tokens: int = 16,
    *,
    logprobs: bool = False,
    trace_headers: dict[str, str] | None = None,
) -> EngineRun:
    """Create an engine, run each batch as one ``generate`` call (in order), shut down.

    Batches run one after another, so KV saved by batch ``i`` can be hit by
    batch ``i + 1``.
    """
    llm = create_llm(opts)
    try:
        core = engine_core(llm)
        cfg = None if core is None else kv_cache_config_summary(core.scheduler.kv_cache_config)
        results = [
            generate(llm, batch, max_tokens, logprobs=logprobs, trace_headers=trace_headers)
            for batch in batches
        ]
        metrics = None if opts.disable_log_stats else collect_metrics(llm)
        lookups, transfers = connector_records(llm)
        return EngineRun(results, metrics, cfg, lookups, transfers)
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
) -> EngineRun:
    """Like :func:`run_engine`, in a fresh Python process (its own vLLM, connector, store).

    ``env`` is added to this process's environment (and :data:`ENGINE_ENV`).
    The child's stdout/stderr go to ``log_path`` (a temp file if None), whose
    tail is put in the error raised when the child fails.
    """
    with tempfile.TemporaryDirectory(prefix="kvpool-engine-") as tmp:
        spec = Path(tmp) / "spec.json"
        result = Path(tmp) / "result.json"
        spec.write_text(
            json.dumps(
                {
                    "opts": asdict(opts),
                    "batches": batches,
                    "max_tokens": max_tokens,
                    "logprobs": logprobs,
                    "trace_headers": trace_headers,
                }
            )
        )
        child_env = {**ENGINE_ENV, **os.environ, **(env or {})}
        log = Path(log_path) if log_path is not None else Path(tmp) / "engine.log"
        with open(log, "wb") as out:
            proc = subprocess.run(
                [sys.executable, "-m", "kvpool.connector.engine_harness", str(spec), str(result)],
                env=child_env,
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=timeout,
                check=False,
            )
        if proc.returncode != 0 or not result.exists():
            tail = log.read_text(errors="replace")[-4000:]
            raise RuntimeError(f"engine subprocess failed (rc={proc.returncode}):\n{tail}")
        return EngineRun.from_json(json.loads(result.read_text()))


def main(argv: list[str] | None = None) -> int:
    """``python -m kvpool.connector.engine_harness SPEC.json RESULT.json``."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(main.__doc__, file=sys.stderr)
        return 2
    spec = json.loads(Path(args[0]).read_text())
    run = run_engine(
        EngineOptions(**spec["opts"]),
        spec["batches"],
        spec["max_tokens"],
        logprobs=spec.get("logprobs", False),
        trace_headers=spec.get("trace_headers"),
    )
    Path(args[1]).write_text(json.dumps(run.to_json()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
