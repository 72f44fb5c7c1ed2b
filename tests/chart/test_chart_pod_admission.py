"""Pod-admission injection in the chart: the MutatingWebhookConfiguration sends only opted-in
Pods, never kube-system's, the operator's or the release namespace's (unless watched), and
fails closed; at least two operator replicas answer it, under a PodDisruptionBudget."""

from __future__ import annotations

from typing import Any

import pytest

from kvpool.operator import names
from kvpool.operator.app import INJECT_ID
from kvpool.operator.network import selects
from kvpool.operator.pod_injection import DEPLOYMENT_PATCH, POD_ADMISSION
from tests.chart.helm import EXAMPLES, NAMESPACE, Helm, of_kind, one
from tests.chart.test_chart_operator import operator_container, operator_options

WEBHOOK = EXAMPLES / "webhook-cert-manager-values.yaml"


def namespace_labels(name: str) -> dict[str, str]:
    """The labels the API server puts on every namespace."""
    return {"kubernetes.io/metadata.name": name}


def sent(webhook: dict[str, Any], namespace: str, pod_labels: dict[str, str]) -> bool:
    """Whether the API server sends a Pod CREATE in ``namespace`` with ``pod_labels`` to it."""
    return selects(webhook.get("namespaceSelector"), namespace_labels(namespace)) and selects(
        webhook.get("objectSelector"), pod_labels
    )


def mutating_webhook(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (webhook,) = one(objects, "MutatingWebhookConfiguration")["webhooks"]
    return dict(webhook)


CONSUMER = {"app": "llm", names.LABEL_ALLOW_POOL: "pool", "pod-template-hash": "abc"}


def test_with_the_webhook_pods_are_injected_at_admission(helm: Helm) -> None:
    objects = helm.template(WEBHOOK)
    webhook = mutating_webhook(objects)
    service = one(objects, "Service")
    assert webhook["clientConfig"]["service"] == {
        "name": service["metadata"]["name"],
        "namespace": NAMESPACE,
        "path": f"/{INJECT_ID}",  # kopf serves each admission handler at /<handler id>
        "port": 443,
    }
    (rule,) = webhook["rules"]
    assert rule == {
        "apiGroups": [""],
        "apiVersions": ["v1"],
        "operations": ["CREATE"],
        "resources": ["pods"],
        "scope": "Namespaced",
    }
    # Fails closed, writes nothing else, is asked once.
    assert webhook["failurePolicy"] == "Fail" and webhook["sideEffects"] == "None"
    assert webhook["reinvocationPolicy"] == "Never"
    assert 1 <= webhook["timeoutSeconds"] <= 30
    configuration = one(objects, "MutatingWebhookConfiguration")
    assert configuration["metadata"]["annotations"]["cert-manager.io/inject-ca-from"].startswith(
        f"{NAMESPACE}/"
    )

    _, container = operator_container(objects)
    assert operator_options(container).injection_mode == POD_ADMISSION


def test_only_opted_in_pods_of_watched_namespaces_are_sent(helm: Helm) -> None:
    objects = helm.template(WEBHOOK, sets=["watchNamespaces={team-a,kube-system}"])
    webhook = mutating_webhook(objects)
    assert sent(webhook, "team-a", CONSUMER)
    assert not sent(webhook, "team-a", {"app": "llm"})  # no opt-in label: never sent, never touched
    assert not sent(webhook, "team-b", CONSUMER)  # not watched
    assert not sent(webhook, "kube-system", CONSUMER)  # even when listed
    assert not sent(webhook, NAMESPACE, CONSUMER)  # the release namespace, not watched here

    # The operator's own Pods are never sent, whatever labels someone adds to them.
    operator_pod = one(objects, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert not sent(webhook, "team-a", {**operator_pod, names.LABEL_ALLOW_POOL: "pool"})
    # Nor a pool's master or store Pods (part of the project too).
    pool_pod = {**names.labels("pool", names.MASTER), names.LABEL_ALLOW_POOL: "pool"}
    assert not sent(webhook, "team-a", pool_pod)


def test_the_release_namespace_is_sent_only_when_watched(helm: Helm) -> None:
    # The default namespaced install watches the release namespace: its pools' consumers live there.
    default = mutating_webhook(helm.template(WEBHOOK))
    assert sent(default, NAMESPACE, CONSUMER) and not sent(default, "kube-system", CONSUMER)
    cluster_wide = mutating_webhook(helm.template(WEBHOOK, sets=["clusterWide=true"]))
    assert sent(cluster_wide, "team-a", CONSUMER) and sent(cluster_wide, "anywhere", CONSUMER)
    assert not sent(cluster_wide, NAMESPACE, CONSUMER) and not sent(cluster_wide, "kube-system", CONSUMER)


def test_two_replicas_answer_it_under_a_disruption_budget(helm: Helm) -> None:
    objects = helm.template(WEBHOOK)
    deployment = one(objects, "Deployment")
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    _, container = operator_container(objects)
    assert operator_options(container).leader_election is not None  # every replica answers, one acts
    budget = one(objects, "PodDisruptionBudget")
    assert budget["spec"]["minAvailable"] == 1
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert selects(budget["spec"]["selector"], pod_labels)
    anti = deployment["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    (term,) = anti["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert selects(term["podAffinityTerm"]["labelSelector"], pod_labels)
    assert any(r["metadata"]["name"].endswith("-leader-election") for r in of_kind(objects, "Role"))
    assert one(helm.template(WEBHOOK, sets=["operator.replicas=3"]), "Deployment")["spec"]["replicas"] == 3


def test_without_the_webhook_deployments_are_patched(helm: Helm) -> None:
    objects = helm.template()
    _, container = operator_container(objects)
    assert operator_options(container).injection_mode == DEPLOYMENT_PATCH
    assert of_kind(objects, "MutatingWebhookConfiguration") == []
    assert of_kind(objects, "PodDisruptionBudget") == []
    assert one(objects, "Deployment")["spec"]["replicas"] == 1


def test_deployment_patching_is_an_explicit_choice_beside_the_webhook(helm: Helm) -> None:
    objects = helm.template(WEBHOOK, sets=[f"injection.mode={DEPLOYMENT_PATCH}"])
    assert of_kind(objects, "MutatingWebhookConfiguration") == []
    assert of_kind(objects, "ValidatingWebhookConfiguration") != []
    _, container = operator_container(objects)
    assert operator_options(container).injection_mode == DEPLOYMENT_PATCH


@pytest.mark.parametrize("mode", ["podAdmission", "sidecar"])
def test_a_mode_that_cannot_work_fails_the_render(helm: Helm, mode: str) -> None:
    result = helm.run(
        "template", "kvpool", str(EXAMPLES.parent), "--set", f"injection.mode={mode}", check=False
    )
    assert result.returncode != 0
    if mode == "podAdmission":
        assert "needs webhook.enabled=true" in result.stderr
        assert "injection.mode=deploymentPatch" in result.stderr
