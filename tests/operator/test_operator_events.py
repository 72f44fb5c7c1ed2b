"""kopf posts no log line as an Event: a pool's Events are the operator's own (a handler's
outcome or an exception text never lands where every reader of Events sees it)."""

from __future__ import annotations

from typing import Any

import pytest

from kvpool.operator.names import EVENTS
from testing.kube_api import Cluster, eventually
from testing.operator_objects import Operator, converge, pool_manifest, vllm_deployment


def all_events(cluster: Cluster) -> list[dict[str, Any]]:
    return [
        obj.raw
        for (resource, _, _), obj in list(cluster.api.objects.items())
        if resource.plural == EVENTS.plural and not obj.deleted
    ]


@pytest.mark.asyncio
async def test_only_the_operators_own_events_are_posted(cluster: Cluster, operator: Operator) -> None:
    await cluster.create(vllm_deployment())
    await cluster.create(pool_manifest())
    await converge(cluster, generation=1)
    await eventually(lambda: cluster.events("ConsumerUpdated"), what="the operator's own Event")
    await cluster.quiet("pool")
    reasons = {event["reason"] for event in all_events(cluster)}
    assert "Logging" not in reasons, reasons  # kopf's "Handler 'create' succeeded." and the like


def test_kopf_is_told_to_post_no_log_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever kopf's default (before 1.44 it posted every log line of a handler)."""
    import kopf

    from kvpool.operator import app

    original = kopf.OperatorSettings

    def posting_log_lines() -> kopf.OperatorSettings:
        settings = original()
        settings.posting.loggers = True  # kopf 1.43's default
        return settings

    monkeypatch.setattr(app.kopf, "OperatorSettings", posting_log_lines)
    settings = app.kopf_settings(app.OperatorOptions())
    assert settings.posting.loggers is False
    assert settings.posting.enabled is True  # the operator's own Events (kopf.event) still go out


def test_kopf_is_at_least_1_44() -> None:
    import tomllib
    from pathlib import Path

    from packaging.requirements import Requirement

    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    (kopf,) = [
        Requirement(r)
        for r in pyproject["project"]["optional-dependencies"]["operator"]
        if r.startswith("kopf")
    ]
    assert "1.43.9" not in kopf.specifier and "1.44.0" in kopf.specifier
