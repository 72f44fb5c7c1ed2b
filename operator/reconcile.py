"""Reconcile a pool, and tear it down: the one place the operator acts on the cluster.

A pass reads a fresh copy of the pool, applies its plan, rolls its consumers and
writes the status only when it changed. Everything is idempotent: a pass over an
unchanged, converged pool reads but never writes; an invalid spec changes nothing but
the status. Passes over one pool are serialised (change handlers and the resync timer
may overlap).

The pool writes only what is its own: a child that exists without its ownerReference,
or a consumer that did not opt in, is left alone and named in the ``Conflict``
condition (and an Event when the refusal is new). Teardown deletes only owned children.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import kopf

from kvpool.operator import names
from kvpool.operator.capacity import apply_observation, external_conditions, scale_down_message
from kvpool.operator.consumer_hits import consumer_pods, hits_status, pod_ready, poll_consumers, with_hits
from kvpool.operator.consumers import (
    ConsumerError,
    Injection,
    config_hash_of,
    inject_patch,
    injection_refusal,
    managed_by_operator,
    owner_pool,
    owner_pool_namespace,
    refusal,
    restore_patch,
    restore_problem,
)
from kvpool.operator.drain_jobs import DrainRefused, cancel_drain_job
from kvpool.operator.drain_timer import advance, drain_base
from kvpool.operator.external_guard import (
    PinnedResolver,
    PoolAddresses,
    elsewhere_of,
    pool_addresses,
    vet_endpoints,
)
from kvpool.operator.first_poll import (
    EXTERNAL_CONDITIONS,
    POLL_CONDITIONS,
    first_poll_bound,
    holds_for_first_poll,
    kept_conditions,
)
from kvpool.operator.grant_usage import grant_usage, with_changed_at
from kvpool.operator.grants import (
    NAMESPACE_NOT_ALLOWED,
    POOL_NOT_FOUND,
    POOL_REFUSES,
    Grant,
    grant_consumer_statuses,
    grant_ref,
    grant_status,
    namespace_refusal,
    pool_namespace_of,
    read_grant,
)
from kvpool.operator.kube import ApiError, Applied, KubeClient, ensure, ensure_absent, owned_by
from kvpool.operator.leader import (
    SERVICE_HEALTH_URL,
    LeaderView,
    check_leader,
    health_url,
    master_pods_selector,
    pod_ips,
)
from kvpool.operator.merge_patch import diff
from kvpool.operator.metrics import OperatorMetrics, pool_mode
from kvpool.operator.names import CONFIGMAPS, DEPLOYMENTS, GRANTS, PODS, POOLS, ApiResource
from kvpool.operator.network import read_namespace_network, selects
from kvpool.operator.observation import Observation, base_of, poll_master
from kvpool.operator.plan import Plan, build_plan
from kvpool.operator.pod_injection import (
    DEPLOYMENT_PATCH,
    POD_ADMISSION,
    carries_settings,
    pod_config_hashes,
    restart_patch,
    runs_nothing,
    template_refusal,
)
from kvpool.operator.policy import OperatorPolicy
from kvpool.operator.spec import Condition, StoreDrainStatus
from kvpool.operator.status import (
    TIME_FORMAT,
    ConsumerState,
    condition_of,
    conflict_reason,
    conflicts_of,
    deployment_progress,
    invalid_status,
    master_condition,
    paused,
    paused_status,
    pool_serves,
    store_condition,
    valid_status,
)
from kvpool.operator.store_drain import (
    DRAINED,
    GIVEN_UP,
    StoreScale,
    drained_message,
    dump,
    ended,
    record_of,
    store_scale,
)
from kvpool.operator.teardown_order import (
    GUARD_WAIT_S,
    guarded_selectors,
    guards,
    guards_wait,
    running_pods,
    unguarded_children,
)

# notify(type, reason, message): post a Kubernetes Event about the pool.
Notify = Callable[[str, str, str], None]
# Whether an HA pool's leader serves (``leader.check_leader`` against the pool's masters).
LeaderCheck = Callable[[Plan], Awaitable[LeaderView]]


logger = logging.getLogger(__name__)


def logged(namespace: str, name: str) -> Notify:
    """A ``Notify`` that only logs: for a pool whose namespace the operator may no longer write
    Events to (kopf would retry each one for most of a minute)."""

    def notify(type_: str, reason: str, message: str) -> None:
        level = logging.WARNING if type_ == "Warning" else logging.INFO
        logger.log(level, "pool %s/%s: %s: %s", namespace, name, reason, message)

    return notify


def skips_teardown(pool: Mapping[str, Any]) -> bool:
    """Whether the pool asks to be let go without teardown (the escape hatch)."""
    annotations = (pool.get("metadata") or {}).get("annotations") or {}
    return str(annotations.get(names.ANNOTATION_SKIP_TEARDOWN, "")).strip().lower() == "true"


def pool_of(deployment: Mapping[str, Any]) -> str | None:
    """The pool a Deployment belongs to: as its child (ownerReference), as a consumer it
    patched (label), or as one whose Pods opt in (the label on its pod template); None for
    any other Deployment."""
    meta = deployment.get("metadata") or {}
    for ref in meta.get("ownerReferences") or []:
        if ref.get("kind") == POOLS.kind and ref.get("apiVersion") == POOLS.api_version:
            return str(ref.get("name"))
    template = ((deployment.get("spec") or {}).get("template") or {}).get("metadata") or {}
    return (meta.get("labels") or {}).get(names.LABEL_CONSUMER_OF) or (template.get("labels") or {}).get(
        names.LABEL_ALLOW_POOL
    )


def child_pool_namespace(deployment: Mapping[str, Any]) -> str:
    """The namespace of the pool ``pool_of`` names: a grant's consumer in another namespace
    carries it as a label (patched) or names it in its consent; otherwise its own."""
    meta = deployment.get("metadata") or {}
    labels = meta.get("labels") or {}
    found = labels.get(names.LABEL_POOL_NAMESPACE) or labels.get(names.LABEL_ALLOW_POOL_NAMESPACE)
    return str(found or meta.get("namespace") or "")


def uses_grants(pool: Mapping[str, Any]) -> bool:
    """Whether a pool's spec turns tenancy on or names a grant (only then are grants read)."""
    spec = pool.get("spec") or {}
    tenancy = spec.get("tenancy") or {}
    consumers = spec.get("consumers") or []
    return bool(tenancy.get("enabled")) or any(isinstance(c, dict) and c.get("grant") for c in consumers)


def consumer_namespaces(pool: Mapping[str, Any], plan: Plan | None = None) -> list[str]:
    """Other namespaces where the pool may have patched consumers: those it takes grants from
    now, and those of the grants its last status named."""
    meta = pool.get("metadata") or {}
    before = [
        ref.split("/", 1)[0]
        for ref in (pool.get("status") or {}).get(GRANTS_ELSEWHERE) or []
        if isinstance(ref, str) and "/" in ref
    ]
    now = grant_namespaces(pool) if plan is None or plan.tenancy is not None else []
    return [n for n in dict.fromkeys([*now, *before]) if n != meta.get("namespace")]


def grant_namespaces(pool: Mapping[str, Any]) -> list[str]:
    """The other namespaces a pool's (unvalidated) spec takes grants from."""
    listed = ((pool.get("spec") or {}).get("tenancy") or {}).get("grantNamespaces")
    return [n for n in dict.fromkeys(listed) if isinstance(n, str)] if isinstance(listed, list) else []


