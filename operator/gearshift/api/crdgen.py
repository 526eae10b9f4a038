"""CustomResourceDefinitions generated from the pydantic models: the one source of the CRD YAML.

pydantic's JSON schema (2020-12) is turned into the *structural* OpenAPI v3 subset the API server
accepts (https://kubernetes.io/docs/tasks/extend-kubernetes/custom-resources/custom-resource-definitions/
#specifying-a-structural-schema):

  - ``$ref`` to ``$defs`` are inlined (no recursion exists in the models);
  - ``anyOf: [X, {type: null}]`` of an optional field becomes ``X`` (the field is simply not required;
    the API server prunes ``null`` of non-nullable fields, as pydantic reads ``None``);
  - ``anyOf: [integer, string]`` becomes ``x-kubernetes-int-or-string``;
  - ``additionalProperties: true`` (pydantic ``extra="allow"``) becomes
    ``x-kubernetes-preserve-unknown-fields``, ``additionalProperties: false`` is dropped (strict field
    validation in ``kubectl apply`` refuses unknown fields);
  - numeric ``exclusiveMinimum``/``exclusiveMaximum`` become OpenAPI v3.0's boolean form;
  - ``title`` is dropped, ``default`` kept when it is a literal (``default: {}`` for nested models whose
    own fields carry defaults), defaults of ``None`` and empty lists dropped.
Cross-field rules come from the models' ``x-kubernetes-validations`` (``CEL`` tables next to them).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel
from pydantic.json_schema import GenerateJsonSchema, NoDefault
from pydantic_core import core_schema

from gearshift.api import gearset, gpuprofile, pdservice
from gearshift.api.common import GROUP, VERSION

#: Where the generated YAML is committed; the drift test regenerates and compares both.
CRD_DIRS: tuple[str, ...] = ("crds", "charts/gearshift/crds")

#: Keys of the JSON schema the structural subset keeps as they are.
_KEEP = {
    "type",
    "description",
    "enum",
    "format",
    "pattern",
    "minimum",
    "maximum",
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
    "minProperties",
    "maxProperties",
    "uniqueItems",
    "multipleOf",
    "default",
    "required",
    "nullable",
}
_DROP = {"title", "examples", "$defs"}
_SKIP_FORMATS = {"uri", "email", "uuid"}  # pydantic formats the API server would check differently


class CRDGenError(ValueError):
    """A model uses a JSON-schema construct that has no structural OpenAPI equivalent."""


class _DefaultsFromFactories(GenerateJsonSchema):
    """pydantic's generator, but ``default_factory`` defaults appear too: a nested model's full JSON form
    (not ``{}``: the API server checks a default against the CEL rules *before* nested defaults apply),
    the list itself for a non-empty list."""

    def get_default_value(self, schema: core_schema.WithDefaultSchema) -> Any:
        factory = schema.get("default_factory")
        if factory is None or schema.get("default_factory_takes_data"):
            return super().get_default_value(schema)
        value = factory()  # type: ignore[call-arg]
        if isinstance(value, BaseModel):
            return value.model_dump(mode="json", by_alias=True, exclude_none=True)
        if isinstance(value, list | dict) and not value:
            return NoDefault
        return value


def structural(node: dict[str, Any], defs: dict[str, Any], where: str = "") -> dict[str, Any]:
    """Convert one pydantic JSON-schema node (with its ``$defs``) into a structural OpenAPI v3 node.

    Raises:
        CRDGenError: an unsupported construct (a union other than optional or int-or-string, tuples),
            naming the schema path ``where``.
    """
    node = dict(node)
    if "$ref" in node:
        target = defs[node.pop("$ref").rsplit("/", 1)[-1]]
        merged = structural(target, defs, where)
        extra = structural(node, defs, where) if node else {}
        extra.pop("type", None)
        return {**merged, **extra}
    if "allOf" in node:
        parts = node.pop("allOf")
        if len(parts) != 1:
            raise CRDGenError(f"{where}: allOf with {len(parts)} parts is not supported")
        return {**structural(parts[0], defs, where), **structural(node, defs, where)}
    if "anyOf" in node:
        options = node.pop("anyOf")
        non_null = [o for o in options if o.get("type") != "null"]
        if node.get("default", NoDefault) is None:
            node.pop("default")
        types = sorted(o.get("type", "") for o in non_null)
        if types == ["integer", "string"]:
            out: dict[str, Any] = {"x-kubernetes-int-or-string": True}
            out.update(structural(node, defs, where))
            out.pop("type", None)
            return out
        if len(non_null) != 1:
            raise CRDGenError(f"{where}: union of {types} is not structural; use one type")
        inner = structural(non_null[0], defs, where)
        rest = structural(node, defs, where) if node else {}
        rest.pop("type", None)
        return {**inner, **rest}
    if "prefixItems" in node:
        raise CRDGenError(f"{where}: tuples are not structural; use a list with minItems/maxItems")

    out = {}
    for key, value in node.items():
        if key in _DROP:
            continue
        if key == "properties":
            out["properties"] = {
                name: structural(sub, defs, f"{where}.{name}") for name, sub in value.items()
            }
        elif key == "items":
            out["items"] = structural(value, defs, f"{where}[]")
        elif key == "additionalProperties":
            if value is True:
                out["x-kubernetes-preserve-unknown-fields"] = True
            elif isinstance(value, dict):
                out["additionalProperties"] = structural(value, defs, f"{where}{{}}")
        elif key == "exclusiveMinimum":
            out["minimum"], out["exclusiveMinimum"] = value, True
        elif key == "exclusiveMaximum":
            out["maximum"], out["exclusiveMaximum"] = value, True
        elif key == "description":
            out[key] = " ".join(str(value).replace("``", "`").split())  # docstrings are reST, YAML is not
        elif key == "const":
            out["enum"] = [value]
        elif key == "format":
            if value not in _SKIP_FORMATS:
                out["format"] = value
        elif key.startswith("x-kubernetes-") or key in _KEEP:
            out[key] = copy.deepcopy(value)
        else:
            raise CRDGenError(f"{where}: JSON-schema keyword {key!r} has no structural equivalent")
    if out.get("default", NoDefault) is None:
        out.pop("default")
    if "enum" in out and "type" not in out:
        out["type"] = "string"
    if "properties" in out and "type" not in out:
        out["type"] = "object"
    if out.get("type") == "object" and "required" in out and not out["required"]:
        out.pop("required")
    if "required" in out:
        out["required"] = sorted(out["required"])
    return _ordered(out)


#: Key order of the generated YAML, so a schema reads top-down: what it is, then its limits, then children.
_ORDER = (
    "type",
    "description",
    "format",
    "enum",
    "default",
    "nullable",
    "minimum",
    "exclusiveMinimum",
    "maximum",
    "exclusiveMaximum",
    "multipleOf",
    "minLength",
    "maxLength",
    "pattern",
    "minItems",
    "maxItems",
    "uniqueItems",
    "minProperties",
    "maxProperties",
    "required",
    "items",
    "properties",
    "additionalProperties",
)


def _tidy_number(value: Any) -> Any:
    # 1e6 from a Python float literal reads better as 1000000 in YAML; the API server takes both.
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    return value


def _ordered(node: dict[str, Any]) -> dict[str, Any]:
    rank = {k: i for i, k in enumerate(_ORDER)}
    out = {k: node[k] for k in sorted(node, key=lambda k: (rank.get(k, len(rank)), k))}
    for key in ("minimum", "maximum"):
        if key in out:
            out[key] = _tidy_number(out[key])
    return out


def openapi_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The structural OpenAPI v3 schema of ``model`` as its camelCase JSON form (validation mode)."""
    raw = model.model_json_schema(by_alias=True, schema_generator=_DefaultsFromFactories)
    return structural(raw, raw.get("$defs", {}), model.__name__)


