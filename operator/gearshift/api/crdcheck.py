"""Whether the CRDs installed in a cluster hold every field this operator writes. Pure.

Helm installs ``charts/gearshift/crds/`` once and never upgrades them (Helm's documented rule for the
``crds/`` folder), so after ``helm upgrade`` a new operator can run against an older CRD. The API server
then prunes every field the old schema lacks from what the operator writes (structural schemas prune
unknown fields, Kubernetes docs "Versions in CustomResourceDefinitions", "Field pruning"), silently:
the executor state of a GearSet vanished and a forced shift cycled Warming ↔ Degraded for ever.

:func:`schema_gaps` lists the property paths of the operator's own CRD (:mod:`gearshift.api.crdgen`, the
one source of the schemas) that the installed one lacks; :func:`stale_message` says what to do.

A CRD can also be replaced *while* the operator runs (``kubectl apply`` of an older chart's CRDs, a Helm
CRD job): kopf's watch then meets ``429 storage is (re)initializing`` while the API server rebuilds the
resource's storage, and nothing said a word (kopf#574: kopf has no notion of a CRD changing under it).
:func:`seen_crd` and :func:`crd_change` are the pure half of the poller that notices
(:mod:`gearshift.handlers.crdwatch`): a CRD as seen (resourceVersion and a hash of the served schema) and
what a new sighting means; :func:`prunable_paths` names what a status write would lose to the installed
schema before it is sent, so such a write can be held instead of half-stored.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from gearshift.api import crdgen
from gearshift.api.common import VERSION

#: How to bring the CRDs up to date (Helm does not); the chart README says the same.
UPGRADE_HINT = (
    "apply this release's CRDs: `kubectl apply --server-side --force-conflicts -f charts/gearshift/crds/` "
    "(or `gearshift crds --out DIR` and apply DIR); `helm upgrade` never updates crds/"
)


def schema_gaps(installed: Mapping[str, Any], expected: Mapping[str, Any], path: str = "") -> list[str]:
    """Property paths of ``expected`` (an openAPIV3Schema) missing from ``installed``, and enum values
    ``expected`` allows that ``installed`` does not (``path value 'X'``), sorted.

    Descends ``properties``, ``items`` (``path[]``) and ``additionalProperties`` (``path{}``); a node of
    ``installed`` with ``x-kubernetes-preserve-unknown-fields: true`` keeps whatever is written below it,
    so nothing below it is missing.
    """
    if installed.get("x-kubernetes-preserve-unknown-fields") is True:
        return []
    gaps: list[str] = []
    # A value the operator writes that an older enum lacks fails the whole status write (422).
    if isinstance(expected.get("enum"), list) and isinstance(installed.get("enum"), list):
        have_values = set(map(str, installed["enum"]))
        gaps += [f"{path} value {v!r}" for v in expected["enum"] if str(v) not in have_values]
    have = installed.get("properties") or {}
    for name, sub in (expected.get("properties") or {}).items():
        where = f"{path}.{name}" if path else name
        if name not in have:
            gaps.append(where)
        else:
            gaps += schema_gaps(have[name], sub, where)
    if isinstance(expected.get("items"), Mapping) and isinstance(installed.get("items"), Mapping):
        gaps += schema_gaps(installed["items"], expected["items"], f"{path}[]")
    exp_add, have_add = expected.get("additionalProperties"), installed.get("additionalProperties")
    if isinstance(exp_add, Mapping) and isinstance(have_add, Mapping):
        gaps += schema_gaps(have_add, exp_add, f"{path}{{}}")
    return sorted(gaps)


def version_schema(crd: Mapping[str, Any], version: str = VERSION) -> Mapping[str, Any] | None:
    """The openAPIV3Schema of ``version`` in a CRD object; None when the CRD does not serve it."""
    for v in (crd.get("spec") or {}).get("versions") or []:
        if v.get("name") == version:
            return dict(((v.get("schema") or {}).get("openAPIV3Schema")) or {})
    return None


def crd_gaps(kind: crdgen.Kind, installed: Mapping[str, Any] | None) -> list[str]:
    """The gaps (:func:`schema_gaps`) of the installed CRD object of ``kind`` against this operator's;
    ``["(not installed)"]`` when there is none, ``["(no version v1alpha1)"]`` when it does not serve the
    version; ``[]`` when it is current. The start-up check and the running poller share it."""
    if installed is None:
        return ["(not installed)"]
    schema = version_schema(installed)
    if schema is None:
        return [f"(no version {VERSION})"]
    return schema_gaps(schema, crdgen.crd(kind)["spec"]["versions"][0]["schema"]["openAPIV3Schema"])


def stale_crds(installed: Mapping[str, Mapping[str, Any] | None]) -> dict[str, list[str]]:
    """Per CRD name (``gearsets.gearshift.io``, ...): the gaps of the installed one, for every kind the
    operator serves; a CRD that is not installed, or lacks the version, maps to ``["(not installed)"]``
    or ``["(no version v1alpha1)"]``. Kinds with no gap are left out."""
    out: dict[str, list[str]] = {}
    for kind in crdgen.KINDS:
        gaps = crd_gaps(kind, installed.get(kind.name))
        if gaps:
            out[kind.name] = gaps
    return out


def stale_message(stale: Mapping[str, list[str]], limit: int = 8) -> str:
    """One line per stale CRD (at most ``limit`` paths each), then the fix."""
    parts = []
    for name, gaps in sorted(stale.items()):
        shown = ", ".join(gaps[:limit]) + (f" and {len(gaps) - limit} more" if len(gaps) > limit else "")
        parts.append(f"{name} lacks {shown}")
    return (
        "the installed CRDs are older than this operator, so the API server would drop what it writes: "
        + "; ".join(parts)
        + f". Fix: {UPGRADE_HINT}"
    )


def pruned_paths(
    written: Mapping[str, Any], stored: Mapping[str, Any] | None, path: str = "status"
) -> list[str]:
    """Paths of what was written (a JSON merge patch body below ``path``) that the stored object lacks:
    the fields the API server pruned because its CRD does not know them.

    ``None`` values (merge-patch deletions) are skipped; dicts are descended, and lists of the same
    length element by element (``path[i]``), since a merge patch replaces a list whole. Scalars are not
    compared: another writer may have changed them since, which is not pruning.
    """
    out: list[str] = []
    stored = stored or {}
    for key, value in written.items():
        if value is None:
            continue
        here = f"{path}.{key}"
        if key not in stored:
            out.append(here)
        elif isinstance(value, Mapping) and isinstance(stored[key], Mapping):
            out += pruned_paths(value, stored[key], here)
        elif isinstance(value, list) and isinstance(stored[key], list) and len(value) == len(stored[key]):
            for i, (w, s) in enumerate(zip(value, stored[key], strict=True)):
                if isinstance(w, Mapping) and isinstance(s, Mapping):
                    out += pruned_paths(w, s, f"{here}[{i}]")
    return out


def schema_hash(schema: Mapping[str, Any] | None) -> str | None:
    """The first 16 hex digits of the SHA-256 of ``schema`` as canonical JSON (keys sorted, no spaces);
    None for no schema. A CRD's ``resourceVersion`` also moves when only its status (``Established``,
    ``acceptedNames``) is written, so a change of schema is told by this hash, not by the version."""
    if schema is None:
        return None
    text = json.dumps(schema, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class SeenCRD:
    """One sighting of an installed CRD: its name, ``metadata.resourceVersion`` (None: not installed),
    :func:`schema_hash` of the served version's schema, and its :func:`crd_gaps` (empty: current)."""

    name: str
    resource_version: str | None
    schema_hash: str | None
    gaps: tuple[str, ...]

    @property
    def current(self) -> bool:
        """The installed CRD holds every field this operator writes."""
        return not self.gaps


