"""An in-memory :class:`~gearshift.adapters.kube.KubeApi` for unit tests: one fake API server that every
handler test runs against, so that they all see the same semantics (and the ones of a real server, where
the fake can have them cheaply).

What it does as the API server does:

- objects are stored by ``(kind, namespace, name)`` (cluster-scoped kinds: namespace None, whatever the
  caller passes); a call with another ``apiVersion`` than the stored object's finds nothing;
- every write that changes an object moves its ``resourceVersion`` (a counter, as a decimal string); a
  write that changes nothing (an apply of the same manifest, a patch to the values already there) leaves
  the object and its ``resourceVersion`` as they were;
- ``metadata.generation`` starts at 1 and moves when anything outside ``metadata`` and ``status``
  changes; ``metadata.uid`` is kept across writes;
- :meth:`FakeKubeApi.create` refuses a taken name with ``KubeApiError(409)``; ``patch`` and
  ``patch_status`` of a missing object raise ``KubeApiError(404)``; ``delete`` of a missing one is False;
- ``patch`` and ``patch_status`` are JSON merge patches (RFC 7386, :func:`merge_patch`: objects merge,
  ``None`` deletes, everything else, lists too, replaces); ``patch`` leaves ``status`` alone and
  ``patch_status`` touches nothing but ``status`` (every kind gearshift writes has a status subresource);
  ``create`` and ``apply`` ignore a manifest's ``status`` for the same reason;
- ``list`` filters by namespace (None: all) and by equality of labels.

Where it is simpler than the server (tests must not lean on these):

- ``apply`` replaces everything but ``status`` with the manifest (server-side apply would keep the fields
  other field managers own, e.g. a label another writer patched in);
- no resourceVersion preconditions, no finalizers, no owner-reference garbage collection, no
  ``creationTimestamp``; Events are recorded in :attr:`FakeKubeApi.events`, not stored as objects.

What it adds for tests: :attr:`FakeKubeApi.calls` (every call, in order), :attr:`FakeKubeApi.applied`
(every applied manifest, as sent), :attr:`FakeKubeApi.refuse` (failures to inject per verb and kind),
:meth:`FakeKubeApi.put` (a test's own write, outside the API) and :attr:`FakeKubeApi.runtime` (the one
operator :class:`~gearshift.handlers.runtime.Runtime` serving this API).

Only tests import this module (an import contract in pyproject.toml keeps shipped code off it).
"""

from __future__ import annotations

import copy
import functools
import itertools
import threading
from collections.abc import Mapping
from typing import Any

from gearshift.adapters.caches import PlanCache
from gearshift.adapters.kube import RESOURCES, KubeApiError, label_selector
from gearshift.control.reconcile.settings import Settings
from gearshift.handlers.runtime import Runtime
from gearshift.profiling.settings import ProbeSettings

#: ``(kind, namespace, name)``: where an object is stored; namespace None for cluster-scoped kinds.
Key = tuple[str, str | None, str]
#: ``(verb, kind, namespace, name)`` of one call: verb is the method's name; a list's name is its label
#: selector (``k=v,...``, sorted, as :class:`~gearshift.adapters.kube.RestKubeApi` sends it).
Call = tuple[str, str, str | None, str]

#: Kinds without a namespace (Node, GPUProfile, CustomResourceDefinition).
CLUSTER_KINDS = frozenset(kind for (_, kind), (_, namespaced) in RESOURCES.items() if not namespaced)
#: Metadata the server keeps itself: not part of what an apply compares.
_BOOKKEEPING = ("resourceVersion", "uid", "generation")


def merge_patch(target: Any, patch: Any) -> Any:
    """``target`` with the JSON merge patch ``patch`` applied (RFC 7386); neither is changed.

    A mapping patch merges into a mapping target key by key (a ``None`` value deletes the key; a target
    that is no mapping is replaced by an empty one first); any other patch (a scalar, a list) replaces the
    target whole.
    """
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    out = copy.deepcopy(dict(target)) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def _spec_part(obj: Mapping[str, Any]) -> dict[str, Any]:
    """What moves ``metadata.generation``: everything but metadata and status."""
    return {k: v for k, v in obj.items() if k not in ("metadata", "status")}


