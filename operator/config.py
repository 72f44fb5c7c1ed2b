"""How the operator runs (scope, endpoints, timings) and the kopf settings it implies."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import kopf

from kvpool.operator import names


@dataclass(frozen=True)
class WebhookConfig:
    """The validating admission webhook server (kopf's ``WebhookServer``)."""

    port: int = 9443
    addr: str | None = None
    host: str | None = None
    certfile: str | None = None
    pkeyfile: str | None = None
    insecure: bool = False
    managed: str | None = None  # name of the ValidatingWebhookConfiguration kopf keeps


@dataclass(frozen=True)
class OperatorConfig:
    """Everything ``kvpool-operator run`` can set."""

    namespaces: tuple[str, ...] = ()  # empty: all namespaces
    kubeconfig: str | None = None  # None: in-cluster, else $KUBECONFIG or ~/.kube/config
    liveness_endpoint: str | None = "http://0.0.0.0:8080/healthz"
    metrics_host: str = "0.0.0.0"
    metrics_port: int | None = 9090
    resync_interval: float = 30.0
    retry_delay: float = 10.0
    request_timeout: float = 30.0
    exit_timeout: float | None = 600.0
    webhook: WebhookConfig | None = None
    log_level: int = logging.INFO


def make_settings(config: OperatorConfig) -> kopf.OperatorSettings:
    """kopf settings: own annotations and finalizer, no cluster scanning, no peering."""
    settings = kopf.OperatorSettings()
    settings.persistence.finalizer = names.FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=names.PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=names.PREFIX, key="last-handled-configuration"
    )
    settings.posting.level = logging.INFO
    settings.posting.reporting_component = names.MANAGER
    settings.scanning.disabled = True
    settings.peering.standalone = True
    settings.networking.request_timeout = config.request_timeout
    settings.watching.server_timeout = 300
    settings.watching.reconnect_backoff = min(1.0, config.retry_delay)
    settings.process.ultimate_exiting_timeout = config.exit_timeout
    # On exit, let a resync pass that is under way finish rather than orphan it.
    settings.background.instant_exit_timeout = 5.0
    settings.queueing.error_delays = (1, 2, 5, 10)
    if config.webhook is not None:
        hook = config.webhook
        settings.admission.server = kopf.WebhookServer(
            addr=hook.addr,
            port=hook.port,
            host=hook.host,
            certfile=hook.certfile,
            pkeyfile=hook.pkeyfile,
            insecure=hook.insecure,
        )
        settings.admission.managed = hook.managed
    return settings
