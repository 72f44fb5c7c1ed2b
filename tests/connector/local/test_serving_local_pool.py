"""The README's path, over HTTP: ``kvpool-local-pool``, then vLLM's OpenAI server with its JSON.

What runs (all on 127.0.0.1, all stopped by PID): the ``kvpool-local-pool``
command (a Mooncake master and store); ``python -m vllm.entrypoints.openai.api_server``
on the tiny hybrid Gemma3 with the printed ``--kv-transfer-config``, KV events
on a ZMQ endpoint, and the dev endpoint ``/reset_prefix_cache``; a ZMQ
subscriber. The client then:

1. completes P1; resets vLLM's local prefix cache only;
2. completes P2 (P2 shares a 288-token prefix with P1): those tokens come from
   the pool, and the server's ``/metrics`` (``vllm:kvpool_*`` and vLLM's own
   external-hit counters) say so, group by group;
3. reads the KV events: the pool's ``BlockStored`` events name P1's blocks with
   vLLM's own block hashes (those of its GPU events for the same tokens);
4. resets with ``reset_external=true``: the pool loses this layout's keys (not
   another layout's), and the events say ``AllBlocksCleared``;
5. completes P2 again: nothing from the pool, and the same tokens as the pool
   run (so step 2's output equals the output computed without the pool).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvpool.connector.contract import metric_names as m
from kvpool.connector.contract.keys import KeySpace, hash_digest
from kvpool.connector.contract.mooncake_env import client_env
from kvpool.connector.local.pool import LOOPBACK, free_port, port_open
from kvpool.connector.local.ports import held_port, release_port
from testing.child_processes import kill_group, remove_shared_memory, wait_group_gone
from testing.models import build_gemma3
from testing.pool_store import put_bytes
from testing.prompts import BLOCK, P1, P2, PREFIX_HIT, block_hashes

pytestmark = [pytest.mark.engine, pytest.mark.mooncake]

STARTUP_S = 900.0
REQUEST_S = 300.0
MAX_TOKENS = 8
SERVED = "tiny-gemma3"
GROUP_KINDS = ("sliding_window", "sliding_window", "full")
TOPIC = "kv"
WARM_UP_TRIES = 5


def warm_up_prompt(seed: int) -> list[int]:
    """A short prompt of its own (no block shared with P1 or P2)."""
    import random

    rng = random.Random(1000 + seed)
    return [rng.randrange(3, 500) for _ in range(2 * BLOCK + 5)]


def _lines_until(stream: Any, deadline: float, want: re.Pattern[str]) -> tuple[str, list[str]]:
    """Lines of ``stream`` until one matches ``want`` (a thread reads; the deadline bounds it)."""
    seen: list[str] = []
    found: list[str] = []
    done = threading.Event()

    def read() -> None:
        for raw in stream:
            line = raw.rstrip("\n")
            seen.append(line)
            if want.search(line):
                found.append(line)
                break
        done.set()

    threading.Thread(target=read, daemon=True).start()
    done.wait(max(0.0, deadline - time.monotonic()))
    if not found:
        raise TimeoutError(f"no line matching {want.pattern!r}; got: {seen[-20:]}")
    return found[0], seen


@dataclass
class PoolCommand:
    """``kvpool-local-pool`` as a user runs it: JSON on stdout, notes on stderr."""

    cache_prefix: str
    process: subprocess.Popen[str] | None = None
    config: dict[str, Any] = field(default_factory=dict)
    metrics_url: str = ""
    log_folders: list[Path] = field(default_factory=list)  # the command keeps them and says where

    def start(self) -> PoolCommand:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "kvpool.connector.local.pool_command", "--segment-size", "256MB",
             "--cache-prefix", self.cache_prefix],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        deadline = time.monotonic() + 120
        line, _ = _lines_until(self.process.stdout, deadline, re.compile(r"^\{"))
        self.config = json.loads(line)
        note, _ = _lines_until(self.process.stderr, deadline, re.compile(r"metrics http://"))
        match = re.search(r"metrics (http://\S+/metrics)", note)
        assert match, note
        self.metrics_url = match.group(1)
        folders = re.search(r"logs in (\S+) and (\S+)\.$", note.strip())
        assert folders, note
        self.log_folders = [Path(folder) for folder in folders.groups()]
        return self

    @property
    def master_address(self) -> str:
        return self.config["kv_connector_extra_config"]["master_server_address"]

    def key_count(self) -> int:
        with urllib.request.urlopen(self.metrics_url, timeout=10) as response:
            for line in response.read().decode().splitlines():
                if line.startswith("master_key_count "):
                    return int(float(line.split()[1]))
        raise AssertionError("master_key_count not exported")

    def interrupt(self) -> int:
        """Ctrl-C, as a user stops it; its exit status."""
        assert self.process is not None
        self.process.send_signal(signal.SIGINT)
        return self.process.wait(60)

    def kill(self) -> None:
        """Stop it if it still runs: Ctrl-C first (it stops its master and store), SIGKILL
        only if that does not end it (a SIGKILL alone leaves those two running); then remove
        the log folders it kept."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        while self.log_folders:
            shutil.rmtree(self.log_folders.pop(), ignore_errors=True)


