"""``kvpool-operator run`` refuses out-of-range numbers before it contacts any API server."""

from __future__ import annotations

import pytest

from kvpool.operator.cli import _parser, options_from_args


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
    ],
)
def test_out_of_range_numbers_are_refused_naming_the_option(args: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as refused:
        options_from_args(_parser().parse_args(["run", *args]))
    assert str(refused.value) == message


def test_numbers_in_range_are_taken() -> None:
    args = ["--observe-interval", "0.5", "--metrics-port", "0", "--webhook-port", "9443"]
    options = options_from_args(_parser().parse_args(["run", *args, "--max-store-replicas", "1"]))
    assert options.observe_interval == 0.5
    assert options.metrics_port is None
    assert options.webhook is not None and options.webhook.port == 9443
    assert options.policy.max_store_replicas == 1
