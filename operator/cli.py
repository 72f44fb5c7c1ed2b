"""``kvpool-operator``: ``run`` the operator, print its ``crd`` or its ``rbac`` rules.

What ``crd`` and ``rbac`` print is what the chart ships (see ``generated``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, NoReturn

from kvpool.operator.crd import build_grant_crd, render_crd
from kvpool.operator.leader import SERVICE_HEALTH_URL
from kvpool.operator.names import LEASE_NAME
from kvpool.operator.pod_injection import DEPLOYMENT_PATCH, INJECTION_MODES, POD_ADMISSION
from kvpool.operator.rbac import RULES, TENANT_RULES, WEBHOOK_RULES, render_rules

if TYPE_CHECKING:
    from kvpool.operator.app import OperatorOptions
    from kvpool.operator.policy import OperatorPolicy


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvpool-operator",
        description="Run the MooncakeKVPool operator, or print its CRD or its RBAC rules.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    crd = sub.add_parser("crd", help="print the MooncakeKVPool CustomResourceDefinition (YAML)")
    crd.add_argument("--grant", action="store_true", help="the MooncakeKVPoolGrant's instead")
    rbac = sub.add_parser("rbac", help="print the RBAC rules the operator needs (YAML)")
    rbac.add_argument(
        "--webhook-managed",
        action="store_true",
        help="include the rules for a kopf-managed webhook configuration",
    )
    rbac.add_argument(
        "--tenant",
        choices=sorted(TENANT_RULES),
        help="print instead what tenants get on pools through the aggregated edit or view role "
        "(grant: what namespace admins get on grants when the chart allows it)",
    )
    run = sub.add_parser("run", help="run the operator")
    run.add_argument(
        "-n",
        "--namespace",
        action="append",
        default=[],
        help="watch only this namespace (repeatable; default: all namespaces)",
    )
    run.add_argument(
        "--kubeconfig", help="kubeconfig file (default: in-cluster, else $KUBECONFIG or ~/.kube/config)"
    )
    run.add_argument(
        "--liveness",
        default="http://0.0.0.0:8080/healthz",
        help="liveness/readiness endpoint URL ('' to disable)",
    )
    run.add_argument("--metrics-host", default="0.0.0.0")
    run.add_argument("--metrics-port", type=int, default=9090, help="0 to disable")
    run.add_argument(
        "--resync-interval", type=float, default=30.0, help="seconds between level checks of every pool"
    )
    run.add_argument(
        "--observe-interval",
        type=float,
        default=15.0,
        help="seconds between asks of each pool's master for health and capacity",
    )
    run.add_argument("--retry-delay", type=float, default=10.0)
    run.add_argument("--webhook-port", type=int, help="serve the validating webhook here")
    run.add_argument("--webhook-host", help="hostname the API server uses to reach it")
    run.add_argument(
        "--webhook-cert", help="TLS certificate file (without one kopf self-signs, which needs certbuilder)"
    )
    run.add_argument("--webhook-key", help="TLS private key file")
    run.add_argument(
        "--webhook-managed",
        help="name of a ValidatingWebhookConfiguration for the operator to keep up to date",
    )
    run.add_argument(
        "--allowed-registry",
        action="append",
        default=[],
        metavar="HOST[:PORT][/PATH]",
        help="a pool's image must come from this registry (and path below it); repeatable; "
        "default: any image",
    )
    run.add_argument(
        "--allowed-priority-class",
        action="append",
        default=[],
        help="a priority class pools may use (repeatable; default: any but the system- ones)",
    )
    run.add_argument(
        "--allowed-toleration-key",
        action="append",
        default=[],
        help="a taint key pools may tolerate (repeatable; default: any but the protected ones)",
    )
    run.add_argument(
        "--protected-node-key",
        action="append",
        default=[],
        help="a taint key pools may not tolerate and a node label they may not select, beyond "
        "the control plane's (repeatable)",
    )
    run.add_argument(
        "--allow-network-policy-opt-out",
        action="store_true",
        help="let pools set networkPolicy.enabled: false",
    )
    run.add_argument(
        "--no-network-policy-end-port",
        dest="network_policy_end_port",
        action="store_false",
        help="the network plugin ignores endPort: write no consumer NetworkPolicy",
    )
    run.add_argument(
        "--no-external-pools",
        dest="allow_external_pools",
        action="store_false",
        help="refuse pools that name an external master (spec.external)",
    )
    run.add_argument("--max-master-replicas", type=int, help="most masters a pool may ask for")
    run.add_argument("--max-store-replicas", type=int, help="most store pods a pool may ask for")
    run.add_argument(
        "--operator-namespace",
        help="the operator's namespace: with --operator-pod-label, let into the masters' HTTP port "
        "(health and capacity)",
    )
    run.add_argument(
        "--operator-pod-label",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a label of the operator's pods (repeatable)",
    )
    run.add_argument(
        "--master-health-url",
        default=SERVICE_HEALTH_URL,
        help="where HA masters are asked whether their leader serves "
        "({service}, {namespace}, {port} filled in)",
    )
    run.add_argument(
        "--leader-election-namespace",
        help="run as one of several replicas: only the holder of a Lease in this namespace acts "
        "(the others stand by); default: no election, this replica always acts",
    )
    run.add_argument(
        "--leader-election-id",
        default=LEASE_NAME,
        help="the Lease's name (the chart's Role lets the operator get and patch this one only)",
    )
    run.add_argument(
        "--injection-mode",
        choices=INJECTION_MODES,
        default=DEPLOYMENT_PATCH,
        help=f"{POD_ADMISSION}: the webhook injects the settings into each new consumer Pod (needs "
        f"--webhook-port; a Deployment gets one restart annotation when its settings change); "
        f"{DEPLOYMENT_PATCH} (default): the operator patches them into the consumer Deployments",
    )
    run.add_argument("-v", "--verbose", action="store_true")
    return parser


class UsageError(SystemExit):
    """A bad ``run`` argument: exit status 2, as argparse's own; its text is the message."""

    def __init__(self, message: str) -> None:
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


