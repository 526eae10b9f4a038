"""The pod runner's ServiceAccount credentials (gearshift.dev.sandbox.podspec): who gets which kubeconfig."""

from __future__ import annotations

import copy

import pytest

from gearshift.dev.sandbox.podspec import (
    CREDENTIALS_ANNOTATION,
    PodSpecError,
    service_account_for,
    service_account_kubeconfig,
)

ADMIN = {
    "apiVersion": "v1",
    "kind": "Config",
    "clusters": [
        {"name": "other", "cluster": {"server": "https://127.0.0.1:1"}},
        {
            "name": "kwok",
            "cluster": {"server": "https://127.0.0.1:32764", "certificate-authority": "/pki/ca.crt"},
        },
    ],
    "users": [
        {"name": "admin", "user": {"client-certificate": "/pki/admin.crt", "client-key": "/pki/a.key"}}
    ],
    "contexts": [{"name": "kwok", "context": {"cluster": "kwok", "user": "admin"}}],
    "current-context": "kwok",
}


def pod(annotations: dict[str, str] | None = None, **spec: object) -> dict[str, object]:
    return {"metadata": {"name": "op-0", "namespace": "ns1", "annotations": annotations}, "spec": spec}


class TestServiceAccountFor:
    def test_no_annotation_keeps_the_admin_kubeconfig(self):
        assert service_account_for(pod(serviceAccountName="gs")) is None

    def test_opted_in_pod_gets_its_service_account(self):
        assert (
            service_account_for(pod({CREDENTIALS_ANNOTATION: "serviceaccount"}, serviceAccountName="gs"))
            == "gs"
        )

    def test_unset_service_account_is_default(self):
        assert service_account_for(pod({CREDENTIALS_ANNOTATION: "serviceaccount"})) == "default"

    def test_automount_false_means_no_credentials(self):
        p = pod(
            {CREDENTIALS_ANNOTATION: "serviceaccount"},
            serviceAccountName="gs",
            automountServiceAccountToken=False,
        )
        assert service_account_for(p) == ""

    def test_unknown_mode_names_the_annotation(self):
        with pytest.raises(PodSpecError, match=r"sandbox-credentials.*'admin'"):
            service_account_for(pod({CREDENTIALS_ANNOTATION: "admin"}))


class TestKubeconfig:
    def test_same_server_and_ca_with_the_token_and_namespace(self):
        before = copy.deepcopy(ADMIN)
        cfg = service_account_kubeconfig(ADMIN, "tok-123", "ns1")
        assert before == ADMIN  # the admin kubeconfig is not modified
        assert cfg["current-context"] == "serviceaccount"
        (cluster,) = cfg["clusters"]
        assert cluster["cluster"] == {
            "server": "https://127.0.0.1:32764",
            "certificate-authority": "/pki/ca.crt",
        }
        (user,) = cfg["users"]
        assert user["user"] == {"token": "tok-123"}  # no client certificate survives
        (ctx,) = cfg["contexts"]
        assert ctx["context"] == {"cluster": "sandbox", "user": "serviceaccount", "namespace": "ns1"}

    def test_kubernetes_client_reads_it(self, tmp_path):
        import yaml
        from kubernetes import client, config

        ca = tmp_path / "ca.crt"
        ca.write_text("not parsed by the loader\n")
        admin = copy.deepcopy(ADMIN)
        admin["clusters"][1]["cluster"]["certificate-authority"] = str(ca)
        path = tmp_path / "kc"
        path.write_text(yaml.safe_dump(service_account_kubeconfig(admin, "tok-123", "ns1")))
        c = client.Configuration()
        config.load_kube_config(config_file=str(path), client_configuration=c)
        assert c.host == "https://127.0.0.1:32764"
        assert c.get_api_key_with_prefix("BearerToken") == "Bearer tok-123"
        assert c.ssl_ca_cert == str(ca)
        assert c.cert_file is None

    def test_no_current_cluster_is_an_error(self):
        broken = {**ADMIN, "current-context": "missing"}
        with pytest.raises(PodSpecError, match="current context"):
            service_account_kubeconfig(broken, "t", "ns1")
