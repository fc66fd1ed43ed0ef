"""Small builders for Grafana dashboard JSON (schemaVersion 39), plain dicts.

Every query is a Prometheus expression that may use Grafana's `$model`,
`$__rate_interval` and `$__range`; `expand()` substitutes them so tests can send
the same expression to Prometheus.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
GRID_WIDTH = 24


@dataclass(frozen=True)
class Target:
    expr: str
    legend: str = ""
    instant: bool = False


@dataclass(frozen=True)
class Panel:
    title: str
    description: str
    targets: tuple[Target, ...]
    kind: str = "timeseries"
    unit: str = "short"
    width: int = 12
    height: int = 8
    stacked: bool = False


@dataclass(frozen=True)
class Dashboard:
    uid: str
    title: str
    description: str
    panels: tuple[Panel, ...]
    model_variable: bool = False
    tags: tuple[str, ...] = field(default=("wakegate",))


def expand(expr: str, *, model: str = ".+", rate_interval: str = "1m", range_: str = "5m") -> str:
    """The expression Grafana would send, with its variables replaced."""
    return (
        expr.replace("$__rate_interval", rate_interval)
        .replace("$__range", range_)
        .replace("$model", model)
    )


def _panel_json(panel: Panel, panel_id: int, x: int, y: int) -> dict[str, Any]:
    custom: dict[str, Any] = {}
    if panel.kind == "timeseries":
        custom = {
            "drawStyle": "line",
            "fillOpacity": 10,
            "lineWidth": 1,
            "showPoints": "never",
            "spanNulls": False,
            "stacking": {"group": "A", "mode": "normal" if panel.stacked else "none"},
        }
    options: dict[str, Any] = {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True}}
    if panel.kind in ("stat", "bargauge"):
        options = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}}
        if panel.kind == "bargauge":
            options["orientation"] = "horizontal"
    return {
        "id": panel_id,
        "type": panel.kind,
        "title": panel.title,
        "description": panel.description,
        "datasource": DATASOURCE,
        "gridPos": {"h": panel.height, "w": panel.width, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": panel.unit, "custom": custom}, "overrides": []},
        "options": options,
        "targets": [
            {
                "datasource": DATASOURCE,
                "refId": chr(ord("A") + index),
                "expr": target.expr,
                "legendFormat": target.legend or "__auto",
                "instant": target.instant,
                "range": not target.instant,
            }
            for index, target in enumerate(panel.targets)
        ],
    }


def _variables(dashboard: Dashboard) -> list[dict[str, Any]]:
    variables: list[dict[str, Any]] = [
        {
            "name": "datasource",
            "label": "Data source",
            "type": "datasource",
            "query": "prometheus",
            "current": {},
            "hide": 0,
        }
    ]
    if dashboard.model_variable:
        query = "label_values(wakegate_gateway_requests_total, model)"
        variables.append(
            {
                "name": "model",
                "label": "Model",
                "type": "query",
                "datasource": DATASOURCE,
                "query": {"query": query, "refId": "model"},
                "definition": query,
                "refresh": 2,
                "includeAll": True,
                "allValue": ".+",
                "multi": True,
                "sort": 1,
                "current": {},
                "hide": 0,
            }
        )
    return variables


def render(dashboard: Dashboard) -> dict[str, Any]:
    panels = []
    x = y = row_height = 0
    for panel_id, panel in enumerate(dashboard.panels, start=1):
        if x + panel.width > GRID_WIDTH:
            x, y, row_height = 0, y + row_height, 0
        panels.append(_panel_json(panel, panel_id, x, y))
        x += panel.width
        row_height = max(row_height, panel.height)
    return {
        "uid": dashboard.uid,
        "title": dashboard.title,
        "description": dashboard.description,
        "tags": list(dashboard.tags),
        "editable": True,
        "graphTooltip": 1,
        "refresh": "30s",
        "schemaVersion": 39,
        "time": {"from": "now-1h", "to": "now"},
        "timezone": "browser",
        "templating": {"list": _variables(dashboard)},
        "annotations": {"list": []},
        "links": [
            {"title": "wakegate", "type": "dashboards", "tags": ["wakegate"], "asDropdown": True}
        ],
        "panels": panels,
    }
