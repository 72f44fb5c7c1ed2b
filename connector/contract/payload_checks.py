"""The payload checksums an object header may name, and how each is computed.

Every object's header names the checksum its writer took of the payload and states its
value (:mod:`kvpool.connector.contract.object_header`); a reader computes the checksum
the header names, whichever kind its own writes use, so writers of either kind share a
pool.

* ``CRC32C``: CRC-32C (Castagnoli) of the payload bytes, what a writer whose staging
  buffer is host memory takes (``google_crc32c``, in hardware: 10-17 GB/s here).
* ``WORD_SUMS``: what a writer whose staging buffer is on an accelerator takes, computed
  where the bytes are with device-agnostic torch operations, so only its 8 bytes cross
  to the host. The payload is read as little-endian 16-bit words ``w_0 .. w_{n-1}``
  (values 0..65535; an odd length ends with a zero byte) and summed twice modulo the
  prime ``P = 2**31 - 1``::

      A = sum(w_i)            mod P
      B = sum((i + 1) * w_i)  mod P      value = A | B << 32

  A payload ``w`` changed into ``w'`` passes only if the difference ``e = w' - w``
  (each ``|e_i| < 2**16 < P``) has ``sum(e_i) = 0`` and ``sum((i + 1) e_i) = 0`` mod P.
  Hence it always catches a change of one word (A) or of two words (then
  ``(i - j) e_i = 0``, impossible for ``i != j`` below P), so every single flipped byte
  or swapped pair; and a payload whose changed words look random passes with
  probability about ``P**-2`` (2^-62), which covers the ways a stored block goes wrong:

  - *replaced*: another block's payload under this header (another prompt, stale bytes);
  - *torn*: the first part new, the rest old (a read that overtook a write);
  - *shifted*: the bytes moved by an offset (A sees the words that fell off or came
    in, B the moved positions: a plain sum would pass a shift by whole words);
  - *truncated*: a tail missing or zeroed. Zero words add nothing to either sum, so a
    payload is checked together with its length, which the header's identity states
    and every load compares with the object's size before the sums.

  Not a cryptographic check: it guards against accidents, as CRC-32C does.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any

import google_crc32c


class Checksum(IntEnum):
    """The payload checksum a header names (its byte in the header)."""

    CRC32C = 1
    WORD_SUMS = 2


PRIME = 2**31 - 1
#: Words summed per row before a reduction modulo ``PRIME``: ``(j + 1) * w_j`` stays below 2^31.
ROW_WORDS = 1 << 15
#: Rows reduced in one pass: bounds the temporaries at a few times 2 MiB of payload.
ROWS_PER_PASS = 32


def crc32c(payload: Any) -> int:
    """The CRC-32C of ``payload`` (any contiguous buffer)."""
    return int(google_crc32c.value(payload))


def crc32c_extend(crc: int, chunk: Any) -> int:
    """The CRC-32C of what ``crc`` covered followed by ``chunk`` (a buffer)."""
    return int(google_crc32c.extend(crc, chunk))


def crc32c_in_hardware() -> bool:
    """Whether :func:`crc32c` runs compiled (else pure Python: correct, far slower)."""
    return google_crc32c.implementation == "c"


def word_sums(payloads: Any) -> Any:
    """``WORD_SUMS`` of each row of ``payloads``, a ``(count, nbytes)`` uint8 tensor.

    Computed on the tensor's device (any torch device); returns a ``(count,)`` int64
    tensor there, each ``A | B << 32``: only that crosses to the host.
    """
    import torch

    count, nbytes = payloads.shape
    if nbytes % 2:
        payloads = torch.nn.functional.pad(payloads, (0, 1))
        nbytes += 1
    try:  # rows of a staging buffer: contiguous each, at an even stride
        words = payloads.view(torch.int16)
    except RuntimeError:
        words = payloads.contiguous().view(torch.int16)
    num_words = nbytes // 2
    if num_words >= PRIME:
        raise ValueError(f"a payload of {nbytes} bytes is too long for WORD_SUMS")
    rows = -(-num_words // ROW_WORDS)
    device = payloads.device
    weights = torch.arange(1, ROW_WORDS + 1, dtype=torch.int32, device=device)
    sum_a = torch.zeros(count, dtype=torch.int64, device=device)
    sum_b = torch.zeros(count, dtype=torch.int64, device=device)
    for first in range(0, rows, ROWS_PER_PASS):
        last = min(rows, first + ROWS_PER_PASS)
        start, stop = first * ROW_WORDS, min(num_words, last * ROW_WORDS)
        chunk = words[:, start:stop].to(torch.int32).bitwise_and_(0xFFFF)
        if stop - start < (last - first) * ROW_WORDS:  # the last row: zeros add nothing
            chunk = torch.nn.functional.pad(chunk, (0, (last - first) * ROW_WORDS - (stop - start)))
        chunk = chunk.view(count, last - first, ROW_WORDS)
        row_sums = chunk.sum(dim=2, dtype=torch.int64)  # < 2^31 each
        inner = chunk.mul_(weights).sum(dim=2, dtype=torch.int64)  # sum (j+1) w_j, < 2^46
        # Word i = r * ROW_WORDS + j weighs (i + 1) = r * ROW_WORDS + (j + 1).
        offsets = torch.arange(first, last, dtype=torch.int64, device=device) * ROW_WORDS
        shifted = (offsets % PRIME) * (row_sums % PRIME) % PRIME  # < 2^62 before the reduction
        sum_a = (sum_a + row_sums.sum(dim=1)) % PRIME
        sum_b = (sum_b + (shifted + inner % PRIME).sum(dim=1)) % PRIME
    return sum_a | (sum_b << 32)


def word_sums_of(payload: bytes) -> int:
    """``WORD_SUMS`` of one payload given as bytes (tests, tools)."""
    import torch

    if not payload:
        return 0
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return int(word_sums(data.view(1, -1)).tolist()[0])