@dataclass(frozen=True)
class Kind:
    """One custom resource kind: names, models, printer columns, subresources."""

    kind: str
    plural: str
    short_name: str
    scope: str
    description: str
    spec_model: type[BaseModel]
    status_model: type[BaseModel]
    columns: list[dict[str, Any]]
    root_rules: list[dict[str, str]] = field(default_factory=list)
    scale: dict[str, str] | None = None

    @property
    def name(self) -> str:
        """The CRD's name, ``<plural>.<group>``."""
        return f"{self.plural}.{GROUP}"

    @property
    def filename(self) -> str:
        """File name of the generated YAML (controller-gen's convention)."""
        return f"{GROUP}_{self.plural}.yaml"


def _col(name: str, path: str, type_: str = "string", description: str = "", priority: int = 0) -> dict:
    col: dict[str, Any] = {"name": name, "type": type_, "jsonPath": path}
    if description:
        col["description"] = description
    if priority:
        col["priority"] = priority
    return col


_AGE = _col("AGE", ".metadata.creationTimestamp", "date")

KINDS: tuple[Kind, ...] = (
    Kind(
        kind="GPUProfile",
        plural="gpuprofiles",
        short_name="gpup",
        scope="Cluster",
        description="Measured capability of one GPU node (named after the node).",
        spec_model=gpuprofile.GPUProfileSpec,
        status_model=gpuprofile.GPUProfileStatus,
        columns=[
            _col("NODE", ".spec.nodeName", description="Profiled node."),
            _col("GPU", ".status.gpuModel", description="GPU model."),
            _col("COUNT", ".status.gpuCount", "integer", "GPUs on the node."),
            _col("MEM(GiB)", ".status.memoryGiB", "number", "Memory per GPU, GiB."),
            _col("SCORE", ".status.computeScore", "number", "Compute relative to one H100 SXM."),
            _col("PHASE", ".status.phase", description="Pending, Probing, Ready, Failed, Stale."),
            _col(
                "WINDOW",
                ".status.availableUntil",
                # A string, not a date: kubectl prints a date column as an age, and "<invalid>" for any
                # time in the future, which a window's end always is while it matters.
                "string",
                "When the node is reclaimed (time-limited node, RFC 3339 UTC), if declared.",
            ),
            _AGE,
        ],
        root_rules=gpuprofile.CEL["GPUProfile"],
    ),
    Kind(
        kind="GearSet",
        plural="gearsets",
        short_name="gs",
        scope="Namespaced",
        description="The gears of one role of a PDService, the shifting policy, and the gear status.",
        spec_model=gearset.GearSetSpec,
        status_model=gearset.GearSetStatus,
        columns=[
            _col("SERVICE", ".spec.serviceName", description="PDService."),
            _col("ROLE", ".spec.role", description="prefill, decode or both (aggregated)."),
            _col("ACTIVE", ".status.activeGear", description="Gear serving traffic."),
            _col("TARGET", ".status.targetGear", description="Gear being shifted to."),
            _col("PHASE", ".status.phase", description="Executor phase."),
            _col(
                "REPLICAS",
                ".spec.replicas",
                "integer",
                "Pipeline replicas asked for (spec.replicas; autoscaler, HPA): copies of the gear's layout.",
            ),
            # A string "ready/wanted": a printer column shows one JSONPath, so the pair is kept in status.
            _col(
                "READY",
                ".status.ready",
                "string",
                "Serving copies of the model Ready/wanted in the active gear (as the PDService counts them).",
            ),
            _col(
                "P99(ms)",
                ".status.signals.p99Ms",
                "number",
                "Smoothed P99 (TTFT prefill and both, ITL decode); empty when the last sample saw no "
                "completion.",
            ),
            _col("QPS", ".status.signals.qps", "number", "Requests/s over the last minute."),
            _AGE,
        ],
        scale={
            "specReplicasPath": ".spec.replicas",
            "statusReplicasPath": ".status.replicas",
            "labelSelectorPath": ".status.selector",
        },
    ),
    Kind(
        kind="PDService",
        plural="pdservices",
        short_name="pds",
        scope="Namespaced",
        description="An LLM served behind a router, with disaggregated prefill and decode roles or one "
        "aggregated serving role.",
        spec_model=pdservice.PDServiceSpec,
        status_model=pdservice.PDServiceStatus,
        columns=[
            _col("MODEL", ".spec.model.name", description="Served model."),
            _col("PREFILL", ".status.prefill.activeGear", description="Active prefill gear."),
            _col("DECODE", ".status.decode.activeGear", description="Active decode gear."),
            _col("SERVING", ".status.serving.activeGear", description="Active gear of aggregated serving."),
            _col("ROUTER", ".spec.router.policy", description="Router policy."),
            _col("READY", '.status.conditions[?(@.type=="Ready")].status', description="Ready condition."),
            _AGE,
        ],
        root_rules=pdservice.CEL["PDService"],
    ),
)


