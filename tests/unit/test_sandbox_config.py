"""The sandbox's generated configuration: layout names, kwok stages, Prometheus (pure, no cluster)."""

from __future__ import annotations

import json
import shutil
import subprocess
from typing import ClassVar

import pytest
import yaml

from gearshift.dev.sandbox.layout import (
    Layout,
    SandboxConfigError,
    read_versions,
    sandbox_name,
    sandbox_octet,
)
from gearshift.dev.sandbox.prometheus import (
    LOCAL_JOB,
    POD_JOB,
    label_name,
    local_target,
    pod_targets,
    prometheus_argv,
    prometheus_config,
)
from gearshift.dev.sandbox.promsd import write_groups
from gearshift.dev.sandbox.stages import RUN_LABEL_QUERY, kwok_configuration, sandbox_stages


class TestLayout:
    def test_name_and_octet_depend_on_path(self, tmp_path):
        a, b = tmp_path / "dev" / ".sandbox", tmp_path / "ci" / ".sandbox"
        assert sandbox_name(a) == sandbox_name(a)
        assert sandbox_name(a) != sandbox_name(b)
        assert sandbox_name(a).startswith("gs-") and len(sandbox_name(a)) == 11
        octets = {sandbox_octet(tmp_path / f"s{i}") for i in range(200)}
        assert octets <= set(range(1, 255))
        assert len(octets) > 100  # spread, not a constant

    def test_versions_file(self, tmp_path):
        f = tmp_path / "versions.env"
        f.write_text(
            "# pins\nKUBE_VERSION=v1.34.4\nETCD_VERSION=v3.6.16  # etcd\nKWOK_VERSION=v0.8\nHELM_VERSION=v3\n"
        )
        v = read_versions(f)
        assert v["ETCD_VERSION"] == "v3.6.16"
        f.write_text("KUBE_VERSION=v1\n")
        with pytest.raises(SandboxConfigError, match="ETCD_VERSION"):
            read_versions(f)

    def test_env_override_and_paths(self, tmp_path):
        lay = Layout.from_env(
            {"GEARSHIFT_SANDBOX_DIR": str(tmp_path / "sb"), "GEARSHIFT_CACHE": str(tmp_path / "c")}
        )
        assert lay.state_dir == (tmp_path / "sb").resolve()
        kube = lay.versions["KUBE_VERSION"]
        assert lay.binary("kubectl") == tmp_path / "c" / "bin" / f"kubernetes-{kube}" / "kubectl"
        assert lay.kubeconfig == lay.state_dir / "kwok" / "clusters" / lay.name / "kubeconfig.yaml"
        env = lay.subprocess_env({"PATH": "/usr/bin"})
        assert env["PATH"].split(":")[0] == str(lay.part_dir("kubernetes"))
        assert env["PATH"].endswith(":/usr/bin")
        assert env["KUBECONFIG"] == str(lay.kubeconfig)
        assert "kwokctl" in lay.missing_binaries()


def _pod_stage(name, exprs):
    return {
        "apiVersion": "kwok.x-k8s.io/v1alpha1",
        "kind": "Stage",
        "metadata": {"name": name},
        "spec": {"resourceRef": {"apiGroup": "v1", "kind": "Pod"}, "selector": {"matchExpressions": exprs}},
    }


DEFAULT_STAGES = (
    {"kind": "Stage", "metadata": {"name": "node-initialize"}, "spec": {"resourceRef": {"kind": "Node"}}},
    _pod_stage("pod-ready", [{"key": ".status.podIP", "operator": "DoesNotExist"}]),
    _pod_stage("pod-delete", [{"key": ".metadata.deletionTimestamp", "operator": "Exists"}]),
)


class TestStages:
    DEFAULTS: ClassVar[list[dict]] = list(DEFAULT_STAGES)

    def test_default_pod_stages_skip_opted_in_pods(self):
        out = {s["metadata"]["name"]: s for s in sandbox_stages(self.DEFAULTS)}
        for name in ("pod-ready", "pod-delete"):
            exprs = out[name]["spec"]["selector"]["matchExpressions"]
            assert {"key": RUN_LABEL_QUERY, "operator": "NotIn", "values": ["true"]} in exprs
            assert len(exprs) == 2  # the original condition is kept
        assert "selector" not in out["node-initialize"]["spec"]
        assert RUN_LABEL_QUERY == '.metadata.labels["gearshift.io/sandbox-run"]'

    def test_defaults_not_mutated(self):
        before = yaml.safe_dump(self.DEFAULTS)
        sandbox_stages(self.DEFAULTS)
        assert yaml.safe_dump(self.DEFAULTS) == before

    def test_own_stages_for_opted_in_pods(self):
        out = {s["metadata"]["name"]: s for s in sandbox_stages(self.DEFAULTS)}
        assign = out["gearshift-run-assign"]
        assert {"key": RUN_LABEL_QUERY, "operator": "In", "values": ["true"]} in assign["spec"]["selector"][
            "matchExpressions"
        ]
        tmpl = assign["spec"]["next"]["statusTemplate"]
        assert "PodIPWith .spec.nodeName" in tmpl and "phase: Pending" in tmpl
        assert "type: Ready" in tmpl and 'status: "True"\n  type: Ready' not in tmpl
        fallback = out["gearshift-run-delete-fallback"]
        assert fallback["spec"]["next"]["delete"] is True
        assert fallback["spec"]["delay"]["durationMilliseconds"] >= 10_000

    def test_kwok_default_cidr_is_loopback_and_outside_node_cidrs(self):
        opts = kwok_configuration(42)["options"]
        assert opts["cidr"] == "127.42.255.0/24"


