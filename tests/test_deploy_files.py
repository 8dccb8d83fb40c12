"""The shipped deploy files agree with the code: config keys, metric names, secrets handling."""

from __future__ import annotations

import re
import textwrap

from faultlens.config import load_config
from faultlens.metrics import ServiceMetrics
from tests.conftest import REPO

DEPLOY = REPO / "deploy"


def _exported_names() -> set[str]:
    text = ServiceMetrics("any").exposition().decode()
    names = set(re.findall(r"^# TYPE (\S+) (\S+)", text, re.M))
    out = set()
    for name, kind in names:
        out.add(name)
        if kind == "counter":
            out.add(name + "_total")
    return out


def test_every_metric_in_the_alert_rules_exists() -> None:
    rules = (DEPLOY / "prometheus" / "faultlens-alerts.yml").read_text()
    used = set(re.findall(r"\bfaultlens_[a-z_]+", rules))
    assert used and used <= _exported_names(), used - _exported_names()
    assert rules.count("absent(") >= 3
    for alert in re.findall(r"- alert: (\S+)", rules):
        assert alert.startswith("Faultlens")
    assert len(re.findall(r"- alert: ", rules)) == len(re.findall(r"\n        expr: ", rules))


def test_the_daemonset_configmap_is_a_valid_faultlens_toml(tmp_path) -> None:
    manifest = (DEPLOY / "kubernetes" / "faultlens-agent-daemonset.yaml").read_text()
    block = re.search(r"  faultlens.toml: \|\n((?:    .*\n|\n)+)", manifest).group(1)
    f = tmp_path / "faultlens.toml"
    f.write_text(textwrap.dedent(block))
    cfg = load_config(f, env={"FAULTLENS_BUS_SASL_PASSWORD": "from-secret", "FAULTLENS_AGENT_NODE": "gpu-1"})
    assert cfg.bus.security_protocol == "SASL_SSL" and cfg.bus.sasl_password == "from-secret"
    assert cfg.agent.node == "gpu-1" and cfg.agent.metrics_port == 9400
    assert "sasl_password" not in block  # the password comes from the Secret only
    # An agent verifies commands and never signs: it is given the public key file only, from a ConfigMap.
    assert cfg.keys.files and all(f.endswith(".pub") for f in cfg.keys.files), cfg.keys.files
    assert "configMap: {name: faultlens-verify-key" in manifest and "faultlens-signing-key" not in manifest
    for needed in ("hostPID: true", "runtimeClassName: nvidia", "secretKeyRef: {name: faultlens-bus, key: sasl-password}",
                   "name: FAULTLENS_BUS_SASL_PASSWORD", "path: /dev/kmsg", "configMap: {name: faultlens-config}"):
        assert needed in manifest, needed


def test_the_systemd_unit_keeps_secrets_out_of_the_unit() -> None:
    unit = (DEPLOY / "systemd" / "faultlens-agent.service").read_text()
    assert "ExecStart=/opt/faultlens/venv/bin/faultlens agent --config /etc/faultlens/faultlens.toml" in unit
    assert "EnvironmentFile=-/etc/faultlens/agent.env" in unit
    assert not re.search(r"^Environment=.*PASSWORD", unit, re.M)
    assert "CAP_SYSLOG" in unit and "CAP_SYS_PTRACE" in unit


def test_every_folder_inside_a_package_is_declared_so_the_install_is_quiet() -> None:
    """setuptools warns (a BuildBackendWarning wall per folder) for an undeclared data folder."""
    import tomllib

    tool = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    declared = set(tool["packages"])
    roots = tool["package-dir"]
    found = set()
    for name, folder in roots.items():
        for sub in (REPO / folder).rglob("*"):
            if sub.is_dir() and "__pycache__" not in sub.parts and any(sub.iterdir()):
                rel = sub.relative_to(REPO / folder)
                found.add(".".join([name, *rel.parts]))
    assert found - declared == set(), f"add to [tool.setuptools] packages: {sorted(found - declared)}"
