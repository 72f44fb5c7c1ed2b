"""The contract: layout rules, settings validation, rendering, fingerprints."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvpool.connector.contract import mooncake_env
from kvpool.connector.contract.layout import GroupKind, KVGroup, KVLayout, check, check_or_raise, fingerprint
from kvpool.connector.contract.settings import ConnectorSettings, SettingsError, parse_size

FULL = KVGroup(kind=GroupKind.FULL, block_size=32)
SWA = KVGroup(kind=GroupKind.SLIDING_WINDOW, block_size=32, sliding_window=128)


def rules(layout: KVLayout) -> dict[str, str]:
    return {p.rule: p.field for p in check(layout)}


def test_serveable_hybrid_layout_has_no_problems() -> None:
    mamba = KVGroup(kind=GroupKind.MAMBA, block_size=32, mamba_cache_mode="align")
    assert check(KVLayout(groups=[FULL, SWA, mamba], cache_block_size=32)) == []


def test_cross_attention_rejected_naming_the_group() -> None:
    cross = KVGroup(kind=GroupKind.CROSS, block_size=32)
    problems = check(KVLayout(groups=[FULL, cross]))
    assert [(p.field, p.rule) for p in problems] == [("groups[1].kind", "cross-attention")]
    assert "group 1" in problems[0].message and "cross attention" in problems[0].message


@pytest.mark.parametrize("mode", ["none", "all", None])
def test_mamba_only_in_align_mode(mode) -> None:
    mamba = KVGroup(kind=GroupKind.MAMBA, block_size=32, mamba_cache_mode=mode)
    assert rules(KVLayout(groups=[FULL, mamba])) == {"mamba-align": "groups[1].mamba_cache_mode"}


def test_mamba_block_size_must_equal_cache_block_size() -> None:
    mamba = KVGroup(kind=GroupKind.MAMBA, block_size=64, mamba_cache_mode="align")
    layout = KVLayout(groups=[FULL, mamba], cache_block_size=32)
    assert rules(layout) == {"mamba-block-size": "groups[1].block_size"}


def test_hybrid_with_decode_context_parallel_rejected() -> None:
    assert rules(KVLayout(groups=[FULL, SWA], dcp_size=2)) == {"hybrid-context-parallel": "dcp_size"}
    # A single group may shard its KV over decode context parallel ranks: they are
    # tensor ranks, which every key names.
    assert check(KVLayout(groups=[FULL], dcp_size=2)) == []


@pytest.mark.parametrize("groups", [[FULL], [FULL, SWA]])
def test_prefill_context_parallel_rejected(groups) -> None:
    """PCP ranks are not tensor ranks: two of them would write one key with other tokens."""
    problems = check(KVLayout(groups=groups, pcp_size=2))
    assert [(p.field, p.rule) for p in problems] == [("pcp_size", "prefill-context-parallel")]
    assert "pcp_size=2" in problems[0].message


def test_no_prefix_cacheable_group_rejected() -> None:
    scratch = KVGroup(kind=GroupKind.FULL, block_size=32, prefix_cacheable=False)
    assert rules(KVLayout(groups=[scratch])) == {"no-cacheable-group": "groups"}


def test_block_size_must_divide_by_hash_block_size() -> None:
    odd = KVGroup(kind=GroupKind.FULL, block_size=48)
    layout = KVLayout(groups=[odd, SWA], hash_block_size=32)
    assert rules(layout) == {"hash-block-divisible": "groups[0].block_size"}


def test_every_problem_listed_in_one_error() -> None:
    cross = KVGroup(kind=GroupKind.CROSS, block_size=32)
    mamba = KVGroup(kind=GroupKind.MAMBA, block_size=32, mamba_cache_mode="none")
    with pytest.raises(ValueError) as err:
        check_or_raise(KVLayout(groups=[cross, mamba], dcp_size=4))
    text = str(err.value)
    for needle in ("groups[0].kind", "groups[1].mamba_cache_mode", "dcp_size"):
        assert needle in text


def test_fingerprint_separates_incompatible_layouts() -> None:
    base = KVLayout(model="m", dtype="bfloat16", groups=[FULL, SWA])
    assert fingerprint(base) == fingerprint(KVLayout(model="m", dtype="bfloat16", groups=[FULL, SWA]))
    variants = [
        base.model_copy(update={"model": "other"}),
        base.model_copy(update={"dtype": "float32"}),
        base.model_copy(update={"tp_size": 2}),
        base.model_copy(update={"groups": [FULL, SWA.model_copy(update={"sliding_window": 256})]}),
        base.model_copy(update={"groups": [SWA, FULL]}),
    ]
    prints = {fingerprint(v) for v in variants}
    assert fingerprint(base) not in prints and len(prints) == len(variants)


def test_contract_imports_neither_vllm_nor_torch() -> None:
    code = (
        "import sys, kvpool.connector, kvpool.connector.contract.layout, kvpool.connector.contract.settings;"
        "print('vllm' in sys.modules or 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# --- settings -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [("4GB", 4 << 30), ("512 MiB", 512 << 20), ("1024", 1024), (2048, 2048), ("1.5g", 3 << 29)],
)
def test_sizes(text, expected) -> None:
    assert parse_size(text) == expected


def test_bad_settings_name_every_field() -> None:
    with pytest.raises(SettingsError) as err:
        ConnectorSettings.parse(
            {
                "master_server_address": "",
                "global_segment_size": "4XB",
                "batch_size": 5000,
                "protocol": "udp",
                "cache_prefix": "has space",
                "bogus": 1,
            }
        )
    assert set(err.value.problems) == {
        "master_server_address",
        "global_segment_size",
        "batch_size",
        "protocol",
        "cache_prefix",
        "bogus",
    }
    assert err.value.problems["bogus"] == "unknown setting"


def test_rdma_needs_a_device() -> None:
    with pytest.raises(SettingsError) as err:
        ConnectorSettings.parse({"master_server_address": "m:1", "protocol": "rdma"})
    assert list(err.value.problems) == ["device_name"]


def test_the_client_binds_where_it_serves_unless_told() -> None:
    settings = ConnectorSettings.parse({"master_server_address": "m:1", "local_hostname": "10.0.0.7"})
    assert settings.tcp_bind_address == "10.0.0.7"
    bound = ConnectorSettings.parse({**settings.extra_config(), "bind_address": "127.0.0.1"})
    assert bound.tcp_bind_address == "127.0.0.1"
    assert bound.extra_config()["bind_address"] == "127.0.0.1"


def test_a_client_process_gets_the_mooncake_environment() -> None:
    environ = {mooncake_env.SETUP_RETRIES: "9", mooncake_env.TCP_BIND_ADDRESS: "0.0.0.0"}
    mooncake_env.configure_client_process("127.0.0.1", environ)
    assert environ == {"MC_STORE_CLIENT_SETUP_RETRIES": "9", "MC_TCP_BIND_ADDRESS": "127.0.0.1"}
    fresh: dict[str, str] = {}
    mooncake_env.configure_client_process("127.0.0.1", fresh)
    assert fresh == mooncake_env.client_env("127.0.0.1")
    assert fresh == {"MC_STORE_CLIENT_SETUP_RETRIES": "3", "MC_TCP_BIND_ADDRESS": "127.0.0.1"}
    timed: dict[str, str] = {}
    mooncake_env.configure_client_process("127.0.0.1", timed, store_timeout_s=7)
    assert timed["MC_RPC_TIMEOUT_MS"] == "7000"
    assert timed["MC_TCP_PROGRESS_TIMEOUT_SEC"] == timed["MC_TCP_STATUS_TIMEOUT_SEC"] == "7"
    clustered: dict[str, str] = {}
    mooncake_env.configure_client_process("127.0.0.1", clustered, cluster_id="team-a.pool")
    assert clustered["MC_STORE_CLUSTER_ID"] == "team-a.pool"
    assert mooncake_env.client_env("127.0.0.1", "team-a.pool") == clustered


@pytest.mark.parametrize("cluster_id", ["team a", "a/b", "x" * 129, "pool\n"])
def test_a_cluster_id_names_an_etcd_key_or_is_refused(cluster_id: str) -> None:
    with pytest.raises(SettingsError, match="cluster_id"):
        ConnectorSettings.parse({"master_server_address": "etcd://e:2379", "cluster_id": cluster_id})
    ok = ConnectorSettings.parse({"master_server_address": "etcd://e:2379", "cluster_id": "team-a.pool_1"})
    assert ok.cluster_id == "team-a.pool_1"


def test_extra_config_overrides_config_file(tmp_path) -> None:
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps({"master_server_address": "file:1", "global_segment_size": "1GB"}))
    settings = ConnectorSettings.from_sources(
        {"master_server_address": "extra:2"}, {"MOONCAKE_CONFIG_PATH": str(path)}
    )
    assert settings.master_server_address == "extra:2"
    assert settings.global_segment_size == 1 << 30


@pytest.mark.parametrize("content", ["{not json", "[1, 2]"])
def test_broken_config_file_named(tmp_path, content) -> None:
    path = tmp_path / "mooncake.json"
    path.write_text(content)
    with pytest.raises(SettingsError) as err:
        ConnectorSettings.from_sources(None, {"MOONCAKE_CONFIG_PATH": str(path)})
    assert "MOONCAKE_CONFIG_PATH" in err.value.problems
    assert str(path) in err.value.problems["MOONCAKE_CONFIG_PATH"]


def test_missing_config_everywhere() -> None:
    with pytest.raises(SettingsError) as err:
        ConnectorSettings.from_sources(None, {})
    assert "kv_connector_extra_config" in err.value.problems


def test_render_round_trip() -> None:
    settings = ConnectorSettings.parse(
        {"master_server_address": "m:50051", "global_segment_size": "2GB", "cache_prefix": "fleet"}
    )
    rendered = settings.kv_transfer_config("kv_both")
    assert rendered["kv_connector"] == "KVPoolConnector"
    assert rendered["kv_connector_module_path"] == "kvpool.connector"
    assert rendered["kv_load_failure_policy"] == "recompute"
    again = ConnectorSettings.parse(
        json.loads(settings.kv_transfer_config_json())["kv_connector_extra_config"]
    )
    assert again == settings
    mooncake = settings.mooncake_config()
    assert mooncake["master_server_address"] == "m:50051" and mooncake["global_segment_size"] == 2 << 30
    with pytest.raises(SettingsError):
        settings.kv_transfer_config("kv_sideways")


def test_how_a_worker_moves_blocks_is_a_setting_with_todays_defaults() -> None:
    """Transfer threads, the read-ahead batch and the idle-step wait were constants tuned to a
    2-core box: settings now, with those values as defaults and bounds that name the field."""
    settings = ConnectorSettings.parse({"master_server_address": "m:1"})
    assert (settings.transfer_threads, settings.load_batch_bytes, settings.idle_step_wait_s) == (
        4,
        4 << 20,
        0.005,
    )
    tuned = ConnectorSettings.parse(
        {
            "master_server_address": "m:1",
            "transfer_threads": 16,
            "load_batch_bytes": "16MB",
            "idle_step_wait_s": 0.001,
        }
    )
    assert (tuned.transfer_threads, tuned.load_batch_bytes, tuned.idle_step_wait_s) == (16, 16 << 20, 0.001)
    with pytest.raises(SettingsError) as err:
        ConnectorSettings.parse(
            {"master_server_address": "m:1", "transfer_threads": 0, "idle_step_wait_s": 5}
        )
    assert set(err.value.problems) == {"transfer_threads", "idle_step_wait_s"}
