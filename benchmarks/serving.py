"""Serving: two vLLM OpenAI API servers on one pool vs local prefix caching only vs no caching.

A fleet of two ``vllm.entrypoints.openai.api_server`` processes (CPU, each
bound to its own core) serves a multi-turn, shared-prefix chat workload of the
kind LMCache's and vLLM production-stack's multi-round QA benchmarks use:

* a few long system prompts, each shared by several users;
* every user opens with a long message of their own (a pasted document), then
  asks short questions; each turn's prompt carries the whole conversation so
  far: system prompt, every earlier message and the server's own answers;
* users come and go as in those benchmarks' sessions: a new user starts every
  ``turns`` slots and ``active`` conversations run at once. Slot ``k`` is at
  ``k / rate`` seconds; user ``u``'s turn ``t`` takes slot ``u * turns + t * active``
  (one request per slot, except while the first users arrive and the last
  leave) or, if its previous answer is still streaming, the moment it ends. The client sends slot ``k`` to
  server ``k mod 2`` (round-robin); ``active`` is odd, so every conversation
  alternates between the servers and a replica always meets history that only
  the other one has computed.
* users arrive in cohorts of ``users``: the first cohort meets a fleet that has
  computed none of the system prompts (a fleet just started or scaled out), each
  later cohort starts once the one before has finished, on the same system
  prompts (a fleet in service: each system prompt computed somewhere before).
  Every cohort is reported, and judged, on its own: with a few dozen requests
  the first arrivals of the system prompts, which no cache can serve, would
  otherwise be every fleet's p99.

The same workload (seeded; everything printed) runs against three fleets in
one run: (1) no prefix caching, (2) vLLM's local prefix caching only, (3) local
caching plus KVPoolConnector on a local Mooncake master and store. A few
warm-up requests per server (prompts unrelated to the workload) run first and
are not measured.

Measured as users measure serving: TTFT (streaming: time to the first token
chunk), inter-token latency, request throughput; plus, from the servers' own
``/metrics``, prompt tokens computed vs served from the local cache vs from the
pool, and the pool's per-group hit rate (the ``vllm:kvpool_*`` series the
dashboards use). Decoding is greedy (temperature 0, ``ignore_eos``, fixed
``max_tokens``); every response of (2) and (3) is compared with (1)'s for the
same request, and any difference makes the benchmark exit non-zero.

``--smoke``: the tiny model, six requests, nothing written; server start-up
is most of its time, so it starts two pairs of servers, both at once (small KV
caches, each model's worker in its engine core's process), and runs the no-cache
fleet on the local-caching pair with a ``cache_salt`` per request (no request
shares a cached block).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

from benchmarks import common, pool
from benchmarks.common import MODELS_DIR, Options, Report, Stat, Table, Target

SERVED_NAME = "kvpool-serving"
REQUEST_TIMEOUT = 600.0  # seconds; bounds every request
STARTUP_TIMEOUT = 600.0
BLOCK_SIZE = 32
SMOKE_KV_CACHE_BYTES = 128 << 20  # smoke servers start two fleets at once: small caches
PR_SET_PDEATHSIG = 1  # prctl(2)

#: The serving model: a random-weight Gemma3 (sliding-window + full attention, three
#: KV-cache groups) of about 0.08 B parameters. The TTFT benchmark's 0.35 B model
#: prefills ~120 tokens/s on one busy core of this machine (float32; its AVX2 CPU has
#: no bf16 units): too slow for three fleets of two servers in 20 minutes.
SERVING_MODEL: dict[str, Any] = {
    "vocab_size": 32768,
    "hidden_size": 512,
    "intermediate_size": 2048,
    "num_hidden_layers": 12,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "sliding_window": 512,
}


@dataclass(frozen=True)
class Workload:
    """The multi-turn shared-prefix workload; every field is printed with the results."""

    system_prompts: int
    system_len: int
    users: int
    turns: int
    active: int
    first_len: int
    question_len: int
    answer_len: int
    rate: float
    warmup: int
    seed: int
    vocab: int
    cohorts: int = 2  # the first meets a cold fleet; each later one starts when the one before ends

    def __post_init__(self) -> None:
        if self.active % 2 == 0 or math.gcd(self.active, self.turns) != 1:
            raise ValueError("active must be odd and coprime with turns (one request per slot)")

    @property
    def requests(self) -> int:
        """Requests of one cohort."""
        return self.users * self.turns

    def slot(self, user: int, turn: int) -> int:
        """The arrival slot of ``user``'s turn ``turn``."""
        return user * self.turns + turn * self.active

    def describe(self) -> str:
        return (
            f"{self.system_prompts} system prompts x {self.system_len} tokens; {self.users} users "
            f"(user u uses system prompt u mod {self.system_prompts}), {self.turns} turns each, "
            f"conversations at a time: {self.active}; first message {self.first_len} tokens, then "
            f"questions of {self.question_len}; answers {self.answer_len} tokens; {self.requests} "
            f"requests at {self.rate:g} req/s per cohort, {self.cohorts} cohorts of users one after "
            f"another on the same system prompts; {self.warmup} warm-up requests per server; "
            f"seed {self.seed}"
        )


