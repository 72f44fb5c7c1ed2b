"""Injection at Pod admission, end to end: the real operator (kopf's webhook server and all)
answers AdmissionReviews as the API server sends them, and in this mode never writes a
consumer Deployment but for one restart annotation when the settings change."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import kmock
import pytest
import pytest_asyncio

from kvpool.operator import names
from kvpool.operator.app import INJECT_ID, OperatorOptions, WebhookOptions
from kvpool.operator.consumers import Injection, injected
from kvpool.operator.election import LeaseOptions
from kvpool.operator.grants import read_grant
from kvpool.operator.names import DEPLOYMENTS, POOLS
from kvpool.operator.plan import build_plan
from kvpool.operator.pod_injection import POD_ADMISSION
from kvpool.operator.rbac import LEASE_RULES, RULES, allowed, request_permission
from testing.kube_api import (
    DEPLOYMENTS_PATH,
    GRANTS_PATH,
    NAMESPACE,
    POOLS_PATH,
    TENANT_NAMESPACE,
    Cluster,
    OperatorThread,
    emulated_cluster,
    eventually,
    held_port,
    post_admission_review,
    quick_options,
    write_kubeconfig,
)
from testing.operator_objects import (
    Operator,
    as_created,
    consumer,
    kv_flags,
    pool_manifest,
    pool_spec,
    vllm_deployment,
)
from testing.pod_admission import admitted, pod_review, replica_set_pod, serving_pool
from tests.operator.test_grants_on_the_api import grant_manifest, tenancy_spec

pytestmark = pytest.mark.asyncio
LEASE_NAMESPACE = "kvpool-system"
POD_ADMISSION_CONFIG = {"webhook": True, "injection_mode": POD_ADMISSION}


def opted_in(name: str = "llm") -> dict[str, Any]:
    """A vLLM Deployment as in Git: the opt-in label on its pod template, nothing else."""
    deployment = vllm_deployment(name, allow_pool=None)
    deployment["spec"]["template"]["metadata"]["labels"][names.LABEL_ALLOW_POOL] = "pool"
    return deployment


async def review(url: str, pod: dict[str, Any]) -> dict[str, Any]:
    """The webhook's response to a Pod CREATE review (waiting for it to listen)."""
    answer = await post_admission_review(url, pod_review(pod))
    assert answer["kind"] == "AdmissionReview" and answer["response"]["uid"] == "review-pod"
    return dict(answer["response"])


def consumer_writes(cluster: Cluster, start: int = 0) -> list[kmock.Request]:
    path = DEPLOYMENTS.path(NAMESPACE, "llm")
    return [r for r in cluster.writes(start) if r.url.path == path]


async def serving(cluster: Cluster) -> None:
    """Play the Deployment controller until the pool's master and store serve."""

    def ready() -> bool:
        cluster.settle()
        pool = cluster.get(POOLS_PATH, "pool") or {}
        current = cluster.pool_status("pool").get("observedGeneration") == pool.get("metadata", {}).get(
            "generation"
        )
        return current and all(
            cluster.condition("pool", kind).get("status") == "True" for kind in ("MasterReady", "StoreReady")
        )

    await eventually(ready, what="the pool serves")


async def start_pod(cluster: Cluster, url: str, deployment: dict[str, Any], template_hash: str) -> dict:
    """A Pod of ``deployment`` through admission, stored as the API server would store it."""
    pod = replica_set_pod(deployment, template_hash)
    response = await review(url, pod)
    assert response["allowed"] is True, response
    stored = admitted(pod, response)
    stored["metadata"]["name"] = stored["metadata"].pop("generateName") + "x"
    await cluster.create(stored)
    return stored


