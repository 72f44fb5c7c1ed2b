"""The rates a load decision reads, learned online from what the scheduler side sees.

* **Load rate**, per transport: bytes over seconds of the loads the workers finished. They
  reach the scheduler in the connector stats vLLM hands back each step
  (``KVConnectorOutput.kv_connector_stats``: every rank's bytes, rank 0's seconds per group;
  a request's groups load one after another). Learned with them: each group's bytes per
  block (loads and saves), to size a hit from its block counts.
* **Prefill rate**: tokens over wall time of the engine's steps that prefill, from
  ``build_connector_meta`` (the step's plan) to the step's output
  (``update_connector_output``), matched first in, first out (with asynchronous
  scheduling the next step is planned before the last one's output arrives).

Both are sums that decay by half every ``half_life`` observations, so they follow a link or
a load that changes and stay cheap: no history is kept.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvpool.connector.observability.vllm_metrics import TransferSample
from kvpool.connector.scheduler.load_decision import Rates

#: Observations after which an old one weighs half.
HALF_LIFE = 32
#: Steps planned and not yet reported beyond which the oldest are dropped (never matched).
MAX_STEPS_IN_FLIGHT = 8


class Throughput:
    """Amount over seconds, both decayed sums; ``samples`` counts observations with seconds."""

    __slots__ = ("_decay", "amount", "samples", "seconds")

    def __init__(self, half_life: int = HALF_LIFE):
        self._decay = 0.5 ** (1.0 / half_life)
        self.amount = 0.0
        self.seconds = 0.0
        self.samples = 0

    def observe(self, amount: float, seconds: float) -> None:
        """Add ``amount`` moved in ``seconds`` (0 seconds: an amount whose time another sample holds)."""
        if seconds > 0:
            self.amount *= self._decay
            self.seconds *= self._decay
            self.samples += 1
        self.amount += amount
        self.seconds += seconds

    @property
    def rate(self) -> float:
        """Amount per second; 0 before any time was observed."""
        return self.amount / self.seconds if self.seconds > 0 else 0.0


@dataclass
class _Step:
    started: float
    tokens: int
    prefills: bool


class LoadRates:
    """The online load rate per transport, block sizes per group, and the engine's prefill rate."""

    def __init__(
        self,
        *,
        min_prefill_tokens: int = 1,
        half_life: int = HALF_LIFE,
        clock: Callable[[], float] = time.perf_counter,
    ):
        # A step counts as prefill when it computes this many tokens beyond one per request.
        self.min_prefill_tokens = min_prefill_tokens
        self._half_life = half_life
        self._clock = clock
        self.load: dict[str, Throughput] = {}
        self.prefill = Throughput(half_life)
        self._group_bytes: dict[int, float] = {}
        self._group_blocks: dict[int, float] = {}
        self._steps: deque[_Step] = deque()
        self.changed = False  # since the rates were last exported

    # --- the engine's steps -------------------------------------------------------
    def step_planned(self, tokens: int, requests: int) -> None:
        """A step computing ``tokens`` tokens for ``requests`` requests was handed to the workers."""
        steps = self._steps
        if len(steps) >= MAX_STEPS_IN_FLIGHT:
            steps.popleft()
        steps.append(_Step(self._clock(), tokens, tokens - requests >= self.min_prefill_tokens))

    def step_reported(self) -> None:
        """The oldest planned step's output arrived: a prefill sample if it prefilled."""
        if not self._steps:
            return
        step = self._steps.popleft()
        if step.prefills:
            seconds = self._clock() - step.started
            if seconds > 0:
                self.prefill.observe(step.tokens, seconds)
                self.changed = True

    # --- the workers' transfers ---------------------------------------------------
    def observe_transfers(self, sample: TransferSample, transport: str) -> None:
        """Learn from one step's worker stats, for loads over ``transport``."""
        if sample.load_bytes or sample.load_seconds:
            rate = self.load.get(transport)
            if rate is None:
                rate = self.load[transport] = Throughput(self._half_life)
            rate.observe(sample.load_bytes, sample.load_seconds)
            self.changed = True
        for group, value in sample.group_bytes.items():
            self._group_bytes[group] = self._group_bytes.get(group, 0.0) + value
        for group, value in sample.group_blocks.items():
            self._group_blocks[group] = self._group_blocks.get(group, 0.0) + value

    # --- what a decision reads ----------------------------------------------------
    def rates(self, transport: str) -> Rates:
        load = self.load.get(transport)
        return Rates(
            load_bytes_per_s=0.0 if load is None else load.rate,
            load_samples=0 if load is None else load.samples,
            prefill_tokens_per_s=self.prefill.rate,
            prefill_samples=self.prefill.samples,
        )

    def block_bytes(self, group: int) -> float | None:
        """Bytes of one block of ``group`` over every rank; None before any was moved."""
        blocks = self._group_blocks.get(group, 0.0)
        bytes_ = self._group_bytes.get(group, 0.0)
        return bytes_ / blocks if blocks > 0 and bytes_ > 0 else None

    def hit_bytes(
        self, needed_blocks: Sequence[Sequence[int]], block_sizes: Sequence[int], local_tokens: int
    ) -> int | None:
        """Bytes a hit moves: per group, its needed blocks (ascending indices) past the local hit.

        None while some group with blocks to move has no measured block size.
        """
        total = 0.0
        for group, (blocks, block_size) in enumerate(zip(needed_blocks, block_sizes)):
            count = len(blocks) - bisect_left(blocks, local_tokens // block_size)
            if count <= 0:
                continue
            size = self.block_bytes(group)
            if size is None:
                return None
            total += count * size
        return int(total)
