"""The end-to-end cluster of the session: the emulated API, the real operator and the test node.

Every scenario shares one cluster (one node, and one operator run as the chart's default,
namespaced install renders it: watching the scenarios' namespace, its every request checked
against the rendered Role) and uses pools and Deployments of its own names; ``reference``
runs the tiny model once without any pool, for the outputs every pooled answer must equal.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvpool.operator import names
from kvpool.operator.app import OperatorOptions
from kvpool.operator.cli import _parser, options_from_args
from kvpool.operator.names import POOLS
from testing.kube_api import OperatorThread, quick_options, write_kubeconfig
from testing.node import Node, PodInfo
from testing.node.sandbox import unavailable
from testing.prompts import MAX_TOKENS, P1, P2
from tests.chart.grants import Grant, rendered_grants
from tests.chart.helm import Helm, extract_helm, one
from tests.e2e import harness
from tests.e2e.harness import ApiThread, Completion, Kube, wait_for

REPO_ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = REPO_ROOT / ".models" / "e2e-gemma3-tiny"
VLLM_START_S = 900.0  # a vLLM server's start-up on two busy cores, with room to spare
OPERATOR_NAMESPACE = "kvpool-system"  # the release namespace
RESYNC_S = 1.0  # the operator's level checks: quick, yet no load on two cores over a long session
# Prompts every scenario may send: two sharing a 288-token prefix, and two more sharing another.
PROMPTS: dict[str, list[int]] = {
    "p1": P1,
    "p2": P2,
    "q1": [7, *P1[1:]],
    "q2": [7, *P2[1:]],
}


@dataclass
class E2E:
    """What a scenario works with: the API, a client of it, the node and the model."""

    api: ApiThread
    kube: Kube
    node: Node
    operator: OperatorThread

    def pods(self, deployment: str, *, kind: str = "Deployment") -> list[PodInfo]:
        return self.node.pods(harness.NAMESPACE, (kind, deployment))

    def ready_pod(
        self, deployment: str, timeout: float = VLLM_START_S, revision: str | None = None
    ) -> PodInfo:
        """The one ready, not terminating pod of ``deployment`` (of ``revision``, if given)."""

        def one() -> PodInfo | None:
            pods = [p for p in self.pods(deployment) if not p.terminating]
            if len(pods) == 1 and pods[0].ready and revision in (None, pods[0].revision):
                return pods[0]
            return None

        return wait_for(one, timeout, f"one ready pod of {deployment}")

    def remove(self, *paths: str) -> None:
        for item in paths:
            self.kube.delete(item)

    def pool_status(self, pool: str) -> dict[str, Any]:
        return (self.kube.pool(pool) or {}).get("status") or {}

    def delete_pool(self, pool: str) -> None:
        """Delete a scenario's pool and wait until its master and store processes stopped."""
        self.kube.delete(harness.path(POOLS.api_version, POOLS.kind, pool))
        components = (names.master_name(pool), names.store_name(pool))
        wait_for(
            lambda: all(p.stopped for p in self.node.all_pods() if p.owner[1] in components),
            60,
            f"{pool}'s processes stopped",
        )


@dataclass
class Install:
    """The operator as ``helm install`` renders it by default (namespaced, watching the
    scenarios' namespace): its run options and what its roles grant."""

    options: OperatorOptions
    granted: set[Grant]


def chart_install(kubeconfig: Path) -> Install:
    """Render the chart's defaults (``watchNamespaces``: the scenarios' namespace and a tenant's,
    whose grants a pool may take) and run its operator with the rendered flags; only its
    endpoints move to loopback and its timings quicken (the kubeconfig stands in for the
    in-cluster account)."""
    objects = Helm(extract_helm(), kubeconfig.parent / "helm").template(
        sets=[f"watchNamespaces[0]={harness.NAMESPACE}", f"watchNamespaces[1]={harness.TENANT_NAMESPACE}"],
        namespace=OPERATOR_NAMESPACE,
    )
    (container,) = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    rendered = options_from_args(_parser().parse_args(container["args"]))
    assert rendered.namespaces == (harness.NAMESPACE, harness.TENANT_NAMESPACE), rendered.namespaces
    # The scenarios run real masters that the node resolves by their Service name: the
    # operator observes them as rendered, not at the harness's unserved port.
    quick = quick_options(
        kubeconfig,
        resync_interval=RESYNC_S,
        master_health_url=rendered.master_health_url,
        observe_interval=rendered.observe_interval,
    )
    options = dataclasses.replace(rendered, **quick)
    return Install(options, rendered_grants(objects))