FULL = Workload(
    system_prompts=3,
    system_len=1024,
    users=7,
    turns=4,
    active=5,
    first_len=512,
    question_len=192,
    answer_len=32,
    rate=0.33,
    warmup=2,
    seed=2024,
    vocab=30000,
)
SMOKE = Workload(
    system_prompts=1,
    system_len=96,
    users=3,
    turns=2,
    active=1,
    first_len=32,
    question_len=16,
    answer_len=4,
    rate=4.0,
    warmup=1,
    seed=7,
    vocab=500,
)


@dataclass(frozen=True)
class Fleet:
    """One configuration of the two servers."""

    name: str
    label: str
    prefix_caching: bool
    pool: bool


FLEETS = (
    Fleet("none", "no prefix caching", prefix_caching=False, pool=False),
    Fleet("local", "local prefix caching", prefix_caching=True, pool=False),
    Fleet("pool", "local caching + pool", prefix_caching=True, pool=True),
)


# --- the workload's token ids ---------------------------------------------------------
class Conversations:
    """Seeded token ids of every system prompt and user message; prompts from answers so far."""

    def __init__(self, wl: Workload):
        rng = random.Random(wl.seed)

        def ids(n: int) -> list[int]:
            return [rng.randrange(3, wl.vocab) for _ in range(n)]

        self.wl = wl
        self.systems = [ids(wl.system_len) for _ in range(wl.system_prompts)]
        self.messages = [
            [ids(wl.first_len if t == 0 else wl.question_len) for t in range(wl.turns)]
            for _ in range(wl.cohorts * wl.users)
        ]
        self.warmups = [ids(wl.system_len) for _ in range(2 * wl.warmup)]

    def prompt(self, user: int, turn: int, answers: dict[tuple[int, int], list[int]]) -> list[int]:
        """System prompt, then every earlier message and answer of ``user``, then this turn's message."""
        out = list(self.systems[user % self.wl.system_prompts])
        for t in range(turn):
            out += self.messages[user][t] + answers.get((user, t), [])
        return out + self.messages[user][turn]


# --- the servers -------------------------------------------------------------------------
def _model(smoke: bool) -> Path:
    from testing.models import build_gemma3

    if smoke:
        return build_gemma3(MODELS_DIR / "bench-gemma3-tiny")
    return build_gemma3(MODELS_DIR / "bench-gemma3-serving", **SERVING_MODEL)


def _cores() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def _own_session() -> None:
    """In the child: a session of its own (its engine and worker join its group), ended with us."""
    os.setsid()
    if sys.platform == "linux":  # SIGTERM when the benchmark dies, even by SIGKILL: no orphans
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class ApiServer:
    """``python -m vllm.entrypoints.openai.api_server`` on loopback, as a user runs it on CPU."""

    model: Path
    core: int
    prefix_caching: bool
    kv_transfer_config: dict[str, Any] | None = None
    kv_cache_bytes: int | None = None  # None: VLLM_CPU_KVCACHE_SPACE=1 (1 GiB)
    port: int = 0
    #: The model's worker in a process of its own beside the engine core, as users run the
    #: server; False runs it in the engine core's process (one vLLM import fewer to start).
    own_worker_process: bool = True
    log_path: Path = field(
        default_factory=lambda: Path(tempfile.mkstemp(prefix="kvpool-serving-", suffix=".log")[1])
    )
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        args = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model),
            "--served-model-name", SERVED_NAME,
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--skip-tokenizer-init",
            "--enforce-eager",
            "--dtype", "float32",
            "--block-size", str(BLOCK_SIZE),
            "--max-model-len", "4096",
            "--max-num-batched-tokens", "2048",
            "--max-num-seqs", "16",
            "--seed", "0",
            "--disable-uvicorn-access-log",
            "--enable-prefix-caching" if self.prefix_caching else "--no-enable-prefix-caching",
        ]  # fmt: skip
        if self.kv_transfer_config is not None:
            args += ["--kv-transfer-config", json.dumps(self.kv_transfer_config)]
        if self.kv_cache_bytes is not None:
            args += ["--kv-cache-memory-bytes", str(self.kv_cache_bytes)]
        return args

    def env(self) -> dict[str, str]:
        from kvpool.connector.contract.mooncake_env import client_env
        from kvpool.connector.local.pool import LOOPBACK

        env = {
            **os.environ,
            **client_env(LOOPBACK),
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": str(self.core),
            "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if self.own_worker_process else "0",
            "VLLM_LOGGING_LEVEL": "INFO",  # to its log file: the KV cache size line
            "VLLM_HOST_IP": LOOPBACK,
        }
        if self.kv_cache_bytes is not None:  # the variable would override the flag
            del env["VLLM_CPU_KVCACHE_SPACE"]
        return env

    def start(self) -> ApiServer:
        from kvpool.connector.local.ports import held_port

        self.port = self.port or held_port()  # vLLM listens after its model loads: held until stop
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            self.command(), stdout=log, stderr=subprocess.STDOUT, env=self.env(), preexec_fn=_own_session
        )
        log.close()
        return self

    def wait_ready(self, deadline: float) -> None:
        assert self.process is not None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"server on {self.url} not ready:\n{self.log_tail()}")

    def stop(self) -> None:
        """SIGTERM to the server; SIGKILL to its process group (its engine and worker) if it lingers."""
        process = self.process
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(30)
        # The group is this server's own session: its engine core and worker; and, once it is
        # gone, the names they held in /dev/shm (vLLM's message queues).
        from testing import child_processes

        held = child_processes.kill_group(process.pid)
        process.wait(10)
        child_processes.wait_group_gone(process.pid)
        child_processes.remove_shared_memory(held)
        from kvpool.connector.local.ports import release_port

        release_port(self.port)

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def kv_cache_tokens(self) -> int | None:
        match = re.search(r"KV cache size: ([\d,]+) tokens", self.log_path.read_text(errors="replace"))
        return int(match.group(1).replace(",", "")) if match else None

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as response:
            return parse_metrics(response.read().decode())