async def read_grants(kube: KubeClient, pool: Mapping[str, Any], own_namespace: bool = True) -> list[Grant]:
    """The grants in the pool's namespace (unless ``own_namespace`` is False), and those naming
    it in its ``grantNamespaces`` (none read when the pool uses none). A listed namespace the
    operator cannot read is skipped (validation names it when the operator does not watch it)."""
    if not uses_grants(pool):
        return []
    meta = pool["metadata"]
    own = meta["namespace"]
    grants = [read_grant(obj) for obj in await kube.list(GRANTS, own)] if own_namespace else []
    for other in grant_namespaces(pool):
        if other == own:
            continue
        try:
            found = await kube.list(GRANTS, other)
        except ApiError as exc:
            logger.warning("grants of pool %s/%s in namespace %s: %s", own, meta["name"], other, exc)
            continue
        for obj in found:
            spec = obj.get("spec") or {}
            if spec.get("pool") == meta["name"] and spec.get("poolNamespace") == own:
                grants.append(read_grant(obj))
    return grants


async def refuse_unlisted_grants(
    kube: KubeClient, pool: Mapping[str, Any], watched: Sequence[str], now: str
) -> None:
    """Grants naming the pool from a namespace it does not list (made before the pool, which
    their own handler could not refuse then): told ``NamespaceNotAllowed``. Read cluster-wide
    (``watched`` empty) or in each watched namespace the pool does not list."""
    meta = pool["metadata"]
    own, listed = meta["namespace"], grant_namespaces(pool)
    scopes: list[str | None] = [n for n in watched if n != own and n not in listed] if watched else [None]
    for scope in scopes:
        try:
            found = await kube.list(GRANTS, scope)
        except ApiError as exc:
            logger.warning("grants naming pool %s/%s in %s: %s", own, meta["name"], scope or "all", exc)
            continue
        for obj in found:
            spec, grant_meta = obj.get("spec") or {}, obj.get("metadata") or {}
            if spec.get("pool") != meta["name"] or spec.get("poolNamespace") != own:
                continue
            refusal = namespace_refusal(str(grant_meta.get("namespace")), own, meta["name"], listed)
            if refusal is not None and not grant_meta.get("deletionTimestamp"):
                await refuse_grant(kube, obj, refusal, NAMESPACE_NOT_ALLOWED, now)


async def write_grant_statuses(
    kube: KubeClient,
    pool: str,
    grants: list[Grant],
    plan: Plan,
    now: str,
    observation: Observation | None,
    pool_status: Mapping[str, Any] | None = None,
    keep_usage: bool = False,
) -> None:
    """Each grant of ``pool``: its tenant and ceiling as the master admits it, its usage as
    the last poll (``observation``) counts it, where its consumers stand and the hit rate
    they report (the pool's status, ``pool_status``), or why the pool does not serve it
    (written only when it changed). ``keep_usage``: the usage as the grant's status holds it
    (this process has not polled the master yet: ``first_poll``)."""
    listed_elsewhere = {(c.grant.namespace, c.grant.name): c.listed_elsewhere for c in plan.grant_children}
    pool_consumers = (pool_status or {}).get("consumers") or []
    hits = {str(h.get("grant")): h for h in ((pool_status or {}).get("hits") or {}).get("grants") or []}
    refusal = (
        f"pool {pool} is invalid: " + "; ".join(str(p) for p in plan.problems)
        if plan.problems
        else f"pool {pool} does not have spec.tenancy.enabled"
    )
    for grant in grants:
        if grant.spec is not None and (grant.spec.pool != pool or pool_namespace_of(grant) != plan.namespace):
            continue
        old = dict(await _grant_status_of(kube, grant))
        doubled = listed_elsewhere.get((grant.namespace, grant.name), {})
        consumers = grant_consumer_statuses(grant, pool_consumers, doubled)
        new = grant_status(grant, plan.tenancy, refusal[:1024], plan.master_address, consumers=consumers)
        ref = grant_ref(grant, plan.namespace)
        if plan.tenancy is not None and ref in plan.tenancy.tenants and ref in hits:
            new["hits"] = {k: v for k, v in hits[ref].items() if k != "grant"}
        if plan.tenancy is not None and ref in plan.tenancy.tenants and keep_usage and old.get("usage"):
            new["usage"] = old["usage"]
        elif plan.tenancy is not None and ref in plan.tenancy.tenants:
            usage = grant_usage(
                ref, plan.tenancy.tenants, observation, asked=plan.observed, external=plan.external
            )
            new["usage"] = with_changed_at(usage, old.get("usage"), now)
        await _write_grant_status(kube, grant, old, new, now)


GRANTS_ELSEWHERE = "grantsFromOtherNamespaces"


async def with_grants_elsewhere(
    kube: KubeClient, pool: Mapping[str, Any], status: dict[str, Any], plan: Plan, now: str
) -> dict[str, Any]:
    """``status`` naming the other namespaces' grants the pool serves now; one it served before
    and no longer does (its namespace unlisted, tenancy off) is told so on its status."""
    meta = pool["metadata"]
    tenants = plan.tenancy.tenants if plan.tenancy is not None else {}
    now_served = sorted(ref for ref in tenants if "/" in ref)
    for ref in (pool.get("status") or {}).get(GRANTS_ELSEWHERE) or []:
        if ref in now_served or not isinstance(ref, str) or "/" not in ref:
            continue
        grant_namespace, grant_name = ref.split("/", 1)
        obj = await kube.get(GRANTS, grant_namespace, grant_name)
        spec = (obj or {}).get("spec") or {}
        if obj is None or spec.get("pool") != meta["name"] or spec.get("poolNamespace") != meta["namespace"]:
            continue  # gone, or another pool's now (that pool says so)
        uid = str((obj.get("metadata") or {}).get("uid") or "")
        if uid:  # its consumers' ConfigMap (its Deployments are released by the pass)
            configmap = names.grant_connector_configmap_name(meta["name"], grant_name)
            await ensure_absent(kube, CONFIGMAPS, grant_namespace, configmap, uid)
        unlisted = namespace_refusal(grant_namespace, meta["namespace"], meta["name"], grant_namespaces(pool))
        if unlisted is not None:
            await refuse_grant(kube, obj, unlisted, NAMESPACE_NOT_ALLOWED, now)
        else:
            served = f"pool {meta['namespace']}/{meta['name']} does not serve grants (see its status)"
            await refuse_grant(kube, obj, served, POOL_REFUSES, now)
    out = {k: v for k, v in status.items() if k != GRANTS_ELSEWHERE}
    return {**out, GRANTS_ELSEWHERE: now_served} if now_served else out


async def refuse_grant(
    kube: KubeClient, body: Mapping[str, Any], refusal: str, reason: str, now: str
) -> None:
    """Say on a grant that the pool it names does not serve it (written only when it changed)."""
    await write_refusal(kube, read_grant(body), refusal, reason, now)


async def write_refusal(kube: KubeClient, grant: Grant, refusal: str, reason: str, now: str) -> None:
    """``refuse_grant`` for a grant already read."""
    old = dict(await _grant_status_of(kube, grant))
    await _write_grant_status(kube, grant, old, grant_status(grant, None, refusal[:1024], reason=reason), now)


async def _write_grant_status(
    kube: KubeClient, grant: Grant, old: Mapping[str, Any], new: dict[str, Any], now: str
) -> None:
    previous = {c.get("type"): c for c in old.get("conditions") or []}
    for item in new["conditions"]:
        before = previous.get(item["type"]) or {}
        same = before.get("status") == item["status"]
        item["lastTransitionTime"] = before.get("lastTransitionTime") if same else now
    if new != old:
        await kube.patch(
            GRANTS, grant.namespace, grant.name, {"status": diff(old, new)}, subresource="status"
        )


async def _grant_status_of(kube: KubeClient, grant: Grant) -> Mapping[str, Any]:
    obj = await kube.get(GRANTS, grant.namespace, grant.name)
    return (obj or {}).get("status") or {}


