"""What the operator assumes of Mooncake, checked against the real binaries on loopback.

* HA: masters and stores started with exactly the args the operator renders, on a real
  three-member etcd cluster whose first member is down (so only a parsed endpoint list
  reaches it), elect a leader, and the store mounts its segment; a client given the
  rendered ``master_server_address`` finds and asks the leader.
* Mooncake takes ``;`` (its own docs' separator) between etcd endpoints as well as ``,``.
* Every master answers ``/health`` (a standby too); the leader check finds the leader
  that serves, and the next one after the leader is killed.
* The operator, asking those masters, sets ``MasterReady`` only once a leader serves.
* A client's transfer engine listens only in the port range the consumers' NetworkPolicy
  keeps to the pool.
* The status's capacity, use, objects and per-store numbers are the master's own; a store
  down is ``Degraded``, a master that stops answering an ``Error``; a scale-down says what it
  loses; an external pool runs nothing and serves a consumer.

Each master binds its own 127.x address with the same ports, as pods share port numbers
on their own IPs.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import pytest

from kvpool.connector.contract.mooncake_env import client_env
from kvpool.connector.contract.settings import ConnectorSettings
from kvpool.connector.local.pool import LocalPool, find_binary, free_port, start_logged, stop_process
from kvpool.connector.local.ports import PortHold
from kvpool.connector.pool_client import open_client
from kvpool.operator import names, store_probe
from kvpool.operator.consumer_hits import pod_ready
from kvpool.operator.leader import check_leader
from kvpool.operator.network import TRANSFER_PORT_ENV, TRANSFER_PORT_MAX, TRANSFER_PORT_MIN
from kvpool.operator.plan import Plan, build_plan
from kvpool.operator.policy import OperatorPolicy
from testing.kube_api import DEPLOYMENTS_PATH, NAMESPACE, PODS_PATH, Cluster, eventually
from testing.operator_objects import Operator, kv_flags, pool_manifest, pool_pod, pool_spec, vllm_deployment
from testing.pool_store import bare_client, put_bytes, put_on, raw_store

pytestmark = pytest.mark.mooncake

MASTER_HOSTS = ("127.0.0.2", "127.0.0.3")
MASTER_IPS = frozenset(ipaddress.ip_address(host) for host in MASTER_HOSTS)
STORE_HOST = "127.0.0.4"
SEGMENT = 64 << 20


@dataclass
class EtcdCluster:
    """Debian's etcd as a three-member cluster on 127.0.0.1."""

    members: int = 3
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="kvpool-etcd3-")))
    ports: list[tuple[int, int]] = field(default_factory=list)
    processes: list[subprocess.Popen[bytes] | None] = field(default_factory=list)

    @property
    def endpoints(self) -> list[str]:
        return [f"127.0.0.1:{client}" for client, _ in self.ports]

    def start(self, attempts: int = 3, timeout: float = 60.0) -> EtcdCluster:
        """Start the members and wait until each reports a leader.

        Ports are picked free and then released, so another process can take one before
        etcd binds it (that member exits): such an attempt is stopped and retried on
        fresh ports. The last failure carries each member's log.
        """
        binary = shutil.which("etcd")
        if binary is None:
            pytest.fail("etcd not installed: run scripts/setup.sh (etcd-server)")
        for attempt in range(attempts):
            failure = self._start_once(binary, attempt, timeout)
            if failure is None:
                return self
            logs = "\n".join(f"--- m{i}.log ---\n{self.log(attempt, i)}" for i in range(self.members))
            self.stop_members()
        raise AssertionError(f"the etcd cluster never became healthy: {failure}\n{logs}")

    def _start_once(self, binary: str, attempt: int, timeout: float) -> str | None:
        """One start on fresh ports; ``None`` once healthy, else why not."""
        ports = distinct_free_ports(2 * self.members)
        self.ports = list(zip(ports[0::2], ports[1::2], strict=True))
        peers = ",".join(f"m{i}=http://127.0.0.1:{peer}" for i, (_, peer) in enumerate(self.ports))
        self.processes = []
        for i, (client, peer) in enumerate(self.ports):
            command = [
                binary,
                f"--name=m{i}",
                f"--data-dir={self.workdir / f'a{attempt}' / f'm{i}'}",
                f"--listen-client-urls=http://127.0.0.1:{client}",
                f"--advertise-client-urls=http://127.0.0.1:{client}",
                f"--listen-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-cluster={peers}",
                "--initial-cluster-state=new",
            ]
            self.processes.append(start_logged(command, self.log_path(attempt, i)))
        deadline = time.monotonic() + timeout
        while not all(self.healthy(endpoint) for endpoint in self.endpoints):
            exited = [i for i, process in enumerate(self.processes) if process and process.poll() is not None]
            if exited:
                return f"member(s) {exited} exited"
            if time.monotonic() > deadline:
                return f"no leader on every member within {timeout:.0f} s"
            time.sleep(0.2)
        return None

    def log_path(self, attempt: int, index: int) -> Path:
        (self.workdir / f"a{attempt}").mkdir(parents=True, exist_ok=True)
        return self.workdir / f"a{attempt}" / f"m{index}.log"

    def log(self, attempt: int, index: int) -> str:
        return self.log_path(attempt, index).read_text(errors="replace")[-1500:]

    @staticmethod
    def healthy(endpoint: str) -> bool:
        """etcd's own ``/health``: the member is up and the cluster has a leader."""
        try:
            with urllib.request.urlopen(f"http://{endpoint}/health", timeout=2) as response:
                return bool(json.loads(response.read()).get("health") == "true")
        except (OSError, ValueError):
            return False

    def stop_member(self, index: int) -> None:
        stop_process(self.processes[index])
        self.processes[index] = None

    def stop_members(self) -> None:
        for process in self.processes:
            stop_process(process)
        self.processes = []

    def stop(self) -> None:
        self.stop_members()
        shutil.rmtree(self.workdir, ignore_errors=True)