def parse_metrics(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Samples of a Prometheus text exposition, ``vllm_`` names written back as ``vllm:``."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = "vllm:" + sample.name[5:] if sample.name.startswith("vllm_") else sample.name
            labels = tuple(
                sorted((k, v) for k, v in sample.labels.items() if k not in ("model_name", "engine"))
            )
            out[(name, labels)] = out.get((name, labels), 0.0) + sample.value
    return out


# --- the client ----------------------------------------------------------------------------
@dataclass
class Sent:
    """One request as the client saw it (times in seconds since the phase started)."""

    user: int
    turn: int
    server: int
    prompt_len: int
    scheduled: float
    sent: float = 0.0
    first: float | None = None
    done: float | None = None
    token_ids: list[int] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)
    cohort: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.sent


async def _stream(
    session: Any, url: str, prompt: list[int], max_tokens: int, rec: Sent, t0: float, salt: str | None = None
) -> None:
    """POST a streaming completion; note the first token chunk, every later gap and the tokens."""
    body: dict[str, Any] = {
        "model": SERVED_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    if salt is not None:  # a prefix no other request shares: nothing cached applies
        body["cache_salt"] = salt
    rec.sent = time.perf_counter() - t0
    last: float | None = None
    try:
        async with session.post(f"{url}/v1/completions", json=body) as response:
            if response.status != 200:
                rec.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                ids = json.loads(line[6:])["choices"][0].get("token_ids") or []
                if not ids:
                    continue
                now = time.perf_counter() - t0
                if rec.first is None:
                    rec.first = now
                elif last is not None:
                    rec.gaps += [(now - last) / len(ids)] * len(ids)
                last = now
                rec.token_ids += ids
    except (TimeoutError, OSError, ValueError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"[:300]
    rec.done = time.perf_counter() - t0
    if rec.error is None and len(rec.token_ids) != max_tokens:
        rec.error = f"{len(rec.token_ids)} tokens, expected {max_tokens}"


def _session() -> Any:
    import aiohttp

    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT), read_bufsize=1 << 20)


async def _warmup(urls: Sequence[str], convs: Conversations) -> None:
    """``warmup`` unrelated requests per server, one at a time per server (not measured)."""
    wl = convs.wl
    t0 = time.perf_counter()
    async with _session() as session:

        async def per_server(i: int, url: str) -> None:
            for j in range(wl.warmup):
                rec = Sent(-1, j, i, 0, 0.0)
                await _stream(session, url, convs.warmups[i * wl.warmup + j], wl.answer_len, rec, t0)
                if rec.error:
                    raise RuntimeError(f"warm-up request to {url} failed: {rec.error}")

        await asyncio.gather(*(per_server(i, url) for i, url in enumerate(urls)))


async def _drive(urls: Sequence[str], convs: Conversations, cohort: int, salted: bool = False) -> list[Sent]:
    """One cohort of the measured workload: each (user, turn) at its slot (after the user's last
    answer), slot mod n; slots count from the cohort's start."""
    wl = convs.wl
    users = range(cohort * wl.users, (cohort + 1) * wl.users)
    answers: dict[tuple[int, int], list[int]] = {}
    answered = {(u, t): asyncio.Event() for u in users for t in range(wl.turns)}
    records: list[Sent] = []
    t0 = time.perf_counter()
    async with _session() as session:

        async def one(user: int, turn: int) -> None:
            k = wl.slot(user - users.start, turn)
            await asyncio.sleep(max(0.0, t0 + k / wl.rate - time.perf_counter()))
            if turn:
                await answered[(user, turn - 1)].wait()
            prompt = convs.prompt(user, turn, answers)
            rec = Sent(user, turn, k % len(urls), len(prompt), k / wl.rate, cohort=cohort)
            records.append(rec)
            try:
                salt = f"u{user}t{turn}" if salted else None
                await _stream(session, urls[k % len(urls)], prompt, wl.answer_len, rec, t0, salt)
            finally:
                answers[(user, turn)] = rec.token_ids
                answered[(user, turn)].set()

        await asyncio.gather(*(one(u, t) for u in users for t in range(wl.turns)))
    return sorted(records, key=lambda r: (r.turn, r.user))


