"""The test node: runs what is written to the emulated API as local processes.

It watches Deployments, StatefulSets, Services and ConfigMaps (all namespaces) through the
API, as a kubelet and the controllers would, and on its own thread and event loop:

* keeps each workload's pods (``workloads``) and runs each pod (``kubelet``) on a loopback
  address of its own (127.B.0.2, 127.B.0.3, ...), in a sandbox of its own (``sandbox``);
* writes each Deployment's and StatefulSet's status back through the API's status
  subresource, as their controllers do;
* serves Services (``services``): a loopback address and relay per ClusterIP Service, cluster
  DNS names in every pod's hosts file, and :meth:`Node.resolving` for this process.

Stopping the node stops every pod (SIGTERM, grace, SIGKILL of each container's process
group) and checks that every process it started has exited.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import itertools
import json
import random
import string
import sys
import threading
import traceback
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from testing.node import kubelet, services, workloads
from testing.node.podspec import Mount, PodIdentity, container_mounts, rewrite, volume_dirs

NODE_NAME = "kvpool-test-node"
# A node takes the loopback block 127.<block>.0.0/16, <block> drawn from these (127.0.0.1
# stays the machine's own; two nodes running at once rarely meet): pods get 127.<block>.x.y
# (x up to 254, y from 2), Services 127.<block>.255.y.
NODE_BLOCKS = range(16, 251)
SERVICE_SUBNET = 255
USER_AGENT = "kvpool-test-node/1"
# (API path prefix, plural) of everything the node watches.
WATCHED = {
    "deployments": "/apis/apps/v1",
    "statefulsets": "/apis/apps/v1",
    "services": "/api/v1",
    "configmaps": "/api/v1",
}
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class NodeError(RuntimeError):
    """The node could not do what was asked (stopped, a process left running, ...)."""


@dataclass(frozen=True)
class ContainerInfo:
    """A snapshot of one container: its process, argv, environment, mounts and log."""

    name: str
    argv: tuple[str, ...]
    env: Mapping[str, str]
    mounts: tuple[Mount, ...]
    pids: tuple[int, ...]
    restarts: int
    exit_codes: tuple[int, ...]
    running: bool
    ready: bool
    log_path: Path

    @property
    def pid(self) -> int | None:
        """The PID of the container's current process."""
        return self.pids[-1] if self.pids and self.running else None

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def path(self, container_path: str) -> Path:
        """Where a path the container sees (in one of its mounts) lies on this machine."""
        return Path(rewrite(container_path, list(self.mounts)))


@dataclass(frozen=True)
class PodInfo:
    """A snapshot of one pod."""

    namespace: str
    name: str
    ip: str
    owner: tuple[str, str]
    revision: str
    labels: Mapping[str, str]
    annotations: Mapping[str, str]
    ready: bool
    terminating: bool
    stopped: bool
    reason: str
    directory: Path
    containers: tuple[ContainerInfo, ...]
    init_containers: tuple[ContainerInfo, ...] = ()

    def container(self, name: str | None = None) -> ContainerInfo:
        """The container ``name`` (default: the first)."""
        for item in self.containers:
            if name is None or item.name == name:
                return item
        raise KeyError(f"pod {self.name} has no container {name!r}")