def utcnow() -> str:
    return datetime.datetime.now(datetime.UTC).strftime(TIME_FORMAT)


def error_reason(exc: BaseException) -> str:
    """A short label for the metrics: ``http_409``, ``TimeoutError``, ..."""
    if isinstance(exc, ApiError):
        return f"http_{exc.status}"
    return type(exc).__name__


def announce(old: Mapping[str, Any], new: Mapping[str, Any], notify: Notify) -> None:
    """Post an Event when the spec turns invalid (or its problems change), or valid again;
    when the consumers' rollout stops at a Deployment; for each refusal and each warning the
    status did not name before."""
    before = condition_of(old, "ConfigValid") or {}
    after = condition_of(new, "ConfigValid") or {}
    if after.get("status") == "False":
        if before.get("status") != "False" or before.get("message") != after.get("message"):
            notify("Warning", after.get("reason", "InvalidSpec"), after.get("message", ""))
    elif after.get("status") == "True" and before.get("status") == "False":
        notify("Normal", "ConfigValid", after.get("message", ""))
    master_before = condition_of(old, "MasterReady") or {}
    master = condition_of(new, "MasterReady") or {}
    if master.get("reason") == "NotProtected" and master_before.get("reason") != "NotProtected":
        notify("Warning", "NotStarted", "master and store " + master.get("message", ""))
    rollout_before = condition_of(old, "ConsumersRolledOut") or {}
    rollout = condition_of(new, "ConsumersRolledOut") or {}
    if rollout.get("reason") == "RolloutStalled" and rollout.get("message") != rollout_before.get("message"):
        notify("Warning", "ConsumerRolloutStalled", rollout.get("message", ""))
    if new.get("phase") in ("Degraded", "Error") and new.get("phase") != old.get("phase"):
        kind = "Degraded" if new["phase"] == "Degraded" else "Observed"
        notify("Warning", f"Pool{new['phase']}", (condition_of(new, kind) or {}).get("message", ""))
    elif old.get("phase") in ("Degraded", "Error") and new.get("phase") == "Ready":
        notify("Normal", "PoolRecovered", "the master serves every declared store again")
    pause_before = (condition_of(old, "Paused") or {}).get("status") == "True"
    pause = (condition_of(new, "Paused") or {}).get("status") == "True"
    if pause != pause_before:
        notify("Normal", "Paused" if pause else "Resumed", "nothing is rolled or patched" if pause else "")
    known = set(conflicts_of(old))
    for conflict in conflicts_of(new):
        if conflict not in known:
            notify("Warning", conflict_reason(conflict), conflict)
    for warning in new.get("warnings") or []:
        if warning not in (old.get("warnings") or []):
            notify("Warning", "PoolWarning", warning)


def announce_drain(drain: StoreDrainStatus, notify: Notify) -> None:
    """An Event for a drain that moved to another state (its status message)."""
    if drain.state == GIVEN_UP:
        notify("Warning", "StoreDrainGivenUp", drain.message)
    else:
        notify("Normal", f"Store{drain.state}", drain.message)


def announce_change(child: str, applied: Applied, notify: Notify) -> None:
    """Say which owned fields of a child a patch set, and whether someone else had changed them."""
    fields = ", ".join(applied.changed[:5]) + (" ..." if len(applied.changed) > 5 else "")
    if applied.edited:
        notify("Warning", "DriftCorrected", f"{child}: {fields} edited outside the operator, put back")
    else:
        notify("Normal", "ChildUpdated", f"{child}: {fields} updated")


def consumer_state(
    injection: Injection, rolled_out: bool, message: str, refused: str | None = None, stalled: bool = False
) -> ConsumerState:
    return ConsumerState(
        injection.display_name,
        injection.config_hash,
        injection.layout_fingerprint,
        rolled_out,
        message,
        refused,
        stalled,
    )


def not_rolled(injection: Injection, message: str) -> ConsumerState:
    """A consumer left as it is this pass, and why."""
    return consumer_state(injection, False, message)


def consumer_refusal(deployment: Mapping[str, Any], injection: Injection, mode: str) -> str | None:
    """Why the consumer is refused in ``mode``: consent on the Deployment (patching) or on its
    pod template (pod admission), and what injection cannot do."""
    if mode == POD_ADMISSION:
        found = template_refusal(deployment, injection)
    else:
        found = refusal(
            deployment, injection.pool, pool_namespace=injection.pool_namespace
        ) or injection_refusal(deployment, injection)
    return None if found is None else str(found)


HELD_BACK = "held back: not every object of the pool is its own (see the Conflict condition)"
MISSING = "the Deployment does not exist"
NOT_SERVING = "not rolled: the pool does not serve yet (MasterReady and StoreReady must be True)"


async def roll_consumer(
    kube: KubeClient, namespace: str, injection: Injection, notify: Notify, mode: str = DEPLOYMENT_PATCH
) -> ConsumerState:
    """Patch one consumer (with its consent) when its settings differ; report whether it is
    rolled out, or why it was refused."""

    def state(
        rolled_out: bool, message: str, refused: str | None = None, stalled: bool = False
    ) -> ConsumerState:
        return consumer_state(injection, rolled_out, message, refused, stalled)

    namespace = injection.namespace or namespace
    deployment = await kube.get(DEPLOYMENTS, namespace, injection.deployment)
    if deployment is None:
        return state(False, MISSING)
    refused = consumer_refusal(deployment, injection, mode)
    if refused is not None:
        return state(False, refused, refused)
    if mode == POD_ADMISSION:
        return await restart_consumer(kube, namespace, injection, deployment, notify)
    try:
        patch = inject_patch(deployment, injection)
    except ConsumerError as exc:
        return state(False, str(exc))
    if patch:
        deployment = await kube.patch(DEPLOYMENTS, namespace, injection.deployment, patch)
        notify(
            "Normal",
            "ConsumerUpdated",
            f"{injection.deployment}: connector settings {injection.config_hash} injected",
        )
    if config_hash_of(deployment) != injection.config_hash:
        return state(False, "the Deployment does not carry the current settings")
    progress = deployment_progress(deployment)
    return state(progress.done, progress.message, stalled=progress.stalled)


async def restart_consumer(
    kube: KubeClient, namespace: str, injection: Injection, deployment: dict[str, Any], notify: Notify
) -> ConsumerState:
    """Pod admission: the Deployment is written only when its Pods need a restart for the
    current settings (one annotation on its pod template); its new Pods get them at admission."""
    hashes: list[str] = []
    if config_hash_of(deployment) is None:  # never restarted: what its injected Pods run
        pods = await kube.list(PODS, namespace, label_selector=f"{names.LABEL_POOL}={injection.pool}")
        hashes = pod_config_hashes(pods, injection.deployment)
    patch = restart_patch(deployment, injection, hashes)
    if patch:
        deployment = await kube.patch(DEPLOYMENTS, namespace, injection.deployment, patch)
        notify(
            "Normal",
            "ConsumerRestarted",
            f"{injection.deployment}: restarted for connector settings {injection.config_hash} "
            "(its new Pods get them at admission)",
        )
    if not carries_settings(deployment, injection, hashes) and not runs_nothing(deployment):
        return consumer_state(
            injection, False, "waiting for its Pods to be admitted with the current settings"
        )
    progress = deployment_progress(deployment)
    return consumer_state(injection, progress.done, progress.message, stalled=progress.stalled)


