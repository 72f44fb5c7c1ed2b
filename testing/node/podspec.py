"""A pod template's containers as local processes, as the kubelet would see them (pure).

* the environment: ``value`` (with ``$(VAR)`` expanded against the entries before it),
  ``fieldRef`` (``status.podIP`` is the pod's own loopback address), ``configMapKeyRef``
  and ``envFrom`` ConfigMaps;
* ``command`` and ``args`` with ``$(VAR)`` expanded against the whole environment (``$$``
  escapes a ``$``; an unknown reference stays as written);
* volumes: ``configMap`` and ``emptyDir`` become directories in the pod's own directory,
  and every mount path in the argv and environment is rewritten to its directory there.

What the node cannot run raises :class:`PodSpecError`, naming the field.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_REFERENCE = re.compile(r"\$\$|\$\(([-._a-zA-Z][-._a-zA-Z0-9]*)\)")
_LABEL_FIELD = re.compile(r"^metadata\.(labels|annotations)\['(.+)'\]$")
# The host address kubelet reports for the node; every pod's node is this machine.
HOST_IP = "127.0.0.1"


class PodSpecError(ValueError):
    """Something in a pod template the test node cannot run."""


@dataclass(frozen=True)
class PodIdentity:
    """What the downward API can tell a pod about itself."""

    name: str
    namespace: str
    uid: str
    ip: str
    node_name: str
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    service_account: str = "default"


@dataclass(frozen=True)
class Mount:
    """A container mount: the path it asked for and where it lies on this machine."""

    path: str
    host: Path


def field_value(path: str, pod: PodIdentity) -> str:
    """The value of a ``fieldRef.fieldPath`` for ``pod``."""
    simple = {
        "metadata.name": pod.name,
        "metadata.namespace": pod.namespace,
        "metadata.uid": pod.uid,
        "spec.nodeName": pod.node_name,
        "spec.serviceAccountName": pod.service_account,
        "status.podIP": pod.ip,
        "status.podIPs": pod.ip,
        "status.hostIP": HOST_IP,
        "status.hostIPs": HOST_IP,
    }
    if path in simple:
        return simple[path]
    match = _LABEL_FIELD.match(path)
    if match:
        values = pod.labels if match.group(1) == "labels" else pod.annotations
        return values.get(match.group(2), "")
    raise PodSpecError(f"fieldRef.fieldPath {path!r} is not one the test node knows")


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: known variables replaced, ``$$`` to ``$``, the rest kept."""

    def substitute(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))

    return _REFERENCE.sub(substitute, text)


def _configmap_value(ref: Mapping[str, Any], configmaps: Mapping[str, Mapping[str, Any]], where: str) -> str:
    data = (configmaps.get(ref.get("name", "")) or {}).get("data") or {}
    if ref.get("key") in data:
        return str(data[ref["key"]])
    if ref.get("optional"):
        return ""
    raise PodSpecError(f"{where}: ConfigMap {ref.get('name')!r} has no key {ref.get('key')!r} (yet)")


def container_env(
    container: Mapping[str, Any], pod: PodIdentity, configmaps: Mapping[str, Mapping[str, Any]]
) -> dict[str, str]:
    """The environment the container declares, resolved in order as the kubelet does."""
    name = container.get("name", "")
    env: dict[str, str] = {}
    for index, source in enumerate(container.get("envFrom") or []):
        ref = source.get("configMapRef")
        if ref is None:
            raise PodSpecError(f"containers[{name}].envFrom[{index}]: only configMapRef is supported")
        data = (configmaps.get(ref.get("name", "")) or {}).get("data")
        if data is None and not ref.get("optional"):
            raise PodSpecError(f"containers[{name}].envFrom[{index}]: no ConfigMap {ref.get('name')!r} (yet)")
        prefix = source.get("prefix", "")
        env.update({prefix + key: str(value) for key, value in (data or {}).items()})
    for index, entry in enumerate(container.get("env") or []):
        where = f"containers[{name}].env[{index}] ({entry.get('name')})"
        source = entry.get("valueFrom")
        if source is None:
            env[entry["name"]] = expand(str(entry.get("value", "")), env)
        elif "fieldRef" in source:
            env[entry["name"]] = field_value(source["fieldRef"].get("fieldPath", ""), pod)
        elif "configMapKeyRef" in source:
            env[entry["name"]] = _configmap_value(source["configMapKeyRef"], configmaps, where)
        else:
            raise PodSpecError(f"{where}: only value, fieldRef and configMapKeyRef are supported")
    return env


