"""``kvpool-local-pool``: a Mooncake pool on this machine's loopback for vLLM servers to share.

It starts a Mooncake master and one store process (:class:`~kvpool.connector.local.pool.LocalPool`),
waits until the master serves and the store's memory is mounted, prints the
``--kv-transfer-config`` JSON for vLLM on one line of standard output, and runs
until Ctrl-C (SIGINT) or SIGTERM, when it stops the store, then the master. If
either dies meanwhile, it stops the other and exits with status 1.

Everything listens on 127.0.0.1; the master's metrics port also serves Mooncake's
unauthenticated admin API, so the pool is for this machine only.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from collections.abc import Sequence
from types import FrameType
from typing import Any

from kvpool.connector.contract.settings import ConnectorSettings, SettingsError, parse_size
from kvpool.connector.local.pool import LocalPool

DEFAULT_SEGMENT = "1GB"
KV_ROLES = ("kv_both", "kv_producer", "kv_consumer")
POLL_S = 0.5


def transfer_config(master_address: str, cache_prefix: str, kv_role: str) -> dict[str, Any]:
    """vLLM's ``--kv-transfer-config`` for the pool at ``master_address``: only settings that
    differ from the connector's defaults in ``kv_connector_extra_config``."""
    settings = ConnectorSettings.parse(
        {"master_server_address": master_address, "cache_prefix": cache_prefix}
    )
    config = settings.kv_transfer_config(kv_role)
    config["kv_connector_extra_config"] = settings.model_dump(mode="json", exclude_defaults=True)
    return config


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvpool-local-pool",
        description="Run a Mooncake master and store on 127.0.0.1 and print the --kv-transfer-config "
        "JSON that points vLLM's KVPoolConnector at them. Stops both on Ctrl-C or SIGTERM.",
    )
    parser.add_argument(
        "--segment-size",
        default=DEFAULT_SEGMENT,
        help=f"memory the store contributes to the pool, e.g. 4GB (default {DEFAULT_SEGMENT})",
    )
    parser.add_argument("--rpc-port", type=int, default=0, help="master RPC port (default: a free port)")
    parser.add_argument(
        "--metrics-port", type=int, default=0, help="master metrics port (default: a free port)"
    )
    parser.add_argument("--cache-prefix", default="kvpool", help="namespace of every key (default kvpool)")
    parser.add_argument(
        "--kv-role", choices=KV_ROLES, default="kv_both", help="vLLM's kv_role (default kv_both)"
    )
    return parser


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Reject bad arguments before anything starts, naming the option and the rule."""
    try:
        if parse_size(args.segment_size) < (1 << 20):
            parser.error("--segment-size: at least 1MB, or no block fits")
    except ValueError as exc:
        parser.error(f"--segment-size: {exc}")
    for option, port in (("--rpc-port", args.rpc_port), ("--metrics-port", args.metrics_port)):
        if not 0 <= port <= 65535:
            parser.error(f"{option}: a TCP port is 1-65535 (0: a free one)")
    try:
        transfer_config("127.0.0.1:1", args.cache_prefix, args.kv_role)
    except SettingsError as exc:
        parser.error(f"--cache-prefix: {exc.problems.get('cache_prefix', exc)}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    _check(parser, args)

    stop = threading.Event()

    def request_stop(signum: int, frame: FrameType | None) -> None:
        stop.set()

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, request_stop)

    pool = LocalPool(segment_size=args.segment_size, rpc_port=args.rpc_port, metrics_port=args.metrics_port)
    try:
        try:
            pool.start()
        except (OSError, RuntimeError, TimeoutError) as exc:
            print(f"kvpool-local-pool: the pool did not start: {exc}", file=sys.stderr)
            return 1
        assert pool.master is not None and pool.store is not None
        config = transfer_config(pool.address, args.cache_prefix, args.kv_role)
        print(json.dumps(config, separators=(",", ":")), flush=True)
        print(
            f"kvpool-local-pool: master {pool.address} (metrics {pool.master.metrics_url}), store "
            f"{args.segment_size}; logs in {pool.master.log_dir} and {pool.store.log_dir}.\n"
            "Pass the JSON above to vLLM as --kv-transfer-config '<json>'. Ctrl-C stops the pool.",
            file=sys.stderr,
            flush=True,
        )
        while not stop.wait(POLL_S):
            exited = pool.exited()
            if exited:
                print(f"kvpool-local-pool: exited unexpectedly: {', '.join(exited)}", file=sys.stderr)
                return 1
        print("kvpool-local-pool: stopping", file=sys.stderr, flush=True)
        return 0
    finally:
        pool.stop()


if __name__ == "__main__":
    sys.exit(main())