# --- one fleet -------------------------------------------------------------------------------
@dataclass
class FleetRun:
    """What one configuration produced."""

    fleet: str
    records: list[Sent]
    metrics: dict[str, Any]
    prompt_tokens_by_cohort: list[dict[str, float]]  # by source, each cohort's own
    queue_by_cohort: list[dict[str, float]]  # arrival to first schedule (queue_time), each cohort's own
    kv_cache_tokens: list[int | None]
    started_seconds: float
    loadavg: tuple[float, float]


def _metric_delta(
    before: list[dict[Any, float]], after: list[dict[Any, float]]
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Counter increments over the measured phase, summed over the servers."""
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for b, a in zip(before, after, strict=True):
        for key, value in a.items():
            out[key] = out.get(key, 0.0) + value - b.get(key, 0.0)
    return out


def _summarise_metrics(delta: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> dict[str, Any]:
    from kvpool.connector.contract import metric_names as mn

    def total(name: str, **labels: str) -> float:
        return sum(
            v for (n, lab), v in delta.items() if n == name and all((k, x) in lab for k, x in labels.items())
        )

    by_source = {
        s: total("vllm:prompt_tokens_by_source_total", source=s)
        for s in ("local_compute", "local_cache_hit", "external_kv_transfer")
    }
    groups: dict[str, dict[str, Any]] = {}
    for (name, labels), value in delta.items():
        if name == mn.GROUP_HIT_TOKENS.exported:
            lab = dict(labels)
            groups[lab["group"]] = {"kind": lab["group_kind"], "hit_tokens": value}
    transfers = {
        op: {
            "requests": total(f"{mn.TRANSFER_SIZE_BYTES.name}_count", operation=op),
            "bytes": total(f"{mn.TRANSFER_SIZE_BYTES.name}_sum", operation=op),
            "group_seconds": total(f"{mn.OPERATION_SECONDS.name}_sum", operation=op),
        }
        for op in (mn.LOAD, mn.SAVE)
    }
    return {
        "prompt_tokens": total("vllm:prompt_tokens_total"),
        "by_source": by_source,
        "lookups": total(mn.LOOKUPS.exported),
        "lookup_deferred_steps": total(mn.LOOKUP_DEFERRED_STEPS.exported),
        "lookup_query_tokens": total(mn.LOOKUP_QUERY_TOKENS.exported),
        "lookup_hit_tokens": total(mn.LOOKUP_HIT_TOKENS.exported),
        "groups": dict(sorted(groups.items(), key=lambda kv: int(kv[0]))),
        "transfers": transfers,
        "lookup_seconds": total(f"{mn.OPERATION_SECONDS.name}_sum", operation=mn.LOOKUP),
        "failures": total(mn.FAILURES.exported),
        "load_error_blocks": total(mn.LOAD_ERROR_BLOCKS.exported),
        "preemptions": total("vllm:num_preemptions_total"),
        "queue": queue_time(delta),
    }


QUEUE_TIME = "vllm:request_queue_time_seconds"


def queue_time(delta: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> dict[str, float]:
    """Arrival to first schedule over the phase (vLLM's per-request queue-time histogram, every
    server): requests, mean seconds, and the bucket bounds p50 and p99 fall under (inf: none)."""
    buckets: dict[float, float] = {}
    count = seconds = 0.0
    for (name, labels), value in delta.items():
        if name == f"{QUEUE_TIME}_bucket":
            bound = float(dict(labels)["le"])
            buckets[bound] = buckets.get(bound, 0.0) + value
        elif name == f"{QUEUE_TIME}_count":
            count += value
        elif name == f"{QUEUE_TIME}_sum":
            seconds += value

    def under(q: float) -> float:
        for bound, cumulative in sorted(buckets.items()):
            if count and cumulative >= q * count:
                return bound
        return float("inf")

    return {
        "requests": count,
        "mean_s": seconds / count if count else 0.0,
        "p50_le_s": under(0.5),
        "p99_le_s": under(0.99),
    }


def _server_key(fleet: Fleet, smoke: bool) -> tuple[bool, bool]:
    """(prefix caching, pool) of the servers ``fleet`` runs on.

    The smoke runs its no-cache fleet on the local-caching servers with a
    ``cache_salt`` per request (no request shares a cached block), so that it
    starts two pairs of servers instead of three.
    """
    return (fleet.prefix_caching or smoke, fleet.pool)


def _start_pair(
    key: tuple[bool, bool], model: Path, transfer: dict[str, Any], smoke: bool
) -> list[ApiServer]:
    """Two servers (prefix caching, pool) = ``key``, each bound to its own core; started, not yet ready."""
    cores = _cores()
    servers = [
        ApiServer(
            model,
            cores[i % len(cores)],
            key[0],
            transfer if key[1] else None,
            kv_cache_bytes=SMOKE_KV_CACHE_BYTES if smoke else None,
            own_worker_process=not smoke,
        )
        for i in range(2)
    ]
    for server in servers:
        server.start()
    return servers


def _measure_fleet(
    fleet: Fleet, servers: list[ApiServer], started: float, convs: Conversations, salted: bool
) -> FleetRun:
    """Wait for the servers, warm them up, run the workload and read their /metrics."""
    deadline = time.monotonic() + STARTUP_TIMEOUT
    for server in servers:
        server.wait_ready(deadline)
    startup = time.perf_counter() - started
    print(
        f"[{fleet.name}] servers ready {startup:.0f} s after start; warming up", file=sys.stderr, flush=True
    )
    urls = [s.url for s in servers]
    asyncio.run(_warmup(urls, convs))
    time.sleep(1.0)  # the last step's stats reach /metrics
    before = [s.metrics() for s in servers]
    load_before = os.getloadavg()[0]
    records: list[Sent] = []
    snapshots = [before]
    for cohort in range(convs.wl.cohorts):
        records += asyncio.run(_drive(urls, convs, cohort, salted))
        time.sleep(2.0)  # the last step's stats reach /metrics
        snapshots.append([s.metrics() for s in servers])
    load_after = os.getloadavg()[0]
    after = snapshots[-1]
    for server in servers:
        if server.process is not None and server.process.poll() is not None:
            raise RuntimeError(f"a server died during the run:\n{server.log_tail()}")
    return FleetRun(
        fleet.name,
        records,
        _summarise_metrics(_metric_delta(before, after)),
        [_summarise_metrics(_metric_delta(a, b))["by_source"] for a, b in pairwise(snapshots)],
        [queue_time(_metric_delta(a, b)) for a, b in pairwise(snapshots)],
        [s.kv_cache_tokens() for s in servers],
        startup,
        (load_before, load_after),
    )


def _run_fleets(
    model: Path, convs: Conversations, transfer: dict[str, Any], smoke: bool
) -> dict[str, FleetRun]:
    """Every fleet in turn; a fleet's servers start once the one before has stopped (smoke: all at once)."""
    keys = [_server_key(f, smoke) for f in FLEETS]
    last_use = {k: i for i, k in enumerate(keys)}
    pairs: dict[tuple[bool, bool], tuple[list[ApiServer], float]] = {}
    runs: dict[str, FleetRun] = {}
    try:
        for i, fleet in enumerate(FLEETS):
            for k in dict.fromkeys(keys[i:] if smoke else keys[i : i + 1]):
                if k not in pairs and last_use[k] >= i:
                    pairs[k] = (_start_pair(k, model, transfer, smoke), time.perf_counter())
            servers, started = pairs[keys[i]]
            salted = smoke and not fleet.prefix_caching
            runs[fleet.name] = _measure_fleet(fleet, servers, started, convs, salted)
            s = summarise(runs[fleet.name])
            print(
                f"[{fleet.name}] TTFT p50 {s.ttft_p50:.3f} s p99 {s.ttft_p99:.3f} s, "
                f"{s.throughput:.3f} req/s, {s.errors} errors",
                file=sys.stderr,
                flush=True,
            )
            if last_use[keys[i]] == i:
                for server in pairs.pop(keys[i])[0]:
                    server.stop()
                    server.log_path.unlink(missing_ok=True)  # a fleet that ran needs no log
    finally:
        for servers, _ in pairs.values():
            for server in servers:
                server.stop()
                print(f"server log kept: {server.log_path}", file=sys.stderr, flush=True)
    return runs


# --- statistics and the report --------------------------------------------------------------
def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100), linear between closest ranks."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass
class Summary:
    """One fleet's headline numbers."""

    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    itl_p50: float
    throughput: float
    ok: int
    errors: int


