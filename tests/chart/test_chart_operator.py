"""The operator's Deployment, Service and webhook: secure by default, and wired to what the
operator's own CLI serves (its flags parsed by the operator's own parser)."""

from __future__ import annotations

import re
from importlib import metadata
from typing import Any
from urllib.parse import urlsplit

import pytest

from kvpool.operator import names
from kvpool.operator.app import VALIDATE_ID, OperatorOptions
from kvpool.operator.cli import _parser, options_from_args
from kvpool.operator.consumers import refusal
from kvpool.operator.metrics import METRICS_PATH
from kvpool.operator.names import POOLS
from kvpool.operator.policy import OperatorPolicy
from tests.chart.helm import CHART, EXAMPLES, NAMESPACE, Helm, of_kind, one


def operator_container(objects: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    pod = one(objects, "Deployment")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    return pod, container


def operator_options(container: dict[str, Any]) -> OperatorOptions:
    assert container["command"] == ["kvpool-operator"]
    return options_from_args(_parser().parse_args(container["args"]))


def port(container: dict[str, Any], name: str) -> int:
    (number,) = [p["containerPort"] for p in container["ports"] if p["name"] == name]
    return int(number)


def test_the_command_is_the_console_script() -> None:
    (script,) = metadata.entry_points(group="console_scripts", name="kvpool-operator")
    assert script.value == "kvpool.operator.cli:main"


def test_secure_by_default(helm: Helm) -> None:
    objects = helm.template()
    deployment = one(objects, "Deployment")
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"] == {"type": "Recreate"}
    pod, container = operator_container(objects)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] not in (None, 0)
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert not any(pod.get(key) for key in ("hostNetwork", "hostPID", "hostIPC"))
    security = container["securityContext"]
    assert security["runAsNonRoot"] is True and security["privileged"] is False
    assert security["allowPrivilegeEscalation"] is False
    assert security["readOnlyRootFilesystem"] is True
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert security["seccompProfile"] == {"type": "RuntimeDefault"}
    resources = container["resources"]
    assert {"cpu", "memory"} <= set(resources["requests"]) and "memory" in resources["limits"]
    # A read-only root needs a writable /tmp; nothing else is mounted.
    assert [m["mountPath"] for m in container["volumeMounts"]] == ["/tmp"]
    assert [set(v) - {"name"} for v in pod["volumes"]] == [{"emptyDir"}]