def crd(kind: Kind) -> dict[str, Any]:
    """The CustomResourceDefinition of ``kind`` as a plain dict."""
    root: dict[str, Any] = {
        "type": "object",
        "description": kind.description,
        "properties": {
            "apiVersion": {"type": "string", "description": "API version: gearshift.io/v1alpha1."},
            "kind": {"type": "string", "description": f"Kind: {kind.kind}."},
            "metadata": {"type": "object"},
            "spec": openapi_schema(kind.spec_model),
            "status": openapi_schema(kind.status_model),
        },
        "required": ["spec"],
    }
    if kind.root_rules:
        root["x-kubernetes-validations"] = copy.deepcopy(kind.root_rules)
    subresources: dict[str, Any] = {"status": {}}
    if kind.scale:
        subresources["scale"] = dict(kind.scale)
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": kind.name},
        "spec": {
            "group": GROUP,
            "names": {
                "kind": kind.kind,
                "listKind": f"{kind.kind}List",
                "plural": kind.plural,
                "singular": kind.kind.lower(),
                "shortNames": [kind.short_name],
                "categories": ["gearshift"],
            },
            "scope": kind.scope,
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": root},
                    "subresources": subresources,
                    "additionalPrinterColumns": kind.columns,
                }
            ],
        },
    }


_HEADER = "# Generated by `gearshift crds` from operator/gearshift/api/; do not edit.\n"


def render(kind: Kind) -> str:
    """The CRD of ``kind`` as YAML text, with a header saying where it comes from."""
    return _HEADER + yaml.safe_dump(crd(kind), sort_keys=False, width=110, allow_unicode=True)


def rendered() -> dict[str, str]:
    """File name -> YAML text of every CRD."""
    return {k.filename: render(k) for k in KINDS}


def write(out_dir: str | Path) -> list[Path]:
    """Write every CRD into ``out_dir`` (created if needed); returns the paths written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, text in rendered().items():
        path = out / name
        path.write_text(text)
        paths.append(path)
    return paths
