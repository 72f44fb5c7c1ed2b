"""Every shipped alert links its runbook: a section of docs/runbooks.md that exists."""

from __future__ import annotations

import re

import yaml

from dashboards import alerts, generate

RULES_FILE = generate.ROOT / generate.CHART_FILES / generate.ALERTS_FILE
RUNBOOKS = generate.ROOT / alerts.RUNBOOKS_DOC
HEADING = re.compile(r"^(#{1,6}) (.+?)\s*$", re.MULTILINE)
LINK = re.compile(r"\]\(#([^)]+)\)")


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors() -> dict[str, str]:
    """Anchor -> heading of every heading in the runbooks."""
    return {github_anchor(h): h for _, h in HEADING.findall(RUNBOOKS.read_text())}


def shipped_rules() -> list[dict]:
    groups = yaml.safe_load(RULES_FILE.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def test_every_shipped_alert_links_its_own_runbook_section() -> None:
    found = anchors()
    rules = shipped_rules()
    assert {r["alert"] for r in rules} == {a.name for a in alerts.all_alerts()}
    for rule in rules:
        url = rule["annotations"]["runbook_url"]
        base, _, anchor = url.partition("#")
        assert base == alerts.RUNBOOKS_URL and base.endswith("/" + alerts.RUNBOOKS_DOC), url
        assert found.get(anchor) == rule["alert"], f"{rule['alert']}: no section #{anchor} in {RUNBOOKS}"


def test_every_runbook_section_is_a_shipped_alert_and_every_link_resolves() -> None:
    text = RUNBOOKS.read_text()
    sections = {h for level, h in HEADING.findall(text) if len(level) == 3}
    assert sections == {r["alert"] for r in shipped_rules()}, "a runbook without its alert, or twice"
    found = anchors()
    assert len(found) == len(HEADING.findall(text)), "two headings share an anchor"
    assert set(LINK.findall(text)) <= set(found)
