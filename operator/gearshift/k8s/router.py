"""The router of a PDService: Deployment ``<pds>-router`` running ``gearshift-router``, its ServiceAccount,
Role and RoleBinding. Pure: plain dicts.

The router learns its pods from the EndpointSlices of the role Services (``--service <pds>``: prefill and
decode, or the one ``both`` Service of an aggregated PDService, ``--roles both``) and reads
each head pod's ``GEARSHIFT_PIPELINE`` env, hence the Role: get/list/watch on ``endpointslices`` and
``pods`` in the namespace. Nodes and GPUProfiles are cluster-scoped; a namespaced PDService cannot own a
ClusterRoleBinding (cluster-scoped objects cannot have namespaced owners), so that read is not granted
here: the router then falls back to the GPU model in the pod's pipeline description (router/membership.py).
"""

from __future__ import annotations

import json
from typing import Any

from gearshift.api.pdservice import PDServiceSpec
from gearshift.k8s import names
from gearshift.k8s.services import ROUTER_PORT

DEFAULT_ROUTER_IMAGE = "ghcr.io/gearshift/operator:0.1.0"


def _meta(service: str, namespace: str, owner: dict[str, Any] | None) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": names.router_name(service),
        "namespace": namespace,
        "labels": names.common_labels(service, names.COMPONENT_ROUTER),
    }
    if owner:
        meta["ownerReferences"] = [owner]
    return meta


def router_args(service: str, namespace: str, spec: PDServiceSpec) -> list[str]:
    """``gearshift-router`` flags (router/settings.py ``add_arguments``) for a PDService: an aggregated one's
    router watches its one role Service (``--roles both``) and sends whole requests to its head pods."""
    weights = spec.router.weights.to_json()
    roles = ["--roles", "both"] if spec.aggregated else []
    return [
        "--port",
        str(ROUTER_PORT),
        "--service",
        service,
        "--namespace",
        namespace,
        "--policy",
        spec.router.policy,
        "--weights",
        json.dumps(weights, sort_keys=True, separators=(",", ":")),
        "--target-itl-ms",
        f"{spec.slo.itl_ms:g}",
        "--target-ttft-ms",
        f"{spec.slo.ttft_ms:g}",
        "--served-model-name",
        spec.model.name,
        "--kv-lease-s",
        str(spec.kv_lease_s),
        *roles,
    ]


def build_router_deployment(
    service: str,
    namespace: str,
    spec: PDServiceSpec,
    image: str | None = None,
    owner: dict[str, Any] | None = None,
    prometheus_url: str | None = None,
) -> dict[str, Any]:
    """The router Deployment ``<pds>-router``; labelled for the sandbox pod runner (an inert label on a
    cluster), whatever the engine: in the sandbox the router runs beside simulated or real vLLM pods."""
    name = names.router_name(service)
    selector = {names.LABEL_SERVICE: service, names.LABEL_COMPONENT: names.COMPONENT_ROUTER}
    pod_labels = names.common_labels(service, names.COMPONENT_ROUTER)
    pod_labels[names.LABEL_SANDBOX_RUN] = "true"
    env = [
        {
            "name": "GEARSHIFT_MODEL",
            "value": json.dumps(spec.model.to_model_arch().to_dict(), sort_keys=True),
        },
    ]
    url = spec.prometheus_url or prometheus_url
    if url:
        env.append({"name": "GEARSHIFT_PROMETHEUS_URL", "value": url})
    probe = {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5, "timeoutSeconds": 2}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(service, namespace, owner),
        "spec": {
            "replicas": spec.router.replicas,
            "selector": {"matchLabels": selector},
            "template": {
                # Prometheus' kubernetes-pods job scrapes the router's /metrics: the client-facing request
                # series (each request once) and gearshift_router_* (the chart's dashboard reads them).
                "metadata": {
                    "labels": pod_labels,
                    "annotations": {
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(ROUTER_PORT),
                        "prometheus.io/path": "/metrics",
                    },
                },
                "spec": {
                    "serviceAccountName": name,
                    "enableServiceLinks": False,
                    "containers": [
                        {
                            "name": "router",
                            "image": spec.router.image or image or DEFAULT_ROUTER_IMAGE,
                            "command": ["gearshift-router"],
                            "args": router_args(service, namespace, spec),
                            "env": env,
                            "ports": [{"name": "http", "containerPort": ROUTER_PORT, "protocol": "TCP"}],
                            "readinessProbe": probe,
                            "livenessProbe": probe | {"failureThreshold": 6, "periodSeconds": 10},
                            "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}},
                        }
                    ],
                },
            },
        },
    }


def build_router_rbac(
    service: str, namespace: str, owner: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """ServiceAccount, Role (read endpointslices and pods, get services) and RoleBinding, all named
    ``<pds>-router``."""
    name = names.router_name(service)
    read = ["get", "list", "watch"]
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(service, namespace, owner)},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": _meta(service, namespace, owner),
            "rules": [
                {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": read},
                {"apiGroups": [""], "resources": ["pods"], "verbs": read},
                # The role Services' selectors, for membership where EndpointSlices cannot hold the
                # pods' addresses (loopback pod IPs in the sandbox; router/membership.py).
                {"apiGroups": [""], "resources": ["services"], "verbs": ["get"]},
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": _meta(service, namespace, owner),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}],
        },
    ]
