"""The Grafana dashboard and the Prometheus alert rules in deploy/ (issue 36): every metric
their PromQL names exists, among the afd_* metrics the collector emits (derived by running
it on a snapshot with every field set) or vLLM 0.32's own vllm:* metrics (derived from the
names vLLM's Prometheus stat logger defines, v1/metrics/loggers.py); the rules file has
Prometheus's rule-file structure. promtool is not installed here: its own check is not run."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.vllm  # prometheus_client comes with vLLM

DASHBOARD = REPO / "deploy" / "grafana" / "afd-dashboard.json"
ALERTS = REPO / "deploy" / "prometheus" / "afd-alerts.yaml"
SUFFIXES = ("_total", "_bucket", "_sum", "_count", "_created")


def afd_sample_names(tmp_path: Path) -> set[str]:
    from prometheus_client import CollectorRegistry

    from afd_core.metrics import AFDCollector, RoleMetrics

    for role in ("attention", "ffn"):
        m = RoleMetrics(role, 0, str(tmp_path))
        m.set_peers([0], True)
        m.count_step(False, 0.01)
        m.add_bytes(0, 1, 1)
        m.exchange_wait.observe(0.001)
        m.rows.observe(4)
        m.publish(now=True)
    registry = CollectorRegistry()
    registry.register(AFDCollector(str(tmp_path)))
    return {s.name for family in registry.collect() for s in family.samples}


def vllm_metric_names() -> set[str]:
    """vllm:* names vLLM's stat logger defines (name="vllm:..."), with the sample suffixes
    prometheus_client adds."""
    import vllm.v1.metrics.loggers as loggers

    tree = ast.parse(Path(loggers.__file__).read_text())
    names = {
        kw.value.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        for kw in node.keywords
        if kw.arg == "name"
        and isinstance(kw.value, ast.Constant)
        and str(kw.value.value).startswith("vllm:")
    }
    assert "vllm:num_requests_running" in names, "vLLM's loggers moved: update this test"
    return names | {n + s for n in names for s in SUFFIXES}


def referenced(expr: str) -> set[str]:
    """The afd_* and vllm:* metric names of a PromQL expression (not label names)."""
    expr = re.sub(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'', "", expr)  # strings
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    clause = r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)"
    expr = re.sub(clause, "", expr)  # label lists
    return set(re.findall(r"(?<![\w:])(afd_\w+|vllm:[\w:]+)", expr))


def dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    for var in dash["templating"]["list"]:
        query = var.get("query")
        if isinstance(query, dict):
            exprs.append(query["query"])
    return exprs


def alert_rules() -> list[dict]:
    import yaml

    return [
        rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]
    ]


def test_the_dashboard_and_the_alerts_name_only_metrics_that_exist(tmp_path):
    emitted = afd_sample_names(tmp_path)
    assert {"afd_info", "afd_step_duration_seconds_bucket", "afd_bytes_sent_total",
            "afd_last_step_age_seconds"} <= emitted  # fmt: skip
    known = emitted | vllm_metric_names()
    exprs = dashboard_exprs() + [rule["expr"] for rule in alert_rules()]
    names = set().union(*map(referenced, exprs))
    assert not names - known, f"unknown metrics: {sorted(names - known)}"
    # each of the collector's metric families shows on the dashboard
    families = {re.sub(r"_(bucket|sum|count|total)$", "", n) for n in emitted}
    shown = {re.sub(r"_(bucket|sum|count|total)$", "", n) for n in names}
    assert families <= shown, f"not on the dashboard: {sorted(families - shown)}"


def test_the_name_check_sees_a_metric_that_does_not_exist():
    assert referenced('rate(afd_nope_total{role="ffn"}[5m]) and on (afd_version) vllm:x') == {
        "afd_nope_total",
        "vllm:x",
    }


def test_the_alert_rules_are_a_prometheus_rule_file():
    import yaml

    doc = yaml.safe_load(ALERTS.read_text())
    assert set(doc) == {"groups"}
    assert {g["name"] for g in doc["groups"]} == {"afd"}
    for group in doc["groups"]:
        assert set(group) <= {"name", "interval", "limit", "rules"}
        for rule in group["rules"]:
            assert set(rule) <= {"alert", "expr", "for", "keep_firing_for", "labels", "annotations"}
            assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", rule["alert"]), rule["alert"]
            assert isinstance(rule["expr"], str) and rule["expr"].strip()
            assert re.fullmatch(r"\d+[smhdwy]", rule["for"]), rule["for"]
            assert rule["labels"]["severity"] in {"warning", "critical"}
            assert {"summary", "description"} <= set(rule["annotations"])
            assert rule["expr"].count("(") == rule["expr"].count(")"), rule["alert"]
    alerts = {r["alert"] for r in alert_rules()}
    assert alerts == {"AFDFFNRankLost", "AFDPeerDown", "AFDExchangeWaitHigh", "AFDStepStuck",
                      "AFDStepFailures"}  # fmt: skip


def test_the_dashboard_is_grafana_json():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"] and dash["schemaVersion"] >= 30
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        assert p["targets"] and all(t["expr"] for t in p["targets"]), p["title"]
