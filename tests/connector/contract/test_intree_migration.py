"""Migration from vLLM's in-tree MooncakeStoreConnector: its config file works as it is.

A typical in-tree ``MOONCAKE_CONFIG_PATH`` file (as vLLM's MooncakeStoreConnector
guide writes it, sized for a test) becomes this connector's settings: shared keys
mean the same, ``mode`` and ``tenant_id`` are read, the rest are ignored with one
log line naming each. A real Mooncake client opened from those settings joins a
real pool and contributes the segment ``mode: embedded`` asks for. Unknown keys
stay errors that name them.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from kvpool.connector.contract.intree_config import INTREE_EMBEDDED_SEGMENT
from kvpool.connector.contract.mooncake_env import CONFIG_PATH_ENV
from kvpool.connector.contract.settings import ConnectorSettings, SettingsError
from testing.pool_store import put_bytes

LOGGER = "kvpool.connector.contract.intree_config"


def intree_file(tmp_path: Path, master: str, **changes: object) -> Path:
    """A typical in-tree file: embedded mode, P2P handshake, TCP, every key the in-tree reads."""
    data: dict[str, object] = {
        "mode": "embedded",
        "metadata_server": "P2PHANDSHAKE",
        "master_server_address": master,
        "global_segment_size": "64MB",
        "local_buffer_size": "16MB",
        "protocol": "tcp",
        "device_name": "",
        "enable_offload": False,
        "tenant_id": "default",
    }
    data.update(changes)
    for key in [k for k, v in data.items() if v is None]:
        del data[key]
    path = tmp_path / "mooncake_config.json"
    path.write_text(json.dumps(data))
    return path


def from_file(path: Path, extra: dict[str, object] | None = None) -> ConnectorSettings:
    return ConnectorSettings.from_sources(extra or {}, environ={CONFIG_PATH_ENV: str(path)})


def test_a_typical_intree_file_becomes_our_settings(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = intree_file(tmp_path, "10.0.0.5:50051")
    with caplog.at_level(logging.INFO, logger=LOGGER):
        settings = from_file(path)
    assert settings.master_server_address == "10.0.0.5:50051"
    assert settings.metadata_server == "P2PHANDSHAKE"
    assert settings.protocol == "tcp"
    assert settings.global_segment_size == 64 << 20
    assert settings.local_buffer_size == 16 << 20
    assert settings.cache_prefix == "kvpool"
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    # One line for each in-tree key, naming it and the file.
    for key in ("mode", "enable_offload", "tenant_id"):
        (line,) = [text for text in lines if f"in-tree setting {key}" in text]
        assert f"{CONFIG_PATH_ENV}={path}" in line
    assert len(lines) == 3


def test_mode_is_read(tmp_path: Path) -> None:
    embedded_default = from_file(intree_file(tmp_path, "m:1", global_segment_size=None))
    assert embedded_default.global_segment_size == INTREE_EMBEDDED_SEGMENT  # as the in-tree connector did
    standalone = from_file(intree_file(tmp_path, "m:1", mode="standalone-store", global_segment_size=None))
    assert standalone.global_segment_size == 0
    for bad, field in (
        ({"mode": "standalone-store"}, "mode"),  # with a 64MB segment
        ({"mode": "embedded", "global_segment_size": 0}, "mode"),
        ({"mode": "sharded"}, "mode"),
    ):
        with pytest.raises(SettingsError) as error:
            from_file(intree_file(tmp_path, "m:1", **bad))
        assert set(error.value.problems) == {field}, bad


def test_tenant_id_keeps_tenants_apart_by_cache_prefix(tmp_path: Path) -> None:
    assert from_file(intree_file(tmp_path, "m:1", tenant_id="team-a")).cache_prefix == "team-a"
    # An explicit cache_prefix (in the file, or in kv_connector_extra_config) wins.
    assert from_file(intree_file(tmp_path, "m:1", tenant_id="team-a", cache_prefix="x")).cache_prefix == "x"
    assert (
        from_file(intree_file(tmp_path, "m:1", tenant_id="team-a"), {"cache_prefix": "y"}).cache_prefix == "y"
    )
    with pytest.raises(SettingsError) as error:
        from_file(intree_file(tmp_path, "m:1", tenant_id="team a/b"))
    assert set(error.value.problems) == {"tenant_id"}


def test_unknown_keys_are_still_rejected(tmp_path: Path) -> None:
    with pytest.raises(SettingsError) as in_file:
        from_file(intree_file(tmp_path, "m:1", no_such_key=1))
    assert set(in_file.value.problems) == {"no_such_key"}
    # kv_connector_extra_config stays strict, in-tree keys included; the error says why.
    with pytest.raises(SettingsError) as in_extra:
        from_file(intree_file(tmp_path, "m:1"), {"enable_lookup": False, "bogus": 1})
    problems = in_extra.value.problems
    assert set(problems) == {"enable_lookup", "bogus"}
    assert "in-tree MooncakeStoreConnector setting" in problems["enable_lookup"]
    assert "in-tree" not in problems["bogus"]
    with pytest.raises(SettingsError) as mode_in_extra:
        ConnectorSettings.from_sources({"master_server_address": "m:1", "mode": "embedded"}, environ={})
    assert set(mode_in_extra.value.problems) == {"mode"}


@pytest.mark.mooncake
def test_a_client_from_an_intree_file_joins_a_real_pool(tmp_path: Path, local_pool, cache_prefix) -> None:
    """The file's settings open a real client that contributes its embedded segment and moves bytes."""
    from kvpool.connector.pool_client import open_client

    settings = from_file(intree_file(tmp_path, local_pool.address, tenant_id=cache_prefix))
    before = local_pool.master.capacity_bytes()
    client = open_client(settings)
    try:
        assert local_pool.master.capacity_bytes() == before + (64 << 20)
        key = f"{settings.cache_prefix}/intree-file-check"
        assert put_bytes(client, key, b"block bytes") == 0
        assert client.exists([key]) == [True]
        assert client.remove([key]) == [0]
    finally:
        client.close()


def test_load_async_is_refused_with_the_reason(tmp_path: Path) -> None:
    """``load_async: false`` asked for loads before the forward, whose failed blocks vLLM keeps
    cached: every load is asynchronous now, and the key is refused, saying why."""
    with pytest.raises(SettingsError) as error:
        ConnectorSettings.from_sources({"master_server_address": "m:1", "load_async": False}, environ={})
    assert set(error.value.problems) == {"load_async"}
    assert "every load is asynchronous" in error.value.problems["load_async"]
