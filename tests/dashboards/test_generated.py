"""The committed dashboards and alerts are what the generator renders, and promtool accepts the rules."""

from __future__ import annotations

import json
import shutil
import subprocess

import yaml

from dashboards.build import ALERTS_FILE, DASHBOARD_DIR, stale
from dashboards.definitions import DASHBOARDS
from tests.support.required import missing


def test_generated_files_are_up_to_date() -> None:
    assert stale() == [], "run `python scripts/gen_dashboards.py` and commit the result"


def test_dashboards_have_unique_panel_ids_and_a_query_per_panel() -> None:
    for dashboard in DASHBOARDS:
        rendered = json.loads((DASHBOARD_DIR / f"{dashboard.uid}.json").read_text())
        ids = [panel["id"] for panel in rendered["panels"]]
        assert len(ids) == len(set(ids)), dashboard.uid
        for panel in rendered["panels"]:
            assert panel["targets"], f"{dashboard.uid}: {panel['title']} has no query"
            assert all(target["expr"] for target in panel["targets"])
            assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24


def test_rule_file_names_every_alert_of_the_issue() -> None:
    rules = yaml.safe_load(ALERTS_FILE.read_text())["groups"][0]["rules"]
    names = {rule["alert"] for rule in rules}
    assert {
        "WakegateActivationTimeouts",
        "WakegateModelStuckLoading",
        "WakegateModelCrashLooping",
        "WakegateQueueSaturated",
        "WakegateScalerMembersExpiring",
        "WakegateGatewayErrorRatio",
    } <= names
    assert all(rule["labels"]["severity"] in ("warning", "critical") for rule in rules)


def test_promtool_check_rules() -> None:
    if shutil.which("promtool") is None:
        missing("promtool missing: apt-get install prometheus (scripts/test installs it)")
    out = subprocess.run(["promtool", "check", "rules", str(ALERTS_FILE)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout
