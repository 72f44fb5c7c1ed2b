"""NOTES.txt tells the user what to do next, for the mode they installed."""

from __future__ import annotations

from tests.chart.helm import EXAMPLES, NAMESPACE, Helm


def test_notes_after_a_default_install(helm: Helm) -> None:
    notes = helm.notes()
    assert f"kubectl -n {NAMESPACE} rollout status deployment/kvpool-mooncake-kvpool" in notes
    assert f"It watches MooncakeKVPools in: {NAMESPACE}." in notes  # least privilege by default
    assert "every namespace" in helm.notes(sets=["clusterWide=true"])
    assert "kubectl apply" in notes and "examples/pool.yaml" in notes
    assert "kubectl get mooncakekvpools -A" in notes
    assert "ConfigValid=False" in notes
    # Uninstall order: pools first, while the operator can still clean up after them.
    assert "kubectl delete mooncakekvpools --all -A" in notes
    assert "WARNING" not in notes


def test_notes_name_the_watched_namespaces(helm: Helm) -> None:
    notes = helm.notes(EXAMPLES / "namespaced-values.yaml")
    assert "watches MooncakeKVPools in: team-a, team-b." in notes


def test_notes_for_the_example_pool_and_monitoring(helm: Helm) -> None:
    notes = helm.notes(EXAMPLES / "example-pool-values.yaml", EXAMPLES / "monitoring-values.yaml")
    assert f"kubectl -n {NAMESPACE} get mkvp kvpool" in notes
    assert "metricsFrom" in notes


def test_notes_for_the_webhook(helm: Helm) -> None:
    assert "cert-manager" in helm.notes(EXAMPLES / "webhook-cert-manager-values.yaml")


def test_notes_say_how_pods_get_their_settings(helm: Helm) -> None:
    webhook = EXAMPLES / "webhook-cert-manager-values.yaml"
    notes = helm.notes(webhook)  # the webhook on: injection at Pod admission by default
    assert "Injection at Pod admission" in notes and "kvpool.mooncake.io/injected" in notes
    assert "Injection at Pod admission" not in helm.notes()
    assert "Injection at Pod admission" not in helm.notes(webhook, sets=["injection.mode=deploymentPatch"])
