"""The store pod's readiness probe when scale-downs drain: ready while its port answers and
its master's last word is not that its segment is drained.

The ReplicaSet controller removes pods that are not ready before ready ones, so a store
whose segment the master has drained (``DRAINED``: its objects moved to the other stores,
no new writes placed on it) is the one a scale-down removes, and the operator needs no
access to Pods beyond reading them (``store_drain``). The probe runs in the store container
(``python3``, which Mooncake's ``mooncake_client`` script runs on; only the standard library)
and asks the pool's master over its HTTP port, which the pool's own pods may reach: its
``/metrics`` names each mounted segment ``<pod IP>:<port>``, and
``/api/v1/segments/status`` says whether this pod's is drained. With HA masters the Service
may answer from a standby, which knows no segment: the probe then asks the leader its
``/health`` names, at the same HTTP port (every master pod has it).

What it cannot tell (no answer within a second, no segment of this pod yet, an unexpected
answer) repeats the master's last word, which the probe keeps in a file in the pod's own
``/tmp`` (``PROBE_MEMORY``): a drained store stays unready while the master is slow to
answer, so the pod the operator scales away is still the one the controller removes, and a
store the master never said was drained stays ready, so a master that restarts or does not
answer never makes the stores unready. The master's word that the segment is not drained
(a drain called off) makes it ready again.
"""

from __future__ import annotations

from typing import Any

from kvpool.operator import names

MASTER_HTTP_ENV = "KVPOOL_MASTER_HTTP"
STORE_PORT_ENV = "KVPOOL_STORE_PORT"
MEMORY_ENV = "KVPOOL_PROBE_MEMORY"
# The drained segment at the master's last word, if any; /tmp is the pod's own emptyDir.
PROBE_MEMORY = "/tmp/kvpool-store-drained"

# Python source both store scripts share (this probe and ``store_wait``'s init container):
# ``leader_base(health, base)``, where to ask next given a master's ``/health`` answer at
# ``base``: an HA standby's named leader (an IP literal only, at the same HTTP port), else
# ``base`` itself. A leader that is not an IP literal raises ``ValueError``.
LEADER_BASE = r"""
import ipaddress
def leader_base(health, base):
    leader = health.get("leader_address")
    if health.get("role") == "leader" or not isinstance(leader, str) or ":" not in leader:
        return base
    address = ipaddress.ip_address(leader.rsplit(":", 1)[0].strip("[]"))
    host = "[%s]" % address if address.version == 6 else str(address)
    return "http://%s:%s" % (host, base.rsplit(":", 1)[1])
"""

# Run as ``python3 -c SCRIPT`` in the store container (its env: POD_IP and the three above).
SCRIPT = (
    LEADER_BASE
    + r"""
import json, os, re, socket, sys, urllib.parse, urllib.request
ip = os.environ["POD_IP"]
try:
    socket.create_connection((ip, int(os.environ["KVPOOL_STORE_PORT"])), 1).close()
except OSError as exc:
    sys.exit("store port closed: %s" % exc)
memory = os.environ.get("KVPOOL_PROBE_MEMORY")
base = os.environ["KVPOOL_MASTER_HTTP"]
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
told, drained = False, None
try:
    health = json.loads(opener.open(base + "/health", timeout=1).read(1 << 16))
    base = leader_base(health, base)  # an HA standby answered through the Service: its leader
    text = opener.open(base + "/metrics", timeout=1).read(4 << 20).decode("utf-8", "replace")
    found = re.findall(r'^segment_total_capacity_bytes\{segment="([^"]+)"\}', text, re.M)
    for segment in sorted(set(found)):
        if segment.rsplit(":", 1)[0].strip("[]") != ip:
            continue
        url = base + "/api/v1/segments/status?segment=" + urllib.parse.quote(segment, safe="")
        status = json.loads(opener.open(url, timeout=1).read(1 << 16)).get("status_name")
        if not isinstance(status, str):
            told = False
            break
        told = True
        if status == "DRAINED":
            drained = segment
            break
except Exception:
    told = False
if not told:
    # No word from the master now: its last word about this pod's segment stands.
    try:
        with open(memory) as file:
            remembered = file.read(256)
    except (OSError, TypeError):
        sys.exit(0)
    if remembered.rsplit(":", 1)[0].strip("[]") == ip:
        sys.exit("segment %s is drained at the master's last answer" % remembered)
    sys.exit(0)
try:
    if drained is not None:
        with open(memory, "w") as file:
            file.write(drained)
    else:
        os.remove(memory)
except (OSError, TypeError):
    pass
if drained is not None:
    sys.exit("segment %s is drained: this pod leaves at the scale-down" % drained)
"""
)


def master_http(pool: str, namespace: str, metrics_port: int) -> str:
    """The master Service's HTTP base URL, as a pod of the pool reaches it."""
    return f"http://{names.master_name(pool)}.{namespace}.svc:{metrics_port}"


def readiness_probe() -> dict[str, Any]:
    """The store container's readiness probe (period 5 s; a second for each of its asks)."""
    return {
        "exec": {"command": ["python3", "-c", SCRIPT]},
        "periodSeconds": 5,
        "timeoutSeconds": 4,
    }


def probe_env(pool: str, namespace: str, metrics_port: int, store_port: int) -> list[dict[str, Any]]:
    """The env the probe reads (beside ``POD_IP``, which every pool pod has)."""
    return [
        {"name": MASTER_HTTP_ENV, "value": master_http(pool, namespace, metrics_port)},
        {"name": STORE_PORT_ENV, "value": str(store_port)},
        {"name": MEMORY_ENV, "value": PROBE_MEMORY},
    ]