def seen_crd(kind: crdgen.Kind, installed: Mapping[str, Any] | None) -> SeenCRD:
    """What a read of ``kind``'s CRD (the object, None when it is not installed) shows."""
    meta = (installed or {}).get("metadata") or {}
    schema = version_schema(installed) if installed is not None else None
    return SeenCRD(
        kind.name, meta.get("resourceVersion"), schema_hash(schema), tuple(crd_gaps(kind, installed))
    )


#: What a new sighting means (:func:`crd_change`): ``outdated``: the schema changed (or this is the first
#: sighting) and now lacks fields the operator writes; ``current``: it holds them all again after lacking
#: some, or at the first sighting (objects may still carry ``CRDCurrent=False`` from before); ``changed``:
#: a new schema that is still current (nothing to do but say so).
CRDChange = Literal["outdated", "current", "changed"]


def crd_change(before: SeenCRD | None, after: SeenCRD) -> CRDChange | None:
    """What ``after`` means next to the previous sighting ``before`` (None: the first); None when the
    schema is the one seen before (a bare ``resourceVersion`` move: the CRD's status was written)."""
    if before is not None and before.schema_hash == after.schema_hash and before.gaps == after.gaps:
        return None
    if after.gaps:
        return "outdated"
    if before is None or before.gaps:
        return "current"
    return "changed"


def _schema_at(node: Mapping[str, Any], key: str) -> Mapping[str, Any] | bool | None:
    """The schema of ``key`` below the object schema ``node``: its ``properties`` entry, else
    ``additionalProperties`` (a schema, or True: any value kept), else None (the key is pruned)."""
    props = node.get("properties") or {}
    if key in props:
        return dict(props[key] or {})
    extra = node.get("additionalProperties")
    if extra is True or isinstance(extra, Mapping):
        return extra if extra is True else dict(extra)
    return None


def prunable_paths(written: Mapping[str, Any], schema: Mapping[str, Any], path: str = "status") -> list[str]:
    """Paths of a status write (a JSON merge patch body below ``path``) that an object schema without them
    would prune, in ``pruned_paths``' form (``status.a.b``, ``status.list[i].c``), in the order written.

    ``schema`` is the schema of the value at ``path`` (for a whole object's openAPIV3Schema, pass
    ``schema["properties"]["status"]``). Structural pruning keeps a field when its object schema lists it
    in ``properties``, allows it by ``additionalProperties``, or says
    ``x-kubernetes-preserve-unknown-fields: true`` (Kubernetes docs, "Field pruning"); everything else is
    dropped on write. ``None`` values (merge-patch deletions) are skipped.
    """
    if schema.get("x-kubernetes-preserve-unknown-fields") is True:
        return []
    out: list[str] = []
    for key, value in written.items():
        if value is None:
            continue
        here = f"{path}.{key}"
        sub = _schema_at(schema, key)
        if sub is None:
            out.append(here)
        elif not isinstance(sub, Mapping):
            continue  # additionalProperties: true keeps any value
        elif isinstance(value, Mapping):
            out += prunable_paths(value, sub, here)
        elif isinstance(value, list) and isinstance(sub.get("items"), Mapping):
            for i, item in enumerate(value):
                if isinstance(item, Mapping):
                    out += prunable_paths(item, sub["items"], f"{here}[{i}]")
    return out


def status_schema(schema: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """The ``status`` schema of an object's openAPIV3Schema; an empty one (everything pruned) when the
    schema has no ``status`` property; None for no schema."""
    if schema is None:
        return None
    return dict(((schema.get("properties") or {}).get("status")) or {})
