"""The operator's narrow view of the Kubernetes API: get, list, create, server-side apply, delete, patch,
status, events; and the write fence that keeps a replica that does not lead from writing.

:class:`KubeApi` is the protocol the reconciler codes against; :class:`RestKubeApi` implements it with the
``kubernetes`` client's REST layer (no discovery round trips: the few kinds gearshift touches have fixed
paths in :data:`RESOURCES`), and :func:`rest_api_from_config` builds one from the process's credentials.
Applies use server-side apply with field manager ``gearshift`` and ``force=true`` (the operator owns these
objects), so applying the same manifest twice is a no-op that leaves ``resourceVersion`` unchanged, and a
changed manifest patches only the fields that changed. Every call counts in
:data:`gearshift.adapters.metrics.API_REQUESTS` (by verb and resource), the operator's own API traffic
(kopf's watches and its own patches are not in it).

The write fence (:data:`FENCE`): losing the Lease must stop every handler at once (nothing acts without
it). kopf's handlers cannot be cancelled from outside, so the operator re-executes itself on a loss
(``gearshift.handlers.main``); the fence covers the time before that, and a failed re-exec: every write
goes through one of two functions, and both ask :data:`FENCE` first.

- the handlers' own API calls: :meth:`RestKubeApi._call`;
- kopf's: every request kopf makes (its patches of status, finalizers and annotations, its events, its
  watches) goes through ``kopf._cogs.clients.api.request`` (kopf 1.45: ``get``/``post``/``patch``/
  ``delete``/``stream`` in that module look it up by its global name at each call), which
  :func:`install_kopf_fence` wraps once.

A write is any method but GET, HEAD and OPTIONS (watches are GETs): reads cannot act, and a standby may
read. Without ``--leader-elect`` the fence stays open. controller-runtime has no such fence: it exits on
a loss, and its manager stops the runnables on the way ("leader election lost"). The fence lives here, with
the client it guards, because its refusal is a :class:`KubeApiError` the client raises.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, Protocol

from gearshift.adapters.metrics import API_REQUESTS
from gearshift.api.common import API_VERSION

log = logging.getLogger("gearshift.fence")

# --- the (apiVersion, kind) of every object the handlers read or write: one place ------------------------
PDS = (API_VERSION, "PDService")
GS = (API_VERSION, "GearSet")
GPUP = (API_VERSION, "GPUProfile")
STS = ("apps/v1", "StatefulSet")
SVC = ("v1", "Service")
NODE = ("v1", "Node")
POD = ("v1", "Pod")
DEPLOY = ("apps/v1", "Deployment")
JOB = ("batch/v1", "Job")
CRD = ("apiextensions.k8s.io/v1", "CustomResourceDefinition")

#: Field manager of every server-side apply by the operator.
FIELD_MANAGER = "gearshift"
#: Kept HTTPS connections to the API server: kopf's handler threads, the reconcile and loop pools, and
#: room for the threads asyncio lends (gearshift.handlers.main's --workers is 8 by default).
CONNECTION_POOL_SIZE = 32

#: (apiVersion, kind) -> (plural, namespaced); read-only.
RESOURCES: Mapping[tuple[str, str], tuple[str, bool]] = MappingProxyType(
    {
        ("v1", "Service"): ("services", True),
        ("v1", "ServiceAccount"): ("serviceaccounts", True),
        ("v1", "Pod"): ("pods", True),
        ("v1", "Node"): ("nodes", False),
        ("v1", "Event"): ("events", True),
        ("apps/v1", "StatefulSet"): ("statefulsets", True),
        ("apps/v1", "Deployment"): ("deployments", True),
        JOB: ("jobs", True),
        ("rbac.authorization.k8s.io/v1", "Role"): ("roles", True),
        ("rbac.authorization.k8s.io/v1", "RoleBinding"): ("rolebindings", True),
        PDS: ("pdservices", True),
        GS: ("gearsets", True),
        GPUP: ("gpuprofiles", False),
        CRD: ("customresourcedefinitions", False),
    }
)


class KubeApiError(RuntimeError):
    """The API server refused a request; ``status`` is its HTTP status code (0: no answer)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


# --- the write fence ------------------------------------------------------------------------------------
#: HTTP methods that change nothing.
READS = frozenset({"GET", "HEAD", "OPTIONS"})


class NotLeader(KubeApiError):
    """A write refused by the fence: this replica does not hold the Lease (``status`` 0: never sent)."""