def refuse(message: str) -> NoReturn:
    """Report a usage error as argparse does (one line on standard error) and exit with 2."""
    print(f"kvpool-operator run: error: {message}", file=sys.stderr)
    raise UsageError(message)


def _labels(pairs: list[str]) -> tuple[tuple[str, str], ...]:
    out = []
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not key:
            refuse(f"--operator-pod-label {pair!r}: expected KEY=VALUE")
        out.append((key, value))
    return tuple(out)


def _policy(args: argparse.Namespace) -> OperatorPolicy:
    from kvpool.operator.policy import OperatorPolicy

    try:
        return OperatorPolicy(
            allowed_registries=tuple(args.allowed_registry),
            max_master_replicas=args.max_master_replicas,
            max_store_replicas=args.max_store_replicas,
            allowed_priority_classes=tuple(args.allowed_priority_class),
            allowed_toleration_keys=tuple(args.allowed_toleration_key),
            protected_node_keys=tuple(args.protected_node_key),
            allow_network_policy_opt_out=args.allow_network_policy_opt_out,
            network_policy_end_port=args.network_policy_end_port,
            allow_external_pools=args.allow_external_pools,
            operator_namespace=args.operator_namespace,
            operator_pod_labels=_labels(args.operator_pod_label),
            watched_namespaces=tuple(args.namespace),
        )
    except ValueError as exc:
        refuse(f"--allowed-registry {exc}")


def _check_numbers(args: argparse.Namespace) -> None:
    """Refuse a number outside its option's range, naming the option and the rule."""
    for option, seconds in (
        ("--resync-interval", args.resync_interval),
        ("--observe-interval", args.observe_interval),
        ("--retry-delay", args.retry_delay),
    ):
        if not seconds > 0:
            refuse(f"{option} {seconds}: more than 0 seconds")
    if not 0 <= args.metrics_port <= 65535:
        refuse(f"--metrics-port {args.metrics_port}: a TCP port is 1-65535 (0: no metrics)")
    if args.webhook_port is not None and not 1 <= args.webhook_port <= 65535:
        refuse(f"--webhook-port {args.webhook_port}: a TCP port is 1-65535")
    for option, most in (
        ("--max-master-replicas", args.max_master_replicas),
        ("--max-store-replicas", args.max_store_replicas),
    ):
        if most is not None and most < 1:
            refuse(f"{option} {most}: at least 1")


