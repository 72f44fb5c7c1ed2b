"""Frozen processes and foreign objects under real engines: never wrong KV, never a hung request.

One master and one store process on loopback, frozen (SIGSTOP) and thawed (SIGCONT) at
chosen moments, and objects replaced through Mooncake's own ``upsert``; real in-process
vLLM engines (float32 KV) with deadlines of a second (``store_timeout_s`` of 20 s, so
Mooncake itself never ends a frozen call before the test thaws it). The matrix: both
layouts (the all-full-attention Gemma3 has one KV-cache group and a failed load hands back
block ids; the hybrid Gemma3 sends the request back whole) and ``kv_role`` ``kv_both`` and
``kv_consumer`` (whose pool a ``kv_both`` engine fills first). Every output, tokens and
log-probabilities, equals the reference computed without any pool.

* a store frozen mid-load: the load passes its deadline and the request recomputes; the
  store is thawed after the recompute, while the request still decodes, and the frozen
  call, now returning, reads objects of random bytes: it must write no block;
* a master frozen at lookup: the lookup passes its deadline and misses;
* objects that are not their block (another block's object, truncated, another layout,
  random bytes): recomputed, removed, counted ``corrupt``; the negative control loads
  another prompt's blocks with the header check off, and the answer changes;
* (``kv_both``) a store frozen mid-save: the save passes its deadline and publishes nothing;
* (``kv_both``) the engine shut down with a save stuck in the pool: shutdown returns, and
  nothing half-written is ever present;
* ``timeout``, ``corrupt`` and the removals on ``/metrics``.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvpool.connector.contract.keys import hash_digest
from kvpool.connector.contract.object_header import HEADER_BYTES, ObjectIdentity, pack_header, payload_crc
from kvpool.connector.contract.settings import ConnectorSettings
from kvpool.connector.local.pool import LOOPBACK, LocalPool, free_port
from kvpool.connector.pool_client import PoolClient, open_client
from testing.engine import transfer_config, worker_of
from testing.pool_store import raw_store
from testing.prompts import block_hashes
from tests.faults.helpers import PREFIX_BLOCKS, PREFIX_TOKENS, prompt

pytestmark = [pytest.mark.faults, pytest.mark.engine, pytest.mark.mooncake, pytest.mark.timeout(900)]

MAX_TOKENS = 8
LOGPROB_TOLERANCE = 1e-3
DEADLINE_S = 2.0  # passed only when a process is frozen, even on a busy machine
SERVE_DEADLINE_S = 120.0
GOOD_BLOCKS = 4  # blocks 0..3 of a prefix: never tampered with
TAMPERED = range(GOOD_BLOCKS, PREFIX_BLOCKS)
# Prefixes (``helpers.prompt``) per scenario, apart for the two roles of one model.
FROZEN_LOAD, FROZEN_LOOKUP, FOREIGN, FROZEN_SAVE, SHUTDOWN, UNCHECKED, DONOR, STALE = range(8)
ROLE_BASE = {"kv_both": 200, "kv_consumer": 300}
CONFIGS = [
    ("single_group", "kv_both"),
    ("single_group", "kv_consumer"),
    ("hybrid", "kv_both"),
    ("hybrid", "kv_consumer"),
]


def prefix_of(role: str, scenario: int) -> int:
    return ROLE_BASE[role] + scenario


def keys_needed() -> list[tuple[int, int]]:
    """Every request whose output a test checks."""
    both = [(prefix_of("kv_both", s), j) for s in range(SHUTDOWN) for j in range(3)]
    both += [(prefix_of("kv_both", UNCHECKED), 0), (prefix_of("kv_both", UNCHECKED), 1)]
    both += [(prefix_of("kv_both", STALE), j) for j in range(3)]
    consumer = [
        (prefix_of("kv_consumer", s), j) for s in (FROZEN_LOAD, FROZEN_LOOKUP, FOREIGN) for j in (1, 2)
    ]
    return both + consumer


# --- the pool and its processes ------------------------------------------------------------


def wait_stopped(pid: int, timeout: float = 10.0) -> None:
    """Wait until every thread of ``pid`` has stopped: ``kill`` returns before a busy machine
    has scheduled each thread to take the SIGSTOP, and one still running could serve a call."""
    deadline = time.monotonic() + timeout
    while True:
        states = []
        for task in Path(f"/proc/{pid}/task").iterdir():
            with suppress(OSError):
                # The state follows the parenthesised command name, which may hold spaces.
                states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
        if states and all(state in ("T", "t") for state in states):
            return
        assert time.monotonic() < deadline, f"process {pid} did not stop: thread states {states}"
        time.sleep(0.005)


@contextmanager
def frozen(process: Any) -> Iterator[Callable[[], None]]:
    """SIGSTOP ``process``; yields ``thaw`` (SIGCONT), which runs at the latest on exit."""
    thawed = False

    def thaw() -> None:
        nonlocal thawed
        if not thawed:
            os.kill(process.pid, signal.SIGCONT)
            thawed = True

    os.kill(process.pid, signal.SIGSTOP)
    try:
        wait_stopped(process.pid)
        yield thaw
    finally:
        thaw()


@pytest.fixture(scope="module")
def pool() -> Iterator[LocalPool]:
    # The master keeps a silent (frozen) store's segment for a minute, not Mooncake's default
    # 10 s: the tests judge the connector, not how long the master waits for a store.
    with LocalPool(segment_size="256MB", master_args=("--client_ttl=60",)) as local:
        yield local


def settings_for(pool: LocalPool, model: str) -> ConnectorSettings:
    return ConnectorSettings.parse(
        {
            "master_server_address": pool.address,
            "cache_prefix": f"integrity-{model}",
            "lookup_timeout_s": DEADLINE_S / 2,
            "load_timeout_s": DEADLINE_S,
            "save_timeout_s": DEADLINE_S,
            "shutdown_timeout_s": 2 * DEADLINE_S,
            "store_timeout_s": 20,
        }
    )


# --- engines ---------------------------------------------------------------------------------


@dataclass
class Served:
    key: tuple[int, int]
    tokens: list[int]
    logprobs: list[float]
    cached: int


@dataclass
class PoolEngine:
    """A real in-process engine (or none, for references) stepped by the test."""

    model: Path
    config: dict[str, Any] | None
    llm: Any = None
    closed: bool = False
    _ids: int = 0

    def start(self) -> PoolEngine:
        from testing.engine import EngineOptions, create_llm

        self.llm = create_llm(
            EngineOptions(
                model=str(self.model),
                kv_transfer_config=self.config,
                max_num_seqs=2,
                dtype="float32",
                disable_log_stats=self.config is None,
            )
        )
        return self

    def serve(self, key: tuple[int, int], on_step: Callable[[int], None] | None = None) -> Served:
        """Serve one request with an empty local cache; ``on_step(tokens so far)`` after each step."""
        from testing.engine import sampling_params

        engine = self.llm.llm_engine
        deadline = time.monotonic() + SERVE_DEADLINE_S
        while not engine.reset_prefix_cache():
            assert time.monotonic() < deadline, "the local prefix cache never became free"
            engine.step()
        self._ids += 1
        request_id = f"integrity-{self._ids}"
        engine.add_request(
            request_id, {"prompt_token_ids": prompt(*key)}, sampling_params(MAX_TOKENS, logprobs=True)
        )
        tokens = 0
        while True:
            outputs = engine.step()
            for out in outputs:
                if out.request_id != request_id:
                    continue
                tokens = len(out.outputs[0].token_ids)
                if out.finished:
                    completion = out.outputs[0]
                    logprobs = [float(next(iter(d.values())).logprob) for d in completion.logprobs or []]
                    return Served(key, list(completion.token_ids), logprobs, int(out.num_cached_tokens or 0))
            if on_step is not None:
                on_step(tokens)
            assert time.monotonic() < deadline, f"request {key} hung"
            if not outputs:
                time.sleep(0.005)

    @property
    def worker(self) -> Any:
        from testing.engine import worker_connector

        return worker_connector()

    def transfers(self, operation: str | None = None) -> list[Any]:
        transfers = list(self.worker.recording.transfers)
        return [t for t in transfers if operation is None or t.operation == operation]

    def lookups(self) -> list[Any]:
        from testing.engine import scheduler_connector

        return list(scheduler_connector(self.llm).recording.lookups)

    def keyspace(self) -> Any:
        from testing.engine import scheduler_connector

        return scheduler_connector(self.llm).keyspace

    def wait_unstuck(self) -> None:
        """Until no call the connector gave up on is still in flight."""
        side = worker_of(self.worker)
        deadline = time.monotonic() + SERVE_DEADLINE_S
        while side.jobs.stalled:
            assert time.monotonic() < deadline, "a stuck call never returned"
            time.sleep(0.01)
        side.wait_for_saves()

    def close(self) -> None:
        from testing.engine import shutdown_llm

        if not self.closed:
            self.closed = True
            shutdown_llm(self.llm)


def check(served: list[Served], references: dict[tuple[int, int], Served]) -> None:
    for got in served:
        want = references[got.key]
        assert got.tokens == want.tokens, f"{got.key}: tokens {got.tokens} != {want.tokens}"
        worst = max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs, strict=True))
        assert worst < LOGPROB_TOLERANCE, f"{got.key}: log-probabilities differ by up to {worst:.3g}"


@dataclass
class Model:
    path: Path
    groups: int
    references: dict[tuple[int, int], Served] = field(default_factory=dict)


def _model(path: Path, groups: int) -> Model:
    engine = PoolEngine(path, None).start()
    try:
        return Model(path, groups, {key: engine.serve(key) for key in keys_needed()})
    finally:
        engine.close()


class Models:
    """The two tiny Gemma3 models and their references, each built on first use."""

    def __init__(self, root: Path):
        self.root = root
        self._built: dict[str, Model] = {}

    def __getitem__(self, layout: str) -> Model:
        if layout not in self._built:
            from testing.models import build_gemma3, build_gemma3_full

            if layout == "single_group":
                self._built[layout] = _model(build_gemma3_full(self.root / "full"), 1)
            else:
                self._built[layout] = _model(build_gemma3(self.root / "hybrid"), 3)
        return self._built[layout]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Models:
    return Models(tmp_path_factory.mktemp("integrity-models"))


@dataclass
class Setup:
    layout: str
    role: str
    model: Model
    engine: PoolEngine
    settings: ConnectorSettings
    pool: LocalPool

    def prefix(self, scenario: int) -> int:
        return prefix_of(self.role, scenario)

    def stalled(self) -> bool:
        """Whether the connector gave up on a call that is still in the pool."""
        return bool(worker_of(self.engine.worker).jobs.stalled)

    def client(self) -> PoolClient:
        return open_client(self.settings, global_segment_size=0)

    def full_group(self) -> int:
        """The full-attention group (it loads every block of a hit; window groups only the last)."""
        from testing.engine import scheduler_connector

        groups = scheduler_connector(self.engine.llm).layout.groups
        return next(i for i, g in enumerate(groups) if g.kind.value == "full")

    def keys(self, prefix: int, blocks: range) -> list[str]:
        """Keys of the full-attention group's blocks ``blocks`` of ``prefix``."""
        group = self.full_group()
        hashes = block_hashes(prompt(prefix, 0))
        return [self.engine.keyspace().key(group, 0, 0, hash_digest(hashes[i])) for i in blocks]


