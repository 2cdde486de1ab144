"""The shipped Grafana dashboard: it imports (the parts of Grafana's dashboard model an import
needs), every query names only metrics a real `watch` `/metrics` and a real `check --prom-file`
serve, every alert rule of the shipped rules has a panel, and promtool parses every query."""

from __future__ import annotations

import json
import re
import subprocess
from importlib import resources

import jsonschema
import yaml
from prometheus_client.parser import text_string_to_metric_families

from audit.rules import path as rules_path
from tests.helpers import run_cli
from tests.run.test_watch import watchers  # noqa: F401 (the fixture: real `watch` processes)
from tests.test_rules import needs_promtool, promtool

DASHBOARD_FILE = "mooncake-audit.dashboard.json"
# Grafana's own variables, filled in at query time: stand-ins promtool can parse.
BUILTIN_VARIABLES = {"__rate_interval": "5m", "__interval": "1m", "__range": "1d"}
UNQUERIED_PANELS = {"row", "text"}

_TARGET = {
    "type": "object",
    "required": ["refId", "expr", "datasource"],
    "properties": {"refId": {"type": "string", "minLength": 1}, "expr": {"type": "string", "minLength": 1}},
}
_PANEL = {
    "type": "object",
    "required": ["id", "type", "title", "gridPos"],
    "properties": {
        "id": {"type": "integer", "minimum": 1},
        "type": {"type": "string", "minLength": 1},
        "title": {"type": "string"},
        "gridPos": {
            "type": "object",
            "required": ["h", "w", "x", "y"],
            "properties": {"h": {"type": "integer", "minimum": 1},
                           "w": {"type": "integer", "minimum": 1, "maximum": 24},
                           "x": {"type": "integer", "minimum": 0, "maximum": 23},
                           "y": {"type": "integer", "minimum": 0}},
        },
        "datasource": {"type": "object", "required": ["type", "uid"]},
        "targets": {"type": "array", "items": _TARGET},
    },
    "if": {"properties": {"type": {"enum": sorted(UNQUERIED_PANELS)}}},
    "else": {"required": ["datasource", "targets"], "properties": {"targets": {"minItems": 1}}},
}
# What Grafana's import reads: a uid it can keep (at most 40 characters), a title, a schema version
# it migrates from, the datasource inputs it asks for, the variables, and the panels.
DASHBOARD_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["uid", "title", "schemaVersion", "panels", "templating", "__inputs"],
    "properties": {
        "uid": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,40}$"},
        "title": {"type": "string", "minLength": 1},
        "schemaVersion": {"type": "integer", "minimum": 36},
        "__inputs": {"type": "array", "items": {
            "type": "object", "required": ["name", "type", "pluginId"],
            "properties": {"type": {"const": "datasource"}, "pluginId": {"const": "prometheus"}}}},
        "templating": {
            "type": "object",
            "required": ["list"],
            "properties": {"list": {"type": "array", "items": {
                "type": "object", "required": ["name", "type"],
                "properties": {"name": {"type": "string", "pattern": r"^\w+$"},
                               "type": {"enum": ["datasource", "query", "custom", "textbox", "constant",
                                                 "interval"]}}}}},
        },
        "panels": {"type": "array", "minItems": 1, "items": _PANEL},
    },
}

