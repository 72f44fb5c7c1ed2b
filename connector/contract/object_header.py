"""The header every pool object starts with: what the bytes after it are.

A stored block is one object, ``header | payload``. The 64-byte header names
the layout fingerprint and the digest of the block's prefix hash (as 8- and
16-byte BLAKE2b tags), its KV-cache group, the tensor shard and pipeline rank
that produced it (the shard is the tensor rank unless ranks hold copies of the
KV: :mod:`kvpool.connector.contract.shards`) and the payload length, with a
CRC-32 of those fields; then which checksum its writer took of the payload and
its value (:mod:`kvpool.connector.contract.payload_checks`: CRC-32C from a
writer staging in host memory, ``WORD_SUMS`` from one staging on an
accelerator). Everything in the first part follows from the key a block is
stored under, so a load compares it with the identity it expects (one
``bytes`` comparison), then the payload with the checksum the header names,
before any payload reaches vLLM's cache: an object of another layout, a
truncated object, an object copied under another key, or one whose payload is
not what its writer wrote never becomes KV.

The payload check matters even without faulty hardware: Mooncake's TCP transport
reports a write done once the writer's kernel holds its bytes, before the store
has copied them, so a reader can overtake a published object's write and read
its header with stale bytes behind it.

``VERSION`` is the object format; it is part of every key
(:mod:`kvpool.connector.contract.keys`). Version 3 names the payload checksum
(version 2 always meant CRC-32C): an object of another version never shares a
key, and one found under a key anyway fails the identity comparison (a failed
load, recomputed), never read as this format.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from dataclasses import dataclass

from kvpool.connector.contract.payload_checks import Checksum, crc32c, crc32c_in_hardware

MAGIC = b"KVPH"
VERSION = 3
HEADER_BYTES = 64

# magic, version, flags, header length, layout tag, digest, group, tp rank, pp rank,
# reserved, payload length: 48 bytes; the CRC-32 of those 48 (the identity ends here);
# the payload checksum's kind (one byte), three zero bytes, its value (8 bytes).
_FIELDS = struct.Struct("<4sBBH8s16sHHHHQ")
_CRC = struct.Struct("<I")
IDENTITY_BYTES = _FIELDS.size + _CRC.size
_CHECK = struct.Struct("<B3xQ")
assert IDENTITY_BYTES + _CHECK.size == HEADER_BYTES


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


def identity_bytes(identity: ObjectIdentity) -> bytes:
    """The header's first ``IDENTITY_BYTES``: what follows from the key alone."""
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
    return fields + _CRC.pack(zlib.crc32(fields))


def pack_header(identity: ObjectIdentity, check: int, kind: Checksum = Checksum.CRC32C) -> bytes:
    """The 64 header bytes of ``identity`` over a payload whose ``kind`` checksum is ``check``."""
    return restate_payload_check(identity_bytes(identity), check, kind)


def restate_payload_check(header: bytes, check: int, kind: Checksum = Checksum.CRC32C) -> bytes:
    """``header``'s identity over a payload whose ``kind`` checksum is ``check``: 64 bytes."""
    return bytes(header[:IDENTITY_BYTES]) + _CHECK.pack(kind, check)


def restate_payload_crc(header: bytes, payload_crc: int) -> bytes:
    """``header``'s identity over a payload whose CRC-32C is ``payload_crc``: 64 bytes."""
    return restate_payload_check(header, payload_crc, Checksum.CRC32C)


#: The CRC-32C of a payload (any contiguous buffer): a CPU writer's checksum.
payload_crc = crc32c
payload_crc_in_hardware = crc32c_in_hardware


def stated_check(header: bytes) -> tuple[int, int]:
    """(checksum kind, value) a header states of its payload; the kind as stored (it may
    name no :class:`Checksum`: then no payload matches)."""
    kind, value = _CHECK.unpack_from(header, IDENTITY_BYTES)
    return int(kind), int(value)


def stated_checksum(header: bytes) -> Checksum | None:
    """The checksum a header names; None when it names none this version knows."""
    kind = stated_check(header)[0]
    return Checksum(kind) if kind in Checksum._value2member_map_ else None


def payload_matches(header: bytes, kind: Checksum, value: int) -> bool:
    """Whether a payload whose ``kind`` checksum is ``value`` is the one ``header`` was written with."""
    return stated_check(header) == (kind, value)


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
    """Why ``data`` (an object's first bytes) is not a header of ``expected``; None if it is.

    The payload is checked apart (:func:`payload_matches`): it needs the payload's bytes.
    """
    if len(data) >= HEADER_BYTES and bytes(data[:IDENTITY_BYTES]) == identity_bytes(expected):
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