def summarise(run: FleetRun, cohort: int | None = None) -> Summary:
    """Headline numbers of ``cohort``'s requests (None: every request; throughput is over the
    time each cohort ran, since every cohort's times count from its own start)."""
    records = [r for r in run.records if cohort is None or r.cohort == cohort]
    ok = [r for r in records if r.error is None and r.ttft is not None]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    gaps = [g for r in ok for g in r.gaps]
    span = sum(
        max((r.done or 0.0) for r in of) - min(r.scheduled for r in of)
        for of in ([r for r in records if r.cohort == c] for c in {r.cohort for r in records})
    )
    return Summary(
        percentile(ttfts, 50),
        percentile(ttfts, 90),
        percentile(ttfts, 99),
        percentile(gaps, 50),
        len(ok) / span if span > 0 else float("nan"),
        len(ok),
        len(records) - len(ok),
    )


def cohort_label(cohort: int) -> str:
    """How the report names ``cohort``."""
    return "first users (cold fleet)" if cohort == 0 else f"later users (cohort {cohort + 1}, warm fleet)"


def compare_outputs(reference: FleetRun, other: FleetRun) -> list[str]:
    """Requests whose prompt or answer differs from the reference fleet's (or failed)."""
    ref = {(r.user, r.turn): r for r in reference.records}
    problems = []
    for rec in other.records:
        base = ref.get((rec.user, rec.turn))
        where = f"{other.fleet}: user {rec.user} turn {rec.turn}"
        if rec.error or base is None or base.error:
            problems.append(f"{where}: failed ({rec.error or (base.error if base else 'missing')})")
        elif rec.prompt_len != base.prompt_len or rec.token_ids != base.token_ids:
            problems.append(
                f"{where}: answer differs from no-cache ({rec.token_ids[:6]} vs {base.token_ids[:6]})"
            )
    return problems


