"""Connector settings: the Mooncake store config plus the connector's own options.

Store fields carry the names of Mooncake's config JSON so an existing
``MOONCAKE_CONFIG_PATH`` file works unchanged. Settings come from vLLM's
``kv_connector_extra_config``, falling back to (and overriding) the file named by
``MOONCAKE_CONFIG_PATH``; they render back to ``--kv-transfer-config`` JSON and
to the Mooncake config file. Invalid input raises ``SettingsError`` naming
every offending field.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from kvpool.connector.contract.errors import error_message
from kvpool.connector.contract.intree_config import IntreeConfigError, explain, from_config_file
from kvpool.connector.contract.layout import KVLayout, fingerprint
from kvpool.connector.contract.mooncake_env import CONFIG_PATH_ENV
from kvpool.connector.contract.sizes import MAX_SIZE, parse_size

MAX_BATCH_KEYS = 1000
MAX_TIMEOUT_S = 3600.0
# Load and save deadlines stay below Mooncake's own 60 s limit on one transfer: the
# connector, not Mooncake, gives up on a stuck call (see worker/side.py's staging buffers).
MAX_TRANSFER_TIMEOUT_S = 30.0
CONNECTOR_NAME = "KVPoolConnector"
CONNECTOR_MODULE = "kvpool.connector"

# A tenant names a Mooncake tenant and prefixes keys: a DNS label, as a Kubernetes name
# is (Mooncake itself takes any printable string that does not start with '_').
_TENANT_RE = re.compile(r"[a-z0-9]([a-z0-9.-]{0,61}[a-z0-9])?")
TENANT_RULE = (
    "1-63 lowercase letters, digits, '.' or '-', starting and ending with a letter or digit "
    "(empty: no tenant)"
)


def is_tenant(name: str) -> bool:
    """Whether ``name`` is a tenant (the whole of it: no trailing newline slips through)."""
    return _TENANT_RE.fullmatch(name) is not None


def _not_a_bool(value: Any) -> Any:
    """Refuse ``true``/``false`` where a number is due (pydantic would read them as 1 and 0)."""
    if isinstance(value, bool):
        raise ValueError(f"{str(value).lower()} is a boolean, not a number")
    return value


def _address(value: str) -> str:
    """An address handed to Mooncake as it is: not empty, no whitespace anywhere."""
    if not value.strip():
        raise ValueError("an address cannot be empty or blank")
    if any(c.isspace() for c in value):
        raise ValueError(f"{value[:70]!r} is not an address: it holds whitespace")
    return value


def _address_or_empty(value: str) -> str:
    return _address(value) if value else value


Int = Annotated[int, BeforeValidator(_not_a_bool)]
Float = Annotated[float, BeforeValidator(_not_a_bool)]
Address = Annotated[str, AfterValidator(_address)]
AddressOrEmpty = Annotated[str, AfterValidator(_address_or_empty)]


Size = Annotated[int, BeforeValidator(parse_size), Field(ge=0, le=MAX_SIZE)]


class SettingsError(ValueError):
    """Invalid connector settings; ``problems`` maps field name to message."""

    def __init__(self, problems: Mapping[str, str]):
        self.problems = dict(problems)
        lines = "\n".join(f"  - {field}: {msg}" for field, msg in self.problems.items())
        super().__init__(f"invalid KVPoolConnector settings:\n{lines}")


#: Mooncake cluster ids name etcd keys (``mooncake-store/<id>/master_view``); empty: its default.
CLUSTER_ID_PATTERN = r"^([A-Za-z0-9_.-]{1,128})?$"


class ConnectorSettings(BaseModel):
    """Everything the connector needs to reach the pool and how to use it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Mooncake store settings, named as in Mooncake's config JSON.
    master_server_address: str = Field(
        min_length=1,
        pattern=r"\S",
        description="host:port of the Mooncake master, or etcd://host:port[,...] for HA.",
    )
    metadata_server: Address = Field(default="P2PHANDSHAKE", description="Transfer-engine metadata server.")
    protocol: Literal["tcp", "rdma"] = "tcp"
    device_name: str = Field(default="", description="RDMA device(s), required for rdma.")
    local_hostname: Address = Field(default="127.0.0.1", description="Address this client serves on.")
    bind_address: AddressOrEmpty = Field(
        default="",
        description="MC_TCP_BIND_ADDRESS of this client's process (empty: local_hostname).",
    )
    global_segment_size: Size = Field(
        default=0, description="Memory this process contributes to the pool (0 = none)."
    )
    local_buffer_size: Size = Field(default=64 << 20, description="Client-side transfer buffer.")
    cluster_id: str = Field(
        default="",
        pattern=CLUSTER_ID_PATTERN,
        description="HA pools (an etcd:// master address): the Mooncake cluster id of the pool's "
        "masters (their --cluster_id; MC_STORE_CLUSTER_ID in this client's process), which names "
        "their leader election in etcd. Pools that share an etcd need different ids. Empty: "
        "Mooncake's default.",
    )
    # Connector options.
    cache_prefix: str = Field(
        default="kvpool", pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="Namespace of every key."
    )
    tenant: str = Field(
        default="",
        description="Mooncake tenant of this consumer (empty: none). A master run with "
        "--enable_multi_tenants charges its quota for every write, refuses writes past it, and "
        "keeps its keys apart from other tenants'; its keys also start with it. Consumers that "
        "share a reuse domain declare the same tenant (docs/tenancy.md).",
    )
    save_decode_cache: bool = Field(
        default=False,
        description="Also save blocks completed while decoding (off: a request saves its prompt's blocks).",
    )
    batch_size: Int = Field(default=256, ge=1, le=MAX_BATCH_KEYS, description="Keys per Mooncake batch call.")
    model_id: str = Field(
        default="", description="Model identity for the layout fingerprint (default: vLLM's)."
    )
    # Deadlines: no wait on the pool is unbounded.
    lookup_timeout_s: Float = Field(
        default=1.0, gt=0, le=MAX_TIMEOUT_S, description="Longest a lookup waits; past it, a miss."
    )
    lookup_budget_ms: Float = Field(
        default=5.0,
        ge=0,
        le=1000,
        description="Longest one scheduler step waits for its new requests' lookups before it "
        "defers the rest a step (0: always defer; a late answer is taken the next step).",
    )
    load_timeout_s: Float = Field(
        default=5.0,
        gt=0,
        le=MAX_TRANSFER_TIMEOUT_S,
        description="Longest a load waits for its next batch; past it, the load fails and the "
        "request recomputes.",
    )
    save_timeout_s: Float = Field(
        default=5.0,
        gt=0,
        le=MAX_TRANSFER_TIMEOUT_S,
        description="Longest a save may take to publish; past it, it is abandoned and publishes nothing.",
    )
    shutdown_timeout_s: Float = Field(
        default=10.0, gt=0, le=MAX_TIMEOUT_S, description="Longest shutdown waits for saves in flight."
    )
    store_timeout_s: Int = Field(
        default=10,
        ge=1,
        le=int(MAX_TIMEOUT_S),
        description="Mooncake's RPC and TCP no-progress timeouts: how long a call to a stuck "
        "master or store can hold a transfer thread.",
    )
    staging_buffer_size: Size = Field(
        default=64 << 20,
        ge=1 << 20,
        description="Registered buffer per transfer thread that blocks move through (bytes a call).",
    )
    # How a worker moves blocks (defaults measured on a 2-core CPU node: benchmarks.transfer).
    transfer_threads: Int = Field(
        default=4,
        ge=1,
        le=64,
        description="Threads per worker moving blocks to and from the pool (each holds one staging buffer).",
    )
    load_batch_bytes: Size = Field(
        default=4 << 20,
        ge=0,
        description="Read-ahead batch of a load whose client holds a segment of the pool (0: one read "
        "a group).",
    )
    direct_local_loads: bool = Field(
        default=True,
        description="Load an object held in this client's own segment by copying it straight into "
        "the blocks, then checking its checksum there (a mismatch fails the load: recompute). Other "
        "loads move through the staging buffer.",
    )
    allow_non_cryptographic_block_hash: bool = Field(
        default=False,
        description="Let engines whose prefix_caching_hash_algo is xxhash or xxhash_cbor join the pool. "
        "Their block hashes are not collision resistant: a crafted prompt could place its KV under "
        "another prompt's key for every engine of the pool. Off: such an engine does not start.",
    )
    idle_step_wait_s: Float = Field(
        default=0.005,
        gt=0,
        le=1.0,
        description="Longest an engine step without a forward waits for pool work in flight.",
    )
    # Whether a hit loads or recomputes (scheduler/load_decision.py).
    load_policy: Literal["auto", "always", "never"] = Field(
        default="auto",
        description="auto: load a hit only when loading it is estimated faster than recomputing it; "
        "always: load every hit; never: recompute every hit (nothing is looked up).",
    )
    load_margin: Float = Field(
        default=0.1,
        ge=0,
        le=100,
        description="auto: a hit loads only when its estimated load time x (1 + margin) is at most "
        "its estimated recompute time.",
    )
    load_decision_min_samples: Int = Field(
        default=4,
        ge=1,
        le=100_000,
        description="auto: observed loads and prefilling steps each before the rates are trusted; "
        "until then every hit loads.",
    )
    # The layout the pool's spec declares for this consumer (the operator renders both):
    # any difference from the layout vLLM builds keeps the connector out of the pool.
    declared_layout: KVLayout | None = Field(
        default=None, description="The KV layout declared for this consumer (none: not checked)."
    )
    declared_layout_fingerprint: str = Field(
        default="",
        pattern=r"^([0-9a-f]{16})?$",
        description="Fingerprint of the declared KV layout (empty: not checked).",
    )

    @property
    def tcp_bind_address(self) -> str:
        """What the client process sets as ``MC_TCP_BIND_ADDRESS``: ``bind_address`` or ``local_hostname``."""
        return self.bind_address or self.local_hostname

    @field_validator("tenant")
    @classmethod
    def _tenant_rule(cls, value: str) -> str:
        if value and not is_tenant(value):
            raise ValueError(f"{value[:70]!r} is not a tenant: {TENANT_RULE}")
        return value

    @model_validator(mode="after")
    def _cross_field_rules(self) -> ConnectorSettings:
        if self.protocol == "rdma" and not self.device_name:
            raise ValueError("device_name: protocol 'rdma' needs an RDMA device name")
        if self.global_segment_size and self.global_segment_size < (1 << 20):
            raise ValueError("global_segment_size: a segment under 1 MiB cannot hold a block")
        declared, declared_print = self.declared_layout, self.declared_layout_fingerprint
        if declared is not None and declared_print and fingerprint(declared) != declared_print:
            raise ValueError(
                f"declared_layout_fingerprint: {declared_print} is not the fingerprint of "
                f"declared_layout ({fingerprint(declared)})"
            )
        return self

    @classmethod
    def parse(cls, data: Mapping[str, Any]) -> ConnectorSettings:
        """Validate ``data``; raise ``SettingsError`` naming every bad field."""
        try:
            return cls.model_validate(dict(data))
        except ValidationError as exc:
            raise SettingsError(_problems_of(exc)) from None

    @classmethod
    def from_sources(
        cls, extra_config: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None
    ) -> ConnectorSettings:
        """Settings from ``kv_connector_extra_config`` over the ``MOONCAKE_CONFIG_PATH`` file."""
        environ = os.environ if environ is None else environ
        merged: dict[str, Any] = {}
        path = environ.get(CONFIG_PATH_ENV)
        if path:
            try:
                merged.update(from_config_file(load_config_file(Path(path)), f"{CONFIG_PATH_ENV}={path}"))
            except IntreeConfigError as exc:
                raise SettingsError(exc.problems) from None
        merged.update(extra_config or {})
        if not merged:
            raise SettingsError(
                {
                    "kv_connector_extra_config": "empty, and MOONCAKE_CONFIG_PATH is not set: "
                    "at least master_server_address is needed"
                }
            )
        try:
            return cls.parse(merged)
        except SettingsError as exc:
            raise SettingsError(explain(exc.problems)) from None

    def mooncake_config(self) -> dict[str, Any]:
        """The Mooncake config file (``MOONCAKE_CONFIG_PATH``) for these settings."""
        return {
            "local_hostname": self.local_hostname,
            "metadata_server": self.metadata_server,
            "protocol": self.protocol,
            "device_name": self.device_name,
            "master_server_address": self.master_server_address,
            "global_segment_size": self.global_segment_size,
            "local_buffer_size": self.local_buffer_size,
        }

    def extra_config(self) -> dict[str, Any]:
        """All settings as ``kv_connector_extra_config`` (sizes in bytes); a layout check only when set."""
        unset = {n for n in ("declared_layout", "declared_layout_fingerprint") if not getattr(self, n)}
        return self.model_dump(mode="json", exclude=unset)

    def kv_transfer_config(self, kv_role: str = "kv_both") -> dict[str, Any]:
        """The ``--kv-transfer-config`` object vLLM takes to load this connector."""
        if kv_role not in ("kv_both", "kv_producer", "kv_consumer"):
            raise SettingsError({"kv_role": f"{kv_role!r} is not kv_both/kv_producer/kv_consumer"})
        return {
            "kv_connector": CONNECTOR_NAME,
            "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": kv_role,
            # A block the pool fails to deliver is recomputed, never an error.
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": self.extra_config(),
        }

    def kv_transfer_config_json(self, kv_role: str = "kv_both") -> str:
        return json.dumps(self.kv_transfer_config(kv_role), sort_keys=True, separators=(",", ":"))


def load_config_file(path: Path) -> dict[str, Any]:
    """Read a Mooncake config JSON file; errors name the file and the problem."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise SettingsError({CONFIG_PATH_ENV: f"{path} does not exist"}) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SettingsError({CONFIG_PATH_ENV: f"{path} cannot be read: {exc}"}) from None
    except json.JSONDecodeError as exc:
        raise SettingsError({CONFIG_PATH_ENV: f"{path} is not valid JSON: {exc}"}) from None
    except RecursionError:
        raise SettingsError({CONFIG_PATH_ENV: f"{path} nests too deeply to be a Mooncake config"}) from None
    if not isinstance(data, dict):
        raise SettingsError({CONFIG_PATH_ENV: f"{path} must hold a JSON object"})
    return data


def _problems_of(exc: ValidationError) -> dict[str, str]:
    problems: dict[str, str] = {}
    for error in exc.errors():
        field = ".".join(str(p) for p in error["loc"])
        message = error_message(error, unknown="unknown setting")
        if not field and ": " in message:
            # Cross-field rules name their field at the front of the message.
            field, message = message.split(": ", 1)
        problems[field or "settings"] = message
    return problems