def test_probes_and_ports_are_the_operators_endpoints(helm: Helm) -> None:
    objects = helm.template(sets=["operator.healthPort=8181", "operator.metricsPort=9191"])
    _, container = operator_container(objects)
    options = operator_options(container)
    assert options.liveness_endpoint is not None
    liveness = urlsplit(options.liveness_endpoint)
    assert liveness.port == port(container, "health") == 8181
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": liveness.path, "port": "health"}
    assert options.metrics_port == port(container, "metrics") == 9191
    assert options.metrics_host == "0.0.0.0"
    service = one(objects, "Service")
    assert service["spec"]["ports"] == [
        {"name": "metrics", "port": 9090, "targetPort": "metrics", "protocol": "TCP"}
    ]
    labels = one(objects, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()


def test_the_other_flags_reach_the_operator(helm: Helm) -> None:
    objects = helm.template(
        sets=["operator.resyncInterval=12.5", "operator.retryDelay=3", "operator.verbose=true"]
    )
    options = operator_options(operator_container(objects)[1])
    assert (options.resync_interval, options.retry_delay) == (12.5, 3.0)
    assert options.log_level == 10
    assert options.kubeconfig is None  # in-cluster


@pytest.mark.parametrize(
    ("sets", "namespaces"),
    [
        ([], (NAMESPACE,)),
        (["clusterWide=true"], ()),
        (["watchNamespaces={team-a,team-b}"], ("team-a", "team-b")),
    ],
)
def test_the_operator_watches_what_rbac_allows(
    helm: Helm, sets: list[str], namespaces: tuple[str, ...]
) -> None:
    objects = helm.template(sets=sets)
    assert operator_options(operator_container(objects)[1]).namespaces == namespaces
    role_namespaces = tuple(r["metadata"]["namespace"] for r in of_kind(objects, "Role"))
    assert role_namespaces == namespaces


def test_the_operator_metrics_path() -> None:
    # The operator's ServiceMonitor scrapes this path (see test_chart_monitoring).
    assert METRICS_PATH == "/metrics"


def webhook_case(helm: Helm, name: str) -> list[dict[str, Any]]:
    return helm.template(EXAMPLES / name)


def test_the_webhook_with_cert_manager(helm: Helm) -> None:
    objects = webhook_case(helm, "webhook-cert-manager-values.yaml")
    pod, container = operator_container(objects)
    options = operator_options(container)
    hook = options.webhook
    assert hook is not None and hook.port == port(container, "webhook") == 9443
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "webhook-tls"]
    assert mount["readOnly"] is True
    assert (
        hook.certfile == f"{mount['mountPath']}/tls.crt" and hook.pkeyfile == f"{mount['mountPath']}/tls.key"
    )
    (volume,) = [v for v in pod["volumes"] if v["name"] == "webhook-tls"]

    (certificate,) = [
        c
        for c in of_kind(objects, "Certificate")
        if c["spec"]["secretName"] == volume["secret"]["secretName"]
    ]

    service = one(objects, "Service")
    assert {"name": "webhook", "port": 443, "targetPort": "webhook", "protocol": "TCP"} in service["spec"][
        "ports"
    ]
    dns = f"{service['metadata']['name']}.{NAMESPACE}.svc"
    assert dns in certificate["spec"]["dnsNames"] and hook.host == dns

    configuration = one(objects, "ValidatingWebhookConfiguration")
    (webhook,) = configuration["webhooks"]
    assert webhook["clientConfig"]["service"] == {
        "name": service["metadata"]["name"],
        "namespace": NAMESPACE,
        "path": f"/{VALIDATE_ID}",  # kopf serves each admission handler at /<handler id>
        "port": 443,
    }
    (rule,) = webhook["rules"]
    assert (rule["apiGroups"], rule["apiVersions"], rule["resources"]) == (
        [POOLS.group],
        [POOLS.version],
        [POOLS.plural],
    )
    assert rule["operations"] == ["CREATE", "UPDATE"]
    # Namespaced (the default): only the watched namespaces' pools are sent to it.
    assert webhook["namespaceSelector"]["matchExpressions"] == [
        {"key": "kubernetes.io/metadata.name", "operator": "In", "values": [NAMESPACE]}
    ]
    assert webhook["sideEffects"] == "None" and webhook["failurePolicy"] == "Fail"


INJECT_CA_FROM = "cert-manager.io/inject-ca-from"
WEBHOOK_CONFIGURATIONS = ("ValidatingWebhookConfiguration", "MutatingWebhookConfiguration")