class FakeKubeApi:
    """An in-memory API server implementing :class:`~gearshift.adapters.kube.KubeApi` (see the module
    docstring for its semantics). Thread-safe: handlers call it from kopf's threads.

    Args:
        settings, plans, probe: what :attr:`runtime` is built with (the reconciler's settings, a plan
            cache to share across tests, the profiling settings); None: the Runtime's own defaults.

    Attributes:
        store: ``(kind, namespace, name) -> object``; tests may read and edit it directly (an edit there
            bypasses the bookkeeping, as an etcd edit would).
        calls: every call made through the API, in order (:data:`Call`).
        applied: every manifest given to :meth:`apply`, as given, in order.
        events: every Event given to :meth:`create_event`, in order.
        refuse: ``(verb, kind) -> exception`` raised by every such call (after it is logged in
            :attr:`calls`, before it changes anything).
    """

    def __init__(
        self,
        *,
        settings: Settings | None = None,
        plans: PlanCache | None = None,
        probe: ProbeSettings | None = None,
    ) -> None:
        self.store: dict[Key, dict[str, Any]] = {}
        self.calls: list[Call] = []
        self.applied: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self.refuse: dict[tuple[str, str], Exception] = {}
        self._rv = itertools.count(1)
        self._lock = threading.RLock()
        self._runtime_args = (settings, plans, probe)

    # --- for tests ---------------------------------------------------------------------------------------
    @functools.cached_property
    def runtime(self) -> Runtime:
        """The Runtime of the one operator serving this API (made on first use, with this API's settings,
        plans and probe settings): its locks, caches and per-object memory last as long as the API, as
        they last as long as the operator's process. (Passing ``self`` as its ``api`` is also where mypy
        checks that this class is a :class:`~gearshift.adapters.kube.KubeApi`.)"""
        settings, plans, probe = self._runtime_args
        return Runtime(api=self, settings=settings, plans=plans, probe=probe)

    @staticmethod
    def key(kind: str, namespace: str | None, name: str) -> Key:
        """Where an object of ``kind`` is stored (a cluster-scoped kind's namespace is dropped)."""
        return (kind, None if kind in CLUSTER_KINDS else namespace, name)

    def put(self, obj: Mapping[str, Any], namespace: str | None = None) -> dict[str, Any]:
        """Store ``obj`` as a test's own write (as ``kubectl replace`` would, without its checks); returns
        the stored copy.

        ``namespace`` (ignored for cluster-scoped kinds) overrides ``metadata.namespace``. The object
        gets a fresh ``resourceVersion``; ``uid`` defaults to ``uid-<name>`` and ``generation`` to 1, and
        both are otherwise kept as given (so a test decides the generation it writes).
        """
        stored = copy.deepcopy(dict(obj))
        meta = stored.setdefault("metadata", {})
        if namespace and stored["kind"] not in CLUSTER_KINDS:
            meta["namespace"] = namespace
        meta.setdefault("uid", f"uid-{meta['name']}")
        meta.setdefault("generation", 1)
        with self._lock:
            meta["resourceVersion"] = str(next(self._rv))
            self.store[self.key(stored["kind"], meta.get("namespace"), meta["name"])] = stored
            return copy.deepcopy(stored)

    def verbs(self) -> list[tuple[str, str]]:
        """``(verb, kind)`` of every call, in order."""
        return [(verb, kind) for verb, kind, _, _ in self.calls]

    # --- the API -----------------------------------------------------------------------------------------
    def get(self, api_version: str, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        key = self._called("get", kind, namespace, name)
        with self._lock:
            obj = self.store.get(key)
            if obj is None or obj.get("apiVersion") != api_version:
                return None
            return copy.deepcopy(obj)

    def list(
        self,
        api_version: str,
        kind: str,
        namespace: str | None = None,
        labels: Mapping[str, str] | None = None,
    ) -> list[dict[str, Any]]:
        self._called("list", kind, namespace, label_selector(labels))
        wanted = dict(labels or {})
        with self._lock:
            return [
                copy.deepcopy(obj)
                for (k, ns, _), obj in self.store.items()
                if k == kind
                and obj.get("apiVersion") == api_version
                and (namespace is None or kind in CLUSTER_KINDS or ns == namespace)
                and all((obj["metadata"].get("labels") or {}).get(a) == b for a, b in wanted.items())
            ]

    def create(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        meta = manifest["metadata"]
        kind, namespace = manifest["kind"], meta.get("namespace")
        key = self._called("create", kind, namespace, meta["name"])
        if kind not in CLUSTER_KINDS and not namespace:
            raise ValueError(f"{kind} {meta['name']!r} is namespaced: give its namespace")
        with self._lock:
            if key in self.store:
                raise KubeApiError(f"POST {kind} {meta['name']!r}: 409 Conflict: already exists", 409)
            obj = copy.deepcopy(dict(manifest))
            obj.pop("status", None)
            return self._write(key, obj, None)

    def apply(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        meta = manifest["metadata"]
        key = self._called("apply", manifest["kind"], meta.get("namespace"), meta["name"])
        with self._lock:
            self.applied.append(copy.deepcopy(dict(manifest)))
            new = copy.deepcopy(dict(manifest))
            new.pop("status", None)
            old = self.store.get(key)
            if old is not None:
                # The server's own metadata is no part of what the manifest says: compare without it.
                for field in _BOOKKEEPING:
                    new["metadata"].pop(field, None)
                    if field in old["metadata"]:
                        new["metadata"][field] = old["metadata"][field]
                if "status" in old:
                    new["status"] = copy.deepcopy(old["status"])
            return self._write(key, new, old)

    def delete(self, api_version: str, kind: str, namespace: str | None, name: str) -> bool:
        key = self._called("delete", kind, namespace, name)
        with self._lock:
            obj = self.store.get(key)
            if obj is None or obj.get("apiVersion") != api_version:
                return False
            del self.store[key]
            return True

    def patch_status(
        self, api_version: str, kind: str, namespace: str | None, name: str, status: Mapping[str, Any]
    ) -> dict[str, Any]:
        key = self._called("patch_status", kind, namespace, name)
        with self._lock:
            old = self._existing(key, api_version, "PATCH status")
            new = copy.deepcopy(old)
            new["status"] = merge_patch(old.get("status"), status)
            return self._write(key, new, old)

    def patch(
        self, api_version: str, kind: str, namespace: str | None, name: str, body: Mapping[str, Any]
    ) -> dict[str, Any]:
        key = self._called("patch", kind, namespace, name)
        with self._lock:
            old = self._existing(key, api_version, "PATCH")
            new = merge_patch(old, {k: v for k, v in body.items() if k != "status"})
            # Identity and bookkeeping are the server's: a patch does not move them.
            for field in (*_BOOKKEEPING, "name", "namespace"):
                if field in old["metadata"]:
                    new.setdefault("metadata", {})[field] = old["metadata"][field]
            return self._write(key, new, old)

    def create_event(self, event: Mapping[str, Any]) -> None:
        meta = event.get("metadata") or {}
        self._called(
            "create_event", "Event", meta.get("namespace"), meta.get("name") or meta.get("generateName", "")
        )
        with self._lock:
            self.events.append(copy.deepcopy(dict(event)))

    # --- the server's side -------------------------------------------------------------------------------
    def _called(self, verb: str, kind: str, namespace: str | None, name: str) -> Key:
        """Log the call, raise what :attr:`refuse` holds for it; the key of its object."""
        key = self.key(kind, namespace, name)
        with self._lock:
            self.calls.append((verb, kind, key[1], name))
            err = self.refuse.get((verb, kind))
        if err is not None:
            raise err
        return key

    def _existing(self, key: Key, api_version: str, what: str) -> dict[str, Any]:
        """The stored object of ``key`` and ``api_version`` (live: lock held).

        Raises:
            KubeApiError: 404, there is none.
        """
        obj = self.store.get(key)
        if obj is None or obj.get("apiVersion") != api_version:
            raise KubeApiError(f"{what} {key[0]} {key[2]!r}: 404 Not Found", 404)
        return obj

    def _write(self, key: Key, new: dict[str, Any], old: dict[str, Any] | None) -> dict[str, Any]:
        """Store ``new`` in place of ``old`` (None: a new object) with the server's bookkeeping; a write
        that changes nothing keeps ``old`` as it was. Returns a copy of what is stored. Lock held."""
        if old is not None and new == old:
            return copy.deepcopy(old)
        meta = new.setdefault("metadata", {})
        if old is None:
            meta.setdefault("uid", f"uid-{meta['name']}")
            meta["generation"] = 1
        else:
            meta["uid"] = old["metadata"].get("uid", f"uid-{meta['name']}")
            generation = old["metadata"].get("generation", 1)
            meta["generation"] = generation + (_spec_part(new) != _spec_part(old))
        meta["resourceVersion"] = str(next(self._rv))
        self.store[key] = new
        return copy.deepcopy(new)
