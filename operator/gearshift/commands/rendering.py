"""``gearshift render``'s library: the objects the operator would create for PDServices and GearSets read
from files, on a fleet file instead of a cluster (as ``helm template`` renders a chart without one).

The same pure code as the reconciler (:mod:`gearshift.control.reconcile`) does the work, in the same
order: :func:`~gearshift.control.reconcile.spec.role_state` checks each GearSet against its role,
:func:`~gearshift.control.reconcile.spec.explicit_layer_problems` and
:func:`~gearshift.control.reconcile.spec.explicit_engine_problems` the explicit gears against the model
and the engine (vLLM's decode: one stage), :func:`~gearshift.control.reconcile.desired.desired_state`
plans the ``auto`` roles on their share of the fleet, picks the active gears and checks placement,
:func:`~gearshift.k8s.desired.desired_objects` builds the manifests and
:func:`~gearshift.control.reconcile.desired.gearset_status_patch` the GearSet status the operator writes.
The fleet file stands in for the cluster (:func:`fleet_cluster`): its nodes as GFD labels them
(:mod:`gearshift.k8s.fleetnodes`), Ready and labelled as profiling labels them, and a datasheet
GPUProfile per node (:func:`gearshift.planner.inputs.datasheet_gpuprofile`). A cluster's probes measure
their own figures, so an ``auto`` role planned there may differ from what is rendered here.

Errors (:class:`RenderError`) name the file, the object and the field; nothing is rendered then.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from gearshift import GROUP, VERSION
from gearshift.api.common import format_validation_error
from gearshift.api.gpuprofile import GPUProfileStatus
from gearshift.api.pdservice import ROLE_SECTIONS, PDService
from gearshift.control.reconcile.desired import desired_state, gearset_status_patch
from gearshift.control.reconcile.placement import placement_problems
from gearshift.control.reconcile.settings import Settings
from gearshift.control.reconcile.spec import explicit_engine_problems, explicit_layer_problems, role_state
from gearshift.control.reconcile.state import RoleState, SpecInvalid
from gearshift.facts.fleet import Fleet
from gearshift.k8s import names
from gearshift.k8s.desired import desired_objects, owner_reference
from gearshift.k8s.engine import EngineSpecError
from gearshift.k8s.fleetnodes import fleet_nodes
from gearshift.planner.inputs import datasheet_gpuprofile
from gearshift.profiling.profiles import card_score, classify, node_labels

API_VERSION = f"{GROUP}/{VERSION}"
KINDS = ("PDService", "GearSet")
#: Owner reference uid of a PDService read from a file without ``metadata.uid`` (the API server assigns
#: the real one): the objects render prints are for review. Applied as they are, the garbage collector
#: would delete them at once, as it deletes objects whose owner does not exist.
PLACEHOLDER_UID = "00000000-0000-0000-0000-000000000000"
#: File name endings a directory given to ``-f`` is read for.
SUFFIXES = (".yaml", ".yml", ".json")


class RenderError(Exception):
    """Input that cannot be rendered; the message names the file, the object and the field."""


@dataclass(frozen=True)
class Document:
    """One object read from a file."""

    source: str
    """``FILE`` or ``FILE#N`` (N = the document's index in a multi-document file, from 0)."""
    body: dict[str, Any]

    @property
    def kind(self) -> str:
        return str(self.body.get("kind", ""))

    @property
    def name(self) -> str:
        return str((self.body.get("metadata") or {}).get("name", ""))

    def namespace(self, default: str) -> str:
        return str((self.body.get("metadata") or {}).get("namespace") or default)


@dataclass
class Rendered:
    """What :func:`render_service` made for one PDService."""

    service: str
    namespace: str
    gearsets: list[dict[str, Any]] = field(default_factory=list)
    """The service's GearSets as read, with the status the operator writes on reconciling them."""
    objects: list[dict[str, Any]] = field(default_factory=list)
    """The objects the operator creates, in its apply order."""
    active: dict[str, str] = field(default_factory=dict)
    """Active gear per role."""


# --- reading ----------------------------------------------------------------------------------------


def _files(paths: Iterable[str | Path]) -> list[Path]:
    out: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if p.is_dir():
            found = sorted(f for f in p.iterdir() if f.is_file() and f.suffix.lower() in SUFFIXES)
            if not found:
                raise RenderError(f"{p}: no {', '.join(SUFFIXES)} file in this directory")
            out += found
        elif p.exists():
            out.append(p)
        else:
            raise RenderError(f"{p}: no such file or directory")
    return out


