"""The kopf app: the operator's run options, its kopf settings, its handlers, and ``run``.

Handlers are thin: each hands its event to ``reconcile.Reconciler`` (or, for the
webhooks, to ``validation`` and ``pod_injection``). They are built per run into their
own registry, so intervals come from the options and several operators (tests) never
share handlers.

The admission webhooks only read, so every replica answers them: the one that holds the
Lease in its kopf run, each standby in a kopf run of the admission handlers alone (no
watches, no writes) until it takes the Lease over; both runs of a replica answer on one
endpoint (``webhook_server``), open from the first run's start to the replica's stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import aiohttp.web
import kopf
from kubernetes_asyncio.client import ApiClient, Configuration

from kvpool.operator import names
from kvpool.operator.consumers import Refusal, config_hash_of
from kvpool.operator.election import LeaseElector, LeaseLost, LeaseOptions
from kvpool.operator.grants import NAMESPACE_NOT_ALLOWED, POOL_NOT_FOUND, namespace_refusal, read_grant
from kvpool.operator.kube import USER_AGENT, ApiError, KubeClient, connection_info, load_configuration
from kvpool.operator.leader import SERVICE_HEALTH_URL
from kvpool.operator.metrics import OperatorMetrics, serve_metrics
from kvpool.operator.names import DEPLOYMENTS, GRANTS, PODS, POOLS
from kvpool.operator.pod_injection import (
    DEPLOYMENT_PATCH,
    POD_ADMISSION,
    POOL_NOT_READY,
    admit_pod,
    owning_deployment,
    pod_config_hashes,
    pool_namespace_of_pod,
)
from kvpool.operator.policy import OperatorPolicy
from kvpool.operator.reconcile import (
    GuardedPodsRunning,
    Notify,
    Reconciler,
    child_pool_namespace,
    grant_namespaces,
    pool_of,
    read_grants,
    refuse_grant,
    utcnow,
)
from kvpool.operator.validation import admission_problems, admission_warnings
from kvpool.operator.webhook_server import shared_webhook_server

POOL = (POOLS.group, POOLS.version, POOLS.plural)
CHILDREN = (DEPLOYMENTS.group, DEPLOYMENTS.version, DEPLOYMENTS.plural)
GRANT = (GRANTS.group, GRANTS.version, GRANTS.plural)


def grant_pool(body: Mapping[str, Any]) -> str | None:
    """The pool a grant names (None: it names none)."""
    pool = (body.get("spec") or {}).get("pool")
    return pool if isinstance(pool, str) and pool else None


VALIDATE_ID = "validate-pool"
INJECT_ID = "inject-pod"
# The webhook's read of the pool a new Pod names: well within the API server's call timeout.
# Every read a Pod's admission makes, together: an answer within it, below the webhook's
# timeoutSeconds (the chart's default 10), so a refusal always names its rule.
ADMISSION_DEADLINE = 8.0
RETRYABLE = (ApiError, aiohttp.ClientError, asyncio.TimeoutError)


@dataclass(frozen=True)
class WebhookOptions:
    """The validating admission webhook server (kopf's ``WebhookServer``)."""

    port: int = 9443
    addr: str | None = None
    host: str | None = None
    certfile: str | None = None
    pkeyfile: str | None = None
    insecure: bool = False
    managed: str | None = None  # name of the webhook configurations kopf keeps (tests, dev)


@dataclass(frozen=True)
class OperatorOptions:
    """How the operator runs: everything ``kvpool-operator run`` can set."""

    namespaces: tuple[str, ...] = ()  # empty: all namespaces
    kubeconfig: str | None = None  # None: in-cluster, else $KUBECONFIG or ~/.kube/config
    liveness_endpoint: str | None = "http://0.0.0.0:8080/healthz"
    metrics_host: str = "0.0.0.0"
    metrics_port: int | None = 9090
    resync_interval: float = 30.0
    # How often each pool's master is asked for health and capacity, and how long one poll
    # may take (never inside a reconcile pass).
    observe_interval: float = 15.0
    observe_timeout: float = 3.0
    retry_delay: float = 10.0
    request_timeout: float = 30.0
    exit_timeout: float | None = 600.0
    webhook: WebhookOptions | None = None
    log_level: int = logging.INFO
    policy: OperatorPolicy = field(default_factory=OperatorPolicy)
    # Where an HA pool's masters are first asked whether their leader serves ({service},
    # {namespace}, {port}: the master Service and its metrics port).
    master_health_url: str = SERVICE_HEALTH_URL
    # Several replicas: only the holder of this Lease acts (None: this replica always acts).
    leader_election: LeaseOptions | None = None
    # How consumers get the pool's settings: injected into each new Pod by the mutating
    # webhook (POD_ADMISSION; needs ``webhook``), or patched into their Deployments.
    injection_mode: str = DEPLOYMENT_PATCH

    def __post_init__(self) -> None:
        if self.injection_mode == POD_ADMISSION and self.webhook is None:
            raise ValueError("pod-admission injection needs the webhook server (--webhook-port)")
        if self.injection_mode not in (POD_ADMISSION, DEPLOYMENT_PATCH):
            raise ValueError(f"unknown injection mode {self.injection_mode!r}")
        # What the operator watches is where it may read grants: one source, ``namespaces``.
        if self.policy.watched_namespaces != self.namespaces:
            watched = dataclasses.replace(self.policy, watched_namespaces=self.namespaces)
            object.__setattr__(self, "policy", watched)


def webhook_server(hook: WebhookOptions) -> kopf.WebhookServer:
    """kopf's webhook server for ``hook``."""
    return kopf.WebhookServer(
        addr=hook.addr,
        port=hook.port,
        host=hook.host,
        certfile=hook.certfile,
        pkeyfile=hook.pkeyfile,
        insecure=hook.insecure,
    )


def kopf_settings(
    options: OperatorOptions, standby: bool = False, server: kopf.WebhookServerProtocol | None = None
) -> kopf.OperatorSettings:
    """kopf's settings: own annotations and finalizer, no cluster scanning, no peering. A
    ``standby`` never writes the webhook configurations (only the Lease holder may). The
    webhooks are served by ``server`` (the replica's, for all its runs), else by a server of
    this run's own."""
    settings = kopf.OperatorSettings()
    settings.persistence.finalizer = names.FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=names.PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=names.PREFIX, key="last-handled-configuration"
    )
    # Only the operator's own Events (kopf.event); never kopf's log lines (handler outcomes,
    # exception texts) where every reader of the pool's Events sees them. kopf < 1.44 posts
    # them unless told not to; pyproject requires 1.44 and this says so whatever the default.
    settings.posting.loggers = False
    settings.posting.level = logging.INFO
    settings.posting.reporting_component = names.MANAGER
    settings.scanning.disabled = True
    settings.peering.standalone = True
    settings.networking.request_timeout = options.request_timeout
    settings.watching.server_timeout = 300
    settings.watching.reconnect_backoff = min(1.0, options.retry_delay)
    settings.process.ultimate_exiting_timeout = options.exit_timeout
    # On exit, let a resync pass that is under way finish rather than orphan it.
    settings.background.instant_exit_timeout = 5.0
    settings.queueing.error_delays = (1, 2, 5, 10)
    if options.webhook is not None:
        settings.admission.server = server or webhook_server(options.webhook)
        settings.admission.managed = None if standby else options.webhook.managed
    return settings


