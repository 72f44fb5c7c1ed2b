"""The test node itself: what it does with a pod template, a rollout, a Service (pure parts
first, then real processes: a small HTTP server Deployment and a client pod)."""

from __future__ import annotations

import ipaddress
import os
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from testing.node import podspec, workloads
from testing.node.podspec import Mount, PodIdentity, PodSpecError
from testing.node.workloads import PodView
from tests.e2e.conftest import E2E
from tests.e2e.harness import NAMESPACE, path, wait_for

POD = PodIdentity(
    name="web-1", namespace=NAMESPACE, uid="u1", ip="127.0.0.9", node_name="n", labels={"app": "web"}
)


# --- the pod template, pure ------------------------------------------------------------------
def test_expansion_follows_kubernetes() -> None:
    env = {"POD_IP": "127.0.0.9", "PORT": "80"}
    assert podspec.expand("--host=$(POD_IP):$(PORT)", env) == "--host=127.0.0.9:80"
    assert podspec.expand("$$(POD_IP) $(MISSING) $$", env) == "$(POD_IP) $(MISSING) $"


def test_env_resolves_in_order_with_field_refs_and_configmaps() -> None:
    container = {
        "name": "c",
        "env": [
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "URL", "value": "http://$(POD_IP):$(PORT)"},
            {"name": "PORT", "value": "80"},
            {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
            {"name": "MODE", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "mode"}}},
        ],
    }
    env = podspec.container_env(container, POD, {"cfg": {"data": {"mode": "fast"}}})
    # $(PORT) is defined after URL: left as written, as the kubelet does.
    assert env == {
        "POD_IP": "127.0.0.9",
        "URL": "http://127.0.0.9:$(PORT)",
        "PORT": "80",
        "APP": "web",
        "MODE": "fast",
    }
    with pytest.raises(PodSpecError, match=r"env\[0\].*secretKeyRef|only value"):
        podspec.container_env(
            {"name": "c", "env": [{"name": "S", "valueFrom": {"secretKeyRef": {}}}]}, POD, {}
        )


def test_mount_paths_are_rewritten_as_whole_paths() -> None:
    mounts = [Mount("/etc/kvpool", Path("/pods/a/volumes/cfg")), Mount("/tmp", Path("/pods/a/volumes/tmp"))]
    assert podspec.rewrite("MOONCAKE_CONFIG_PATH=/etc/kvpool/mooncake.json", mounts) == (
        "MOONCAKE_CONFIG_PATH=/pods/a/volumes/cfg/mooncake.json"
    )
    assert podspec.rewrite("/etc/kvpool", mounts) == "/pods/a/volumes/cfg"
    assert podspec.rewrite("/etc/kvpoolx /var/tmp /tmpfs", mounts) == "/etc/kvpoolx /var/tmp /tmpfs"
    # A directory put in is not rewritten again: pods live under the node's /tmp too.
    nested = [
        Mount("/var/lib/tier", Path("/tmp/node/a/volumes/tier")),
        Mount("/tmp", Path("/tmp/node/a/tmp")),
    ]
    assert (
        podspec.rewrite("DIR=/var/lib/tier /tmp/x", nested)
        == "DIR=/tmp/node/a/volumes/tier /tmp/node/a/tmp/x"
    )


# --- rollouts, pure --------------------------------------------------------------------------
def _deployment(replicas: int, strategy: dict, template: dict | None = None) -> dict:
    return {
        "metadata": {"name": "d", "generation": 3},
        "spec": {"replicas": replicas, "strategy": strategy, "template": template or {"spec": {"x": 1}}},
    }


