"""Pool objects made by hand, for tests that put bytes of their own under a block's key."""

from __future__ import annotations

from kvpool.connector.contract.object_header import payload_crc, restate_payload_crc


def over_payload(stored: bytes, payload: bytes) -> bytes:
    """``stored``'s header (the block it names) over ``payload``, stating ``payload``'s CRC-32C:
    an object that passes every check a load makes and whose KV is ``payload``."""
    return restate_payload_crc(stored, payload_crc(payload)) + payload
