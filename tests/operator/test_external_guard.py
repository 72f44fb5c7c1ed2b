"""The external-endpoint guard, the pure part: what an endpoint resolves to, checked against
the addresses of pools the operator runs in other namespaces, and asked only there."""

from __future__ import annotations

import asyncio
import ipaddress

import pytest

from kvpool.operator.external_guard import PinnedResolver, Vetted, vet_endpoints
from kvpool.operator.validation import _refused_host

ELSEWHERE = {ipaddress.ip_address("127.0.0.1")}  # a pool of team-b
FIELD = "spec.external.metricsEndpoints"


def vet(*endpoints: str, timeout: float = 3.0) -> Vetted:
    return asyncio.run(vet_endpoints(list(endpoints), ELSEWHERE, timeout, field_name=FIELD))


@pytest.mark.parametrize("endpoint", ["127.0.0.1:9003", "[::ffff:127.0.0.1]:9003", "localhost:9003"])
def test_every_spelling_of_another_pools_address_is_refused(endpoint: str) -> None:
    vetted = vet("198.51.100.7:9003", endpoint)  # (a documentation address: never asked)
    assert vetted.reason == "EndpointRefused" and vetted.addresses == {}
    assert vetted.problem is not None and f"{FIELD}[1]" in vetted.problem and "team-b" not in vetted.problem


@pytest.mark.parametrize("endpoint", ["a..b:9003", f"{'x' * 64}.example:9003"])
def test_a_name_that_cannot_resolve_is_a_problem_not_an_exception(endpoint: str) -> None:
    vetted = vet(endpoint)
    assert vetted.reason == "Unreachable" and "does not resolve" in str(vetted.problem)


def test_the_resolver_answers_what_was_checked_whatever_the_case_and_port() -> None:
    vetted = asyncio.run(vet_endpoints(["LocalHost:9003", "localhost:9004"], {}, 3.0, field_name=FIELD))
    assert vetted.problem is None
    resolver = PinnedResolver(vetted.addresses)
    for host, port in (("localhost", 9003), ("LOCALHOST", 9003), ("localhost.", 9004)):
        assert {r["port"] for r in asyncio.run(resolver.resolve(host, port))} == {port}
    with pytest.raises(OSError, match="not checked"):
        asyncio.run(resolver.resolve("localhost", 9005))
    with pytest.raises(OSError, match="not checked"):
        asyncio.run(resolver.resolve("elsewhere.example", 9003))


def test_validation_refuses_a_loopback_or_metadata_address_written_as_ipv6() -> None:
    assert _refused_host("[::ffff:127.0.0.1]") is not None
    assert _refused_host("::ffff:169.254.169.254") is not None
    assert _refused_host("[::ffff:198.51.100.7]") is None