def test_rolling_update_surges_one_and_counts_old_pods_in_replicas() -> None:
    deployment = _deployment(
        1, {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": "25%", "maxUnavailable": "25%"}}
    )
    current = workloads.revision(deployment["spec"]["template"])
    old = PodView("d-old", "old", ready=True, available=True)
    plan = workloads.deployment_plan(deployment, [old])
    assert plan.actions == workloads.Actions(create=1)
    starting = PodView("d-new", current, ready=False, available=False)
    plan = workloads.deployment_plan(deployment, [old, starting])
    assert plan.actions == workloads.Actions()  # the old pod stays until the new one is available
    assert plan.status["replicas"] == 2
    assert plan.status["updatedReplicas"] == plan.status["availableReplicas"] == 1
    plan = workloads.deployment_plan(deployment, [old, PodView("d-new", current, True, True)])
    assert plan.actions == workloads.Actions(delete=("d-old",))


def test_one_at_a_time_without_surge() -> None:
    deployment = _deployment(
        2, {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
    )
    current = workloads.revision(deployment["spec"]["template"])
    olds = [PodView(f"d-old{i}", "old", True, True) for i in range(2)]
    assert workloads.deployment_plan(deployment, olds).actions == workloads.Actions(delete=("d-old0",))
    assert workloads.deployment_plan(deployment, olds[1:]).actions == workloads.Actions(create=1)
    starting = PodView("d-new", current, False, False)
    assert workloads.deployment_plan(deployment, [olds[1], starting]).actions == workloads.Actions()


def test_recreate_waits_for_old_pods_to_be_gone() -> None:
    deployment = _deployment(1, {"type": "Recreate"})
    old = PodView("d-old", "old", True, True)
    assert workloads.deployment_plan(deployment, [old]).actions == workloads.Actions(delete=("d-old",))
    dying = PodView("d-old", "old", False, False, terminating=True)
    assert workloads.deployment_plan(deployment, [dying]).actions == workloads.Actions()
    assert workloads.deployment_plan(deployment, []).actions == workloads.Actions(create=1)


def test_statefulset_orders_its_pods() -> None:
    statefulset = {"metadata": {"name": "s", "generation": 1}, "spec": {"replicas": 3, "template": {}}}
    rev = workloads.revision({})
    assert workloads.stateful_plan(statefulset, []).actions.create_names == ("s-0",)
    waiting = [PodView("s-0", rev, False, False)]
    assert workloads.stateful_plan(statefulset, waiting).actions.create_names == ()
    ready = [PodView("s-0", rev, True, True)]
    assert workloads.stateful_plan(statefulset, ready).actions.create_names == ("s-1",)
    statefulset["spec"]["podManagementPolicy"] = "Parallel"
    assert workloads.stateful_plan(statefulset, []).actions.create_names == ("s-0", "s-1", "s-2")


# --- real processes --------------------------------------------------------------------------
def _web(replicas: int, greeting: str) -> list[dict]:
    """An HTTP server Deployment serving a ConfigMap's file, its ConfigMap and its Service."""
    configmap = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "web-content", "namespace": NAMESPACE},
        "data": {"greeting.txt": greeting},
    }
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "web", "namespace": NAMESPACE},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": "web"}},
            "template": {
                "metadata": {"labels": {"app": "web"}},
                "spec": {
                    "terminationGracePeriodSeconds": 5,
                    "containers": [
                        {
                            "name": "web",
                            "image": "python:3.11",
                            "command": [
                                "python",
                                "-m",
                                "http.server",
                                "$(PORT)",
                                "--directory",
                                "/srv/content",
                            ],
                            "env": [
                                {"name": "PORT", "value": "8080"},
                                {"name": "GREETING", "value": greeting},
                                {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                            ],
                            "ports": [{"name": "http", "containerPort": 8080}],
                            "readinessProbe": {
                                "httpGet": {"path": "/greeting.txt", "port": "http"},
                                "periodSeconds": 1,
                            },
                            "volumeMounts": [
                                {"name": "content", "mountPath": "/srv/content", "readOnly": True}
                            ],
                        }
                    ],
                    "volumes": [{"name": "content", "configMap": {"name": "web-content"}}],
                },
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "web", "namespace": NAMESPACE},
        "spec": {"selector": {"app": "web"}, "ports": [{"name": "http", "port": 80, "targetPort": "http"}]},
    }
    return [configmap, deployment, service]


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


def shell_deployment(name: str, script: str) -> dict[str, Any]:
    """A one-replica Deployment ``name`` whose one container runs ``sh -c script`` in its pod's
    directory (one second to stop)."""
    container = {"name": "main", "image": "busybox", "command": ["sh", "-c", script]}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {"terminationGracePeriodSeconds": 1, "containers": [container]},
            },
        },
    }