class TestPrometheus:
    def test_scrape_config(self, tmp_path):
        cfg = prometheus_config(tmp_path / "targets.json")
        assert cfg["global"]["scrape_interval"] == "2s"
        job = cfg["scrape_configs"][0]
        assert job["file_sd_configs"][0]["files"] == [str(tmp_path / "targets.json")]
        rules = job["relabel_configs"]
        keep = [r for r in rules if r.get("action") == "keep"]
        assert {tuple(r["source_labels"]) for r in keep} == {
            ("__meta_kubernetes_pod_annotation_prometheus_io_scrape",),
            ("__meta_kubernetes_pod_phase",),
        }
        addr = next(r for r in rules if r.get("target_label") == "__address__")
        assert addr["source_labels"] == [
            "__meta_kubernetes_pod_ip",
            "__meta_kubernetes_pod_annotation_prometheus_io_port",
        ]

    def test_listens_on_loopback_only(self, tmp_path):
        argv = prometheus_argv("prometheus", tmp_path / "p.yml", tmp_path / "data", 9999)
        assert "--web.listen-address=127.0.0.1:9999" in argv

    def test_pod_targets_like_kubernetes_sd(self):
        pod = {
            "metadata": {
                "name": "sim-0",
                "namespace": "ns1",
                "uid": "u1",
                "labels": {"gearshift.io/role": "prefill"},
                "annotations": {"prometheus.io/scrape": "true", "prometheus.io/port": "8000"},
                "ownerReferences": [{"kind": "StatefulSet", "name": "sim", "controller": True}],
            },
            "spec": {
                "nodeName": "gpu-h100-0",
                "containers": [
                    {"name": "engine", "image": "w:1", "ports": [{"name": "http", "containerPort": 8000}]},
                    {"name": "side", "image": "s:1"},
                ],
            },
            "status": {
                "podIP": "127.9.1.3",
                "phase": "Running",
                "conditions": [{"type": "Ready", "status": "True"}],
            },
        }
        pending = {
            "metadata": {"name": "p", "namespace": "ns1"},
            "spec": {"containers": [{"name": "c"}]},
            "status": {},
        }
        groups = pod_targets([pod, pending])
        assert [g["targets"] for g in groups] == [["127.9.1.3:8000"], ["127.9.1.3"]]
        lab = groups[0]["labels"]
        m = "__meta_kubernetes_pod_"
        assert lab["__meta_kubernetes_namespace"] == "ns1"
        assert lab[m + "annotation_prometheus_io_scrape"] == "true"
        assert lab[m + "annotation_prometheus_io_port"] == "8000"
        assert lab[m + "label_gearshift_io_role"] == "prefill"
        assert lab[m + "labelpresent_gearshift_io_role"] == "true"
        assert (lab[m + "ready"], lab[m + "phase"], lab[m + "node_name"]) == ("true", "Running", "gpu-h100-0")
        assert (lab[m + "controller_kind"], lab[m + "controller_name"]) == ("StatefulSet", "sim")
        assert (lab[m + "container_port_number"], lab[m + "container_port_name"]) == ("8000", "http")
        assert groups[1]["labels"][m + "container_name"] == "side"

    @pytest.mark.skipif(
        shutil.which("promtool") is None, reason="promtool (Debian package prometheus) not installed"
    )
    def test_promtool_accepts_config(self, tmp_path):
        targets = tmp_path / "targets.json"
        targets.write_text("[]")
        local = tmp_path / "local"
        local.mkdir()
        write_groups(local / "op.json", local_target("127.0.0.1:9999", {"namespace": "gearshift-system"}))
        for cfg in (prometheus_config(targets), prometheus_config(targets, local_targets_dir=local)):
            path = tmp_path / "prometheus.yml"
            path.write_text(yaml.safe_dump(cfg))
            proc = subprocess.run(["promtool", "check", "config", str(path)], capture_output=True, text=True)
            assert proc.returncode == 0, proc.stdout + proc.stderr

    def test_local_job_reads_every_json_file_of_the_directory(self, tmp_path):
        assert [j["job_name"] for j in prometheus_config(tmp_path / "t.json")["scrape_configs"]] == [POD_JOB]
        cfg = prometheus_config(tmp_path / "t.json", local_targets_dir=tmp_path / "local")
        pods, local = cfg["scrape_configs"]
        assert (pods["job_name"], local["job_name"]) == (POD_JOB, LOCAL_JOB)
        assert local["file_sd_configs"][0]["files"] == [str(tmp_path / "local" / "*.json")]
        assert "relabel_configs" not in local  # the file's labels are the series' labels

    def test_local_target_and_atomic_write(self, tmp_path):
        groups = local_target("127.0.0.1:9090", {"namespace": "gearshift-system"})
        assert groups == [{"targets": ["127.0.0.1:9090"], "labels": {"namespace": "gearshift-system"}}]
        for bad in ("127.0.0.1", ":9090", "127.0.0.1:x"):
            with pytest.raises(ValueError, match="host:port"):
                local_target(bad, {})
        out = tmp_path / "op.json"
        write_groups(out, groups)
        assert json.loads(out.read_text()) == groups
        assert [f.name for f in tmp_path.iterdir()] == ["op.json"]  # no temporary left behind

    def test_label_name_is_prometheus_discoverys_spelling(self):
        assert label_name("app.kubernetes.io/component") == "app_kubernetes_io_component"
        assert label_name("gearshift.io/role") == "gearshift_io_role"


