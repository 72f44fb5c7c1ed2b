"""The Mooncake store client as the connector uses it.

Bounded batches (never more than ``batch_size`` keys per call), every per-key
return code classified, and one client per process shared by the scheduler
and worker roles when they live together.

A client of a tenant (``ConnectorSettings.tenant``) declares it to Mooncake, whose
master (run with ``--enable_multi_tenants``) charges the tenant's quota for every
write and keeps each tenant's keys apart; the client also puts the tenant in front
of every key it sends, so tenants miss each other's blocks on a master that does not
keep them apart (docs/tenancy.md).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, TypeVar

from kvpool.connector.contract.mooncake_env import configure_client_process
from kvpool.connector.contract.settings import ConnectorSettings
from kvpool.connector.cpu_affinity import unpinned
from kvpool.connector.observability.logs import get_logger
from kvpool.connector.pool_attach import Attacher, accepts_connections, set_up

logger = get_logger(__name__)

T = TypeVar("T")

# Per-key return codes of Mooncake's batch calls (mooncake-store ErrorCode).
CODE_STORE_FULL = -200
CODE_BUFFER_TOO_SMALL = -600
# The same code (Mooncake's INVALID_PARAMS) per key from a reservation: this client already
# holds a put session for the key (a save of it in flight here, or one whose publish or
# revoke failed: after a master failover, the session of a reservation made on the old leader
# lingers in the client until revoked, and every reservation of its key answers this; a revoke
# the master refuses, as after a store restarted under the write, keeps it for a retry).
CODE_SESSION_HELD = -600
# The master lists the object but holds no readable copy of it (its store died, or has not
# finished writing it): REPLICA_IS_NOT_READY, REPLICA_NOT_FOUND, REPLICA_IS_GONE.
CODES_REPLICA_UNAVAILABLE = (-703, -710, -712)
CODE_OBJECT_NOT_FOUND = -704
CODE_OBJECT_EXISTS = -705
# Not Mooncake's: a reservation answered CODE_OBJECT_EXISTS for a key whose object is not
# published (another writer's save in flight, or one that writer abandoned or died in:
# Mooncake drops such a reservation after about 30 s).
CODE_RESERVED_ELSEWHERE = -70500
# Not Mooncake's: a removal this client did not make, because a save of its own holds a put
# session for the key (or another removal of its own is removing it). Mooncake drops an
# object removed after its writer's publish reached the master and before the writer has the
# answer, and the publish still answers success: the key would be left empty.
CODE_KEPT_WRITING = -70501
CODE_TRANSFER_FAILED = -800
# A read whose lease on the object ran out before its transfer completed (Mooncake's
# LEASE_EXPIRED, seen under a frozen store): its bytes may not be the object's.
CODE_LEASE_EXPIRED = -707
CODE_RPC_FAILED = -900
CODE_RPC_TIMEOUT = -901
# Mooncake's multi-tenant admission: a write past its tenant's quota, or of a tenant the
# master has no quota for. Mooncake refuses the reservation; nothing of it is stored.
CODE_TENANT_QUOTA_EXCEEDED = -1700
CODE_TENANT_NOT_REGISTERED = -1701
TENANT_REFUSALS = (CODE_TENANT_QUOTA_EXCEEDED, CODE_TENANT_NOT_REGISTERED)
# Refusals by the tenant admission are logged at most once in this many seconds.
REFUSAL_LOG_S = 60.0
RPC_FAILURES = (CODE_RPC_FAILED, CODE_RPC_TIMEOUT)

# Buffers (scatter/gather entries) per multi-buffer call: Mooncake's TCP transport fails
# calls past ~2,000 (benchmarks/README.md, finding 1); 1,024 never failed.
MAX_BATCH_ENTRIES = 1024

# Keys per existence check (metadata only): larger calls cost less per key up to ~16k
# keys (benchmarks/README.md, finding 2).
MAX_EXIST_KEYS = 16384

# After this many batches in a row whose every key failed its RPC, fail fast for
# UNREACHABLE_BACKOFF_S, then try again.
UNREACHABLE_AFTER_BATCHES = 2
UNREACHABLE_BACKOFF_S = 2.0

# An existence check still inside Mooncake this long past Mooncake's own RPC timeout
# (``store_timeout_s``) is wedged: Mooncake did not end it (benchmarks/README.md, finding 9).
# Its caller gets a miss; later checks go to a spare client until the wedged call returns.
EXISTS_GRACE_S = 2.0
# The spare client's transfer buffer: it makes metadata calls only.
SPARE_LOCAL_BUFFER = 1 << 20


class Outcome(StrEnum):
    """What one key's transfer came to."""

    OK = "ok"
    MISSING = "missing"
    STORE_FULL = "store_full"
    TRANSFER_FAILED = "transfer_failed"
    RPC_FAILED = "rpc_failed"
    TIMEOUT = "timeout"  # past a deadline of the connector's, or Mooncake's RPC timeout
    CORRUPT = "corrupt"  # an object that is not the block its key names (header check)
    IN_FLIGHT = "in_flight"  # a save found the key reserved by another writer, not published
    QUOTA_EXCEEDED = "quota_exceeded"  # Mooncake refused a save past its tenant's quota
    TENANT_NOT_REGISTERED = "tenant_not_registered"  # the master holds no quota for the tenant
    REPLICA_UNAVAILABLE = "replica_unavailable"  # listed, but no copy readable (its store died)
    FORWARD_FAILED = "forward_failed"  # a save of a step whose forward raised: never started
    OTHER = "other_error"


