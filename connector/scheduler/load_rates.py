"""The rates a load decision reads, learned online from what the scheduler side sees.

* **Load rate**, per transport: bytes over seconds of the loads the workers finished. They
  reach the scheduler in the connector stats vLLM hands back each step
  (``KVConnectorOutput.kv_connector_stats``: every rank's bytes, rank 0's seconds per group;
  a request's groups load one after another). Learned with them: each group's bytes per
  block (loads and saves), to size a hit from its block counts.
* **Prefill rate**: from the wall time of the engine's steps, from ``build_connector_meta``
  (the step's plan) to the step's output (vLLM asks the scheduler's connector for its stats
  once per step output, idle steps included), matched first in, first out (with
  asynchronous scheduling the next step is planned before the last one's output arrives).
  A step costs a fixed overhead plus a cost per token (:class:`StepCost` fits both over
  every step, decodes included): recomputing a hit costs its tokens at the cost per token
  (the step that computes the request's other tokens pays the overhead either way). Until
  the steps' sizes spread enough to fit, the rate is tokens over seconds of the prefilling
  steps (overhead included: recompute looks dearer, so hits load). The first prefilling step is no
  sample: it pays the engine's one-time costs (kernels chosen and built, memory first
  touched), measured at several times a later step's.

Both are sums that decay by half every ``half_life`` observations, so they follow a link or
a load that changes and stay cheap: no history is kept.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvpool.connector.observability.vllm_metrics import TransferSample
from kvpool.connector.scheduler.hybrid_hit import blocks_from
from kvpool.connector.scheduler.load_decision import Rates

#: Observations after which an old one weighs half.
HALF_LIFE = 32
#: Steps after which an old one weighs half, in the fit of step costs (most steps decode).
STEP_HALF_LIFE = 256
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


class StepCost:
    """Step seconds as ``overhead + tokens * per_token``, fitted by least squares over decayed sums."""

    __slots__ = ("_decay", "n", "sx", "sxx", "sxy", "sy")

    def __init__(self, half_life: int = STEP_HALF_LIFE):
        self._decay = 0.5 ** (1.0 / half_life)
        self.n = self.sx = self.sy = self.sxx = self.sxy = 0.0

    def observe(self, tokens: float, seconds: float) -> None:
        d = self._decay
        self.n = self.n * d + 1.0
        self.sx = self.sx * d + tokens
        self.sy = self.sy * d + seconds
        self.sxx = self.sxx * d + tokens * tokens
        self.sxy = self.sxy * d + tokens * seconds

    def fit(self, min_spread: float) -> tuple[float, float] | None:
        """(overhead seconds, seconds per token); None unless the steps' sizes spread by at least
        ``min_spread`` tokens (standard deviation) and more tokens cost more time."""
        n = self.n
        if n < 2:
            return None
        mean_x = self.sx / n
        var_x = self.sxx / n - mean_x * mean_x
        if var_x < min_spread * min_spread:
            return None
        per_token = (self.sxy / n - mean_x * self.sy / n) / var_x
        if per_token <= 0:
            return None
        return max(0.0, self.sy / n - per_token * mean_x), per_token


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
        self.prefill = Throughput(half_life)  # prefilling steps, overhead included: the fallback
        self.step_cost = StepCost()
        self._group_bytes: dict[int, float] = {}
        self._group_blocks: dict[int, float] = {}
        self._steps: deque[_Step] = deque()
        self._warm = False  # past the engine's first prefilling step
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
        if step.tokens <= 0:
            return  # an idle step: nothing computed
        seconds = self._clock() - step.started
        if not self._warm:
            self._warm = step.prefills  # one-time costs end with the first prefill
            return
        if seconds <= 0:
            return
        self.step_cost.observe(step.tokens, seconds)
        if step.prefills:
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
        fitted = self.step_cost.fit(self.min_prefill_tokens)
        return Rates(
            load_bytes_per_s=0.0 if load is None else load.rate,
            load_samples=0 if load is None else load.samples,
            prefill_tokens_per_s=self.prefill.rate if fitted is None else 1.0 / fitted[1],
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
            count = blocks_from(blocks, local_tokens // block_size)
            if count <= 0:
                continue
            size = self.block_bytes(group)
            if size is None:
                return None
            total += count * size
        return int(total)