@pytest.mark.parametrize("operator_config", [POD_ADMISSION_CONFIG])
async def test_pods_are_injected_and_the_deployment_in_git_is_never_written(
    cluster: Cluster, operator: Operator
) -> None:
    url = f"{operator.webhook_url}/{INJECT_ID}"
    deployment = opted_in()
    await cluster.create(deployment)
    await cluster.create(pool_manifest())

    # Before the pool serves, its consumers' Pods are refused (fail closed), rule and fix named.
    early = await review(url, replica_set_pod(deployment))
    assert early["allowed"] is False and early["status"]["code"] == 403
    assert "[pool-not-ready]" in early["status"]["message"]
    assert "the ReplicaSet controller retries" in early["status"]["message"]

    await serving(cluster)
    pod = await start_pod(cluster, url, deployment, "aaa")
    # The Pod runs exactly what Deployment patching would have put into its template.
    injection = build_plan("pool", NAMESPACE, pool_spec()).consumers[0]
    assert pod["spec"] == injected(deployment, injection)["spec"]["template"]["spec"]
    record = json.loads(pod["metadata"]["annotations"][names.ANNOTATION_INJECTED])
    assert record["configHash"] == injection.config_hash and record["deployment"] == "llm"

    await eventually(
        lambda: cluster.settle() or cluster.pool_status("pool").get("phase") == "Ready", what="Ready"
    )
    await cluster.quiet("pool")
    assert consumer_writes(cluster) == []
    stored = cluster.get(DEPLOYMENTS_PATH, "llm")
    created = as_created(cluster, "llm")
    assert stored is not None and stored["spec"] == created["spec"]
    assert stored["metadata"].get("labels") == deployment["metadata"]["labels"]
    assert "annotations" not in stored["metadata"]

    # A settings change: one write to the Deployment, the restart annotation and nothing else.
    start = cluster.mark()
    await cluster.patch_pool("pool", {"spec": {"connector": {"cache_prefix": "team-b"}}})
    new_hash = (
        build_plan("pool", NAMESPACE, pool_spec(connector={"cache_prefix": "team-b"}))
        .consumers[0]
        .config_hash
    )
    await eventually(lambda: consumer_writes(cluster, start), what="the restart annotation")
    await serving(cluster)
    restarted = cluster.get(DEPLOYMENTS_PATH, "llm")
    assert restarted is not None
    new_pod = await start_pod(cluster, url, restarted, "bbb")
    assert json.loads(new_pod["metadata"]["annotations"][names.ANNOTATION_INJECTED])["configHash"] == new_hash
    await eventually(
        lambda: cluster.settle() or cluster.pool_status("pool").get("phase") == "Ready", what="Ready"
    )
    await cluster.quiet("pool")
    (write,) = consumer_writes(cluster, start)
    assert write.method.upper() == "PATCH"
    body = dict(write.data)
    # metadata: only the preconditions (the emulator notes the generation in what it received)
    assert set(body["metadata"]) <= {"uid", "resourceVersion", "generation"}
    assert body["spec"] == {
        "template": {"metadata": {"annotations": {names.ANNOTATION_CONFIG_HASH: new_hash}}}
    }
    assert restarted["spec"]["template"]["spec"] == created["spec"]["template"]["spec"]


@pytest.mark.parametrize("operator_config", [POD_ADMISSION_CONFIG])
async def test_refusals_are_denied_reviews_and_unlabelled_pods_are_never_touched(
    cluster: Cluster, operator: Operator
) -> None:
    url = f"{operator.webhook_url}/{INJECT_ID}"
    await cluster.create(opted_in())
    await cluster.create(pool_manifest())
    await serving(cluster)

    stranger = await review(url, replica_set_pod(opted_in("other")))
    assert stranger["allowed"] is False and stranger["status"]["code"] == 403
    message = stranger["status"]["message"]
    assert message.endswith("[not-a-consumer]") and "add it to the pool's spec.consumers" in message
    assert "patch" not in stranger

    shell = opted_in()
    vllm = shell["spec"]["template"]["spec"]["containers"][0]
    vllm["command"] = ["sh", "-c", "vllm serve org/model"]
    del vllm["args"]
    refused = await review(url, replica_set_pod(shell))
    assert refused["allowed"] is False and "[shell-launch]" in refused["status"]["message"]

    unlabelled = replica_set_pod(vllm_deployment(allow_pool=None))
    answer = await review(url, unlabelled)
    assert answer["allowed"] is True and "patch" not in answer
    assert admitted(unlabelled, answer) == unlabelled