def run(opts: Options) -> Report:
    from kvpool.connector.local.pool import LocalPool

    wl = SMOKE if opts.smoke else FULL
    model = _model(opts.smoke)
    convs = Conversations(wl)
    print(f"workload: {wl.describe()}", file=sys.stderr, flush=True)
    with LocalPool(segment_size="512MB" if opts.smoke else "3GB") as lp:
        transfer = pool.settings(lp.address, f"serving{os.getpid()}").kv_transfer_config()
        runs = _run_fleets(model, convs, transfer, opts.smoke)
    problems = compare_outputs(runs["none"], runs["local"]) + compare_outputs(runs["none"], runs["pool"])
    problems += [f"none: user {r.user} turn {r.turn}: {r.error}" for r in runs["none"].records if r.error]
    report = _report(wl, model, runs, problems, None if opts.smoke else _last_written())
    _plot(report, runs, opts)
    return report


#: Issue #32: the warm fleet's TTFT over local caching's, met in two consecutive runs.
WARM_P50_GOAL, WARM_P99_GOAL = 0.5, 0.7


def _last_written() -> dict[str, Any] | None:
    """The last run written to ``results/serving.json`` (None: none)."""
    path = common.RESULTS_DIR / "serving.json"
    return json.loads(path.read_text()) if path.exists() else None


def _warm_ratios(summaries: dict[str, dict[str, Any]]) -> tuple[float, float]:
    """(p50, p99) TTFT of the pool fleet over local caching's, from one cohort's summaries."""
    pool_s, local = summaries["pool"], summaries["local"]
    return pool_s["ttft_p50"] / local["ttft_p50"], pool_s["ttft_p99"] / local["ttft_p99"]


def _consecutive_target(now: tuple[float, float], previous: dict[str, Any] | None, label: str) -> Target:
    """The warm fleet's targets met in this run and in the last written one."""

    def met(ratios: tuple[float, float]) -> bool:
        return ratios[0] <= WARM_P50_GOAL and ratios[1] <= WARM_P99_GOAL

    goal = (
        f"{label}: TTFT p50 ≤ {WARM_P50_GOAL}x and p99 ≤ {WARM_P99_GOAL}x local prefix caching "
        "in two consecutive runs"
    )
    measured = f"this run {now[0]:.2f}x / {now[1]:.2f}x"
    earlier = None if previous is None else previous["data"].get("summaries_by_cohort", {}).get(label)
    if previous is None or earlier is None:
        return Target(goal, f"{measured}; no earlier written run", False)
    before = _warm_ratios(earlier)
    measured += f"; run of {previous['machine']['time']} {before[0]:.2f}x / {before[1]:.2f}x"
    return Target(goal, measured, met(now) and met(before))