async def check_consumer(
    kube: KubeClient, namespace: str, injection: Injection, mode: str = DEPLOYMENT_PATCH
) -> ConsumerState:
    """A consumer not rolled while the pool does not serve; a refusal is said already."""
    namespace = injection.namespace or namespace
    deployment = await kube.get(DEPLOYMENTS, namespace, injection.deployment)
    if deployment is None:
        return not_rolled(injection, MISSING)
    refused = consumer_refusal(deployment, injection, mode)
    if refused is not None:
        return consumer_state(injection, False, refused, refused)
    return not_rolled(injection, NOT_SERVING)


async def roll_consumers(
    kube: KubeClient,
    namespace: str,
    injections: list[Injection],
    notify: Notify,
    mode: str = DEPLOYMENT_PATCH,
) -> list[ConsumerState]:
    """Roll consumers one Deployment at a time, in the spec's order: the next one is patched
    only once the one before is available with the current settings; the rollout stops at
    the first that does not become available (its progress deadline passed). Refused and
    missing Deployments are skipped (there is nothing to wait for)."""
    states: list[ConsumerState] = []
    waiting_for: str | None = None
    for injection in injections:
        if waiting_for is not None:
            states.append(not_rolled(injection, f"waiting: {waiting_for}"))
            continue
        state = await roll_consumer(kube, namespace, injection, notify, mode)
        states.append(state)
        if state.rolled_out or state.refused or state.message == MISSING:
            continue
        waiting_for = (
            f"the rollout stopped at {injection.deployment}, which did not become available"
            if state.stalled
            else f"{injection.deployment} is rolling out first"
        )
    return states


class GuardedPodsRunning(Exception):
    """Teardown waits: master or store pods of the pool may still run, and its NetworkPolicies
    guard them until they end."""

    def __init__(self, pods: list[str]):
        self.pods = pods
        super().__init__(f"waiting for {', '.join(pods)} to end before the NetworkPolicies go")


class ConsumersNotReleased(ApiError):
    """The API refused to take the pool's settings out of some Deployments (every other one
    was released); the first refusal's status."""

    def __init__(self, namespace: str, refused: list[tuple[str, ApiError]]):
        self.names = [name for name, _ in refused]
        first = refused[0][1]
        kept = f"{namespace}: {', '.join(self.names)} kept the settings"
        super().__init__(first.status, first.reason, kept)


async def release_consumers(
    kube: KubeClient, namespace: str, pool: str, keep: set[str], notify: Notify, pool_namespace: str = ""
) -> list[str]:
    """Take the pool's settings out of Deployments in ``namespace`` it no longer lists; their
    names. ``pool_namespace``: the pool's, when ``namespace`` is a grant's (default: the same).

    One Deployment the API refuses (a webhook, a stale read) never keeps the rest: each is
    tried, each refusal gets an Event, and ``ConsumersNotReleased`` names them at the end."""
    released: list[str] = []
    refused: list[tuple[str, ApiError]] = []
    selector = f"{names.LABEL_CONSUMER_OF}={pool}"
    for deployment in await kube.list(DEPLOYMENTS, namespace, label_selector=selector):
        name = deployment.get("metadata", {}).get("name", "")
        if owner_pool(deployment) != pool or owner_pool_namespace(deployment) != (
            pool_namespace or namespace
        ):
            continue
        if name in keep or managed_by_operator(deployment):
            continue
        problem = restore_problem(deployment)
        try:
            patch = restore_patch(deployment)
        except Exception as exc:  # a Deployment nobody foresaw: say so, never block the rest
            logger.exception("cannot restore %s/%s", namespace, name)
            notify("Warning", "ConsumerNotReleased", f"{name}: its settings could not be taken out ({exc})")
            continue
        if problem is not None:
            notify(
                "Warning",
                "RestoreRecordMalformed",
                f"{name}: its restore record ({names.ANNOTATION_RESTORE}) is unreadable ({problem}): "
                "the pool's settings are taken out, what they replaced cannot be put back",
            )
        if patch:
            try:
                await kube.patch(DEPLOYMENTS, namespace, name, patch)
            except ApiError as exc:
                if exc.status == 404:  # deleted since the list: nothing of the pool's is left in it
                    continue
                logger.warning("releasing %s/%s from pool %s: %s", namespace, name, pool, exc)
                if not exc.conflict:  # a stale read is tried again, not reported
                    message = f"{name}: its settings could not be taken out ({exc})"
                    notify("Warning", "ConsumerNotReleased", message)
                refused.append((name, exc))
                continue
            notify("Normal", "ConsumerReleased", f"{name}: connector settings removed")
        released.append(name)
    if refused:
        raise ConsumersNotReleased(namespace, refused)
    return released


async def converge(
    kube: KubeClient,
    pool: Mapping[str, Any],
    plan: Plan,
    notify: Notify,
    now: str,
    leader_check: LeaderCheck | None = None,
    mode: str = DEPLOYMENT_PATCH,
    observation: Observation | None = None,
    first_poll_pending: bool = False,
) -> dict[str, Any]:
    """Apply a valid plan to what the pool owns; the status it leads to. ``mode``: how
    consumers get their settings (Deployment patching, or Pod admission); ``observation``:
    the last poll of the pool's master (the observation timer's, never made here);
    ``first_poll_pending``: this process has not polled it yet, and what the poll decides is
    kept as the status holds it (``first_poll``)."""
    meta = pool.get("metadata", {})
    name, namespace, uid = meta["name"], meta["namespace"], meta["uid"]
    scale = await store_scale_of(kube, plan, uid, pool.get("status") or {}, observation, now)
    scale_down = announce_scale_down(scale, observation, notify, now)
    live: dict[str, dict[str, Any]] = {}
    refused: set[str] = set()
    conflicts: list[str] = []
    components = {f"Deployment/{names.component_name(name, c)}" for c in (names.MASTER, names.STORE)}
    guard = f"NetworkPolicy/{names.network_policy_name(name)}"
    unprotected = False
    # NetworkPolicies first: while the pool's cannot be applied, master and store do not run.
    for child in sorted(plan.children, key=lambda c: c["kind"] != "NetworkPolicy"):
        obj = copy.deepcopy(child)
        key = f"{obj['kind']}/{obj['metadata']['name']}"
        if unprotected and key in components:
            obj["spec"]["replicas"] = 0
        elif key == f"Deployment/{names.store_name(name)}" and scale.replicas is not None:
            obj["spec"]["replicas"] = scale.replicas  # held while the leaving pods drain
        kopf.adopt(obj, owner=dict(pool))
        applied = await ensure(kube, obj, uid)
        if applied.conflict is not None:
            conflicts.append(applied.conflict)
            refused.add(key)
            unprotected = unprotected or key == guard
        elif applied.live is not None:
            live[key] = applied.live
        if applied.changed:
            announce_change(key, applied, notify)
    for resource, child_name in plan.absent:
        await ensure_absent(kube, resource, namespace, child_name, uid)
    held: set[str] = set()  # grants' namespaces whose ConfigMap is not the grant's own
    for grant_child in plan.grant_children:
        owned = grant_child.owned()
        applied = await ensure(kube, owned, grant_child.grant.uid)
        if applied.conflict is not None:
            conflicts.append(applied.conflict)
            held.add(grant_child.grant.namespace)
        elif applied.changed:
            where = f"ConfigMap/{grant_child.grant.namespace}/{owned['metadata']['name']}"
            announce_change(where, applied, notify)
    blocked = frozenset(
        component
        for component in (names.MASTER, names.STORE)
        if f"Deployment/{names.component_name(name, component)}" in refused
    )
    leader = await leader_check(plan) if plan.ha and leader_check is not None else None
    master = live.get(f"Deployment/{names.master_name(name)}")
    store = live.get(f"Deployment/{names.store_name(name)}")
    old = pool.get("status") or {}
    # An external pool's MasterReady/StoreReady are its master's answer: none yet, the last one stands.
    answer = kept_conditions(old, EXTERNAL_CONDITIONS) if first_poll_pending and plan.external else None
    ready: tuple[Condition, Condition]
    if answer is not None:
        ready = (answer[0], answer[1])
    elif plan.external:
        ready = external_conditions(plan.observed, observation, plan.embedded)
    else:
        ready = (
            master_condition(master, names.MASTER in blocked, plan.ha, leader, unprotected),
            store_condition(store, names.STORE in blocked, plan.embedded, unprotected),
        )
    serves = pool_serves(*ready)
    if refused:
        # A consumer pointed at a Service or ConfigMap that is not the pool's would send its
        # KV elsewhere: no consumer is changed until every child is the pool's own.
        consumers = [not_rolled(c, HELD_BACK) for c in plan.consumers]
    elif not serves:
        # A connector that cannot reach its pool fails vLLM's start: roll only onto a pool that serves.
        consumers = [await check_consumer(kube, namespace, c, mode) for c in plan.consumers]
    else:
        ready_ones = [c for c in plan.consumers if c.namespace not in held]
        rolled = iter(await roll_consumers(kube, namespace, ready_ones, notify, mode))
        consumers = [
            not_rolled(c, HELD_BACK) if c.namespace in held else next(rolled) for c in plan.consumers
        ]
    conflicts += [c.refused for c in consumers if c.refused]
    # Pod admission patches no Deployment: what patching put in one before is taken out,
    # but from a refused one (its owner has yet to move the label onto its pod template),
    # and not before the pool serves (taking it out rolls the consumer, and admission
    # refuses the new Pods until then).
    admits = serves and not refused
    keep = {c.name for c in consumers if mode == DEPLOYMENT_PATCH or c.refused or not admits}
    # A Deployment the API refused to release has its Event; the pass goes on to write the
    # status, and the next pass (its change, or the resync) tries it again.
    with contextlib.suppress(ConsumersNotReleased):
        await release_consumers(kube, namespace, name, keep, notify)
    for other in consumer_namespaces(pool, plan):
        prefix = f"{other}/"
        kept = {n.removeprefix(prefix) for n in keep if n.startswith(prefix)}
        try:
            await release_consumers(kube, other, name, kept, notify, pool_namespace=namespace)
        except ConsumersNotReleased:
            pass
        except ApiError as exc:  # a namespace the operator no longer reads: said by validation
            logger.warning("releasing consumers of %s/%s in %s: %s", namespace, name, other, exc)
    status = valid_status(
        master_address=plan.master_address,
        master=master,
        store=store,
        embedded=plan.embedded,
        consumers=consumers,
        old=pool.get("status") or {},
        generation=meta.get("generation"),
        now=now,
        ha=plan.ha,
        leader=leader,
        conflicts=conflicts,
        blocked=blocked,
        warnings=[str(w) for w in plan.warnings],
        unprotected=unprotected,
        components=ready,
        last_scale_down=scale_down,
        store_drain=dump(scale.drain),
    )
    return observed_status(status, old, observation, plan, now, first_poll_pending)


