"""Job deadlines, on a clock the test moves (no sleeping on deadlines)."""

from __future__ import annotations

import threading

from kvpool.connector.integrity.deadlines import Job, JobBoard, JobState


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_job_is_overdue_only_without_progress() -> None:
    clock = Clock()
    job = Job("load", 1.0, clock)
    clock.now += 0.9
    job.progress()
    clock.now += 0.9
    assert not job.overdue()
    clock.now += 0.2
    assert job.overdue()
    assert not job.wait(), "waiting on an overdue job returns at once"


def test_an_abandoned_job_touches_no_block_and_publishes_nothing() -> None:
    job = Job("save", 1.0, Clock())
    assert job.abandon()
    assert not job.abandon(), "given up once"
    assert not job.begin_touch()
    assert not job.may_publish()
    assert not job.finish(True)
    assert job.stuck, "abandoned and not returned: its call may still be in flight"
    job.returned()
    assert not job.stuck


def test_abandon_waits_for_a_copy_in_progress_then_wins() -> None:
    job = Job("load", 1.0, Clock())
    assert job.begin_touch()
    abandoned: list[bool] = []
    waiter = threading.Thread(target=lambda: abandoned.append(job.abandon()))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive(), "the waiter waits while the job copies"
    job.end_touch()
    waiter.join(5)
    assert abandoned == [True]
    assert not job.begin_touch(), "no copy after it was given up"


def test_a_finished_job_cannot_be_abandoned() -> None:
    job = Job("load", 1.0, Clock())
    assert job.begin_touch()
    assert job.finish(True)
    assert not job.abandon()
    assert job.state is JobState.DONE and job.wait()


def test_a_save_releases_its_blocks_before_it_is_done() -> None:
    job = Job("save", 1.0, Clock())
    assert job.begin_touch()
    job.end_touch(last=True)
    assert job.wait(until_released=True)
    assert not job.done


def test_the_board_is_stalled_while_an_abandoned_job_has_not_returned() -> None:
    clock = Clock()
    board = JobBoard()
    stuck, fine = Job("save", 1.0, clock), Job("save", 5.0, clock)
    board.add(stuck)
    board.add(fine)
    clock.now += 2.0
    assert board.abandon_overdue() == [stuck]
    assert board.stalled
    stuck.returned()
    board.remove(stuck)
    assert not board.stalled
