"""vLLM's in-tree ``MooncakeStoreConnector`` configuration, read as this connector's settings.

An existing ``MOONCAKE_CONFIG_PATH`` file written for the in-tree connector works
unchanged: the keys both share mean the same; ``mode`` and ``tenant_id`` are read
(translated to ``global_segment_size`` and ``cache_prefix``); the keys that have
no meaning here are ignored, each with one log line naming it. Keys of
``kv_connector_extra_config`` stay strict: an in-tree key there is still
rejected, and the error says what it maps to.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

from kvpool.connector.contract.sizes import parse_size

logger = logging.getLogger(__name__)

#: The in-tree default segment of ``mode: embedded`` when the file names none (4 GiB).
INTREE_EMBEDDED_SEGMENT = 4 << 30
INTREE_DEFAULT_TENANT = "default"
MODES = ("embedded", "standalone-store")
_PREFIX_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")

#: In-tree file keys with no meaning for this connector, and why.
IGNORED_FILE_KEYS: dict[str, str] = {
    "enable_offload": "the SSD tier belongs to the store processes (their own configuration); "
    "KVPoolConnector keeps blocks in the pool's memory only",
    "device_name_per_gpu": "KVPoolConnector gives every rank device_name",
}

#: In-tree ``kv_connector_extra_config`` keys, and what to do instead (for error messages).
INTREE_EXTRA_KEYS: dict[str, str] = {
    "lookup_async": "lookups are one batch_is_exist round trip with a deadline (lookup_timeout_s)",
    "enable_lookup": "set kv_role to kv_producer to store without looking up",
    "custom_mem_pool": "not needed: blocks move through a registered staging buffer",
    "preferred_segment": "the master places objects; nothing to set",
    "enable_group_semantics": "hybrid groups are always handled; nothing to set",
    "enable_cross_layers_blocks": "a block is stored whole per group; nothing to set",
    "enable_store_tp_lcm": "each tensor shard is stored once (ranks holding copies share it); nothing to set",
    "prefill_tp_sizes": "each tensor shard is stored once (ranks holding copies share it); nothing to set",
    "store_tp_size": "each tensor shard is stored once (ranks holding copies share it); nothing to set",
    "lookup_rpc_port": "the scheduler asks the master itself; no lookup server to place",
    "load_async": "every load is asynchronous (vLLM caches a loaded block only once its load "
    "succeeded); nothing to set",
}


class IntreeConfigError(ValueError):
    """An in-tree key with a value this connector cannot honour; ``problems`` maps key to message."""

    def __init__(self, problems: Mapping[str, str]):
        self.problems = dict(problems)
        super().__init__("; ".join(f"{k}: {v}" for k, v in self.problems.items()))


def from_config_file(data: Mapping[str, Any], source: str) -> dict[str, Any]:
    """Settings from a Mooncake config file (``source`` names it in log lines).

    In-tree keys are translated or dropped, each with one log line; every other key
    is passed on as it is (the settings model rejects unknown ones).
    """
    out = dict(data)
    problems: dict[str, str] = {}
    for key, why in IGNORED_FILE_KEYS.items():
        if key in out:
            out.pop(key)
            logger.info("%s: in-tree setting %s ignored: %s", source, key, why)
    if "mode" in out:
        _read_mode(out, source, problems)
    if "tenant_id" in out:
        _read_tenant(out, source, problems)
    if problems:
        raise IntreeConfigError(problems)
    return out


def _read_mode(out: dict[str, Any], source: str, problems: dict[str, str]) -> None:
    mode = out.pop("mode")
    if mode not in MODES:
        problems["mode"] = f"{mode!r} is not an in-tree mode ({' or '.join(MODES)})"
        return
    given = out.get("global_segment_size")
    try:
        # The size as the settings read it: "0GB" is 0 bytes, as 0 and "0" are.
        segment = None if given is None else parse_size(given)
    except ValueError as exc:
        problems["global_segment_size"] = str(exc)
        return
    if mode == "standalone-store":
        if segment not in (None, 0):
            problems["mode"] = (
                "'standalone-store' needs global_segment_size 0 (the store processes hold the memory)"
            )
            return
        out["global_segment_size"] = 0
        logger.info("%s: in-tree setting mode=standalone-store read: global_segment_size 0", source)
        return
    if segment is None:
        out["global_segment_size"] = INTREE_EMBEDDED_SEGMENT
        logger.info(
            "%s: in-tree setting mode=embedded read: no global_segment_size, so each vLLM process "
            "contributes 4 GiB, as the in-tree connector did",
            source,
        )
        return
    if segment == 0:
        problems["mode"] = "'embedded' needs a global_segment_size above 0 (each vLLM process contributes it)"
        return
    logger.info("%s: in-tree setting mode=embedded read: global_segment_size as given", source)


def _read_tenant(out: dict[str, Any], source: str, problems: dict[str, str]) -> None:
    tenant = out.pop("tenant_id")
    name = tenant.strip() if isinstance(tenant, str) else tenant
    if name in (None, "", INTREE_DEFAULT_TENANT):
        logger.info("%s: in-tree setting tenant_id ignored: the default tenant needs nothing", source)
        return
    if not isinstance(name, str) or not _PREFIX_RE.fullmatch(name):
        problems["tenant_id"] = (
            f"{str(tenant)[:40]!r} cannot name a key namespace: 1-64 of letters, digits, '_', '.', '-'"
        )
        return
    if "cache_prefix" in out:
        logger.info(
            "%s: in-tree setting tenant_id ignored: cache_prefix %r keeps this tenant's keys apart",
            source,
            out["cache_prefix"],
        )
        return
    out["cache_prefix"] = name
    logger.info(
        "%s: in-tree setting tenant_id read: cache_prefix %r keeps this tenant's keys apart", source, name
    )


def explain(problems: Mapping[str, str]) -> dict[str, str]:
    """``problems`` with each rejected in-tree key of ``kv_connector_extra_config`` explained."""
    out = dict(problems)
    for key, message in problems.items():
        if key in INTREE_EXTRA_KEYS:
            out[key] = f"{message} (an in-tree MooncakeStoreConnector setting: {INTREE_EXTRA_KEYS[key]})"
    return out
