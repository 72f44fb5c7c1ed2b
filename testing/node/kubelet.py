"""One pod on the test node: its containers as local processes, supervised as the kubelet does.

A pod waits for what its volumes and environment name (a ConfigMap not there yet keeps it
Pending), runs its ``initContainers`` one at a time, each to a zero exit (one that fails runs
again after the back-off below, and the pod stays Pending, ``Init:<done>/<all>``), then
starts each container (``sandbox.pod_command``, logs in the pod's directory) and runs its
probes: ``startupProbe`` first, then ``readinessProbe`` (the pod is ready
while every container is) and ``livenessProbe`` (failing, the container is stopped and
restarted). A container that exits is restarted (``restartPolicy: Always``) after the
kubelet's back-off (none, then 10 s doubling up to 5 min). Termination sends SIGTERM,
waits the pod's grace period, then SIGKILLs the container's process group: everything
it started, found by its PID, never by a name.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from testing import child_processes
from testing.node import podspec, sandbox

ConfigMaps = Callable[[str], Mapping[str, Mapping[str, Any]]]  # namespace -> name -> ConfigMap
BACKOFF_START_S = 10.0
BACKOFF_MAX_S = 300.0


@dataclass
class Container:
    """One container of a pod and what the node knows of its process."""

    spec: dict[str, Any]
    log_path: Path
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    process: subprocess.Popen[bytes] | None = None
    pids: list[int] = field(default_factory=list)  # every process started, in order
    restarts: int = 0
    exit_codes: list[int] = field(default_factory=list)
    started: bool = False  # past its startup probe
    ready: bool = False

    @property
    def name(self) -> str:
        return str(self.spec.get("name", ""))

    @property
    def running(self) -> bool:
        return self.process is not None and _exit_status(self.process) is None

    def port(self, value: int | str) -> int:
        """A probe's port: a number, or the name of one of the container's ports."""
        if isinstance(value, int) or str(value).isdigit():
            return int(value)
        for port in self.spec.get("ports") or []:
            if port.get("name") == value:
                return int(port["containerPort"])
        raise podspec.PodSpecError(f"containers[{self.name}]: no port named {value!r}")


def backoff_s(restarts: int) -> float:
    """The kubelet's wait before a container's ``restarts``-th restart (none for the first)."""
    if restarts <= 1:
        return 0.0
    return min(BACKOFF_START_S * 2 ** (restarts - 2), BACKOFF_MAX_S)


def _exit_status(process: subprocess.Popen[bytes]) -> int | None:
    """The process's exit status, without reaping it (its PID stays reserved until reaped)."""
    if process.returncode is not None:
        return process.returncode
    try:
        info = os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return process.poll()
    if info is None:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


#: How long a killed group's processes may take to go (their names in /dev/shm wait for it).
GROUP_GONE_S = 30.0


async def stop_process(process: subprocess.Popen[bytes], grace: float) -> int:
    """SIGTERM, up to ``grace`` seconds, then SIGKILL to the process's group; its exit status."""
    if _exit_status(process) is None:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while _exit_status(process) is None and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
    # The leader is not reaped yet, so its group id is still its own: the rest of its group
    # (what it started) goes with it, and so do the names it held in /dev/shm (vLLM's
    # message queues: a SIGKILLed engine leaves them), once the group is gone.
    held = await asyncio.to_thread(child_processes.kill_group, process.pid)
    while _exit_status(process) is None:
        await asyncio.sleep(0.05)
    deadline = time.monotonic() + GROUP_GONE_S
    while child_processes.group_members(process.pid) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    child_processes.remove_shared_memory(held)
    return process.wait()