def observed_status(
    status: Mapping[str, Any],
    old: Mapping[str, Any],
    observation: Observation | None,
    plan: Plan,
    now: str,
    first_poll_pending: bool = False,
) -> dict[str, Any]:
    """``status`` with what the last poll of the plan's master found (``apply_observation``);
    ``first_poll_pending``: ``Observed`` and ``Degraded`` as ``old`` holds them instead."""
    return apply_observation(
        status,
        old,
        observation,
        asked=plan.observed,
        external=plan.external,
        expected=plan.store_replicas,
        now=now,
        tenants=plan.tenancy.tenants if plan.tenancy is not None else None,
        held=kept_conditions(old, POLL_CONDITIONS) if first_poll_pending else None,
    )


async def store_scale_of(
    kube: KubeClient,
    plan: Plan,
    uid: str,
    status: Mapping[str, Any],
    observation: Observation | None,
    now: str,
) -> StoreScale:
    """The store replicas this pass applies, from the live store Deployment (the pool's own),
    ``status.storeDrain`` and, while the leaving pods drain, which store pods are ready."""
    if plan.store_replicas is None:
        return StoreScale(None)
    live = await kube.get(DEPLOYMENTS, plan.namespace, names.store_name(plan.pool))
    meta = (live or {}).get("metadata") or {}
    owned = any(ref.get("uid") == uid for ref in meta.get("ownerReferences") or [])
    replicas = ((live or {}).get("spec") or {}).get("replicas") if owned else None
    before = replicas if isinstance(replicas, int) else None
    record = record_of(status)
    ready: list[str] = []
    unready: list[str] = []
    if record is not None and record.state == DRAINED:
        selector = names.label_selector(plan.pool, names.STORE)
        for pod in await kube.list(PODS, plan.namespace, label_selector=selector):
            pod_meta = pod.get("metadata") or {}
            if not pod_meta.get("deletionTimestamp") and not ended(pod):  # the controller counts neither
                (ready if pod_ready(pod) else unready).append(str(pod_meta.get("name")))
    return store_scale(plan, before, record, observation, ready, now, unready)


def announce_scale_down(
    scale: StoreScale, observation: Observation | None, notify: Notify, now: str
) -> dict[str, Any] | None:
    """When this pass applies fewer store pods: say what the leaving ones take with them (an
    Event ``StoreScaleDown``, and ``status.lastScaleDown``; nothing when they were drained);
    None when this is no scale-down. A drain this pass begins is announced
    (``StoreDrainPending``)."""
    before, ended = scale.before, scale.ended
    if scale.begins and scale.drain is not None:
        notify("Normal", "StoreDrainPending", scale.drain.message)
    if before is None or scale.replicas is None or scale.replicas >= before:
        return None
    if ended is not None and ended.state == DRAINED:
        message = drained_message(ended, scale.stayed_ready, scale.unready_kept)
        notify("Warning" if scale.warns else "Normal", "StoreScaleDown", message)
    else:
        message = scale_down_message(before, scale.replicas, observation)
        if ended is not None:
            message = f"{message} (the drain was given up: {ended.message})"
        notify("Warning", "StoreScaleDown", message)
    return {"at": now, "fromReplicas": before, "toReplicas": scale.replicas, "message": message}


