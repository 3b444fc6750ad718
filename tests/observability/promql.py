"""What the dashboards and alert rules may query: the agent's metric names and labels, and the
labels a scrape adds. A small reader of the PromQL they use (selectors, label clauses)."""

from __future__ import annotations

import re

from prometheus_client.metrics import MetricWrapperBase

from agent.observe.metrics import Metrics

SCRAPE_LABELS = frozenset({"job", "instance"})
"""Labels Prometheus gives every scraped series."""
CHART_LABELS = frozenset({"node"})
"""Labels the chart's ServiceMonitor and PodMonitor add (templates/_monitoring.tpl)."""
PROMETHEUS_SERIES = {"up": frozenset[str]()}
"""Series Prometheus itself adds to every target."""
PROMQL_WORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool",
    "offset", "le", "inf", "nan", "vector", "time",
}  # fmt: skip
_SAMPLES: dict[str, tuple[tuple[str, frozenset[str]], ...]] = {
    "histogram": (("_bucket", frozenset({"le"})), ("_count", frozenset()), ("_sum", frozenset())),
    "counter": (("_total", frozenset()),),
    "info": (("_info", frozenset()),),
    "gauge": (("", frozenset()),),
}
"""Sample names and extra labels per metric type (counters lose ``_total`` in their family name)."""
_SELECTOR = re.compile(r"([a-zA-Z_:][\w:]*)\s*\{([^}]*)\}")
_MATCHER = re.compile(r"(\w+)\s*(?:=~|!~|!=|=)")
_CLAUSE = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")


def exported_labels() -> dict[str, frozenset[str]]:
    """Every sample name the agent's /metrics can show, with its label names."""
    found: dict[str, frozenset[str]] = dict(PROMETHEUS_SERIES)
    for metric in vars(Metrics()).values():
        if not isinstance(metric, MetricWrapperBase):
            continue
        for suffix, extra in _SAMPLES[str(metric._type)]:
            found[metric._name + suffix] = frozenset(metric._labelnames) | extra
    return found


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (not functions, labels, keywords or variables)."""
    text = re.sub(r'"[^"]*"', "", expr)
    text = re.sub(r"\{[^}]*\}", "", text)
    text = re.sub(r"\[[^\]]*\]", "", text)
    text = _CLAUSE.sub("", text)
    text = re.sub(r"\$\w+", "", text)
    found = set()
    for match in re.finditer(r"(?<![\w.])([a-zA-Z_:][\w:]*)(\s*\()?", text):
        name, call = match.group(1), match.group(2)
        if not call and name.lower() not in PROMQL_WORDS:
            found.add(name)
    return found


def unknown_labels(expr: str, exported: dict[str, frozenset[str]], extra: set[str] | None = None) -> set[str]:
    """Labels `expr` (or `extra`, e.g. a legend's) uses that neither its metrics nor a scrape through
    the chart give: in a selector, those of that metric; in by/on/... clauses, those of any."""
    allowed = SCRAPE_LABELS | CHART_LABELS
    unknown: set[str] = set()
    for name, matchers in _SELECTOR.findall(expr):
        unknown |= set(_MATCHER.findall(matchers)) - exported.get(name, frozenset()) - allowed
    anywhere = allowed.union(*(exported.get(name, frozenset()) for name in metric_names(expr)))
    for clause in _CLAUSE.findall(expr):
        unknown |= {label.strip() for label in clause.split(",") if label.strip()} - anywhere
    return unknown | ((extra or set()) - anywhere)
