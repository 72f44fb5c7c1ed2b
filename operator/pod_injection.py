"""Injection at Pod admission: the pool's settings go into each new Pod, never into its Deployment.

The mutating webhook (``app``) hands every new Pod that carries the opt-in label
``kvpool.mooncake.io/allow-pool: <pool>`` to ``admit_pod``, with the pool the label names (in
the namespace its ``allow-pool-namespace`` label names, else the Pod's: a consumer of a grant
in another namespace than its pool's, ``pool_namespace_of_pod``).
The Pod gets what Deployment patching would put into its template (``consumers.injected``,
applied to the Pod seen as its Deployment's template), plus a record of what was injected
(the ``kvpool.mooncake.io/injected`` annotation). Whatever cannot be injected is refused
with the rule and the fix (fail closed): a Pod never starts without the settings its label
asks for.

The Deployment in Git is never changed. When the settings change, the operator writes one
annotation on the Deployment's pod template (``restart_patch``: the config hash), which
rolls it; its new Pods are injected with the new settings.

Everything here is pure: Pods, Deployments and pools in, patches and refusals out.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvpool.operator import names
from kvpool.operator.consumers import (
    ConsumerError,
    Injection,
    Refusal,
    choose_container,
    config_hash_of,
    guarded,
    injected,
    injection_refusal,
    refusal,
)
from kvpool.operator.grants import Grant, pool_namespace_of
from kvpool.operator.merge_patch import diff
from kvpool.operator.plan import build_plan
from kvpool.operator.policy import OperatorPolicy
from kvpool.operator.status import condition_of, conflicts_of, paused

POD_ADMISSION = "podAdmission"
DEPLOYMENT_PATCH = "deploymentPatch"
INJECTION_MODES = (POD_ADMISSION, DEPLOYMENT_PATCH)
RECORD_VERSION = 1
POD_TEMPLATE_HASH = "pod-template-hash"  # the label the Deployment controller puts on its Pods
ON_TEMPLATE = " on its pod template (spec.template.metadata.labels)"
# A pool serves its consumers once these are True for its current spec.
SERVING = ("ConfigValid", "MasterReady", "StoreReady")


@dataclass(frozen=True)
class PodInjection:
    """What a new Pod gets: a JSON merge patch (empty: already injected) and the record."""

    patch: dict[str, Any]
    record: dict[str, Any]


def owning_deployment(pod: Mapping[str, Any]) -> str | None:
    """The Deployment a Pod belongs to: its controller is a ReplicaSet named
    ``<deployment>-<pod-template-hash>``; None for any other Pod."""
    meta = pod.get("metadata") or {}
    template_hash = (meta.get("labels") or {}).get(POD_TEMPLATE_HASH)
    if not template_hash:
        return None
    for ref in meta.get("ownerReferences") or []:
        name = str(ref.get("name", ""))
        if (
            ref.get("kind") == "ReplicaSet"
            and ref.get("apiVersion") == "apps/v1"
            and ref.get("controller")
            and name.endswith(f"-{template_hash}")
        ):
            return name[: -len(template_hash) - 1] or None
    return None


def pool_namespace_of_pod(pod: Mapping[str, Any], namespace: str) -> str:
    """The namespace of the pool a Pod opts into: its ``allow-pool-namespace`` label (a grant's
    consumer in another namespace than its pool's), else its own ``namespace``."""
    labels = (pod.get("metadata") or {}).get("labels") or {}
    return str(labels.get(names.LABEL_ALLOW_POOL_NAMESPACE) or namespace)


def as_template(pod: Mapping[str, Any], namespace: str, deployment: str) -> dict[str, Any]:
    """The Pod seen as its Deployment's pod template, so that ``consumers`` reads (and names)
    it as the Deployment it comes from."""
    meta = pod.get("metadata") or {}
    return {
        "metadata": {
            "namespace": namespace,
            "name": deployment,
            "labels": dict(meta.get("labels") or {}),
        },
        "spec": {
            "template": {
                "metadata": {
                    "labels": dict(meta.get("labels") or {}),
                    "annotations": dict(meta.get("annotations") or {}),
                },
                "spec": copy.deepcopy(dict(pod.get("spec") or {})),
            }
        },
    }


POOL_NOT_READY = "pool-not-ready"


def pool_refusal(where: str, namespace: str, name: str, pool: Mapping[str, Any] | None) -> Refusal | None:
    """Why ``pool`` cannot serve a new consumer Pod now: gone, being deleted, or not serving
    its current spec (not ready, paused with a newer spec, or some child not its own)."""
    label = f"{names.LABEL_ALLOW_POOL}={name}"
    if pool is None:
        return Refusal(
            "no-pool",
            f"{where} carries {label} but there is no MooncakeKVPool {namespace}/{name}: "
            f"create the pool, or remove the label from the Deployment's pod template",
        )
    meta = pool.get("metadata") or {}
    if meta.get("deletionTimestamp"):
        return Refusal(
            "pool-deleting",
            f"{where} carries {label} but the pool is being deleted: "
            "remove the label from the Deployment's pod template",
        )
    status = pool.get("status") or {}
    waiting = "its Pods are admitted once the pool is Ready (the ReplicaSet controller retries)"
    if status.get("observedGeneration") != meta.get("generation"):
        why = f"{names.ANNOTATION_PAUSED}=true: remove it" if paused(pool) else waiting
        return Refusal(
            POOL_NOT_READY,
            f"{where}: pool {namespace}/{name} has not applied its current spec "
            f"(generation {meta.get('generation')}, observed {status.get('observedGeneration')}): {why}",
        )
    for kind in SERVING:
        item = condition_of(status, kind) or {}
        if item.get("status") != "True":
            return Refusal(
                POOL_NOT_READY,
                f"{where}: pool {namespace}/{name} does not serve ({kind}="
                f"{item.get('status', 'Unknown')}: {item.get('message', 'no status yet')}): {waiting}",
            )
    not_own = [c for c in conflicts_of(status) if c.endswith("[ownership]")]
    if not_own:
        return Refusal(
            "held-back",
            f"{where}: pool {namespace}/{name} does not own every object it needs ({not_own[0]}): "
            "consumers are held back until it does (see the pool's Conflict condition)",
        )
    return None


def consumer_of(
    where: str,
    namespace: str,
    name: str,
    pool: Mapping[str, Any],
    deployment: str,
    policy: OperatorPolicy,
    grants: Sequence[Grant] = (),
    consumer_namespace: str = "",
) -> Injection | Refusal:
    """The injection pool ``namespace/name``'s spec (or a grant it accepts) declares for
    ``consumer_namespace/deployment`` (default: a Deployment of the pool's namespace), or why
    there is none. A consumer is its namespace and its name: a Deployment of the same name in
    another namespace is another consumer."""
    consumer_namespace = consumer_namespace or namespace
    plan = build_plan(name, namespace, pool.get("spec"), policy, grants=grants)
    if not plan.valid:
        problems = ", ".join(str(p) for p in plan.problems)
        return Refusal(
            "pool-invalid", f"{where}: pool {namespace}/{name} has an invalid spec ({problems}): fix the pool"
        )
    for injection in plan.consumers:
        if injection.deployment == deployment and (injection.namespace or namespace) == consumer_namespace:
            return injection
    if consumer_namespace == namespace:
        return Refusal(
            "not-a-consumer",
            f"{where} carries {names.LABEL_ALLOW_POOL}={name} but pool {namespace}/{name} does not list it: "
            f"add it to the pool's spec.consumers (with its layout), or remove the label",
        )
    # Another namespace's: ``grant_membership`` found a grant listing it, which the pool did not take.
    return Refusal(
        "not-a-consumer",
        f"{where} carries {names.LABEL_ALLOW_POOL}={name} and "
        f"{names.LABEL_ALLOW_POOL_NAMESPACE}={namespace} but pool {namespace}/{name} does not take "
        f"the grant of namespace {consumer_namespace} that lists it: its status says why",
    )


def grant_membership(
    where: str,
    namespace: str,
    pool_namespace: str,
    name: str,
    pool: Mapping[str, Any],
    deployment: str,
    grants: Sequence[Grant],
) -> Refusal | None:
    """For a Pod of another namespace than its pool's, before anything about the pool is said:
    refused, naming nothing of the pool's state, unless the pool takes grants from the Pod's
    namespace and a grant there lists its Deployment (a namespace the pool does not list
    learns nothing of it from its refusals)."""
    tenancy = ((pool.get("spec") or {}).get("tenancy")) or {}
    listed = bool(tenancy.get("enabled")) and namespace in (tenancy.get("grantNamespaces") or [])
    if listed and any(
        g.namespace == namespace
        and g.spec is not None
        and g.spec.pool == name
        and pool_namespace_of(g) == pool_namespace
        and any(c.name == deployment for c in g.spec.consumers)
        for g in grants
    ):
        return None
    return Refusal(
        "not-a-consumer",
        f"{where} carries {names.LABEL_ALLOW_POOL}={name} and {names.LABEL_ALLOW_POOL_NAMESPACE}="
        f"{pool_namespace}, but no grant of namespace {namespace} that pool {pool_namespace}/{name} "
        f"takes lists it: add it to the spec.consumers of a MooncakeKVPoolGrant of namespace "
        f"{namespace} naming the pool (the pool's admin lists the namespace in its "
        "spec.tenancy.grantNamespaces), or remove the labels",
    )


def grant_hint(
    where: str, namespace: str, name: str, deployment: str, namespace_grants: Sequence[Grant]
) -> Refusal | None:
    """For a Pod whose labels name pool ``name`` in its own ``namespace``, where there is none:
    a grant of its namespace that lists its Deployment as a consumer of pool ``name`` in
    another namespace (the Pod lacks ``allow-pool-namespace``), as a consent refusal."""
    for grant in sorted(namespace_grants, key=lambda g: g.name):
        if grant.spec is None or grant.namespace != namespace or grant.spec.pool != name:
            continue
        other = pool_namespace_of(grant)
        if other != namespace and any(c.name == deployment for c in grant.spec.consumers):
            return Refusal(
                "consent",
                f"{where} needs the labels {names.LABEL_ALLOW_POOL}={name} and "
                f"{names.LABEL_ALLOW_POOL_NAMESPACE}={other}{ON_TEMPLATE} to take its settings "
                f"(grant {grant.name} lists it as a consumer of pool {other}/{name}, and there is "
                f"no MooncakeKVPool {namespace}/{name}: one there would be another pool)",
            )
    return None


def injection_record(injection: Injection, container: str | None) -> dict[str, Any]:
    """What the webhook injected into a Pod (the ``injected`` annotation)."""
    return {
        "version": RECORD_VERSION,
        "pool": injection.pool,
        "deployment": injection.deployment,
        "container": container,
        "configHash": injection.config_hash,
        "layoutFingerprint": injection.layout_fingerprint,
        "args": [f"--kv-transfer-config={injection.kv_transfer_config}"],
        "env": [name for name, _ in injection.env],
        "volume": {"name": names.CONNECTOR_VOLUME, "configMap": injection.config_map},
        "mountPath": names.CONNECTOR_MOUNT_PATH,
    }


def injected_pod(pod: Mapping[str, Any], namespace: str, injection: Injection) -> dict[str, Any]:
    """The Pod with the injection applied (a new object): its spec is what Deployment
    patching would give the template, its labels and annotations too, plus the record."""
    view = as_template(pod, namespace, injection.deployment)
    chosen = choose_container(view, injection)
    if isinstance(chosen, Refusal):
        raise ConsumerError(str(chosen))
    template = injected(view, injection)["spec"]["template"]
    new = copy.deepcopy(dict(pod))
    meta = new.setdefault("metadata", {})
    meta["labels"] = template["metadata"]["labels"]
    annotations = dict(template["metadata"]["annotations"])
    annotations[names.ANNOTATION_INJECTED] = json.dumps(
        injection_record(injection, chosen.get("name")), sort_keys=True, separators=(",", ":")
    )
    meta["annotations"] = annotations
    new["spec"] = template["spec"]
    return new


def admit_pod(
    pod: Mapping[str, Any],
    namespace: str,
    pool: Mapping[str, Any] | None,
    policy: OperatorPolicy | None = None,
    grants: Sequence[Grant] = (),
    pool_namespace: str = "",
    namespace_grants: Sequence[Grant] = (),
    running: Mapping[str, Any] | None = None,
    pod_hashes: Sequence[str] = (),
) -> PodInjection | Refusal:
    """The patch a new Pod with the opt-in label gets from ``pool`` (the one its labels name,
    in ``pool_namespace``, default the Pod's ``namespace``; None if there is none; ``grants``:
    the pool's, ``read_grants``, for a pool with tenancy), or why it is refused. A Pod of
    another namespace than its pool's is injected only as a consumer a grant of its namespace
    lists, one the pool accepts, with that grant's settings, as Deployment patching would.
    ``namespace_grants``: the grants of the Pod's namespace, read where its labels name a pool
    of its own namespace that does not exist (to tell a grant's consumer what consent it lacks).
    ``running``: the Pod's Deployment as the API holds it, and ``pod_hashes`` the settings its
    injected Pods run (``pod_config_hashes``), read where the pool does not serve now: a
    Deployment already running the pool's current settings (rolled onto it while it served)
    gets them in its new Pods too, whose connectors join the pool once it serves again, as
    under Deployment patching; any other is refused until the pool serves."""
    meta = pod.get("metadata") or {}
    name = str((meta.get("labels") or {}).get(names.LABEL_ALLOW_POOL, ""))
    pool_namespace = pool_namespace or namespace
    policy = policy or OperatorPolicy()
    deployment = owning_deployment(pod)
    if deployment is None:
        shown = meta.get("name") or meta.get("generateName") or ""
        return Refusal(
            "no-deployment",
            f"Pod {namespace}/{shown} carries {names.LABEL_ALLOW_POOL}={name} but no Deployment made it "
            "(its controller is not a Deployment's ReplicaSet): only Pods of a Deployment the pool "
            "lists take its settings: remove the label",
        )
    view = as_template(pod, namespace, deployment)
    where = f"Deployment {namespace}/{deployment}"
    found = (
        refusal(view, name, on=ON_TEMPLATE, pool_namespace=pool_namespace)
        or (
            grant_membership(where, namespace, pool_namespace, name, pool, deployment, grants)
            if pool is not None and pool_namespace != namespace
            else None
        )
        or (
            grant_hint(where, namespace, name, deployment, namespace_grants)
            if pool is None and pool_namespace == namespace
            else None
        )
        or _unless_running(
            pool_refusal(where, pool_namespace, name, pool),
            running,
            pod_hashes,
            lambda: consumer_of(
                where, pool_namespace, name, pool or {}, deployment, policy, grants, namespace
            ),
        )
        or (
            consumer_of(where, pool_namespace, name, pool, deployment, policy, grants, namespace)
            if pool
            else None
        )
    )
    if isinstance(found, Refusal):
        return found
    assert isinstance(found, Injection)
    refused = injection_refusal(view, found)
    if refused is not None:
        return refused
    new = injected_pod(pod, namespace, found)
    record = json.loads(new["metadata"]["annotations"][names.ANNOTATION_INJECTED])
    current = (meta.get("annotations") or {}).get(names.ANNOTATION_INJECTED)
    if (
        current is not None
        and _same_injection(current, record)
        and diff(_unrecorded(pod), _unrecorded(new)) == {}
    ):
        return PodInjection({}, record)  # injected already (a reinvocation, a copied manifest)
    return PodInjection(diff(pod, new), record)


def _unless_running(
    refused: Refusal | None,
    running: Mapping[str, Any] | None,
    pod_hashes: Sequence[str],
    injection: Callable[[], Injection | Refusal],
) -> Refusal | None:
    """``refused``, but None for a pool that does not serve now (``pool-not-ready``) when the
    Deployment ``running`` runs the settings it would inject already."""
    if refused is None or refused.rule != POOL_NOT_READY or running is None:
        return refused
    found = injection()
    if isinstance(found, Injection) and carries_settings(running, found, list(pod_hashes)):
        return None
    return refused


def _same_injection(raw: str, record: Mapping[str, Any]) -> bool:
    try:
        return bool(json.loads(raw) == record)
    except ValueError:
        return False


def _unrecorded(pod: Mapping[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(dict(pod))
    ((out.get("metadata") or {}).get("annotations") or {}).pop(names.ANNOTATION_INJECTED, None)
    return out


# --- the Deployment side: consent, and one restart annotation -------------------------------


def template_refusal(deployment: Mapping[str, Any], injection: Injection) -> Refusal | None:
    """Why the Deployment's Pods would be refused: consent is the opt-in label on its pod
    template (what the webhook sees), then what ``consumers.injection_refusal`` detects."""
    template_labels = (((deployment.get("spec") or {}).get("template") or {}).get("metadata") or {}).get(
        "labels"
    ) or {}
    return refusal(
        deployment, injection.pool, template_labels, ON_TEMPLATE, injection.pool_namespace
    ) or injection_refusal(deployment, injection)


def pod_config_hashes(pods: Iterable[Mapping[str, Any]], deployment: str) -> list[str]:
    """The config hashes the webhook recorded on ``deployment``'s Pods (its injected ones)."""
    hashes = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        if meta.get("deletionTimestamp"):
            continue
        raw = (meta.get("annotations") or {}).get(names.ANNOTATION_INJECTED)
        try:
            record = json.loads(raw) if raw else None
        except ValueError:
            record = None
        if isinstance(record, dict) and record.get("deployment") == deployment:
            hashes.append(str(record.get("configHash")))
    return hashes


def pods_refused(deployment: Mapping[str, Any]) -> bool:
    """Whether the Deployment's ReplicaSet could not create Pods (``ReplicaFailure``), e.g.
    refused at admission while the pool did not serve yet."""
    conditions = (deployment.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "ReplicaFailure" and c.get("status") == "True" for c in conditions)


def carries_settings(deployment: Mapping[str, Any], injection: Injection, pod_hashes: list[str]) -> bool:
    """Whether the Deployment's Pods run the current settings: its template carries their
    hash (the restart annotation), or it never did and every injected Pod of it carries them
    (it was created while the pool served)."""
    current = config_hash_of(deployment)
    if current is not None:
        return current == injection.config_hash
    return bool(pod_hashes) and all(h == injection.config_hash for h in pod_hashes)


def runs_nothing(deployment: Mapping[str, Any]) -> bool:
    """Whether the Deployment is scaled to zero and no Pod of it is left: none runs other
    settings, and its next Pods get the current ones at admission."""
    spec_replicas = (deployment.get("spec") or {}).get("replicas", 1)
    return spec_replicas == 0 and not (deployment.get("status") or {}).get("replicas")


def needs_restart(deployment: Mapping[str, Any], injection: Injection, pod_hashes: list[str]) -> bool:
    """Whether only a restart brings the current settings: the template's hash is another, or
    (none yet) a Pod runs other settings, or its Pods were refused (a restart retries at once,
    where the ReplicaSet controller backs off). A Deployment whose Pods are still coming waits."""
    current = config_hash_of(deployment)
    if current is not None:
        return current != injection.config_hash
    if pod_hashes:
        return any(h != injection.config_hash for h in pod_hashes)
    return pods_refused(deployment)


def restart_patch(
    deployment: Mapping[str, Any], injection: Injection, pod_hashes: list[str]
) -> dict[str, Any]:
    """The one write to a consumer in pod-admission mode: the config hash as an annotation on
    its pod template, which rolls it; empty when no restart is needed."""
    if not needs_restart(deployment, injection, pod_hashes):
        return {}
    annotations = {names.ANNOTATION_CONFIG_HASH: injection.config_hash}
    return guarded({"spec": {"template": {"metadata": {"annotations": annotations}}}}, deployment)
