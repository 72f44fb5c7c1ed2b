"""What the scheduler-side connector tells the workers each step."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass
class GroupTransfer:
    """Blocks of one KV-cache group to move: store digests paired with block ids."""

    group_id: int
    digests: list[str] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    # Blocks the hit covers but the group's mask leaves in place (not moved).
    masked: int = 0
    # Saves only. How many of the first blocks replace whatever the pool holds under
    # their keys (re-saved after a failed load: the pool may hold a bad object there).
    replacing: int = 0

    def __len__(self) -> int:
        return len(self.block_ids)


@dataclass
class RequestLoad:
    """Load the pool's blocks of one request into its allocated blocks.

    Every load is asynchronous: the request waits (``WAITING_FOR_REMOTE_KVS``) until the
    workers report the load finished, and vLLM caches its blocks only then, and only
    those that loaded.
    """

    req_id: str
    groups: list[GroupTransfer]
    hit_tokens: int
    trace_context: dict[str, str] = field(default_factory=dict)
    # Nothing to load: vLLM allocated what the lookup did not plan. Every worker reports
    # the load failed, and the request recomputes.
    refused: bool = False

    @property
    def num_blocks(self) -> int:
        return sum(len(g) for g in self.groups)


@dataclass
class RequestSave:
    """Store newly computed blocks of one request."""

    req_id: str
    groups: list[GroupTransfer]
    trace_context: dict[str, str] = field(default_factory=dict)

    @property
    def num_blocks(self) -> int:
        return sum(len(g) for g in self.groups)


@dataclass
class PoolConnectorMetadata(KVConnectorMetadata):
    """One step's loads and saves for every worker."""

    loads: list[RequestLoad] = field(default_factory=list)
    saves: list[RequestSave] = field(default_factory=list)
    # Tokens this step's forward computes; 0: an idle step (no forward).
    forward_tokens: int = 0


def runs_no_forward(meta: object) -> bool:
    """Whether a step bound with ``meta`` runs no forward (the engine only waits, e.g. for loads)."""
    return isinstance(meta, PoolConnectorMetadata) and meta.forward_tokens == 0