def wait_for_capacity_of(metrics_port: int, minimum: int, timeout: float = 60) -> None:
    """Until the master on ``metrics_port`` has ``minimum`` bytes of store memory mounted."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, KeyError):
            if masters_own_numbers(metrics_port)["master_total_capacity_bytes"] >= minimum:
                return
        time.sleep(0.2)
    raise TimeoutError(f"less than {minimum} bytes mounted after {timeout}s")


def distinct_free_ports(count: int) -> list[int]:
    """``count`` different ports free on loopback at the time of asking."""
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


@pytest.fixture
def etcd() -> Iterator[EtcdCluster]:
    """Three etcd members; the first, listed first everywhere, stopped (two keep quorum)."""
    cluster = EtcdCluster()
    try:
        cluster.start()
        cluster.stop_member(0)
        yield cluster
    finally:
        cluster.stop()


@dataclass
class Processes:
    """Processes started from rendered args, stopped by PID."""

    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="kvpool-ha-")))
    started: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def start(self, name: str, command: list[str], env: dict[str, str] | None = None) -> None:
        self.started[name] = start_logged(command, self.workdir / f"{name}.log", env)

    def stop(self, name: str) -> None:
        stop_process(self.started.pop(name))

    def stop_all(self) -> None:
        """Stop every process; the end of each one's log goes to stdout (a failed test's report)."""
        for name in list(self.started):
            self.stop(name)
        for log in sorted(self.workdir.glob("*.log")):
            print(f"--- the end of {log.name} ---\n{log.read_text(errors='replace')[-3000:]}")
        shutil.rmtree(self.workdir, ignore_errors=True)


@pytest.fixture
def processes() -> Iterator[Processes]:
    started = Processes()
    try:
        yield started
    finally:
        started.stop_all()


def ha_spec(etcd_endpoints: list[str], rpc_port: int, metrics_port: int) -> dict[str, Any]:
    return pool_spec(
        consumers=[],
        master={
            "replicas": 2,
            "rpcPort": rpc_port,
            "metricsPort": metrics_port,
            "ha": {"enabled": True, "etcdEndpoints": etcd_endpoints},
        },
        store={"segmentSize": SEGMENT, "replicas": 1},
    )


def ha_plan(etcd_endpoints: list[str], rpc_port: int, metrics_port: int) -> Plan:
    plan = build_plan("pool", NAMESPACE, ha_spec(etcd_endpoints, rpc_port, metrics_port))
    assert plan.valid, plan.problems
    return plan


def rendered(plan: Plan, deployment: str, pod_ip: str) -> list[str]:
    """The Deployment's command and args as the kubelet runs them on a pod with ``pod_ip``."""
    (child,) = [c for c in plan.children if c["kind"] == "Deployment" and c["metadata"]["name"] == deployment]
    (container,) = child["spec"]["template"]["spec"]["containers"]
    binary = find_binary(container["command"][0])
    return [binary, *(arg.replace("$(POD_IP)", pod_ip) for arg in container["args"])]


def master_pod(host: str) -> dict[str, Any]:
    """The Pod object of the master at ``host``, as the API would hold it (the leader check
    asks only the pool's master pods' IPs)."""
    return pool_pod(f"pool-master-{host.replace('.', '-')}", host, names.MASTER)


def start_masters(processes: Processes, plan: Plan) -> None:
    for host in MASTER_HOSTS:
        # On loopback every address shares one machine: keep the master's HTTP servers on its own.
        loopback = [f"--metrics_host={host}", f"--http_metadata_server_host={host}", "--rpc_thread_num=2"]
        processes.start(f"master-{host}", rendered(plan, "pool-master", host) + loopback)


