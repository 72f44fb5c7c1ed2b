"""Bad input, fuzzed: connector settings, MOONCAKE_CONFIG_PATH files, KV layouts, MooncakeKVPool specs.

Every input is either accepted, and then usable (it renders, round-trips, fits what the
next component takes), or rejected with a message naming the offending field; never
another exception, never a hang (each example runs under a time limit), never a change
half made (parsing is pure; an invalid pool plan has no objects to apply).

Hypothesis runs derandomized (the same examples each run, so CI stays stable); set
``KVPOOL_FUZZ_EXAMPLES=N`` to explore N random examples per property instead.

Sizes stay below 2**61 bytes, other numbers within int32, and quantities' exponents below 10 in
the strategies, and JSON nests at most a few levels; the inputs beyond those bounds (overlong
sizes, sizes past 2**63, deep JSON, absurd quantities, replicas past int32) have their own
tests at the end.
"""

from __future__ import annotations

import json
import os
import string
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from kvpool.connector.contract.layout import GroupKind, KVLayout, check, check_or_raise, fingerprint
from kvpool.connector.contract.settings import CONFIG_PATH_ENV, ConnectorSettings, SettingsError
from kvpool.operator.plan import build_plan
from kvpool.operator.spec import PoolSpec
from kvpool.operator.validation import admission_problems, validate
from testing.operator_objects import pool_manifest, pool_spec

pytestmark = [pytest.mark.faults, pytest.mark.timeout(120)]

_EXAMPLES = int(os.environ.get("KVPOOL_FUZZ_EXAMPLES", "0"))
FUZZ = settings(
    max_examples=_EXAMPLES or 100,
    derandomize=not _EXAMPLES,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
EXAMPLE_LIMIT_S = 5.0  # "never a hang": one example's parse/validate/build
INT32_MAX = 2**31 - 1
UINT64_MAX = 2**64 - 1
SETTINGS_FIELDS = set(ConnectorSettings.model_fields)


class Clock:
    def __enter__(self) -> Clock:
        self.started = time.monotonic()
        return self

    def __exit__(self, *exc: object) -> None:
        elapsed = time.monotonic() - self.started
        assert elapsed < EXAMPLE_LIMIT_S, f"one input took {elapsed:.1f}s"


# --- strategies ----------------------------------------------------------------------------

numbers = st.one_of(
    st.integers(min_value=-(2**31), max_value=2**31 - 1),
    st.floats(min_value=-(2.0**31), max_value=2.0**31 - 1),
    st.sampled_from([float("nan"), float("inf"), float("-inf")]),
)
size_strings = st.builds(
    lambda n, frac, space, unit: f"{n}{frac}{space}{unit}",
    st.integers(min_value=0, max_value=10**6).map(str),
    st.sampled_from(["", ".5", ".0", ".25"]),
    st.sampled_from(["", " "]),
    st.sampled_from(["", "B", "KB", "kib", "MB", "MiB", "GB", "gib", "TB", "XB", "GiB ", "bytes", "e3"]),
)
texts = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=24)
scalars = st.one_of(st.none(), st.booleans(), numbers, texts, size_strings)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=6,
)
addresses = st.one_of(
    st.sampled_from(["127.0.0.1:50051", "etcd://127.0.0.1:2379", "mooncake-master.ns.svc:50051"]),
    texts,
    json_values,
)
FIELD_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "master_server_address": addresses,
    "metadata_server": st.one_of(st.just("P2PHANDSHAKE"), texts),
    "protocol": st.one_of(st.sampled_from(["tcp", "rdma", "TCP", ""]), json_values),
    "device_name": st.one_of(st.sampled_from(["", "mlx5_0"]), json_values),
    "local_hostname": st.one_of(st.just("127.0.0.1"), texts),
    "bind_address": st.one_of(st.sampled_from(["", "127.0.0.1"]), texts),
    "global_segment_size": st.one_of(size_strings, numbers, json_values),
    "local_buffer_size": st.one_of(size_strings, numbers, json_values),
    "cache_prefix": st.one_of(st.from_regex(r"[A-Za-z0-9_.-]{1,70}", fullmatch=True), texts),
    "save_decode_cache": st.one_of(st.booleans(), json_values),
    "batch_size": st.one_of(st.integers(-5, 2000), json_values),
    "model_id": st.one_of(texts, json_values),
    "lookup_timeout_s": st.one_of(numbers, json_values),
    "load_timeout_s": st.one_of(numbers, json_values),
    "save_timeout_s": st.one_of(numbers, json_values),
    "shutdown_timeout_s": st.one_of(numbers, json_values),
    "store_timeout_s": st.one_of(st.integers(-5, 5000), numbers, json_values),
    "staging_buffer_size": st.one_of(size_strings, numbers, json_values),
}
#: Settings whose accepted value is a number, even when given as a string.
NUMERIC = {
    "global_segment_size",
    "local_buffer_size",
    "staging_buffer_size",
    "lookup_timeout_s",
    "load_timeout_s",
    "save_timeout_s",
    "shutdown_timeout_s",
    "store_timeout_s",
}
unknown_keys = st.text(alphabet=string.ascii_letters + "_.", min_size=1, max_size=12).filter(
    lambda k: k not in SETTINGS_FIELDS
)


