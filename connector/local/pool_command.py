"""``kvpool-local-pool``: a Mooncake pool on this machine's loopback for vLLM servers to share.

It starts a Mooncake master and one store process (:class:`~kvpool.connector.local.pool.LocalPool`),
waits until the master serves and the store's memory is mounted, prints the
``--kv-transfer-config`` JSON for vLLM on one line of standard output, and runs
until Ctrl-C (SIGINT) or SIGTERM, when it stops the store, then the master. If
either dies meanwhile, it stops the other and exits with status 1. A stop while the
pool starts stops what has started, and prints no JSON. If it is killed (SIGKILL, the OOM
killer), their watchdogs (:mod:`~kvpool.connector.local.watchdog`) kill them.

With ``--disk-capacity`` the store has a local disk tier (Mooncake's SSD offload in a
directory of its own under ``--disk-dir``, removed when the pool stops). With ``--tenant
NAME=QUOTA`` (repeatable) the master admits writes of those tenants only, each within its
quota (cut in proportion when they add up to more than the store's memory), and a JSON
line is printed for each tenant, in the order given (docs/tenancy.md).

The master and the store's RPC port listen on 127.0.0.1; the store's Mooncake transfer engine
also listens on every interface (no Mooncake setting narrows it), and the master's metrics
port serves Mooncake's unauthenticated admin API (tenant quotas included): the pool is for
this machine only, on one whose ports other hosts cannot reach.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvpool.connector.contract.settings import ConnectorSettings, SettingsError, parse_size
from kvpool.connector.local.disk_tier import EVICTION_POLICIES, DiskTier
from kvpool.connector.local.pool import LOOPBACK, LocalPool
from kvpool.connector.local.ports import listenable
from kvpool.connector.local.stopping import Stopped, raise_on_stop_signals

DEFAULT_SEGMENT = "1GB"
#: The least memory Mooncake's store mounts (its client refuses less, and exits).
MIN_SEGMENT = 16 << 20
KV_ROLES = ("kv_both", "kv_producer", "kv_consumer")
POLL_S = 0.5
#: The option that sets each ``DiskTier`` field its errors name.
DISK_OPTIONS = {
    "capacity": "--disk-capacity",
    "parent": "--disk-dir",
    "key_limit": "--disk-key-limit",
    "eviction": "--disk-eviction",
    "watermarks": "--disk-low-watermark, --disk-high-watermark",
}
#: The ``DiskTier`` field each of the tier's tuning options sets (its default when not given).
DISK_FIELDS = {
    "disk_key_limit": "key_limit",
    "disk_eviction": "eviction",
    "disk_high_watermark": "high_watermark",
    "disk_low_watermark": "low_watermark",
}
DISK_DEFAULTS = {f.name: f.default for f in dataclasses.fields(DiskTier)}


def transfer_config(master_address: str, cache_prefix: str, kv_role: str, tenant: str = "") -> dict[str, Any]:
    """vLLM's ``--kv-transfer-config`` for the pool at ``master_address``: only settings that
    differ from the connector's defaults in ``kv_connector_extra_config``."""
    settings = ConnectorSettings.parse(
        {"master_server_address": master_address, "cache_prefix": cache_prefix, "tenant": tenant}
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
        help=f"memory the store contributes to the pool, e.g. 4GB; at least 16MB (default {DEFAULT_SEGMENT})",
    )
    parser.add_argument("--rpc-port", type=int, default=0, help="master RPC port (default: a free port)")
    parser.add_argument(
        "--metrics-port", type=int, default=0, help="master metrics port (default: a free port)"
    )
    parser.add_argument("--cache-prefix", default="kvpool", help="namespace of every key (default kvpool)")
    parser.add_argument(
        "--kv-role", choices=KV_ROLES, default="kv_both", help="vLLM's kv_role (default kv_both)"
    )
    tenancy = parser.add_argument_group("tenants (Mooncake's multi-tenant admission)")
    tenancy.add_argument(
        "--tenant",
        action="append",
        default=[],
        metavar="NAME=QUOTA",
        help="a tenant and its quota, e.g. team-a=2GB (repeatable; the master then admits writes of "
        "these tenants only; a JSON line for each)",
    )
    disk = parser.add_argument_group("disk tier (Mooncake's SSD offload under the store's memory)")
    disk.add_argument("--disk-capacity", default="", help="the tier's size, e.g. 20GB (default: no tier)")
    disk.add_argument(
        "--disk-dir", default="", help="where the tier's own directory is made (default: the temp dir)"
    )
    # These need --disk-capacity; None: not given, DiskTier's default.
    for option, kind, text in (
        ("--disk-key-limit", int, "most objects on disk"),
        ("--disk-high-watermark", float, "use (of the capacity) that starts eviction"),
        ("--disk-low-watermark", float, "use eviction brings it down to"),
    ):
        default = DISK_DEFAULTS[DISK_FIELDS[option[2:].replace("-", "_")]]
        disk.add_argument(option, type=kind, help=f"{text} (default {default})")
    disk.add_argument(
        "--disk-eviction",
        choices=EVICTION_POLICIES,
        help=f"which objects leave a full tier (default {DISK_DEFAULTS['eviction']})",
    )
    return parser


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Reject bad arguments before anything starts, naming the option and the rule."""
    try:
        if parse_size(args.segment_size) < MIN_SEGMENT:
            parser.error("--segment-size: at least 16MB (the least Mooncake's store mounts)")
    except ValueError as exc:
        parser.error(f"--segment-size: {exc}")
    for option, port in (("--rpc-port", args.rpc_port), ("--metrics-port", args.metrics_port)):
        if not 0 <= port <= 65535:
            parser.error(f"{option}: a TCP port is 1-65535 (0: a free one)")
    if args.rpc_port and args.rpc_port == args.metrics_port:
        parser.error("--metrics-port: not the --rpc-port (the master listens on both)")
    for option, port in (("--rpc-port", args.rpc_port), ("--metrics-port", args.metrics_port)):
        if port and not listenable(port):  # as the master binds it
            parser.error(f"{option}: {port} is in use on {LOOPBACK}")
    try:
        transfer_config("127.0.0.1:1", args.cache_prefix, args.kv_role)
    except SettingsError as exc:
        parser.error(f"--cache-prefix: {exc.problems.get('cache_prefix', exc)}")
    args.tenant_quotas = _tenant_quotas(parser, args.tenant)
    args.disk_tier = _disk_tier(parser, args)


def _tenant_quotas(parser: argparse.ArgumentParser, specs: list[str]) -> dict[str, int] | None:
    quotas: dict[str, int] = {}
    for spec in specs:
        name, sep, quota = spec.partition("=")
        if not sep:
            parser.error(f"--tenant: {spec!r} is not NAME=QUOTA")
        try:
            transfer_config("127.0.0.1:1", "kvpool", "kv_both", name)
        except SettingsError as exc:
            parser.error(f"--tenant: {exc.problems.get('tenant', exc)}")
        if name in quotas:
            parser.error(f"--tenant {name}: given twice (one quota per tenant)")
        try:
            quotas[name] = parse_size(quota)
        except ValueError as exc:
            parser.error(f"--tenant {name}: {exc}")
        if quotas[name] < 1:
            parser.error(f"--tenant {name}: a quota is at least 1 byte")
    return quotas or None


def _disk_tier(parser: argparse.ArgumentParser, args: argparse.Namespace) -> DiskTier | None:
    given = {
        field: getattr(args, dest) for dest, field in DISK_FIELDS.items() if getattr(args, dest) is not None
    }
    if not args.disk_capacity:
        options = ["--disk-dir"] if args.disk_dir else []
        options += [f"--{dest.replace('_', '-')}" for dest in DISK_FIELDS if getattr(args, dest) is not None]
        if options:
            parser.error(f"{options[0]}: needs --disk-capacity (the tier's size)")
        return None
    try:
        capacity = parse_size(args.disk_capacity)
    except ValueError as exc:
        parser.error(f"--disk-capacity: {exc}")
    try:
        return DiskTier(
            capacity=capacity,
            parent=Path(args.disk_dir) if args.disk_dir else None,
            bucket_bytes=min(8 << 20, parse_size(args.segment_size) // 2, capacity),
            **given,
        )
    except ValueError as exc:
        named = (part.partition(": ") for part in str(exc).split("; "))
        parser.error("; ".join(f"{DISK_OPTIONS.get(name, name)}: {rule}" for name, _, rule in named))


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    _check(parser, args)

    with raise_on_stop_signals():  # also while the pool starts: what started is stopped
        pool = LocalPool(
            segment_size=args.segment_size,
            rpc_port=args.rpc_port,
            metrics_port=args.metrics_port,
            tenant_quotas=args.tenant_quotas,
            disk_tier=args.disk_tier,
            keep_logs=True,  # it says where they are
        )
        status = 0  # a stop signal's: the pool ran until it was stopped
        try:
            try:
                status = _serve(pool, args)
            finally:
                pool.stop()  # a stop signal meanwhile is raised once the pool is stopped
        except Stopped:
            print("kvpool-local-pool: stopping", file=sys.stderr, flush=True)
        return status


def _serve(pool: LocalPool, args: argparse.Namespace) -> int:
    """Start ``pool``, print its JSON, and watch it until a part exits (1), or a stop signal."""
    try:
        pool.start()
    except (OSError, RuntimeError, TimeoutError) as exc:
        kept = f" (the master's log is in {pool.master.log_dir})" if pool.master is not None else ""
        print(f"kvpool-local-pool: the pool did not start{kept}: {exc}", file=sys.stderr)
        return 1
    assert pool.master is not None and pool.store is not None
    for tenant in args.tenant_quotas or [""]:
        config = transfer_config(pool.address, args.cache_prefix, args.kv_role, tenant)
        print(json.dumps(config, separators=(",", ":")), flush=True)
    tier = "" if pool.disk_tier is None else f", disk tier {args.disk_capacity} in {pool.disk_tier.directory}"
    print(
        f"kvpool-local-pool: master {pool.address} (metrics {pool.master.metrics_url}), store "
        f"{args.segment_size}{tier}; logs in {pool.master.log_dir} and {pool.store.log_dir}.\n"
        "Pass the JSON above to vLLM as --kv-transfer-config '<json>'. Ctrl-C stops the pool.",
        file=sys.stderr,
        flush=True,
    )
    while True:
        time.sleep(POLL_S)
        exited = pool.exited()
        if exited:
            print(f"kvpool-local-pool: exited unexpectedly: {', '.join(exited)}", file=sys.stderr)
            return 1


if __name__ == "__main__":
    sys.exit(main())