def notifier(body: Mapping[str, Any]) -> Notify:
    """Post Kubernetes Events about the pool ``body``."""

    def notify(type_: str, reason: str, message: str) -> None:
        kopf.event(dict(body), type=type_, reason=reason, message=message)  # type: ignore[arg-type]

    return notify


async def grant_changed(reconciler: Reconciler, body: Mapping[str, Any], event_type: str | None) -> None:
    """A grant came, went or changed: a pass over the pool it names (its policy, its
    consumers' tenants, every grant's cut); a grant whose pool is not there, or does not
    list the grant's namespace, is told so at once, even while a pass over that pool waits
    to begin (such a pass reads only the grants the pool takes)."""
    own, name = body.get("metadata", {}).get("namespace"), grant_pool(body)
    named = (body.get("spec") or {}).get("poolNamespace")
    namespace = named if isinstance(named, str) and named else own
    if name is None:
        return
    pool = await reconciler.kube.get(POOLS, namespace, name)
    going = event_type == "DELETED" or body.get("metadata", {}).get("deletionTimestamp")
    if pool is None and not going:
        missing = f"pool {namespace}/{name} not found"
        try:
            await refuse_grant(reconciler.kube, body, missing, POOL_NOT_FOUND, utcnow())
        except RETRYABLE as exc:
            logging.getLogger(__name__).warning("grant %s/%s: %s", own, body["metadata"]["name"], exc)
        return
    if pool is None or pool.get("metadata", {}).get("deletionTimestamp"):
        return
    try:
        refusal = namespace_refusal(own, namespace, name, grant_namespaces(pool))
        if refusal is not None:
            if not going:
                await refuse_grant(reconciler.kube, body, refusal, NAMESPACE_NOT_ALLOWED, utcnow())
            return
        # Dropped when a pass over the pool waits to begin: that pass reads this grant.
        await reconciler.reconcile(pool, "grant", notifier(pool), coalesce=True)
    except RETRYABLE as exc:
        logging.getLogger(__name__).warning("pass after a grant of %s/%s: %s", namespace, name, exc)