def rendered_env(plan: Plan, deployment: str) -> dict[str, str]:
    """The literal env entries of the Deployment's container."""
    (child,) = [c for c in plan.children if c["kind"] == "Deployment" and c["metadata"]["name"] == deployment]
    (container,) = child["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def start_store(processes: Processes, plan: Plan) -> None:
    env = {**os.environ, **client_env(STORE_HOST), **rendered_env(plan, "pool-store")}
    processes.start("store", rendered(plan, "pool-store", STORE_HOST), env)


def health_url(host: str, port: int) -> str:
    return f"http://{host}:{port}/health"


async def serving_leader(
    metrics_port: int, hosts: tuple[str, ...] = MASTER_HOSTS, timeout: float = 90
) -> str:
    """The address of the leader once one serves (asking the masters at ``hosts``)."""

    async def ask() -> str | None:
        for host in hosts:
            view = await check_leader(health_url(host, metrics_port), metrics_port, MASTER_IPS)
            if view.serves:
                return view.message
        return None

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while (found := await ask()) is None:
        assert loop.time() < deadline, "no leader serves"
        await asyncio.sleep(0.2)
    return found


def capacity(host: str, metrics_port: int) -> float:
    """Store memory mounted on the master at ``host`` (its Prometheus metrics)."""
    try:
        with urllib.request.urlopen(f"http://{host}:{metrics_port}/metrics", timeout=3) as response:
            text = response.read().decode()
    except OSError:
        return 0.0
    for line in text.splitlines():
        if line.startswith("master_total_capacity_bytes "):
            return float(line.split()[1])
    return 0.0


def client_reaches_the_leader(master_address: str, cluster_id: str) -> subprocess.CompletedProcess[str]:
    """A Mooncake client given ``master_server_address`` sets up and asks the leader about a key.

    Metadata only: two runs at once on this machine may race for the same transfer port
    (Mooncake picks one, frees it, binds it again), which is not what is checked here.
    """
    setup = f"s.setup('127.0.0.5', 'P2PHANDSHAKE', 0, 16 << 20, 'tcp', '', {master_address!r})"
    code = (
        "from mooncake.store import MooncakeDistributedStore as S\n"
        "s = S()\n"
        f"assert {setup} == 0, 'setup failed'\n"
        "assert s.is_exist('kvpool-ha-probe') == 0, 'the leader did not answer'\n"
    )
    env = {**os.environ, **client_env("127.0.0.5", cluster_id)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


@pytest.mark.timeout(480)
@pytest.mark.asyncio
@pytest.mark.parametrize("operator_config", [{"master_health_url": "http://127.0.0.2:{port}/health"}])
async def test_an_ha_pool_runs_as_rendered_and_is_ready_once_a_leader_serves(
    cluster: Cluster,
    operator: Operator,
    etcd: EtcdCluster,
    processes: Processes,
    held_ports: Callable[[], int],
) -> None:
    rpc_port, metrics_port = held_ports(), held_ports()  # the masters bind them later
    plan = ha_plan(etcd.endpoints, rpc_port, metrics_port)
    assert plan.master_address == "etcd://" + ",".join(etcd.endpoints)
    for host in MASTER_HOSTS:
        await cluster.create(master_pod(host))
    await cluster.create(pool_manifest(spec=ha_spec(etcd.endpoints, rpc_port, metrics_port)))

    # The Deployments are rolled out, but no master runs: no leader serves.
    def master_ready() -> dict[str, Any]:
        cluster.settle()
        return cluster.condition("pool", "MasterReady")

    down = await eventually(lambda: master_ready().get("reason") == "NoLeader" and master_ready())
    assert down["status"] == "False" and "cannot ask the masters' health" in down["message"]

    start_masters(processes, plan)
    leader = await serving_leader(metrics_port)
    ready = await eventually(lambda: master_ready().get("status") == "True" and master_ready(), timeout=60)
    assert ready["reason"] == "LeaderServes" and "serves" in ready["message"]
    assert leader.split()[3] in ready["message"]  # the same leader address

    # The store, with the rendered master_server_address (several etcd endpoints), mounts its segment.
    start_store(processes, plan)
    leading_host = leader.split()[3].rsplit(":", 1)[0]
    await eventually(
        lambda: capacity(leading_host, metrics_port) >= SEGMENT,
        timeout=60,
        what="the store's segment mounted",
    )
    settings = consumer_settings(plan, "127.0.0.5")
    result = await asyncio.to_thread(client_reaches_the_leader, plan.master_address, settings["cluster_id"])
    assert result.returncode == 0, outcome(result)
    # A consumer, with the settings the pool's ConfigMap gives it, stores an object.
    put = await asyncio.to_thread(consumer_probe, settings, "put")
    assert put.returncode == 0, outcome(put)
    assert put.stdout.split()[-2:] == ["0", "1"], outcome(put)

    # The leader dies: the standby takes over, and the check finds it.
    processes.stop(f"master-{leading_host}")
    survivor = next(h for h in MASTER_HOSTS if h != leading_host)
    new_leader = await serving_leader(metrics_port, hosts=(survivor,))
    assert survivor in new_leader
    # It replayed the leader's index (the OpLog): the object is still there, with its bytes.
    kept = await asyncio.to_thread(consumer_probe, settings, "read")
    assert kept.returncode == 0, outcome(kept)
    assert kept.stdout.split()[-2:] == ["1", "4096"], outcome(kept)


def outcome(result: subprocess.CompletedProcess[str]) -> str:
    """A child's result in one line, for a failure's message; the end of its output goes to
    stdout (the failed test's report)."""
    print(f"--- its stdout ---\n{result.stdout[-2000:]}\n--- its stderr ---\n{result.stderr[-3000:]}")
    lines = result.stderr.strip().splitlines() or [""]
    last = lines[-1][:300]
    return f"exited {result.returncode}, printed {result.stdout.split()[-2:]}; stderr's last line: {last}"


def consumer_settings(plan: Plan, host: str) -> dict[str, Any]:
    """The connector settings the pool's ConfigMap gives a consumer pod at ``host``."""
    (configmap,) = [
        c
        for c in plan.children
        if c["kind"] == "ConfigMap" and c["metadata"]["name"] == names.connector_configmap_name(plan.pool)
    ]
    extra = json.loads(configmap["data"][names.KV_TRANSFER_CONFIG_FILE])["kv_connector_extra_config"]
    return {**extra, "local_hostname": host, "bind_address": host}


CONSUMER_PROBE = """
import json, os, sys, time, traceback
from kvpool.connector.contract.settings import ConnectorSettings
from kvpool.connector.pool_client import open_client
from testing.pool_store import put_bytes, raw_store
KEY = "kvpool-ha-probe"
client = open_client(ConnectorSettings.parse(json.loads(sys.argv[1])), global_segment_size=0)
try:
    # A segment just mounted may refuse a first put (-200) for a while; on a loaded machine
    # (two test runs side by side) for more than 30 s: 120 s.
    if sys.argv[2] == "put":
        deadline = time.monotonic() + 120
        while (code := put_bytes(client, KEY, b"x" * 4096)) != 0 and time.monotonic() < deadline:
            time.sleep(0.5)
        print(code)
    # A new leader replays the OpLog in polls (Mooncake's: every second): give it 60 s.
    deadline = time.monotonic() + (60 if sys.argv[2] == "read" else 0)
    while raw_store(client).is_exist(KEY) != 1 and time.monotonic() < deadline:
        time.sleep(0.5)
    print(raw_store(client).is_exist(KEY))
    if sys.argv[2] == "read":
        value = raw_store(client).get(KEY)
        print(len(value) if value == b"x" * len(value) else -1)
except BaseException:
    traceback.print_exc()
    sys.stderr.flush()
    os._exit(1)
# Not closed: with an etcd:// master, Mooncake's close waits ~30 s (its HA watcher).
sys.stdout.flush()
os._exit(0)
"""


def consumer_probe(settings: dict[str, Any], action: str) -> subprocess.CompletedProcess[str]:
    """The connector's own client, in a process of its own (Mooncake joins one etcd and one
    cluster id per process), given ``settings``: ``put`` a probe object (prints its code), then
    print whether it exists; ``read`` also prints its length (-1 if not the bytes put)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run(
        [sys.executable, "-c", CONSUMER_PROBE, json.dumps(settings), action],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )


@pytest.mark.timeout(420)
@pytest.mark.asyncio
async def test_ha_pools_sharing_an_etcd_each_elect_their_own_leader(
    etcd: EtcdCluster, processes: Processes, held_ports: Callable[[], int]
) -> None:
    """Mooncake keeps an HA election under its cluster id: two pools on one etcd, each
    started as rendered, each lead (with one id between them only one would), a pool's store
    mounts on its own leader, and its consumers' settings reach that leader, not the other's."""
    rpc_port, metrics_port = held_ports(), held_ports()  # the masters bind them later
    hosts = {"pool-a": MASTER_HOSTS[0], "pool-b": MASTER_HOSTS[1]}
    plans = {}
    for pool, host in hosts.items():
        plans[pool] = build_plan(pool, NAMESPACE, ha_spec(etcd.endpoints, rpc_port, metrics_port))
        assert plans[pool].valid, plans[pool].problems
        loopback = [f"--metrics_host={host}", f"--http_metadata_server_host={host}", "--rpc_thread_num=2"]
        processes.start(f"master-{pool}", rendered(plans[pool], f"{pool}-master", host) + loopback)
    for host in hosts.values():
        leader = await serving_leader(metrics_port, hosts=(host,))
        assert leader.split()[3].startswith(f"{host}:")

    store_env = {**os.environ, **client_env(STORE_HOST), **rendered_env(plans["pool-a"], "pool-a-store")}
    processes.start("store", rendered(plans["pool-a"], "pool-a-store", STORE_HOST), store_env)
    await eventually(
        lambda: capacity(hosts["pool-a"], metrics_port) >= SEGMENT, timeout=60, what="pool-a's store mounted"
    )
    assert capacity(hosts["pool-b"], metrics_port) == 0

    consumer = {pool: consumer_settings(plan, "127.0.0.5") for pool, plan in plans.items()}
    assert consumer["pool-a"]["cluster_id"] != consumer["pool-b"]["cluster_id"]
    put = await asyncio.to_thread(consumer_probe, consumer["pool-a"], "put")
    assert put.returncode == 0, outcome(put)
    assert put.stdout.split()[-2:] == ["0", "1"]  # stored, and pool-a's leader has it
    other = await asyncio.to_thread(consumer_probe, consumer["pool-b"], "exists")
    assert other.returncode == 0, outcome(other)
    assert other.stdout.split()[-1] == "0"  # pool-b's leader has not


@pytest.mark.timeout(240)
@pytest.mark.asyncio
async def test_mooncake_takes_semicolons_between_etcd_endpoints_too(
    etcd: EtcdCluster, processes: Processes, held_ports: Callable[[], int]
) -> None:
    """Mooncake's own docs join etcd endpoints with ``;``; the operator renders ``,`` (the
    test above): either reaches the live members past a dead first one."""
    rpc_port, metrics_port = held_ports(), held_ports()  # the masters bind them later
    plan = ha_plan(etcd.endpoints, rpc_port, metrics_port)
    joined = ";".join(etcd.endpoints)
    host = MASTER_HOSTS[0]
    args = [a.replace(",".join(etcd.endpoints), joined) for a in rendered(plan, "pool-master", host)]
    assert f"--etcd_endpoints={joined}" in args
    processes.start("master", [*args, f"--metrics_host={host}", f"--http_metadata_server_host={host}"])
    await serving_leader(metrics_port, hosts=(host,))
    cluster_id = consumer_settings(plan, "127.0.0.5")["cluster_id"]
    result = await asyncio.to_thread(client_reaches_the_leader, f"etcd://{joined}", cluster_id)
    assert result.returncode == 0, outcome(result)


def test_a_clients_transfer_engine_listens_in_the_pinned_range() -> None:
    """The consumers' NetworkPolicy keeps ports [TRANSFER_PORT_MIN, TRANSFER_PORT_MAX] to the pool:
    a client with the injected environment listens there and nowhere else."""
    from kvpool.connector.local.pool import MooncakeMaster

    master = MooncakeMaster().start()
    setup = f"s.setup('127.0.0.1', 'P2PHANDSHAKE', {SEGMENT}, 16 << 20, 'tcp', '', {master.address!r})"
    code = (
        "import os, subprocess, sys\n"
        "from mooncake.store import MooncakeDistributedStore as S\n"
        "s = S()\n"
        f"assert {setup} == 0\n"
        "out = subprocess.run(['ss', '-ltnH', '-p'], capture_output=True, text=True).stdout\n"
        "mine = [l.split()[3] for l in out.splitlines() if f'pid={os.getpid()},' in l]\n"
        "print(' '.join(p.rsplit(':', 1)[1] for p in mine))\n"
    )
    env = {**os.environ, **client_env("127.0.0.1"), **dict(TRANSFER_PORT_ENV)}
    try:
        result = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
        )
    finally:
        master.stop()
        shutil.rmtree(master.log_dir, ignore_errors=True)
    assert result.returncode == 0, outcome(result)
    ports = [int(p) for p in result.stdout.split()]
    assert ports, result.stdout
    assert all(TRANSFER_PORT_MIN <= p <= TRANSFER_PORT_MAX for p in ports), ports


# --- Capacity observed from the master, and external pools -----------------------------

OBSERVING = {
    "master_health_url": "http://127.0.0.1:{port}/health",
    "observe_interval": 0.3,
    "policy": OperatorPolicy(operator_namespace="kvpool-system", operator_pod_labels=(("app", "op"),)),
}
LOOPBACK_MASTER = [
    "--rpc_address=127.0.0.1",
    "--metrics_host=127.0.0.1",
    "--http_metadata_server_host=127.0.0.1",
]
STORE_HOSTS = {"pool-store-a": "127.0.0.4", "pool-store-b": "127.0.0.5"}


def store_pod(name: str, host: str) -> dict[str, Any]:
    return pool_pod(name, host, names.STORE)


def start_rendered_store(processes: Processes, plan: Plan, name: str, rpc_port: int) -> int:
    """The store pod ``name`` (at its ``STORE_HOSTS`` address) as rendered, reaching the
    master on loopback; its service port. Each store gets its own port (pods would share the
    rendered one on their own IPs)."""
    service = f"{names.master_name('pool')}.{NAMESPACE}.svc:{rpc_port}"  # as the cluster's DNS would
    host, port = STORE_HOSTS[name], free_port()
    rendered_port = f"--port={plan_store_port(plan)}"
    args = [
        a.replace(service, f"127.0.0.1:{rpc_port}").replace(rendered_port, f"--port={port}")
        for a in rendered(plan, "pool-store", host)
    ]
    processes.start(name, args, {**os.environ, **client_env(host)})
    return port


def store_container(plan: Plan) -> dict[str, Any]:
    (child,) = [
        c for c in plan.children if c["kind"] == "Deployment" and c["metadata"]["name"] == "pool-store"
    ]
    (container,) = child["spec"]["template"]["spec"]["containers"]
    return dict(container)


def plan_store_port(plan: Plan) -> int:
    return int(store_container(plan)["ports"][0]["containerPort"])


def masters_own_numbers(metrics_port: int) -> dict[str, float]:
    """The master's /metrics as plain ``name{labels} value`` lines (read here without the
    operator's parser)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def matches_the_master(capacity: dict[str, Any], metrics_port: int) -> bool:
    own = masters_own_numbers(metrics_port)
    segments = {s["segment"]: s for s in capacity["segments"]}
    return (
        capacity["capacityBytes"] == own["master_total_capacity_bytes"]
        and capacity["usedBytes"] == own["master_allocated_bytes"]
        and capacity["objects"] == own["master_key_count"]
        and capacity["evictions"] == own["master_successful_evictions_total"]
        and {name: s["capacityBytes"] for name, s in segments.items()}
        == {
            key.split('"')[1]: value
            for key, value in own.items()
            if key.startswith("segment_total_capacity_bytes{")
        }
        and {name: s["usedBytes"] for name, s in segments.items()}
        == {
            key.split('"')[1]: value
            for key, value in own.items()
            if key.startswith("segment_allocated_bytes{")
        }
    )


def put_objects(
    master_address: str, count: int | range, size: int = 1 << 20, segment: str | None = None
) -> None:
    """Objects ``kvpool-capacity-<i>`` (``count`` of them, or the indices in a range) of ``size``
    bytes each, written by a client that contributes no memory; placed on ``segment`` if given."""
    with bare_client(master_address) as client:
        for i in range(count) if isinstance(count, int) else count:
            assert put_on(client, f"kvpool-capacity-{i}", bytes([i % 256]) * size, segment) == 0


@pytest.mark.timeout(180)
@pytest.mark.asyncio
@pytest.mark.parametrize("operator_config", [OBSERVING])
async def test_the_status_shows_the_masters_own_capacity_and_use(
    cluster: Cluster, operator: Operator, processes: Processes, held_ports: Callable[[], int]
) -> None:
    """Master and stores started from what the operator renders: the status's capacity, use,
    objects and per-store numbers are the master's own; a store down is Degraded and named;
    a scale-down says what it loses (Event and status) and changes no pod template; a master
    that stops answering is an Error."""
    rpc_port, metrics_port = held_ports(), held_ports()  # the master binds them later
    spec = pool_spec(
        consumers=[],
        master={"rpcPort": rpc_port, "metricsPort": metrics_port},
        # No drain: what a scale-down loses is said (the drain: the next test).
        store={"segmentSize": SEGMENT, "replicas": 2, "drainTimeoutSeconds": 0},
    )
    plan = build_plan("pool", NAMESPACE, spec)
    for name, host in STORE_HOSTS.items():
        await cluster.create(store_pod(name, host))
    await cluster.create(pool_manifest(spec=spec))
    processes.start("master", rendered(plan, "pool-master", "127.0.0.1") + LOOPBACK_MASTER)

    def start_store(name: str) -> None:
        start_rendered_store(processes, plan, name, rpc_port)

    def status() -> dict[str, Any]:
        cluster.settle()
        return cluster.pool_status("pool")

    # One store of two: the pool serves, with half its memory.
    start_store("pool-store-a")
    degraded = await eventually(
        lambda: status().get("phase") == "Degraded" and status()["capacity"]["stores"] == "1/2" and status(),
        what="Degraded, one store mounted",
    )
    message = cluster.condition("pool", "Degraded")["message"]
    assert "1/2 store pods" in message and "pool-store-b" in message, message
    assert degraded["capacity"]["stores"] == "1/2"
    await eventually(lambda: cluster.events("PoolDegraded"), what="a PoolDegraded Event")

    await asyncio.to_thread(put_objects, f"127.0.0.1:{rpc_port}", 6)
    start_store("pool-store-b")
    ready = await eventually(
        lambda: (
            status().get("phase") == "Ready"
            and status()["capacity"]["objects"] == 6
            and matches_the_master(status()["capacity"], metrics_port)
            and status()
        ),
        what="the status's numbers equal the master's own",
    )
    capacity = ready["capacity"]
    assert capacity["capacityBytes"] == 2 * SEGMENT and capacity["stores"] == "2/2"
    assert capacity["usedBytes"] >= 6 << 20
    assert {s["pod"] for s in capacity["segments"]} == set(STORE_HOSTS)
    assert cluster.condition("pool", "Observed")["reason"] == "Answered"

    # Scaling down: what the leaving store holds is said before it goes; no template changes.
    before = cluster.get(DEPLOYMENTS_PATH, "pool-store")
    await cluster.patch_pool("pool", {"spec": {"store": {"replicas": 1}}})
    (event,) = await eventually(lambda: cluster.events("StoreScaleDown"), what="StoreScaleDown")
    assert "store pods 2 -> 1" in event["message"] and "6 objects" in event["message"], event["message"]
    after = await eventually(
        lambda: (
            (cluster.get(DEPLOYMENTS_PATH, "pool-store") or {}).get("spec", {}).get("replicas") == 1
            and cluster.get(DEPLOYMENTS_PATH, "pool-store")
        ),
        what="one store pod",
    )
    assert before is not None
    assert after["spec"]["template"] == before["spec"]["template"]
    scale_down = await eventually(lambda: status().get("lastScaleDown"), what="lastScaleDown")
    assert scale_down["message"] == event["message"] and scale_down["fromReplicas"] == 2

    # The master stops answering while its Deployment says it is available: Error.
    processes.stop("master")
    await eventually(lambda: status().get("phase") == "Error", what="Error")
    observed = cluster.condition("pool", "Observed")
    assert observed["status"] == "False" and observed["reason"] == "Unreachable", observed
    assert cluster.pool_status("pool")["capacity"]["objects"] == 6  # the last numbers, kept


def probe_ready(container: dict[str, Any], host: str, port: int, metrics_port: int, pod_tmp: Path) -> bool:
    """Play the kubelet: run the store container's rendered readiness probe as in a pod at
    ``host`` (the master Service's name, which no DNS resolves here, is the master's loopback
    address; the store's own port is ``port``; the pod's own ``/tmp`` is ``pod_tmp``)."""
    probe = container["readinessProbe"]["exec"]["command"]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    memory = PurePosixPath(env[store_probe.MEMORY_ENV]).relative_to("/tmp")
    pod_tmp.mkdir(exist_ok=True)
    env.update(
        {
            "POD_IP": host,
            store_probe.MASTER_HTTP_ENV: f"http://127.0.0.1:{metrics_port}",
            store_probe.STORE_PORT_ENV: str(port),
            store_probe.MEMORY_ENV: str(pod_tmp / memory),
            "PATH": os.environ["PATH"],
        }
    )
    return subprocess.run(probe, env=env, capture_output=True, timeout=30).returncode == 0


def read_objects(master_address: str, count: int, size: int = 1 << 20) -> list[int]:
    """The objects of ``put_objects`` that do not read back byte for byte."""
    with bare_client(master_address) as client:
        expected = {i: bytes([i % 256]) * size for i in range(count)}
        return [i for i, value in expected.items() if raw_store(client).get(f"kvpool-capacity-{i}") != value]


@pytest.mark.timeout(240)
@pytest.mark.asyncio
@pytest.mark.parametrize("operator_config", [OBSERVING])
async def test_a_scale_down_drains_the_leaving_store_first_and_loses_nothing(
    cluster: Cluster, operator: Operator, processes: Processes, held_ports: Callable[[], int]
) -> None:
    """Master and two stores started from what the operator renders; the test plays the
    kubelet (each store pod's rendered readiness probe decides its Ready condition) and the
    ReplicaSet controller (at one replica, the pod that is not ready goes). Scaling 2 -> 1:
    the Deployment stays at two while the master drains the emptiest store (which holds
    objects); only that store turns unready; then one replica is applied, that store stops,
    and every object reads back byte for byte. Events and the status say so."""
    rpc_port, metrics_port = held_ports(), held_ports()  # the master binds them later
    spec = pool_spec(
        consumers=[],
        master={"rpcPort": rpc_port, "metricsPort": metrics_port},
        store={"segmentSize": SEGMENT, "replicas": 2},
    )
    plan = build_plan("pool", NAMESPACE, spec)
    container = store_container(plan)
    master = f"127.0.0.1:{rpc_port}"
    for name, host in STORE_HOSTS.items():
        await cluster.create(store_pod(name, host))
    await cluster.create(pool_manifest(spec=spec))
    processes.start("master", rendered(plan, "pool-master", "127.0.0.1") + LOOPBACK_MASTER)
    ports = {"pool-store-a": start_rendered_store(processes, plan, "pool-store-a", rpc_port)}
    await asyncio.to_thread(wait_for_capacity_of, metrics_port, SEGMENT)
    await asyncio.to_thread(put_objects, master, 6)  # all on store a, the only one
    ports["pool-store-b"] = start_rendered_store(processes, plan, "pool-store-b", rpc_port)
    await asyncio.to_thread(wait_for_capacity_of, metrics_port, 2 * SEGMENT)
    (segment_b,) = [
        key.split('"')[1]
        for key in masters_own_numbers(metrics_port)
        if key.startswith("segment_total_capacity_bytes{") and STORE_HOSTS["pool-store-b"] in key
    ]
    await asyncio.to_thread(put_objects, master, range(6, 9), 1 << 20, segment_b)  # store b: the emptiest
    removed: set[str] = set()

    async def kubelet() -> None:
        while True:
            for name, port in ports.items():
                if name not in removed:
                    ready = await asyncio.to_thread(
                        probe_ready,
                        container,
                        STORE_HOSTS[name],
                        port,
                        metrics_port,
                        processes.workdir / name,
                    )
                    cluster.set_pod_ready(name, ready)
            await asyncio.sleep(0.3)

    def status() -> dict[str, Any]:
        cluster.settle()
        return cluster.pool_status("pool")

    def store_replicas() -> int:
        return int((cluster.get(DEPLOYMENTS_PATH, "pool-store") or {})["spec"]["replicas"])

    playing = asyncio.create_task(kubelet())
    try:
        await eventually(
            lambda: status().get("phase") == "Ready" and status()["capacity"]["objects"] == 9,
            what="Ready, nine objects",
        )
        await cluster.patch_pool("pool", {"spec": {"store": {"replicas": 1}}})
        drain = await eventually(lambda: status().get("storeDrain"), what="status.storeDrain")
        assert store_replicas() == 2, "the scale-down waits for the drain"
        assert drain["toReplicas"] == 1 and drain["fromReplicas"] == 2
        await eventually(
            lambda: store_replicas() == 1, timeout=120, what="one store replica, after the drain"
        )
        pods = {name: cluster.get(PODS_PATH, name) or {} for name in STORE_HOSTS}
        ready = {name: pod_ready(pod) for name, pod in pods.items()}
        assert ready == {"pool-store-a": True, "pool-store-b": False}, ready
        removed.add("pool-store-b")  # the ReplicaSet controller removes the pod that is not ready
        await cluster.delete_pod("pool-store-b")
        processes.stop("pool-store-b")
        assert await asyncio.to_thread(read_objects, master, 9) == []
    finally:
        playing.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await playing

    (event,) = cluster.events("StoreScaleDown")
    assert event["type"] == "Normal", event
    assert "drained pool-store-b first (3 objects" in event["message"], event["message"]
    for reason in ("StoreDrainPending", "StoreDraining", "StoreDrained"):
        assert cluster.events(reason), reason
    scale_down = await eventually(lambda: status().get("lastScaleDown"), what="lastScaleDown")
    assert scale_down["message"] == event["message"]
    assert "storeDrain" not in status()


@pytest.mark.timeout(180)
@pytest.mark.asyncio
@pytest.mark.parametrize("operator_config", [OBSERVING])
async def test_an_external_pool_runs_nothing_and_serves_its_consumer(
    cluster: Cluster, operator: Operator
) -> None:
    """A pool that names a running master: the operator starts nothing, rolls its consumer
    once the master says it serves, shows its capacity; a client with the consumer's injected
    settings writes and reads through that master."""
    pool = LocalPool(segment_size="32MB")
    with pool:
        assert pool.master is not None
        master = f"localhost:{pool.master.rpc_port}"
        spec = pool_spec(
            external={
                "masterServerAddress": master,
                "metricsEndpoints": [f"localhost:{pool.master.metrics_port}"],
            }
        )
        del spec["image"], spec["store"]
        await cluster.create(vllm_deployment("llm"))
        await cluster.create(pool_manifest(spec=spec))

        def status() -> dict[str, Any]:
            cluster.settle()
            return cluster.pool_status("pool")

        ready = await eventually(lambda: status().get("phase") == "Ready" and status(), what="Ready")
        assert cluster.condition("pool", "MasterReady")["reason"] == "ExternalServes"
        assert ready["capacity"]["capacityBytes"] == 32 << 20 and ready["masterAddress"] == master
        assert cluster.get(DEPLOYMENTS_PATH, "pool-master") is None
        assert cluster.get(DEPLOYMENTS_PATH, "pool-store") is None
        consumer = cluster.get(DEPLOYMENTS_PATH, "llm")
        (flag,) = kv_flags(consumer)
        extra = json.loads(flag.split("=", 1)[1])["kv_connector_extra_config"]
        assert extra["master_server_address"] == master
        # The consumer's settings, on a pod whose IP is 127.0.0.1: they reach the external pool.
        settings = ConnectorSettings.parse(
            {k: (v.replace("$(POD_IP)", "127.0.0.1") if isinstance(v, str) else v) for k, v in extra.items()}
        )
        client = open_client(settings, global_segment_size=0)
        try:
            assert put_bytes(client, "kvpool-external-0", b"kv" * 1024) == 0
            assert bytes(raw_store(client).get("kvpool-external-0")) == b"kv" * 1024
        finally:
            client.close()
        await eventually(lambda: status()["capacity"]["objects"] == 1, what="the object counted")

        # Another master named, whose HTTP port nothing answers: the old master's answer
        # vouches for nothing, so the consumer is not rolled onto the new address.
        nowhere = PortHold.drawn()
        try:
            moved = {
                "masterServerAddress": f"localhost:{nowhere.port}",
                "metricsEndpoints": [f"localhost:{nowhere.port}"],
            }
            await cluster.patch_pool("pool", {"spec": {"external": moved}})
            await eventually(
                lambda: status().get("observedGeneration") == 2 and cluster.handled("pool"), what="seen"
            )
            assert cluster.condition("pool", "MasterReady")["status"] != "True", cluster.condition(
                "pool", "MasterReady"
            )
            await asyncio.sleep(1.0)
            (flag,) = kv_flags(cluster.get(DEPLOYMENTS_PATH, "llm"))
            assert (
                json.loads(flag.split("=", 1)[1])["kv_connector_extra_config"]["master_server_address"]
                == master
            )
        finally:
            nowhere.release()
    for part in (pool.master, pool.store):
        if part is not None:
            shutil.rmtree(part.log_dir, ignore_errors=True)
    # The master is gone: an external pool whose master does not answer is an Error.
    await eventually(lambda: status().get("phase") == "Error", what="Error")
