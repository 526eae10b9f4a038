"""The demo's service: the example's documents (checked before the run), applied fresh to the namespace,
their GearSets waited for until planned, and the router's pod IP once the PDService is Ready."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from gearshift.dev.demo.context import Ctx
from gearshift.dev.demo.fleet import node_models
from gearshift.dev.demo.gears import gearset_table
from gearshift.dev.demo.kube import wait_until
from gearshift.k8s import names

PLAN_TIMEOUT_S = 120.0


def load_example(path: Path, model_config: Path | None) -> list[dict[str, Any]]:
    """The example's documents; with ``model_config`` (an HF config.json) the PDService serves that model."""
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    if model_config is not None:
        from gearshift.api.modelspec import ModelSpec

        cfg = json.loads(model_config.read_text())
        name = str(cfg.get("_name_or_path") or model_config.stem)
        model = ModelSpec.from_hf_config(name, cfg).to_json()
        for d in docs:
            if d.get("kind") == "PDService":
                d["spec"]["model"] = model
    return docs


#: PDService spec section → the role of the GearSet it names (aggregated ``serving``: role ``both``).
SECTION_ROLES = {"prefill": "prefill", "decode": "decode", "serving": "both"}


def service_gearsets(pds: dict[str, Any]) -> dict[str, str]:
    """Role → GearSet name of a PDService document: ``prefill`` and ``decode`` (disaggregated) or ``both``
    (aggregated, ``spec.serving``), in that order."""
    spec = pds.get("spec") or {}
    return {
        role: str(spec[section]["gearSetRef"]["name"])
        for section, role in SECTION_ROLES.items()
        if isinstance(spec.get(section), dict) and "gearSetRef" in spec[section]
    }


def _remove_previous_run(ctx: Ctx, docs: list[dict[str, Any]]) -> None:
    """Delete the example's objects left by an earlier demo in the namespace and wait for their pods.

    A rerun on a kept cluster would otherwise replay onto the gears the last run shifted to, with
    its GearSet history and engines' queues, and its report would not be of a fresh service.
    """
    ns = ctx.args.namespace
    if ctx.kube.get("pdservice", ctx.service, "-n", ns) is None:
        return
    ctx.say(
        f"service: removing {ctx.service} of an earlier run in {ns}, so this run starts on its initial gears"
    )
    for d in docs:
        ctx.kube.run(
            "delete", d["kind"].lower(), d["metadata"]["name"], "-n", ns, "--ignore-not-found", "--wait=true",
            timeout=PLAN_TIMEOUT_S,
        )  # fmt: skip
    sel = f"{names.LABEL_SERVICE}={ctx.service}"
    wait_until(
        lambda: not ctx.kube.json("get", "pods", "-n", ns, "-l", sel)["items"],
        PLAN_TIMEOUT_S,
        f"the earlier run's pods of {ctx.service} to be gone",
        2.0,
    )


def apply_service(ctx: Ctx) -> dict[str, dict[str, Any]]:
    assert ctx.inputs is not None  # main sets it from _preflight
    docs = ctx.inputs.docs
    pds = next(d for d in docs if d.get("kind") == "PDService")
    ctx.service = pds["metadata"]["name"]
    slo = pds["spec"].get("slo") or {}
    ctx.slo = {k: float(v) for k, v in slo.items() if isinstance(v, int | float)}
    ns = ctx.args.namespace
    ctx.kube.ensure_namespace(ns)
    _remove_previous_run(ctx, docs)
    ctx.say(
        f"service: applying {ctx.args.example.name} to namespace {ns} "
        f"(model {pds['spec']['model'].get('name')})"
    )
    ctx.say.block(ctx.kube.apply_docs(docs, namespace=ns))
    refs = service_gearsets(pds)

    def planned() -> dict[str, dict[str, Any]] | None:
        out = {}
        for role, gs in refs.items():
            obj = ctx.kube.get("gearset", gs, "-n", ns)
            st = (obj or {}).get("status") or {}
            gears = (obj or {}).get("spec", {}).get("gears") or st.get("plannedGears")
            if not obj or not gears or not st.get("activeGear"):
                return None
            out[role] = obj
        return out

    gearsets = wait_until(
        planned, PLAN_TIMEOUT_S, "the GearSets to hold planned gears and an active gear", 2.0
    )
    models = node_models(ctx)
    for role, gs in gearsets.items():
        ctx.say.block(gearset_table(role, gs, models))
    return gearsets


def router_url(ctx: Ctx) -> str:
    """Wait for the PDService to be Ready and return ``http://<router pod IP>:<port>`` (never a ClusterIP)."""
    from gearshift.k8s.services import ROUTER_PORT

    ns = ctx.args.namespace
    last: dict[str, str] = {"msg": ""}

    def ready() -> str | None:
        pds = ctx.kube.get("pdservice", ctx.service, "-n", ns) or {}
        st = pds.get("status") or {}
        cond = {c.get("type"): c for c in st.get("conditions") or []}
        why = (cond.get("Ready") or {}).get("message", "")
        msg = f"phase {st['phase']}: {why}" if st.get("phase") else "not reconciled by the operator yet"
        if msg != last["msg"]:
            last["msg"] = msg
            ctx.say(f"  service: {msg}")
        if st.get("phase") != "Ready":
            return None
        sel = f"{names.LABEL_COMPONENT}={names.COMPONENT_ROUTER},{names.LABEL_SERVICE}={ctx.service}"
        for pod in ctx.kube.json("get", "pods", "-n", ns, "-l", sel)["items"]:
            conds = {c["type"]: c["status"] for c in pod.get("status", {}).get("conditions") or []}
            ip = pod.get("status", {}).get("podIP")
            if ip and conds.get("Ready") == "True":
                return f"http://{ip}:{ROUTER_PORT}"
        return None

    ctx.say(f"service: waiting for {ctx.service} to be Ready (pods, router)")
    url = wait_until(ready, ctx.args.ready_timeout, f"PDService {ns}/{ctx.service} to be Ready", 2.0)
    ctx.say(f"service: Ready; the router's pod IP is {url} (loopback in the sandbox)")
    return str(url)