@dataclass
class ApiServer:
    """vLLM's OpenAI server on loopback, its own process group (engine core included)."""

    model: Path
    kv_transfer_config: dict[str, Any]
    events_port: int
    log: Path  # under pytest's temporary directory: nothing left in /tmp
    port: int = field(default_factory=held_port)  # it listens after its model loads: held until stop
    process: subprocess.Popen[bytes] | None = None
    exposition: str = ""  # the last /metrics text

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def start(self) -> ApiServer:
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://{LOOPBACK}:{self.events_port}",
            "topic": TOPIC,
        }
        command = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model), "--served-model-name", SERVED,
            "--host", LOOPBACK, "--port", str(self.port),
            "--skip-tokenizer-init", "--enforce-eager", "--dtype", "float32",
            "--block-size", str(BLOCK), "--max-model-len", "2048", "--max-num-seqs", "4",
            "--seed", "0", "--enable-prompt-tokens-details", "--disable-uvicorn-access-log",
            "--kv-transfer-config", json.dumps(self.kv_transfer_config),
            "--kv-events-config", json.dumps(events),
        ]  # fmt: skip
        env = {
            **os.environ,
            **client_env(LOOPBACK),
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "1",  # as users run the server
            "VLLM_HOST_IP": LOOPBACK,
            "VLLM_SERVER_DEV_MODE": "1",  # /reset_prefix_cache
            "PYTHONHASHSEED": "0",
        }
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.tail()}")
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(f"{self.url}/health", timeout=2) as reply,
            ):
                if reply.status == 200:
                    return self
            time.sleep(1)
        raise TimeoutError(f"server not ready:\n{self.tail()}")

    def post(self, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        data = json.dumps(body or {}).encode()
        request = urllib.request.Request(
            f"{self.url}{path}", data=data, headers={"Content-Type": "application/json"}, method="POST"
        )
        with urllib.request.urlopen(request, timeout=REQUEST_S) as response:
            return json.loads(response.read().decode() or "{}")

    def complete(self, prompt: list[int]) -> tuple[list[int], int]:
        """Greedy completion of token ids: (output token ids, prompt tokens cached)."""
        body = {
            "model": SERVED,
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        reply = self.post("/v1/completions", body)
        details = reply["usage"].get("prompt_tokens_details") or {}
        return reply["choices"][0]["token_ids"], int(details.get("cached_tokens") or 0)

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as response:
            text = response.read().decode()
        out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k not in m.VLLM_LABELS))
                out[(sample.name, labels)] = out.get((sample.name, labels), 0.0) + sample.value
        self.exposition = text
        return out

    def stop(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(60)
        # Its own session: engine core, workers; and what they held in /dev/shm, once gone.
        held = kill_group(self.process.pid)
        self.process.wait(30)
        wait_group_gone(self.process.pid)
        remove_shared_memory(held)
        release_port(self.port)

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


class Subscriber:
    """A router's ZMQ SUB socket, bound where the server publishes its KV events; decodes vLLM's batches."""

    def __init__(self, port: int):
        import zmq
        from msgspec.msgpack import Decoder
        from vllm.distributed.kv_events import KVEventBatch

        self._zmq = zmq
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.SUB)
        self.socket.setsockopt_string(zmq.SUBSCRIBE, TOPIC)
        # vLLM's publisher connects to an endpoint with an address (and binds a wildcard one),
        # as engines connect to a router.
        self.socket.bind(f"tcp://{LOOPBACK}:{port}")
        self.decoder = Decoder(type=KVEventBatch)
        self.events: list[Any] = []

    def drain(self, quiet_s: float = 3.0, limit_s: float = 60.0) -> list[Any]:
        """Events received until none came for ``quiet_s`` (at most ``limit_s``)."""
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            if not self.socket.poll(int(quiet_s * 1000)):
                break
            _topic, _seq, payload = self.socket.recv_multipart()
            self.events.extend(self.decoder.decode(payload).events)
        return self.events

    def close(self) -> None:
        self.socket.close(linger=0)
        self.context.term()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_gemma3(tmp_path_factory.mktemp("serving-gemma3"))


