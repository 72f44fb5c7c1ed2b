"""What the scheduler-side connector tells the workers each step."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass
class SaveLineage:
    """Which blocks of one group a save's request read and wrote, for the worker's taint check.

    ``prefix`` is the request's block ids from its first block to its last (partly)
    computed one. Blocks before ``computed_from`` hold KV of earlier steps, which this
    step's forward read; blocks from ``computed_from`` on were written from their first
    token by it; blocks from ``unsaved_from`` on were written since the request's previous
    save (the steps since ``RequestSave.since_step``).
    """

    prefix: list[int] = field(default_factory=list)
    computed_from: int = 0
    unsaved_from: int = 0

    @property
    def read(self) -> list[int]:
        return self.prefix[: self.computed_from]

    @property
    def written(self) -> list[int]:
        return self.prefix[self.computed_from :]

    @property
    def unsaved(self) -> list[int]:
        return self.prefix[self.unsaved_from :]


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
    # Saves only: what the saved blocks were computed from (see ``SaveLineage``).
    lineage: SaveLineage | None = None

    def __len__(self) -> int:
        return len(self.block_ids)


@dataclass
class RequestLoad:
    """Load the pool's blocks of one request into its allocated blocks."""

    req_id: str
    groups: list[GroupTransfer]
    hit_tokens: int
    is_async: bool
    trace_context: dict[str, str] = field(default_factory=dict)

    @property
    def num_blocks(self) -> int:
        return sum(len(g) for g in self.groups)


@dataclass
class RequestSave:
    """Store newly computed blocks of one request."""

    req_id: str
    groups: list[GroupTransfer]
    trace_context: dict[str, str] = field(default_factory=dict)
    # The step of the request's previous save (or of its first): the saved blocks were
    # computed in the steps from there to this one.
    since_step: int = 0

    @property
    def num_blocks(self) -> int:
        return sum(len(g) for g in self.groups)


@dataclass
class PoolConnectorMetadata(KVConnectorMetadata):
    """One step's loads and saves for every worker."""

    loads: list[RequestLoad] = field(default_factory=list)
    saves: list[RequestSave] = field(default_factory=list)
    # The scheduler's step number (one per metadata, in order).
    step: int = 0
    # Per group: blocks newly allocated this step, which hold nothing of earlier steps.
    new_blocks: list[list[int]] = field(default_factory=list)
    # Tokens this step's forward computes; 0: an idle step (no forward).
    forward_tokens: int = 0