class Fence:
    """Whether writes may go out: open by default; :meth:`guard` makes a predicate decide, :meth:`close`
    shuts it for good (the process is about to re-execute or exit)."""

    def __init__(self) -> None:
        self._may: Callable[[], bool] | None = None
        self._closed = threading.Event()
        self.refused = 0

    def guard(self, may_act: Callable[[], bool]) -> None:
        """Writes go out only while ``may_act()`` is true (asked at each write)."""
        self._may = may_act

    def close(self) -> None:
        self._closed.set()

    def reset(self) -> None:
        """Open again, unguarded (tests)."""
        self._may = None
        self._closed.clear()
        self.refused = 0

    def allows(self, method: str) -> bool:
        if method.upper() in READS:
            return True
        if self._closed.is_set():
            return False
        may = self._may
        return may is None or may()

    def check(self, method: str, what: str) -> None:
        """Raise :class:`NotLeader` for a write the fence refuses.

        Raises:
            NotLeader: ``method`` writes and this replica may not act.
        """
        if not self.allows(method):
            self.refused += 1
            if self.refused == 1:
                log.warning("not the leader: refused %s %s (and every write until the re-exec)", method, what)
            raise NotLeader(f"{method.upper()} {what}: refused, this replica does not hold the Lease")


FENCE = Fence()


def install_kopf_fence() -> None:
    """Wrap ``kopf._cogs.clients.api.request`` with :data:`FENCE` (idempotent)."""
    from kopf._cogs.clients import api

    original = api.request
    if getattr(original, "_gearshift_fenced", False):
        return

    async def fenced(method: str, url: str, *args: Any, **kwargs: Any) -> Any:
        FENCE.check(method, url)
        return await original(method, url, *args, **kwargs)

    fenced._gearshift_fenced = True  # type: ignore[attr-defined]
    api.request = fenced


# --- the client ------------------------------------------------------------------------------------------
def resource_path(api_version: str, kind: str, namespace: str | None = None, name: str | None = None) -> str:
    """The REST path of a collection or object.

    Raises:
        KeyError: a kind gearshift does not handle.
        ValueError: a namespaced kind without ``namespace``.
    """
    try:
        plural, namespaced = RESOURCES[(api_version, kind)]
    except KeyError:
        raise KeyError(f"gearshift does not handle {api_version} {kind}") from None
    base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    if namespaced:
        if namespace:
            base += f"/namespaces/{namespace}"
        elif name:
            raise ValueError(f"{kind} {name!r} is namespaced: give its namespace")
    path = f"{base}/{plural}"
    return f"{path}/{name}" if name else path


def label_selector(labels: Mapping[str, str] | None) -> str:
    """``k=v,k2=v2`` from a mapping (sorted, so the same mapping gives the same string)."""
    return ",".join(f"{k}={v}" for k, v in sorted((labels or {}).items()))


