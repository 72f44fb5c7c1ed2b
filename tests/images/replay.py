"""Replaying a Dockerfile's install steps without an image builder.

:class:`Dockerfile` reads one with ``dockerfile-parse``: its stages, base images,
labels, user, and the ``pip install`` / ``uv pip install`` requirements of its
``RUN`` steps. :class:`FreshEnv` is a new virtual environment of the base
interpreter in which those steps are replayed affordably:

* this project's requirement is installed for real, from a wheel built out of
  the files the Dockerfile's wheel stage copies, with ``--no-deps``;
* every other requirement (what the image would download) comes from ``.venv``,
  where it is installed already: exactly the distributions it names and their
  dependency closure are linked, file by file, into a directory the fresh
  environment sees after its own site-packages, and their console scripts are
  written as pip writes them. Nothing else of ``.venv`` is visible, so an import
  that works proves the declared requirements suffice;
* a base image that brings a whole stack (vLLM) is stood in for by ``.venv``'s
  site-packages as a whole.
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dockerfile_parse import DockerfileParser
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]
PIP_OPTIONS_WITH_VALUE = {
    "--find-links",
    "-f",
    "--index-url",
    "-i",
    "--extra-index-url",
    "-c",
    "-r",
    "--target",
}


@dataclass
class Stage:
    """One ``FROM`` ... of a Dockerfile: its base, name and instructions."""

    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def values(self, instruction: str) -> list[str]:
        return [v for i, v in self.instructions if i == instruction]


class Dockerfile:
    """A Dockerfile, parsed."""

    def __init__(self, path: Path):
        self.path = path
        self.parser = DockerfileParser(path=str(path))
        self.stages: list[Stage] = []
        for item in self.parser.structure:
            instruction, value = item["instruction"], item["value"]
            if instruction == "FROM":
                parts = value.split()
                name = parts[2] if len(parts) == 3 and parts[1].upper() == "AS" else None
                self.stages.append(Stage(parts[0], name))
            elif self.stages and instruction != "COMMENT":
                self.stages[-1].instructions.append((instruction, value))

    @property
    def final(self) -> Stage:
        return self.stages[-1]

    @property
    def labels(self) -> dict[str, str]:
        return dict(self.parser.labels)

    @property
    def external_bases(self) -> list[str]:
        """Base images pulled from a registry (not earlier stages)."""
        names = {s.name for s in self.stages if s.name}
        return [s.base for s in self.stages if s.base not in names]

    def user(self) -> str | None:
        users = self.final.values("USER")
        return users[-1] if users else None

    def pip_requirements(self, stage: Stage | None = None) -> list[Requirement]:
        """Requirements of every ``pip install`` in ``stage``'s (default: the final stage's) RUN steps."""
        out: list[Requirement] = []
        for run in (stage or self.final).values("RUN"):
            for command in _commands(run):
                out += _pip_install_requirements(command)
        return out

    def copied_sources(self, stage: Stage) -> list[tuple[str, str]]:
        """(source, destination) of each ``COPY`` from the build context in ``stage``."""
        out = []
        for value in stage.values("COPY"):
            tokens = [t for t in shlex.split(value) if not t.startswith("--")]
            *sources, destination = tokens
            out += [(source, destination) for source in sources]
        return out


def _commands(run: str) -> list[list[str]]:
    """The simple commands of a shell ``RUN`` line, split at ``&&`` and ``;``."""
    commands: list[list[str]] = [[]]
    for token in shlex.split(run.replace("\\\n", " ")):
        if token in ("&&", ";", "||"):
            commands.append([])
        else:
            commands[-1].append(token)
    return [c for c in commands if c]


def _pip_install_requirements(command: list[str]) -> list[Requirement]:
    words = [Path(c).name if i == 0 else c for i, c in enumerate(command)]
    start = None
    for i in range(len(words) - 1):
        if words[i] == "pip" and words[i + 1] == "install":
            start = i + 2
    if start is None:
        return []
    out: list[Requirement] = []
    skip = False
    for token in command[start:]:
        if skip:
            skip = False
        elif token in PIP_OPTIONS_WITH_VALUE:
            skip = True
        elif not token.startswith("-"):
            out.append(Requirement(token))
    return out


def build_wheel(dockerfile: Dockerfile, out: Path) -> Path:
    """This project's wheel, built (as the wheel stage does) from exactly the files the stage copies."""
    stage = next(s for s in dockerfile.stages if s.name == "wheel")
    src = out / "src"
    src.mkdir(parents=True)
    for source, destination in dockerfile.copied_sources(stage):
        target = src / destination if not destination.endswith("/") else src / destination / source
        origin = REPO / source
        if origin.is_dir():
            shutil.copytree(origin, target, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(origin, target)
    return pip_wheel(src, out / "wheels")


def pip_wheel(src: Path, wheels: Path) -> Path:
    """This project's wheel built from the source tree ``src`` into ``wheels`` (offline, no deps)."""
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "--wheel-dir", str(wheels), str(src)],
        check=True, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    (wheel,) = wheels.glob("mooncake_kvpool-*.whl")
    return wheel