def _report(
    wl: Workload,
    model: Path,
    runs: dict[str, FleetRun],
    problems: list[str],
    previous: dict[str, Any] | None = None,
) -> Report:
    report = Report("serving", "7. Serving: a fleet of two vLLM servers sharing one pool", "")
    sums = {name: summarise(r) for name, r in runs.items()}
    cohorts = range(wl.cohorts)
    by_cohort = {c: {name: summarise(r, c) for name, r in runs.items()} for c in cohorts}

    def vs_local(value: float, base: float) -> str:
        return f"{value / base:.2f}x" if base > 0 else "-"

    table = Table(
        f"{model.name}, 2 OpenAI API servers (1 core each), {wl.cohorts} cohorts of {wl.requests} "
        f"requests at {wl.rate:g} req/s; ratios to local prefix caching in the same cohort; prompt "
        "tokens from the servers' /metrics",
        [
            "users", "fleet", "TTFT p50 s", "p90 s", "p99 s", "ITL p50 ms", "req/s",
            "p50 ratio", "p99 ratio", "req/s ratio",
            "prompt tokens computed", "from local cache", "from pool", "errors", "load avg",
        ],
    )  # fmt: skip
    for cohort, fleet in ((c, f) for c in cohorts for f in FLEETS):
        s, src = by_cohort[cohort][fleet.name], runs[fleet.name].prompt_tokens_by_cohort[cohort]
        local = by_cohort[cohort]["local"]
        table.add(
            cohort_label(cohort),
            fleet.label,
            f"{s.ttft_p50:.3f}",
            f"{s.ttft_p90:.3f}",
            f"{s.ttft_p99:.3f}",
            f"{s.itl_p50 * 1e3:.0f}",
            f"{s.throughput:.3f}",
            vs_local(s.ttft_p50, local.ttft_p50),
            vs_local(s.ttft_p99, local.ttft_p99),
            vs_local(s.throughput, local.throughput),
            f"{src['local_compute']:.0f}",
            f"{src['local_cache_hit']:.0f}",
            f"{src['external_kv_transfer']:.0f}",
            s.errors,
            "{:.1f}..{:.1f}".format(*runs[fleet.name].loadavg),
        )
    report.tables.append(table)

    by_turn = Table(
        "TTFT by turn, s: median (min..max) over users",
        ["users", "turn", "prompt tokens", *(f.label for f in FLEETS)],
    )
    for cohort, turn in ((c, t) for c in cohorts for t in range(wl.turns)):
        cells = []
        lengths = sorted({r.prompt_len for r in _of_turn(runs["none"], cohort, turn)})
        for fleet in FLEETS:
            values = [r.ttft for r in _of_turn(runs[fleet.name], cohort, turn) if r.ttft is not None]
            cells.append(Stat.of(values).fmt(digits=3) if values else "-")
        by_turn.add(
            cohort_label(cohort), turn + 1, f"{lengths[0]}..{lengths[-1]}" if lengths else "-", *cells
        )
    report.tables.append(by_turn)

    queued = Table(
        "arrival to first schedule per request (vllm:request_queue_time_seconds, both servers): "
        "mean, and the histogram bucket bounds p50 and p99 fall under; a pool lookup answered "
        "past the step's lookup_budget_ms defers its request a step",
        ["users", "fleet", "requests", "mean s", "p50 ≤ s", "p99 ≤ s"],
    )
    for cohort, fleet in ((c, f) for c in cohorts for f in FLEETS):
        q = runs[fleet.name].queue_by_cohort[cohort]
        queued.add(
            cohort_label(cohort),
            fleet.label,
            f"{q['requests']:.0f}",
            f"{q['mean_s']:.3f}" if q["requests"] else "-",
            f"{q['p50_le_s']:g}" if q["requests"] else "-",
            f"{q['p99_le_s']:g}" if q["requests"] else "-",
        )
    report.tables.append(queued)

    pm = runs["pool"].metrics
    groups = Table(
        "the pool fleet's /metrics (vllm:kvpool_*, both servers, measured phase): hit rate = hit "
        f"tokens / tokens looked up past the local hit ({pm['lookup_query_tokens']:.0f} in "
        f"{pm['lookups']:.0f} lookups, which deferred their requests "
        f"{pm.get('lookup_deferred_steps', 0.0):.0f} scheduler steps in all)",
        ["group", "kind", "hit tokens", "hit rate"],
    )
    query = pm["lookup_query_tokens"]
    for gid, g in pm["groups"].items():
        groups.add(
            gid, g["kind"], f"{g['hit_tokens']:.0f}", f"{g['hit_tokens'] / query:.1%}" if query else "-"
        )
    groups.add(
        "all", "hybrid hit (reconciled)", f"{pm['lookup_hit_tokens']:.0f}",
        f"{pm['lookup_hit_tokens'] / query:.1%}" if query else "-",
    )  # fmt: skip
    report.tables.append(groups)

    moves = Table(
        "the pool fleet's transfers (vllm:kvpool_transfer_size_bytes, vllm:kvpool_operation_seconds)",
        ["operation", "requests", "MiB per request", "seconds per request, summed over groups", "MB/s"],
    )
    for op, t in pm["transfers"].items():
        n, size, secs = t["requests"], t["bytes"], t["group_seconds"]
        moves.add(
            op,
            f"{n:.0f}",
            f"{size / n / 2**20:.1f}" if n else "-",
            f"{secs / n:.3f}" if n else "-",
            f"{size / secs / 1e6:.0f}" if secs else "-",
        )
    lookups = pm["lookups"]
    moves.add(
        "lookup", f"{lookups:.0f}", "-", f"{pm['lookup_seconds'] / lookups:.4f}" if lookups else "-", "-"
    )
    moves.add(
        "failed keys / blocks recomputed", f"{pm['failures']:.0f} / {pm['load_error_blocks']:.0f}", "", "", ""
    )
    report.tables.append(moves)

    for cohort in cohorts:
        pool_s, local = by_cohort[cohort]["pool"], by_cohort[cohort]["local"]
        p50 = pool_s.ttft_p50 / local.ttft_p50
        p99 = pool_s.ttft_p99 / local.ttft_p99
        report.targets += [
            Target(
                f"{cohort_label(cohort)}: TTFT p50 ≤ 0.5x local prefix caching",
                f"{p50:.2f}x ({pool_s.ttft_p50:.3f} s vs {local.ttft_p50:.3f} s)",
                p50 <= 0.5,
            ),
            Target(
                f"{cohort_label(cohort)}: TTFT p99 ≤ 0.7x local prefix caching",
                f"{p99:.2f}x ({pool_s.ttft_p99:.3f} s vs {local.ttft_p99:.3f} s)",
                p99 <= 0.7,
            ),
        ]
    warm = cohorts[-1]
    if warm > 0:
        summaries = {name: asdict(by_cohort[warm][name]) for name in ("pool", "local")}
        report.targets.append(_consecutive_target(_warm_ratios(summaries), previous, cohort_label(warm)))
    pool_s, local = sums["pool"], sums["local"]
    tput = pool_s.throughput / local.throughput
    checked = sum(len(runs[f].records) for f in ("local", "pool"))
    report.targets += [
        Target(
            "request throughput ≥ local prefix caching",
            f"{tput:.2f}x ({pool_s.throughput:.3f} vs {local.throughput:.3f} req/s)",
            tput >= 1.0,
        ),
        Target(
            "every answer equals the no-cache fleet's",
            f"{len(problems)} mismatches in {checked} requests checked",
            not problems,
        ),
    ]
    caches = runs["local"].kv_cache_tokens
    report.notes += [
        f"Workload: {wl.describe()}.",
        "Each server: `python -m vllm.entrypoints.openai.api_server` (vLLM CPU, float32, "
        f"--block-size {BLOCK_SIZE}, --max-num-batched-tokens 2048, --enforce-eager, "
        "--skip-tokenizer-init, token-id prompts), bound to one core; local KV cache "
        f"{', '.join(str(c) for c in caches)} tokens per server. Streaming completions; TTFT is "
        "the time to the first token chunk, ITL the gap between later chunks per token; "
        "throughput is completed requests over the time from the first slot to the last answer.",
        "Fleets run one after another on the same machine (no prefix caching, local, pool), "
        "one run each; the pool fleet's servers share a local Mooncake master and store. "
        f"Tree: {_tree_state()}.",
    ]
    report.notes += [f"mismatch: {p}" for p in problems[:10]]
    report.data.update(
        {
            "workload": asdict(wl),
            "model": model.name,
            "summaries": {k: asdict(v) for k, v in sums.items()},
            "summaries_by_cohort": {
                cohort_label(c): {k: asdict(v) for k, v in by_cohort[c].items()} for c in cohorts
            },
            "metrics": {k: r.metrics for k, r in runs.items()},
            "kv_cache_tokens": {k: r.kv_cache_tokens for k, r in runs.items()},
            "startup_seconds": {k: round(r.started_seconds, 1) for k, r in runs.items()},
            "loadavg": {k: r.loadavg for k, r in runs.items()},
            "requests": {
                k: [
                    {
                        "cohort": x.cohort,
                        "user": x.user,
                        "turn": x.turn,
                        "server": x.server,
                        "prompt_len": x.prompt_len,
                        "scheduled": round(x.scheduled, 3),
                        "sent": round(x.sent, 3),
                        "ttft": None if x.ttft is None else round(x.ttft, 4),
                        "done": None if x.done is None else round(x.done, 3),
                        "error": x.error,
                    }
                    for x in r.records
                ]
                for k, r in runs.items()
            },
            "mismatches": problems,
        }
    )
    return report


