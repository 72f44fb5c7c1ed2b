"""Agree across an engine's ranks on which blocks of a step's loads failed.

Each tensor- and pipeline-parallel rank loads its own keys, so a load can fail on one
rank and succeed on another; yet every rank's forward then computes from the failed
rank's garbage (tensor ranks all-reduce their results, a later pipeline stage takes an
earlier stage's hidden states). So every rank must know every rank's failures before
it decides what to save. The ranks of one engine see the same metadata, hence the
same list of blocks a step loads synchronously: each contributes one flag per block,
and a max-reduction over the tensor group, then the pipeline group, gives the union.
One small collective on the CPU groups, only in steps with synchronous loads, and
only when the engine has more than one rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

#: Maps this rank's per-block failure flags to the flags of every rank (their union).
AgreeFailures = Callable[[list[int]], list[int]]


def union_over(cpu_groups: Sequence[Any]) -> AgreeFailures:
    """Flags or-ed over every rank of each ``torch.distributed`` group, in turn."""

    def agree(flags: list[int]) -> list[int]:
        import torch
        import torch.distributed as dist

        tensor = torch.tensor(flags, dtype=torch.int32)
        for group in cpu_groups:
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
        return [int(v) for v in tensor.tolist()]

    return agree


def rank_agreement() -> AgreeFailures | None:
    """The union over this engine's tensor and pipeline groups; None with a single rank."""
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        groups = [g.cpu_group for g in (get_tp_group(), get_pp_group()) if g.world_size > 1]
    except (AssertionError, AttributeError, ImportError):
        return None
    return union_over(groups) if groups else None
