"""Whether the CRDs installed in a cluster hold every field this operator writes (#20 row 5). Pure.

Helm installs ``charts/gearshift/crds/`` once and never upgrades them (Helm's documented rule for the
``crds/`` folder), so after ``helm upgrade`` a new operator can run against an older CRD. The API server
then prunes every field the old schema lacks from what the operator writes (structural schemas prune
unknown fields, Kubernetes docs "Versions in CustomResourceDefinitions", "Field pruning"), silently:
the executor state of a GearSet vanished and a forced shift cycled Warming ↔ Degraded for ever.

:func:`schema_gaps` lists the property paths of the operator's own CRD (:mod:`gearshift.api.crdgen`, the
one source of the schemas) that the installed one lacks; :func:`stale_message` says what to do.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

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


def stale_crds(installed: Mapping[str, Mapping[str, Any] | None]) -> dict[str, list[str]]:
    """Per CRD name (``gearsets.gearshift.io``, ...): the gaps of the installed one, for every kind the
    operator serves; a CRD that is not installed, or lacks the version, maps to ``["(not installed)"]``
    or ``["(no version v1alpha1)"]``. Kinds with no gap are left out."""
    out: dict[str, list[str]] = {}
    for kind in crdgen.KINDS:
        want = crdgen.crd(kind)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        got = installed.get(kind.name)
        if got is None:
            out[kind.name] = ["(not installed)"]
            continue
        schema = version_schema(got)
        if schema is None:
            out[kind.name] = [f"(no version {VERSION})"]
            continue
        gaps = schema_gaps(schema, want)
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