class PodMirror:
    """Writes the node's pods into the API as Pod objects (name, labels, containers' argv,
    ``status.podIP``, phase and ``Ready``), as the kubelet would: the operator reads an HA
    pool's master pods, and the consumer pods it asks for their hits, from there."""

    def __init__(self, node: Node, kube: Kube):
        self.node, self.kube = node, kube
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pod-mirror", daemon=True)
        self._mirrored: dict[str, tuple[str, bool, str]] = {}  # name -> IP, ready, phase

    def start(self) -> PodMirror:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            try:
                self.sync()
            except OSError:
                continue  # the API is stopping

    def sync(self) -> None:
        pods = {p.name: p for p in self.node.pods(harness.NAMESPACE) if not p.stopped and not p.terminating}
        for name in set(self._mirrored) - set(pods):
            self.kube.delete(harness.path("v1", "Pod", name))
            del self._mirrored[name]
        for name, pod in pods.items():
            phase = "Running" if pod.reason == "Running" else "Pending"
            if self._mirrored.get(name) == (pod.ip, pod.ready, phase):
                continue
            if name in self._mirrored:
                self.kube.delete(harness.path("v1", "Pod", name))
            self.kube.create(
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {"name": name, "namespace": harness.NAMESPACE, "labels": dict(pod.labels)},
                    "spec": {
                        "containers": [
                            {"name": c.name, "image": "node", "command": list(c.argv)} for c in pod.containers
                        ]
                    },
                    "status": {
                        "phase": phase,
                        "conditions": [{"type": "Ready", "status": "True" if pod.ready else "False"}],
                        "podIP": pod.ip,
                        "podIPs": [{"ip": pod.ip}],
                    },
                }
            )
            self._mirrored[name] = (pod.ip, pod.ready, phase)


@pytest.fixture(scope="session")
def e2e(request: pytest.FixtureRequest) -> Iterator[E2E]:
    """The cluster for the session; everything it started is stopped (by PID) at the end.

    Pods' directories (their logs) are removed at the end, or kept when a test failed.
    """
    why = unavailable()
    if why is not None:
        pytest.skip(f"the test node cannot run pods here: {why}")
    for binary in ("mooncake_master", "mooncake_client"):
        if shutil.which(binary, path=str(Path(sys.executable).parent)) is None:
            pytest.skip(f"{binary} is not installed next to the interpreter")
    root = Path(tempfile.mkdtemp(prefix="kvpool-e2e-"))
    saved_host = os.environ.pop("KUBERNETES_SERVICE_HOST", None)
    api = ApiThread().start()
    node = Node(api.url, root / "node").start()
    kubeconfig = write_kubeconfig(root / "kubeconfig", api.url)
    install = chart_install(kubeconfig)
    operator = OperatorThread(install.options)
    mirror = PodMirror(node, Kube(api.url)).start()
    try:
        with node.resolving():
            operator.start()
            yield E2E(api, Kube(api.url), node, operator)
    finally:
        asyncio.run(operator.stop())
        mirror.stop()
        try:
            node.stop()
        finally:
            api.stop()
            if saved_host is not None:
                os.environ["KUBERNETES_SERVICE_HOST"] = saved_host
    if request.session.testsfailed:
        print(f"\nthe test node's pods (logs, mounted files) are kept in {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)
    assert operator.error is None, repr(operator.error)
    assert api.api is not None and api.api.unauthorised(install.granted) == []


@pytest.fixture(scope="session")
def model() -> Path:
    """The tiny hybrid Gemma3 (random weights, built once and kept in ``.models``)."""
    from testing.models import build_gemma3

    return build_gemma3(MODEL_DIR)


@pytest.fixture(scope="session")
def layout(model: Path) -> dict[str, Any]:
    """The consumers' ``layout:`` block, as ``kvpool-layout`` prints it for the servers' flags."""
    command = [
        sys.executable, "-m", "kvpool.connector.local.layout_command",
        "--model", str(model), "--block-size", "32", "--dtype", "float32", "--format", "json",
    ]  # fmt: skip
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    # vLLM may still log to standard output: the layout is the JSON object from the line "{".
    lines = done.stdout.splitlines()
    return json.loads("\n".join(lines[lines.index("{") :]))


@pytest.fixture(scope="session")
def reference_server(e2e: E2E, model: Path) -> Iterator[None]:
    """The reference: the same vLLM server without any pool. Scenarios ask for it before they
    start their own servers, so that the two start-ups overlap."""
    e2e.kube.create(harness.vllm_deployment("reference", model, allow_pool=None))
    yield
    e2e.kube.delete(harness.path("apps/v1", "Deployment", "reference"))


@pytest.fixture(scope="session")
def reference(e2e: E2E, reference_server: None) -> dict[str, Completion]:
    """Every prompt's greedy completion from the reference server (then stopped)."""
    pod = e2e.ready_pod("reference")
    outputs = {key: harness.complete(pod.ip, prompt, MAX_TOKENS) for key, prompt in PROMPTS.items()}
    e2e.kube.delete(harness.path("apps/v1", "Deployment", "reference"))
    return outputs
