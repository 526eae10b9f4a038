"""The chart's Grafana dashboard (``charts/gearshift/dashboards/gearshift.json``) read as its PromQL: every
panel target, and the query Grafana would send once the dashboard's variables are filled in.

Pure (the file is read by :func:`load` only). The chart's unit tests check the dashboard's shape and that
every expression parses; the e2e test runs each one against the sandbox's Prometheus during a demo.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gearshift.dev.sandbox.layout import REPO_ROOT

#: The dashboard the chart ships (``dashboards.enabled`` renders it into a ConfigMap).
DASHBOARD = REPO_ROOT / "charts" / "gearshift" / "dashboards" / "gearshift.json"

_VARIABLE = re.compile(r"\$(?:\{(\w+)(?::\w+)?\}|(\w+))")


@dataclass(frozen=True)
class PanelTarget:
    """One query of one panel."""

    panel: str
    """The panel's title."""
    ref_id: str
    expr: str
    """The PromQL as stored, with Grafana's variables (``$namespace``, ``$__rate_interval``...)."""
    legend: str


def load(path: Path = DASHBOARD) -> dict[str, Any]:
    """The dashboard document.

    Raises:
        OSError: the file cannot be read.
        ValueError: it is not JSON.
    """
    doc = json.loads(path.read_text())
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: a dashboard is a JSON object")
    return doc


def panels(doc: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every panel but rows, including those folded into a collapsed row, in the file's order."""
    out: list[dict[str, Any]] = []
    for p in doc.get("panels") or []:
        if p.get("type") == "row":
            out += [q for q in p.get("panels") or [] if q.get("type") != "row"]
        else:
            out.append(p)
    return out


def panel_targets(doc: Mapping[str, Any]) -> list[PanelTarget]:
    """Every target of every panel (:func:`panels`), hidden ones included."""
    return [
        PanelTarget(
            str(p.get("title", "")),
            str(t.get("refId", "")),
            str(t.get("expr", "")),
            str(t.get("legendFormat", "")),
        )
        for p in panels(doc)
        for t in p.get("targets") or []
    ]


def fill(expr: str, variables: Mapping[str, str]) -> str:
    """``expr`` with Grafana's ``$name`` and ``${name}`` variables replaced from ``variables`` (e.g.
    ``namespace``, ``service``, ``__rate_interval``).

    Raises:
        KeyError: ``expr`` uses a variable ``variables`` does not give, named.
    """

    def one(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        if name not in variables:
            raise KeyError(f"variable ${name} has no value (given: {sorted(variables)})")
        return variables[name]

    return _VARIABLE.sub(one, expr)
