"""The environment variables Mooncake reads, and the values this project gives them.

Mooncake's store client and transfer engine take part of their configuration
from the environment of the process they run in. The project sets them in two
ways only:

* a process that sets up a Mooncake client calls :func:`configure_client_process`
  first (``kvpool.connector.pool_client.open_client`` does);
* a process the project starts (a store, an engine) is given :func:`client_env`
  in the environment it is started with.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

#: Setup attempts of a store client before it reports failure.
SETUP_RETRIES = "MC_STORE_CLIENT_SETUP_RETRIES"
#: The address the transfer engine publishes for peers to reach it, read when a client is
#: set up. Mooncake uses it with a metadata server; with ``P2PHANDSHAKE`` it publishes
#: ``local_hostname``. Either way its listening sockets accept on every interface.
TCP_BIND_ADDRESS = "MC_TCP_BIND_ADDRESS"
#: Mooncake's timeout of one RPC to the master (milliseconds; Mooncake's default: 30 s).
RPC_TIMEOUT_MS = "MC_RPC_TIMEOUT_MS"
#: Mooncake's TCP transport: seconds without progress, or without a status frame, before a
#: transfer's connection is dropped and the transfer fails (Mooncake's default: 30 s each).
TCP_PROGRESS_TIMEOUT_SEC = "MC_TCP_PROGRESS_TIMEOUT_SEC"
TCP_STATUS_TIMEOUT_SEC = "MC_TCP_STATUS_TIMEOUT_SEC"
#: The cluster id of an HA pool's masters, which names their leader election in etcd
#: (``mooncake-store/<id>/master_view``); a client finds its leader under it. The masters
#: take it as ``--cluster_id``. Mooncake's default when unset: ``mooncake_cluster``.
CLUSTER_ID = "MC_STORE_CLUSTER_ID"
#: Mooncake's log level (glog severities: INFO, WARNING, ERROR).
LOG_LEVEL = "MC_LOG_LEVEL"
#: The address vLLM's in-tree Mooncake connector serves on.
REQUESTER_LOCAL_HOSTNAME = "MOONCAKE_REQUESTER_LOCAL_HOSTNAME"
#: A Mooncake config JSON file (read by the connector, and by vLLM's in-tree connector).
CONFIG_PATH_ENV = "MOONCAKE_CONFIG_PATH"

#: Setup attempts the project's clients make: a master that is not there fails fast.
CLIENT_SETUP_RETRIES = "3"
#: Mooncake logs errors only (benchmarks print tables, not logs).
ERRORS_ONLY = "ERROR"


def client_env(bind_address: str, cluster_id: str = "") -> dict[str, str]:
    """The variables of a Mooncake client process, for the environment a child starts with
    (``cluster_id``: an HA pool's, when it has one)."""
    env = {SETUP_RETRIES: CLIENT_SETUP_RETRIES, TCP_BIND_ADDRESS: bind_address}
    if cluster_id:
        env[CLUSTER_ID] = cluster_id
    return env


def store_timeout_env(store_timeout_s: int) -> dict[str, str]:
    """Mooncake's own timeouts, all set to ``store_timeout_s`` (the connector's ``store_timeout_s``).

    They bound how long one call to a frozen master or store stays stuck: an RPC
    fails after it, a TCP transfer that makes no progress for it drops its
    connection and fails (so it writes no more bytes).
    """
    return {
        RPC_TIMEOUT_MS: str(store_timeout_s * 1000),
        TCP_PROGRESS_TIMEOUT_SEC: str(store_timeout_s),
        TCP_STATUS_TIMEOUT_SEC: str(store_timeout_s),
    }


def configure_client_process(
    bind_address: str,
    environ: MutableMapping[str, str] | None = None,
    *,
    store_timeout_s: int | None = None,
    cluster_id: str = "",
) -> None:
    """Set this process's Mooncake client variables; call it before a Mooncake client is set up.

    A setup-retry count already set is kept. The bind address (and, when given,
    the timeouts of :func:`store_timeout_env` and the HA cluster id) are always set: they
    are connector settings, and Mooncake reads them when a client is set up.
    """
    target = os.environ if environ is None else environ
    target.setdefault(SETUP_RETRIES, CLIENT_SETUP_RETRIES)
    target[TCP_BIND_ADDRESS] = bind_address
    if cluster_id:
        target[CLUSTER_ID] = cluster_id
    if store_timeout_s is not None:
        target.update(store_timeout_env(store_timeout_s))
