"""The store pod's init container: wait, with a deadline, until the pool's master serves.

``mooncake_client`` gives up after 20 tries to reach its master, then aborts (SIGABRT):
about two seconds when the master's RPC port resets its calls, as a starting master's
does (about 90 s when nothing listens there yet). So on a new pool every store pod used to
exit once or twice and come back after the kubelet's back-off. This container
(``python3 -c SCRIPT``: the standard library only, in the pool's own image, which runs
``mooncake_client`` on ``python3``) asks the master Service's ``/health`` twice a second
and exits 0 once a leader answers ``service_ready`` (an HA standby's answer is followed to
the leader it names, ``store_probe.LEADER_BASE``). The wait has a deadline
(``WAIT_SECONDS``): past it, the container exits 1 with what the master last said, and the
kubelet runs it again after its back-off. It prints one line each time the master's answer
changes: no keys, no prompts.
"""

from __future__ import annotations

from typing import Any

from kvpool.operator.store_probe import LEADER_BASE, MASTER_HTTP_ENV, master_http

CONTAINER_NAME = "wait-for-master"
WAIT_SECONDS_ENV = "KVPOOL_MASTER_WAIT_SECONDS"
# Past this, the container fails with the master's last answer and the kubelet retries it.
WAIT_SECONDS = 120
# Python and the standard library's HTTP client; a memory limit, since some quotas want one.
RESOURCES: dict[str, dict[str, str]] = {
    "requests": {"cpu": "10m", "memory": "32Mi"},
    "limits": {"memory": "64Mi"},
}

SCRIPT = (
    LEADER_BASE
    + r"""
import json, os, sys, time, urllib.request
base = os.environ["KVPOOL_MASTER_HTTP"]
limit = float(os.environ["KVPOOL_MASTER_WAIT_SECONDS"])
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
def health(url):
    return json.loads(opener.open(url + "/health", timeout=1).read(1 << 16))
start, said = time.monotonic(), None
while True:
    try:
        answer = health(base)
        leader = leader_base(answer, base)
        if leader != base:
            answer = health(leader)
        if answer.get("role") == "leader" and answer.get("service_ready") is True:
            print("the master serves (%.1f s)" % (time.monotonic() - start), flush=True)
            sys.exit(0)
        now = "the master is not serving yet (role %s, state %s)" % (
            str(answer.get("role"))[:16], str(answer.get("ha_state"))[:16])
    except Exception as exc:
        now = "no usable answer from the master yet (%s)" % type(exc).__name__
    if now != said:
        print(now, flush=True)
        said = now
    if time.monotonic() - start >= limit:
        sys.exit("%s did not serve within %g s: %s" % (base, limit, now))
    time.sleep(0.5)
"""
)


def wait_container(pool: str, namespace: str, metrics_port: int) -> dict[str, Any]:
    """The init container (without image and security context, which the pod's containers share)."""
    return {
        "name": CONTAINER_NAME,
        "command": ["python3", "-c", SCRIPT],
        "env": [
            {"name": MASTER_HTTP_ENV, "value": master_http(pool, namespace, metrics_port)},
            {"name": WAIT_SECONDS_ENV, "value": str(WAIT_SECONDS)},
        ],
        "resources": {key: dict(values) for key, values in RESOURCES.items()},  # a copy per pod
    }