def _of_turn(run: FleetRun, cohort: int, turn: int) -> list[Sent]:
    return [r for r in run.records if r.cohort == cohort and r.turn == turn]


def _tree_state() -> str:
    """The commit measured, and whether the connector had uncommitted changes (a shared tree)."""
    from benchmarks.common import REPO_ROOT

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=False)
        return done.stdout.strip()

    dirty = git("status", "--porcelain", "--", "connector")
    changed = len(dirty.splitlines())
    return f"HEAD {git('rev-parse', '--short', 'HEAD') or '?'}" + (
        f", {changed} uncommitted change(s) under connector/" if changed else ", connector/ as committed"
    )


def _plot(report: Report, runs: dict[str, FleetRun], opts: Options) -> None:
    path = common.plot_path("serving", opts)
    plt = common.pyplot() if path else None
    if plt is None or path is None:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for fleet in FLEETS:
        values = sorted(r.ttft for r in runs[fleet.name].records if r.ttft is not None)
        left.step(
            values, [(i + 1) / len(values) for i in range(len(values))], where="post", label=fleet.label
        )
    left.set_xscale("log")
    left.set_xlabel("TTFT, s (log)")
    left.set_ylabel("fraction of requests")
    left.set_title("TTFT distribution")
    left.legend()
    sums = report.data["summaries"]
    width = 0.27
    for i, fleet in enumerate(FLEETS):
        s = sums[fleet.name]
        xs = [j + (i - 1) * width for j in range(3)]
        right.bar(xs, [s["ttft_p50"], s["ttft_p90"], s["ttft_p99"]], width, label=fleet.label)
    right.set_xticks(range(3), ["p50", "p90", "p99"])
    right.set_ylabel("TTFT, s")
    right.set_title("TTFT percentiles")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    report.plots.append(str(path.relative_to(common.BENCH_DIR)))


def main(argv: list[str] | None = None) -> int:
    """``common.main``, failing (exit 1) when any answer differs from the no-cache fleet's."""
    kept: list[Report] = []

    def run_and_keep(opts: Options) -> Report:
        report = run(opts)
        kept.append(report)
        return report

    rc = common.main("benchmarks.serving", __doc__, run_and_keep, argv)
    problems = kept[0].data.get("mismatches", []) if kept else ["no report"]
    if problems:
        print(f"FAILED: {len(problems)} answers differ from the no-cache fleet's", file=sys.stderr)
        return 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
