"""Byte addressing of KV blocks inside vLLM's per-layer cache tensors.

A layer's cache tensor has one dimension that indexes blocks (possibly split
into kernel blocks); the dimensions before it (e.g. K and V) give separate
contiguous segments of each block. A block of a group is stored as one key:
the concatenation of its segments over the group's layers, in layer order.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LayerBlocks:
    """Where block ``b`` of one layer lives: ``base + outer + b * block_stride``."""

    base: int
    outer_offsets: tuple[int, ...]
    block_stride: int
    segment_bytes: int
    num_blocks: int

    @property
    def block_bytes(self) -> int:
        return self.segment_bytes * len(self.outer_offsets)

    def regions(self, block_id: int) -> list[tuple[int, int]]:
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block id {block_id} outside 0..{self.num_blocks - 1}")
        start = self.base + block_id * self.block_stride
        return [(start + off, self.segment_bytes) for off in self.outer_offsets]


def describe_layer(tensor: Any, num_blocks: int) -> LayerBlocks:
    """Find the block dimension of ``tensor`` (a torch tensor) and its segments.

    Raises ``ValueError`` when a block's bytes are not a few contiguous runs.
    """
    shape = tuple(tensor.shape)
    strides = tuple(tensor.stride())
    elem = tensor.element_size()
    block_dim = _block_dim(shape, num_blocks)
    sub_blocks = shape[block_dim] // num_blocks
    # The trailing dims of one (kernel) block must be densely packed.
    expected = 1
    for dim in range(len(shape) - 1, block_dim, -1):
        if shape[dim] > 1 and strides[dim] != expected:
            raise ValueError(
                f"KV cache tensor {shape} with strides {strides} is not contiguous "
                f"within a block (dim {dim}); the connector cannot address its blocks"
            )
        expected *= shape[dim]
    kernel_bytes = expected * elem
    if sub_blocks > 1 and strides[block_dim] * elem != kernel_bytes:
        raise ValueError(f"KV cache tensor {shape}: kernel blocks of one block are not adjacent")
    outer_offsets = tuple(
        sum(i * s for i, s in zip(index, strides[:block_dim])) * elem
        for index in itertools.product(*(range(n) for n in shape[:block_dim]))
    )
    return LayerBlocks(
        base=tensor.data_ptr(),
        outer_offsets=outer_offsets or (0,),
        block_stride=strides[block_dim] * elem * sub_blocks,
        segment_bytes=kernel_bytes * sub_blocks,
        num_blocks=num_blocks,
    )


def _block_dim(shape: tuple[int, ...], num_blocks: int) -> int:
    # Prefer an exact match in the leading dims (vLLM puts blocks first or
    # second, after a K/V dim of 2), then a whole multiple (kernel blocks).
    for dim in range(min(2, len(shape))):
        if shape[dim] == num_blocks:
            return dim
    for dim in range(min(2, len(shape))):
        if shape[dim] % num_blocks == 0 and shape[dim] > num_blocks:
            return dim
    raise ValueError(f"KV cache tensor {shape} has no dimension of {num_blocks} blocks")


def storage_span(tensor: Any) -> tuple[int, int]:
    """(address, bytes) of the memory behind ``tensor``, for registration."""
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.nbytes()