def load_documents(paths: Iterable[str | Path]) -> list[Document]:
    """The objects of every file in ``paths`` (a directory: its ``*.yaml``, ``*.yml``, ``*.json``, sorted,
    not recursive). Empty documents are skipped; a ``kind: List`` contributes its ``items``.

    Raises:
        RenderError: a path that does not exist, or a file that is not YAML/JSON of mappings.
    """
    docs: list[Document] = []
    for path in _files(paths):
        try:
            loaded = list(yaml.safe_load_all(path.read_text()))
        except (OSError, UnicodeDecodeError) as exc:
            raise RenderError(f"{path}: cannot read: {exc}") from None
        except yaml.YAMLError as exc:
            raise RenderError(f"{path}: not valid YAML or JSON: {exc}") from None
        many = len(loaded) > 1
        for i, body in enumerate(loaded):
            where = f"{path}#{i}" if many else str(path)
            if body is None:
                continue
            if not isinstance(body, dict):
                raise RenderError(f"{where}: a document must be a Kubernetes object (a mapping)")
            if body.get("kind") == "List" and isinstance(body.get("items"), list):
                for j, item in enumerate(body["items"]):
                    if not isinstance(item, dict):
                        raise RenderError(f"{where}: items[{j}] must be a Kubernetes object (a mapping)")
                    docs.append(Document(f"{where} items[{j}]", item))
            else:
                docs.append(Document(where, body))
    return docs


def _check_kind(doc: Document) -> None:
    what = f"{doc.kind or '(no kind)'} {doc.name!r}" if doc.name else doc.kind or "(no kind)"
    if doc.kind not in KINDS or doc.body.get("apiVersion") != API_VERSION:
        raise RenderError(
            f"{doc.source}: {what} (apiVersion {doc.body.get('apiVersion')!r}) is not a PDService or "
            f"GearSet of {API_VERSION}; render reads only those (pass the files that hold them)"
        )
    if not doc.name:
        raise RenderError(f"{doc.source}: {doc.kind}: metadata.name is required")


# --- the fleet as a cluster ---------------------------------------------------------------------------


def fleet_cluster(fleet: Fleet, now: datetime) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """``(nodes, profiles)`` by name: the fleet's GPU nodes as the reconciler would read them. Pure.

    Nodes as GFD and the device plugin label them (:mod:`gearshift.k8s.fleetnodes`), Ready,
    with the labels profiling writes (``gearshift.io/gpu-model``, ``compute-class``, ``memory-gib``,
    ``profiled``; classes clustered over the fleet as the GPUProfile handler does); one Ready datasheet
    GPUProfile per node, probed at ``now``.
    """
    nodes: dict[str, dict[str, Any]] = {}
    profiles: dict[str, dict[str, Any]] = {}
    for node in fleet_nodes(fleet):
        node["status"]["conditions"] = [{"type": "Ready", "status": "True"}]
        name = node["metadata"]["name"]
        nodes[name] = node
        profiles[name] = datasheet_gpuprofile(node)
    scores = {}
    for name, prof in profiles.items():
        score = card_score(GPUProfileStatus.model_validate(prof["status"]))
        if score is not None:
            scores[name] = score
    classes = classify(scores)
    for name, prof in profiles.items():
        status = prof["status"]
        status["probeTime"] = now.isoformat()
        if name in classes:
            status["computeClass"] = classes[name]
        labels = node_labels(GPUProfileStatus.model_validate(status))
        nodes[name]["metadata"]["labels"].update({k: v for k, v in labels.items() if v is not None})
    return nodes, profiles


# --- rendering ----------------------------------------------------------------------------------------


def _pds_body(doc: Document, namespace: str) -> dict[str, Any]:
    body = copy.deepcopy(doc.body)
    meta = body.setdefault("metadata", {})
    meta["namespace"] = namespace
    meta.setdefault("uid", PLACEHOLDER_UID)
    return body


def _role_of(message: str) -> str | None:
    return next((r for r in ROLE_SECTIONS if message.startswith(r)), None)


def _problems(pds_doc: Document, docs: Mapping[str, Document], messages: Sequence[str], what: str) -> str:
    """One line per problem, each prefixed by the file of the GearSet it is about (else the PDService's)."""
    lines = []
    for m in messages:
        role = _role_of(m)
        src = docs[role].source if role is not None and role in docs else pds_doc.source
        lines.append(f"  {src}: {m}")
    return f"{pds_doc.source}: PDService {pds_doc.name!r}: {what}:\n" + "\n".join(lines)


