"""``KVPoolConnector`` that also keeps what it observed, for reading after a run.

The connector hands its lookup and transfer records to vLLM's metrics and
keeps none. :class:`RecordingKVPoolConnector` is the same connector plus a
:class:`Recording` of every record, in order, for the life of the connector:
the demo prints it per KV-cache group. vLLM loads it by module path, as
:func:`recording_transfer_config` names it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvpool.connector.connector import KVPoolConnector
from kvpool.connector.contract.settings import ConnectorSettings
from kvpool.connector.metadata import PoolConnectorMetadata
from kvpool.connector.observability.records import LookupRecord, StatsCollector, TransferRecord


@dataclass
class Recording:
    """Every lookup (scheduler side) and transfer (worker side) record a collector took, and
    how many saves the worker was asked to make (each reports one save record, once it
    returned: after the request's finish, until the engine's shutdown drained it)."""

    lookups: list[LookupRecord] = field(default_factory=list)
    transfers: list[TransferRecord] = field(default_factory=list)
    saves_asked: int = 0

    def unreported_saves(self) -> int:
        """Saves asked for whose record has not come (yet)."""
        reported = sum(1 for t in list(self.transfers) if t.operation == "save")
        return max(0, self.saves_asked - reported)

    def tap(self, collector: StatsCollector) -> None:
        """Keep a copy of each record ``collector`` takes from now on; the collector works as before."""
        take_lookup, take_transfer = collector.record_lookup, collector.record_transfer

        def record_lookup(record: LookupRecord, request: Any = None) -> None:
            take_lookup(record, request)
            self.lookups.append(record)

        def record_transfer(record: TransferRecord) -> None:
            take_transfer(record)
            self.transfers.append(record)

        collector.record_lookup = record_lookup  # type: ignore[method-assign]
        collector.record_transfer = record_transfer  # type: ignore[method-assign]


class RecordingKVPoolConnector(KVPoolConnector):
    """``KVPoolConnector`` whose records also stay in ``recording``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.recording = Recording()
        self.recording.tap(self.stats)

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        if isinstance(meta, PoolConnectorMetadata):
            self.recording.saves_asked += len(meta.saves)
        super().wait_for_save()


def recording_transfer_config(settings: ConnectorSettings, kv_role: str = "kv_both") -> dict[str, Any]:
    """``--kv-transfer-config`` loading :class:`RecordingKVPoolConnector` against ``settings``' pool."""
    config = settings.kv_transfer_config(kv_role)
    config["kv_connector"] = RecordingKVPoolConnector.__name__
    config["kv_connector_module_path"] = __name__
    return config