@pytest.mark.e2e
def test_node_runs_rolls_scales_and_deletes_a_deployment(e2e: E2E) -> None:
    for obj in _web(2, "hello"):
        e2e.kube.create(obj)
    deployment_path = path("apps/v1", "Deployment", "web")
    try:
        pods = wait_for(
            lambda: (p := e2e.pods("web")) and len(p) == 2 and all(x.ready for x in p) and p,
            60,
            "two ready pods",
        )
        assert len({p.ip for p in pods}) == 2
        assert all(ipaddress.ip_address(p.ip) in e2e.node.pod_network for p in pods)
        for pod in pods:
            # The same port on each pod's own address; the ConfigMap at its rewritten mount path.
            assert _get(f"http://{pod.ip}:8080/greeting.txt") == "hello"
            container = pod.container()
            assert container.argv[1:4] == ("-m", "http.server", "8080")
            assert container.env["POD_IP"] == pod.ip
            assert container.path("/srv/content/greeting.txt").read_text() == "hello"
        status = wait_for(
            lambda: (
                (e2e.kube.get(deployment_path) or {}).get("status", {}).get("readyReplicas") == 2
                and e2e.kube.get(deployment_path)["status"]
            ),
            30,
            "the status written back",
        )
        assert status["observedGeneration"] == 1
        assert status["replicas"] == status["updatedReplicas"] == status["availableReplicas"] == 2
        # The Service: its own loopback address, port 80 relayed to a ready pod's 8080.
        (address,) = e2e.node.lookup("web.team-a.svc")
        assert ipaddress.ip_address(address) in e2e.node.service_network
        assert _get("http://web.team-a.svc.cluster.local/greeting.txt") == "hello"

        # A template change rolls every pod; the old ones stop.
        old = {p.name: p for p in pods}
        e2e.kube.patch(
            deployment_path,
            {"spec": {"template": {"metadata": {"annotations": {"rolled": "yes"}}}}},
        )
        rolled = wait_for(
            lambda: (
                (p := e2e.pods("web")) and len(p) == 2 and all(x.ready and x.name not in old for x in p) and p
            ),
            60,
            "two new ready pods",
        )
        assert {p.annotations.get("rolled") for p in rolled} == {"yes"}
        stopped = wait_for(
            lambda: [p for p in e2e.node.all_pods() if p.name in old and p.stopped], 30, "old pods stopped"
        )
        assert all(not c.running for p in stopped for c in p.containers)
        wait_for(
            lambda: e2e.kube.get(deployment_path)["status"].get("observedGeneration") == 2, 30, "generation 2"
        )

        # Scale down: one pod goes.
        e2e.kube.patch(deployment_path, {"spec": {"replicas": 1}})
        wait_for(lambda: len([p for p in e2e.pods("web") if not p.terminating]) == 1, 30, "one pod left")
    finally:
        e2e.remove(deployment_path, path("v1", "Service", "web"), path("v1", "ConfigMap", "web-content"))
    gone = wait_for(lambda: not e2e.pods("web") and e2e.node.all_pods(), 60, "every web pod gone")
    for pod in gone:
        if pod.owner == ("Deployment", "web"):
            for container in pod.containers:
                for pid in container.pids:
                    with pytest.raises(ProcessLookupError):
                        os.kill(pid, 0)


@pytest.mark.e2e
def test_a_pod_resolves_services_and_knows_its_name(e2e: E2E) -> None:
    for obj in _web(1, "dns"):
        e2e.kube.create(obj)
    script = "hostname > name; until getent hosts web > resolved; do sleep 0.2; done; exec sleep 600"
    client = shell_deployment("client", script)
    e2e.kube.create(client)
    try:
        pod = wait_for(lambda: e2e.pods("client") and e2e.pods("client")[0], 30, "the client pod")
        resolved = wait_for(lambda: (pod.directory / "resolved").read_text().split(), 30, "its lookup")
        assert resolved[0] == e2e.node.lookup("web.team-a.svc")[0]
        assert (pod.directory / "name").read_text().strip() == pod.name
    finally:
        e2e.remove(
            path("apps/v1", "Deployment", "client"),
            path("apps/v1", "Deployment", "web"),
            path("v1", "Service", "web"),
            path("v1", "ConfigMap", "web-content"),
        )
    wait_for(lambda: not e2e.pods("client") and not e2e.pods("web"), 60, "the pods gone")


