"""Settings rules that pydantic's lax reading would otherwise let through: blank addresses,
booleans as numbers, fractional byte counts, a tenant with a trailing newline, and the
in-tree ``mode`` read against the segment size as it parses."""

from __future__ import annotations

from typing import Any

import pytest

from kvpool.connector.contract.settings import ConnectorSettings, SettingsError

BASE = {"master_server_address": "m:1"}


def problems_of(**settings: Any) -> dict[str, str]:
    with pytest.raises(SettingsError) as err:
        ConnectorSettings.parse({**BASE, **settings})
    return err.value.problems


# --- addresses ------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["metadata_server", "local_hostname"])
@pytest.mark.parametrize("value", ["", " ", "\t\n"])
def test_a_blank_address_is_refused_naming_its_field(field: str, value: str) -> None:
    assert problems_of(**{field: value}) == {field: "an address cannot be empty or blank"}


@pytest.mark.parametrize("field", ["metadata_server", "local_hostname", "bind_address"])
def test_an_address_with_whitespace_is_refused(field: str) -> None:
    problems = problems_of(**{field: "10.0.0.7 "})
    assert list(problems) == [field] and "whitespace" in problems[field]


def test_bind_address_may_be_empty_but_not_blank() -> None:
    assert ConnectorSettings.parse({**BASE, "bind_address": ""}).tcp_bind_address == "127.0.0.1"
    assert list(problems_of(bind_address="  ")) == ["bind_address"]
    settings = ConnectorSettings.parse(
        {**BASE, "metadata_server": "etcd://10.0.0.2:2379", "local_hostname": "10.0.0.7"}
    )
    assert settings.mooncake_config()["metadata_server"] == "etcd://10.0.0.2:2379"