@pytest.fixture(scope="module", params=CONFIGS, ids=[f"{p}-{r}" for p, r in CONFIGS])
def setup(request: pytest.FixtureRequest, models: Models, pool: LocalPool) -> Iterator[Setup]:
    layout, role = request.param
    model = models[layout]
    settings = settings_for(pool, layout)
    if role == "kv_consumer":
        # A consumer stores nothing: a kv_both engine fills the pool with its prefixes first.
        producer = PoolEngine(model.path, transfer_config(settings)).start()
        try:
            for scenario in (FROZEN_LOAD, FROZEN_LOOKUP, FOREIGN):
                producer.serve((prefix_of(role, scenario), 0))
            producer.wait_unstuck()
        finally:
            producer.close()
    engine = PoolEngine(model.path, transfer_config(settings, role)).start()
    try:
        yield Setup(layout, role, model, engine, settings, pool)
    finally:
        engine.close()


def seed(setup: Setup, scenario: int) -> Served:
    """Store the scenario's prefix (a kv_both engine serves it; a consumer's pool has it)."""
    key = (setup.prefix(scenario), 0)
    if setup.role == "kv_both":
        served = setup.engine.serve(key)
        check([served], setup.model.references)
        setup.engine.wait_unstuck()
    return key


def replace_from_donor(setup: Setup, scenario: int, make: Callable[[bytes, bytes], bytes]) -> int:
    """Store the scenario's prefix and the donor's, then put ``make(own, donor's)`` under each
    of the prefix's keys of blocks 4..8 (same size: right layout, right length); its prefix."""
    prefix, donor = setup.prefix(scenario), setup.prefix(DONOR)
    seed(setup, scenario)
    setup.engine.serve((donor, 0))
    setup.engine.wait_unstuck()
    client = setup.client()
    try:
        for mine, theirs in zip(setup.keys(prefix, TAMPERED), setup.keys(donor, TAMPERED), strict=True):
            own, other = raw_store(client).get(mine), raw_store(client).get(theirs)
            assert len(own) == len(other) > HEADER_BYTES, "both prefixes are stored"
            assert raw_store(client).upsert(mine, make(own, other)) == 0
    finally:
        client.close()
    return prefix