def spec_changed(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> bool:
    """Whether an UPDATE changes the spec of a pool that is not being deleted."""
    if (new.get("metadata") or {}).get("deletionTimestamp"):
        return False
    return old is None or old.get("spec") != new.get("spec")


class Acting:
    """The handlers that act (passes, the observation timer with its drain steps, teardowns),
    each while it runs. When the Lease is lost, ``stop`` cancels those under way at once and
    every later one is cancelled as it begins: kopf's own stop would let a timer's pass run on
    for ``background.instant_exit_timeout`` (5 s), then any task for 5 s more, while a standby
    may take the Lease over ``lease_duration - renew_deadline`` (5 s) after it was found lost.
    A cancelled handler writes nothing more (kopf records no outcome of it)."""

    def __init__(self) -> None:
        self.stopped = False
        self._running: set[asyncio.Task[Any]] = set()

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Around a handler's work: cancelled when the Lease is lost."""
        task = asyncio.current_task()
        if self.stopped or task is None:
            raise asyncio.CancelledError("the lease is lost: this replica acts no more")
        self._running.add(task)
        try:
            yield
        finally:
            self._running.discard(task)

    def stop(self) -> None:
        if not self.stopped:
            logging.getLogger(__name__).error("the lease is lost: every handler under way is cancelled")
        self.stopped = True
        for task in list(self._running):
            task.cancel()


def make_registry(
    options: OperatorOptions,
    configuration: Configuration,
    reconciler: Reconciler,
    metrics: OperatorMetrics,
    acting: Acting | None = None,
) -> kopf.OperatorRegistry:
    """All handlers of one operator run; those that act run within ``acting``."""
    registry = kopf.OperatorRegistry()
    acting = acting or Acting()
    retry: dict[str, Any] = {"errors": kopf.ErrorsMode.TEMPORARY, "backoff": options.retry_delay}

    def temporary(trigger: str, exc: BaseException) -> kopf.TemporaryError:
        return kopf.TemporaryError(f"{trigger}: {exc}", delay=options.retry_delay)

    async def run(trigger: str, body: Mapping[str, Any]) -> None:
        with acting.running():
            try:
                await reconciler.reconcile(body, trigger, notifier(body))
            except RETRYABLE as exc:
                raise temporary(trigger, exc) from exc

    @kopf.on.login(registry=registry)
    async def login(**_: Any) -> kopf.ConnectionInfo:
        return await connection_info(configuration)

    @kopf.on.resume(*POOL, registry=registry, id="resume", **retry)
    async def resume(body: kopf.Body, **_: Any) -> None:
        await run("resume", body)

    @kopf.on.create(*POOL, registry=registry, id="create", **retry)
    async def create(body: kopf.Body, **_: Any) -> None:
        await run("create", body)

    @kopf.on.update(*POOL, registry=registry, id="update", field="spec", **retry)
    async def update(body: kopf.Body, **_: Any) -> None:
        await run("update", body)

    @kopf.timer(
        *POOL,
        registry=registry,
        id="resync",
        interval=options.resync_interval,
        initial_delay=options.resync_interval,
        **retry,
    )
    async def resync(body: kopf.Body, **_: Any) -> None:
        await run("resync", body)

    @kopf.timer(
        *POOL,
        registry=registry,
        id="observe",
        interval=options.observe_interval,
        initial_delay=min(1.0, options.observe_interval),
    )
    async def observe(body: kopf.Body, **_: Any) -> None:
        # The master's health and capacity: polled with a deadline, outside any pass.
        with acting.running():
            try:
                await reconciler.observe(body, notifier(body))
            except RETRYABLE as exc:
                meta = body.get("metadata", {})
                logging.getLogger(__name__).warning(
                    "observing %s/%s: %s", meta.get("namespace"), meta.get("name"), exc
                )

    @kopf.on.event(*CHILDREN, registry=registry, id="child", when=lambda body, **_: pool_of(body) is not None)
    async def child(body: kopf.Body, **_: Any) -> None:
        # A pool's Deployment or consumer changed (a rollout progressed, a hand edit): a pass
        # now, not at the next resync (passes that would wait behind one already queued are
        # dropped: the queued one reads the newest state).
        namespace, name = child_pool_namespace(body), pool_of(body)
        if name is None or reconciler.queued(namespace, name):
            return
        with acting.running():
            pool = await reconciler.kube.get(POOLS, namespace, name)
            if pool is not None and not pool.get("metadata", {}).get("deletionTimestamp"):
                try:
                    await reconciler.reconcile(pool, "child", notifier(pool), coalesce=True)
                except RETRYABLE as exc:
                    logging.getLogger(__name__).warning(
                        "pass after a change of %s/%s: %s", namespace, name, exc
                    )

    @kopf.on.event(*GRANT, registry=registry, id="grant", when=lambda body, **_: grant_pool(body) is not None)
    async def grant(body: kopf.Body, type: str | None = None, **_: Any) -> None:
        with acting.running():
            await grant_changed(reconciler, body, type)

    @kopf.on.delete(*POOL, registry=registry, id="teardown", **retry)
    async def delete(body: kopf.Body, **_: Any) -> None:
        with acting.running():
            try:
                await reconciler.teardown(body, notifier(body))
            except (*RETRYABLE, GuardedPodsRunning) as exc:
                raise temporary("delete", exc) from exc

    register_admission(registry, options, reconciler.kube)

    @kopf.on.probe(registry=registry, id="pools")
    def pools(**_: Any) -> int:
        return len(metrics.conditions)

    return registry


def register_admission(registry: kopf.OperatorRegistry, options: OperatorOptions, kube: KubeClient) -> None:
    """The admission handlers: pool validation, and (pod-admission mode) the injection into
    new consumer Pods. Neither writes anything."""
    if options.webhook is None:  # kopf refuses admission handlers without a server
        return

    @kopf.on.validate(*POOL, registry=registry, id=VALIDATE_ID, operations=["CREATE", "UPDATE"])
    def validate(
        body: kopf.Body,
        warnings: list[str],
        old: Any = None,
        operation: str | None = None,
        **_: Any,
    ) -> None:
        if operation == "UPDATE" and not spec_changed(old, body):
            return  # metadata/status updates (e.g. a finalizer's removal) never block
        message = admission_problems(body, options.policy)
        if message:
            raise kopf.AdmissionError(message, code=422)
        warnings.extend(admission_warnings(body, options.policy))

    if options.injection_mode != POD_ADMISSION:
        return

    # Only Pods with the opt-in label (kopf's filter; the webhook configuration's
    # objectSelector sends no others): every other Pod is admitted as it is.
    @kopf.on.mutate(
        PODS.version,
        PODS.plural,
        registry=registry,
        id=INJECT_ID,
        operations=["CREATE"],
        labels={names.LABEL_ALLOW_POOL: kopf.PRESENT},
    )
    async def inject(body: kopf.Body, patch: kopf.Patch, **_: Any) -> None:
        meta = body.get("metadata") or {}
        namespace = str(meta.get("namespace") or "")
        if options.namespaces and namespace not in options.namespaces:
            return  # another operator's namespace: its own webhook answers for it
        pool_name = str((meta.get("labels") or {}).get(names.LABEL_ALLOW_POOL, ""))
        # A grant's consumer in another namespace names its pool's (allow-pool-namespace).
        pool_namespace = pool_namespace_of_pod(body, namespace)
        if options.namespaces and pool_namespace not in options.namespaces:
            raise kopf.AdmissionError(
                f"Pod {namespace}/{meta.get('generateName') or meta.get('name') or ''} names pool "
                f"{pool_namespace}/{pool_name} ({names.LABEL_ALLOW_POOL_NAMESPACE}), in a namespace "
                "this operator does not watch: no pool of it can take the Pod's settings: fix the "
                "label, or have the namespace watched [namespace-not-watched]",
                code=403,
            )
        deadline = asyncio.get_running_loop().time() + ADMISSION_DEADLINE

        def left() -> float:
            return max(0.0, deadline - asyncio.get_running_loop().time())

        # A fresh read of the pool (never an index that may lag a spec change or a status
        # that just turned Ready): Pods are created rarely, and one GET is cheap.
        try:
            pool = await asyncio.wait_for(kube.get(POOLS, pool_namespace, pool_name), left())
        except RETRYABLE as exc:
            raise kopf.AdmissionError(
                f"pool {pool_namespace}/{pool_name} could not be read ({exc or type(exc).__name__}): "
                "the Pod is refused, the ReplicaSet controller retries [pool-unreachable]",
                code=503,
            ) from exc
        try:
            grants = await asyncio.wait_for(read_grants(kube, pool), left()) if pool else []
        except RETRYABLE as exc:
            raise kopf.AdmissionError(
                f"the grants of pool {pool_namespace}/{pool_name} could not be read "
                f"({exc or type(exc).__name__}): "
                "the Pod is refused, the ReplicaSet controller retries [pool-unreachable]",
                code=503,
            ) from exc
        # No such pool in the Pod's own namespace: a grant of its namespace may list it as a
        # consumer of a pool elsewhere (the refusal then names the label it lacks). Only a hint:
        # the Pod is refused either way.
        namespace_grants = []
        if pool is None and pool_namespace == namespace:
            with contextlib.suppress(*RETRYABLE):
                found = await asyncio.wait_for(kube.list(GRANTS, namespace), left())
                namespace_grants = [read_grant(obj) for obj in found]
        answer = admit_pod(
            dict(body), namespace, pool, options.policy, grants, pool_namespace, namespace_grants
        )
        if isinstance(answer, Refusal) and answer.rule == POOL_NOT_READY:
            # A Deployment rolled onto the pool while it served keeps getting its settings.
            running = await running_settings(kube, body, namespace, pool_name, left())
            if running is not None:
                answer = admit_pod(
                    dict(body),
                    namespace,
                    pool,
                    options.policy,
                    grants,
                    pool_namespace,
                    namespace_grants,
                    running=running[0],
                    pod_hashes=running[1],
                )
        if isinstance(answer, Refusal):
            raise kopf.AdmissionError(str(answer), code=403)
        patch.update(answer.patch)


async def running_settings(
    kube: KubeClient, pod: Mapping[str, Any], namespace: str, pool: str, timeout: float
) -> tuple[dict[str, Any], list[str]] | None:
    """The Pod's Deployment and the settings its injected Pods run (their config hashes,
    read only when its template names none); None when it cannot be read within ``timeout``."""
    deployment_name = owning_deployment(pod)
    if deployment_name is None:
        return None
    try:
        async with asyncio.timeout(timeout):
            deployment = await kube.get(DEPLOYMENTS, namespace, deployment_name)
            if deployment is None:
                return None
            hashes: list[str] = []
            if config_hash_of(deployment) is None:
                pods = await kube.list(PODS, namespace, label_selector=f"{names.LABEL_POOL}={pool}")
                hashes = pod_config_hashes(pods, deployment_name)
    except RETRYABLE:
        return None  # the refusal stands: the ReplicaSet controller retries
    return deployment, hashes


def admission_registry(
    configuration: Configuration, options: OperatorOptions, kube: KubeClient
) -> kopf.OperatorRegistry:
    """A standby's handlers: the admission webhooks alone (and the login)."""
    registry = kopf.OperatorRegistry()

    @kopf.on.login(registry=registry)
    async def login(**_: Any) -> kopf.ConnectionInfo:
        return await connection_info(configuration)

    register_admission(registry, options, kube)
    return registry


@contextlib.asynccontextmanager
async def standby_admission(
    options: OperatorOptions,
    configuration: Configuration,
    kube: KubeClient,
    stopped: asyncio.Event,
    server: kopf.WebhookServerProtocol | None = None,
) -> AsyncIterator[None]:
    """While a standby waits for the Lease, it answers the admission webhooks: kopf with the
    admission handlers alone, on ``server`` (the replica's: it answers with these handlers until
    the main run's take over, never closed between). A signal that stops it stops the replica
    (``stopped``)."""
    if options.webhook is None:
        yield
        return
    leaving = asyncio.Event()
    task = asyncio.create_task(
        kopf.operator(
            registry=admission_registry(configuration, options, kube),
            settings=kopf_settings(options, standby=True, server=server),
            clusterwide=not options.namespaces,
            namespaces=list(options.namespaces),
            standalone=True,
            liveness_endpoint=None,
            stop_flag=leaving,
        )
    )
    task.add_done_callback(lambda _: None if leaving.is_set() else stopped.set())
    try:
        yield
    finally:
        leaving.set()
        for outcome in await asyncio.gather(task, return_exceptions=True):
            if isinstance(outcome, BaseException):
                logging.getLogger(__name__).warning("the standby's webhook server: %r", outcome)


async def run(
    options: OperatorOptions,
    *,
    stop_flag: threading.Event | asyncio.Event | None = None,
    ready_flag: threading.Event | asyncio.Event | None = None,
) -> None:
    """Run until kopf exits (a signal, or ``stop_flag`` set); see ``kopf.operator``."""
    configuration = await load_configuration(options.kubeconfig)
    metrics = OperatorMetrics()
    async with ApiClient(configuration) as api, AsyncExitStack() as stack:
        api.user_agent = USER_AGENT
        kube = KubeClient(api, on_write=metrics.count_write, timeout=options.request_timeout)
        if options.metrics_port is not None:
            await stack.enter_async_context(
                serve_metrics(metrics.registry, options.metrics_host, options.metrics_port)
            )
        reconciler = Reconciler(
            kube,
            metrics,
            options.policy,
            options.master_health_url,
            injection_mode=options.injection_mode,
            observe_timeout=options.observe_timeout,
            addresses_ttl=options.observe_interval,
            observe_interval=options.observe_interval,
        )
        stopped = asyncio.Event()
        stack.enter_context(_forward(stop_flag, stopped))
        # One webhook endpoint for the standby's run and the main one: open across the takeover.
        webhooks = None
        if options.webhook is not None:
            webhooks = await stack.enter_async_context(shared_webhook_server(webhook_server(options.webhook)))
        elector = None
        if options.leader_election is not None:
            elector = LeaseElector(kube, options.leader_election)
            async with (
                standby_liveness(options.liveness_endpoint),
                standby_admission(options, configuration, kube, stopped, webhooks),
            ):
                if not await elector.acquire(stopped):
                    return
        holding = asyncio.create_task(elector.hold()) if elector is not None else None
        acting = Acting()
        lost = _on_done(holding, stopped, acting)
        try:
            await kopf.operator(
                registry=make_registry(options, configuration, reconciler, metrics, acting),
                settings=kopf_settings(options, server=webhooks),
                clusterwide=not options.namespaces,
                namespaces=list(options.namespaces),
                standalone=True,
                liveness_endpoint=options.liveness_endpoint,
                stop_flag=stopped,
                ready_flag=ready_flag,
            )
        finally:
            if holding is not None:
                holding.cancel()
            if elector is not None and not lost():
                await elector.release()
        if lost():
            raise LeaseLost(f"{elector.identity if elector else ''} lost the lease: it stops acting")


@contextlib.contextmanager
def _forward(source: threading.Event | asyncio.Event | None, target: asyncio.Event) -> Iterator[None]:
    """Set ``target`` when ``source`` (a caller's stop flag, of either kind) is set."""
    if source is None:
        yield
        return

    async def watch() -> None:
        while not source.is_set():
            await asyncio.sleep(0.1)
        target.set()

    task = asyncio.get_running_loop().create_task(watch())
    try:
        yield
    finally:
        task.cancel()


def _on_done(task: asyncio.Task[None] | None, stopped: asyncio.Event, acting: Acting) -> Callable[[], bool]:
    """Stop the operator when the Lease is lost (the handlers under way at once); whether it was."""
    if task is None:
        return lambda: False

    def lost() -> bool:
        return task.done() and not task.cancelled() and isinstance(task.exception(), LeaseLost)

    def done(_: asyncio.Task[None]) -> None:
        if lost():
            acting.stop()
        stopped.set()

    task.add_done_callback(done)
    return lost


@contextlib.asynccontextmanager
async def standby_liveness(endpoint: str | None) -> AsyncIterator[None]:
    """While a standby waits for the Lease, its liveness endpoint answers (kopf serves it once
    the replica acts)."""
    if not endpoint:
        yield
        return
    url = urlsplit(endpoint)

    async def healthy(_: aiohttp.web.Request) -> aiohttp.web.Response:
        return aiohttp.web.json_response({"standby": True})

    app = aiohttp.web.Application()
    app.router.add_get(url.path or "/", healthy)
    runner = aiohttp.web.AppRunner(app)
    await runner.setup()
    site = aiohttp.web.TCPSite(runner, url.hostname, url.port or 80, reuse_address=True)
    await site.start()
    try:
        yield
    finally:
        await runner.cleanup()