def volume_dirs(pod_spec: Mapping[str, Any], pod_dir: Path) -> dict[str, Path]:
    """Each volume's directory in the pod's own directory (``configMap`` and ``emptyDir`` only)."""
    out = {}
    for volume in pod_spec.get("volumes") or []:
        if "configMap" not in volume and "emptyDir" not in volume:
            kinds = sorted(set(volume) - {"name"})
            raise PodSpecError(f"volumes[{volume.get('name')}]: {kinds} volumes are not supported")
        out[volume["name"]] = pod_dir / "volumes" / volume["name"]
    return out


def container_mounts(container: Mapping[str, Any], volumes: Mapping[str, Path]) -> list[Mount]:
    """The container's mounts, each at its volume's directory (and ``subPath`` in it)."""
    mounts = []
    for mount in container.get("volumeMounts") or []:
        if mount.get("name") not in volumes:
            raise PodSpecError(f"containers[{container.get('name')}]: no volume {mount.get('name')!r}")
        host = volumes[mount["name"]]
        if mount.get("subPath"):
            host = host / mount["subPath"]
        mounts.append(Mount(str(mount["mountPath"]).rstrip("/") or "/", host))
    return mounts


def rewrite(text: str, mounts: list[Mount]) -> str:
    """``text`` with each mount path (as a whole path, or a path's start) replaced by its directory,
    in one pass: a directory put in is never rewritten again (a mount at ``/tmp`` leaves alone a
    directory under the node's own ``/tmp``), and the longest mount path wins."""
    if not mounts:
        return text
    ordered = sorted(mounts, key=lambda m: len(m.path), reverse=True)
    hosts = {m.path: str(m.host) for m in reversed(ordered)}
    alternatives = "|".join(re.escape(m.path) for m in ordered)
    pattern = re.compile(r"(?<![\w.-])(" + alternatives + r")(?=/|$|[^\w.-])")
    return pattern.sub(lambda match: hosts[match.group(1)], text)


def configmap_files(
    volume: Mapping[str, Any], configmap: Mapping[str, Any] | None
) -> dict[str, tuple[str, int]]:
    """The files a ``configMap`` volume projects: relative path -> (content, mode)."""
    source = volume["configMap"]
    if configmap is None:
        if source.get("optional"):
            return {}
        raise PodSpecError(f"volumes[{volume['name']}]: no ConfigMap {source.get('name')!r} (yet)")
    data = {k: str(v) for k, v in (configmap.get("data") or {}).items()}
    mode = int(source.get("defaultMode", 0o644))
    items = source.get("items")
    if not items:
        return {key: (value, mode) for key, value in data.items()}
    out = {}
    for item in items:
        if item["key"] not in data:
            raise PodSpecError(f"volumes[{volume['name']}]: ConfigMap has no key {item['key']!r}")
        out[item["path"]] = (data[item["key"]], int(item.get("mode", mode)))
    return out


def container_argv(
    container: Mapping[str, Any],
    env: Mapping[str, str],
    mounts: list[Mount],
    entrypoints: Mapping[str, list[str]],
    path: str,
) -> list[str]:
    """``command`` + ``args``, expanded and rewritten, the program found on ``path``.

    A container without ``command`` runs its image's entrypoint, from ``entrypoints``.
    """
    command = container.get("command")
    if not command:
        image = container.get("image", "")
        if image not in entrypoints:
            raise PodSpecError(
                f"containers[{container.get('name')}]: no command, and the node knows no entrypoint "
                f"for image {image!r}"
            )
        command = entrypoints[image]
    argv = [rewrite(expand(str(token), env), mounts) for token in [*command, *(container.get("args") or [])]]
    program = argv[0] if "/" in argv[0] else shutil.which(argv[0], path=path)
    if program is None:
        raise PodSpecError(f"containers[{container.get('name')}]: {argv[0]!r} not found on {path}")
    return [program, *argv[1:]]