def closure(requirements: Iterable[Requirement]) -> dict[str, metadata.Distribution]:
    """The distributions of ``.venv`` that ``requirements`` need, transitively; each version checked."""
    found: dict[str, metadata.Distribution] = {}
    extras_of: dict[str, set[str]] = {}
    pending: list[tuple[Requirement, frozenset[str]]] = [(r, frozenset()) for r in requirements]
    while pending:
        requirement, parent_extras = pending.pop()
        if requirement.marker is not None and not any(
            requirement.marker.evaluate({"extra": e}) for e in ("", *parent_extras)
        ):
            continue
        name = canonicalize_name(requirement.name)
        dist = metadata.distribution(requirement.name)  # PackageNotFoundError: not in .venv
        if not requirement.specifier.contains(dist.version, prereleases=True):
            raise AssertionError(f"{requirement} is needed; .venv has {dist.version}")
        wanted = set(requirement.extras)
        if name in found and wanted <= extras_of[name]:
            continue
        found[name] = dist
        extras_of.setdefault(name, set()).update(wanted)
        for raw in dist.requires or []:
            pending.append((Requirement(raw), frozenset(extras_of[name])))
    return found


def wheel_requirements(wheel: Path, extras: Iterable[str]) -> list[Requirement]:
    """The requirements a wheel declares for ``extras`` (and unconditionally)."""
    import zipfile
    from email.parser import Parser

    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        meta = Parser().parsestr(archive.read(name).decode())
    out = []
    for raw in meta.get_all("Requires-Dist") or []:
        requirement = Requirement(raw)
        marker = requirement.marker
        if marker is None or any(marker.evaluate({"extra": e}) for e in ("", *extras)):
            requirement.marker = None
            out.append(requirement)
    return out


class FreshEnv:
    """A new virtual environment of the base interpreter (with pip), for replaying installs."""

    def __init__(self, root: Path):
        self.root = root
        subprocess.run([sys._base_executable, "-m", "venv", str(root)], check=True, timeout=300)
        self.python = root / "bin" / "python"
        purelib = subprocess.run(
            [str(self.python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True, capture_output=True, text=True,
        ).stdout.strip()  # fmt: skip
        self.site_packages = Path(purelib)
        self.view = root / "deps"
        self.view.mkdir()
        # After the environment's own site-packages: what it installs itself wins.
        (self.site_packages / "zz_replayed_requirements.pth").write_text(f"{self.view}\n")

    def pip_install_wheel(self, wheel: Path) -> None:
        self.run(
            [str(self.python), "-m", "pip", "install", "--no-deps", "--no-index", str(wheel)], check=True
        )

    def expose(self, dists: Iterable[metadata.Distribution]) -> None:
        """Link each distribution's files (and write its console scripts) into this environment."""
        for dist in dists:
            for file in dist.files or []:
                if str(file).startswith(".."):
                    continue  # scripts and data outside site-packages: written below
                target = self.view / file
                if target.exists() or target.is_symlink():
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                target.symlink_to(Path(str(dist.locate_file(file))))
            for entry in dist.entry_points.select(group="console_scripts"):
                self._write_script(entry)

    def expose_site_packages(self) -> None:
        """A base image's whole stack: ``.venv``'s site-packages, after this environment's own."""
        purelib = sysconfig.get_paths()["purelib"]
        (self.site_packages / "zz_base_image.pth").write_text(f"{purelib}\n")

    def _write_script(self, entry: Any) -> None:
        module, _, attr = entry.value.partition(":")
        script = self.root / "bin" / entry.name
        script.write_text(
            f"#!{self.python}\nimport sys\nfrom {module} import {attr.split('.')[0]}\nsys.exit({attr}())\n"
        )
        script.chmod(0o755)

    def run(
        self, command: Sequence[str], *, check: bool = False, timeout: float = 600
    ) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env["PATH"] = f"{self.root / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        return subprocess.run(
            list(command),
            capture_output=True,
            text=True,
            check=check,
            timeout=timeout,
            env=env,
            cwd=self.root,
        )
