"""The chaos run's fault schedule: seeded, every kind as often as asked, never two of a kind at once."""

from __future__ import annotations

from collections import Counter
from itertools import pairwise

import pytest

from testing.chaos_schedule import HOLDS, FaultKind, PlannedFault, overlapping, plan

KINDS = list(FaultKind)


def long_run(seed: int) -> list[PlannedFault]:
    return plan(
        seed,
        start=60.0,
        end=1200.0,
        kinds=KINDS,
        per_kind=4,
        targets={
            FaultKind.STORE_FROZEN: 2,
            FaultKind.SERVER_RESTARTED: 3,
            FaultKind.ETCD_MEMBER_RESTARTED: 3,
        },
    )


def test_the_same_seed_plans_the_same_faults_and_another_seed_others() -> None:
    assert long_run(1) == long_run(1)
    assert long_run(1) != long_run(2)


@pytest.mark.parametrize("seed", range(20))
def test_every_kind_is_planned_as_often_as_asked_in_the_window(seed: int) -> None:
    faults = long_run(seed)
    assert Counter(f.kind for f in faults) == {kind: 4 for kind in KINDS}
    assert all(f.at >= 60.0 for f in faults)
    assert [f.at for f in faults] == sorted(f.at for f in faults)
    # Only a fault moved past another of its kind starts after the window, by at most that hold.
    longest = max(high for _, high in HOLDS.values())
    assert all(f.at < 1200.0 + longest + 1.0 for f in faults)


@pytest.mark.parametrize("seed", range(20))
def test_holds_are_in_range_and_targets_exist(seed: int) -> None:
    faults = long_run(seed)
    for fault in faults:
        low, high = HOLDS[fault.kind]
        assert low <= fault.hold <= high
    assert all(1.0 <= f.hold <= 20.0 for f in faults if f.kind == FaultKind.STORE_FROZEN)
    assert {f.target for f in faults if f.kind == FaultKind.STORE_FROZEN} <= {0, 1}
    assert {f.target for f in faults if f.kind == FaultKind.SERVER_RESTARTED} <= {0, 1, 2}
    assert {f.target for f in faults if f.kind == FaultKind.LEADER_KILLED} == {0}


@pytest.mark.parametrize("seed", range(20))
def test_two_faults_of_one_kind_never_overlap(seed: int) -> None:
    for earlier, later in overlapping(long_run(seed)):
        assert earlier.kind != later.kind, (earlier, later)
    for kind in KINDS:
        of_kind = [f for f in long_run(seed) if f.kind == kind]
        assert all(b.at >= a.until + 1.0 for a, b in pairwise(of_kind))


def test_faults_of_different_kinds_sometimes_overlap() -> None:
    assert all(overlapping(long_run(seed)) for seed in range(10))
    assert not overlapping(
        plan(3, start=0.0, end=1000.0, kinds=KINDS, per_kind=2, overlap_chance=0.0, max_hold=5.0)
    )


def test_a_short_run_caps_holds_and_still_plans_every_kind() -> None:
    faults = plan(7, start=20.0, end=150.0, kinds=KINDS, per_kind=1, max_hold=6.0)
    assert sorted(f.kind for f in faults) == sorted(KINDS)
    assert all(f.hold <= 6.0 for f in faults)


def test_an_empty_window_is_refused() -> None:
    with pytest.raises(ValueError):
        plan(1, start=10.0, end=10.0, kinds=KINDS, per_kind=1)
    with pytest.raises(ValueError):
        plan(1, start=0.0, end=10.0, kinds=[], per_kind=1)