@pytest.fixture(scope="module")
def served(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[PoolCommand, ApiServer, Subscriber]]:
    pool = PoolCommand(cache_prefix=f"serve{os.getpid()}")
    server: ApiServer | None = None
    subscriber: Subscriber | None = None
    try:
        pool.start()
        events_port = free_port()
        subscriber = Subscriber(events_port)
        log = tmp_path_factory.mktemp("serving-api") / "server.log"
        server = ApiServer(model_dir, pool.config, events_port, log).start()
        yield pool, server, subscriber
    finally:
        if server is not None:
            server.stop()
        if subscriber is not None:
            subscriber.close()
        pool.kill()


def _value(series: dict, name: str, **labels: object) -> float:
    key = (name, tuple(sorted((k, str(v)) for k, v in labels.items())))
    return series.get(key, 0.0)


def _pool_events(events: list[Any], kind: type) -> list[Any]:
    return [e for e in events if isinstance(e, kind) and getattr(e, "medium", None) == "CPU"]


def test_a_local_pool_serves_vllms_openai_server(served) -> None:
    from vllm.distributed.kv_events import AllBlocksCleared, BlockStored

    pool, server, subscriber = served
    assert pool.config["kv_connector"] == "KVPoolConnector"

    # 0. A router's subscription reaches vLLM's publisher only after its first messages (ZMQ
    # drops what a publisher sends before then): warm up with prompts of their own until
    # events arrive, then count from there.
    warmed: list[list[int]] = []  # the warm-up prompts and answers: their saves may publish late
    for attempt in range(WARM_UP_TRIES):
        prompt = warm_up_prompt(attempt)
        answer, _ = server.complete(prompt)
        warmed.append(prompt + answer)
        if subscriber.drain():
            break
    assert subscriber.events, "no KV event reached the subscriber"
    subscriber.events.clear()
    before = server.metrics()

    def delta(series: dict, name: str, **labels: object) -> float:
        return _value(series, name, **labels) - _value(before, name, **labels)

    # 1. P1 fills the pool; the local prefix cache is then emptied (the pool keeps P1).
    out_a, cached_a = server.complete(P1)
    assert cached_a == 0
    _wait_until_stored(pool, before, P1)
    assert server.post("/reset_prefix_cache") == {"success": True}

    # 2. P2 takes the shared prefix from the pool.
    out_b, cached_b = server.complete(P2)
    assert cached_b == PREFIX_HIT
    series = server.metrics()
    assert delta(series, "vllm:kvpool_lookups_total") == 2
    assert delta(series, "vllm:kvpool_lookup_query_tokens_total") == len(P1) + len(P2)
    assert delta(series, "vllm:kvpool_lookup_hit_tokens_total") == PREFIX_HIT
    assert delta(series, "vllm:external_prefix_cache_hits_total") == PREFIX_HIT  # vLLM agrees
    for group, kind in enumerate(GROUP_KINDS):
        labels = {"group": group, "group_kind": kind}
        # a 64-token window at token 288 needs 2 blocks; full attention all 9
        loaded = 9 if kind == "full" else 2
        assert delta(series, "vllm:kvpool_group_hit_tokens_total", **labels) == PREFIX_HIT
        assert delta(series, "vllm:kvpool_present_blocks_total", **labels) == PREFIX_HIT // BLOCK
        assert delta(series, "vllm:kvpool_transfer_blocks_total", operation="load", **labels) == loaded
        assert delta(series, "vllm:kvpool_transfer_blocks_total", operation="save", **labels) > 0
    for spec in m.ALL:  # every series of ours is on vLLM's /metrics
        assert f"# TYPE {spec.exported} " in server.exposition, spec.name

    # 3. The pool's events name the stored blocks with vLLM's own block hashes.
    events = subscriber.drain()
    # Events go out with the engine's next step: the local reset's came with P2's steps.
    assert sum(isinstance(e, AllBlocksCleared) for e in events) == 1
    stored = _pool_events(events, BlockStored)
    assert stored and all(e.locality == "REMOTE" for e in stored)
    # A warm-up's save may finish after the count began (a busy machine): its events must be
    # right too.
    late = {k: v for tokens in warmed for k, v in _block_hashes(tokens).items()}
    expected = {**late, **_block_hashes(P1 + out_a), **_block_hashes(P2 + out_b)}
    for event in stored:
        assert event.block_size == BLOCK and len(event.block_hashes) == 1
        assert event.kv_cache_spec_kind == GROUP_KINDS[event.group_idx].replace("full", "full_attention")
        assert event.block_hashes[0] == expected[tuple(event.token_ids)]
    full_group = GROUP_KINDS.index("full")
    p1_blocks = {tuple(P1[i * BLOCK : (i + 1) * BLOCK]) for i in range(len(P1) // BLOCK)}
    assert p1_blocks <= {tuple(e.token_ids) for e in stored if e.group_idx == full_group}
    # The same hashes as vLLM's own events for those blocks in its GPU cache (full attention:
    # vLLM's event lists every block it caches, so its i-th hash is its i-th block's).
    gpu = {
        tuple(e.token_ids[i * BLOCK : (i + 1) * BLOCK]): h
        for e in events
        if isinstance(e, BlockStored) and e.medium == "GPU" and e.group_idx == full_group
        for i, h in enumerate(e.block_hashes)
    }
    for event in stored:
        if event.group_idx == full_group and tuple(event.token_ids) in gpu:
            assert gpu[tuple(event.token_ids)] == event.block_hashes[0]

    # 4. A reset with reset_external clears this layout's keys, and only those.
    other_layout = KeySpace(pool.config["kv_connector_extra_config"]["cache_prefix"], "0" * 16).key(
        0, 0, 0, "x"
    )
    _put_other_key(pool, other_layout)
    assert server.post("/reset_prefix_cache?reset_external=true") == {"success": True}
    deadline = time.monotonic() + 120
    while pool.key_count() > 1 and time.monotonic() < deadline:  # held keys go with the sweep
        time.sleep(1)
    assert pool.key_count() == 1  # the other layout's key

    # 5. Without the pool, P2 gives the same tokens.
    out_ref, cached_ref = server.complete(P2)
    assert cached_ref == 0
    assert out_b == out_ref
    # With this step went out the reset's events: vLLM's local cache cleared, and the pool.
    assert sum(isinstance(e, AllBlocksCleared) for e in subscriber.drain()) == 1 + 2
    assert delta(server.metrics(), "vllm:kvpool_lookup_hit_tokens_total") == PREFIX_HIT  # no new hit

    # Ctrl-C stops the pool command cleanly, and its master with it.
    server.stop()
    port = pool.master_address.rsplit(":", 1)[1]
    assert pool.interrupt() == 0
    assert not port_open(int(port))


def _block_hashes(tokens: list[int]) -> dict[tuple[int, ...], Any]:
    """Each full block's tokens -> its hash, as vLLM publishes it in KV events."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    hashes = block_hashes(tokens)
    return {
        tuple(tokens[i * BLOCK : (i + 1) * BLOCK]): maybe_convert_block_hash(h) for i, h in enumerate(hashes)
    }


@contextlib.contextmanager
def _pool_client(pool: PoolCommand) -> Iterator[Any]:
    """A client of the pool of our own (contributing no memory)."""
    from kvpool.connector.contract.settings import ConnectorSettings
    from kvpool.connector.pool_client import open_client

    client = open_client(
        ConnectorSettings.parse({"master_server_address": pool.master_address}), global_segment_size=0
    )
    try:
        yield client
    finally:
        client.close()


def _put_other_key(pool: PoolCommand, key: str) -> None:
    """A key of another layout under the same prefix, stored through a client of our own."""
    with _pool_client(pool) as client:
        assert put_bytes(client, key, b"another layout") == 0


def _wait_until_stored(pool: PoolCommand, series: dict, prompt: list[int], timeout_s: float = 120) -> None:
    """Until the pool holds ``prompt``'s shared prefix in the full-attention group (saved last):
    a save publishes after the response went out, so the next request could look up first."""
    fingerprint = next(
        dict(labels)["fingerprint"] for name, labels in series if name == m.KEY_FINGERPRINT_INFO.exported
    )
    keyspace = KeySpace(pool.config["kv_connector_extra_config"]["cache_prefix"], fingerprint)
    group = GROUP_KINDS.index("full")
    hashes = block_hashes(prompt)[: PREFIX_HIT // BLOCK]
    keys = [keyspace.key(group, 0, 0, hash_digest(h)) for h in hashes]
    deadline = time.monotonic() + timeout_s
    with _pool_client(pool) as client:
        while not all(client.exists(keys)):
            assert time.monotonic() < deadline, f"the prefix was not stored within {timeout_s} s"
            time.sleep(0.2)
