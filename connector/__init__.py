"""vLLM KV connector storing hybrid-model KV blocks in a Mooncake pool.

vLLM loads it with ``kv_connector_module_path="kvpool.connector"`` and
``kv_connector="KVPoolConnector"``. Importing this package pulls in neither
vLLM nor torch: the contract (``kvpool.connector.contract``) is usable by
the operator; ``KVPoolConnector`` is imported lazily on first access.
"""

from typing import Any

from kvpool.connector.contract.layout import GroupKind, KVGroup, KVLayout, Problem, check
from kvpool.connector.contract.settings import ConnectorSettings, SettingsError

__all__ = [
    "ConnectorSettings",
    "GroupKind",
    "KVGroup",
    "KVLayout",
    "KVPoolConnector",
    "Problem",
    "SettingsError",
    "check",
]


def __getattr__(name: str) -> Any:
    if name == "KVPoolConnector":
        from kvpool.connector.connector import KVPoolConnector

        return KVPoolConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