# --- a standby answers too ---------------------------------------------------------------


@pytest_asyncio.fixture
async def own_cluster() -> AsyncIterator[Cluster]:
    """An emulated API of this test's own (the Lease is granted apart from the chart's rules)."""
    async with emulated_cluster() as cluster:
        yield cluster


async def a_standby(cluster: Cluster, tmp_path: Path, lease_duration: float) -> tuple[OperatorThread, int]:
    """A replica (not started) that finds the Lease held by another, for ``lease_duration``
    seconds, and a serving pool with an opted-in consumer; the port of its webhook."""
    lease = {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": "kvpool-operator", "namespace": LEASE_NAMESPACE},
        "spec": {"holderIdentity": "elsewhere", "leaseDurationSeconds": int(lease_duration)},
    }
    await cluster.create(lease)
    await cluster.create(opted_in())
    pool = await cluster.create(serving_pool())  # Ready, as the leader left it
    response = await cluster.api.patch(
        POOLS.path(NAMESPACE, "pool", "status"),
        json={"status": serving_pool(generation=pool["metadata"].get("generation", 1))["status"]},
        headers={"Content-Type": "application/merge-patch+json"},
    )
    assert response.status == 200, await response.text()
    port = held_port()
    options = OperatorOptions(
        **quick_options(
            write_kubeconfig(tmp_path / "kubeconfig", cluster.url),
            leader_election=LeaseOptions(LEASE_NAMESPACE, identity="standby", lease_duration=lease_duration),
            webhook=WebhookOptions(port=port, addr="127.0.0.1", host="127.0.0.1", insecure=True),
            injection_mode=POD_ADMISSION,
        )
    )
    return OperatorThread(options), port


