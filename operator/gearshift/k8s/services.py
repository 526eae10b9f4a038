"""Services of a PDService: a headless one per role and gear, a role Service that selects the active gear's
head pods, and the client Service ``<pds>`` in front of the router (DESIGN.md). Pure: plain dicts.

Switching a role's traffic to another gear is changing the role Service's ``gearshift.io/gear`` selector
(:func:`role_selector`); the EndpointSlice controller then moves the endpoints, and the router follows.
"""

from __future__ import annotations

from typing import Any

from gearshift.k8s import names
from gearshift.k8s.engine import ENGINE_PORT

#: Port of the client Service and of the router container.
ROUTER_PORT = 8000


def _meta(name: str, namespace: str, labels: dict[str, str], owner: dict[str, Any] | None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "labels": labels}
    if owner:
        meta["ownerReferences"] = [owner]
    return meta


def _http_port(port: int) -> list[dict[str, Any]]:
    return [{"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"}]


def build_gear_headless_service(
    service: str, namespace: str, role: str, gear: str, owner: dict[str, Any] | None = None
) -> dict[str, Any]:
    """``<pds>-<role>-<gear>``: headless Service giving every stage pod of the gear a stable DNS name.

    ``publishNotReadyAddresses: true`` is required, not a nicety: a vLLM head only becomes Ready after its
    headless ranks have joined the rendezvous at its ``--master-addr``, this Service's DNS name for it
    (``<sts>-<r>.<pds>-<role>-<gear>.<ns>.svc``). Publishing only Ready pods, that record would never
    appear and the pipeline would deadlock.
    """
    labels = names.engine_labels(service, role, gear)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(names.gear_headless_service_name(service, role, gear), namespace, labels, owner),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": names.engine_labels(service, role, gear),
            "ports": _http_port(ENGINE_PORT),
        },
    }


def role_selector(service: str, role: str, gear: str) -> dict[str, str]:
    """Selector of the role Service: the head pods (stage 0) of ``gear``."""
    return {
        names.LABEL_SERVICE: service,
        names.LABEL_ROLE: role,
        names.LABEL_GEAR: gear,
        names.LABEL_STAGE: "0",
    }


def build_role_service(
    service: str, namespace: str, role: str, gear: str, owner: dict[str, Any] | None = None
) -> dict[str, Any]:
    """``<pds>-<role>``: the Service whose selector names the role's active ``gear`` and stage 0.

    Headless: nothing sends traffic to a role VIP (the router picks pods from the Service's
    EndpointSlices), and a ClusterIP per role would exhaust small service CIDRs (the sandbox's /24 ran
    out at ~100 PDServices with two role VIPs each).
    """
    labels = names.common_labels(service, names.COMPONENT_ENGINE) | {names.LABEL_ROLE: role}
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(names.role_service_name(service, role), namespace, labels, owner),
        "spec": {
            "clusterIP": "None",
            "selector": role_selector(service, role, gear),
            "ports": _http_port(ENGINE_PORT),
        },
    }


def build_client_service(service: str, namespace: str, owner: dict[str, Any] | None = None) -> dict[str, Any]:
    """``<pds>``: the client-facing Service of the router pods."""
    labels = names.common_labels(service, names.COMPONENT_ROUTER)
    selector = {names.LABEL_SERVICE: service, names.LABEL_COMPONENT: names.COMPONENT_ROUTER}
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(service, namespace, labels, owner),
        "spec": {"selector": selector, "ports": _http_port(ROUTER_PORT)},
    }
