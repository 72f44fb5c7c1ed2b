"""Every shipped alert has a runbook, a section of docs/runbooks.md; where that document is
served is the installer's (``monitoring.prometheusRule.runbookBaseUrl``), so the chart adds
each alert's ``runbook_url`` only when it is set, never a guessed address."""

from __future__ import annotations

import re
from typing import Any

from dashboards import alerts, generate
from tests.chart.helm import Helm, one
from tests.chart.test_chart_monitoring import MONITORING

RUNBOOKS = generate.ROOT / alerts.RUNBOOKS_DOC
HEADING = re.compile(r"^(#{1,6}) (.+?)\s*$", re.MULTILINE)
LINK = re.compile(r"\]\(#([^)]+)\)")
BASE = "https://docs.example.org/mooncake-kvpool/runbooks.md"


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors() -> dict[str, str]:
    """Anchor -> heading of every heading in the runbooks."""
    return {github_anchor(h): h for _, h in HEADING.findall(RUNBOOKS.read_text())}


def rendered_rules(helm: Helm, *sets: str) -> list[dict[str, Any]]:
    rule = one(helm.template(MONITORING, sets=sets), "PrometheusRule")
    return [r for group in rule["spec"]["groups"] for r in group["rules"]]


def test_with_a_base_url_every_alert_links_its_own_runbook_section(helm: Helm) -> None:
    found = anchors()
    rules = rendered_rules(helm, f"monitoring.prometheusRule.runbookBaseUrl={BASE}")
    assert {r["alert"] for r in rules} == {a.name for a in alerts.all_alerts()}
    for rule in rules:
        base, _, anchor = rule["annotations"]["runbook_url"].partition("#")
        assert base == BASE
        assert found.get(anchor) == rule["alert"], f"{rule['alert']}: no section #{anchor} in {RUNBOOKS}"


def test_without_one_no_alert_names_an_address(helm: Helm) -> None:
    assert all("runbook_url" not in r["annotations"] for r in rendered_rules(helm))


def test_every_runbook_section_is_a_shipped_alert_and_every_link_resolves() -> None:
    text = RUNBOOKS.read_text()
    sections = {h for level, h in HEADING.findall(text) if len(level) == 3}
    assert sections == {a.name for a in alerts.all_alerts()}, "a runbook without its alert, or twice"
    assert {a.runbook_anchor for a in alerts.all_alerts()} <= set(anchors())
    found = anchors()
    assert len(found) == len(HEADING.findall(text)), "two headings share an anchor"
    assert set(LINK.findall(text)) <= set(found)
