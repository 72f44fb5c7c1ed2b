"""Joining the pool later: an engine whose master is down when it starts serves without the
pool, and joins it once the master serves.

Mooncake's ``setup`` holds the GIL for its whole attempt (about 13 s against a master that
does not answer, with the connector's timeouts), so a serving engine never tries one
in-process on a guess. Each attempt asks first, without holding the GIL:

1. whether the master's address accepts a TCP connection (for HA, one of etcd's);
2. whether a setup succeeds in a short-lived child process
   (``python -m kvpool.connector.pool_attach``), killed by its PID past its deadline;

and only then sets up in-process, which takes milliseconds with a master that serves.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, NoReturn

from kvpool.connector.contract.settings import ConnectorSettings
from kvpool.connector.observability.logs import get_logger

logger = get_logger(__name__)

#: How often an engine out of the pool tries to join it.
ATTACH_INTERVAL_S = 5.0
#: How long a TCP connect to the master's address may take.
CONNECT_TIMEOUT_S = 1.0
#: How often the attempts still failing are logged.
STILL_OUT_LOG_S = 60.0
#: The transfer buffer of the child's trial client (it moves nothing).
TRIAL_LOCAL_BUFFER = 1 << 20
ETCD_SCHEME = "etcd://"


def endpoints(master_server_address: str) -> list[tuple[str, int]]:
    """The (host, port) pairs behind a ``master_server_address``: the master's, or for
    ``etcd://h:p[,h:p...]`` etcd's."""
    address = master_server_address.strip()
    hosts = address[len(ETCD_SCHEME) :].split(",") if address.startswith(ETCD_SCHEME) else [address]
    out = []
    for host_port in hosts:
        host, sep, port = host_port.strip().rpartition(":")
        if sep and port.isdigit():
            out.append((host.strip("[]"), int(port)))
    return out


def accepts_connections(master_server_address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> bool:
    """Whether any endpoint of the address accepts a TCP connection (without holding the GIL)."""
    for host, port in endpoints(master_server_address):
        try:
            with socket.create_connection((host, port), timeout=timeout_s):
                return True
        except OSError:
            continue
    return False


def trial_setup_deadline_s(settings: ConnectorSettings) -> float:
    """How long the child's setup may take: past Mooncake's own RPC timeout and retries."""
    return 3.0 * settings.store_timeout_s + 10.0


def set_up(store: Any, settings: ConnectorSettings, segment: int, local_buffer_size: int) -> int:
    """``store.setup`` (a ``MooncakeDistributedStore``) for ``settings``' pool; Mooncake's code."""
    tenant = {"tenant_id": settings.tenant} if settings.tenant else {}
    return int(
        store.setup(
            settings.local_hostname,
            settings.metadata_server,
            segment,
            local_buffer_size,
            settings.protocol,
            settings.device_name,
            settings.master_server_address,
            **tenant,
        )
    )


def sets_up_in_a_child(settings: ConnectorSettings, deadline_s: float) -> bool:
    """Whether a client of ``settings`` (contributing nothing) sets up in a child process
    within ``deadline_s``; the child is killed past it. This process's Mooncake variables
    (its bind address, its timeouts) are the child's."""
    child = subprocess.Popen(
        [sys.executable, "-m", __name__, settings.model_dump_json()],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        return child.wait(timeout=deadline_s) == 0
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
        return False


class Attacher:
    """A daemon thread that calls ``attach`` once the master serves (asked as above), every
    :data:`ATTACH_INTERVAL_S`, until it returns True or :meth:`stop` is called."""

    NO_CONNECTION = "no connection"
    TRIAL_FAILED = "a trial client did not set up"
    SETUP_FAILED = "the setup failed"

    def __init__(
        self,
        settings: ConnectorSettings,
        attach: Callable[[], bool],
        interval_s: float = ATTACH_INTERVAL_S,
    ) -> None:
        self._settings = settings
        self._attach = attach
        self._interval_s = interval_s
        self._stopped = threading.Event()
        self._started = time.monotonic()
        self.failures: Counter[str] = Counter()  # the attempts that failed, by why
        self._thread = threading.Thread(target=self._run, name="kvpool-attach", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()

    def _run(self) -> None:
        address = self._settings.master_server_address
        logged = time.monotonic()
        while not self._stopped.wait(self._interval_s):
            why = self._try()
            if why is None:
                return
            self.failures[why] += 1
            now = time.monotonic()
            if now - logged >= STILL_OUT_LOG_S:
                logged = now
                logger.warning(
                    "KVPoolConnector: still out of the pool after %.0f s (master %s: %s)",
                    now - self._started,
                    address,
                    why,
                )

    def _try(self) -> str | None:
        """None once attached (or stopped); else why not."""
        if not accepts_connections(self._settings.master_server_address):
            return self.NO_CONNECTION
        if self._stopped.is_set():
            return None
        if not sets_up_in_a_child(self._settings, trial_setup_deadline_s(self._settings)):
            return self.TRIAL_FAILED
        if self._stopped.is_set() or self._attach():
            return None
        return self.SETUP_FAILED


def _trial_and_exit(settings: ConnectorSettings) -> NoReturn:
    """In the child: one setup of a client that contributes nothing, then exit (0 if it
    succeeded) with the client never closed nor freed: Mooncake tears down a client of an HA
    master (``etcd://``) only after its leader watch's current wait ends (up to 30 s)."""
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    code = set_up(store, settings, 0, TRIAL_LOCAL_BUFFER)
    os._exit(0 if code == 0 else 1)  # `store` still referenced: no teardown runs


if __name__ == "__main__":
    _trial_and_exit(ConnectorSettings.model_validate_json(sys.argv[1]))