def seconds(duration: str) -> float:
    """A Go duration of the chart's values (e.g. ``8760h``, ``1h30m``) in seconds."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    parts = re.findall(r"([0-9]+)(ms|s|m|h)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, duration
    return sum(int(number) * units[unit] for number, unit in parts)


def injected_from(objects: list[dict[str, Any]]) -> dict[str, Any]:
    """The one Certificate whose CA cert-manager injects into both webhook configurations."""
    named = set()
    for kind in WEBHOOK_CONFIGURATIONS:
        namespace, name = one(objects, kind)["metadata"]["annotations"][INJECT_CA_FROM].split("/")
        assert namespace == NAMESPACE
        named.add(name)
    (name,) = named
    return one(objects, "Certificate", name)


def test_the_webhook_trusts_a_ca_that_outlives_serving_certificate_renewals(helm: Helm) -> None:
    """cert-manager writes a renewed serving certificate into its Secret; the operator serves the
    old one until the kubelet updates the mounted Secret and kopf reloads it (a minute or two).
    The caBundle must be a CA that signed both, never the serving certificate itself: injected
    from it, a renewal made the API server refuse the old certificate, and with failurePolicy
    Fail every pool change and opted-in Pod, until the reload."""
    objects = webhook_case(helm, "webhook-cert-manager-values.yaml")
    pod, _ = operator_container(objects)
    (volume,) = [v for v in pod["volumes"] if v["name"] == "webhook-tls"]
    mounted = volume["secret"]["secretName"]

    ca = injected_from(objects)
    assert ca["spec"]["isCA"] is True
    assert ca["spec"]["secretName"] != mounted
    (serving,) = [c for c in of_kind(objects, "Certificate") if c["spec"]["secretName"] == mounted]
    assert serving["metadata"]["name"] != ca["metadata"]["name"] and not serving["spec"].get("isCA")

    # self-signed Issuer -> CA Certificate -> CA Issuer -> serving Certificate
    issuers = {i["metadata"]["name"]: i for i in of_kind(objects, "Issuer")}
    assert serving["spec"]["issuerRef"]["kind"] == "Issuer"
    assert issuers[serving["spec"]["issuerRef"]["name"]]["spec"] == {
        "ca": {"secretName": ca["spec"]["secretName"]}
    }
    assert ca["spec"]["issuerRef"]["kind"] == "Issuer"
    assert issuers[ca["spec"]["issuerRef"]["name"]]["spec"] == {"selfSigned": {}}
    assert len(issuers) == 2
    # The CA lives longer than the certificates it signs and keeps its key when renewed, so
    # they stay valid against the renewed CA.
    assert seconds(ca["spec"]["duration"]) > seconds(serving["spec"]["duration"])
    assert ca["spec"]["privateKey"]["rotationPolicy"] == "Never"
    assert ca["spec"]["commonName"]


def test_a_ca_that_would_not_outlive_its_certificates_fails_the_render(helm: Helm) -> None:
    sets = ["webhook.enabled=true", "webhook.certManager.duration=2160h"]
    for ca_duration in ("2160h", "90m", "2159h59m59s"):
        with pytest.raises(AssertionError, match=r"webhook.certManager.caDuration \(.*\) must be longer"):
            helm.template(sets=[*sets, f"webhook.certManager.caDuration={ca_duration}"])
    objects = helm.template(sets=[*sets, "webhook.certManager.caDuration=2160h0m1s"])
    assert injected_from(objects)["spec"]["duration"] == "2160h0m1s"


def test_the_webhook_with_an_issuer_of_your_own(helm: Helm) -> None:
    """An issuerRef of your own (a CA or Vault issuer) signs the serving certificate; its Secret's
    ca.crt is then that issuer's CA, injected from the serving Certificate. The chart makes no
    issuer of its own, and its CA's duration is not asked about."""
    objects = helm.template(
        sets=[
            "webhook.enabled=true",
            "webhook.certManager.issuerRef.name=corp-ca",
            "webhook.certManager.issuerRef.kind=ClusterIssuer",
            "webhook.certManager.caDuration=1h",
        ]
    )
    assert of_kind(objects, "Issuer") == []
    serving = one(objects, "Certificate")
    assert serving["spec"]["issuerRef"] == {"name": "corp-ca", "kind": "ClusterIssuer"}
    assert injected_from(objects) == serving


def test_the_webhook_with_a_certificate_of_your_own(helm: Helm) -> None:
    objects = webhook_case(helm, "webhook-own-tls-values.yaml")
    assert of_kind(objects, "Certificate") == of_kind(objects, "Issuer") == []
    pod, _ = operator_container(objects)
    (volume,) = [v for v in pod["volumes"] if v["name"] == "webhook-tls"]
    assert volume["secret"]["secretName"] == "kvpool-webhook-tls"
    (webhook,) = one(objects, "ValidatingWebhookConfiguration")["webhooks"]
    assert webhook["clientConfig"]["caBundle"]
    # Namespaced mode: only the watched namespaces are sent to it.
    (expression,) = webhook["namespaceSelector"]["matchExpressions"]
    assert expression == {"key": "kubernetes.io/metadata.name", "operator": "In", "values": [NAMESPACE]}


def test_no_webhook_by_default(helm: Helm) -> None:
    objects = helm.template()
    assert operator_options(operator_container(objects)[1]).webhook is None
    assert of_kind(objects, "ValidatingWebhookConfiguration") == []


def test_the_operator_knows_its_own_pods_and_is_never_a_consumer(helm: Helm) -> None:
    objects = helm.template()
    deployment = one(objects, "Deployment")
    _, container = operator_container(objects)
    policy = operator_options(container).policy
    assert policy.operator_namespace == NAMESPACE
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    # The labels it passes select its own pods (each pool's NetworkPolicy lets those, and only
    # those, into its masters' HTTP port) ...
    assert dict(policy.operator_pod_labels).items() <= pod_labels.items()
    assert dict(policy.operator_pod_labels) == deployment["spec"]["selector"]["matchLabels"]
    # ... and its own Deployment is refused as a consumer, whatever labels someone adds.
    deployment["metadata"]["labels"][names.LABEL_ALLOW_POOL] = "pool"
    found = refusal({**deployment, "metadata": {**deployment["metadata"], "namespace": NAMESPACE}}, "pool")
    assert found is not None and found.rule == "operator-managed"


