"""Faults at the Mooncake client boundary, and prompts whose blocks they pick.

:class:`FailingReads` patches ``mooncake.store.MooncakeDistributedStore`` itself (every
client of this process, the engine's included): reads of the chosen keys answer a chosen
code and write no byte; every other key goes to the real store in the same call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvpool.connector.contract.keys import hash_digest
from kvpool.connector.pool_client import CODE_TRANSFER_FAILED
from tests.support.prompts import block_hashes

READ_METHOD = "batch_get_into_multi_buffers"


def digests_of(prompt: list[int], blocks: Iterable[int]) -> set[str]:
    """Key digests of ``prompt``'s blocks ``blocks`` (every group and rank uses them)."""
    hashes = block_hashes(prompt)
    return {hash_digest(hashes[i]) for i in blocks}


def key_digest(key: str) -> str:
    return key.rsplit("/", 1)[-1]


@dataclass
class FailingReads:
    """Reads of keys whose digest is in ``digests`` answer ``code`` without writing."""

    digests: set[str]
    code: int = CODE_TRANSFER_FAILED
    failed: list[str] = field(default_factory=list)

    def doomed(self, key: str) -> bool:
        return key_digest(key) in self.digests

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from mooncake.store import MooncakeDistributedStore

        original: Callable[..., list[int]] = getattr(MooncakeDistributedStore, READ_METHOD)
        fault = self

        def read(store: Any, keys: list[str], ptrs: list[Any], sizes: list[Any], *rest: Any) -> list[int]:
            codes = [fault.code] * len(keys)
            passed = [i for i, key in enumerate(keys) if not fault.doomed(key)]
            fault.failed.extend(key for key in keys if fault.doomed(key))
            if passed:
                real = original(
                    store,
                    [keys[i] for i in passed],
                    [ptrs[i] for i in passed],
                    [sizes[i] for i in passed],
                    *rest,
                )
                for i, code in zip(passed, real, strict=True):
                    codes[i] = code
            return codes

        monkeypatch.setattr(MooncakeDistributedStore, READ_METHOD, read)
