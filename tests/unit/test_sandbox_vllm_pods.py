"""The pod runner's pure helpers for real-vLLM pods (gearshift.dev.sandbox.podspec): the ``vllm`` program,
volume mounts as a kubelet makes them, cluster DNS for headless Services, the CPU-platform env."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from gearshift.dev.sandbox import podspec
from gearshift.dev.sandbox.layout import Layout
from gearshift.dev.sandbox.podspec import (
    VLLM_SITE_DIR,
    PodSpecError,
    cluster_dns_names,
    container_argv,
    hosts_file,
    mount_plan,
    quantity_bytes,
    vllm_cpu_env,
)

POD = {
    "metadata": {"name": "svc-prefill-a-s0-0", "namespace": "ns1", "uid": "u-1"},
    "spec": {
        "hostname": "svc-prefill-a-s0-0",
        "subdomain": "svc-prefill-a",
        "volumes": [
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}},
            {"name": "scratch", "emptyDir": {}},
            {
                "name": "models",
                "hostPath": {"path": "/var/lib/gearshift/models", "type": "DirectoryOrCreate"},
            },
            {"name": "claim", "persistentVolumeClaim": {"claimName": "c"}},
        ],
    },
    "status": {"podIP": "127.9.1.4"},
}


class TestVllmCommand:
    def test_vllm_resolves_in_the_vllm_venv(self, tmp_path: Path) -> None:
        vbin = tmp_path / "vllm-venv" / "bin"
        vbin.mkdir(parents=True)
        (vbin / "vllm").write_text("#!/bin/sh\n")
        c = {"name": "engine", "command": ["vllm"], "args": ["serve", "m", "--host", "$(IP)"]}
        argv = container_argv(c, {"IP": "127.9.1.4"}, tmp_path / "venv" / "bin", vbin)
        assert argv == [str(vbin / "vllm"), "serve", "m", "--host", "127.9.1.4"]

    def test_vllm_without_install_names_the_fix(self, tmp_path: Path) -> None:
        c = {"name": "engine", "command": ["vllm"], "args": ["serve", "m"]}
        with pytest.raises(PodSpecError, match=r"install-vllm\.sh"):
            container_argv(c, {}, tmp_path, None)

    def test_cpu_env_pins_one_core_and_stays_on_loopback(self) -> None:
        env = vllm_cpu_env(1)
        assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
        assert env["VLLM_TARGET_DEVICE"] == "cpu"
        assert env["GLOO_SOCKET_IFNAME"] == "lo" and env["UCX_NET_DEVICES"] == "lo"
        assert env["HF_HUB_OFFLINE"] == "1"
        # Only platform env: nothing that changes what the operator wrote (args, model, ports, roles).
        assert not any(k.startswith(("GEARSHIFT_", "VLLM_PP_", "VLLM_NIXL_")) for k in env)


class TestMounts:
    def test_kubelet_volume_kinds(self, tmp_path: Path) -> None:
        c = {
            "name": "engine",
            "volumeMounts": [
                {"name": "dshm", "mountPath": "/dev/shm"},
                {"name": "scratch", "mountPath": "/scratch"},
                {"name": "models", "mountPath": "/root/.cache/huggingface", "readOnly": True},
            ],
        }
        plan = mount_plan(POD, c, tmp_path / "pod", tmp_path / "hostpath")
        assert plan == [
            {
                "target": "/dev/shm",
                "readOnly": False,
                "kind": "tmpfs",
                "source": "tmpfs",
                "sizeBytes": 2 * 2**30,
            },
            {
                "target": "/scratch",
                "readOnly": False,
                "kind": "bind",
                "source": str(tmp_path / "pod" / "volumes" / "scratch"),
                "sizeBytes": None,
            },
            {
                "target": "/root/.cache/huggingface",
                "readOnly": True,
                "kind": "bind",
                "source": str(tmp_path / "hostpath" / "var/lib/gearshift/models"),
                "sizeBytes": None,
            },
        ]

    def test_service_account_volume_is_not_mounted(self, tmp_path: Path) -> None:
        # What the ServiceAccount admission plugin adds to every pod; the runner hands out a KUBECONFIG.
        sa = {
            "name": "kube-api-access-x",
            "projected": {
                "sources": [
                    {"serviceAccountToken": {"path": "token", "expirationSeconds": 3607}},
                    {
                        "configMap": {
                            "name": "kube-root-ca.crt",
                            "items": [{"key": "ca.crt", "path": "ca.crt"}],
                        }
                    },
                ]
            },
        }
        pod = {**POD, "spec": {**POD["spec"], "volumes": [*POD["spec"]["volumes"], sa]}}
        c = {
            "name": "engine",
            "volumeMounts": [
                {"name": "kube-api-access-x", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount"}
            ],
        }
        assert mount_plan(pod, c, tmp_path, tmp_path) == []

    @pytest.mark.parametrize(
        ("mount", "match"),
        [
            ({"name": "claim", "mountPath": "/c"}, r"spec.volumes\[claim\]: persistentVolumeClaim"),
            ({"name": "nope", "mountPath": "/c"}, r"names no volume"),
            ({"name": "scratch", "mountPath": "rel"}, r"absolute path"),
            ({"name": "scratch", "mountPath": "/c", "subPath": "x"}, r"subPath"),
        ],
    )
    def test_refused_with_the_field(self, tmp_path: Path, mount: dict, match: str) -> None:
        with pytest.raises(PodSpecError, match=match):
            mount_plan(POD, {"name": "engine", "volumeMounts": [mount]}, tmp_path, tmp_path)

    @pytest.mark.parametrize(
        ("q", "n"), [("2Gi", 2 * 1024**3), ("512M", 512 * 10**6), (1024, 1024), ("1.5Ki", 1536), (None, None)]
    )
    def test_quantity(self, q: object, n: int | None) -> None:
        assert quantity_bytes(q) == n

    def test_bad_quantity(self) -> None:
        with pytest.raises(PodSpecError, match="quantity"):
            quantity_bytes("two gigs")


class TestClusterDns:
    def test_statefulset_pod_names(self) -> None:
        assert cluster_dns_names(POD) == [
            "svc-prefill-a-s0-0.svc-prefill-a.ns1.svc.cluster.local",
            "svc-prefill-a-s0-0.svc-prefill-a.ns1.svc",
            "svc-prefill-a-s0-0.svc-prefill-a.ns1",
            "svc-prefill-a-s0-0.svc-prefill-a",
        ]

    def test_no_subdomain_no_record(self) -> None:
        assert cluster_dns_names({"metadata": {"namespace": "n"}, "spec": {"hostname": "h"}}) == []

    def test_hosts_file_keeps_the_machine_entries(self) -> None:
        text = hosts_file(
            "127.0.0.1\tlocalhost\n", {"u2": ("127.9.1.5", ["b.s"]), "u1": ("127.9.1.4", ["a.s"])}
        )
        lines = text.splitlines()
        assert lines[0] == "127.0.0.1\tlocalhost"
        assert lines[2:] == ["127.9.1.4\ta.s", "127.9.1.5\tb.s"]


def test_vllm_is_an_allowed_program() -> None:
    assert podspec.VLLM_COMMAND in podspec.ALLOWED_COMMANDS


class TestNixlProgressDelay:
    """``sandbox/vllm_site/sitecustomize.py`` run by the vLLM venv's own Python against NIXL's own
    ``nixl_agent``: the agent NIXL builds gets the sandbox's progress-thread delay."""

    PROBE = """
import sys
import nixl_cu13._api as api
bindings = sys.modules["nixl_cu13._bindings"]
class Seen(Exception):
    pass
def record(name, config):
    raise Seen(config.pthrDelay)
bindings.nixlAgent = record
try:
    api.nixl_agent("probe", api.nixl_agent_config(backends=[]))
except Seen as seen:
    print("pthrDelay", seen.args[0])
"""

    def test_nixl_agents_get_the_delay(self, tmp_path: Path) -> None:
        layout = Layout.from_env()
        if not layout.vllm_installed:
            pytest.fail(f"vLLM for the sandbox is missing ({layout.vllm_root}): run `make vllm`")
        py = str(layout.vllm_bin / "python")
        env = {**vllm_cpu_env(0), "PATH": "/usr/bin:/bin", "SANDBOX_NIXL_PROGRESS_DELAY_US": "777"}
        out = subprocess.run(
            [str(py), "-c", self.PROBE], env=env, capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr[-2000:]
        assert "pthrDelay 777" in out.stdout, out.stdout + out.stderr[-2000:]
        # without the folder on PYTHONPATH NIXL keeps its own 0 (what the patch exists for)
        env["PYTHONPATH"] = ""
        out = subprocess.run(
            [str(py), "-c", self.PROBE], env=env, capture_output=True, text=True, timeout=120
        )
        assert "pthrDelay 0" in out.stdout, out.stdout + out.stderr[-2000:]

    def test_container_pythonpath_is_kept_after_the_sandbox_folder(self) -> None:
        env = vllm_cpu_env(0, "/opt/app")
        assert env["PYTHONPATH"].split(os.pathsep) == [str(VLLM_SITE_DIR), "/opt/app"]


def test_ended_engine_errors_shows_why_a_gone_pod_ended(tmp_path, monkeypatch):
    from gearshift.dev.sandbox.vllm_service import ended_engine_errors

    monkeypatch.setenv("GEARSHIFT_SANDBOX_DIR", str(tmp_path))
    pods_dir = Layout.from_env().pods_dir
    gone, live = pods_dir / "ns_h-s0-0_aaaa1111", pods_dir / "ns_h-s0-0_bbbb2222"
    for d in (gone, live, pods_dir / "other_x-0_cccc3333"):
        d.mkdir(parents=True)
    gone.joinpath("engine.log").write_text(
        "(APIServer pid=1) WARNING 12-07 02:30:20 [system_utils.py:255] failed to increase ulimit\n"
        "(Worker pid=2) ERROR 12-07 02:32:35 [base_worker.py:1318] NIXL transfer failure: handshake\n"
        "(Worker pid=2) ERROR 12-07 02:32:35 [base_worker.py:1318] Traceback (most recent call last):\n"
        '(Worker pid=2) ERROR 12-07 02:32:35 [base_worker.py:1318]   File "x.py", line 3, in f\n'
        "(Worker pid=2) ERROR 12-07 02:32:35 [base_worker.py:1318] zmq.error.Again: Resource unavailable\n"
        "RuntimeError: The server socket has failed to listen on any local network address\n"
    )
    live.joinpath("engine.log").write_text("(Worker pid=3) ERROR 12-07 02:40:00 [x.py:1] live pod's error\n")
    text = ended_engine_errors("ns", {live.name})
    assert "other_x" not in text and "live pod's error" not in text
    shown = [ln.strip() for ln in text.splitlines()[2:]]
    assert [ln.rsplit("] ", 1)[-1] if "] " in ln else ln for ln in shown] == [
        "NIXL transfer failure: handshake",
        "zmq.error.Again: Resource unavailable",
        "RuntimeError: The server socket has failed to listen on any local network address",
    ]
