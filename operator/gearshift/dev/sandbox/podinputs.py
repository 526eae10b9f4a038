"""What a sandbox pod's containers get from the API server: ConfigMap and Secret values for their
environment, and the kubeconfig of the pod's ServiceAccount (a TokenRequest token bound to the pod)."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gearshift.dev.sandbox import podspec

if TYPE_CHECKING:
    from kubernetes.client import CoreV1Api

#: Lifetime of a pod's ServiceAccount token, s. The token is bound to the pod (revoked when it is
#: deleted) and not rotated, so it outlives any sandbox session.
TOKEN_TTL_S = 7 * 24 * 3600


def lookup(core: CoreV1Api, kind: str, ns: str, name: str) -> dict[str, str] | None:
    """The data of ConfigMap or Secret ``ns/name`` (``kind``) through ``core``; None when
    it does not exist."""
    from kubernetes.client.rest import ApiException

    try:
        if kind == "ConfigMap":
            return dict(core.read_namespaced_config_map(name, ns).data or {})
        secret = core.read_namespaced_secret(name, ns)
        data = {k: base64.b64decode(v).decode() for k, v in (secret.data or {}).items()}
        return {**data, **(secret.string_data or {})}
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


def credentials(core: CoreV1Api, admin_kubeconfig: Path, pod: dict[str, Any], pod_dir: Path) -> Path | None:
    """The kubeconfig the pod's containers get: the admin one (``admin_kubeconfig``), or its
    ServiceAccount's (see ``podspec.service_account_for``); None when the pod must have no credentials.

    Raises:
        PodSpecError: the ServiceAccount does not exist, or the API refused the token.
    """
    import yaml
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    sa = podspec.service_account_for(pod)
    if sa is None:
        return admin_kubeconfig
    if not sa:
        return None
    meta = pod["metadata"]
    request = client.AuthenticationV1TokenRequest(
        spec=client.V1TokenRequestSpec(
            audiences=[],
            expiration_seconds=TOKEN_TTL_S,
            bound_object_ref=client.V1BoundObjectReference(
                api_version="v1", kind="Pod", name=meta["name"], uid=meta["uid"]
            ),
        )
    )
    try:
        token = core.create_namespaced_service_account_token(sa, meta["namespace"], request)
    except ApiException as exc:
        raise podspec.PodSpecError(
            f"spec.serviceAccountName {sa!r}: cannot get a token ({exc.status} {exc.reason})"
        ) from None
    admin = yaml.safe_load(admin_kubeconfig.read_text())
    cfg = podspec.service_account_kubeconfig(admin, token.status.token, meta["namespace"])  # type: ignore[union-attr,arg-type]  # a created TokenRequest has its status
    path = pod_dir / "serviceaccount.kubeconfig"
    path.touch(mode=0o600)
    path.write_text(yaml.safe_dump(cfg))
    return path