def check_files(args: argparse.Namespace) -> None:
    """Refuse a file option naming no readable file on this machine, before anything starts."""
    for option, path in (
        ("--kubeconfig", args.kubeconfig),
        ("--webhook-cert", args.webhook_cert),
        ("--webhook-key", args.webhook_key),
    ):
        if path is None:
            continue
        if not os.path.exists(path):
            refuse(f"{option} {path}: no such file")
        if not os.path.isfile(path):
            refuse(f"{option} {path}: not a file")
        if not os.access(path, os.R_OK):
            refuse(f"{option} {path}: not readable")


def _check_webhook_options(args: argparse.Namespace) -> None:
    """Refuse webhook options that would do nothing: without a webhook server, or a key without
    its certificate (kopf would sign one of its own)."""
    if args.webhook_port is None:
        for option, value in (
            ("--webhook-host", args.webhook_host),
            ("--webhook-cert", args.webhook_cert),
            ("--webhook-key", args.webhook_key),
            ("--webhook-managed", args.webhook_managed),
        ):
            if value is not None:
                refuse(f"{option}: needs the webhook server: --webhook-port")
    if args.webhook_key is not None and args.webhook_cert is None:
        refuse("--webhook-key: needs --webhook-cert (its certificate)")


def options_from_args(args: argparse.Namespace) -> OperatorOptions:
    """The run options a parsed ``run`` command line sets."""
    from kvpool.operator.app import OperatorOptions, WebhookOptions
    from kvpool.operator.election import LeaseOptions

    _check_numbers(args)
    _check_webhook_options(args)
    webhook = None
    if args.webhook_port is not None:
        webhook = WebhookOptions(
            port=args.webhook_port,
            host=args.webhook_host,
            certfile=args.webhook_cert,
            pkeyfile=args.webhook_key,
            managed=args.webhook_managed,
        )
    if args.injection_mode == POD_ADMISSION and webhook is None:
        refuse(f"--injection-mode={POD_ADMISSION} needs the webhook server: --webhook-port")
    return OperatorOptions(
        injection_mode=args.injection_mode,
        namespaces=tuple(args.namespace),
        kubeconfig=args.kubeconfig,
        liveness_endpoint=args.liveness or None,
        metrics_host=args.metrics_host,
        metrics_port=args.metrics_port or None,
        resync_interval=args.resync_interval,
        observe_interval=args.observe_interval,
        retry_delay=args.retry_delay,
        webhook=webhook,
        log_level=logging.DEBUG if args.verbose else logging.INFO,
        policy=_policy(args),
        master_health_url=args.master_health_url,
        leader_election=(
            LeaseOptions(args.leader_election_namespace, name=args.leader_election_id)
            if args.leader_election_namespace
            else None
        ),
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "crd":
        grant = (build_grant_crd(), "kvpool-operator crd --grant") if args.grant else ()
        sys.stdout.write(render_crd(*grant))
        return 0
    if args.command == "rbac" and args.tenant:
        command = f"kvpool-operator rbac --tenant {args.tenant}"
        sys.stdout.write(render_rules(TENANT_RULES[args.tenant], command))
        return 0
    if args.command == "rbac":
        sys.stdout.write(render_rules(RULES + (WEBHOOK_RULES if args.webhook_managed else ())))
        return 0
    from kvpool.operator.app import run

    options = options_from_args(args)
    check_files(args)
    logging.basicConfig(level=options.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from kvpool.operator.election import LeaseLost
    from kvpool.operator.kube import KubeconfigError

    try:
        asyncio.run(run(options))
    except LeaseLost as exc:  # back as a standby after a restart
        logging.getLogger(__name__).error("%s", exc)
        return 1
    except KubeconfigError as exc:
        print(f"kvpool-operator run: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
