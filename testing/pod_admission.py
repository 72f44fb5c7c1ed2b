"""Test data for injection at Pod admission: a Pod as a Deployment's ReplicaSet creates it, a
pool that serves, and the AdmissionReview the API server sends a mutating webhook."""

from __future__ import annotations

import base64
import copy
import json
from typing import Any

import jsonpatch

from kvpool.operator.names import PODS
from testing.kube_api import NAMESPACE
from testing.operator_objects import pool_manifest

TEMPLATE_HASH = "5d9c7b8f6"


def replica_set_pod(deployment: dict[str, Any], template_hash: str = TEMPLATE_HASH) -> dict[str, Any]:
    """A Pod of ``deployment`` as its ReplicaSet's controller POSTs it: the template, the
    ``pod-template-hash`` label, a controller reference, a generated name (none yet)."""
    template = copy.deepcopy(deployment["spec"]["template"])
    meta = template.get("metadata") or {}
    replica_set = f"{deployment['metadata']['name']}-{template_hash}"
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "generateName": f"{replica_set}-",
            "namespace": deployment["metadata"].get("namespace", NAMESPACE),
            "labels": {**(meta.get("labels") or {}), "pod-template-hash": template_hash},
            **({"annotations": meta["annotations"]} if meta.get("annotations") else {}),
            "ownerReferences": [
                {
                    "apiVersion": "apps/v1",
                    "kind": "ReplicaSet",
                    "name": replica_set,
                    "uid": "rs-uid",
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": template["spec"],
    }


def serving_pool(spec: dict[str, Any] | None = None, generation: int = 1, **status: Any) -> dict[str, Any]:
    """A pool as the API server holds it once the operator has it Ready at ``generation``."""
    pool = pool_manifest(spec=spec)
    pool["metadata"].update(generation=generation, uid="pool-uid")
    conditions = [
        {"type": kind, "status": "True", "reason": "Ok", "message": ""}
        for kind in ("ConfigValid", "MasterReady", "StoreReady", "ConsumersRolledOut")
    ]
    pool["status"] = {"observedGeneration": generation, "phase": "Ready", "conditions": conditions, **status}
    return pool


def pod_review(pod: dict[str, Any], uid: str = "review-pod") -> dict[str, Any]:
    """The AdmissionReview (admission.k8s.io/v1) a Pod CREATE sends a mutating webhook."""
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": uid,
            "kind": {"group": PODS.group, "version": PODS.version, "kind": PODS.kind},
            "resource": {"group": PODS.group, "version": PODS.version, "resource": PODS.plural},
            "requestKind": {"group": PODS.group, "version": PODS.version, "kind": PODS.kind},
            "requestResource": {"group": PODS.group, "version": PODS.version, "resource": PODS.plural},
            "namespace": pod["metadata"].get("namespace", NAMESPACE),
            "name": pod["metadata"].get("name", ""),
            "operation": "CREATE",
            "userInfo": {
                "username": "system:serviceaccount:kube-system:replicaset-controller",
                "groups": ["system:serviceaccounts", "system:authenticated"],
            },
            "object": pod,
            "oldObject": None,
            "dryRun": False,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"},
        },
    }


def admitted(pod: dict[str, Any], response: dict[str, Any]) -> dict[str, Any]:
    """The Pod as the API server stores it after a webhook's ``response`` (its JSONPatch applied)."""
    if "patch" not in response:
        return copy.deepcopy(pod)
    assert response.get("patchType") == "JSONPatch", response
    ops = json.loads(base64.b64decode(response["patch"]))
    return dict(jsonpatch.apply_patch(pod, ops))
