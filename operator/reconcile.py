"""One level-based pass over a pool: apply the plan, roll consumers, compute the status.

Everything here is idempotent: a pass over an unchanged, converged pool reads but
never writes. An invalid spec changes nothing but the status.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import kopf

from kvpool.operator import names
from kvpool.operator.apply import ensure, ensure_absent
from kvpool.operator.consumers import (
    ConsumerError,
    Injection,
    config_hash_of,
    inject_patch,
    owner_pool,
    restore_patch,
)
from kvpool.operator.kube import Kube
from kvpool.operator.plan import Plan, build_plan, children_names
from kvpool.operator.resources import DEPLOYMENTS
from kvpool.operator.status import ConsumerState, deployment_progress, invalid_status, valid_status

# notify(type, reason, message): post a Kubernetes Event about the pool.
Notify = Callable[[str, str, str], None]


@dataclass(frozen=True)
class Result:
    """The pass's outcome: the status to have, and the plan it came from."""

    status: dict[str, Any]
    plan: Plan


async def roll_consumer(kube: Kube, namespace: str, injection: Injection, notify: Notify) -> ConsumerState:
    """Patch one consumer when its settings differ; report whether it is rolled out."""

    def state(rolled_out: bool, message: str) -> ConsumerState:
        return ConsumerState(
            injection.deployment, injection.config_hash, injection.layout_fingerprint, rolled_out, message
        )

    deployment = await kube.get(DEPLOYMENTS, namespace, injection.deployment)
    if deployment is None:
        return state(False, "the Deployment does not exist")
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
    return state(progress.done, progress.message)


async def release_consumers(
    kube: Kube, namespace: str, pool: str, keep: set[str], notify: Notify
) -> list[str]:
    """Take the pool's settings out of Deployments it no longer lists; their names."""
    released = []
    selector = f"{names.LABEL_CONSUMER_OF}={pool}"
    for deployment in await kube.list(DEPLOYMENTS, namespace, label_selector=selector):
        name = deployment.get("metadata", {}).get("name", "")
        if owner_pool(deployment) != pool or name in keep:
            continue
        patch = restore_patch(deployment)
        if patch:
            await kube.patch(DEPLOYMENTS, namespace, name, patch)
            notify("Normal", "ConsumerReleased", f"{name}: connector settings removed")
        released.append(name)
    return released


async def reconcile(kube: Kube, pool: Mapping[str, Any], *, now: str, notify: Notify) -> Result:
    """Converge one pool (a fresh copy of the object) and compute its status."""
    meta = pool.get("metadata", {})
    name, namespace = meta["name"], meta["namespace"]
    generation = meta.get("generation")
    old_status = dict(pool.get("status") or {})
    plan = build_plan(name, namespace, pool.get("spec"))
    if not plan.valid:
        return Result(invalid_status(plan.problems, old_status, generation, now), plan)

    live: dict[str, dict[str, Any]] = {}
    for child in plan.children:
        obj = copy.deepcopy(child)
        kopf.adopt(obj, owner=dict(pool))
        live[f"{obj['kind']}/{obj['metadata']['name']}"] = await ensure(kube, obj)
    for resource, child_name in plan.absent:
        await ensure_absent(kube, resource, namespace, child_name)
    consumers = [await roll_consumer(kube, namespace, c, notify) for c in plan.consumers]
    await release_consumers(kube, namespace, name, {c.deployment for c in plan.consumers}, notify)
    status = valid_status(
        master_address=plan.master_address,
        master=live.get(f"Deployment/{names.master_name(name)}"),
        store=live.get(f"Deployment/{names.store_name(name)}"),
        embedded=plan.embedded,
        consumers=consumers,
        old=old_status,
        generation=generation,
        now=now,
    )
    return Result(status, plan)


async def teardown(kube: Kube, pool: Mapping[str, Any], notify: Notify) -> None:
    """Take the settings out of every consumer, then delete the pool's children."""
    meta = pool.get("metadata", {})
    name, namespace = meta["name"], meta["namespace"]
    await release_consumers(kube, namespace, name, set(), notify)
    for resource, child_name in children_names(name):
        await ensure_absent(kube, resource, namespace, child_name)
