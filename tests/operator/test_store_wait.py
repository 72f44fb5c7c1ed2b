"""The store pod's init container waits, with a deadline, until its master serves (``store_wait``).

The script runs as the container would (``python3 -c SCRIPT``, its two env variables) against
a real ``mooncake_master`` on loopback, started only after the wait began. The HA answers a
test cannot hold a real master in (a standby naming a leader still warming up, a leader named
by host name) come from stand-in ``/health`` servers on 127.x addresses, on the port the
Service would use. The e2e scale-down test shows a new pool's stores start without a restart.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import kubernetes_validate

from kvpool.connector.local.pool import MooncakeMaster
from kvpool.connector.local.ports import free_port
from kvpool.operator.plan import build_plan
from kvpool.operator.store_probe import MASTER_HTTP_ENV
from kvpool.operator.store_wait import CONTAINER_NAME, SCRIPT, WAIT_SECONDS, WAIT_SECONDS_ENV
from testing.kube_api import NAMESPACE
from testing.master_health import health_server
from testing.operator_objects import pool_spec


def start_wait(base: str, limit_s: float) -> subprocess.Popen[str]:
    env = {"PATH": os.environ["PATH"], MASTER_HTTP_ENV: base, WAIT_SECONDS_ENV: f"{limit_s:g}"}
    return subprocess.Popen(
        [sys.executable, "-c", SCRIPT], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def finish(process: subprocess.Popen[str], timeout: float = 60) -> tuple[int, str, str]:
    try:
        out, err = process.communicate(timeout=timeout)
    finally:
        process.kill()
    return process.returncode, out, err


def test_the_store_pods_wait_for_their_master_in_a_hardened_init_container() -> None:
    plan = build_plan("pool", NAMESPACE, pool_spec())
    (store,) = [
        c for c in plan.children if c["kind"] == "Deployment" and c["metadata"]["name"] == "pool-store"
    ]
    pod = store["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    (main,) = pod["containers"]
    assert init["name"] == CONTAINER_NAME
    assert init["command"] == ["python3", "-c", SCRIPT]
    assert (init["image"], init["imagePullPolicy"]) == (main["image"], main["imagePullPolicy"])
    assert init["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }
    env = {e["name"]: e["value"] for e in init["env"]}
    assert env == {
        MASTER_HTTP_ENV: f"http://pool-master.{NAMESPACE}.svc:9003",
        WAIT_SECONDS_ENV: str(WAIT_SECONDS),
    }
    assert init["resources"]["limits"]["memory"] == "64Mi"
    kubernetes_validate.validate(store, "1.30.0", strict=True)  # raises on any unknown or bad field


def test_the_wait_ends_once_a_real_master_serves_and_not_before() -> None:
    master = MooncakeMaster()
    waiting = start_wait(f"http://127.0.0.1:{master.metrics_port}", 120)
    try:
        time.sleep(1.0)
        assert waiting.poll() is None, "the wait ended with no master at all"
        master.start()
        code, out, err = finish(waiting)
        assert code == 0, err
        lines = out.splitlines()
        assert lines[0] == "no usable answer from the master yet (URLError)", out
        assert lines[-1].startswith("the master serves ("), out
    finally:
        waiting.kill()
        master.stop()
        shutil.rmtree(master.log_dir, ignore_errors=True)


def test_the_wait_has_a_deadline_and_says_what_the_master_last_said(held_ports: Callable[[], int]) -> None:
    base = f"http://127.0.0.1:{held_ports()}"  # held: nothing listens there meanwhile
    code, _, err = finish(start_wait(base, 1))
    assert code == 1
    assert f"{base} did not serve within 1 s: no usable answer from the master yet (URLError)" in err


def test_a_standby_is_followed_to_its_leader_until_that_leader_serves() -> None:
    """Through the Service a standby answers; the leader it names warms up, then serves."""
    port = free_port()
    serving = threading.Event()

    def standby() -> dict[str, Any]:
        return {
            "role": "standby",
            "ha_state": "standby",
            "service_ready": False,
            "leader_address": "127.0.0.3:50051",
        }

    def leader() -> dict[str, Any]:
        state = "serving" if serving.is_set() else "leader_warmup"
        return {
            "role": "leader",
            "ha_state": state,
            "service_ready": serving.is_set(),
            "leader_address": None,
        }

    with health_server("127.0.0.2", port, standby), health_server("127.0.0.3", port, leader) as asked_leader:
        waiting = start_wait(f"http://127.0.0.2:{port}", 120)
        try:
            deadline = time.monotonic() + 30
            while len(asked_leader) < 3 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert len(asked_leader) >= 3 and waiting.poll() is None, "did not wait for the warming leader"
            serving.set()
            code, out, err = finish(waiting)
        finally:
            waiting.kill()
    assert code == 0, err
    first, last = out.splitlines()
    assert first == "the master is not serving yet (role leader, state leader_warmup)"
    assert last.startswith("the master serves (")
    assert set(asked_leader) == {"/health"}


def test_a_leader_named_by_host_name_is_never_asked() -> None:
    """Only an IP literal is followed: a name could point anywhere (the probe's rule too)."""
    port = free_port()

    def standby() -> dict[str, Any]:
        return {"role": "standby", "service_ready": False, "leader_address": "metadata.example:80"}

    with health_server("127.0.0.2", port, standby):
        code, _, err = finish(start_wait(f"http://127.0.0.2:{port}", 1))
    assert code == 1
    assert "did not serve within 1 s: no usable answer from the master yet (ValueError)" in err
