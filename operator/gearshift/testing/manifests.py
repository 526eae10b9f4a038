"""Manifests of gearshift's three kinds for tests and benchmarks, built from the API models.

Each builder takes the spec as a user writes it (camelCase keys, as in ``kubectl apply``), checks the whole
object with its model (:class:`~gearshift.api.gearset.GearSet`, :class:`~gearshift.api.pdservice.PDService`,
:class:`~gearshift.api.gpuprofile.GPUProfile`: a spec the operator would refuse fails here, where it is
written) and returns the manifest: ``apiVersion`` and ``kind`` from the model, ``metadata`` from the
arguments, and the spec as written. Not the model's dump: it would add nothing (``exclude_unset``)
but writes the whole numbers of float fields as ``2000.0``, and the API server must receive what the test
or benchmark wrote.

A test that means to send an invalid object writes it as a raw mapping: these builders refuse it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gearshift.api.gearset import GearSet
from gearshift.api.gpuprofile import GPUProfile
from gearshift.api.pdservice import PDService


def metadata(name: str, namespace: str | None = None, **extra: Any) -> dict[str, Any]:
    """``{"name": name}``, with ``namespace`` when given and any ``extra`` keys (``labels``, …) after it."""
    meta: dict[str, Any] = {"name": name}
    if namespace is not None:
        meta["namespace"] = namespace
    meta.update(extra)
    return meta


def _manifest(
    model: type[GearSet | PDService | GPUProfile], meta: dict[str, Any], spec: Mapping[str, Any]
) -> dict[str, Any]:
    written = dict(spec)
    obj = model.model_validate({"metadata": meta, "spec": written})
    return {"apiVersion": obj.api_version, "kind": obj.kind, "metadata": meta, "spec": written}


def gearset(name: str, namespace: str | None, spec: Mapping[str, Any], **meta: Any) -> dict[str, Any]:
    """A GearSet manifest named ``name`` (in ``namespace`` when given) with ``spec``.

    Raises:
        pydantic.ValidationError: :class:`~gearshift.api.gearset.GearSet` refuses the object.
    """
    return _manifest(GearSet, metadata(name, namespace, **meta), spec)


def pdservice(name: str, namespace: str | None, spec: Mapping[str, Any], **meta: Any) -> dict[str, Any]:
    """A PDService manifest named ``name`` (in ``namespace`` when given) with ``spec``.

    Raises:
        pydantic.ValidationError: :class:`~gearshift.api.pdservice.PDService` refuses the object.
    """
    return _manifest(PDService, metadata(name, namespace, **meta), spec)


def gpuprofile(name: str, spec: Mapping[str, Any], **meta: Any) -> dict[str, Any]:
    """A GPUProfile manifest (cluster-scoped) named ``name`` with ``spec``.

    Raises:
        pydantic.ValidationError: :class:`~gearshift.api.gpuprofile.GPUProfile` refuses the object.
    """
    return _manifest(GPUProfile, metadata(name, **meta), spec)