@pytest.mark.e2e
def test_a_restarted_container_runs_again_and_its_pod_says_so(e2e: E2E) -> None:
    """A container that exits once (as a store does while its master starts) is restarted:
    the pod is Running and Ready again, on the node and in the API, where the operator reads
    it (a pod left Pending there looked unready to the operator: a drained store's scale-down
    was applied at once, and the node's controller removed the wrong store)."""
    from kvpool.operator.consumer_hits import pod_ready

    once = "test -e exited || { touch exited; exit 3; }; exec sleep 600"
    flaky = shell_deployment("flaky", once)
    e2e.kube.create(flaky)
    try:
        pod = wait_for(
            lambda: (p := e2e.pods("flaky")) and p[0].container().restarts == 1 and p[0].ready and p[0],
            60,
            "the pod ready after one restart",
        )
        assert pod.reason == "Running" and pod.container().exit_codes == (3,)
        mirrored = wait_for(
            lambda: (
                (e2e.kube.get(path("v1", "Pod", pod.name)) or {}).get("status", {}).get("phase") == "Running"
                and e2e.kube.get(path("v1", "Pod", pod.name))
            ),
            30,
            "the API's pod Running",
        )
        assert pod_ready(mirrored)
    finally:
        e2e.remove(path("apps/v1", "Deployment", "flaky"))
    wait_for(lambda: not e2e.pods("flaky"), 60, "the pod gone")


@pytest.mark.e2e
def test_init_containers_run_in_order_to_success_before_the_containers(e2e: E2E) -> None:
    """Each init container runs to a zero exit, in order, before any container starts; one
    that fails runs again (and the ones before it do not); a pod whose init container never
    succeeds stays Pending in its init phase and never starts its containers."""
    ordered = shell_deployment("ordered", "echo main >> order; exec sleep 600")
    ordered["spec"]["template"]["spec"]["initContainers"] = [
        {"name": "first", "image": "busybox", "command": ["sh", "-c", "echo first >> order"]},
        {
            "name": "second",
            "image": "busybox",
            "command": ["sh", "-c", "test -e tried || { touch tried; exit 4; }; echo second >> order"],
        },
    ]
    stuck = shell_deployment("stuck", "echo main >> order; exec sleep 600")
    stuck["spec"]["template"]["spec"]["initContainers"] = [
        {"name": "never", "image": "busybox", "command": ["sh", "-c", "exit 5"]}
    ]
    e2e.kube.create(ordered)
    e2e.kube.create(stuck)
    try:
        pod = wait_for(lambda: (p := e2e.pods("ordered")) and p[0].ready and p[0], 60, "the pod ready")
        order = pod.directory / "order"
        # Ready once its container started (no probe): its shell may not have written yet.
        wait_for(lambda: len(order.read_text().split()) >= 3, 30, "the container's line")
        assert order.read_text().split() == ["first", "second", "main"]
        first, second = pod.init_containers
        assert (first.restarts, first.exit_codes, second.restarts, second.exit_codes) == (0, (0,), 1, (4, 0))
        assert pod.reason == "Running"

        blocked = wait_for(
            lambda: (p := e2e.pods("stuck")) and p[0].init_containers[0].restarts >= 2 and p[0],
            60,
            "the init container failing twice",
        )
        assert blocked.reason.startswith("Init:Error: never exited with 5"), blocked.reason
        assert not blocked.ready and blocked.container().pids == ()
        assert not (blocked.directory / "order").exists()
        api_pod = e2e.kube.get(path("v1", "Pod", blocked.name)) or {}
        assert api_pod.get("status", {}).get("phase", "Pending") == "Pending", api_pod.get("status")
    finally:
        e2e.remove(path("apps/v1", "Deployment", "ordered"), path("apps/v1", "Deployment", "stuck"))
    wait_for(lambda: not e2e.pods("ordered") and not e2e.pods("stuck"), 60, "the pods gone")