FAILURE_OUTCOMES = tuple(o for o in Outcome if o is not Outcome.OK)


def classify(code: int, expected_size: int | None = None) -> Outcome:
    """Map a per-key return code (bytes moved when >= 0) to an ``Outcome``.

    A read that moved fewer bytes than the block holds is not a whole block:
    it counts as a transfer failure, never as loaded.
    """
    if code >= 0:
        if expected_size is not None and code != expected_size:
            return Outcome.TRANSFER_FAILED
        return Outcome.OK
    if code == CODE_OBJECT_NOT_FOUND:
        return Outcome.MISSING
    if code == CODE_STORE_FULL:
        return Outcome.STORE_FULL
    if code in (CODE_TRANSFER_FAILED, CODE_LEASE_EXPIRED):
        return Outcome.TRANSFER_FAILED
    if code == CODE_RPC_FAILED:
        return Outcome.RPC_FAILED
    if code == CODE_RPC_TIMEOUT:
        return Outcome.TIMEOUT
    if code == CODE_RESERVED_ELSEWHERE:
        return Outcome.IN_FLIGHT
    if code == CODE_TENANT_QUOTA_EXCEEDED:
        return Outcome.QUOTA_EXCEEDED
    if code == CODE_TENANT_NOT_REGISTERED:
        return Outcome.TENANT_NOT_REGISTERED
    if code in CODES_REPLICA_UNAVAILABLE:
        return Outcome.REPLICA_UNAVAILABLE
    _note_unclassified(code)
    return Outcome.OTHER


_unclassified_logged: dict[int, float] = {}


def _note_unclassified(code: int) -> None:
    """Log (at most once a ``REFUSAL_LOG_S`` per code) a code no outcome names: its keys count
    as ``other_error``, and the log says which code that was."""
    now = time.monotonic()
    if now - _unclassified_logged.get(code, -REFUSAL_LOG_S) < REFUSAL_LOG_S:
        return
    _unclassified_logged[code] = now
    logger.warning("Mooncake answered code %d, which no failure reason names: counted as other_error", code)


class StoreUnavailable(RuntimeError):
    """The Mooncake client could not be set up or has been closed."""


class _NotAttached:
    """The Mooncake client of a :class:`PoolClient` out of the pool: every call fails."""

    def __getattr__(self, name: str) -> Callable[..., Any]:
        def fail(*args: Any, **kwargs: Any) -> Any:
            raise StoreUnavailable(f"not in the pool yet: no {name}")

        return fail


def _listening_ports() -> set[int]:
    """The TCP ports this process listens on (empty when they cannot be read)."""
    import psutil

    try:
        connections = psutil.Process().net_connections(kind="tcp")
    except (psutil.Error, OSError):
        return set()
    return {c.laddr.port for c in connections if c.status == psutil.CONN_LISTEN}


def tenant_key_prefix(tenant: str) -> str:
    """What a client of ``tenant`` puts in front of every key (nothing without a tenant)."""
    return f"{tenant}/" if tenant else ""


def scoped_pattern(tenant: str, pattern: str) -> str:
    """``pattern`` (a regular expression over keys) restricted to ``tenant``'s keys as stored."""
    if not tenant:
        return pattern
    # A tenant is [a-z0-9.-] (the settings' rule): only '.' means more than itself.
    prefix = tenant_key_prefix(tenant).replace(".", "\\.")
    if pattern.startswith("^"):
        return f"^{prefix}{pattern[1:]}"
    return f"^{prefix}.*(?:{pattern})"


