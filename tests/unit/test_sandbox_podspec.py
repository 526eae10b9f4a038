"""The pod runner's pure helpers (gearshift.dev.sandbox.podspec): env, command, probes, messages and
conditions."""

from __future__ import annotations

from pathlib import Path

import pytest

from gearshift.dev.sandbox.podspec import (
    PodSpecError,
    check_pod_ip,
    container_argv,
    container_env,
    expand,
    field_ref,
    is_job_like,
    merge_conditions,
    readiness_target,
    restart_delay,
    termination_message,
)

POD = {
    "metadata": {
        "name": "sim-0",
        "namespace": "ns1",
        "uid": "u-1",
        "labels": {"gearshift.io/stage": "0", "app": "sim"},
        "annotations": {"note": "x"},
    },
    "spec": {"nodeName": "gpu-h100-0", "serviceAccountName": "default", "restartPolicy": "Always"},
    "status": {"podIP": "127.9.1.4", "hostIP": "127.9.0.1"},
}


def no_lookup(kind, ns, name):
    return None


class TestEnv:
    def test_field_refs(self):
        assert field_ref(POD, "metadata.name") == "sim-0"
        assert field_ref(POD, "status.podIP") == "127.9.1.4"
        assert field_ref(POD, "spec.nodeName") == "gpu-h100-0"
        assert field_ref(POD, "metadata.labels['gearshift.io/stage']") == "0"
        assert field_ref(POD, "metadata.annotations['note']") == "x"
        assert field_ref(POD, "metadata.labels['missing']") == ""
        with pytest.raises(PodSpecError, match=r"status\.podIPs"):
            field_ref(POD, "status.podIPs")

    def test_order_and_expansion(self):
        c = {
            "name": "c",
            "env": [
                {"name": "PORT", "value": "8000"},
                {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                {"name": "URL", "value": "http://$(IP):$(PORT)/$(LATER)"},
                {"name": "LATER", "value": "late"},
                {"name": "ESC", "value": "$$(IP)"},
            ],
        }
        env = container_env(POD, c, no_lookup)
        # $(VAR) sees only earlier variables; undefined references stay as written; $$ escapes.
        assert env["URL"] == "http://127.9.1.4:8000/$(LATER)"
        assert env["ESC"] == "$(IP)"

    def test_config_maps_and_secrets(self):
        store = {("ConfigMap", "ns1", "cfg"): {"A": "1", "B": "2"}, ("Secret", "ns1", "s"): {"token": "t0k"}}

        def lookup(kind, ns, name):
            return store.get((kind, ns, name))

        c = {
            "name": "c",
            "envFrom": [{"configMapRef": {"name": "cfg"}, "prefix": "CFG_"}],
            "env": [
                {"name": "B", "value": "override"},
                {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "token"}}},
                {
                    "name": "OPT",
                    "valueFrom": {"configMapKeyRef": {"name": "gone", "key": "k", "optional": True}},
                },
            ],
        }
        env = container_env(POD, c, lookup)
        assert env == {"CFG_A": "1", "CFG_B": "2", "B": "override", "TOKEN": "t0k"}
        c = {
            "name": "c",
            "env": [{"name": "X", "valueFrom": {"configMapKeyRef": {"name": "gone", "key": "k"}}}],
        }
        with pytest.raises(PodSpecError, match="ConfigMap ns1/gone not found"):
            container_env(POD, c, lookup)
        c = {
            "name": "c",
            "env": [{"name": "X", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu"}}}],
        }
        with pytest.raises(PodSpecError, match=r"env\[X\]\.valueFrom"):
            container_env(POD, c, lookup)

    def test_expand(self):
        assert expand("$(A)-$(B)-$$-$(C)", {"A": "1", "B": "2"}) == "1-2-$-$(C)"


class TestCommand:
    def test_allowed_program_resolved_in_venv(self):
        venv = Path("/venv/bin")
        c = {"name": "c", "command": ["/usr/local/bin/gearshift-sim"], "args": ["--port", "$(PORT)"]}
        assert container_argv(c, {"PORT": "8000"}, venv) == ["/venv/bin/gearshift-sim", "--port", "8000"]
        c = {"name": "c", "command": ["gearshift", "probe"], "args": ["run"]}
        assert container_argv(c, {}, venv) == ["/venv/bin/gearshift", "probe", "run"]

    @pytest.mark.parametrize("cmd", [["python3", "-c", "print(1)"], ["/bin/sh"], ["gearshift-evil"]])
    def test_other_programs_refused(self, cmd):
        with pytest.raises(PodSpecError, match="not allowed"):
            container_argv({"name": "c", "command": cmd}, {}, Path("/v"))

    def test_no_command(self):
        with pytest.raises(PodSpecError, match=r"containers\[c\]\.command is empty"):
            container_argv({"name": "c", "args": ["x"]}, {}, Path("/v"))


class TestProbe:
    def test_http_named_port_and_defaults(self):
        c = {
            "name": "c",
            "ports": [{"name": "http", "containerPort": 8000}],
            "readinessProbe": {"httpGet": {"path": "health", "port": "http", "host": "10.0.0.1"}},
        }
        t = readiness_target(c, "127.9.1.4")
        assert t["url"] == "http://127.9.1.4:8000/health"  # the pod IP, never httpGet.host
        assert (t["period_s"], t["timeout_s"], t["failure_threshold"], t["success_threshold"]) == (
            10,
            1,
            3,
            1,
        )

    def test_tcp_and_none(self):
        c = {"name": "c", "readinessProbe": {"tcpSocket": {"port": 9000}, "periodSeconds": 2}}
        assert readiness_target(c, "127.1.1.1") == {
            "kind": "tcp",
            "host": "127.1.1.1",
            "port": 9000,
            "period_s": 2.0,
            "initial_delay_s": 0.0,
            "timeout_s": 1.0,
            "failure_threshold": 3,
            "success_threshold": 1,
        }
        assert readiness_target({"name": "c"}, "127.1.1.1") is None

    def test_unsupported(self):
        with pytest.raises(PodSpecError, match="only httpGet and tcpSocket"):
            readiness_target({"name": "c", "readinessProbe": {"exec": {"command": ["true"]}}}, "127.1.1.1")
        with pytest.raises(PodSpecError, match="names no port"):
            readiness_target({"name": "c", "readinessProbe": {"httpGet": {"port": "web"}}}, "127.1.1.1")


class TestPodIp:
    def test_loopback_only(self):
        assert check_pod_ip("127.9.1.4") == "127.9.1.4"
        for bad in ("10.0.0.5", "192.168.1.1", ""):
            with pytest.raises(PodSpecError):
                check_pod_ip(bad)

    def test_job_like(self):
        assert is_job_like({"spec": {"restartPolicy": "Never"}})
        assert is_job_like({"spec": {"restartPolicy": "OnFailure"}})
        assert not is_job_like({"spec": {}})


class TestMessages:
    def test_file_wins_and_is_capped(self):
        assert termination_message("done", "log", 0, "File") == "done"
        assert len(termination_message("x" * 5000, "", 1, "File")) == 4096

    def test_fallback_to_logs_only_on_error(self):
        log = "\n".join(f"line {i}" for i in range(100))
        msg = termination_message("", log, 2, "FallbackToLogsOnError")
        assert msg.splitlines()[0] == "line 20" and msg.splitlines()[-1] == "line 99"
        assert termination_message("", log, 0, "FallbackToLogsOnError") == ""
        assert termination_message("", log, 2, "File") == ""
        big = "y" * 5000
        assert len(termination_message("", big, 1, "FallbackToLogsOnError")) == 2048

    def test_backoff_doubles_to_cap(self):
        assert [restart_delay(n, 1.0, 30.0) for n in range(7)] == [1, 2, 4, 8, 16, 30, 30]


class TestConditions:
    def test_transition_time_changes_only_on_flip(self):
        cur = [
            {"type": "PodScheduled", "status": "True", "lastTransitionTime": "t0"},
            {"type": "Ready", "status": "False", "lastTransitionTime": "t0", "reason": "ContainersNotReady"},
        ]
        out = merge_conditions(cur, {"Ready": ("False", "ContainersNotReady", "still")}, "t1")
        assert out[1]["lastTransitionTime"] == "t0" and out[1]["message"] == "still"
        out = merge_conditions(out, {"Ready": ("True", "", ""), "ContainersReady": ("True", "", "")}, "t2")
        by = {c["type"]: c for c in out}
        assert by["Ready"]["lastTransitionTime"] == "t2"
        assert by["ContainersReady"]["lastTransitionTime"] == "t2"
        assert by["PodScheduled"] == cur[0]