def render_service(
    pds_doc: Document,
    gearsets: Mapping[tuple[str, str], Document],
    nodes: dict[str, dict[str, Any]],
    profiles: dict[str, dict[str, Any]],
    *,
    namespace: str = "default",
    settings: Settings | None = None,
    now: datetime,
    all_gears: bool = False,
) -> Rendered:
    """Render one PDService with the GearSets it names (``gearsets`` by ``(namespace, name)``). Pure.

    Without ``all_gears``: what the operator applies (the active gear of each role, or both ends of a
    shift the GearSets' status says is in flight); with it, every gear's headless Service and
    StatefulSets too (what the operator creates as shifts reach them), the role Services still selecting
    the active gears.

    Raises:
        RenderError: the PDService or a GearSet does not validate, a GearSet is missing or serves another
            service or role, an explicit gear does not cover the model's layers or has more stages than the
            engine runs for its role, an ``auto`` role finds no
            gear on the fleet, a gear cannot be placed on the fleet's nodes, or the engine cannot run a
            gear (the cases the operator refuses or reports as not placed).
    """
    settings = settings or Settings()
    ns = pds_doc.namespace(namespace)
    body = _pds_body(pds_doc, ns)
    name = str(body["metadata"]["name"])
    where = f"{pds_doc.source}: PDService {name!r}"
    try:
        pds = PDService.model_validate(body)
    except ValidationError as exc:
        raise RenderError(f"{where} is invalid:\n{format_validation_error(exc)}") from None

    used: dict[str, Document] = {}
    roles: dict[str, RoleState] = {}
    for role in pds.spec.roles:
        ref = pds.spec.role_spec(role).gear_set_ref.name
        gs_doc = gearsets.get((ns, ref))
        if gs_doc is None:
            raise RenderError(
                f"{where}: spec.{ROLE_SECTIONS[role]}.gearSetRef.name names GearSet {ref!r}, which no "
                f"file given holds in namespace {ns}; add its file with -f"
            )
        gs_body = copy.deepcopy(gs_doc.body)
        gs_body.setdefault("metadata", {})["namespace"] = ns
        try:
            roles[role] = role_state(pds, name, role, gs_body)
            explicit_layer_problems(pds, {role: roles[role]})
            explicit_engine_problems(pds, {role: roles[role]}, profiles)
        except SpecInvalid as exc:
            raise RenderError(f"{gs_doc.source}: PDService {name!r}: {exc}") from None
        used[role] = gs_doc

    want = desired_state(pds, roles, nodes, profiles, settings, now)
    trouble = want.missing + want.problems
    if trouble:
        raise RenderError(_problems(pds_doc, used, trouble, "the operator could not place it on this fleet"))

    desires = want.desires
    if all_gears:
        extra: list[str] = []
        full = []
        for d in desires:
            rs = roles[d.role]
            running = {g.name for g in d.gears}
            for g in rs.gears:
                if g.name not in running:
                    extra += placement_problems(d.role, g, nodes)[0]
            full.append(dataclasses.replace(d, gears=list(rs.gears)))
        if extra:
            raise RenderError(_problems(pds_doc, used, extra, "a gear that is not active cannot be placed"))
        desires = full
    try:
        objects = desired_objects(
            name, ns, pds.spec, desires, settings.images, owner_reference(body), settings.prometheus_url
        )
    except EngineSpecError as exc:
        gear_role = next((d.role for d in desires for g in d.gears if f"gear {g.name!r}" in str(exc)), None)
        src = used[gear_role].source if gear_role else pds_doc.source
        raise RenderError(
            f"{src}: {gear_role or 'a'} gear of PDService {name!r} (engine {pds.spec.engine}): {exc}"
        ) from None

    out = Rendered(name, ns, objects=objects, active={r: str(rs.active) for r, rs in roles.items()})
    for rs in roles.values():
        gs = copy.deepcopy(rs.gs_body)
        status = dict(gs.get("status") or {})
        for k, v in gearset_status_patch(rs, now).items():
            if v is None:
                status.pop(k, None)
            else:
                status[k] = v
        # Transition times and the generation would differ on every run; the rest is the plan.
        status.pop("conditions", None)
        status.pop("observedGeneration", None)
        gs["status"] = status
        out.gearsets.append(gs)
    return out