async def test_a_standby_answers_the_webhook_and_writes_nothing(
    own_cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    cluster = own_cluster
    # Another replica holds the Lease for the whole test: this one stays a standby.
    standby, port = await a_standby(cluster, tmp_path, lease_duration=3600.0)
    start = cluster.mark()
    standby.start()
    try:
        answer = await review(f"http://127.0.0.1:{port}/{INJECT_ID}", replica_set_pod(opted_in()))
        assert answer["allowed"] is True and "patch" in answer
        injected_pod = admitted(replica_set_pod(opted_in()), answer)
        assert names.ANNOTATION_INJECTED in injected_pod["metadata"]["annotations"]
        refused = await review(f"http://127.0.0.1:{port}/{INJECT_ID}", replica_set_pod(opted_in("other")))
        assert refused["allowed"] is False and "[not-a-consumer]" in refused["status"]["message"]
    finally:
        await standby.stop()
    assert standby.error is None, repr(standby.error)
    assert cluster.writes(start) == []  # the standby acted on nothing, wrote nothing
    assert not cluster.watching_pools(start)
    for request in cluster.requests(start):
        permission = request_permission(request.method, str(request.url))
        assert permission is None or allowed(permission, RULES + LEASE_RULES), request.url


async def test_a_standby_that_takes_the_lease_over_answers_every_review_meanwhile(
    own_cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Lease's holder is gone (evicted; its webhook with it): the standby takes the Lease
    over, and its webhook port never closes as its admission-only run makes way for its main
    one (a refused connection, with failurePolicy Fail, refuses the Pod)."""
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    cluster = own_cluster
    standby, port = await a_standby(cluster, tmp_path, lease_duration=3.0)  # never renewed
    url = f"http://127.0.0.1:{port}/{INJECT_ID}"
    review = pod_review(replica_set_pod(opted_in()))
    # "answered" (allowed or refused: once it acts, its passes may leave the pool not Ready),
    # or what went wrong.
    answers: list[str] = []
    start = cluster.mark()
    standby.start()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 60
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            # From the standby's first answer until a while after its main run watches pools.
            acting_since = None
            while acting_since is None or loop.time() < acting_since + 1.0:
                assert loop.time() < deadline and standby.alive, (standby.error, answers[-5:])
                try:
                    async with session.post(url, json=review) as response:
                        body = await response.json() if response.status == 200 else {}
                        uid = (body.get("response") or {}).get("uid")
                        answers.append("answered" if uid == "review-pod" else f"{response.status}: {body}")
                except aiohttp.ClientError as exc:
                    answers.append(repr(exc))
                if acting_since is None and cluster.watching_pools(start):
                    acting_since = loop.time()
                await asyncio.sleep(0.01)
        assert lease_holder_of(cluster) == "standby"
    finally:
        await standby.stop()
    assert standby.error is None, repr(standby.error)
    served = answers[answers.index("answered") :]
    assert [answer for answer in served if answer != "answered"] == []


def lease_holder_of(cluster: Cluster) -> str | None:
    for (resource, namespace, name), obj in list(cluster.api.objects.items()):
        if resource.plural == "leases" and (namespace, name) == (LEASE_NAMESPACE, "kvpool-operator"):
            return None if obj.deleted else (obj.raw.get("spec") or {}).get("holderIdentity")
    return None


def test_the_cli_sets_the_mode_and_pod_admission_needs_the_webhook() -> None:
    from kvpool.operator.cli import _parser, options_from_args

    assert options_from_args(_parser().parse_args(["run"])).injection_mode == "deploymentPatch"
    args = ["run", "--webhook-port", "9443", "--injection-mode", POD_ADMISSION]
    assert options_from_args(_parser().parse_args(args)).injection_mode == POD_ADMISSION
    with pytest.raises(SystemExit, match="--webhook-port"):
        options_from_args(_parser().parse_args(["run", "--injection-mode", POD_ADMISSION]))


@pytest.mark.parametrize("operator_config", [POD_ADMISSION_CONFIG])
async def test_what_patching_put_in_stays_while_the_pool_does_not_serve(
    cluster: Cluster, operator: Operator
) -> None:
    """Taking the settings out rolls the consumer, and admission refuses its new Pods until the
    pool serves: a consumer keeps what patching put in until its Pods can be admitted."""
    spec = pool_spec()
    injection = build_plan("pool", NAMESPACE, spec).consumers[0]
    moved = injected(opted_in("llm"), injection)
    moved["metadata"]["labels"][names.LABEL_CONSUMER_OF] = "pool"
    await cluster.create(moved)
    start = cluster.mark()
    await cluster.create(pool_manifest(spec=spec))
    await cluster.passes("pool", start, count=3)  # no Deployment controller: never serves
    assert cluster.condition("pool", "MasterReady").get("status") != "True"
    assert consumer_writes(cluster, start) == []
    assert kv_flags(cluster.get(DEPLOYMENTS_PATH, "llm"))

    await serving(cluster)
    await eventually(lambda: not kv_flags(cluster.get(DEPLOYMENTS_PATH, "llm")), what="llm restored")


@pytest.mark.parametrize("operator_config", [POD_ADMISSION_CONFIG])
async def test_what_patching_put_in_is_taken_out_once_the_template_opts_in(
    cluster: Cluster, operator: Operator
) -> None:
    spec = pool_spec(consumers=[consumer("legacy"), consumer("llm")])
    injections = {c.deployment: c for c in build_plan("pool", NAMESPACE, spec).consumers}
    moved = injected(opted_in("llm"), injections["llm"])  # patched before, label now on the template
    legacy = injected(vllm_deployment("legacy"), injections["legacy"])  # label on the Deployment only
    for deployment in (moved, legacy):
        deployment["metadata"]["labels"][names.LABEL_CONSUMER_OF] = "pool"
        await cluster.create(deployment)
    await cluster.create(pool_manifest(spec=spec))
    await serving(cluster)

    await eventually(lambda: not kv_flags(cluster.get(DEPLOYMENTS_PATH, "llm")), what="llm restored")
    restored = cluster.get(DEPLOYMENTS_PATH, "llm")
    assert restored is not None and names.LABEL_CONSUMER_OF not in restored["metadata"]["labels"]
    # Refused (its owner has yet to move the label onto its pod template): left as it is, and said.
    conflict = await eventually(
        lambda: (
            cluster.condition("pool", "Conflict").get("status") == "True"
            and cluster.condition("pool", "Conflict")["message"]
        ),
        what="Conflict",
    )
    assert "Deployment team-a/legacy needs the label" in conflict and "on its pod template" in conflict
    assert kv_flags(cluster.get(DEPLOYMENTS_PATH, "legacy"))


# --- a grant's consumers in another namespace --------------------------------------------

TENANT_GRANT = "tenant"


def tenant_opted_in(name: str, pool_namespace: str | None = NAMESPACE) -> dict[str, Any]:
    """A Deployment of the tenant's namespace as in Git: on its pod template the opt-in label
    and (``pool_namespace``) the one naming the pool's namespace."""
    deployment = vllm_deployment(name, allow_pool=None)
    deployment["metadata"]["namespace"] = TENANT_NAMESPACE
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    labels[names.LABEL_ALLOW_POOL] = "pool"
    if pool_namespace is not None:
        labels[names.LABEL_ALLOW_POOL_NAMESPACE] = pool_namespace
    return deployment


async def create_granted_pool(cluster: Cluster, *tenant_consumers: str) -> dict[str, Any]:
    """A pool taking grants from the tenant's namespace, its own consumer ``llm`` (opted in,
    with its grant), and grant ``tenant`` there listing ``tenant_consumers``; the pool's spec."""
    await cluster.create(opted_in("llm"))
    await cluster.create(grant_manifest("team-a", "8MB"))
    granted = grant_manifest(TENANT_GRANT, "8MB", namespace=TENANT_NAMESPACE, pool_namespace=NAMESPACE)
    granted["spec"]["consumers"] = [consumer(name) for name in tenant_consumers]
    await cluster.create(granted)
    spec = tenancy_spec("team-a")
    spec["tenancy"]["grantNamespaces"] = [TENANT_NAMESPACE]
    await cluster.create(pool_manifest(spec=spec))
    return spec


def grant_injection(cluster: Cluster, spec: dict[str, Any], namespace: str, name: str) -> Injection:
    """What Deployment patching gives ``namespace/name`` (the pool's plan with the grants as stored)."""
    grants = [
        read_grant(g)
        for g in (
            cluster.get(GRANTS_PATH, "team-a"),
            cluster.get(GRANTS_PATH, TENANT_GRANT, TENANT_NAMESPACE),
        )
        if g is not None
    ]
    plan = build_plan("pool", NAMESPACE, spec, grants=grants)
    (injection,) = [
        c for c in plan.consumers if c.deployment == name and (c.namespace or NAMESPACE) == namespace
    ]
    return injection


@pytest.mark.parametrize("operator_config", [POD_ADMISSION_CONFIG])
async def test_a_grants_consumer_in_another_namespace_is_injected_with_the_grants_settings(
    cluster: Cluster, operator: Operator
) -> None:
    url = f"{operator.webhook_url}/{INJECT_ID}"
    chat = tenant_opted_in("chat")
    await cluster.create(chat)
    spec = await create_granted_pool(cluster, "chat")
    await serving(cluster)

    # Its Pod gets what Deployment patching would put into its template: the grant's tenant,
    # the grant's ConfigMap in the tenant's namespace, the pool's namespace as a label.
    pod = await start_pod(cluster, url, chat, "aaa")
    injection = grant_injection(cluster, spec, TENANT_NAMESPACE, "chat")
    assert injection.namespace == TENANT_NAMESPACE and injection.config_map == "pool-tenant-connector"
    template = injected(chat, injection)["spec"]["template"]
    assert pod["spec"] == template["spec"]
    assert pod["metadata"]["labels"][names.LABEL_POOL_NAMESPACE] == NAMESPACE
    (flag,) = [a for a in pod["spec"]["containers"][0]["args"] if a.startswith("--kv-transfer-config")]
    assert (
        json.loads(flag.split("=", 1)[1])["kv_connector_extra_config"]["tenant"]
        == f"{TENANT_NAMESPACE}.tenant"
    )
    record = json.loads(pod["metadata"]["annotations"][names.ANNOTATION_INJECTED])
    assert record["configHash"] == injection.config_hash and record["deployment"] == "chat"

    # A tenant's Deployment no grant lists: refused, and told where to list it.
    stranger = await review(url, replica_set_pod(tenant_opted_in("stranger")))
    assert stranger["allowed"] is False and stranger["status"]["code"] == 403
    message = stranger["status"]["message"]
    assert message.endswith("[not-a-consumer]") and "MooncakeKVPoolGrant" in message
    # A listed one with the opt-in label alone names a pool of its own namespace: the refusal
    # names the label it lacks.
    bare = await review(url, replica_set_pod(tenant_opted_in("chat", pool_namespace=None)))
    assert bare["allowed"] is False and bare["status"]["message"].endswith("[consent]")
    assert f"{names.LABEL_ALLOW_POOL_NAMESPACE}={NAMESPACE}" in bare["status"]["message"]
    # A Deployment of the pool's namespace named as the tenant's consumer is another Deployment.
    namesake = await review(url, replica_set_pod(opted_in("chat")))
    assert namesake["allowed"] is False and namesake["status"]["message"].endswith("[not-a-consumer]")
    assert "add it to the pool's spec.consumers" in namesake["status"]["message"]
    # ... and the tenant's Deployment named as the pool's own consumer is not that one.
    other_llm = await review(url, replica_set_pod(tenant_opted_in("llm")))
    assert other_llm["allowed"] is False and other_llm["status"]["message"].endswith("[not-a-consumer]")


@pytest.mark.parametrize("operator_config", [POD_ADMISSION_CONFIG])
async def test_grant_consumers_in_another_namespace_roll_out_one_after_the_other(
    cluster: Cluster, operator: Operator
) -> None:
    url = f"{operator.webhook_url}/{INJECT_ID}"
    tenants = [tenant_opted_in("chat"), tenant_opted_in("batch")]
    for deployment in tenants:
        await cluster.create(deployment)
    start = cluster.mark()
    await create_granted_pool(cluster, "chat", "batch")
    await serving(cluster)
    for index, deployment in enumerate([opted_in("llm"), *tenants]):
        await start_pod(cluster, url, deployment, f"hash{index}")

    def consumers() -> dict[str, dict[str, Any]]:
        cluster.settle()
        return {c["name"]: c for c in cluster.pool_status("pool").get("consumers") or []}

    wanted = ("llm", f"{TENANT_NAMESPACE}/chat", f"{TENANT_NAMESPACE}/batch")
    await eventually(
        lambda: (
            all(consumers().get(name, {}).get("rolledOut") for name in wanted)
            and cluster.condition("pool", "ConsumersRolledOut").get("status") == "True"
        ),
        what="every consumer rolled out",
    )

    def on_grant() -> dict[str, dict[str, Any]]:
        status = (cluster.get(GRANTS_PATH, TENANT_GRANT, TENANT_NAMESPACE) or {}).get("status") or {}
        return {c["name"]: c for c in status.get("consumers") or []}

    await eventually(
        lambda: all(on_grant().get(name, {}).get("rolledOut") for name in ("chat", "batch")),
        what="the tenant's grant says both rolled out",
    )
    # Pod admission writes no tenant Deployment, and every request is one the chart allows.
    await cluster.quiet("pool")
    tenant_paths = {DEPLOYMENTS.path(TENANT_NAMESPACE, d["metadata"]["name"]) for d in tenants}
    assert [w for w in cluster.writes(start) if w.url.path in tenant_paths] == []
    for request in cluster.requests(start):
        permission = request_permission(request.method, str(request.url))
        assert permission is None or allowed(permission, RULES + LEASE_RULES), request.url


@pytest.mark.parametrize("operator_config", [POD_ADMISSION_CONFIG])
async def test_a_consumer_running_the_settings_gets_them_in_new_pods_while_the_pool_is_down(
    cluster: Cluster, operator: Operator
) -> None:
    """A Pod created while the pool does not serve (a scale-up during a store rollout, a node
    drain) of a Deployment already running the pool's settings gets them, as its siblings run
    them and as Deployment patching would: refusing it would cost the consumer its Pod."""
    url = f"{operator.webhook_url}/{INJECT_ID}"
    deployment = opted_in()
    await cluster.create(deployment)
    await cluster.create(pool_manifest())
    await serving(cluster)
    first = await start_pod(cluster, url, deployment, "aaa")

    await cluster.patch_pool("pool", {"spec": {"store": {"replicas": 3}}})  # no controller plays
    await eventually(
        lambda: (
            cluster.condition("pool", "StoreReady").get("status") == "False"
            and cluster.pool_status("pool").get("observedGeneration") == 2
        ),
        what="the pool does not serve",
    )
    second = await start_pod(cluster, url, deployment, "bbb")
    assert second["spec"] == first["spec"]
    record = json.loads(second["metadata"]["annotations"][names.ANNOTATION_INJECTED])
    assert record == json.loads(first["metadata"]["annotations"][names.ANNOTATION_INJECTED])

    # A Deployment that never ran them waits for the pool (its Pods refused, as before).
    other = opted_in("chat")
    await cluster.create(other)
    refused = await review(url, replica_set_pod(other))
    assert refused["allowed"] is False and "[pool-not-ready]" in refused["status"]["message"]


@pytest.mark.parametrize(
    "operator_config", [{**POD_ADMISSION_CONFIG, "namespaces": (NAMESPACE, TENANT_NAMESPACE)}]
)
async def test_a_pod_naming_a_pool_in_a_namespace_not_watched_is_refused(
    cluster: Cluster, operator: Operator
) -> None:
    """No webhook answers for a pool in a namespace this operator does not watch (another
    operator's webhook sees only its own namespaces' Pods): the Pod is refused, naming the
    label, never admitted without the settings it opted into."""
    url = f"{operator.webhook_url}/{INJECT_ID}"
    deployment = opted_in()
    deployment["spec"]["template"]["metadata"]["labels"][names.LABEL_ALLOW_POOL_NAMESPACE] = "elsewhere"
    answer = await review(url, replica_set_pod(deployment))
    assert answer["allowed"] is False and "[namespace-not-watched]" in answer["status"]["message"]
    assert names.LABEL_ALLOW_POOL_NAMESPACE in answer["status"]["message"]


@pytest.mark.parametrize("operator_config", [POD_ADMISSION_CONFIG])
async def test_a_consumer_scaled_to_zero_never_holds_the_rollout_back(
    cluster: Cluster, operator: Operator
) -> None:
    """A consumer at 0 replicas (parked, or scaled to zero by an autoscaler) runs no Pod with
    other settings, and the webhook gives its next Pods the current ones: it is rolled out,
    and the consumers after it roll on, rather than waiting for Pods that never come."""
    url = f"{operator.webhook_url}/{INJECT_ID}"
    idle = opted_in("idle")
    idle["spec"]["replicas"] = 0
    await cluster.create(idle)
    llm = opted_in("llm")
    await cluster.create(llm)
    await cluster.create(pool_manifest(spec=pool_spec(consumers=[consumer("idle"), consumer("llm")])))
    await serving(cluster)
    await start_pod(cluster, url, llm, "aaa")

    def consumers() -> dict[str, dict[str, Any]]:
        cluster.settle()
        return {c["name"]: c for c in cluster.pool_status("pool").get("consumers") or []}

    await eventually(
        lambda: (
            all(consumers().get(name, {}).get("rolledOut") for name in ("idle", "llm"))
            and cluster.condition("pool", "ConsumersRolledOut").get("status") == "True"
        ),
        what="both consumers rolled out",
    )
    # Nothing was restarted: neither runs other settings.
    for name in ("idle", "llm"):
        template = cluster.get(DEPLOYMENTS_PATH, name)["spec"]["template"]
        assert names.ANNOTATION_CONFIG_HASH not in (template["metadata"].get("annotations") or {})
