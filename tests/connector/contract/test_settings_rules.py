"""Settings rules that pydantic's lax reading would otherwise let through: blank addresses,
booleans as numbers, fractional byte counts, a tenant with a trailing newline, and the
in-tree ``mode`` read against the segment size as it parses."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvpool.connector.contract.mooncake_env import CONFIG_PATH_ENV
from kvpool.connector.contract.settings import ConnectorSettings, SettingsError, is_tenant, parse_size
from kvpool.connector.contract.tenant_policy import policy_yaml

BASE = {"master_server_address": "m:1"}
#: Every setting read as a number (byte sizes included).
NUMERIC_FIELDS = sorted(
    name for name, info in ConnectorSettings.model_fields.items() if info.annotation in (int, float)
)


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


# --- numbers ----------------------------------------------------------------------------


def test_every_numeric_setting_is_covered() -> None:
    assert {"batch_size", "store_timeout_s", "lookup_budget_ms", "global_segment_size"} <= set(NUMERIC_FIELDS)


@pytest.mark.parametrize("field", NUMERIC_FIELDS)
@pytest.mark.parametrize("value", [True, False])
def test_a_boolean_is_not_a_number(field: str, value: bool) -> None:
    problems = problems_of(**{field: value})
    assert list(problems) == [field]
    assert str(value).lower() in problems[field]


def test_numbers_still_read_as_before() -> None:
    settings = ConnectorSettings.parse(
        {**BASE, "batch_size": 128, "store_timeout_s": 7, "lookup_budget_ms": 0, "load_margin": 1}
    )
    assert (settings.batch_size, settings.store_timeout_s, settings.lookup_budget_ms) == (128, 7, 0.0)
    assert settings.load_margin == 1.0


@pytest.mark.parametrize("text", ["0.5", "1.5", "0.3KB", "1.0000000000000000000000000000001", 0.5])
def test_a_size_that_is_not_whole_bytes_is_refused(text: object) -> None:
    with pytest.raises(ValueError, match="whole number of bytes"):
        parse_size(text)
    assert list(problems_of(load_batch_bytes=text)) == ["load_batch_bytes"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [("1.5GB", 3 << 29), ("0.5KB", 512), ("2.0", 2), ("1.25 MiB", 5 << 18), (3.0, 3)],
)
def test_a_fraction_that_makes_whole_bytes_is_taken(text: object, expected: int) -> None:
    assert parse_size(text) == expected


# --- tenant -----------------------------------------------------------------------------


@pytest.mark.parametrize("tenant", ["team-a\n", "team-a\r\n", "\nteam-a"])
def test_a_tenant_is_matched_whole(tenant: str) -> None:
    assert not is_tenant(tenant)
    assert list(problems_of(tenant=tenant)) == ["tenant"]
    with pytest.raises(ValueError, match="is not a tenant"):
        policy_yaml({tenant: 1 << 20})


def test_a_good_tenant_still_passes() -> None:
    assert is_tenant("team-a") and not is_tenant("")
    assert ConnectorSettings.parse({**BASE, "tenant": "team-a"}).tenant == "team-a"


@pytest.mark.parametrize(
    ("field", "value"), [("cache_prefix", "fleet\n"), ("declared_layout_fingerprint", "0123456789abcdef\n")]
)
def test_pattern_fields_are_matched_whole(field: str, value: str) -> None:
    assert list(problems_of(**{field: value})) == [field]


# --- in-tree mode -----------------------------------------------------------------------


def from_file(tmp_path: Path, **data: object) -> ConnectorSettings:
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps({**BASE, **data}))
    return ConnectorSettings.from_sources(None, {CONFIG_PATH_ENV: str(path)})


@pytest.mark.parametrize("zero", [0, "0", "0GB", "0 MiB", 0.0])
def test_intree_mode_reads_the_segment_as_parsed(tmp_path: Path, zero: object) -> None:
    standalone = from_file(tmp_path, mode="standalone-store", global_segment_size=zero)
    assert standalone.global_segment_size == 0
    with pytest.raises(SettingsError) as err:
        from_file(tmp_path, mode="embedded", global_segment_size=zero)
    assert list(err.value.problems) == ["mode"]


def test_intree_mode_with_a_segment(tmp_path: Path) -> None:
    embedded = from_file(tmp_path, mode="embedded", global_segment_size="64MB")
    assert embedded.global_segment_size == 64 << 20
    with pytest.raises(SettingsError) as err:
        from_file(tmp_path, mode="standalone-store", global_segment_size="64MB")
    assert list(err.value.problems) == ["mode"]


@pytest.mark.parametrize("mode", ["embedded", "standalone-store"])
@pytest.mark.parametrize("segment", ["lots", True, "0.5"])
def test_intree_mode_with_a_bad_segment_names_the_segment(tmp_path: Path, mode: str, segment: object) -> None:
    with pytest.raises(SettingsError) as err:
        from_file(tmp_path, mode=mode, global_segment_size=segment)
    assert list(err.value.problems) == ["global_segment_size"]