class Node:
    """The test node, against the API at ``api_url``; pods live under ``root``."""

    def __init__(
        self,
        api_url: str,
        root: Path,
        *,
        entrypoints: Mapping[str, list[str]] | None = None,
        tick: float = 0.2,
        block: int | None = None,
    ):
        self.api_url = api_url.rstrip("/")
        self.root = Path(root)
        self.entrypoints = dict(entrypoints or {})
        self.tick = tick
        self.base_path = f"{Path(sys.executable).parent}:{SYSTEM_PATH}"
        self._cache: dict[str, dict[tuple[str, str], dict[str, Any]]] = {kind: {} for kind in WATCHED}
        self._pods: dict[tuple[str, str], kubelet.Pod] = {}
        self._gone: list[kubelet.Pod] = []
        self._written: dict[str, dict[str, Any]] = {}  # uid -> the status last written
        self._relays: dict[str, services.Relay] = {}
        self._service_addresses: dict[str, str] = {}
        self._records = services.Records()
        self.block = random.choice(NODE_BLOCKS) if block is None else block
        self.pod_network = ipaddress.IPv4Network(f"127.{self.block}.0.0/16")
        self.service_network = ipaddress.IPv4Network(f"127.{self.block}.{SERVICE_SUBNET}.0/24")
        self._pod_addresses = (
            str(a)
            for a in self.pod_network.hosts()
            if a not in self.service_network and a.packed[3] not in (0, 1, 255)
        )
        self._vips = (str(a) for a in self.service_network.hosts())
        self._uids = itertools.count(1)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._main, name=NODE_NAME, daemon=True)
        self._changed: asyncio.Event | None = None
        self._stopping: asyncio.Event | None = None
        self._synced = threading.Event()
        self._error: BaseException | None = None
        self._session: aiohttp.ClientSession | None = None
        self.errors: list[str] = []  # what went wrong talking to others (watches, status writes, relays)
        self.failures: list[str] = []  # the node's own steps that raised (stop() reports them)

    # --- the thread ------------------------------------------------------------------------
    def start(self, timeout: float = 30.0) -> Node:
        """Start watching and running pods; returns once every watch has listed its objects."""
        self.root.mkdir(parents=True, exist_ok=True)
        self._thread.start()
        if not self._synced.wait(timeout):
            raise NodeError(f"the node's watches did not start in {timeout}s: {self._error!r}")
        return self

    def stop(self, timeout: float = 120.0) -> None:
        """Stop every pod and the node; raise if any process it started is still running."""
        if self._thread.is_alive() and self._stopping is not None:
            self._loop.call_soon_threadsafe(self._stopping.set)
            self._thread.join(timeout)
        if self._thread.is_alive():
            raise NodeError(f"the node did not stop in {timeout}s")
        left = [
            f"{pod.identity.namespace}/{pod.name}/{c.name} pid {c.process.pid}"
            for pod in [*self._gone, *self._pods.values()]
            for c in [*pod.init_containers, *pod.containers]
            if c.process is not None and c.process.returncode is None
        ]
        if left:
            raise NodeError(f"processes left running: {left}")
        if self._error is not None:
            raise NodeError(f"the node failed: {self._error!r}") from self._error
        if self.failures:
            raise NodeError(f"{len(self.failures)} steps of the node failed; the first:\n{self.failures[0]}")

    def __enter__(self) -> Node:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._run())
        except BaseException as exc:
            self._error = exc
        finally:
            self._loop.close()

    async def _run(self) -> None:
        self._changed = asyncio.Event()
        self._stopping = asyncio.Event()
        headers = {"User-Agent": USER_AGENT}
        async with aiohttp.ClientSession(headers=headers) as session:
            self._session = session
            listed = {kind: asyncio.Event() for kind in WATCHED}
            watches = [asyncio.create_task(self._watch(kind, listed[kind])) for kind in WATCHED]
            try:
                await asyncio.gather(*(event.wait() for event in listed.values()))
                self._synced.set()
                while not self._stopping.is_set():
                    try:
                        await self._step()
                    except Exception:  # a bug in the node: noted, reported by stop(), never a hang
                        self.failures.append(traceback.format_exc())
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._changed.wait(), self.tick)
                    self._changed.clear()
            finally:
                await self._shutdown()
                for task in watches:
                    task.cancel()
                await asyncio.gather(*watches, return_exceptions=True)

    async def _shutdown(self) -> None:
        pods = list(self._pods.values())
        for pod in pods:
            pod.terminate()
        await asyncio.gather(*(pod.wait_stopped() for pod in pods), return_exceptions=True)
        for relay in self._relays.values():
            await relay.close()

    # --- watching -----------------------------------------------------------------------------
    async def _watch(self, kind: str, listed: asyncio.Event) -> None:
        """Keep ``_cache[kind]`` equal to the API's objects (a watch, reopened when it ends)."""
        assert self._session is not None
        url = f"{self.api_url}{WATCHED[kind]}/{kind}"
        while True:
            try:
                async with self._session.get(url) as response:
                    response.raise_for_status()
                    items = (await response.json())["items"]
                self._cache[kind] = {_key(o): o for o in items}
                listed.set()
                async with self._session.get(url, params={"watch": "true"}, timeout=None) as response:
                    response.raise_for_status()
                    async for line in response.content:
                        if line.strip():
                            self._apply(kind, json.loads(line))
            except (aiohttp.ClientError, ValueError) as exc:
                self.errors.append(f"watch {kind}: {exc!r}")
            await asyncio.sleep(0.2)

    def _apply(self, kind: str, event: Mapping[str, Any]) -> None:
        obj = event.get("object") or {}
        key = _key(obj)
        if event.get("type") == "DELETED":
            self._cache[kind].pop(key, None)
        elif event.get("type") in ("ADDED", "MODIFIED"):
            self._cache[kind][key] = obj
        if self._changed is not None:
            self._changed.set()

    # --- one step -----------------------------------------------------------------------------
    async def _step(self) -> None:
        statuses: list[tuple[str, dict[str, Any], dict[str, Any]]] = []
        owners: set[tuple[str, str, str]] = set()
        controllers = (("deployments", workloads.deployment_plan), ("statefulsets", workloads.stateful_plan))
        for kind, plan_of in controllers:
            for (namespace, name), obj in list(self._cache[kind].items()):
                owner_kind = "Deployment" if kind == "deployments" else "StatefulSet"
                owners.add((namespace, owner_kind, name))
                mine = [
                    p
                    for p in self._pods.values()
                    if p.identity.namespace == namespace and p.owner == (owner_kind, name)
                ]
                min_ready = float((obj.get("spec") or {}).get("minReadySeconds", 0))
                views = [
                    workloads.PodView(p.name, p.revision, p.ready, p.available(min_ready), p.terminating)
                    for p in mine
                ]
                plan = plan_of(obj, views)
                self._act(obj, owner_kind, plan.actions)
                statuses.append((kind, obj, plan.status))
        for pod in list(self._pods.values()):
            if (pod.identity.namespace, *pod.owner) not in owners and not pod.terminating:
                pod.terminate()
            if pod.stopped:
                self._gone.append(self._pods.pop((pod.identity.namespace, pod.name)))
        for pod in self._pods.values():
            if pod.reason == "Running" and not pod.terminating:
                with contextlib.suppress(Exception):
                    pod.refresh_volumes(self._configmaps(pod.identity.namespace))
        await self._serve()
        for kind, obj, status in statuses:
            await self._write_status(kind, obj, status)

    def _configmaps(self, namespace: str) -> dict[str, dict[str, Any]]:
        return {name: obj for (ns, name), obj in self._cache["configmaps"].items() if ns == namespace}

    def _act(self, workload: Mapping[str, Any], owner_kind: str, actions: workloads.Actions) -> None:
        meta = workload["metadata"]
        namespace = meta["namespace"]
        for name in actions.delete:
            pod = self._pods.get((namespace, name))
            if pod is not None:
                pod.terminate()
        template = (workload.get("spec") or {}).get("template") or {}
        rev = workloads.revision(template)
        names = list(actions.create_names)
        for _ in range(actions.create):
            suffix = "".join(random.choices(string.ascii_lowercase + string.digits, k=5))
            names.append(f"{meta['name']}-{rev}-{suffix}")
        for name in names:
            self._create_pod(workload, owner_kind, name, rev)

    def _create_pod(self, workload: Mapping[str, Any], owner_kind: str, name: str, rev: str) -> None:
        meta, spec = workload["metadata"], workload.get("spec") or {}
        template = spec.get("template") or {}
        template_meta = template.get("metadata") or {}
        pod_spec = template.get("spec") or {}
        namespace = meta["namespace"]
        labels = dict(template_meta.get("labels") or {})
        if owner_kind == "Deployment":
            labels[workloads.REVISION_LABEL] = rev
            hostname, subdomain = pod_spec.get("hostname", name), pod_spec.get("subdomain", "")
        else:
            labels[workloads.STATEFUL_REVISION_LABEL] = f"{meta['name']}-{rev}"
            labels["statefulset.kubernetes.io/pod-name"] = name
            hostname, subdomain = name, spec.get("serviceName", "")
        identity = PodIdentity(
            name=name,
            namespace=namespace,
            uid=f"pod-uid-{next(self._uids)}",
            ip=next(self._pod_addresses),
            node_name=NODE_NAME,
            labels=labels,
            annotations=dict(template_meta.get("annotations") or {}),
            service_account=pod_spec.get("serviceAccountName", "default"),
        )
        assert self._session is not None
        # The pod's own temporary folder, as a container's /tmp: what its processes leave
        # there (vLLM's IPC socket files) goes with the node. Short: a socket's path must fit
        # in 107 bytes.
        temporary = self.root / "tmp" / identity.uid.rsplit("-", 1)[-1]
        temporary.mkdir(parents=True, exist_ok=True)
        pod = kubelet.Pod(
            identity,
            template,
            self.root / namespace / name,
            owner=(owner_kind, meta["name"]),
            revision=rev,
            configmaps=self._configmaps,
            session=self._session,
            base_env={
                "PATH": self.base_path,
                "HOME": str(self.root / namespace / name),
                "LANG": "C.UTF-8",
                "TMPDIR": str(temporary),
            },
            entrypoints=self.entrypoints,
            hostname=hostname,
            subdomain=subdomain,
        )
        pod.directory.mkdir(parents=True, exist_ok=True)
        services.write_if_changed(pod.hosts_file, self._hosts(pod))
        self._pods[(namespace, name)] = pod
        pod.start()

    # --- Services -----------------------------------------------------------------------------
    def _endpoints(self) -> list[services.Endpoint]:
        return [
            services.Endpoint(
                namespace=pod.identity.namespace,
                ip=pod.ip,
                labels=pod.identity.labels,
                ports=pod.ports(),
                ready=pod.ready,
                hostname=pod.hostname,
                subdomain=pod.subdomain,
            )
            for pod in self._pods.values()
            if not pod.terminating
        ]

    def _hosts(self, pod: kubelet.Pod) -> str:
        namespace = pod.identity.namespace
        if pod.subdomain:
            fqdn = f"{pod.hostname}.{pod.subdomain}.{namespace}.svc.{services.CLUSTER_DOMAIN}"
            own = f"{pod.ip} {fqdn} {pod.hostname}"
        else:
            own = f"{pod.ip} {pod.hostname}"
        return self._records.hosts(namespace, own)

    async def _serve(self) -> None:
        endpoints = self._endpoints()
        live = {obj["metadata"]["uid"]: obj for obj in self._cache["services"].values()}
        for uid in set(self._relays) - set(live):
            await self._relays.pop(uid).close()
        for uid, service in live.items():
            spec = service.get("spec") or {}
            if spec.get("clusterIP") == "None" or spec.get("type") == "ExternalName":
                continue
            if uid not in self._relays:
                self._service_addresses[uid] = next(self._vips)
                self._relays[uid] = services.Relay(
                    self._service_addresses[uid], lambda port, s=service: self._backends(s, port)
                )
            try:
                await self._relays[uid].serve(spec.get("ports") or [])
            except OSError as exc:
                self.errors.append(f"service {service['metadata']['name']}: {exc!r}")
        self._records = services.records(list(live.values()), endpoints, self._service_addresses)
        for pod in self._pods.values():
            services.write_if_changed(pod.hosts_file, self._hosts(pod))

    def _backends(self, service: Mapping[str, Any], port: Mapping[str, Any]) -> list[tuple[str, int]]:
        """Where a connection to ``service``'s ``port`` may go: its ready pods' target ports."""
        current = self._cache["services"].get(
            (service["metadata"]["namespace"], service["metadata"]["name"]), service
        )
        selector = (current.get("spec") or {}).get("selector")
        out = []
        for endpoint in self._endpoints():
            if (
                endpoint.namespace == service["metadata"]["namespace"]
                and endpoint.ready
                and services.selects(selector, endpoint.labels)
            ):
                number = services.target_port(port, endpoint)
                if number is not None:
                    out.append((endpoint.ip, number))
        return out

    # --- status ---------------------------------------------------------------------------------
    async def _write_status(self, kind: str, obj: Mapping[str, Any], status: dict[str, Any]) -> None:
        meta = obj["metadata"]
        if self._written.get(meta["uid"]) == status or not status:
            return
        old = obj.get("status") or {}
        patch = {"status": {**{k: None for k in old if k not in status}, **status}}
        url = f"{self.api_url}{WATCHED[kind]}/namespaces/{meta['namespace']}/{kind}/{meta['name']}/status"
        assert self._session is not None
        try:
            async with self._session.patch(
                url, data=json.dumps(patch), headers={"Content-Type": "application/merge-patch+json"}
            ) as response:
                if response.status == 200:
                    self._written[meta["uid"]] = status
                elif response.status != 404:
                    self.errors.append(f"status of {kind}/{meta['name']}: HTTP {response.status}")
        except aiohttp.ClientError as exc:
            self.errors.append(f"status of {kind}/{meta['name']}: {exc!r}")

    # --- what tests ask -------------------------------------------------------------------------
    def _call(self, fn: Any) -> Any:
        if not self._thread.is_alive():
            raise NodeError("the node is not running")

        async def run() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(30)

    def pods(self, namespace: str | None = None, owner: tuple[str, str] | None = None) -> list[PodInfo]:
        """Pods the node runs (terminating ones too), optionally of one namespace and owner."""

        def snapshot() -> list[PodInfo]:
            return [
                _info(pod)
                for pod in self._pods.values()
                if (namespace is None or pod.identity.namespace == namespace)
                and (owner is None or pod.owner == owner)
            ]

        return list(self._call(snapshot))

    def all_pods(self) -> list[PodInfo]:
        """Every pod the node ever ran, stopped ones included."""
        return list(self._call(lambda: [_info(p) for p in [*self._gone, *self._pods.values()]]))

    def lookup(self, name: str) -> list[str]:
        """The addresses cluster DNS gives ``name`` (empty: not a cluster name)."""
        return self._records.lookup(name)

    @contextlib.contextmanager
    def resolving(self) -> Iterator[None]:
        """This process resolves cluster names as the pods do, until the block ends."""
        with services.resolving(self.lookup):
            yield