@st.composite
def settings_dicts(draw: st.DrawFn) -> dict[str, Any]:
    chosen = draw(st.sets(st.sampled_from(sorted(FIELD_VALUES)), max_size=len(FIELD_VALUES)))
    data = {name: draw(FIELD_VALUES[name]) for name in sorted(chosen)}
    if draw(st.booleans()):
        data.setdefault("master_server_address", "127.0.0.1:50051")
    if draw(st.integers(0, 5)) == 0:
        data[draw(unknown_keys)] = draw(json_values)
    return data


def _names_a_field(field: str, given: dict[str, Any], extra: set[str] = frozenset()) -> bool:
    top = field.split(".")[0]
    # An unknown setting with an empty name can only be reported as "settings".
    unnamed = field == "settings" and "" in given
    return field in given or top in SETTINGS_FIELDS or top in given or field in extra or unnamed


# --- connector settings ---------------------------------------------------------------------


@FUZZ
@given(data=settings_dicts())
@example(data={"master_server_address": "a:1", "global_segment_size": "512KB"})
@example(data={"master_server_address": "a:1", "protocol": "rdma"})
@example(data={"master_server_address": " ", "batch_size": 0})
@example(data={})
def test_settings_are_accepted_or_rejected_naming_the_field(data: dict[str, Any]) -> None:
    with Clock():
        try:
            accepted = ConnectorSettings.parse(data)
        except SettingsError as exc:
            assert exc.problems
            for field, message in exc.problems.items():
                assert _names_a_field(field, data), f"{field!r} names no field of {sorted(data)}"
                assert message and f"{field}: " in str(exc)
            return
    # Accepted: usable as given, and it round-trips through every rendering.
    for name, value in data.items():
        if name not in NUMERIC and isinstance(value, str):
            assert getattr(accepted, name) == value
    assert ConnectorSettings.parse(accepted.extra_config()) == accepted
    assert (
        json.loads(accepted.kv_transfer_config_json())["kv_connector_extra_config"] == accepted.extra_config()
    )
    config = accepted.mooncake_config()
    assert 0 <= config["global_segment_size"] <= UINT64_MAX and 0 <= config["local_buffer_size"] <= UINT64_MAX
    assert 1 <= accepted.batch_size <= 1000
    assert 0 < accepted.load_timeout_s <= 30 and 0 < accepted.save_timeout_s <= 30
    assert accepted.staging_buffer_size >= 1 << 20 and accepted.store_timeout_s >= 1


# --- MOONCAKE_CONFIG_PATH files ----------------------------------------------------------------

file_bodies = st.one_of(
    st.binary(max_size=64),
    texts,
    json_values.map(json.dumps),
    settings_dicts().map(json.dumps),
    st.just("[" * 10 + "]" * 10),
)