class KubeApi(Protocol):
    """What the reconciler needs from the API server."""

    def get(self, api_version: str, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        """The object, or None when it does not exist."""
        ...

    def list(
        self,
        api_version: str,
        kind: str,
        namespace: str | None = None,
        labels: Mapping[str, str] | None = None,
    ) -> list[dict[str, Any]]:
        """Objects of a kind (in ``namespace``, or all), filtered by equality ``labels``."""
        ...

    def create(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        """Create ``manifest`` (POST); returns the object as stored.

        Raises:
            KubeApiError: the server refused it; status 409 when an object of that name exists (it is left
                as it is).
            ValueError: a namespaced kind without ``metadata.namespace``.
        """
        ...

    def apply(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        """Server-side apply ``manifest``; returns the object as stored."""
        ...

    def delete(self, api_version: str, kind: str, namespace: str | None, name: str) -> bool:
        """Delete an object (background propagation); False when it was already gone."""
        ...

    def patch_status(
        self, api_version: str, kind: str, namespace: str | None, name: str, status: Mapping[str, Any]
    ) -> dict[str, Any]:
        """JSON merge patch of the status subresource."""
        ...

    def patch(
        self, api_version: str, kind: str, namespace: str | None, name: str, body: Mapping[str, Any]
    ) -> dict[str, Any]:
        """JSON merge patch of the object (not its status), e.g. ``{"spec": {"replicas": 3}}``."""
        ...

    def create_event(self, event: Mapping[str, Any]) -> None:
        """Create a core/v1 Event."""
        ...


def resource_of_path(path: str) -> str:
    """The resource a REST path names, with its subresource: ``/apis/apps/v1/namespaces/n/statefulsets/x``
    → ``statefulsets``, ``/api/v1/nodes/x/status`` → ``nodes/status``, ``/api/v1/pods`` → ``pods``."""
    parts = [p for p in path.split("?", 1)[0].split("/") if p]
    rest = parts[2:] if parts[:1] == ["api"] else parts[3:]
    if len(rest) >= 2 and rest[0] == "namespaces" and len(rest) != 2:
        rest = rest[2:]
    if not rest:
        return ""
    return f"{rest[0]}/{rest[2]}" if len(rest) >= 3 else rest[0]


class RestKubeApi:
    """:class:`KubeApi` over a ``kubernetes.client.ApiClient`` (sync; call it from threads)."""

    def __init__(self, api_client: Any) -> None:
        self.client = api_client

    def _call(
        self,
        method: str,
        path: str,
        *,
        query: list[tuple[str, str]] | None = None,
        body: Any = None,
        content_type: str | None = None,
    ) -> Any:
        from kubernetes.client.exceptions import ApiException

        FENCE.check(method, path)  # before anything is counted or sent: see the module docstring
        API_REQUESTS.labels(method, resource_of_path(path)).inc()
        headers = {"Accept": "application/json"}
        if content_type:
            headers["Content-Type"] = content_type
        try:
            # kubernetes >= 31 (OpenAPI generator 7): serialise, then send; errors come back as statuses.
            m, url, hdrs, data, _post = self.client.param_serialize(
                method=method,
                resource_path=path,
                query_params=query or [],
                header_params=headers,
                body=body,
                auth_settings=["BearerToken"],
            )
            resp = self.client.call_api(m, url, header_params=hdrs, body=data)
            raw = resp.read()
        except ApiException as exc:
            raise KubeApiError(f"{method} {path}: {exc.status} {exc.reason}", exc.status or 0) from None
        if resp.status >= 400:
            text = raw.decode(errors="replace")[:2000] if raw else ""
            raise KubeApiError(f"{method} {path}: {resp.status} {resp.reason}: {text}", resp.status)
        return json.loads(raw) if raw else None

    def get(self, api_version: str, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        try:
            return self._call("GET", resource_path(api_version, kind, namespace, name))
        except KubeApiError as exc:
            if exc.status == 404:
                return None
            raise

    def list(
        self,
        api_version: str,
        kind: str,
        namespace: str | None = None,
        labels: Mapping[str, str] | None = None,
    ) -> list[dict[str, Any]]:
        query = [("labelSelector", label_selector(labels))] if labels else []
        out = self._call("GET", resource_path(api_version, kind, namespace), query=query)
        return list(out.get("items") or [])

    def create(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        # A plain POST, not an apply: it leaves an existing object alone (409), and RBAC's create verb is
        # all it needs (the probe Jobs' Role grants no patch).
        api_version, kind = manifest["apiVersion"], manifest["kind"]
        namespace = manifest["metadata"].get("namespace")
        if RESOURCES.get((api_version, kind), ("", False))[1] and not namespace:
            raise ValueError(f"{kind} {manifest['metadata'].get('name')!r} is namespaced: give its namespace")
        path = resource_path(api_version, kind, namespace)
        return self._call("POST", path, body=dict(manifest), content_type="application/json")

    def apply(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        meta = manifest["metadata"]
        path = resource_path(manifest["apiVersion"], manifest["kind"], meta.get("namespace"), meta["name"])
        return self._call(
            "PATCH",
            path,
            query=[("fieldManager", FIELD_MANAGER), ("force", "true")],
            body=dict(manifest),
            content_type="application/apply-patch+yaml",
        )

    def delete(self, api_version: str, kind: str, namespace: str | None, name: str) -> bool:
        try:
            self._call(
                "DELETE",
                resource_path(api_version, kind, namespace, name),
                body={"propagationPolicy": "Background"},
            )
        except KubeApiError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    def patch_status(
        self, api_version: str, kind: str, namespace: str | None, name: str, status: Mapping[str, Any]
    ) -> dict[str, Any]:
        return self._call(
            "PATCH",
            resource_path(api_version, kind, namespace, name) + "/status",
            body={"status": dict(status)},
            content_type="application/merge-patch+json",
        )

    def patch(
        self, api_version: str, kind: str, namespace: str | None, name: str, body: Mapping[str, Any]
    ) -> dict[str, Any]:
        """JSON merge patch of the object (not its status): e.g. ``{"spec": {"replicas": 3}}``."""
        return self._call(
            "PATCH",
            resource_path(api_version, kind, namespace, name),
            body=dict(body),
            content_type="application/merge-patch+json",
        )

    def create_event(self, event: Mapping[str, Any]) -> None:
        ns = event["metadata"]["namespace"]
        self._call("POST", resource_path("v1", "Event", ns), body=dict(event))


def rest_api_from_config() -> RestKubeApi:
    """A :class:`RestKubeApi` over in-cluster credentials, else ``$KUBECONFIG`` / ``~/.kube/config``.

    Raises:
        kubernetes.config.ConfigException: neither is there.
    """
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    cfg = client.Configuration.get_default_copy()
    # One kept connection per thread that may call at once: with the client's default (5 per CPU: 10 on
    # 2 cores) the operator's handler and loop threads discarded connections and made new ones, a TLS
    # handshake each ("Connection pool is full", bench/fleet_operator.py).
    cfg.connection_pool_maxsize = max(cfg.connection_pool_maxsize or 0, CONNECTION_POOL_SIZE)
    return RestKubeApi(client.ApiClient(cfg))
