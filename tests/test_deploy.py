"""deploy/: the manifests the kustomize base lists pass kubernetes-validate (strict, against a current
Kubernetes schema); the DaemonSet asks for the privileges the guide justifies and no more; the
scrape config and the dashboard use metrics the exporter serves."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gputrace.exporter import metrics

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
KUSTOMIZE = DEPLOY / "kustomize"


def resources() -> list[Path]:
    k = yaml.safe_load((KUSTOMIZE / "kustomization.yaml").read_text())
    return [KUSTOMIZE / r for r in k["resources"]]


def test_manifests_pass_kubernetes_validate():
    """kubernetes-validate comes with the dev extra: CI runs this, it does not skip."""
    files = resources()
    assert files and all(f.exists() for f in files)
    tool = Path(sys.executable).parent / "kubernetes-validate"
    r = subprocess.run([str(tool), "--strict", "-k", "1.33.0", *map(str, files)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "INFO" in r.stdout and "ERROR" not in r.stdout


def test_the_daemonset_asks_for_what_the_guide_justifies():
    ds = yaml.safe_load((KUSTOMIZE / "daemonset.yaml").read_text())
    pod = ds["spec"]["template"]["spec"]
    assert pod["hostPID"] is True and pod["automountServiceAccountToken"] is False
    (c,) = pod["containers"]
    sc = c["securityContext"]
    assert sc["capabilities"]["drop"] == ["ALL"] and sorted(sc["capabilities"]["add"]) == ["BPF", "PERFMON", "SYS_PTRACE"]
    assert sc["privileged"] is False and sc["allowPrivilegeEscalation"] is False
    guide = (DEPLOY / "README.md").read_text()
    for cap in sc["capabilities"]["add"]:
        assert f"`CAP_{cap}`" in guide  # every capability is justified in the guide
    assert c["args"][:3] == ["export", "--listen", ":9400"]
    assert any(p["containerPort"] == 9400 for p in c["ports"])


def test_dashboard_and_scrape_config_use_served_metrics():
    served = set(re.findall(r"(gputrace_\w+)", metrics.__doc__)) | {"gputrace_budget_ratio", "gputrace_processes"}
    dash = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    used = {m for p in dash["panels"] for t in p["targets"] for m in re.findall(r"(gputrace_\w+)", t["expr"])}
    assert used and used <= served, used - served
    titles = " ".join(p["title"] for p in dash["panels"]).lower()
    assert "predicted slowdown" in titles and "calls per gpu-millisecond" in titles and "tracer" in titles
    scrape = yaml.safe_load((DEPLOY / "prometheus-scrape.yaml").read_text())
    assert scrape[0]["job_name"] == "gputrace" and scrape[0]["honor_labels"] is True