def _key(obj: Mapping[str, Any]) -> tuple[str, str]:
    meta = obj.get("metadata") or {}
    return (meta.get("namespace", ""), meta.get("name", ""))


def _container_info(pod: kubelet.Pod, c: kubelet.Container) -> ContainerInfo:
    try:
        mounts = tuple(container_mounts(c.spec, volume_dirs(pod.spec, pod.directory)))
    except ValueError:
        mounts = ()
    return ContainerInfo(
        name=c.name,
        argv=tuple(c.argv),
        env=dict(c.env),
        mounts=mounts,
        pids=tuple(c.pids),
        restarts=c.restarts,
        exit_codes=tuple(c.exit_codes),
        running=c.running,
        ready=c.ready,
        log_path=c.log_path,
    )


def _info(pod: kubelet.Pod) -> PodInfo:
    return PodInfo(
        namespace=pod.identity.namespace,
        name=pod.name,
        ip=pod.ip,
        owner=pod.owner,
        revision=pod.revision,
        labels=dict(pod.identity.labels),
        annotations=dict(pod.identity.annotations),
        ready=pod.ready,
        terminating=pod.terminating,
        stopped=pod.stopped,
        reason=pod.reason,
        directory=pod.directory,
        containers=tuple(_container_info(pod, c) for c in pod.containers),
        init_containers=tuple(_container_info(pod, c) for c in pod.init_containers),
    )
