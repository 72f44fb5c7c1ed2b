"""Every rank of an engine learns every rank's failed loads before it decides what to save.

Two real processes in a real ``torch.distributed`` gloo group on loopback, as an engine's
two tensor-parallel workers: a block whose load failed on one rank only is tainted on
both (the other rank's forward computed from it too), and both report it to vLLM.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from typing import Any

from kvpool.connector.local.pool import LOOPBACK, free_port

# The step's synchronous loads: blocks 3..6, the same list on every rank (one metadata).
LOADED = [3, 4, 5, 6]
FAILED_ON = {0: {4}, 1: {6}}  # rank -> blocks whose load failed there


def _rank(rank: int, port: int, out: Any) -> None:
    import torch.distributed as dist

    from kvpool.connector.metadata import GroupTransfer, PoolConnectorMetadata, RequestLoad
    from kvpool.connector.rank_agreement import union_over
    from kvpool.connector.save_integrity import SaveIntegrity

    os.environ.update(MASTER_ADDR=LOOPBACK, MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        integrity = SaveIntegrity(record_marker=lambda: None, agree_failures=union_over([dist.group.WORLD]))
        load = RequestLoad("r", [GroupTransfer(0, [f"d{b}" for b in LOADED], LOADED)], 128, is_async=False)
        meta = PoolConnectorMetadata(loads=[load], step=7)
        failed = integrity.after_sync_loads(meta, FAILED_ON[rank].__contains__)
        out.put((rank, sorted(failed), sorted(b for b in LOADED if (0, b) in integrity.taint)))
    finally:
        dist.destroy_process_group()


def test_a_load_failed_on_one_rank_is_tainted_on_every_rank() -> None:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(rank, port, out)) for rank in (0, 1)]
    for proc in procs:
        proc.start()
    try:
        answers = [out.get(timeout=120) for _ in procs]
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    assert sorted(answers) == [(0, [4, 6], [4, 6]), (1, [4, 6], [4, 6])]