class Pod:
    """A pod's containers, run from its template until :meth:`terminate`."""

    def __init__(
        self,
        identity: podspec.PodIdentity,
        template: Mapping[str, Any],
        directory: Path,
        *,
        owner: tuple[str, str],
        revision: str,
        configmaps: ConfigMaps,
        session: aiohttp.ClientSession,
        base_env: Mapping[str, str],
        entrypoints: Mapping[str, list[str]],
        hostname: str = "",
        subdomain: str = "",
    ):
        self.identity = identity
        self.template = template
        self.spec: Mapping[str, Any] = template.get("spec") or {}
        self.directory = directory
        self.owner = owner  # (kind, name)
        self.revision = revision
        self.hostname = hostname or identity.name
        self.subdomain = subdomain
        self.hosts_file = directory / "hosts"
        self.created = time.monotonic()
        self.ready_since: float | None = None
        self.reason = "ContainerCreating"
        self.terminating = False
        self.stopped = False
        self.init_containers = [
            Container(dict(c), directory / f"{c.get('name', 'init')}.log")
            for c in self.spec.get("initContainers") or []
        ]
        self.containers = [
            Container(dict(c), directory / f"{c.get('name', 'container')}.log")
            for c in self.spec.get("containers") or []
        ]
        self._configmaps = configmaps
        self._session = session
        self._base_env = dict(base_env)
        self._entrypoints = entrypoints
        self._volumes: dict[str, Path] = {}
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    # --- what the node asks -----------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.identity.name

    @property
    def ip(self) -> str:
        return self.identity.ip

    @property
    def ready(self) -> bool:
        return not self.terminating and bool(self.containers) and all(c.ready for c in self.containers)

    def available(self, min_ready_seconds: float) -> bool:
        return (
            self.ready
            and self.ready_since is not None
            and (time.monotonic() - self.ready_since >= min_ready_seconds)
        )

    def ports(self) -> dict[str, int]:
        return {
            str(p["name"]): int(p["containerPort"])
            for c in self.containers
            for p in c.spec.get("ports") or []
            if p.get("name")
        }

    # --- life -----------------------------------------------------------------------------------
    def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self._task = asyncio.create_task(self._run(), name=f"pod {self.identity.namespace}/{self.name}")

    def terminate(self) -> None:
        """Begin stopping the pod; ``stopped`` once every process is gone."""
        self.terminating = True
        self._stop.set()

    async def wait_stopped(self) -> None:
        if self._task is not None:
            await asyncio.shield(self._task)

    def _grace(self) -> float:
        return float(self.spec.get("terminationGracePeriodSeconds", 30))

    async def _run(self) -> None:
        supervisors: list[asyncio.Task[None]] = []
        try:
            while not await self._prepare():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), 0.5)
                if self._stop.is_set():
                    return
            if not await self._initialize():
                return
            self.reason = "Running"
            supervisors = [asyncio.create_task(self._supervise(c)) for c in self.containers]
            await self._stop.wait()
        finally:
            self._stop.set()
            await asyncio.gather(*supervisors, return_exceptions=True)
            self.stopped = True

    async def _prepare(self) -> bool:
        """Volumes written and every container's argv and environment resolved; False to wait."""
        configmaps = self._configmaps(self.identity.namespace)
        try:
            self._volumes = podspec.volume_dirs(self.spec, self.directory)
            self.refresh_volumes(configmaps)
            for container in [*self.init_containers, *self.containers]:
                mounts = podspec.container_mounts(container.spec, self._volumes)
                declared = podspec.container_env(container.spec, self.identity, configmaps)
                env = {**self._base_env, **{k: podspec.rewrite(v, mounts) for k, v in declared.items()}}
                env["HOSTNAME"] = self.hostname
                container.env = env
                container.argv = podspec.container_argv(
                    container.spec, env, mounts, self._entrypoints, env["PATH"]
                )
        except podspec.PodSpecError as exc:
            self.reason = str(exc)
            return False
        return True

    def refresh_volumes(self, configmaps: Mapping[str, Mapping[str, Any]]) -> None:
        """Write (or bring up to date) every volume's files."""
        for volume in self.spec.get("volumes") or []:
            directory = self._volumes.get(volume["name"]) or self.directory / "volumes" / volume["name"]
            directory.mkdir(parents=True, exist_ok=True)
            if "configMap" not in volume:
                continue
            files = podspec.configmap_files(volume, configmaps.get(volume["configMap"].get("name", "")))
            for relative, (content, mode) in files.items():
                path = directory / relative
                path.parent.mkdir(parents=True, exist_ok=True)
                if path.exists() and path.read_text() == content:
                    continue
                partial = path.with_name(f".{path.name}.tmp")
                partial.write_text(content)
                partial.chmod(mode)
                partial.replace(path)

    # --- containers ---------------------------------------------------------------------------
    def _spawn(self, container: Container) -> subprocess.Popen[bytes]:
        env = {**container.env, sandbox.POD_IP_ENV: self.ip, "LD_PRELOAD": str(sandbox.podnet_library())}
        command = sandbox.pod_command(container.argv, self.hosts_file, self.hostname)
        with container.log_path.open("ab") as log:
            log.write(f"--- start {container.restarts}: {container.argv}\n".encode())
            log.flush()
            process = subprocess.Popen(
                command,
                env=env,
                cwd=str(self.directory),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        container.pids.append(process.pid)
        return process

    async def _initialize(self) -> bool:
        """Run each init container to a zero exit, in order; False if the pod stops first."""
        for done, container in enumerate(self.init_containers):
            while True:
                self.reason = f"Init:{done}/{len(self.init_containers)}"
                container.process = self._spawn(container)
                while _exit_status(container.process) is None and not self._stop.is_set():
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._stop.wait(), 0.1)
                code = await stop_process(container.process, self._grace() if self._stop.is_set() else 0.0)
                if self._stop.is_set():
                    return False
                container.exit_codes.append(code)
                if code == 0:
                    break
                container.restarts += 1
                delay = backoff_s(container.restarts)
                self.reason = f"Init:Error: {container.name} exited with {code}; restarting in {delay:g}s"
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), delay)
                if self._stop.is_set():
                    return False
        return True

    async def _supervise(self, container: Container) -> None:
        """Run ``container`` until the pod stops, restarting it whenever it exits."""
        while not self._stop.is_set():
            container.started = container.ready = False
            container.process = self._spawn(container)
            if all(c.process is not None and _exit_status(c.process) is None for c in self.containers):
                self.reason = "Running"  # running again after a restart, as the kubelet reports it
            probes = asyncio.create_task(self._probe(container))
            stopper = asyncio.create_task(self._stop.wait())
            try:
                while _exit_status(container.process) is None and not self._stop.is_set():
                    await asyncio.wait({stopper}, timeout=0.1)
            finally:
                probes.cancel()
                stopper.cancel()
                container.ready = False
                self._note_ready()
                grace = self._grace() if self._stop.is_set() else 0.0
                code = await stop_process(container.process, grace)
            if self._stop.is_set():
                return
            container.exit_codes.append(code)
            container.restarts += 1
            delay = backoff_s(container.restarts)
            self.reason = f"container {container.name} exited with {code}; restarting in {delay:g}s"
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), delay)

    def _note_ready(self) -> None:
        if self.ready:
            if self.ready_since is None:
                self.ready_since = time.monotonic()
        else:
            self.ready_since = None

    async def _probe(self, container: Container) -> None:
        spec = container.spec
        startup = spec.get("startupProbe")
        if startup is not None and not await self._until(container, startup, want=True):
            await self._restart(container, "startup probe failed")
            return
        container.started = True
        readiness, liveness = spec.get("readinessProbe"), spec.get("livenessProbe")
        if readiness is None:
            container.ready = True
            self._note_ready()
        tasks = []
        if readiness is not None:
            tasks.append(asyncio.create_task(self._readiness(container, readiness)))
        if liveness is not None:
            tasks.append(asyncio.create_task(self._liveness(container, liveness)))
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()

    async def _until(self, container: Container, probe: Mapping[str, Any], want: bool) -> bool:
        """Probe until it succeeds (True) or fails ``failureThreshold`` times in a row (False)."""
        await asyncio.sleep(float(probe.get("initialDelaySeconds", 0)))
        failures = 0
        while True:
            if await self._check(container, probe) == want:
                return True
            failures += 1
            if failures >= int(probe.get("failureThreshold", 3)):
                return False
            await asyncio.sleep(float(probe.get("periodSeconds", 10)))

    async def _readiness(self, container: Container, probe: Mapping[str, Any]) -> None:
        await asyncio.sleep(float(probe.get("initialDelaySeconds", 0)))
        successes = failures = 0
        while True:
            if await self._check(container, probe):
                successes, failures = successes + 1, 0
                if successes >= int(probe.get("successThreshold", 1)):
                    container.ready = True
            else:
                successes, failures = 0, failures + 1
                if failures >= int(probe.get("failureThreshold", 3)):
                    container.ready = False
            self._note_ready()
            await asyncio.sleep(float(probe.get("periodSeconds", 10)))

    async def _liveness(self, container: Container, probe: Mapping[str, Any]) -> None:
        await asyncio.sleep(float(probe.get("initialDelaySeconds", 0)))
        failures = 0
        while True:
            failures = 0 if await self._check(container, probe) else failures + 1
            if failures >= int(probe.get("failureThreshold", 3)):
                await self._restart(container, "liveness probe failed")
                return
            await asyncio.sleep(float(probe.get("periodSeconds", 10)))

    async def _restart(self, container: Container, why: str) -> None:
        """Stop the container's process (the supervisor starts it again)."""
        self.reason = f"container {container.name}: {why}"
        if container.process is not None:
            await stop_process(container.process, self._grace())

    async def _check(self, container: Container, probe: Mapping[str, Any]) -> bool:
        """One probe: HTTP GET (2xx/3xx), TCP connect, or a command exiting 0, within its timeout."""
        timeout = float(probe.get("timeoutSeconds", 1))
        try:
            if "httpGet" in probe:
                action = probe["httpGet"]
                host = action.get("host") or self.ip
                url = f"{action.get('scheme', 'HTTP').lower()}://{host}:{container.port(action['port'])}"
                async with self._session.get(
                    url + action.get("path", "/"), timeout=aiohttp.ClientTimeout(total=timeout)
                ) as response:
                    return 200 <= response.status < 400
            if "tcpSocket" in probe:
                port = container.port(probe["tcpSocket"]["port"])
                _, writer = await asyncio.wait_for(asyncio.open_connection(self.ip, port), timeout)
                writer.close()
                return True
            if "exec" in probe:
                return await self._exec(container, list(probe["exec"]["command"]), timeout)
        except (OSError, TimeoutError, aiohttp.ClientError, podspec.PodSpecError):
            return False
        return False

    async def _exec(self, container: Container, argv: list[str], timeout: float) -> bool:
        env = {**container.env, sandbox.POD_IP_ENV: self.ip, "LD_PRELOAD": str(sandbox.podnet_library())}
        process = await asyncio.create_subprocess_exec(
            *sandbox.pod_command(argv, self.hosts_file, self.hostname),
            env=env,
            cwd=str(self.directory),
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            return await asyncio.wait_for(process.wait(), timeout) == 0
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            await process.wait()
            return False
