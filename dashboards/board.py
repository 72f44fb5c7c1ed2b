"""A thin layer over grafana-foundation-sdk: one dashboard, its variables, rows and panels."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from grafana_foundation_sdk.builders import dashboard, prometheus, stat, timeseries
from grafana_foundation_sdk.builders.common import StackingConfig
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import StackingMode, VisibilityMode
from grafana_foundation_sdk.models.dashboard import (
    DashboardCursorSync,
    DashboardLinkType,
    DataSourceRef,
    DynamicConfigValue,
    ValueMap,
    ValueMappingResult,
    VariableOption,
    VariableRefresh,
    VariableSort,
)

from dashboards.conventions import ALL_VALUE, DASHBOARD_TAG, VAR_DATASOURCE, VARIABLE_LABELS

DATASOURCE = DataSourceRef(type_val="prometheus", uid=f"${{{VAR_DATASOURCE}}}")


@dataclass(frozen=True)
class Target:
    """One PromQL query of a panel and its legend; ``unit``: its own, where it is not the panel's."""

    expr: str
    legend: str = ""
    unit: str = ""


@dataclass(frozen=True)
class Variable:
    """A query variable: the label values of ``label`` on ``metric{selector}``; with several
    metrics, on any of them (a value any one of them carries is listed)."""

    name: str
    label: str
    metric: str | tuple[str, ...]
    selector: str = ""

    @property
    def query(self) -> str:
        if isinstance(self.metric, str):
            return f"label_values({self.metric}{self.selector}, {self.label})"
        matchers = [f'__name__=~"{"|".join(self.metric)}"']
        if self.selector:
            matchers.append(self.selector[1:-1])
        return f"label_values({{{', '.join(matchers)}}}, {self.label})"


class Board:
    """A dashboard under construction; panels are numbered in the order they are added."""

    def __init__(self, uid: str, title: str, description: str, variables: Sequence[Variable]):
        self._next_id = 1
        self.builder = (
            dashboard.Dashboard(title)
            .uid(uid)
            .description(description)
            .tags([DASHBOARD_TAG])
            .editable()
            .tooltip(DashboardCursorSync.CROSSHAIR)
            .refresh("30s")
            .time("now-1h", "now")
            .timezone("browser")
            .link(
                dashboard.DashboardLink("KV pool dashboards")
                .type(DashboardLinkType.DASHBOARDS)
                .tags([DASHBOARD_TAG])
                .as_dropdown(True)
                .include_vars(True)
                .keep_time(True)
            )
            .with_variable(
                dashboard.DatasourceVariable(VAR_DATASOURCE)
                .label("Data source")
                .type("prometheus")
                .current(VariableOption(selected=True, text="default", value="default"))
            )
        )
        for var in variables:
            assert VARIABLE_LABELS[var.name] == var.label, var
            self.builder.with_variable(
                dashboard.QueryVariable(var.name)
                .label(var.name.capitalize())
                .datasource(DATASOURCE)
                .query({"query": var.query, "refId": "StandardVariableQuery"})
                .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
                .sort(VariableSort.ALPHABETICAL_ASC)
                .multi(True)
                .include_all(True)
                .all_value(ALL_VALUE)
                .current(VariableOption(selected=True, text=["All"], value=["$__all"]))
            )

    def row(self, title: str) -> Board:
        self.builder.with_row(dashboard.Row(title).id(self._take_id()))
        return self

    def _take_id(self) -> int:
        panel_id, self._next_id = self._next_id, self._next_id + 1
        return panel_id

    def _targets(self, panel: Any, targets: Sequence[Target], instant: bool = False) -> None:
        for i, target in enumerate(targets):
            query = (
                prometheus.Dataquery()
                .expr(target.expr)
                .legend_format(target.legend or "__auto")
                .ref_id(chr(ord("A") + i))
                .datasource(DATASOURCE)
            )
            query = query.instant() if instant else query.range()
            panel.with_target(query)
            if target.unit:
                panel.override_by_query(
                    chr(ord("A") + i), [DynamicConfigValue(id_val="unit", value=target.unit)]
                )

    def timeseries(
        self,
        title: str,
        description: str,
        targets: Sequence[Target],
        unit: str = "short",
        width: int = 12,
        height: int = 8,
        min_value: float | None = 0,
        max_value: float | None = None,
        stacked: bool = False,
    ) -> Board:
        panel = (
            timeseries.Panel()
            .id(self._take_id())
            .title(title)
            .description(description)
            .datasource(DATASOURCE)
            .unit(unit)
            .span(width)
            .height(height)
            .fill_opacity(10)
            .show_points(VisibilityMode.NEVER)
        )
        if min_value is not None:
            panel.min(min_value)
        if max_value is not None:
            panel.max(max_value)
        if stacked:
            panel.stacking(StackingConfig().mode(StackingMode.NORMAL))
        self._targets(panel, targets)
        self.builder.with_panel(panel)
        return self

    def stat(
        self,
        title: str,
        description: str,
        targets: Sequence[Target],
        unit: str = "short",
        width: int = 6,
        height: int = 4,
        mappings: Mapping[int, str] | None = None,
    ) -> Board:
        panel = (
            stat.Panel()
            .id(self._take_id())
            .title(title)
            .description(description)
            .datasource(DATASOURCE)
            .unit(unit)
            .span(width)
            .height(height)
        )
        if mappings:
            options = {
                str(value): ValueMappingResult(text=text, index=i)
                for i, (value, text) in enumerate(sorted(mappings.items()))
            }
            panel.mappings([ValueMap(options=options)])
        self._targets(panel, targets, instant=True)
        self.builder.with_panel(panel)
        return self

    def to_dict(self) -> dict[str, Any]:
        return json.loads(JSONEncoder(sort_keys=True).encode(self.builder.build()))