@FUZZ
@given(body=file_bodies, extra=st.one_of(st.none(), settings_dicts()))
@example(body=b"\xff\xfe not utf-8", extra=None)
@example(body='{"master_server_address": "a:1", "batch_size": 7}', extra={"batch_size": 9})
@example(body='{"master_server_address": NaN}', extra={})
@example(body="null", extra=None)
def test_config_files_are_accepted_or_rejected_naming_the_field(body: bytes | str, extra: Any) -> None:
    with tempfile.TemporaryDirectory(prefix="kvpool-fuzz-") as tmp:
        path = Path(tmp) / "mooncake.json"
        path.write_bytes(body if isinstance(body, bytes) else body.encode())
        environ = {CONFIG_PATH_ENV: str(path)}
        with Clock():
            try:
                accepted = ConnectorSettings.from_sources(extra, environ)
            except SettingsError as exc:
                try:
                    from_file = json.loads(body)
                except (ValueError, UnicodeDecodeError):
                    from_file = {}
                given = {**(from_file if isinstance(from_file, dict) else {}), **(extra or {})}
                for field in exc.problems:
                    assert _names_a_field(field, given, {CONFIG_PATH_ENV, "kv_connector_extra_config"}), field
                return
        # Accepted: the extra config wins field by field over the file.
        for name, value in (extra or {}).items():
            if name in ("master_server_address", "cache_prefix", "model_id", "metadata_server"):
                assert getattr(accepted, name) == value
        assert environ == {CONFIG_PATH_ENV: str(path)}, "the environment is left alone"


