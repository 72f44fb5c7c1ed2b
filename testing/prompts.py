"""The shared-prefix prompts of the real-engine tests, and the pool keys of their blocks."""

from __future__ import annotations

import random
from typing import Any

from kvpool.connector.contract.keys import KeySpace, hash_digest

BLOCK = 32
_rng = random.Random(1234)
PREFIX = [_rng.randrange(3, 500) for _ in range(300)]  # 9 whole blocks + 12 tokens
P1 = PREFIX + [_rng.randrange(3, 500) for _ in range(40)]
P2 = PREFIX + [_rng.randrange(3, 500) for _ in range(50)]
PREFIX_HIT = (len(PREFIX) // BLOCK) * BLOCK  # 288 tokens the pool can serve P2
MAX_TOKENS = 12


def hashed_request(
    prompt: list[int], hash_block: int = BLOCK, request_id: str = "keys", sampling_params: Any = None
) -> Any:
    """A vLLM ``Request`` for ``prompt``, hashed as an engine hashes it (sha256, the default)."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling_params=sampling_params or SamplingParams(max_tokens=1),
        pooling_params=None,
        block_hasher=get_request_block_hasher(hash_block, hash_fn),
    )


def block_hashes(prompt: list[int]) -> list[bytes]:
    """vLLM's block hashes for ``prompt`` (sha256, the engine default)."""
    return [bytes(h) for h in hashed_request(prompt).block_hashes]


def pool_keys(
    keyspace: KeySpace, prompt: list[int], num_groups: int, blocks: range | None = None
) -> list[str]:
    """Keys rank 0 stores for ``prompt``'s blocks in every group (all groups use 32-token blocks)."""
    hashes = block_hashes(prompt)
    chosen = range(len(hashes)) if blocks is None else blocks
    return [keyspace.key(g, 0, 0, hash_digest(hashes[i])) for g in range(num_groups) for i in chosen]
