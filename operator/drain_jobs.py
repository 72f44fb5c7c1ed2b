"""Mooncake's drain jobs, asked of a pool's own master over its admin API (with a deadline).

A drain job (``POST /api/v1/drain_jobs``, Mooncake 0.3.13) turns the named segments
``DRAINING``: the master places no new object on them and moves the objects they hold to the
other segments (the stores copy them), then turns each ``DRAINED``. ``/query`` says how far it
is, ``/cancel`` gives a job that has not finished its segments back (``OK``). Checked against
a real master and two stores (tests/operator/test_store_drain.py).

Only the operator's observation timer calls these, at the pool's own master Service (the
port its poll already reads, which the pool's NetworkPolicy lets the operator reach): each
call within ``timeout`` seconds, no redirect followed, at most ``MAX_BODY`` bytes read.
"""

from __future__ import annotations

import json
import urllib.parse
from dataclasses import dataclass
from typing import Any

import aiohttp

CREATE_PATH = "/api/v1/drain_jobs"
QUERY_PATH = "/api/v1/drain_jobs/query"
CANCEL_PATH = "/api/v1/drain_jobs/cancel"
MAX_BODY = 1 << 16
SUCCEEDED, FAILED, CANCELED = "SUCCEEDED", "FAILED", "CANCELED"
FINISHED = frozenset((SUCCEEDED, FAILED, CANCELED))


class DrainRefused(Exception):
    """The master did not take the request, or did not answer within the deadline."""


@dataclass(frozen=True)
class DrainJob:
    """A drain job as the master reports it."""

    job_id: str
    status: str  # CREATED, PLANNING, RUNNING, SUCCEEDED, FAILED, CANCELED
    moved_objects: int = 0
    failed_objects: int = 0
    blocked_objects: int = 0
    moving_objects: int = 0
    moved_bytes: int = 0
    message: str = ""

    @property
    def finished(self) -> bool:
        return self.status in FINISHED


def _count(answer: dict[str, Any], key: str) -> int:
    value = answer.get(key, 0)
    return value if isinstance(value, int) and value >= 0 else 0


def parse_job(job_id: str, answer: dict[str, Any]) -> DrainJob:
    """A ``/query`` answer (its ``status_name`` and unit counts)."""
    return DrainJob(
        job_id=job_id,
        status=str(answer.get("status_name", "")),
        moved_objects=_count(answer, "succeeded_units"),
        failed_objects=_count(answer, "failed_units"),
        blocked_objects=_count(answer, "blocked_units"),
        moving_objects=_count(answer, "active_units"),
        moved_bytes=_count(answer, "migrated_bytes"),
        message=str(answer.get("message", ""))[:200],
    )


async def _call(method: str, url: str, timeout: float, body: dict[str, Any] | None = None) -> dict[str, Any]:
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session,
            session.request(method, url, json=body, allow_redirects=False) as response,
        ):
            raw = await response.content.read(MAX_BODY + 1)
            status = response.status
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise DrainRefused(f"{url}: {type(exc).__name__}: {exc}") from exc
    if len(raw) > MAX_BODY:
        raise DrainRefused(f"{url} answered more than {MAX_BODY} bytes")
    try:
        answer = json.loads(raw)
    except ValueError as exc:
        raise DrainRefused(f"{url} answered HTTP {status} with no JSON") from exc
    if not isinstance(answer, dict):
        raise DrainRefused(f"{url} answered HTTP {status} with no JSON object")
    if status != 200 or answer.get("success") is not True:
        detail = str(answer.get("error_message") or answer.get("message") or "")[:200]
        raise DrainRefused(f"{url} answered HTTP {status}, error {answer.get('error_code')}: {detail}")
    return answer


async def create_drain_job(base: str, segments: list[str], timeout: float) -> str:
    """Start draining ``segments`` at the master ``base`` (``http://host:port``); the job's id."""
    answer = await _call("POST", base + CREATE_PATH, timeout, {"segments": segments})
    job_id = answer.get("job_id")
    if not isinstance(job_id, str) or not job_id:
        raise DrainRefused(f"{base}{CREATE_PATH} answered no job_id")
    return job_id


async def query_drain_job(base: str, job_id: str, timeout: float) -> DrainJob:
    """How far the job is."""
    url = f"{base}{QUERY_PATH}?job_id={urllib.parse.quote(job_id, safe='')}"
    return parse_job(job_id, await _call("GET", url, timeout))


async def cancel_drain_job(base: str, job_id: str, timeout: float) -> None:
    """Give the job's segments back (a job that has finished refuses: ``DrainRefused``)."""
    await _call("POST", f"{base}{CANCEL_PATH}?job_id={urllib.parse.quote(job_id, safe='')}", timeout)
