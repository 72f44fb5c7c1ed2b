"""The object header: every field that differs is named, and nothing else passes."""

from __future__ import annotations

import dataclasses
import struct
import zlib

import pytest

from kvpool.connector.contract.keys import OBJECT_FORMAT, KeySpace
from kvpool.connector.contract.object_header import (
    HEADER_BYTES,
    VERSION,
    ObjectIdentity,
    mismatch,
    pack_header,
    payload_crc,
    payload_crc_in_hardware,
    payload_matches,
    read_header,
    stated_check,
    stated_checksum,
)
from kvpool.connector.contract.payload_checks import Checksum, word_sums_of

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


@pytest.mark.parametrize(
    ("kind", "checksum"), [(Checksum.CRC32C, payload_crc), (Checksum.WORD_SUMS, word_sums_of)]
)
def test_a_payload_is_checked_against_the_checksum_its_header_names(kind: Checksum, checksum) -> None:
    assert payload_crc(b"123456789") == 0xE3069283, "CRC-32C (Castagnoli), its standard check value"
    assert payload_crc_in_hardware(), "the installed google-crc32c is the compiled one"
    payload = bytes(range(256)) * 16
    header = pack_header(ME, checksum(payload), kind)
    assert mismatch(header, ME) is None
    assert stated_checksum(header) is kind and stated_check(header) == (kind, checksum(payload))
    assert payload_matches(header, kind, checksum(payload))
    stale = bytearray(payload)
    stale[-1] ^= 0x01  # one byte behind the header is not what was written
    assert not payload_matches(header, kind, checksum(bytes(stale)))
    other = Checksum.WORD_SUMS if kind is Checksum.CRC32C else Checksum.CRC32C
    assert not payload_matches(header, other, checksum(payload)), "a value of another kind is no match"
    # The identity does not depend on the payload: a header over other bytes names the same block.
    assert mismatch(pack_header(ME, checksum(bytes(stale)), kind), ME) is None


def test_a_header_names_no_checksum_this_version_does_not_know() -> None:
    header = bytearray(pack_header(ME, 7))
    header[IDENTITY_END] = 0
    assert stated_checksum(bytes(header)) is None
    assert mismatch(bytes(header), ME) is None, "the identity stands; no payload will match"


IDENTITY_END = 52


def as_version(header: bytes, version: int) -> bytes:
    """``header`` stating another format version, its fields CRC made anew."""
    old = bytearray(header)
    old[4] = version
    old[48:52] = struct.pack("<I", zlib.crc32(bytes(old[:48])))
    return bytes(old)


def v2_header(identity: ObjectIdentity, crc: int) -> bytes:
    """A header as version 2 wrote it: the identity, the payload's CRC-32C at byte 52, zeros."""
    return as_version(pack_header(identity, 0), 2)[:IDENTITY_END] + struct.pack("<I", crc) + bytes(8)


@pytest.mark.parametrize("version", [1, 2])
def test_a_header_of_a_previous_format_is_rejected(version: int) -> None:
    assert VERSION == 3
    old = v2_header(ME, 0x1234) if version == 2 else as_version(pack_header(ME, 0), 1)
    assert mismatch(old, ME) == f"header version {version}, expected 3"


def test_a_version_2_header_read_as_version_3_would_name_no_checksum() -> None:
    """Were the version not compared, a v2 header's CRC would be read as a checksum kind and
    value: the version is what refuses it, and the keys keep the formats apart."""
    assert OBJECT_FORMAT == "h3"
    old = v2_header(ME, 0xE3069283)
    assert stated_check(old) == (0x83, 0)  # nonsense, never trusted: the identity check fails first
