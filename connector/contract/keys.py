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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvpool.connector.contract.object_header import VERSION as HEADER_VERSION

#: The object format in every key: objects of another format never share a key.
OBJECT_FORMAT = f"h{HEADER_VERSION}"


#: Longest block hash a key names as it is; longer (merged) ones are hashed down to this.
DIGEST_BYTES = 32


def hash_digest(block_hash: bytes) -> str:
    """A hex digest of one of vLLM's (possibly merged) block hashes, at most 64 characters.

    vLLM's block hash is already a hash of the token prefix (32 bytes with its default
    SHA-256), so a hash that short is named by its own hex: a key costs no hashing of its
    own (BLAKE2b cost ~0.5 µs a block, on every lookup and save plan). A merged hash (a
    group whose blocks span several hash blocks) is longer and is named by its BLAKE2b-256.
    Within one key space every group's hashes have one length, so the two never meet.
    """
    raw = block_hash if type(block_hash) is bytes else bytes(block_hash)
    if len(raw) <= DIGEST_BYTES:
        return raw.hex()
    return hashlib.blake2b(raw, digest_size=DIGEST_BYTES).hexdigest()


def hash_digests(block_hashes: Sequence[bytes], indices: Iterable[int]) -> list[str]:
    """:func:`hash_digest` of ``block_hashes[i]`` for each of ``indices`` (bytes hashes;
    a lookup's thousands of keys, without a call per block)."""
    return [
        block_hash.hex() if len(block_hash) <= DIGEST_BYTES else hash_digest(block_hash)
        for block_hash in map(block_hashes.__getitem__, indices)
    ]


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
