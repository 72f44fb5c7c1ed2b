"""Store keys: one key per (layout, rank, group, block prefix hash).

A key names everything that makes a block's bytes interchangeable: the cache
prefix, the layout fingerprint, the object format (the header every object
starts with, :mod:`kvpool.connector.contract.object_header`), the pipeline rank
and tensor shard that produced it, the KV-cache group, and a digest of vLLM's
chained block hash (so it stands for the whole token prefix up to the end of
the block). Keys hold no token ids.

The rank part is ``pp<pipeline rank>-tp<tensor shard>``. A group's tensor shard
is the tensor rank unless ranks hold copies of its KV (more ranks than KV heads,
MLA): then it is the KV shard every rank of it reads and its lowest rank writes
(:mod:`kvpool.connector.contract.shards`). Where each rank holds its own KV the
two are the same, so such keys read as they always did.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from kvpool.connector.contract.object_header import VERSION as HEADER_VERSION

#: The object format in every key: objects of another format never share a key.
OBJECT_FORMAT = f"h{HEADER_VERSION}"


def hash_digest(block_hash: bytes) -> str:
    """A fixed-length hex digest of one of vLLM's (possibly merged) block hashes."""
    return hashlib.blake2b(bytes(block_hash), digest_size=16).hexdigest()


@dataclass(frozen=True)
class KeySpace:
    """The key namespace of one deployment layout."""

    cache_prefix: str
    fingerprint: str

    def key(self, group: int, tp_rank: int, pp_rank: int, digest: str) -> str:
        """The key of one block; ``tp_rank`` is the group's tensor shard (see the module)."""
        rank = f"pp{pp_rank}-tp{tp_rank}"
        return f"{self.cache_prefix}/{self.fingerprint}/{OBJECT_FORMAT}/{rank}/g{group}/{digest}"

    def rank_keys(self, group: int, tp_size: int, pp_size: int, digest: str) -> list[str]:
        """Keys of every shard for one block (``tp_size``: the group's shards): a hit needs all."""
        return [prefix + digest for prefix in self.rank_prefixes(group, tp_size, pp_size)]

    def rank_prefixes(self, group: int, tp_size: int, pp_size: int) -> tuple[str, ...]:
        """Every shard's key prefix in ``group`` (``tp_size``: the group's shards): a block's key is
        a prefix plus its digest."""
        return tuple(self.key(group, tp, pp, "") for pp in range(pp_size) for tp in range(tp_size))
