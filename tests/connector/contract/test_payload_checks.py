"""The device payload checksum (``WORD_SUMS``): its definition, and the damage it catches.

Each kind of damage the module names (torn, truncated, shifted, replaced) is made from
real-looking KV (random fp16) and must change the sums; the sums are computed with the same
torch code on CPU tensors as on an accelerator.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvpool.connector.contract.payload_checks import PRIME, ROW_WORDS, ROWS_PER_PASS, word_sums, word_sums_of

BLOCK_BYTES = 2 * 16 * 8 * 128 * 2  # K and V, 16 tokens, 8 heads, head size 128, fp16: 64 KiB


def reference(payload: bytes) -> int:
    """The module's formula, term by term (Python integers, no overflow)."""
    data = payload + b"\0" * (len(payload) % 2)
    words = np.frombuffer(data, dtype="<u2").astype(object)
    positions = np.arange(1, len(words) + 1, dtype=object)
    return int(words.sum() % PRIME) | int((words * positions).sum() % PRIME) << 32


def kv_block(seed: int, nbytes: int = BLOCK_BYTES) -> bytes:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(nbytes // 2, generator=gen).half().numpy().tobytes()


@pytest.mark.parametrize(
    "payload",
    [b"", b"\x01", b"\x01\x00", bytes(range(256)) * 3 + b"\x07", kv_block(0)],
    ids=["empty", "one byte", "one word", "odd length", "a block"],
)
def test_the_sums_are_the_formula(payload: bytes) -> None:
    assert word_sums_of(payload) == reference(payload)


def test_a_payload_over_many_rows_and_passes_sums_as_the_formula() -> None:
    nbytes = 2 * ROW_WORDS * ROWS_PER_PASS * 2 + 1234  # two passes and a partial row
    payload = bytes(np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8))
    assert word_sums_of(payload) == reference(payload)
    worst = b"\xff" * nbytes  # every word and weight at its largest: nothing overflows
    assert word_sums_of(worst) == reference(worst)


def test_rows_of_a_staging_buffer_sum_as_their_bytes() -> None:
    """Payloads as the staging buffer holds them: rows at an object's stride, behind a header."""
    objects = torch.randint(0, 256, (3, 64 + BLOCK_BYTES), dtype=torch.uint8)
    payloads = objects[:, 64:]
    assert not payloads.is_contiguous()
    sums = word_sums(payloads).tolist()
    assert sums == [reference(row.numpy().tobytes()) for row in payloads]


def damaged(payload: bytes, kind: str) -> bytes:
    other = kv_block(99, len(payload))
    half = len(payload) // 2
    if kind == "torn":  # the first half new, the rest what the bytes were before
        return payload[:half] + other[half:]
    if kind == "truncated":  # a tail missing (zeroed where a buffer was)
        return payload[: len(payload) - 4096] + bytes(4096)
    if kind == "shifted by one word":
        return b"\0\0" + payload[:-2]
    if kind == "shifted by 3 bytes":
        return payload[3:] + payload[:3]
    if kind == "replaced":  # another block's payload
        return other
    if kind == "one byte":
        return payload[:100] + bytes([payload[100] ^ 0x80]) + payload[101:]
    if kind == "two words swapped":
        return payload[:10] + payload[12:14] + payload[10:12] + payload[14:]
    raise ValueError(kind)


@pytest.mark.parametrize(
    "kind",
    [
        "torn",
        "truncated",
        "shifted by one word",
        "shifted by 3 bytes",
        "replaced",
        "one byte",
        "two words swapped",
    ],
)
def test_every_kind_of_damage_changes_the_sums(kind: str) -> None:
    payload = kv_block(3)
    bad = damaged(payload, kind)
    assert len(bad) == len(payload) and bad != payload
    assert word_sums_of(bad) != word_sums_of(payload)


def test_a_plain_sum_would_miss_a_shift_the_weighted_sum_catches() -> None:
    """Why two sums: rotating the words keeps their sum (A) and changes only the weighted one (B)."""
    payload = kv_block(5)
    rotated = payload[2:] + payload[:2]
    before, after = word_sums_of(payload), word_sums_of(rotated)
    assert before & 0xFFFFFFFF == after & 0xFFFFFFFF
    assert before >> 32 != after >> 32
