"""The header every pool object starts with: what the bytes after it are.

A stored block is one object, ``header | payload``. The 64-byte header names
the layout fingerprint and the digest of the block's prefix hash (as 8- and
16-byte BLAKE2b tags), its KV-cache group, the tensor shard and pipeline rank
that produced it (the shard is the tensor rank unless ranks hold copies of the
KV: :mod:`kvpool.connector.contract.shards`) and the payload length, with a
CRC-32 of those fields. Everything
in it follows from the key a block is stored under, so a load compares the
object's first 64 bytes with the header it expects (one ``bytes`` comparison)
before any payload reaches vLLM's cache: an object of another layout, a
truncated object, or an object copied under another key never becomes KV.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from dataclasses import dataclass

MAGIC = b"KVPH"
VERSION = 1
HEADER_BYTES = 64

# magic, version, flags, header length, layout tag, digest, group, tp rank, pp rank,
# reserved, payload length: 48 bytes, then the CRC-32 of those 48 and zero padding.
_FIELDS = struct.Struct("<4sBBH8s16sHHHHQ")
_CRC = struct.Struct("<I")
_PADDING = bytes(HEADER_BYTES - _FIELDS.size - _CRC.size)


@dataclass(frozen=True)
class ObjectIdentity:
    """What one stored block is: the fields of its header."""

    fingerprint: str  # the layout fingerprint of the key space
    digest: str  # the digest of the block's prefix hash (the key's last part)
    group: int
    tp_rank: int  # the group's tensor shard, as in the key
    pp_rank: int
    payload_bytes: int

    @property
    def object_bytes(self) -> int:
        return HEADER_BYTES + self.payload_bytes


def layout_tag(fingerprint: str) -> bytes:
    """Eight bytes standing for a layout fingerprint."""
    return hashlib.blake2b(fingerprint.encode(), digest_size=8).digest()


def block_tag(digest: str) -> bytes:
    """Sixteen bytes standing for a block's key digest."""
    return hashlib.blake2b(digest.encode(), digest_size=16).digest()


def pack_header(identity: ObjectIdentity) -> bytes:
    """The 64 header bytes of ``identity``."""
    fields = _FIELDS.pack(
        MAGIC,
        VERSION,
        0,
        HEADER_BYTES,
        layout_tag(identity.fingerprint),
        block_tag(identity.digest),
        identity.group,
        identity.tp_rank,
        identity.pp_rank,
        0,
        identity.payload_bytes,
    )
    return fields + _CRC.pack(zlib.crc32(fields)) + _PADDING


@dataclass(frozen=True)
class HeaderFields:
    """A header as read back, for diagnostics."""

    magic: bytes
    version: int
    layout_tag: bytes
    block_tag: bytes
    group: int
    tp_rank: int
    pp_rank: int
    payload_bytes: int
    crc_ok: bool


def read_header(data: bytes) -> HeaderFields | None:
    """The fields of ``data``'s header; None when it is too short to hold one."""
    if len(data) < HEADER_BYTES:
        return None
    magic, version, _flags, _size, layout, block, group, tp, pp, _res, payload = _FIELDS.unpack_from(data)
    (crc,) = _CRC.unpack_from(data, _FIELDS.size)
    return HeaderFields(
        magic, version, layout, block, group, tp, pp, payload, crc == zlib.crc32(data[: _FIELDS.size])
    )


def mismatch(data: bytes, expected: ObjectIdentity) -> str | None:
    """Why ``data`` (an object's first bytes) is not the header of ``expected``; None if it is."""
    if bytes(data[:HEADER_BYTES]) == pack_header(expected):
        return None
    found = read_header(bytes(data[:HEADER_BYTES]))
    if found is None:
        return f"object shorter than a header ({len(data)} bytes)"
    if found.magic != MAGIC or not found.crc_ok:
        return "no valid header"
    if found.layout_tag != layout_tag(expected.fingerprint):
        return "another layout"
    if found.block_tag != block_tag(expected.digest):
        return "another block (misdirected key)"
    if (found.group, found.tp_rank, found.pp_rank) != (expected.group, expected.tp_rank, expected.pp_rank):
        return "another group or rank"
    if found.payload_bytes != expected.payload_bytes:
        return f"payload of {found.payload_bytes} bytes, expected {expected.payload_bytes}"
    return f"header version {found.version}, expected {VERSION}"