@pytest.mark.parametrize("kind", ["missing", "directory"])
def test_config_path_that_is_no_file_is_named(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "nothing.json"
    if kind == "directory":
        path.mkdir()
    with pytest.raises(SettingsError) as raised:
        ConnectorSettings.from_sources({}, {CONFIG_PATH_ENV: str(path)})
    assert set(raised.value.problems) == {CONFIG_PATH_ENV}


# --- KV layouts ---------------------------------------------------------------------------------

ints = st.one_of(st.integers(-4, 4100), st.sampled_from([16, 32, 64, 128, 4096]), json_values)
groups = st.fixed_dictionaries(
    {"kind": st.one_of(st.sampled_from([k.value for k in GroupKind]), json_values)},
    optional={
        "block_size": ints,
        "sliding_window": st.one_of(st.none(), ints),
        "attention_chunk_size": st.one_of(st.none(), ints),
        "mamba_cache_mode": st.one_of(st.sampled_from(["none", "align", "all", None]), json_values),
        "num_layers": ints,
        "page_size_bytes": st.one_of(st.none(), ints),
        "prefix_cacheable": st.one_of(st.booleans(), json_values),
        "eagle": st.booleans(),
        "window": json_values,  # not a field
    },
)
layouts = st.fixed_dictionaries(
    {"groups": st.one_of(st.lists(groups, max_size=4), json_values)},
    optional={
        "model": texts,
        "dtype": st.one_of(st.sampled_from(["auto", "bfloat16", "fp8"]), json_values),
        "hash_block_size": st.one_of(st.none(), ints),
        "cache_block_size": st.one_of(st.none(), ints),
        "tp_size": ints,
        "pp_size": ints,
        "pcp_size": ints,
        "dcp_size": ints,
    },
)


def _resolve(obj: Any, field: str) -> Any:
    """Follow ``groups[1].kind`` through a layout; AttributeError/IndexError if it names nothing."""
    for part in field.replace("]", "").replace("[", ".").split("."):
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
    return obj


@FUZZ
@given(raw=layouts)
@example(raw={"groups": [{"kind": "cross", "block_size": 16}, {"kind": "mamba", "block_size": 8}]})
@example(raw={"groups": [{"kind": "full", "block_size": 16}], "dcp_size": 2, "hash_block_size": 32})
def test_layouts_are_accepted_or_rejected_naming_the_field(raw: dict[str, Any]) -> None:
    with Clock():
        try:
            layout = KVLayout.model_validate(raw)
        except ValidationError as exc:
            for error in exc.errors():
                assert error["loc"] and str(error["loc"][0]) in raw, error
            return
        problems = check(layout)
    for problem in problems:
        _resolve(layout, problem.field)  # names a real field of this layout
        assert problem.rule and problem.message
    if problems:
        with pytest.raises(ValueError) as raised:
            check_or_raise(layout)
        assert all(problem.field in str(raised.value) for problem in problems)
    else:
        check_or_raise(layout)
    again = KVLayout.model_validate(layout.model_dump(mode="json"))
    assert fingerprint(again) == fingerprint(layout) and check(again) == problems


# --- MooncakeKVPool specs -------------------------------------------------------------------

quantities = st.one_of(
    st.from_regex(r"[0-9]{1,6}(\.[0-9]{1,2})?(e[0-9])?(Ki|Mi|Gi|Ti|k|M|G|m|)", fullmatch=True),
    st.integers(0, 10**12),
    texts,
)
SPEC_PATHS: dict[tuple[str, ...], st.SearchStrategy[Any]] = {
    ("image",): st.one_of(st.just(""), texts),
    ("imagePullPolicy",): st.one_of(st.sampled_from(["Always", "Never", "sometimes"]), json_values),
    ("master", "replicas"): st.one_of(st.integers(-1, 5), json_values),
    ("master", "ha"): st.fixed_dictionaries(
        {}, optional={"enabled": st.booleans(), "etcdEndpoints": st.lists(texts, max_size=2)}
    ),
    ("master", "rpcPort"): st.one_of(st.integers(-1, 70000), json_values),
    ("master", "metricsPort"): st.one_of(st.sampled_from([50051, 9003]), st.integers(-1, 70000)),
    ("master", "evictionRatio"): st.one_of(st.floats(-1, 2), json_values),
    ("master", "leaseTtlMs"): st.one_of(st.integers(-1, 10**9), json_values),
    ("master", "extraArgs"): st.one_of(st.lists(texts, max_size=2), json_values),
    ("master", "resources"): st.fixed_dictionaries(
        {}, optional={"limits": st.dictionaries(texts, quantities)}
    ),
    ("store", "mode"): st.one_of(st.sampled_from(["standalone", "embedded", "remote"]), json_values),
    ("store", "replicas"): st.one_of(st.integers(-1, 5), json_values),
    ("store", "segmentSize"): st.one_of(size_strings, st.integers(-1, 10**13), json_values),
    ("store", "protocol"): st.sampled_from(["tcp", "rdma", "udp"]),
    ("store", "rdmaDevices"): st.one_of(st.lists(texts, max_size=2), json_values),
    ("store", "resources"): st.fixed_dictionaries(
        {}, optional={"limits": st.dictionaries(st.sampled_from(["memory", "cpu"]), quantities)}
    ),
    ("connector",): st.one_of(settings_dicts(), json_values),
    ("connector", "cache_prefix"): FIELD_VALUES["cache_prefix"],
    ("connector", "batch_size"): FIELD_VALUES["batch_size"],
    ("consumers",): st.one_of(st.lists(json_values, max_size=2), json_values),
    ("consumers", 0, "name"): st.one_of(st.sampled_from(["llm", "LLM", "-x", "a" * 260]), texts),
    ("consumers", 0, "kvRole"): st.sampled_from(["kv_both", "kv_consumer", "kv_sender"]),
    ("consumers", 0, "layout"): st.one_of(layouts, json_values),
    ("networkPolicy",): st.fixed_dictionaries(
        {}, optional={"enabled": st.booleans(), "metricsFrom": st.lists(json_values, max_size=2)}
    ),
    ("unknownField",): json_values,
}


def _put(spec: dict[str, Any], path: tuple[Any, ...], value: Any) -> None:
    node: Any = spec
    for part in path[:-1]:
        if isinstance(part, int):
            if not isinstance(node, list) or len(node) <= part:
                return
            node = node[part]
        else:
            if not isinstance(node, dict):
                return
            node = node.setdefault(part, {})
    if isinstance(node, dict):
        node[path[-1]] = value


@st.composite
def pool_specs(draw: st.DrawFn) -> dict[str, Any]:
    spec = pool_spec()
    paths = draw(st.lists(st.sampled_from(list(SPEC_PATHS)), max_size=4, unique=True))
    for path in paths:
        _put(spec, path, draw(SPEC_PATHS[path]))
    return spec


def _fields_of(raw: dict[str, Any]) -> set[str]:
    return (
        set(raw) | set(PoolSpec.model_fields) | {f.alias for f in PoolSpec.model_fields.values() if f.alias}
    )


@FUZZ
@given(raw=pool_specs(), name=st.sampled_from(["pool", "p" * 54, "p" * 60]))
@example(raw=pool_spec(master={"replicas": 2, "ha": {"enabled": True}}), name="pool")
@example(raw=pool_spec(store={"segmentSize": "2GB", "resources": {"limits": {"memory": "1Gi"}}}), name="pool")
def test_pool_specs_are_accepted_or_rejected_naming_the_field(raw: dict[str, Any], name: str) -> None:
    with Clock():
        spec, connector, problems = validate(name, "team-a", raw)
        plan = build_plan(name, "team-a", raw)
        verdict = admission_problems(
            pool_manifest(name, raw) | {"metadata": {"name": name, "namespace": "team-a"}}
        )
    assert [str(p) for p in plan.problems] == [str(p) for p in problems]
    assert (verdict is None) == (not problems)
    if problems:
        # Rejected: every field named, and nothing to apply.
        top_fields = _fields_of(raw) | {"connector"}
        for problem in problems:
            assert problem.field == "metadata.name" or problem.field.startswith("spec."), problem
            if problem.field.startswith("spec."):
                top = problem.field.split(".")[1].split("[")[0]
                assert top in top_fields, problem
            assert problem.field in verdict
        assert plan.children == [] and plan.consumers == []
        return
    # Accepted: a plan whose objects a real API server would take.
    assert spec is not None and connector is not None and plan.children
    for child in plan.children:
        assert len(child["metadata"]["name"]) <= 63
        if child["kind"] == "Deployment":
            assert 0 <= child["spec"]["replicas"] <= INT32_MAX
            for container in child["spec"]["template"]["spec"]["containers"]:
                assert all(1 <= p["containerPort"] <= 65535 for p in container.get("ports", []))
    assert build_plan(name, "team-a", raw) == plan, "the plan is a pure function of the spec"


# --- known bugs beyond the strategies' bounds ---------------------------------------------------


@pytest.mark.parametrize("size", ["9" * 400, "1" * 300 + "TB"])
def test_an_overlong_size_is_rejected_naming_the_field(size: str) -> None:
    with pytest.raises(SettingsError) as raised:
        ConnectorSettings.parse({"master_server_address": "a:1", "global_segment_size": size})
    assert "global_segment_size" in raised.value.problems


@pytest.mark.parametrize("size", [2**64, "17179869184GB"])
def test_a_size_beyond_uint64_is_rejected_naming_the_field(size: int | str) -> None:
    with pytest.raises(SettingsError) as raised:
        ConnectorSettings.parse({"master_server_address": "a:1", "global_segment_size": size})
    assert "global_segment_size" in raised.value.problems


def test_a_deeply_nested_config_file_is_rejected_naming_the_path(tmp_path: Path) -> None:
    path = tmp_path / "mooncake.json"
    path.write_text("[" * 100_000)
    with pytest.raises(SettingsError) as raised:
        ConnectorSettings.from_sources({}, {CONFIG_PATH_ENV: str(path)})
    assert set(raised.value.problems) == {CONFIG_PATH_ENV}


@pytest.mark.parametrize("memory", ["1e999999999999", "1e300000"])
def test_an_absurd_quantity_is_rejected_quickly_naming_the_field(memory: str) -> None:
    raw = pool_spec(store={"segmentSize": "1GB", "resources": {"limits": {"memory": memory}}})
    started = time.monotonic()
    try:
        _, _, problems = validate("pool", "team-a", raw)
    finally:
        elapsed = time.monotonic() - started
    assert elapsed < 1.0, f"validation took {elapsed:.1f}s"
    assert any(p.field == "spec.store.resources.limits.memory" for p in problems)


@pytest.mark.parametrize("where", ["master", "store"])
def test_replicas_beyond_int32_are_rejected_naming_the_field(where: str) -> None:
    if where == "master":
        raw = pool_spec(master={"replicas": 2**40, "ha": {"enabled": True, "etcdEndpoints": ["etcd:2379"]}})
    else:
        raw = pool_spec(store={"replicas": 2**40, "segmentSize": "1GB"})
    _, _, problems = validate("pool", "team-a", raw)
    assert any(p.field == f"spec.{where}.replicas" for p in problems)
