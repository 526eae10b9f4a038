"""On the sandbox: objects near the API's limits do not make the operator loop.

The operator runs as a process watching this module's namespace (``harness.OperatorProcess``) on two
private GPU nodes (``harness.GpuNodes``), engine ``sim``.

1. A PDService carrying a 150 KiB user annotation: kopf's diff base used to copy it into its
   last-handled-configuration annotation, the two passed the API server's 256 KiB limit for all of an
   object's annotations, and every patch failed "Too long" forever. Now the diff base holds no
   annotations: the service reconciles (its StatefulSets appear, its status is written) and a spec edit
   after it is handled too.
2. A GearSet whose stages name many Nodes that do not exist: the message listing them exceeded the
   condition's 32768-character maxLength and every reconcile failed pydantic's ``string_too_long``. Now
   the message is cut to the limit and says how much was left out, and the condition is written.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gearshift.api.common import MAX_MESSAGE
from gearshift.dev.sandbox.harness import (
    LLAMA_3_2_1B,
    GpuNodes,
    OperatorProcess,
    get_json,
    install_crds,
    teardown_run,
    wait_until,
)
from gearshift.testing import manifests as build

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL = LLAMA_3_2_1B
ANNOTATION = "example.com/notes"
ANNOTATION_BYTES = 150 * 1024
DIFFBASE = "gearshift.io/last-handled-configuration"


class World:
    def __init__(self, sandbox: Any, tmp: Path) -> None:
        install_crds(sandbox)
        self.sandbox = sandbox
        self.ns = f"e2e-limits-{uuid.uuid4().hex[:6]}"
        sandbox.kubectl("create", "namespace", self.ns)
        self.gpus = GpuNodes(sandbox, "e2e-lim", cidr_base=140)
        self.op: OperatorProcess | None = OperatorProcess(sandbox, self.ns, tmp / "operator.log")

    def apply(self, obj: dict[str, Any]) -> None:
        obj["metadata"]["namespace"] = self.ns
        # server-side apply: a client-side apply would store the object (and its 150 KiB annotation)
        # again in kubectl's own last-applied annotation and be refused before the operator sees it.
        self.sandbox.kubectl("apply", "--server-side", "-f", "-", input=json.dumps(obj))

    def get(self, kind: str, name: str) -> dict[str, Any]:
        return dict(get_json(self.sandbox, kind, name, "-n", self.ns))


@pytest.fixture(scope="module")
def world(sandbox: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    w = World(sandbox, tmp_path_factory.mktemp("limits"))
    try:
        yield w
    finally:
        left = teardown_run(sandbox, w.ns, w.op, w.gpus, wait_s=60)
        assert left == [], f"teardown left {left}"


def _gearset(name: str, service: str, role: str, stages: list[dict[str, Any]]) -> dict[str, Any]:
    return build.gearset(name, None, {
        "serviceName": service,
        "role": role,
        "mode": "explicit",
        "gears": [{"name": "g", "microBatch": 4, "maxBatch": 32, "stages": stages}],
    })  # fmt: skip


def _service(name: str, annotations: dict[str, str] | None = None) -> dict[str, Any]:
    return build.pdservice(name, None, {
        "model": MODEL,
        "engine": "sim",
        "prefill": {"gearSetRef": {"name": f"{name}-prefill"}},
        "decode": {"gearSetRef": {"name": f"{name}-decode"}},
    }, **({"annotations": annotations} if annotations else {}))  # fmt: skip


def _statefulsets(w: World, service: str) -> list[dict[str, Any]]:
    out = get_json(w.sandbox, "sts", "-n", w.ns, "-l", f"gearshift.io/service={service}")
    return list(out["items"])


def test_a_large_user_annotation_does_not_stop_reconciling(world: World) -> None:
    p, d = world.gpus.add("A10-24GB", "p"), world.gpus.add("A10-24GB", "d")
    whole = [{"layers": [0, 16], "gpuModel": "A10-24GB"}]
    world.apply(_gearset("big-prefill", "big", "prefill", [{**whole[0], "nodes": [p]}]))
    world.apply(_gearset("big-decode", "big", "decode", [{**whole[0], "nodes": [d]}]))
    world.apply(_service("big", {ANNOTATION: "x" * ANNOTATION_BYTES}))

    def both_roles() -> list[dict[str, Any]] | None:
        # The reconcile creates the StatefulSets one after another: wait for both, not the first.
        sts = _statefulsets(world, "big")
        roles = {s["metadata"]["labels"]["gearshift.io/role"] for s in sts}
        return sts if roles == {"prefill", "decode"} else None

    wait_until(both_roles, 120, "the service's prefill and decode StatefulSets")
    # kopf writes its diff base once the handler returns, which may come after the StatefulSets.
    notes = wait_until(
        lambda: (n := world.get("pds", "big")["metadata"]["annotations"]).get(DIFFBASE) and n,
        60, "kopf's diff base written",
    )  # fmt: skip
    assert len(notes[ANNOTATION]) == ANNOTATION_BYTES
    diffbase = notes[DIFFBASE]
    assert ANNOTATION not in diffbase, "kopf's diff base copied the annotation"
    assert json.loads(diffbase)["spec"]["engine"] == "sim"
    # A spec edit after it is handled: the new SLO reaches the diff base.
    world.sandbox.kubectl(
        "patch",
        "pds",
        "big",
        "-n",
        world.ns,
        "--type=merge",
        "-p",
        json.dumps({"spec": {"slo": {"ttftMs": 1234}}}),
    )

    def edited() -> bool | None:
        base = world.get("pds", "big")["metadata"]["annotations"].get(DIFFBASE)
        return True if base and json.loads(base)["spec"].get("slo", {}).get("ttftMs") == 1234 else None

    wait_until(edited, 60, "the edit handled")
    assert world.op is not None and "Too long" not in world.op.log_tail(200_000)


def test_a_message_naming_many_missing_nodes_is_cut_to_the_schema(world: World) -> None:
    # 4 stages × 64 node names of 200 characters: the "no Node named ..." list alone is ~52,000 characters.
    stages = [
        {"layers": [4 * k, 4 * k + 4], "gpuModel": "A10-24GB",
         "nodes": [f"n{k}-{i:02d}-" + "m" * 194 for i in range(64)]}
        for k in range(4)
    ]  # fmt: skip
    world.apply(_gearset("lost-prefill", "lost", "prefill", stages))
    world.apply(_gearset("lost-decode", "lost", "decode", stages))
    world.apply(_service("lost"))

    def long_condition() -> dict[str, Any] | None:
        for kind, name in (("pds", "lost"), ("gs", "lost-prefill")):
            for c in (world.get(kind, name).get("status") or {}).get("conditions") or []:
                # Later reconciles word it "node(s) ... missing or not Ready" with the scheduler's view.
                if "no Node named" in c.get("message", "") or "missing or not Ready" in c.get("message", ""):
                    return dict(c)
        return None

    cond = wait_until(long_condition, 120, "a condition naming the missing nodes")
    msg = cond["message"]
    assert len(msg) <= MAX_MESSAGE
    assert msg.endswith("more characters)"), msg[-200:]
    assert world.op is not None and "string_too_long" not in world.op.log_tail(200_000)
