"""The CRD: generated from the models, printed by the CLI, structural, usable."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from kvpool.operator.cli import main
from kvpool.operator.crd import build_crd, render_crd
from kvpool.operator.generated import CRD_PATH, generated_files
from testing.operator_objects import pool_spec


def schema() -> dict[str, Any]:
    return build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def test_the_cli_prints_the_chart_file(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["crd"]) == 0
    assert capsys.readouterr().out == render_crd() == generated_files()[CRD_PATH]


def test_names_and_scope() -> None:
    spec = build_crd()["spec"]
    assert spec["group"] == "kvpool.mooncake.io"
    assert spec["scope"] == "Namespaced"
    assert spec["names"]["kind"] == "MooncakeKVPool"
    assert spec["names"]["plural"] == "mooncakekvpools"
    assert spec["names"]["shortNames"] == ["mkvp"]
    (version,) = spec["versions"]
    assert version["name"] == "v1alpha1"
    assert version["subresources"] == {"status": {}}
    assert yaml.safe_load(render_crd()) == build_crd()


def walk(node: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    nodes = [(path, node)]
    for name, sub in node.get("properties", {}).items():
        nodes += walk(sub, f"{path}.{name}")
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            nodes += walk(node[key], f"{path}[{key}]")
    return nodes


def test_the_schema_is_structural() -> None:
    for path, node in walk(schema()):
        assert "$ref" not in node and "anyOf" not in node and "allOf" not in node, path
        assert "type" in node or node.get("x-kubernetes-int-or-string"), path
        assert not ("properties" in node and "additionalProperties" in node), path
        assert "uniqueItems" not in node and "title" not in node, path
        for key in ("exclusiveMinimum", "exclusiveMaximum"):
            assert isinstance(node.get(key, True), bool), path
        if "default" in node and node.get("type") in ("object", "array"):
            pytest.fail(f"{path}: object defaults are not pruned-safe")


def test_field_names_and_contract_blocks() -> None:
    spec = schema()["properties"]["spec"]["properties"]
    assert {"image", "imagePullPolicy", "master", "store", "connector", "consumers", "networkPolicy"} <= set(
        spec
    )
    assert {
        "replicas",
        "ha",
        "rpcPort",
        "metricsPort",
        "evictionHighWatermarkRatio",
        "evictionRatio",
        "leaseTtlMs",
        "resources",
    } <= set(spec["master"]["properties"])
    assert {
        "mode",
        "replicas",
        "segmentSize",
        "protocol",
        "rdmaDevices",
        "resources",
        "nodeSelector",
        "tolerations",
    } <= set(spec["store"]["properties"])
    assert spec["store"]["properties"]["segmentSize"]["x-kubernetes-int-or-string"] is True
    # Contract blocks keep the contract's names.
    assert set(spec["connector"]["properties"]) == {
        "cache_prefix",
        "save_decode_cache",
        "batch_size",
        "local_buffer_size",
        "metadata_server",
        "transfer_threads",
        "load_batch_bytes",
        "idle_step_wait_s",
        "load_policy",
        "load_margin",
        "load_decision_min_samples",
        "allow_non_cryptographic_block_hash",
    }
    layout = spec["consumers"]["items"]["properties"]["layout"]
    assert {"groups", "tp_size", "pp_size", "pcp_size", "dcp_size"} <= set(layout["properties"])
    status = schema()["properties"]["status"]["properties"]
    assert {"observedGeneration", "phase", "conditions", "consumers"} <= set(status)


def test_a_sample_pool_validates_against_the_schema() -> None:
    # OpenAPI 3.0 schemas use draft 4's boolean exclusiveMinimum.
    jsonschema = pytest.importorskip("jsonschema")
    validator = jsonschema.Draft4Validator(schema()["properties"]["spec"])
    validator.validate(pool_spec())
    for bad in (
        pool_spec(store={"mode": "shared"}),
        pool_spec(master={"rpcPort": 70000}),
        pool_spec(consumers=[{"name": "x", "layout": {"groups": []}}]),
    ):
        with pytest.raises(jsonschema.ValidationError):
            validator.validate(bad)