class TestCli:
    def test_env_and_status_of_a_sandbox_that_is_not_up(self, tmp_path, monkeypatch, capsys):
        from gearshift.cli import main

        monkeypatch.setenv("GEARSHIFT_SANDBOX_DIR", str(tmp_path / "sb"))
        assert main(["sandbox", "env"]) == 0
        out = capsys.readouterr().out.splitlines()
        lay = Layout.from_env()
        assert out[0] == f"export KUBECONFIG={lay.kubeconfig}"
        assert out[1].startswith(f"export PATH={lay.part_dir('kubernetes')}:")
        assert main(["sandbox", "status"]) == 1
        assert "DOWN" in capsys.readouterr().out

    def test_up_without_binaries_names_the_fix(self, tmp_path, monkeypatch, capsys):
        from gearshift.cli import main

        monkeypatch.setenv("GEARSHIFT_SANDBOX_DIR", str(tmp_path / "sb"))
        monkeypatch.setenv("GEARSHIFT_CACHE", str(tmp_path / "empty-cache"))
        assert main(["sandbox", "up", "--quiet"]) == 1
        err = capsys.readouterr().err
        assert "missing sandbox binaries" in err and "make binaries" in err


def test_api_server_reaches_kubelets_by_loopback_internal_ip_not_by_dns():
    from pathlib import Path

    from gearshift.dev.sandbox.nodes import node_ip
    from gearshift.dev.sandbox.stages import kwokctl_configuration

    bins = {n: Path(f"/x/{n}") for n in ("kube-apiserver", "kube-controller-manager", "kube-scheduler")}
    bins |= {n: Path(f"/x/{n}") for n in ("kubectl", "etcd", "kwok")}
    cfg = kwokctl_configuration(bins, "v1.34.4")
    (patch,) = [p for p in cfg["componentsPatches"] if p["name"] == "kube-apiserver"]
    assert {"key": "kubelet-preferred-address-types", "value": "InternalIP"} in patch["extraArgs"]
    # ... and that address is a loopback one, so `kubectl logs` never leaves the machine.
    assert node_ip(42, 3).startswith("127.")


def test_controllers_run_without_leader_election() -> None:
    """One controller manager and one scheduler: a slow lease renewal must not make them exit."""
    from pathlib import Path

    from gearshift.dev.sandbox.stages import kwokctl_configuration

    names = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl", "etcd", "kwok")
    cfg = kwokctl_configuration({n: Path(f"/x/{n}") for n in names}, "v1.34.4")
    for name in ("kube-controller-manager", "kube-scheduler"):
        (patch,) = [p for p in cfg["componentsPatches"] if p["name"] == name]
        assert {"key": "leader-elect", "value": "false"} in patch["extraArgs"]


class TestInvokedAs:
    """The commands `sandbox up` suggests run as the user ran gearshift: a venv's command by its path."""

    def test_a_path_is_kept_and_a_bare_name_stays_bare(self, monkeypatch):
        from gearshift.dev.sandbox.cli import invoked_as

        monkeypatch.setattr("sys.argv", [".venv/bin/gearshift", "sandbox", "up"])
        assert invoked_as() == ".venv/bin/gearshift"
        monkeypatch.setattr("sys.argv", ["/opt/my tools/gearshift"])
        assert invoked_as() == "'/opt/my tools/gearshift'"
        monkeypatch.setattr("sys.argv", ["gearshift", "sandbox", "up"])
        assert invoked_as() == "gearshift"
        monkeypatch.setattr("sys.argv", ["/usr/lib/python3/site-packages/pytest/__main__.py"])
        assert invoked_as() == "gearshift"