def render(
    docs: Sequence[Document],
    fleet: Fleet,
    *,
    now: datetime,
    namespace: str = "default",
    settings: Settings | None = None,
    all_gears: bool = False,
) -> tuple[list[Rendered], list[str]]:
    """Render every PDService among ``docs`` on ``fleet``; returns the renderings and warnings (GearSets no
    PDService names). Pure.

    Raises:
        RenderError: an object that is not a PDService or GearSet, two objects of one kind and name, no
            PDService at all, or any of :func:`render_service`'s errors.
    """
    seen: dict[tuple[str, str, str], Document] = {}
    services: list[Document] = []
    gearsets: dict[tuple[str, str], Document] = {}
    for doc in docs:
        _check_kind(doc)
        key = (doc.kind, doc.namespace(namespace), doc.name)
        if key in seen:
            raise RenderError(
                f"{doc.source}: {doc.kind} {doc.name!r} is also in {seen[key].source}; give each object once"
            )
        seen[key] = doc
        if doc.kind == "PDService":
            services.append(doc)
        else:
            gearsets[(doc.namespace(namespace), doc.name)] = doc
    if not services:
        raise RenderError("no PDService in the files given: render needs a PDService and its two GearSets")
    nodes, profiles = fleet_cluster(fleet, now)
    out = [
        render_service(
            d, gearsets, nodes, profiles, namespace=namespace, settings=settings, now=now, all_gears=all_gears
        )
        for d in services
    ]
    named = {(r.namespace, str(gs["metadata"]["name"])) for r in out for gs in r.gearsets}
    warnings = [
        f"{d.source}: GearSet {d.name!r} is named by no PDService in the files given; not rendered"
        for key, d in gearsets.items()
        if key not in named
    ]
    return out, warnings


# --- output ---------------------------------------------------------------------------------------------


def describe(obj: Mapping[str, Any]) -> str:
    """A one-line comment on what an object is for (the YAML output puts it above the object)."""
    kind = obj.get("kind", "")
    meta = obj.get("metadata") or {}
    labels = meta.get("labels") or {}
    role, gear = labels.get(names.LABEL_ROLE), labels.get(names.LABEL_GEAR)
    if kind == "GearSet":
        st = obj.get("status") or {}
        planned = st.get("plannedGears")
        gears = planned if planned is not None else (obj.get("spec") or {}).get("gears") or []
        mode = (obj.get("spec") or {}).get("mode", "explicit")
        return (
            f"GearSet {meta.get('name')} ({mode}; {len(gears)} gear(s): "
            f"{', '.join(str(g.get('name')) for g in gears)}; active {st.get('activeGear')}), with the "
            "status the operator writes"
        )
    if kind == "StatefulSet":
        spec = obj["spec"]
        env = {e["name"]: e.get("value") for e in spec["template"]["spec"]["containers"][0].get("env", [])}
        layers = (env.get("GEARSHIFT_LAYERS") or "?,?").split(",")
        na = spec["template"]["spec"]["affinity"].get("nodeAffinity") or {}
        required = na.get("requiredDuringSchedulingIgnoredDuringExecution") or {}
        terms = required.get("nodeSelectorTerms") or []
        where = "; ".join(
            f"{e['key']} in {','.join(e['values'])}" for t in terms for e in t.get("matchExpressions", [])
        )
        return (
            f"{role} gear {gear}, stage {labels.get(names.LABEL_STAGE)}: layers [{layers[0]}, {layers[-1]}), "
            f"{spec['replicas']} pod(s), {where or 'any GPU node'}"
        )
    if kind == "Service" and gear:
        return f"headless Service of {role} gear {gear} (stable DNS names of its pods)"
    if kind == "Service" and role:
        sel = (obj.get("spec") or {}).get("selector") or {}
        return f"{role} Service: selects the stage-0 pods of the active gear, {sel.get(names.LABEL_GEAR)}"
    return f"{kind} {meta.get('name')}"


def documents(rendered: Sequence[Rendered], gearsets: bool = True) -> list[dict[str, Any]]:
    """The objects to print, per service: its GearSets (when ``gearsets``), then what the operator creates."""
    out: list[dict[str, Any]] = []
    for r in rendered:
        out += (r.gearsets if gearsets else []) + r.objects
    return out


class _Dumper(yaml.SafeDumper):
    """Block style, except lists of numbers (``layers: [0, 24]``, ``qpsRange: [0, 8]``) on one line."""


def _list(dumper: yaml.SafeDumper, data: list[Any]) -> yaml.Node:
    flow = bool(data) and all(isinstance(x, int | float) and not isinstance(x, bool) for x in data)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)


_Dumper.add_representer(list, _list)


def to_yaml(objs: Sequence[Mapping[str, Any]]) -> str:
    """Multi-document YAML, each object under a comment saying what it is."""
    parts = []
    for obj in objs:
        text = yaml.dump(dict(obj), Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=120)
        parts.append(f"---\n# {describe(obj)}\n{text}")
    return "".join(parts)


def to_json(objs: Sequence[Mapping[str, Any]]) -> str:
    """A ``v1`` ``List`` of the objects, as ``kubectl get -o json`` prints several."""
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": list(objs)}, indent=2) + "\n"
