"""The operator's endpoints: liveness, Prometheus metrics, the validating webhook."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvpool.connector.local.ports import PortHold
from kvpool.operator import metric_names as names
from kvpool.operator.app import VALIDATE_ID
from kvpool.operator.names import POOLS
from testing.kube_api import (
    NAMESPACE,
    Cluster,
    eventually,
    post_admission_review,
    write_kubeconfig,
)
from testing.operator_objects import (
    Operator,
    converge,
    pool_manifest,
    pool_spec,
    vllm_deployment,
)

pytestmark = pytest.mark.asyncio


async def fetch(url: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return response.status, await response.text()


async def test_liveness_and_metrics(cluster: Cluster, operator: Operator) -> None:
    await cluster.create(vllm_deployment())
    await cluster.create(pool_manifest())
    await converge(cluster, generation=1)

    status, body = await fetch(operator.liveness_url)
    assert status == 200
    assert '"pools": 1' in body  # the operator's own probe

    status, text = await fetch(operator.metrics_url)
    assert status == 200
    for spec in names.ALL:
        assert f"# TYPE {spec.exported} {spec.kind}" in text, spec.name
    assert f'{names.POOLS.exported}{{condition="ConfigValid",status="True"}} 1.0' in text
    rolled_out = names.CONSUMERS_ROLLED_OUT.exported
    assert f'{rolled_out}{{namespace="{NAMESPACE}",pool="pool"}} 1.0' in text
    assert f'{names.POOL_INFO.exported}{{mode="managed",namespace="{NAMESPACE}",pool="pool"}} 1.0' in text
    assert f'{names.RECONCILES.exported}{{result="success",trigger="create"}}' in text
    assert f'{names.API_WRITES.exported}{{resource="deployments",verb="patch"}}' in text
    assert f"{names.RECONCILE_DURATION.exported}_count" in text


def review(spec: dict[str, Any], operation: str = "CREATE") -> dict[str, Any]:
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "review-1",
            "kind": {"group": POOLS.group, "version": POOLS.version, "kind": POOLS.kind},
            "resource": {"group": POOLS.group, "version": POOLS.version, "resource": POOLS.plural},
            "namespace": NAMESPACE,
            "name": "pool",
            "operation": operation,
            "userInfo": {"username": "alice"},
            "object": pool_manifest(spec=spec),
            "oldObject": None,
            "dryRun": False,
        },
    }


async def admit(url: str, spec: dict[str, Any]) -> dict[str, Any]:
    """The webhook's verdict on a review of ``spec`` (waiting for it to listen)."""
    return dict((await post_admission_review(url, review(spec)))["response"])


@pytest.mark.parametrize("operator_config", [{"webhook": True}])
async def test_the_webhook_rejects_bad_specs_naming_the_field(cluster: Cluster, operator: Operator) -> None:
    assert operator.webhook_url is not None
    url = f"{operator.webhook_url}/{VALIDATE_ID}"
    good = await admit(url, pool_spec())
    assert good["allowed"] is True and good["uid"] == "review-1"

    bad = pool_spec(master={"replicas": 2})
    bad["consumers"][0]["layout"]["groups"][0]["kind"] = "cross"
    answer = await admit(url, bad)
    assert answer["allowed"] is False
    assert answer["status"]["code"] == 422
    message = answer["status"]["message"]
    assert "spec.master.replicas" in message and "[single-master]" in message
    assert "spec.consumers[0].layout.groups[0].kind" in message
    assert "consumer 'llm'" in message and "[cross-attention]" in message

    schema = await admit(url, pool_spec(store={"segmentSize": "lots"}))
    assert schema["allowed"] is False
    assert "spec.store.segmentSize" in schema["status"]["message"]


async def test_the_console_script_runs_and_stops_on_sigterm(cluster: Cluster, tmp_path: Path) -> None:
    script = Path(sys.executable).parent / "kvpool-operator"
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", cluster.url)
    # Held from other draws until the operator stops: it binds them only once it runs.
    holds = [PortHold.drawn(), PortHold.drawn()]
    liveness = f"http://127.0.0.1:{holds[0].port}/healthz"
    env = {k: v for k, v in os.environ.items() if k != "KUBERNETES_SERVICE_HOST"}
    process = await asyncio.create_subprocess_exec(
        str(script),
        "run",
        "--kubeconfig",
        str(kubeconfig),
        "--liveness",
        liveness,
        "--metrics-host",
        "127.0.0.1",
        "--metrics-port",
        str(holds[1].port),
        "--resync-interval",
        "1",
        env=env,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        await cluster.create(pool_manifest())
        await eventually(
            lambda: cluster.get("v1/configmaps", "pool-connector"), what="the CLI operator reconciles"
        )
        status, _ = await fetch_when_up(liveness)
        assert status == 200
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            _, stderr = await asyncio.wait_for(process.communicate(), timeout=60)
        except TimeoutError:
            process.kill()
            await process.wait()
            raise
        finally:
            for hold in holds:
                hold.release()
    assert process.returncode == 0, stderr.decode()[-2000:]


async def fetch_when_up(url: str) -> tuple[int, str]:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 60
    while True:
        try:
            return await fetch(url)
        except aiohttp.ClientConnectionError:
            assert loop.time() < deadline, f"{url} never came up"
            await asyncio.sleep(0.05)
