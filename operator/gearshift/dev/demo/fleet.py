"""The sandbox fleet as the demo reads it: its GPU nodes and their GPUProfiles (waited for until each is
Ready, then shown as tables, plots' rows and node → GPU model)."""

from __future__ import annotations

from gearshift.dev.demo import plots
from gearshift.dev.demo.context import Ctx
from gearshift.dev.demo.kube import DemoError, wait_until

PROFILE_TIMEOUT_S = 300.0


def _gpu_nodes(ctx: Ctx) -> list[str]:
    fleet_nodes = set(ctx.state.get("nodes") or [])
    out = []
    for n in ctx.kube.json("get", "nodes")["items"]:
        gpus = int((n.get("status", {}).get("capacity") or {}).get("nvidia.com/gpu", "0") or 0)
        if gpus > 0 and (not fleet_nodes or n["metadata"]["name"] in fleet_nodes):
            out.append(n["metadata"]["name"])
    return sorted(out)


def wait_profiles(ctx: Ctx) -> str:
    nodes = _gpu_nodes(ctx)
    ctx.say(f"profiles: waiting for a Ready GPUProfile of each of {len(nodes)} GPU nodes")
    shown: dict[str, int] = {"n": -1}

    def ready() -> bool:
        items = ctx.kube.json("get", "gpuprofiles")["items"]
        done = {
            (p.get("spec") or {}).get("nodeName") or p["metadata"]["name"]
            for p in items
            if (p.get("status") or {}).get("phase") == "Ready"
        }
        n = len(set(nodes) & done)
        if n != shown["n"]:
            shown["n"] = n
            ctx.say(f"  profiles: {n}/{len(nodes)} Ready")
        return n == len(nodes)

    wait_until(ready, PROFILE_TIMEOUT_S, "every GPU node's GPUProfile to be Ready", interval_s=2.0)
    table = ctx.kube.run("get", "gpup").stdout
    ctx.say.block("$ kubectl get gpup\n" + table)
    return table


def fleet_rows(ctx: Ctx) -> list[plots.NodeRow]:
    rows = []
    for p in ctx.kube.json("get", "gpuprofiles")["items"]:
        st = p.get("status") or {}
        name = (p.get("spec") or {}).get("nodeName") or p["metadata"]["name"]
        if name not in set(ctx.state.get("nodes") or [name]):
            continue
        rows.append(
            plots.NodeRow(
                name=name,
                gpu_model=str(st.get("gpuModel") or "?"),
                gpus=int(st.get("gpuCount") or 1),
                memory_gib=st.get("memoryGiB"),
                score=st.get("computeScore"),
            )
        )
    return sorted(rows, key=lambda r: (-(r.score or 0.0), r.name))


def node_models(ctx: Ctx) -> dict[str, str | None]:
    """Node → GPU model from the GPUProfiles (a GearSet stage names one ``gpuModel`` even when its
    replicas sit on different cards); empty when they cannot be read, so the tables fall back to it."""
    try:
        return {r.name: r.gpu_model for r in fleet_rows(ctx)}
    except (DemoError, KeyError, ValueError):
        return {}
