"""The demo's engine runner: a vLLM CPU engine on token-id prompts, in a fresh process.

``kvpool-demo`` runs each engine with :func:`run_engine_subprocess`, which runs
``python -m kvpool.connector.local.engine SPEC.json RESULT.json`` (its own vLLM,
connector and Mooncake client) and reads the result back; in that process
:func:`run_engine` creates the engine (:func:`create_llm`), runs the batches
(:func:`generate`) and shuts it down (:func:`shutdown_llm`).

Generation is greedy (temperature 0, ``ignore_eos``, a fixed ``max_tokens``),
so runs are deterministic and comparable. With the recording connector
(:mod:`kvpool.connector.local.recording`) a run also returns the connector's
lookup and transfer records. vLLM is imported lazily; engines run with
:data:`ENGINE_ENV`. The test harness (``testing.engine``, not shipped) builds
on this module.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

from kvpool.connector.local.pool import LOOPBACK
from kvpool.connector.local.supervised import run_in_own_group

if TYPE_CHECKING:
    from kvpool.connector.local.recording import Recording

#: Environment of a CPU engine in its own process: no hub access, no usage
#: reports, loopback addresses, no engine-core subprocess.
ENGINE_ENV: dict[str, str] = {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_HOST_IP": LOOPBACK,
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
}

Prompt = list[int]

#: The module a fresh engine process runs (``python -m``).
ENGINE_MODULE = "kvpool.connector.local.engine"


def apply_engine_env() -> None:
    """Set :data:`ENGINE_ENV` in ``os.environ``, keeping what is already set; before vLLM loads."""
    for key, value in ENGINE_ENV.items():
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


@dataclass
class EngineRun:
    """Per-batch results, and the recording connector's records as dicts (empty without it).

    ``unreported_saves``: saves the worker made whose record had not come when the run was
    read (given up at the engine's shutdown while a call of theirs was still in the pool):
    what they stored is not in ``transfers``.
    """

    batches: list[list[RequestResult]]
    lookups: list[dict[str, Any]] = field(default_factory=list)
    transfers: list[dict[str, Any]] = field(default_factory=list)
    unreported_saves: int = 0

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
    def from_json(cls, data: dict[str, Any]) -> Self:
        fields = dict(data)
        fields["batches"] = [[RequestResult(**r) for r in batch] for batch in data["batches"]]
        return cls(**fields)


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


def generate(llm: Any, prompts: list[Prompt], max_tokens: int = 16) -> list[RequestResult]:
    """Greedy-generate exactly ``max_tokens`` tokens for each token-id prompt."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
    return [
        RequestResult(
            prompt_len=len(prompt),
            token_ids=list(out.outputs[0].token_ids),
            num_cached_tokens=out.num_cached_tokens,
            finish_reason=out.outputs[0].finish_reason,
        )
        for prompt, out in zip(prompts, outputs, strict=True)
    ]


def connector_recordings(llm: Any) -> tuple[Recording | None, Recording | None]:
    """The recording connector's recordings of an in-process engine: (scheduler, worker); None
    without it. They keep filling after the last request finished, until the engine's shutdown."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    scheduler = None if core is None else core.scheduler.get_kv_connector()
    worker = get_kv_transfer_group() if has_kv_transfer_group() else None
    return getattr(scheduler, "recording", None), getattr(worker, "recording", None)


def recorded(
    scheduler: Recording | None, worker: Recording | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], int]:
    """Lookups (scheduler) and transfers (worker) as dicts, and the saves not reported yet."""
    lookups = list(scheduler.lookups) if scheduler is not None else []
    transfers = list(worker.transfers) if worker is not None else []
    unreported = worker.unreported_saves() if worker is not None else 0
    return [asdict(r) for r in lookups], [asdict(r) for r in transfers], unreported


def connector_records(llm: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The recording connector's lookups (scheduler) and transfers (worker) so far, as dicts:
    saves still in flight are not in them (:func:`run_engine` reads them after its shutdown)."""
    lookups, transfers, _ = recorded(*connector_recordings(llm))
    return lookups, transfers


def shutdown_llm(llm: Any) -> None:
    """Shut an in-process engine down so another can be created in this process."""
    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    ensure_kv_transfer_shutdown()
    cleanup_dist_env_and_memory()
    gc.collect()


def run_engine(opts: EngineOptions, batches: list[list[Prompt]], max_tokens: int = 16) -> EngineRun:
    """Create an engine, run each batch as one ``generate`` call (in order), shut it down.

    Batches run one after another, so KV saved by batch ``i`` can be hit by
    batch ``i + 1``. The connector's records are read after the shutdown, which
    drains the saves still in flight: every save the engine made is in them.
    """
    llm = create_llm(opts)
    try:
        results = [generate(llm, batch, max_tokens) for batch in batches]
        recordings = connector_recordings(llm)
    finally:
        shutdown_llm(llm)
    # Saves publish off the forward path: the last ones may report after the last request
    # finished. The connector's shutdown drained them (``shutdown_timeout_s``); read only now.
    return EngineRun(results, *recorded(*recordings))


def run_module(
    module: str,
    spec: dict[str, Any],
    *,
    env: dict[str, str] | None = None,
    timeout: float = 600.0,
    log_path: str | os.PathLike[str] | None = None,
) -> dict[str, Any]:
    """``python -m MODULE SPEC.json RESULT.json`` in a fresh process; the result it wrote.

    The child's environment is :data:`ENGINE_ENV`, this process's environment
    over it, then ``env``. Its stdout/stderr go to ``log_path`` (a temporary
    file if None), whose tail is in the error raised when the child fails. The child runs
    in a process group of its own (:func:`~kvpool.connector.local.supervised.run_in_own_group`):
    what it forks (vLLM's engine core, its workers) ends with it, past ``timeout`` (then
    :class:`subprocess.TimeoutExpired`), on a stop signal here, or with this process.
    """
    with tempfile.TemporaryDirectory(prefix="kvpool-engine-") as tmp:
        spec_path = Path(tmp) / "spec.json"
        result_path = Path(tmp) / "result.json"
        spec_path.write_text(json.dumps(spec))
        log = Path(log_path) if log_path is not None else Path(tmp) / "engine.log"
        with open(log, "wb") as out:
            returncode = run_in_own_group(
                [sys.executable, "-m", module, str(spec_path), str(result_path)],
                env={**ENGINE_ENV, **os.environ, **(env or {})},
                stdout=out,
                timeout=timeout,
            )
        if returncode != 0 or not result_path.exists():
            tail = log.read_text(errors="replace")[-4000:]
            raise RuntimeError(f"engine subprocess failed (rc={returncode}):\n{tail}")
        return json.loads(result_path.read_text())


def serve_module(argv: list[str] | None, run: Callable[[dict[str, Any]], dict[str, Any]]) -> int:
    """The child side of :func:`run_module`: ``run`` the spec file, write the result file."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m MODULE SPEC.json RESULT.json", file=sys.stderr)
        return 2
    result = run(json.loads(Path(args[0]).read_text()))
    Path(args[1]).write_text(json.dumps(result))
    return 0


def run_engine_subprocess(
    opts: EngineOptions,
    batches: list[list[Prompt]],
    max_tokens: int = 16,
    *,
    env: dict[str, str] | None = None,
    timeout: float = 600.0,
    log_path: str | os.PathLike[str] | None = None,
) -> EngineRun:
    """Like :func:`run_engine`, in a fresh Python process (see :func:`run_module`)."""
    spec = {"opts": asdict(opts), "batches": batches, "max_tokens": max_tokens}
    return EngineRun.from_json(run_module(ENGINE_MODULE, spec, env=env, timeout=timeout, log_path=log_path))


def _run_spec(spec: dict[str, Any]) -> dict[str, Any]:
    return run_engine(EngineOptions(**spec["opts"]), spec["batches"], spec["max_tokens"]).to_json()


def main(argv: list[str] | None = None) -> int:
    """``python -m kvpool.connector.local.engine SPEC.json RESULT.json``."""
    return serve_module(argv, _run_spec)


if __name__ == "__main__":
    sys.exit(main())
