"""The object header: every field that differs is named, and nothing else passes."""

from __future__ import annotations

import dataclasses
import struct
import zlib

import pytest

from kvpool.connector.contract.keys import OBJECT_FORMAT, KeySpace
from kvpool.connector.contract.object_header import (
    HEADER_BYTES,
    ObjectIdentity,
    mismatch,
    pack_header,
    payload_crc,
    payload_crc_in_hardware,
    payload_matches,
    read_header,
)

ME = ObjectIdentity(
    fingerprint="0123456789abcdef", digest="d" * 32, group=1, tp_rank=2, pp_rank=0, payload_bytes=4096
)


CRC = 0x1234ABCD


def test_a_header_is_64_bytes_and_reads_back() -> None:
    header = pack_header(ME, CRC)
    assert len(header) == HEADER_BYTES
    assert mismatch(header + b"payload", ME) is None
    fields = read_header(header)
    assert fields is not None and fields.crc_ok
    assert (fields.group, fields.tp_rank, fields.pp_rank, fields.payload_bytes) == (1, 2, 0, 4096)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"fingerprint": "fedcba9876543210"}, "another layout"),
        ({"digest": "e" * 32}, "another block (misdirected key)"),
        ({"group": 0}, "another group or rank"),
        ({"tp_rank": 3}, "another group or rank"),
        ({"pp_rank": 1}, "another group or rank"),
        ({"payload_bytes": 2048}, "payload of 2048 bytes, expected 4096"),
    ],
)
def test_every_field_is_checked(change: dict, reason: str) -> None:
    other = pack_header(dataclasses.replace(ME, **change), CRC)
    assert mismatch(other, ME) == reason


def test_garbage_short_and_torn_headers_are_rejected() -> None:
    assert mismatch(bytes(HEADER_BYTES), ME) == "no valid header"
    assert mismatch(b"KVPH", ME) == "object shorter than a header (4 bytes)"
    torn = bytearray(pack_header(ME, CRC))
    torn[20] ^= 0xFF  # inside the layout tag: the CRC no longer matches
    assert mismatch(bytes(torn), ME) == "no valid header"


def test_the_object_format_is_part_of_every_key() -> None:
    key = KeySpace("kvpool", "fp").key(0, 0, 0, "d" * 32)
    assert f"/{OBJECT_FORMAT}/" in key


def test_a_payload_is_checked_against_the_crc_its_header_states() -> None:
    assert payload_crc(b"123456789") == 0xE3069283, "CRC-32C (Castagnoli), its standard check value"
    assert payload_crc_in_hardware(), "the installed google-crc32c is the compiled one"
    payload = bytes(range(256)) * 16
    header = pack_header(ME, payload_crc(payload))
    assert mismatch(header, ME) is None
    assert payload_matches(header, payload_crc(payload))
    stale = bytearray(payload)
    stale[-1] ^= 0x01  # one byte behind the header is not what was written
    assert not payload_matches(header, payload_crc(bytes(stale)))
    # The identity does not depend on the payload: a header over other bytes names the same block.
    assert mismatch(pack_header(ME, payload_crc(bytes(stale))), ME) is None


def test_a_header_of_the_previous_format_is_rejected() -> None:
    v1 = bytearray(pack_header(ME, 0))
    v1[4] = 1  # version 1 (no payload CRC); its fields CRC made anew
    v1[48:52] = struct.pack("<I", zlib.crc32(bytes(v1[:48])))
    assert mismatch(bytes(v1), ME) == "header version 1, expected 2"