_STRINGS = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`')
_GROUPINGS = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_MATCHERS_AND_RANGES = re.compile(r"\{[^}]*\}|\[[^\]]*\]")
_VARIABLES = re.compile(r"\$\{?(\w+)\}?")
_TOKENS = re.compile(r"(?<![\w:.])\d[\w.]*|([A-Za-z_:][\w:]*)(\s*\()?")
# Binary operators and modifiers spelled as words (aggregations are calls once their grouping is gone).
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "atan2", "inf", "nan"}
_LABEL_VALUES = re.compile(r"^label_values\((.+),\s*\w+\)$")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: what is left once strings, label matchers,
    ranges, groupings, variables, numbers, durations, calls and keywords are taken out."""
    for pattern in (_STRINGS, _GROUPINGS, _MATCHERS_AND_RANGES, _VARIABLES):
        expr = pattern.sub(" ", expr)
    return {match[1] for match in _TOKENS.finditer(expr)
            if match[1] and not match[2] and match[1].lower() not in _KEYWORDS}


def queries(dashboard: dict) -> dict[str, list[str]]:
    """Every PromQL query of the dashboard, by where it is: each panel's targets, and the metric
    selector of each `label_values(...)` variable."""
    found = {f"panel {panel['id']} {panel['title']!r}": [target["expr"] for target in panel.get("targets", [])]
             for panel in dashboard["panels"]}
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
            selector = _LABEL_VALUES.match(query)
            found[f"variable {variable['name']!r}"] = [selector[1] if selector else query]
    return found


def unserved(dashboard: dict, served: set[str]) -> dict[str, set[str]]:
    """Where a query names a metric that nothing in `served` is: place -> those names."""
    missing = {place: set().union(*map(metric_names, exprs)) - served for place, exprs in queries(dashboard).items()}
    return {place: names for place, names in missing.items() if names}


def load_dashboard() -> dict:
    return json.loads(resources.files("audit.rules").joinpath(DASHBOARD_FILE).read_text())


def sample_names(exposition: str) -> set[str]:
    """The series names Prometheus stores from a text exposition: a histogram's `_bucket`, `_sum`,
    `_count` and a counter's `_total`, not their family names."""
    return {sample.name for family in text_string_to_metric_families(exposition) for sample in family.samples}


def alert_rules() -> dict[str, str]:
    return {rule["alert"]: rule["expr"] for group in yaml.safe_load(rules_path().read_text())["groups"]
            for rule in group["rules"] if "alert" in rule}


def test_the_dashboard_ships_and_imports():
    dashboard = load_dashboard()
    jsonschema.validate(dashboard, DASHBOARD_SCHEMA)
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    assert all(panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24 for panel in dashboard["panels"])
    defined = {variable["name"] for variable in dashboard["templating"]["list"]} | set(BUILTIN_VARIABLES)
    text = json.dumps(dashboard)
    inputs = {found["name"] for found in dashboard["__inputs"]}
    assert {name for name in _VARIABLES.findall(text) if name.startswith("DS_")} <= inputs
    assert {name for name in _VARIABLES.findall(text) if not name.startswith("DS_")} <= defined
    # Queries go through the `datasource` variable, never the import input itself: a provisioned copy
    # (no import step fills DS_PROMETHEUS in) still finds a Prometheus.
    sources = [holder["datasource"] for panel in dashboard["panels"] for holder in [panel, *panel.get("targets", [])]
               if "datasource" in holder]
    assert sources and all(source["uid"] == "${datasource}" for source in sources)


def test_metric_names_leave_out_calls_labels_groupings_ranges_and_numbers():
    assert metric_names('histogram_quantile(0.95, sum by (job, le) (rate(a_bucket{job=~"$job"}[$__rate_interval])))'
                        ) == {"a_bucket"}
    assert metric_names('time() - b{reason="x y", le="1"} > 3600') == {"b"}
    assert metric_names("c and on (job, instance) d offset 5m") == {"c", "d"}
    assert metric_names('$period - e unless sum(f) by (le) / count_values("v", g) + vector(1e3) * 0x1f') == {
        "e", "f", "g"}


def test_a_query_of_a_metric_nothing_serves_is_reported():
    bad = {"panels": [{"id": 1, "title": "typo", "targets": [{"expr": "rate(mooncake_audit_bytes_scaned_total[5m])"}]},
                      {"id": 2, "title": "fine", "targets": [{"expr": "mooncake_audit_findings > 0"}]}],
           "templating": {"list": [{"name": "job", "type": "query",
                                    "query": "label_values(mooncake_audit_finding, job)"}]}}
    served = {"mooncake_audit_findings", "mooncake_audit_bytes_scanned_total"}
    assert unserved(bad, served) == {"panel 1 'typo'": {"mooncake_audit_bytes_scaned_total"},
                                     "variable 'job'": {"mooncake_audit_finding"}}


def test_every_query_names_a_metric_a_real_check_or_watch_serves(watchers, publisher, cli_args,  # noqa: F811
                                                                 namespace, tmp_path):
    publisher.put(f"{namespace}clean", b"\x01" * 4096)
    publisher.put(f"{namespace}zero", bytes(4096))
    prom = tmp_path / "mooncake_audit.prom"
    check = run_cli("check", *cli_args, "--prefix", namespace, "--prom-file", str(prom), "--no-progress")
    assert check.exit_code == 1, check.output
    (tmp_path / "watch").mkdir()
    watcher = watchers(cli_args, namespace, tmp_path / "watch")
    watched = watcher.wait_for(lambda metrics: metrics.get("mooncake_audit_findings") == 1)
    assert watcher.stop() == 0
    served_by_watch = {name.partition("{")[0] for name in watched}
    served = sample_names(prom.read_text()) | served_by_watch
    assert "mooncake_audit_watch_first_seen_to_verified_seconds_bucket" in served
    assert unserved(load_dashboard(), served) == {}


def test_every_alert_rule_has_a_panel_that_names_it_and_queries_its_metrics():
    panels = [panel for panel in load_dashboard()["panels"] if panel["type"] not in UNQUERIED_PANELS]
    for alert, expr in alert_rules().items():
        naming = [panel for panel in panels if re.search(rf"\b{alert}\b", panel.get("description", ""))]
        assert naming, f"no panel's description names {alert}"
        assert any(metric_names(expr) <= set().union(*(metric_names(t["expr"]) for t in panel["targets"]))
                   for panel in naming), f"no panel naming {alert} queries every metric of {expr!r}"


@needs_promtool
def test_promtool_parses_every_query(tmp_path):
    """Every panel query as a recording rule, Grafana's variables filled in: `promtool check rules`
    parses each expression as Prometheus would."""
    dashboard = load_dashboard()
    values = {**BUILTIN_VARIABLES, **{variable["name"]: variable.get("query") if variable["type"] == "textbox" else ".*"
                                     for variable in dashboard["templating"]["list"]}}
    rules = [{"record": f"dashboard:panel_{panel['id']}_{target['refId']}",
              "expr": _VARIABLES.sub(lambda variable: values[variable[1]], target["expr"])}
             for panel in dashboard["panels"] for target in panel.get("targets", [])]
    rules_file = tmp_path / "dashboard.rules.yml"
    rules_file.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    checked = subprocess.run([promtool, "check", "rules", str(rules_file)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