class Reconciler:
    """Reconciles and tears down pools for one running operator: its client, metrics, policy,
    how it asks HA masters for their leader, per-pool locks."""

    def __init__(
        self,
        kube: KubeClient,
        metrics: OperatorMetrics,
        policy: OperatorPolicy | None = None,
        master_health_url: str = SERVICE_HEALTH_URL,
        leader_timeout: float = 3.0,
        injection_mode: str = DEPLOYMENT_PATCH,
        observe_timeout: float = 3.0,
        addresses_ttl: float = 15.0,
        observe_interval: float = 15.0,
    ):
        self.kube = kube
        self.addresses_ttl = addresses_ttl
        self._addresses: tuple[float, PoolAddresses] | None = None
        self._addresses_lock = asyncio.Lock()
        self.injection_mode = injection_mode
        self.metrics = metrics
        self.policy = policy or OperatorPolicy()
        self.master_health_url = master_health_url
        self.leader_timeout = leader_timeout
        self.observe_timeout = observe_timeout
        # The last poll of each pool's master (the observation timer's).
        self.observations: dict[tuple[str, str], Observation] = {}
        # When a pass first found no poll of a pool's master (``first_poll``), loop time.
        self._unpolled_since: dict[tuple[str, str], float] = {}
        self.first_poll_bound = first_poll_bound(observe_interval, observe_timeout)
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}
        # The pool generation whose unlisted grants were last looked for (``refuse_unlisted_grants``).
        self._swept: dict[tuple[str, str], int | None] = {}
        self._queued: set[tuple[str, str]] = set()

    async def check_leader(self, plan: Plan) -> LeaderView:
        """Ask the pool's masters whether their leader serves (a leader only at one of the
        pool's own master pods' IPs)."""
        url = health_url(self.master_health_url, plan.pool, plan.namespace, plan.metrics_port)
        pods = await self.kube.list(PODS, plan.namespace, label_selector=master_pods_selector(plan.pool))
        return await check_leader(url, plan.metrics_port, pod_ips(pods), self.leader_timeout)

    def _lock(self, namespace: str, name: str) -> asyncio.Lock:
        return self._locks.setdefault((namespace, name), asyncio.Lock())

    def _failed(self, trigger: str, exc: BaseException) -> None:
        self.metrics.reconciles.labels(trigger, "error").inc()
        self.metrics.errors.labels(trigger, error_reason(exc)).inc()

    def queued(self, namespace: str, name: str) -> bool:
        """Whether a pass over the pool waits to begin (it will read the newest state)."""
        return (namespace, name) in self._queued

    async def reconcile(
        self, body: Mapping[str, Any], trigger: str, notify: Notify, coalesce: bool = False
    ) -> dict[str, Any] | None:
        """One pass over the pool ``body`` names; its status, or None if it is gone (or, with
        ``coalesce``, when a pass that had not begun yet was already waiting)."""
        meta = body.get("metadata", {})
        namespace, name = meta["namespace"], meta["name"]
        if coalesce:
            if self.queued(namespace, name):
                return None
            self._queued.add((namespace, name))
        async with self._lock(namespace, name):
            self._queued.discard((namespace, name))
            with self.metrics.duration.labels(trigger).time():
                try:
                    outcome = await self._pass(namespace, name, notify)
                except Exception as exc:
                    self._failed(trigger, exc)
                    raise
            if outcome is None:
                return None
            status, valid, mode = outcome
            self.metrics.reconciles.labels(trigger, "success" if valid else "invalid").inc()
            self.metrics.observe_pool(namespace, name, status, mode)
            return status

    async def _pass(
        self, namespace: str, name: str, notify: Notify
    ) -> tuple[dict[str, Any], bool, str] | None:
        """Read the pool fresh, converge it, write its status if it changed; (status, valid,
        the pool's mode for the metrics)."""
        pool = await self.kube.get(POOLS, namespace, name)
        if pool is None or pool.get("metadata", {}).get("deletionTimestamp"):
            return None
        old = dict(pool.get("status") or {})
        valid = True
        if paused(pool):
            status = paused_status(old, utcnow())
        else:
            network = await read_namespace_network(self.kube, pool)
            generation = pool["metadata"].get("generation")
            if self._swept.get((namespace, name)) != generation:  # once per spec
                await refuse_unlisted_grants(self.kube, pool, self.policy.watched_namespaces, utcnow())
                self._swept[(namespace, name)] = generation
            grants = await read_grants(self.kube, pool)
            plan = build_plan(name, namespace, pool.get("spec"), self.policy, network, grants)
            valid = plan.valid
            observation = self.observation_of(plan)
            pending = self.first_poll_pending(plan, old, pool["metadata"].get("generation"))
            if plan.valid:
                status = await converge(
                    self.kube,
                    pool,
                    plan,
                    notify,
                    utcnow(),
                    self.check_leader,
                    self.injection_mode,
                    observation,
                    pending,
                )
            else:
                status = invalid_status(plan.problems, old, pool["metadata"].get("generation"), utcnow())
            # After the policy is applied: a grant says what the master was told.
            await write_grant_statuses(
                self.kube, name, grants, plan, utcnow(), observation, status, keep_usage=pending
            )
            if plan.valid:
                status = await with_grants_elsewhere(self.kube, pool, status, plan, utcnow())
            elif GRANTS_ELSEWHERE in old:  # an invalid spec changes nothing it served elsewhere
                status = {**status, GRANTS_ELSEWHERE: old[GRANTS_ELSEWHERE]}
        if status != old:
            await self.kube.patch(POOLS, namespace, name, {"status": diff(old, status)}, subresource="status")
            announce(old, status, notify)
        return status, valid, pool_mode(pool.get("spec"))

    async def teardown(self, body: Mapping[str, Any], notify: Notify) -> None:
        """A pool is being deleted: take its settings out of every consumer, delete its children,
        the NetworkPolicies last, once the master and store pods they guard may no longer run
        (``teardown_order``; until then ``GuardedPodsRunning``: teardown is tried again).

        A consumer whose restore record is unreadable loses the pool's settings and gets an
        Event; teardown goes on. The escape hatch, when teardown cannot finish (an API that
        keeps refusing): the annotation ``kvpool.mooncake.io/skip-teardown: "true"`` lets the
        pool go at once; its children are then removed by the garbage collector (owner
        references) and consumers are left as they are.

        A pool the operator may no longer read (403: the Role in its namespace is gone, as it is
        first thing when the namespace is deleted) is let go of (``let_go_of_namespace``)."""
        meta = body.get("metadata", {})
        namespace, name = meta["namespace"], meta["name"]
        async with self._lock(namespace, name):
            current: Mapping[str, Any] | None
            try:
                current = await self.kube.get(POOLS, namespace, name)
                reachable = True
            except ApiError as exc:
                # A read is refused by authorisation only (admission sees writes): the rights
                # the operator had in the namespace are gone. Nothing there can be done; waiting
                # would keep the pool, and so a namespace being deleted, forever.
                if exc.status != 403:
                    raise
                current, reachable, notify = body, False, logged(namespace, name)
            if current is not None and skips_teardown(current):
                notify(
                    "Warning",
                    "TeardownSkipped",
                    f"{names.ANNOTATION_SKIP_TEARDOWN}=true: consumers keep the pool's settings "
                    "(see their kvpool.mooncake.io/consumer-of label); children go with the pool",
                )
                self.metrics.forget_pool(namespace, name)
                self.forget_polls(namespace, name)
                self._locks.pop((namespace, name), None)
                return
            try:
                if reachable:
                    await self.release_every_consumer(body, notify)
                    await self.forget_grants(body)
                    await self.remove_children(body, unguarded_children(name), notify)
                    await self.wait_for_guarded_pods(body, notify)
                    await self.remove_children(body, guards(name), notify)
                else:
                    await self.let_go_of_namespace(body, notify)
            except GuardedPodsRunning:
                raise
            except Exception as exc:
                self._failed("delete", exc)
                raise
            self.metrics.reconciles.labels("delete", "success").inc()
            self.metrics.forget_pool(namespace, name)
            self.forget_polls(namespace, name)
            self._swept.pop((namespace, name), None)
            self._locks.pop((namespace, name), None)

    async def remove_children(
        self, body: Mapping[str, Any], children: list[tuple[ApiResource, str]], notify: Notify
    ) -> None:
        """Delete those of ``children`` the pool owns; one it does not own is left alone."""
        meta = body["metadata"]
        for resource, child_name in children:
            removal = await ensure_absent(self.kube, resource, meta["namespace"], child_name, meta["uid"])
            if removal.conflict is not None:
                notify("Normal", "NotOwned", f"left alone: {removal.conflict}")

    async def guards_standing(self, body: Mapping[str, Any]) -> bool:
        """Whether one of the pool's own NetworkPolicies is still there (one it does not own
        is left alone by teardown, so none to keep)."""
        meta = body["metadata"]
        for resource, name in guards(meta["name"]):
            live = await self.kube.get(resource, meta["namespace"], name)
            if live is not None and owned_by(live, meta["uid"]):
                return True
        return False

    async def wait_for_guarded_pods(self, body: Mapping[str, Any], notify: Notify) -> None:
        """Raise ``GuardedPodsRunning`` (teardown is tried again) while a master or store pod of
        the pool may still run, for at most ``GUARD_WAIT_S`` past the start of its deletion;
        past that, a Warning names the pods its NetworkPolicies stop guarding. A pool with no
        NetworkPolicy of its own left (they are off) has nothing to keep: no wait."""
        meta = body["metadata"]
        if not await self.guards_standing(body):
            return
        pods: list[dict[str, Any]] = []
        for selector in guarded_selectors(meta["name"]):
            pods += await self.kube.list(PODS, meta["namespace"], label_selector=selector)
        now = utcnow()
        running = running_pods(pods, now)
        if guards_wait(running, str(meta.get("deletionTimestamp") or now), now):
            raise GuardedPodsRunning(running)
        if running:
            notify(
                "Warning",
                "GuardsRemoved",
                f"the pool's NetworkPolicies are deleted while {', '.join(running)} may still run "
                f"({GUARD_WAIT_S} s after its deletion began): they no longer keep others from them",
            )

    async def let_go_of_namespace(self, body: Mapping[str, Any], notify: Notify) -> None:
        """Teardown without rights in the pool's namespace (its Role is gone, as when the
        namespace is being deleted): what can still be reached is done, and the pool goes (kopf
        patches its finalizer away: the chart's finalizer ClusterRole allows that patch alone).

        Its consumers and grants' ConfigMaps in other namespaces are released and deleted as
        always; in its own namespace its children go with it (owner references) and its
        consumers keep the pool's settings (in a namespace being deleted they go too)."""
        meta = body["metadata"]
        logger.warning(
            "pool %s/%s: the operator may no longer read it (its Role in %s is gone: is the namespace "
            "being deleted?); releasing what it reaches elsewhere, leaving the rest to the namespace",
            meta["namespace"],
            meta["name"],
            meta["namespace"],
        )
        await self.release_every_consumer(body, notify, own_namespace=False)
        await self.forget_grants(body, own_namespace=False)

    async def release_every_consumer(
        self, body: Mapping[str, Any], notify: Notify, own_namespace: bool = True
    ) -> None:
        """Teardown's first step: the pool's settings out of its consumers, in its namespace
        (unless ``own_namespace`` is False) and its grants'. Every namespace is tried; a
        Deployment that kept them fails the step (the teardown is tried again; the pool's
        children stay while a consumer points at them)."""
        meta = body["metadata"]
        refused: list[ConsumersNotReleased] = []
        own = [meta["namespace"]] if own_namespace else []
        for other in (*own, *consumer_namespaces(body)):
            pool_namespace = "" if other == meta["namespace"] else meta["namespace"]
            try:
                await release_consumers(self.kube, other, meta["name"], set(), notify, pool_namespace)
            except ConsumersNotReleased as exc:
                refused.append(exc)
            except ApiError as exc:
                if other == meta["namespace"] or exc.status not in (403, 404):
                    raise  # tried again: a consumer there may still point at the pool's children
                logger.warning(  # a namespace the operator no longer reads: said by validation
                    "releasing consumers of %s/%s in %s: %s", meta["namespace"], meta["name"], other, exc
                )
        if refused:
            raise refused[0]

    async def forget_grants(self, body: Mapping[str, Any], own_namespace: bool = True) -> None:
        """Teardown in the grants' namespaces: the ConfigMaps the pool wrote for them deleted
        (the grants stay: they are the tenants'; their status says the pool is gone). The
        grants of the pool's own namespace are left out when ``own_namespace`` is False."""
        meta = body["metadata"]
        gone = f"pool {meta['namespace']}/{meta['name']} is deleted"
        for grant in await read_grants(self.kube, body, own_namespace):
            if grant.namespace != meta["namespace"] and grant.uid:
                configmap = names.grant_connector_configmap_name(meta["name"], grant.name)
                await ensure_absent(self.kube, CONFIGMAPS, grant.namespace, configmap, grant.uid)
            if grant.spec is None or grant.spec.pool != meta["name"]:
                continue  # another pool's grant (read_grants reads its whole namespace)
            if pool_namespace_of(grant) != meta["namespace"]:
                continue
            try:  # the grant stays; its status stops claiming a share
                await write_refusal(self.kube, grant, gone, POOL_NOT_FOUND, utcnow())
            except ApiError as exc:
                if exc.status != 404:
                    raise

    def master_base(self, plan: Plan) -> str:
        """``http://host:port`` of the pool's own master Service's HTTP port."""
        return base_of(health_url(self.master_health_url, plan.pool, plan.namespace, plan.metrics_port))

    def drain_base(self, plan: Plan, observation: Observation | None) -> str:
        """Where drain jobs go: the pool's master Service; with HA, the leader the last poll
        found at one of the pool's own master pods (a standby takes no job)."""
        return drain_base(plan.ha, observation, self.master_base(plan))

    async def step_drain(
        self, plan: Plan, drain: StoreDrainStatus, observation: Observation | None
    ) -> StoreDrainStatus | None:
        """The drain one step further (``drain_timer``), outside the pool's lock."""
        base = self.drain_base(plan, observation)
        return await advance(drain, observation, base, utcnow(), self.observe_timeout)

    async def forget_drain_job(
        self, plan: Plan, drain: StoreDrainStatus, observation: Observation | None
    ) -> None:
        """Cancel a drain job no status names (best effort: a job that finished refuses)."""
        if drain.job_id is not None:
            with contextlib.suppress(DrainRefused):
                await cancel_drain_job(self.drain_base(plan, observation), drain.job_id, self.observe_timeout)

    def poll_target(self, plan: Plan) -> tuple[Any, ...]:
        """What a poll of ``plan``'s master asks, and what its answer vouches for."""
        if plan.external:
            return ("external", plan.master_address, plan.metrics_endpoints)
        return ("pool", self.master_base(plan), plan.metrics_port, plan.ha)

    def forget_polls(self, namespace: str, name: str) -> None:
        """A pool gone: its last poll, and when a pass first found none."""
        self.observations.pop((namespace, name), None)
        self._unpolled_since.pop((namespace, name), None)

    def first_poll_pending(self, plan: Plan, status: Mapping[str, Any], generation: int | None) -> bool:
        """Whether a pass keeps what the poll decides as ``status`` holds it: this process has
        not polled the pool's master yet, for less than ``first_poll_bound`` (``first_poll``)."""
        key = (plan.namespace, plan.pool)
        polled = key in self.observations
        now = asyncio.get_running_loop().time()
        since = now if polled else self._unpolled_since.setdefault(key, now)
        return holds_for_first_poll(
            asked=plan.observed,
            polled=polled,
            waited=now - since,
            bound=self.first_poll_bound,
            status=status,
            generation=generation,
        )

    def observation_of(self, plan: Plan) -> Observation | None:
        """The last poll of the pool's master, if it asked what ``plan`` names: after a spec
        change (another external master, another port) an older answer vouches for nothing,
        and no consumer is rolled on it before the next poll."""
        observation = self.observations.get((plan.namespace, plan.pool))
        if observation is None or observation.asked != self.poll_target(plan):
            return None
        return observation

    async def poll(self, plan: Plan) -> Observation:
        """One poll of the pool's master, within ``observe_timeout`` (no lock held), with what
        it asked (:meth:`poll_target`)."""
        now = utcnow()
        if plan.external:
            return replace(await self.poll_external(plan, now), asked=self.poll_target(plan))
        stores = await self.kube.list(
            PODS,
            plan.namespace,
            label_selector=names.label_selector(plan.pool, names.STORE),
        )
        # An ended pod (evicted: phase Failed) keeps its IP in the API, where a new pod may have it.
        store_pods = {
            str(ip): str((pod.get("metadata") or {}).get("name"))
            for pod in stores
            if not ended(pod)
            for ip in pod_ips([pod])
        }
        masters = None
        if plan.ha:
            masters = pod_ips(
                await self.kube.list(PODS, plan.namespace, label_selector=master_pods_selector(plan.pool))
            )
        observation = await poll_master(
            [self.master_base(plan)],
            now=now,
            timeout=self.observe_timeout,
            master_ips=masters,
            metrics_port=plan.metrics_port,
            store_pods=store_pods,
        )
        return replace(observation, asked=self.poll_target(plan))

    async def pool_addresses(self) -> PoolAddresses:
        """The addresses of the pools this operator runs (``external_guard``), read at most once
        per ``addresses_ttl`` for every external pool's poll together."""
        async with self._addresses_lock:
            now = asyncio.get_running_loop().time()
            if self._addresses is None or now - self._addresses[0] >= self.addresses_ttl:
                found = await pool_addresses(self.kube, self.policy.watched_namespaces)
                self._addresses = (asyncio.get_running_loop().time(), found)
            return self._addresses[1]

    async def poll_external(self, plan: Plan, now: str) -> Observation:
        """An external pool's master, asked only at addresses that lead to no pool this
        operator runs in another namespace (``external_guard``), all within ``observe_timeout``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.observe_timeout
        try:
            async with asyncio.timeout_at(deadline):
                elsewhere = elsewhere_of(await self.pool_addresses(), plan.namespace)
        except (ApiError, TimeoutError) as exc:
            problem = f"the pools this operator runs could not be read ({exc or 'timeout'}): not asked"
            return Observation(now, problem=problem, reason="Unreachable")
        vetted = await vet_endpoints(
            plan.metrics_endpoints,
            elsewhere,
            max(0.0, deadline - loop.time()),
            field_name="spec.external.metricsEndpoints",
        )
        if vetted.problem is not None:
            return Observation(now, problem=vetted.problem, reason=vetted.reason)
        bases = [f"http://{endpoint}" for endpoint in plan.metrics_endpoints]
        resolver = PinnedResolver(vetted.addresses)
        left = max(0.1, deadline - loop.time())
        return await poll_master(bases, now=now, timeout=left, resolver=resolver)

    async def poll_hits(self, plan: Plan) -> dict[str, Any] | None:
        """``status.hits`` from the consumers' own ``/metrics`` (None: no consumer pod is ready):
        the ready pods of each consumer the pool rolled, in its namespace or its grant's, asked
        within ``observe_timeout``; per grant too where tenancy is on."""
        if not plan.consumers:
            return None
        by_namespace: dict[str, list[Injection]] = {}
        for injection in plan.consumers:
            by_namespace.setdefault(injection.namespace or plan.namespace, []).append(injection)
        asked: dict[str, int] = {}
        targets = []
        for namespace, injections in by_namespace.items():
            # Another namespace's pods and Deployments also name the pool's namespace (a pool
            # of the same name there is another pool).
            own = namespace == plan.namespace
            theirs = "" if own else f",{names.LABEL_POOL_NAMESPACE}={plan.namespace}"
            try:
                pods = await self.kube.list(
                    PODS,
                    namespace,
                    label_selector=f"{names.LABEL_POOL}={plan.pool},!{names.LABEL_COMPONENT}{theirs}",
                )
                # The consumer Deployments this pool patched (they carry its label), in one call.
                patched = f"{names.LABEL_CONSUMER_OF}={plan.pool}{theirs}"
                rolled = {
                    str((d.get("metadata") or {}).get("name")): d
                    for d in await self.kube.list(DEPLOYMENTS, namespace, label_selector=patched)
                }
            except ApiError as exc:
                if own:
                    raise
                logger.warning("consumers of %s/%s in %s: %s", plan.namespace, plan.pool, namespace, exc)
                continue
            for injection in injections:
                deployment = rolled.get(injection.deployment)
                selector = (deployment or {}).get("spec", {}).get("selector")
                if not selector:
                    continue
                found = consumer_pods(
                    injection.display_name,
                    [p for p in pods if selects(selector, (p.get("metadata") or {}).get("labels") or {})],
                )
                asked[injection.display_name] = len(found)
                targets += found
        if not targets:
            return None  # no consumer pod is ready: nothing to report
        answers = await poll_consumers(targets, timeout=self.observe_timeout)
        grants = {c.display_name: c.grant for c in plan.consumers if c.grant}
        return hits_status([c.display_name for c in plan.consumers], answers, asked, grants)

    async def observe(self, body: Mapping[str, Any], notify: Notify) -> None:
        """The observation timer: poll the pool's master and its consumers (outside the pool's
        lock), keep the answer, and write what it changes in the status (capacity, ``Observed``,
        ``Degraded``, the phase, the consumers' hits). When it changes whether an external pool
        serves, a pass follows (its consumers are rolled only onto a pool that serves)."""
        meta = body.get("metadata", {})
        namespace, name = meta["namespace"], meta["name"]
        grants = await read_grants(self.kube, body)
        plan = build_plan(name, namespace, body.get("spec"), self.policy, grants=grants)
        key = (namespace, name)
        if not plan.valid or paused(body):
            self.observations.pop(key, None)
            return
        observation = await self.poll(plan) if plan.observed else None
        if observation is None:
            self.observations.pop(key, None)
        hits = await self.poll_hits(plan)
        before = self.observations.get(key)
        if observation is not None:
            self.observations[key] = observation
        drain = record_of(body.get("status") or {}) if plan.store_replicas is not None else None
        stepped = None if drain is None else await self.step_drain(plan, drain, observation)
        async with self._lock(namespace, name):
            pool = await self.kube.get(POOLS, namespace, name)
            if pool is None or pool.get("metadata", {}).get("deletionTimestamp") or paused(pool):
                return
            old = dict(pool.get("status") or {})
            if (condition_of(old, "ConfigValid") or {}).get("status") != "True":
                return  # not applied yet, or invalid: the next pass writes the observation
            now = utcnow()
            status = old if observation is None else observed_status(old, old, observation, plan, now)
            status = with_hits(status, hits, now)
            drain_moved, orphan = False, None
            if drain is not None:
                if record_of(old) == drain:
                    status = {k: v for k, v in status.items() if k != "storeDrain"}
                    if stepped is not None:
                        status["storeDrain"] = dump(stepped)
                    drain_moved = stepped is None or stepped.state != drain.state
                    if drain_moved and stepped is not None:
                        announce_drain(stepped, notify)
                elif stepped is not None and stepped.job_id and drain.job_id is None:
                    orphan = stepped  # a pass moved on while this step asked for a job
            if plan.tenancy is not None and (observation is not None or hits is not None):
                # Each grant's usage and hits from the same poll (written when they changed),
                # before the pool's, as a pass writes them: whoever reads the pool's new
                # numbers finds its grants' already there.
                await write_grant_statuses(self.kube, name, grants, plan, utcnow(), observation, status)
            if status != old:
                await self.kube.patch(
                    POOLS, namespace, name, {"status": diff(old, status)}, subresource="status"
                )
                announce(old, status, notify)
                self.metrics.observe_pool(namespace, name, status, pool_mode(pool.get("spec")))
        if orphan is not None:
            await self.forget_drain_job(plan, orphan, observation)  # outside the lock: give the job back
        if drain_moved:
            # A drain moved on: the pass applies what it leads to (fewer pods, or as before).
            await self.reconcile(pool, "observe", notify, coalesce=True)
            return
        if observation is None:
            return
        if plan.external and (before is None or before.answered != observation.answered):
            await self.reconcile(pool, "observe", notify, coalesce=True)
