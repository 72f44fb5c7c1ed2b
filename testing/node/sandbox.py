"""What each pod of the test node gets of its own on a machine shared by every pod: an
address, a hostname, an ``/etc/hosts`` (the cluster's DNS), and private "any" binds.

A container's process runs as
``unshare --mount --uts -- sh -c 'mount --bind HOSTS /etc/hosts; hostname POD; exec ARGV'``
with ``podnet.c`` preloaded: its own mount and UTS namespaces give it the pod's hosts file
and hostname (every resolver reads them, Go's too), and the preloaded library binds "any"
address to the pod's own loopback address and keeps abstract Unix sockets private to the
pod (both are per network namespace in a real pod). The process keeps the PID ``Popen``
reports: ``unshare`` and ``sh`` exec into it.

Needs a C compiler and the right to create mount namespaces (root here);
:func:`unavailable` says why not, for a skip.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("podnet.c")
POD_IP_ENV = "KVPOOL_POD_IP"
# $0: the hosts file, $1: the hostname, the rest: the container's argv.
_ENTER = 'mount --bind "$0" /etc/hosts && hostname "$1" && shift && exec "$@"'


@functools.cache
def podnet_library() -> Path:
    """``podnet.c`` built once per source version (cached in the system's temp directory)."""
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
    target = Path(tempfile.gettempdir()) / f"kvpool-podnet-{digest}.so"
    if not target.exists():
        compiler = shutil.which("cc") or shutil.which("gcc")
        if compiler is None:
            raise RuntimeError("no C compiler (cc) to build the test node's podnet library")
        partial = target.with_suffix(f".{os.getpid()}.tmp")
        subprocess.run(
            [compiler, "-shared", "-fPIC", "-O2", "-o", str(partial), str(SOURCE), "-ldl"],
            check=True,
            capture_output=True,
        )
        partial.replace(target)
    return target


def pod_command(argv: list[str], hosts_file: Path, hostname: str) -> list[str]:
    """``argv`` run in a pod's own mount and UTS namespaces (its hosts file, its hostname)."""
    unshare = shutil.which("unshare") or "unshare"
    return [
        unshare, "--mount", "--uts", "--propagation", "private", "--",
        "/bin/sh", "-c", _ENTER, str(hosts_file), hostname, *argv,
    ]  # fmt: skip


@functools.cache
def unavailable() -> str | None:
    """Why pods cannot run on this machine (no compiler, no namespaces); None when they can."""
    try:
        podnet_library()
    except (RuntimeError, subprocess.CalledProcessError) as exc:
        return f"cannot build the podnet library: {exc}"
    with tempfile.NamedTemporaryFile("w", suffix=".hosts") as hosts:
        hosts.write("127.0.0.1 localhost\n")
        hosts.flush()
        probe = subprocess.run(
            pod_command(["/bin/true"], Path(hosts.name), "probe"), capture_output=True, text=True
        )
    if probe.returncode != 0:
        return f"cannot create mount and UTS namespaces: {probe.stderr.strip()}"
    return None
