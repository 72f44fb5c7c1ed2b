"""``kvpool-operator run`` refuses bad arguments before it contacts any API server.

A usage error is reported as argparse reports its own: one line on standard error naming
the option and the rule, exit status 2.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvpool.operator.cli import _parser, main, options_from_args

COMMAND = [sys.executable, "-m", "kvpool.operator.cli"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--observe-interval", "-1"], "--observe-interval -1.0: more than 0 seconds"),
        (["--resync-interval", "0"], "--resync-interval 0.0: more than 0 seconds"),
        (["--retry-delay", "nan"], "--retry-delay nan: more than 0 seconds"),
        (["--metrics-port", "70000"], "--metrics-port 70000: a TCP port is 1-65535 (0: no metrics)"),
        (["--webhook-port", "0"], "--webhook-port 0: a TCP port is 1-65535"),
        (["--max-store-replicas", "-3"], "--max-store-replicas -3: at least 1"),
        (["--max-master-replicas", "0"], "--max-master-replicas 0: at least 1"),
        (["--operator-pod-label", "app"], "--operator-pod-label 'app': expected KEY=VALUE"),
        (["--allowed-registry", "bad registry"], "--allowed-registry 'bad registry' is not a registry"),
        (["--injection-mode", "podAdmission"], "--injection-mode=podAdmission needs the webhook server"),
        (["--webhook-host", "op.ns.svc"], "--webhook-host: needs the webhook server: --webhook-port"),
        (["--webhook-managed", "kvpool"], "--webhook-managed: needs the webhook server: --webhook-port"),
        (["--webhook-port", "9443", "--webhook-key", __file__], "--webhook-key: needs --webhook-cert"),
    ],
)
def test_bad_arguments_are_refused_naming_the_option(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as refused:
        options_from_args(_parser().parse_args(["run", *args]))
    assert refused.value.code == 2
    out, err = capsys.readouterr()
    assert err.startswith(f"kvpool-operator run: error: {message}")
    assert err.count("\n") == 1 and out == ""


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--kubeconfig", "/nonexistent/kubeconfig"], "--kubeconfig /nonexistent/kubeconfig: no such file"),
        (["--kubeconfig", "/"], "--kubeconfig /: not a file"),
        (["--webhook-port", "9443", "--webhook-cert", "/nonexistent/tls.crt"], "--webhook-cert /nonexistent"),
        (
            ["--webhook-port", "9443", "--webhook-cert", __file__, "--webhook-key", "/nonexistent/tls.key"],
            "--webhook-key /nonexistent",
        ),
    ],
)
def test_missing_files_are_refused_naming_the_option(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before any API server is contacted (it used to be a traceback from the Kubernetes client)."""
    with pytest.raises(SystemExit) as refused:
        main(["run", "--metrics-port", "0", "--liveness", "", *args])
    assert refused.value.code == 2
    out, err = capsys.readouterr()
    assert err.startswith(f"kvpool-operator run: error: {message}")
    assert err.count("\n") == 1 and out == ""


def test_a_kubeconfig_that_is_none_is_one_clear_error(tmp_path: Path) -> None:
    """A file that holds no kubeconfig: one line naming the option and the file, no traceback."""
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text("not: [a kubeconfig\n")
    result = subprocess.run(
        [*COMMAND, "run", "--kubeconfig", str(kubeconfig), "--metrics-port", "0", "--liveness", ""],
        capture_output=True, text=True, timeout=120, env={**os.environ, "KUBERNETES_SERVICE_HOST": ""},
    )  # fmt: skip
    assert result.returncode == 1
    assert f"kvpool-operator run: --kubeconfig {kubeconfig}: no credentials from it: " in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


def test_numbers_in_range_are_taken() -> None:
    args = ["--observe-interval", "0.5", "--metrics-port", "0", "--webhook-port", "9443"]
    options = options_from_args(_parser().parse_args(["run", *args, "--max-store-replicas", "1"]))
    assert options.observe_interval == 0.5
    assert options.metrics_port is None
    assert options.webhook is not None and options.webhook.port == 9443
    assert options.policy.max_store_replicas == 1