def test_the_policy_values_reach_the_operator(helm: Helm) -> None:
    options = operator_options(operator_container(helm.template())[1])
    default = options.policy
    assert default == OperatorPolicy(
        operator_namespace=default.operator_namespace,
        operator_pod_labels=default.operator_pod_labels,
        watched_namespaces=options.namespaces,  # a pool takes grants only from these
    )
    assert not default.allow_network_policy_opt_out and default.network_policy_end_port
    objects = helm.template(
        sets=[
            "operator.policy.allowedRegistries={registry.internal/mooncake,mirror.internal:5000}",
            "operator.policy.maxMasterReplicas=3",
            "operator.policy.maxStoreReplicas=8",
            "operator.policy.allowedPriorityClasses={kv-cache}",
            "operator.policy.allowedTolerationKeys={nvidia.com/gpu}",
            "operator.policy.protectedNodeKeys={example.com/infra}",
            "operator.policy.allowNetworkPolicyOptOut=true",
            "operator.policy.networkPolicyEndPort=false",
            "operator.policy.externalPools=false",
        ]
    )
    policy = operator_options(operator_container(objects)[1]).policy
    assert policy.allowed_registries == ("registry.internal/mooncake", "mirror.internal:5000")
    assert (policy.max_master_replicas, policy.max_store_replicas) == (3, 8)
    assert policy.allowed_priority_classes == ("kv-cache",)
    assert policy.allowed_toleration_keys == ("nvidia.com/gpu",)
    assert policy.protected_node_keys == ("example.com/infra",)
    assert policy.allow_network_policy_opt_out and not policy.network_policy_end_port
    assert default.allow_external_pools and not policy.allow_external_pools


def test_a_registry_that_is_not_one_fails_the_render(helm: Helm) -> None:
    with pytest.raises(AssertionError, match="allowedRegistries"):
        helm.template(sets=["operator.policy.allowedRegistries={registry.internal/x:1}"])


def test_the_operators_network_policy(helm: Helm) -> None:
    # On by default: the metrics, which name every watched pool, reach no one until scrapers
    # are named; the probes still reach the health port.
    default = one(helm.template(), "NetworkPolicy")
    assert default["spec"]["ingress"] == [{"ports": [{"port": "health", "protocol": "TCP"}]}]
    assert of_kind(helm.template(sets=["networkPolicy.enabled=false"]), "NetworkPolicy") == []
    webhook = EXAMPLES / "webhook-cert-manager-values.yaml"
    objects = helm.template(EXAMPLES / "monitoring-values.yaml", webhook)
    policy = one(objects, "NetworkPolicy")
    pod, container = operator_container(objects)
    labels = one(objects, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    rules = policy["spec"]["ingress"]
    named = {p["name"] for p in container["ports"]}
    opened = {(port["port"], bool(rule.get("from"))) for rule in rules for port in rule["ports"]}
    # Probes and the API server (webhook) from anywhere; metrics only from the scraper pods.
    assert opened == {("health", False), ("webhook", False), ("metrics", True)}
    assert {port for port, _ in opened} <= named
    (scrapers,) = [rule["from"] for rule in rules if rule.get("from")]
    for peer in scrapers:
        assert peer["namespaceSelector"]["matchLabels"] and peer["podSelector"]["matchLabels"]
    without_webhook = one(helm.template(EXAMPLES / "monitoring-values.yaml"), "NetworkPolicy")
    assert "webhook" not in str(without_webhook["spec"]["ingress"])
    assert pod["containers"] == [container]


def test_metrics_from_needs_both_selectors(helm: Helm) -> None:
    result = helm.run(
        "template",
        "kvpool",
        str(CHART),
        "--set",
        "networkPolicy.enabled=true",
        "--set",
        "networkPolicy.metricsFrom[0].namespaceSelector.team=monitoring",
        check=False,
    )
    assert result.returncode != 0 and "podSelector" in result.stderr