def chunks(items: Sequence[T], size: int) -> list[Sequence[T]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


class _Answer:
    """What a :class:`_Lane` job came to, once :attr:`done` is set."""

    __slots__ = ("codes", "done", "error")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.codes: list[int] = []
        self.error: BaseException | None = None


class _Lane:
    """One daemon thread that runs a client's existence calls one at a time, so that a caller
    waits for a call with a deadline, and a call Mooncake never ends holds this thread only."""

    def __init__(self, name: str):
        self._name = name
        self._cond = threading.Condition()
        self._job: tuple[Callable[[], list[int]], _Answer] | None = None
        self._busy_since: float | None = None  # when the call inside started
        self._thread: threading.Thread | None = None
        self._closed = False

    def wedged(self, after_s: float) -> bool:
        """Whether a call has been inside for more than ``after_s``."""
        since = self._busy_since
        return since is not None and time.monotonic() - since > after_s

    @property
    def busy(self) -> bool:
        return self._busy_since is not None

    def call(self, job: Callable[[], list[int]], timeout_s: float) -> list[int] | None:
        """``job``'s codes; None when it has not returned within ``timeout_s`` (waiting for the
        call before it included): it may go on, holding this lane, until Mooncake ends it."""
        end = time.monotonic() + timeout_s
        answer = _Answer()
        with self._cond:
            while self._busy_since is not None or self._job is not None:
                left = end - time.monotonic()
                if left <= 0 or self._closed:
                    return None
                self._cond.wait(left)
            if self._closed:
                return None
            self._job = (job, answer)
            self._busy_since = time.monotonic()
            self._start()
            self._cond.notify_all()
        if not answer.done.wait(max(0.0, end - time.monotonic())):
            return None
        if answer.error is not None:
            raise answer.error
        return answer.codes

    def close(self) -> None:
        """Let the thread end (after the call inside, if any)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._job is None and not self._closed:
                    self._cond.wait()
                if self._job is None:
                    return
                job, answer = self._job
            try:
                answer.codes = job()
            except BaseException as error:  # handed to the caller, if it still waits
                answer.error = error
            finally:
                with self._cond:
                    self._job = None
                    self._busy_since = None
                    self._cond.notify_all()
                answer.done.set()


@dataclass
class _Shared:
    client: PoolClient
    users: int


class PoolClient:
    """One ``MooncakeDistributedStore`` with bounded, classified batch calls.

    Create it with :func:`open_client` (or share one with :func:`acquire_client`),
    which prepares the process's Mooncake environment first.
    """

    def __init__(
        self,
        settings: ConnectorSettings,
        *,
        global_segment_size: int | None = None,
        spare: bool = False,
        attach_later: bool = False,
    ):
        """Set up now; or, with ``attach_later``, when that fails, start out of the pool (every
        call a fast ``rpc_failed``, regions to register remembered) and join it in the
        background once the master serves (:mod:`kvpool.connector.pool_attach`)."""
        self.settings = settings
        self.batch_size = settings.batch_size
        self.tenant = settings.tenant
        self._key_prefix = tenant_key_prefix(settings.tenant)
        self._segment = settings.global_segment_size if global_segment_size is None else global_segment_size
        self._open = True
        self._store: Any = _NotAttached()
        self._put_config: Any = None
        self._own_endpoints: frozenset[str] = frozenset()
        self.holds_segment = False
        self.attached = False
        self._registered: set[tuple[int, int]] = set()
        self._pending_regions: set[tuple[int, int]] = set()  # registered while out of the pool
        self._attach_lock = threading.Lock()
        self._attacher: Attacher | None = None
        self._unreachable_until = 0.0
        self._failed_batches = 0
        self._refusal_logged = -REFUSAL_LOG_S
        self._kept_sessions_logged = -REFUSAL_LOG_S
        # Keys of the put sessions this client holds or is opening (a count per key: threads
        # may race for one), to tell a session in flight here from one left behind.
        self._sessions: Counter[str] = Counter()
        # Keys a removal of this client is removing now: reserving them waits for none, it
        # answers CODE_RESERVED_ELSEWHERE (the remover's save writes them next).
        self._removing: set[str] = set()
        self._sessions_lock = threading.Lock()
        # Calls inside Mooncake now; a close requested meanwhile waits for the last of them.
        self._state = threading.Lock()
        self._in_flight = 0
        self._close_pending = False
        # Existence calls run on a lane of their own, each waited for at most
        # ``exists_deadline_s``. While one is wedged (past it), checks go to a spare client
        # (a client of its own, contributing no memory: metadata calls only) on a second
        # lane: opened then, kept for the next wedge, closed with this client (Mooncake's
        # setup and close hold the GIL, close for up to its leader watch's 30 s under HA:
        # not while serving). A spare has no spare: a client has at most two existence
        # calls inside Mooncake at a time.
        self.exists_deadline_s = settings.store_timeout_s + EXISTS_GRACE_S
        self.wedged_exists = 0  # existence calls given up on past exists_deadline_s
        self._may_spare = not spare
        self._exists_lane = _Lane("kvpool-exists")
        self._spare_lane = _Lane("kvpool-exists-spare")
        self._spare: PoolClient | None = None
        self._spare_state = threading.Lock()
        self._spare_retry_at = 0.0  # after a failed setup, none before this (monotonic)
        if not attach_later:
            self._attach()
        elif not accepts_connections(settings.master_server_address) or not self.attach():
            logger.warning(
                "KVPoolConnector: the Mooncake master %s does not serve; serving without the pool "
                "and joining it once it serves",
                settings.master_server_address,
            )
            with unpinned():  # its connects and trial processes off vLLM's compute cores
                self._attacher = Attacher(settings, self.attach)

    # --- joining the pool -----------------------------------------------------
    def _attach(self) -> None:
        """Set up this client's Mooncake client and register the regions remembered so far;
        ``StoreUnavailable`` when either fails (nothing of it is kept then)."""
        settings, segment = self.settings, self._segment
        listening = _listening_ports() if segment > 0 else set()
        # The client's threads start here: off the cores vLLM pins its compute to.
        # (Loading Mooncake starts threads too.)
        with unpinned():
            from mooncake.store import MooncakeDistributedStore

            store = MooncakeDistributedStore()
            code = set_up(store, settings, segment, settings.local_buffer_size)
        if code != 0:
            raise StoreUnavailable(
                f"Mooncake setup failed with code {code} "
                f"(master_server_address={settings.master_server_address})"
            )
        registered: list[tuple[int, int]] = []
        for ptr, size in sorted(self._pending_regions):
            code = store.register_buffer(ptr, size)
            if code != 0:
                for done_ptr, _ in registered:
                    store.unregister_buffer(done_ptr)
                store.close()
                raise StoreUnavailable(f"register_buffer failed with code {code}")
            registered.append((ptr, size))
        self._registered.update(registered)
        self._pending_regions.clear()
        # A client that contributes memory keeps what it saves there when it can (Mooncake
        # falls back to other segments when it is full): its own hits then move by memcpy,
        # not over the network. Others read those objects as they read any store's.
        if segment > 0:
            from mooncake.store import ReplicateConfig

            self._put_config = ReplicateConfig()
            self._put_config.preferred_segment = store.get_hostname()
        # The transfer endpoint ("host:port") of this client's own segment is one of the ports
        # its setup started listening on, at its local_hostname: no other process can serve it.
        ports = _listening_ports() - listening if segment > 0 else set()
        self._own_endpoints = frozenset(f"{settings.local_hostname}:{port}" for port in ports)
        self.holds_segment = bool(self._own_endpoints)
        self._store = store
        self.attached = True  # last: a call that sees it sees all of the above

    def attach(self) -> bool:
        """Join the pool now if not yet (set up in-process: only once the master serves, as
        this holds the GIL); whether this client is in the pool."""
        with self._attach_lock:
            if self.attached or not self._open:
                return self.attached
            try:
                self._attach()
            except StoreUnavailable:
                logger.warning("KVPoolConnector: joining the pool failed", exc_info=True)
                return False
        logger.info("KVPoolConnector: joined the pool at %s", self.settings.master_server_address)
        return True

    # --- guards -----------------------------------------------------------
    def _scoped(self, keys: Sequence[str]) -> list[str]:
        """``keys`` as stored: behind the tenant's prefix when the client has a tenant."""
        prefix = self._key_prefix
        return [prefix + key for key in keys] if prefix else list(keys)

    def _call(self, fn: Callable[..., Sequence[T]], *args: Any) -> list[T]:
        with self.holding_segment():
            return list(fn(*args))

    @property
    def answering_from_spare(self) -> bool:
        """Whether existence checks go to the spare client now (one of this client's is wedged)."""
        return self._may_spare and self._exists_lane.wedged(self.exists_deadline_s)

    @property
    def unreachable(self) -> bool:
        """Whether this client is out of the pool, or a recent transfer found the master
        unreachable (then calls fail fast)."""
        return not self.attached or time.monotonic() < self._unreachable_until

    def _note_codes(self, codes: Sequence[int]) -> None:
        # Batches in a row whose every key failed its RPC mean the master is gone:
        # then, for a moment, fail at once instead of waiting out each call's RPC
        # timeout (seconds per batch), so requests compute at normal speed
        # meanwhile. One such batch alone (a partial failure) changes nothing.
        if not codes or not all(code in RPC_FAILURES for code in codes):
            self._failed_batches = 0
            return
        self._failed_batches += 1
        if self._failed_batches >= UNREACHABLE_AFTER_BATCHES:
            self._failed_batches = 0
            self._unreachable_until = time.monotonic() + UNREACHABLE_BACKOFF_S
            logger.warning(
                "Mooncake master unreachable; pool transfers fail fast for %.0f s", UNREACHABLE_BACKOFF_S
            )

    # --- batch API --------------------------------------------------------
    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Presence of each key; an error for a key counts as absent (:meth:`presence` says
        whether there was one)."""
        return self.presence(keys)[0]

    def presence(self, keys: Sequence[str]) -> tuple[list[bool], str | None]:
        """Presence of each key, and why the pool could not tell for some (None: it told for
        every key): ``timeout`` past the call's deadline or Mooncake's RPC timeout,
        ``rpc_failed`` for any other error. A key it could not tell about counts as absent.

        Metadata only, so one round trip per ``MAX_EXIST_KEYS`` keys (not per
        ``batch_size``, which bounds data transfers).

        A call waits at most :attr:`exists_deadline_s` (every key absent past it); while a
        call Mooncake did not end holds this client's existence lane, a spare client answers.
        """
        present: list[bool] = []
        if self.unreachable:
            return [False] * len(keys), Outcome.RPC_FAILED.value
        failure: str | None = None
        for part in chunks(keys, MAX_EXIST_KEYS):
            try:
                codes = self._exists_codes(self._scoped(part))
            except StoreUnavailable:
                raise
            except Exception:  # the RPC itself failed: nothing is known present
                logger.warning("batch_is_exist failed for %d keys", len(part), exc_info=True)
                codes = [CODE_RPC_FAILED] * len(part)
            present.extend(code == 1 for code in codes)
            if failure is None and any(code not in (0, 1) for code in codes):
                timed_out = CODE_RPC_TIMEOUT in codes
                failure = (Outcome.TIMEOUT if timed_out else Outcome.RPC_FAILED).value
        return present, failure

    def _exists_codes(self, scoped: list[str]) -> list[int]:
        """``batch_is_exist`` of ``scoped`` (keys as stored), from this client or, while an
        existence call of its is wedged, from the spare."""
        deadline_s = self.exists_deadline_s
        if self.answering_from_spare:
            codes = self._spare_lane.call(lambda: self._spare_exists(scoped), deadline_s)
            return [CODE_RPC_TIMEOUT] * len(scoped) if codes is None else codes
        with self._state:
            if not self._open:
                raise StoreUnavailable("Mooncake client is closed")
        codes = self._exists_lane.call(lambda: self._call(self._store.batch_is_exist, scoped), deadline_s)
        if codes is None:
            self.wedged_exists += 1
            logger.warning(
                "Mooncake existence check of %d keys still in flight after %.0f s: a miss; "
                "checks go to a spare client until it returns",
                len(scoped),
                deadline_s,
            )
            return [CODE_RPC_TIMEOUT] * len(scoped)
        return codes

    def _spare_exists(self, scoped: list[str]) -> list[int]:
        """On the spare lane: the spare's answer, the spare opened first when there is none
        (a fresh client finds the current leader; setup is bounded by the caller's wait)."""
        with self._spare_state:
            spare = self._spare
        if spare is None:
            with self._state:
                if not self._open:
                    raise StoreUnavailable("Mooncake client is closed")
            if time.monotonic() < self._spare_retry_at:
                return [CODE_RPC_FAILED] * len(scoped)
            try:
                settings = self.settings.model_copy(update={"local_buffer_size": SPARE_LOCAL_BUFFER})
                spare = PoolClient(settings, global_segment_size=0, spare=True)
            except StoreUnavailable:  # no master to set up with yet: misses, tried again later
                self._spare_retry_at = time.monotonic() + self.exists_deadline_s
                logger.warning("Mooncake spare client failed to set up", exc_info=True)
                return [CODE_RPC_FAILED] * len(scoped)
            with self._spare_state:
                self._spare = spare
            logger.warning("Mooncake existence checks answered by a spare client")
        try:
            return spare._call(spare._store.batch_is_exist, scoped)
        except StoreUnavailable:  # closed under this call, with this client
            return [CODE_RPC_FAILED] * len(scoped)

    def _close_spare(self) -> None:
        """Close the spare, if any (once its call in flight returns, if one is)."""
        with self._spare_state:
            spare, self._spare = self._spare, None
        if spare is not None:
            spare.close()

    def register(self, ptr: int, size: int) -> None:
        """Register a memory region once for zero-copy transfers (out of the pool: when the
        client joins it)."""
        with self._attach_lock:
            if not self.attached:
                self._pending_regions.add((ptr, size))
                return
        if (ptr, size) in self._registered:
            return
        code = self._call(lambda p, n: [self._store.register_buffer(p, n)], ptr, size)[0]
        if code != 0:
            raise StoreUnavailable(f"register_buffer failed with code {code}")
        self._registered.add((ptr, size))

    def unregister(self, ptr: int, size: int) -> None:
        """Forget a region registered with :meth:`register` (its memory is about to be freed)."""
        with self._attach_lock:
            if not self.attached:
                self._pending_regions.discard((ptr, size))
                return
        if (ptr, size) not in self._registered or not self._open:
            return
        self._registered.discard((ptr, size))
        try:
            self._call(lambda p: [self._store.unregister_buffer(p)], ptr)
        except Exception:  # the client is closing or gone: nothing is left to forget
            logger.debug("unregister_buffer failed", exc_info=True)

    def get_into(
        self, keys: Sequence[str], ptrs: Sequence[list[int]], sizes: Sequence[list[int]]
    ) -> list[int]:
        """Read each key into its scatter list; per-key codes (bytes read when >= 0)."""
        return self._batched(self._store.batch_get_into_multi_buffers, keys, ptrs, sizes)

    def _batched(
        self,
        fn: Callable[..., list[int]],
        keys: Sequence[str],
        ptrs: Sequence[list[int]],
        sizes: Sequence[list[int]],
    ) -> list[int]:
        codes: list[int] = []
        for start, end in self._spans(sizes):
            part = self._scoped(keys[start:end])
            if self.unreachable:
                codes.extend([CODE_RPC_FAILED] * len(part))
                continue
            try:
                part_codes = self._call(fn, part, list(ptrs[start:end]), list(sizes[start:end]))
            except StoreUnavailable:
                part_codes = [CODE_RPC_FAILED] * len(part)
            except Exception:
                logger.warning("Mooncake batch call failed for %d keys", len(part), exc_info=True)
                part_codes = [CODE_RPC_FAILED] * len(part)
            if len(part_codes) != len(part):  # no code for some key: none of them counts as moved
                logger.warning("Mooncake answered %d codes for %d keys", len(part_codes), len(part))
                part_codes = [CODE_RPC_FAILED] * len(part)
            self._note_codes(part_codes)
            codes.extend(part_codes)
        return codes

    def _spans(self, sizes: Sequence[list[int]]) -> list[tuple[int, int]]:
        """[start, end) runs of keys: at most ``batch_size`` keys and ``MAX_BATCH_ENTRIES`` buffers a call."""
        spans: list[tuple[int, int]] = []
        start = entries = 0
        for index, scatter in enumerate(sizes):
            if index > start and (
                index - start >= self.batch_size or entries + len(scatter) > MAX_BATCH_ENTRIES
            ):
                spans.append((start, index))
                start, entries = index, 0
            entries += len(scatter)
        if start < len(sizes):
            spans.append((start, len(sizes)))
        return spans

    # --- put sessions: reserve, write, then publish or revoke -----------------
    def reserve(self, keys: Sequence[str], sizes: Sequence[int]) -> list[int]:
        """Reserve an object of ``sizes[i]`` bytes under each key; 0 when reserved.

        A reserved object is invisible to lookups and loads until :meth:`publish`;
        :meth:`revoke` drops it. A key whose object is published answers
        ``CODE_OBJECT_EXISTS``; one another writer reserved and has not published answers
        ``CODE_RESERVED_ELSEWHERE`` (Mooncake answers both alike: presence tells them apart).
        """
        codes = self._open_sessions(keys, sizes)
        held = [i for i, code in enumerate(codes) if code == CODE_SESSION_HELD]
        if held:
            with self._sessions_lock:
                in_flight = {i for i in held if self._sessions[keys[i]] > 0}
            for i in in_flight:  # another save here holds it: as another writer's
                codes[i] = CODE_RESERVED_ELSEWHERE
            left_behind = [i for i in held if i not in in_flight]
            if left_behind:
                # Sessions a save left behind: revoked (nothing of them is visible), then
                # reserved again, once.
                revoked = self.revoke([keys[i] for i in left_behind], tracked=False)
                again = self._open_sessions([keys[i] for i in left_behind], [sizes[i] for i in left_behind])
                kept = []
                for i, code, revoke_code in zip(left_behind, again, revoked, strict=True):
                    codes[i] = code
                    if code == CODE_SESSION_HELD:
                        # Mooncake keeps a session whose revoke its master refused (a store
                        # restarted under the write), for a retry: the key stays reserved by
                        # it, as by another writer, until the master lets it go.
                        codes[i] = CODE_RESERVED_ELSEWHERE
                        kept.append(revoke_code)
                if kept:
                    self._note_kept_sessions(kept)
        taken = [i for i, code in enumerate(codes) if code == CODE_OBJECT_EXISTS]
        if taken:
            published = self.exists([keys[i] for i in taken])
            for i, present in zip(taken, published):
                if not present:
                    codes[i] = CODE_RESERVED_ELSEWHERE
        self._note_refusals(codes)
        return codes

    def _open_sessions(self, keys: Sequence[str], sizes: Sequence[int]) -> list[int]:
        """``batch_put_session_start`` of ``keys``, each counted as a session of this client
        while the call runs, and after it when reserved; a key this client is removing now
        answers ``CODE_RESERVED_ELSEWHERE`` without a call."""
        with self._sessions_lock:
            barred = {i for i, key in enumerate(keys) if key in self._removing} if self._removing else None
            self._sessions.update(keys if not barred else (k for i, k in enumerate(keys) if i not in barred))
        if barred:
            codes = [CODE_RESERVED_ELSEWHERE] * len(keys)
            asked = [i for i in range(len(keys)) if i not in barred]
            reserved = self._open_sessions_now([keys[i] for i in asked], [sizes[i] for i in asked])
            for i, code in zip(asked, reserved):
                codes[i] = code
            return codes
        return self._open_sessions_now(keys, sizes)

    def _open_sessions_now(self, keys: Sequence[str], sizes: Sequence[int]) -> list[int]:
        """``batch_put_session_start`` of ``keys`` (already counted as sessions of this client);
        the count of each key Mooncake did not reserve is dropped."""
        config = () if self._put_config is None else (self._put_config,)
        codes = self._session_call(self._store.batch_put_session_start, keys, list(sizes), *config)
        self._end_sessions([key for key, code in zip(keys, codes) if code != 0])
        return codes

    def _end_sessions(self, keys: Sequence[str]) -> None:
        with self._sessions_lock:
            for key in keys:
                self._sessions[key] -= 1
                if self._sessions[key] <= 0:
                    del self._sessions[key]

    def _note_kept_sessions(self, revoke_codes: Sequence[int]) -> None:
        """Log (at most once a ``REFUSAL_LOG_S``) put sessions left behind that Mooncake kept."""
        now = time.monotonic()
        if now - self._kept_sessions_logged < REFUSAL_LOG_S:
            return
        self._kept_sessions_logged = now
        logger.warning(
            "Mooncake kept %d put session(s) a save left behind (revoke answered %s): their keys "
            "count as in flight until its master lets them go",
            len(revoke_codes),
            sorted(set(revoke_codes)),
        )

    def _note_refusals(self, codes: Sequence[int]) -> None:
        """Log (at most once a ``REFUSAL_LOG_S``) the reservations Mooncake's tenant admission refused."""
        refused = sum(code in TENANT_REFUSALS for code in codes)
        if not refused:
            return
        now = time.monotonic()
        if now - self._refusal_logged < REFUSAL_LOG_S:
            return
        self._refusal_logged = now
        reason = classify(next(code for code in codes if code in TENANT_REFUSALS)).value
        logger.warning(
            "Mooncake refused %d of %d reservation(s) of tenant %r (%s): those blocks are not stored",
            refused,
            len(codes),
            self.tenant,
            reason,
        )

    def write(
        self,
        keys: Sequence[str],
        ptrs: Sequence[list[int]],
        sizes: Sequence[list[int]],
        offsets: Sequence[list[int]],
    ) -> list[int]:
        """Write each reserved key's buffers at ``offsets``; per-key codes (bytes written when >= 0)."""
        return self._session_call(
            self._store.batch_put_from_multi_buffer_ranges,
            keys,
            [list(p) for p in ptrs],
            [list(s) for s in sizes],
            [list(o) for o in offsets],
        )

    def publish(self, keys: Sequence[str]) -> list[int]:
        """Make written reservations visible; 0 per key when published. A key that fails to
        publish is revoked: its session does not linger in this client (after a master
        failover, one made on the old leader would refuse every later reservation of its key)."""
        codes = self._session_call(self._store.batch_put_session_end, keys)
        failed = [key for key, code in zip(keys, codes) if code != 0]
        self._end_sessions([key for key, code in zip(keys, codes) if code == 0])
        if failed:
            self.revoke(failed)
        return codes

    def revoke(self, keys: Sequence[str], *, tracked: bool = True) -> list[int]:
        """Drop reservations: nothing of them is ever visible (``tracked``: sessions this
        client counted as its own)."""
        codes = self._session_call(self._store.batch_put_session_revoke, keys)
        if tracked:
            self._end_sessions(keys)
        return codes

    def _session_call(self, fn: Callable[..., list[int]], keys: Sequence[str], *args: Any) -> list[int]:
        if not keys:
            return []
        if self.unreachable:
            return [CODE_RPC_FAILED] * len(keys)
        try:
            codes = self._call(fn, self._scoped(keys), *args)
        except StoreUnavailable:
            codes = [CODE_RPC_FAILED] * len(keys)
        except Exception:
            logger.warning("Mooncake put-session call failed for %d keys", len(keys), exc_info=True)
            codes = [CODE_RPC_FAILED] * len(keys)
        if len(codes) != len(keys):  # a client-side rejection of the whole call
            codes = [CODE_RPC_FAILED] * len(keys)
        self._note_codes(codes)
        return codes

    def remove(self, keys: Sequence[str]) -> list[int]:
        """Remove each key's object; per key 0 when removed. A key a save of this client is
        writing (a put session held here), or that another removal here is removing, is left
        to it: ``CODE_KEPT_WRITING``. While the removal runs, reservations of its keys here
        answer ``CODE_RESERVED_ELSEWHERE``. Never raises: a call that fails (the client closed
        or out of the pool included) is ``CODE_RPC_FAILED`` for its keys, which stay."""
        with self._sessions_lock:
            kept = {k for k in keys if self._sessions.get(k, 0) > 0 or k in self._removing}
            mine = [k for k in dict.fromkeys(keys) if k not in kept]
            self._removing.update(mine)
        try:
            removed: dict[str, int] = {}
            for part in chunks(mine, self.batch_size):
                try:
                    codes = self._call(self._store.batch_remove, self._scoped(part), True)
                except StoreUnavailable:
                    codes = []
                except Exception:
                    logger.warning("Mooncake remove call failed for %d keys", len(part), exc_info=True)
                    codes = []
                if len(codes) == len(part):
                    removed.update(zip(part, codes))
        finally:
            with self._sessions_lock:
                self._removing.difference_update(mine)
        return [CODE_KEPT_WRITING if k in kept else removed.get(k, CODE_RPC_FAILED) for k in keys]

    def remove_matching(self, pattern: str) -> int:
        """Remove every object whose key matches ``pattern`` (a regular expression) and that no
        read holds (Mooncake keeps an object a lookup or read leased); the count removed, or a
        negative Mooncake code."""
        scoped = scoped_pattern(self.tenant, pattern)
        return int(self._call(lambda p: [self._store.remove_by_regex(p)], scoped)[0])

    def own_objects(self, keys: Sequence[str]) -> list[tuple[int, int] | None]:
        """Per key, ``(address, size)`` of its object when a complete copy of it is in this
        client's own segment (memory of this process), else None; one call to the master.

        The answer is a snapshot: the object may be evicted and its memory reused after it,
        so a reader checks what it copied (:meth:`holding_segment` keeps the memory mapped).
        """
        if not self.holds_segment or not keys or self.unreachable:
            return [None] * len(keys)
        from mooncake.store import ReplicaStatus

        scoped = self._scoped(keys)
        try:
            found = self._call(lambda k: [self._store.batch_get_replica_desc(k)], scoped)[0]
        except StoreUnavailable:
            return [None] * len(keys)
        except Exception:
            logger.warning("batch_get_replica_desc failed for %d keys", len(keys), exc_info=True)
            return [None] * len(keys)
        out: list[tuple[int, int] | None] = []
        for key in scoped:
            at = None
            for replica in found.get(key, ()):
                if replica.status != ReplicaStatus.COMPLETE or not replica.is_memory_replica():
                    continue
                where = replica.get_memory_descriptor().buffer_descriptor
                if where.transport_endpoint in self._own_endpoints:
                    at = (int(where.buffer_address), int(where.size))
                    break
            out.append(at)
        return out

    @contextmanager
    def holding_segment(self) -> Iterator[None]:
        """While inside, this client does not close (its segment stays mapped); raises
        ``StoreUnavailable`` when it is closed already."""
        with self._state:
            if not self._open:
                raise StoreUnavailable("Mooncake client is closed")
            self._in_flight += 1
        try:
            yield
        finally:
            with self._state:
                self._in_flight -= 1
                last = self._close_pending and self._in_flight == 0
                if last:
                    self._close_pending = False
            if last:
                self._close_now()

    def size_of(self, key: str) -> int:
        """The stored size of ``key``'s object; negative when absent or unknown."""
        try:
            return int(self._call(lambda k: [self._store.get_size(k)], self._key_prefix + key)[0])
        except StoreUnavailable:
            raise
        except Exception:
            logger.warning("get_size failed", exc_info=True)
            return -1

    def close(self) -> None:
        """Refuse new calls; close now, or when the last call still inside Mooncake returns.

        A call the connector gave up on (a frozen store) may still be in flight at
        shutdown: closing under it would free what it uses.
        """
        if self._attacher is not None:
            self._attacher.stop()
        # After a setup in progress: it joins, then closes here.
        with self._attach_lock, self._state:
            if not self._open:
                return
            self._open = False
        self._exists_lane.close()
        self._spare_lane.close()
        self._close_spare()
        with self._state:
            if self._in_flight:
                self._close_pending = True
                logger.warning("Mooncake client: %d call(s) in flight; it closes after them", self._in_flight)
                return
        self._close_now()

    def _close_now(self) -> None:
        if not self.attached:
            return
        for ptr, _size in self._registered:
            try:
                self._store.unregister_buffer(ptr)
            except Exception:  # closing anyway
                logger.debug("unregister_buffer failed", exc_info=True)
        self._registered.clear()
        self._store.close()


def open_client(
    settings: ConnectorSettings, *, global_segment_size: int | None = None, attach_later: bool = False
) -> PoolClient:
    """A new client of ``settings``' pool, set up after this process's Mooncake environment.

    ``global_segment_size`` overrides the memory the client contributes (0: none);
    ``attach_later``: see :class:`PoolClient`.
    """
    configure_client_process(
        settings.tcp_bind_address, store_timeout_s=settings.store_timeout_s, cluster_id=settings.cluster_id
    )
    return PoolClient(settings, global_segment_size=global_segment_size, attach_later=attach_later)


_shared_lock = threading.Lock()
_shared: dict[tuple[str, ...], _Shared] = {}


def _identity(settings: ConnectorSettings) -> tuple[str, ...]:
    return (
        settings.master_server_address,
        settings.cluster_id,
        settings.metadata_server,
        settings.protocol,
        settings.local_hostname,
        settings.tcp_bind_address,
        settings.tenant,
    )


def acquire_client(
    settings: ConnectorSettings, *, global_segment_size: int | None = None, attach_later: bool = False
) -> PoolClient:
    """The process's client for ``settings``' pool, created on first use.

    The scheduler and worker roles of one process share it; the first role to
    ask decides the segment it contributes (vLLM creates the worker first) and
    whether it may join the pool later (``attach_later``).
    """
    identity = _identity(settings)
    with _shared_lock:
        entry = _shared.get(identity)
        if entry is None:
            client = open_client(settings, global_segment_size=global_segment_size, attach_later=attach_later)
            entry = _Shared(client, 0)
            _shared[identity] = entry
        entry.users += 1
        return entry.client


def release_client(client: PoolClient) -> None:
    """Drop one user of ``client``; the last one closes it."""
    with _shared_lock:
        for identity, entry in list(_shared.items()):
            if entry.client is client:
                entry.users -= 1
                if entry.users <= 0:
                    del _shared[identity]
                    client.close()
                return
    client.close()
