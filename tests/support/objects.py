"""Pool objects made by hand, for tests that put bytes of their own under a block's key."""

from __future__ import annotations

import struct

from kvpool.connector.contract.object_header import HEADER_BYTES, IDENTITY_BYTES, payload_crc


def over_payload(stored: bytes, payload: bytes) -> bytes:
    """``stored``'s header (the block it names) over ``payload``, stating ``payload``'s CRC-32C:
    an object that passes every check a load makes and whose KV is ``payload``."""
    header = (
        stored[:IDENTITY_BYTES]
        + struct.pack("<I", payload_crc(payload))
        + stored[IDENTITY_BYTES + 4 : HEADER_BYTES]
    )
    return header + payload
