"""Whether to load a request's pool hit or recompute it: a pure decision over measured rates.

Loading is not always faster than recomputing: where prefill is fast and KV large (a GPU
behind a slow link), a hit loads slower than the engine computes it. Per request, the
estimated time to load the hit (its bytes over the load rate the workers measured) is
weighed against the time to recompute it (its tokens over the engine's prefill rate); the
hit loads only when loading is faster by ``margin``. Until both rates rest on
``min_samples`` observations the hit loads (the connector's behaviour without a decision),
and ``load_policy`` forces either way.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class LoadPolicy(StrEnum):
    """``load_policy``: decide per request (auto), or load / recompute every hit."""

    AUTO = "auto"
    ALWAYS = "always"
    NEVER = "never"


class Basis(StrEnum):
    """Why a hit loads or recomputes (the ``basis`` label of the decision metrics)."""

    FORCED = "forced"  # load_policy always or never
    FLOOR = "floor"  # too few observations to trust the rates: load
    ESTIMATE = "estimate"  # the rates' estimates compared
    PROBE = "probe"  # recompute estimated faster, but loads again after PROBE_EVERY such hits


@dataclass(frozen=True)
class Rates:
    """The online rates a decision reads, with how many observations each rests on."""

    load_bytes_per_s: float = 0.0
    load_samples: int = 0
    prefill_tokens_per_s: float = 0.0  # marginal where known: what one more token costs a step
    prefill_samples: int = 0


@dataclass(frozen=True)
class Verdict:
    """One hit's decision, and the estimates it compared (None where it compared none)."""

    load: bool
    basis: Basis
    load_s: float | None = None
    recompute_s: float | None = None

    @property
    def labels(self) -> tuple[str, str]:
        """Its ``(decision, basis)`` labels of ``vllm:kvpool_load_decisions``."""
        return ("load" if self.load else "recompute", self.basis.value)


#: Hits recomputed in a row on the estimate after which one loads anyway: a load rate learned
#: during a slow spell would otherwise never be measured again.
PROBE_EVERY = 64

LOAD_FORCED = Verdict(True, Basis.FORCED)
RECOMPUTE_FORCED = Verdict(False, Basis.FORCED)
LOAD_ON_FLOOR = Verdict(True, Basis.FLOOR)

#: The labels of every verdict :func:`decide` can reach: it recomputes only when forced or on
#: the estimate.
VERDICT_LABELS: tuple[tuple[str, str], ...] = (
    *(("load", basis.value) for basis in Basis),
    ("recompute", Basis.FORCED.value),
    ("recompute", Basis.ESTIMATE.value),
)


def decide(
    policy: LoadPolicy,
    *,
    hit_tokens: int,
    hit_bytes: int | None,
    rates: Rates,
    margin: float,
    min_samples: int,
    recomputed_in_a_row: int = 0,
) -> Verdict:
    """Load or recompute a hit of ``hit_tokens`` tokens moving ``hit_bytes`` bytes (None: unknown).

    ``auto`` loads when ``load_s * (1 + margin) <= recompute_s`` (the hit's bytes at the load
    rate, its tokens at the prefill rate); with an unknown size, or a
    rate resting on fewer than ``min_samples`` observations (or none above zero), it loads.
    After ``recomputed_in_a_row`` reaches :data:`PROBE_EVERY`, a hit estimated cheaper to
    recompute loads anyway (basis probe), so the load rate is measured again.
    """
    if policy is LoadPolicy.ALWAYS:
        return LOAD_FORCED
    if policy is LoadPolicy.NEVER:
        return RECOMPUTE_FORCED
    if (
        hit_bytes is None
        or rates.load_samples < min_samples
        or rates.prefill_samples < min_samples
        or rates.load_bytes_per_s <= 0
        or rates.prefill_tokens_per_s <= 0
    ):
        return LOAD_ON_FLOOR
    load_s = hit_bytes / rates.load_bytes_per_s
    recompute_s = hit_tokens / rates.prefill_tokens_per_s
    if load_s * (1.0 + margin) <= recompute_s:
        return Verdict(True, Basis.ESTIMATE, load_s, recompute_s)
    if recomputed_in_a_row >= PROBE_EVERY:
        return Verdict(True, Basis.PROBE, load_s, recompute_s)
    return Verdict(False, Basis.ESTIMATE, load_s, recompute_s)