# --- the scenarios ------------------------------------------------------------------------------


def test_a_store_frozen_mid_load_is_recomputed_and_its_late_read_writes_no_block(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mooncake.store import MooncakeDistributedStore

    prefix = setup.prefix(FROZEN_LOAD)
    seed(setup, FROZEN_LOAD)
    # Blocks 4..8 become random bytes of the right size: what the frozen read returns late.
    client = setup.client()
    try:
        for key in setup.keys(prefix, TAMPERED):
            stored = raw_store(client).get(key)
            assert len(stored) > HEADER_BYTES, "the prefix is stored"
            assert raw_store(client).upsert(key, os.urandom(len(stored))) == 0
    finally:
        client.close()
    store = setup.pool.store
    assert store is not None and store.process is not None
    original = MooncakeDistributedStore.batch_get_into_multi_buffers
    prefix_keys = set(setup.keys(prefix, range(PREFIX_BLOCKS)))
    state: dict[str, Any] = {}
    freezing = threading.Lock()  # transfer threads may call at once: one freezes
    # The freezing call also waits for the thaw at the Mooncake boundary: SIGSTOP alone left it
    # unstalled in 2 of 5 full runs (the read returned in 1 ms while the store was stopped), and
    # then nothing was given up on. After the thaw it reads for real, late.
    released = threading.Event()

    def freeze_then_read(self: Any, keys: list[str], *args: Any) -> list[int]:
        ours = bool(prefix_keys & set(keys))
        with freezing:
            freezes = "thaw" not in state and ours
            if freezes:
                state["frozen"] = frozen(store.process)
                state["thaw"] = state["frozen"].__enter__()
                state["frozen_at"] = time.monotonic()
        if freezes:
            released.wait(SERVE_DEADLINE_S)
        codes = original(self, keys, *args)
        if ours and "thawed" not in state and "frozen_at" in state:
            # A read of the prefix returning while the store is frozen (for the message below).
            state.setdefault("returned_frozen", []).append(round(time.monotonic() - state["frozen_at"], 3))
        return codes

    def thaw_once_recomputed(tokens: int) -> None:
        # Given up (stalled) and recomputed (a token): a late write would now be KV it uses.
        if "thaw" in state and setup.stalled() and tokens >= 1 and "thawed" not in state:
            state["thaw"]()
            state["thawed"] = True
            released.set()
            setup.engine.wait_unstuck()  # the frozen read returns, scribbling what it read

    monkeypatch.setattr(MooncakeDistributedStore, "batch_get_into_multi_buffers", freeze_then_read)
    mark = len(setup.engine.transfers())
    try:
        faulted = setup.engine.serve((prefix, 1), on_step=thaw_once_recomputed)
    finally:
        released.set()
        monkeypatch.undo()
        if "frozen" in state:
            state["frozen"].__exit__(None, None, None)
    loads = [t for t in setup.engine.transfers()[mark:] if t.operation == "load"]
    assert state.get("thawed"), (
        f"the store was frozen mid-load and thawed after the recompute: {state}, {loads}"
    )
    check([faulted], setup.model.references)
    assert loads[0].failures.get("timeout"), "the frozen load passed its deadline"
    setup.engine.wait_unstuck()
    after = setup.engine.serve((prefix, 2))
    check([after], setup.model.references)
    assert after.cached >= GOOD_BLOCKS * 32, "the good prefix still comes from the pool"


def test_a_master_frozen_at_lookup_makes_it_a_miss(setup: Setup) -> None:
    prefix = setup.prefix(FROZEN_LOOKUP)
    seed(setup, FROZEN_LOOKUP)
    master = setup.pool.master
    assert master is not None and master.process is not None
    marks = len(setup.engine.lookups())
    with frozen(master.process) as thaw:

        def thaw_once_missed(tokens: int) -> None:
            if len(setup.engine.lookups()) > marks:
                thaw()  # the lookup has decided: a miss

        missed = setup.engine.serve((prefix, 1), on_step=thaw_once_missed)
    setup.engine.wait_unstuck()
    check([missed], setup.model.references)
    assert missed.cached == 0
    lookups = setup.engine.lookups()[marks:]
    assert lookups[0].failures == {"timeout": 1} and lookups[0].hit_tokens == 0
    hit = setup.engine.serve((prefix, 2))
    check([hit], setup.model.references)
    assert hit.cached >= PREFIX_TOKENS, "lookups answer again once the master does"


def test_objects_that_are_not_their_block_are_recomputed_and_removed(setup: Setup) -> None:
    prefix = setup.prefix(FOREIGN)
    seed(setup, FOREIGN)
    keys = setup.keys(prefix, range(PREFIX_BLOCKS))
    digests = [key.rsplit("/", 1)[-1] for key in keys]
    client = setup.client()
    try:
        store = raw_store(client)
        objects = [store.get(key) for key in keys]
        payload = len(objects[0]) - HEADER_BYTES
        group = setup.full_group()
        other_layout = pack_header(
            ObjectIdentity("another-layout", digests[5], group, 0, 0, payload),
            payload_crc(objects[5][HEADER_BYTES:]),
        )
        replaced = {
            1: objects[2],  # another block's object under this key
            3: objects[3][: len(objects[3]) // 2],  # truncated
            5: other_layout + objects[5][HEADER_BYTES:],  # another layout, same size
            7: os.urandom(len(objects[7])),  # random bytes, same size
        }
        for block, data in replaced.items():
            assert store.upsert(keys[block], data) == 0
        mark = len(setup.engine.transfers())
        faulted = setup.engine.serve((prefix, 1))
        check([faulted], setup.model.references)
        setup.engine.wait_unstuck()
        records = setup.engine.transfers()[mark:]
        load = next(t for t in records if t.operation == "load")
        assert load.failures.get("corrupt") == len(replaced), load.failures
        removed = [t for t in records if t.operation == "remove"]
        assert sum(sum(t.blocks) for t in removed) == len(replaced)
        present = client.exists([keys[b] for b in replaced])
        if setup.role == "kv_consumer":
            assert present == [False] * len(replaced), "removed, and a consumer stores nothing"
    finally:
        client.close()
    again = setup.engine.serve((prefix, 2))
    check([again], setup.model.references)
    if setup.role == "kv_both":
        assert again.cached >= PREFIX_TOKENS, "the recompute stored the right blocks again"


def test_negative_control_without_the_header_check_another_blocks_object_is_kv(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Blocks 4..8 of a prefix replaced by another prompt's (right layout, right size): with
    the header check off they load as KV and the answer changes, so the check is what keeps
    them out, and the loaded KV is really used."""
    if (setup.layout, setup.role) != ("single_group", "kv_both"):
        pytest.skip("one configuration suffices")
    from kvpool.connector.worker import side as worker_side

    prefix = replace_from_donor(setup, UNCHECKED, lambda own, other: other)
    monkeypatch.setattr(worker_side, "mismatch", lambda data, expected: None)
    served = setup.engine.serve((prefix, 1))
    monkeypatch.undo()
    assert served.cached == PREFIX_TOKENS, "the swapped blocks were loaded"
    with pytest.raises(AssertionError):
        check([served], setup.model.references)


def test_a_payload_not_as_its_header_states_is_recomputed_and_without_the_check_is_kv(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read that overtakes its block's write finds the block's header over stale bytes:
    Mooncake's TCP write returns once the writer's kernel holds the bytes, the store copies
    them later, and the writer has published by then. Blocks 4..8 here keep their headers over
    another prompt's payloads: with the payload check off they load as KV and the answer
    changes; with it they are recomputed (and removed)."""
    if setup.role != "kv_both":
        pytest.skip("a kv_both engine stores the prefix whose payloads the test replaces")
    from kvpool.connector.worker import staging

    prefix = replace_from_donor(setup, STALE, lambda own, other: own[:HEADER_BYTES] + other[HEADER_BYTES:])
    with monkeypatch.context() as unchecked:
        unchecked.setattr(staging, "payload_matches", lambda header, kind, value: True)
        served = setup.engine.serve((prefix, 1))
    assert served.cached >= PREFIX_TOKENS, "the stale payloads were loaded"
    with pytest.raises(AssertionError):
        check([served], setup.model.references)
    mark = len(setup.engine.transfers())
    checked = setup.engine.serve((prefix, 2))
    check([checked], setup.model.references)
    setup.engine.wait_unstuck()
    load = next(t for t in setup.engine.transfers()[mark:] if t.operation == "load")
    assert load.failures.get("corrupt") == len(TAMPERED), load.failures


def test_a_store_frozen_mid_save_publishes_nothing(setup: Setup, monkeypatch: pytest.MonkeyPatch) -> None:
    if setup.role != "kv_both":
        pytest.skip("a consumer saves nothing")
    from mooncake.store import MooncakeDistributedStore

    prefix = setup.prefix(FROZEN_SAVE)
    store = setup.pool.store
    assert store is not None and store.process is not None
    original = MooncakeDistributedStore.batch_put_from_multi_buffer_ranges
    state: dict[str, Any] = {}
    keyspace, hashes = setup.engine.keyspace(), block_hashes(prompt(prefix, 0))
    mine = {keyspace.key(g, 0, 0, hash_digest(h)) for g in range(setup.model.groups) for h in hashes}
    setup.engine.wait_unstuck()  # earlier tests' saves are done: the first write below is this prefix's

    freezing = threading.Lock()  # saves write on several threads at once: one freezes

    def freeze_then_write(self: Any, keys: list[str], *args: Any) -> list[int]:
        with freezing:
            if "frozen" not in state and mine.issuperset(keys):
                state["frozen"] = frozen(store.process)
                state["thaw"] = state["frozen"].__enter__()
        codes = original(self, keys, *args)
        if "thaw" in state and mine.issuperset(keys):
            # A write that returns while the store is frozen (its bytes fit the loopback
            # socket's buffers) completed as far as Mooncake says; one that returns only
            # after the thaw was stuck past the save's deadline and given up.
            state.setdefault("given_up" if "thawed" in state else "returned", []).extend(keys)
            state.setdefault("codes", []).extend(codes)
        return codes

    def thaw_after_deadline(tokens: int) -> None:
        if "thaw" not in state or "thawed" in state:
            return
        if not setup.stalled():
            # Let the save pass its deadline before the request ends: the next step's
            # barrier gives up on it.
            time.sleep(DEADLINE_S / 4)
            return
        state["thawed"] = True
        state["thaw"]()

    monkeypatch.setattr(MooncakeDistributedStore, "batch_put_from_multi_buffer_ranges", freeze_then_write)
    mark = len(setup.engine.transfers())
    try:
        served = setup.engine.serve((prefix, 0), on_step=thaw_after_deadline)
    finally:
        monkeypatch.undo()
        if "frozen" in state:
            state["frozen"].__exit__(None, None, None)
    check([served], setup.model.references)
    setup.engine.wait_unstuck()
    assert "frozen" in state, "a save was writing when the store froze"
    saves = [t for t in setup.engine.transfers()[mark:] if t.operation == "save"]
    assert state.get("thawed"), (
        f"the save was not given up while the store was frozen: {saves}, codes {state.get('codes')}"
    )
    given_up = state.get("given_up", [])
    assert given_up, f"a write was stuck until the store thawed: {saves}"
    client = setup.client()
    try:
        present = client.exists(given_up)
    finally:
        client.close()
    assert present == [False] * len(given_up), f"the abandoned save published: {saves}"
    assert any(t.failures.get("timeout") for t in saves)
    # Saves go on: the prefix is stored again and hits.
    setup.engine.serve((prefix, 1))
    setup.engine.wait_unstuck()
    hit = setup.engine.serve((prefix, 2))
    check([hit], setup.model.references)
    assert hit.cached >= PREFIX_TOKENS


def test_failures_and_removals_are_on_metrics(setup: Setup) -> None:
    """vLLM's /metrics (its Prometheus registry, served over HTTP here) shows the faults above."""
    import prometheus_client

    server, thread = prometheus_client.start_http_server(free_port(), addr=LOOPBACK)
    try:
        url = f"http://{LOOPBACK}:{server.server_address[1]}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
    finally:
        server.shutdown()
        thread.join(5)
    lines = [line for line in text.splitlines() if not line.startswith("#")]

    def total(name: str, **labels: str) -> float:
        picked = [
            float(line.rsplit(" ", 1)[1])
            for line in lines
            if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items())
        ]
        return sum(picked)

    assert total("vllm:kvpool_failures_total", reason="timeout", operation="load") > 0
    assert total("vllm:kvpool_failures_total", reason="timeout", operation="lookup") > 0
    assert total("vllm:kvpool_failures_total", reason="corrupt", operation="load") > 0
    assert total("vllm:kvpool_removed_objects_total", reason="corrupt") > 0


def test_shutdown_with_a_save_in_the_pool_returns_and_leaves_nothing_half_written(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    if setup.role != "kv_both":
        pytest.skip("a consumer saves nothing")
    from mooncake.store import MooncakeDistributedStore

    prefix = setup.prefix(SHUTDOWN)
    store = setup.pool.store
    assert store is not None and store.process is not None
    original = MooncakeDistributedStore.batch_put_from_multi_buffer_ranges
    state: dict[str, Any] = {}
    shut_down = threading.Event()

    def freeze_then_write(self: Any, keys: list[str], *args: Any) -> list[int]:
        if "frozen" not in state:
            state["keys"] = list(keys)
            state["frozen"] = frozen(store.process)
            state["thaw"] = state["frozen"].__enter__()
            # Mooncake's TCP write returns once the kernel has taken its bytes, so a frozen
            # store alone holds only a write too large for the socket buffers: this one is
            # held until the engine has shut down, as a write stuck in the transport is.
            shut_down.wait(SERVE_DEADLINE_S)
        return original(self, keys, *args)

    monkeypatch.setattr(MooncakeDistributedStore, "batch_put_from_multi_buffer_ranges", freeze_then_write)
    engine = setup.engine.llm.llm_engine
    side = worker_of(setup.engine.worker)
    from testing.engine import sampling_params

    try:
        assert engine.reset_prefix_cache()
        engine.add_request("shutdown", {"prompt_token_ids": prompt(prefix, 0)}, sampling_params(MAX_TOKENS))
        deadline = time.monotonic() + SERVE_DEADLINE_S
        while "frozen" not in state:  # until a save writes into the frozen store
            assert time.monotonic() < deadline, "no save reached the store"
            engine.step()
        setup.engine.close()  # vLLM's shutdown, the connector's with it: it must return
    finally:
        shut_down.set()
        monkeypatch.undo()
        if "frozen" in state:
            state["frozen"].__exit__(None, None, None)
    # The write returns once the store thaws, finds its save abandoned, and revokes it.
    deadline = time.monotonic() + SERVE_DEADLINE_S
    while side.jobs.live():
        assert time.monotonic() < deadline, "the stuck write never returned"
        time.sleep(0.05)
    client = setup.client()
    try:
        keys = state["keys"]
        assert client.exists(keys) == [False] * len(keys), "a save abandoned at shutdown was published"
    finally:
        client.close()
