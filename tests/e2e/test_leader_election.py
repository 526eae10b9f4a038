"""On the sandbox: of two operator replicas started together, one acts; the other waits.

With kopf's peering both replicas handled resources for about 4 s at start-up (each first saw only
itself in the peering object). Now they campaign for a Lease (``--leader-elect``) and the standby does not
start kopf until it holds it. Two ``gearshift operator`` processes on one namespace, started at the same
moment, with short but valid times (lease 6 s, renew deadline 4 s, retry 1 s):

1. exactly one leads, the Lease names it, the standby logs who holds it, runs no kopf at all and answers
   its ``/healthz`` with 200 (``leader: false``); the leader handles the work waiting at start-up;
2. SIGTERM to the leader releases the Lease: the standby leads within a few retry periods, not a lease
   duration, and handles new work;
3. SIGKILL to a leader (no release): its standby waits out the lease duration before it takes over.

The work is a PDService whose GearSets name Nodes that do not exist, so each reconcile writes
``Placed=False`` and no pod runs.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gearshift.dev.sandbox.cluster import free_port
from gearshift.dev.sandbox.harness import LLAMA_3_2_1B, OperatorProcess, get_json, install_crds, wait_until
from gearshift.testing import manifests as build

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

LEASE = "gearshift-e2e"
LEASE_S, RENEW_S, RETRY_S = 6, 4, 1
LEADING = re.compile(r"leading: acquired Lease \S+ as (\S+)")
#: A log line of kopf's own loggers: only an operator that runs kopf writes one.
KOPF_LINE = re.compile(r"^\S+ \S+ (DEBUG|INFO|WARNING|ERROR) kopf[\w.]*: ", re.M)


class Replica:
    def __init__(self, sandbox: Any, ns: str, log: Path) -> None:
        self.port = free_port()
        self.op = OperatorProcess(
            sandbox, ns, log,
            ["--leader-elect", "--leader-election-namespace", ns, "--leader-election-id", LEASE,
             "--lease-duration", str(LEASE_S), "--renew-deadline", str(RENEW_S),
             "--retry-period", str(RETRY_S), "--probe-host", "127.0.0.1", "--probe-port", str(self.port)],
        )  # fmt: skip

    def log(self) -> str:
        return self.op.log_tail(500_000)

    def identity(self) -> str | None:
        m = LEADING.search(self.log())
        return m.group(1) if m else None

    def health(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/healthz", timeout=5) as r:
            assert r.status == 200
            return dict(json.loads(r.read()))


class World:
    def __init__(self, sandbox: Any, tmp: Path) -> None:
        install_crds(sandbox)
        self.sandbox, self.tmp = sandbox, tmp
        self.ns = f"e2e-leader-{uuid.uuid4().hex[:6]}"
        sandbox.kubectl("create", "namespace", self.ns)
        self.replicas: list[Replica] = []

    def apply_service(self, name: str) -> None:
        stages = [{"layers": [0, 16], "gpuModel": "A10-24GB", "nodes": [f"{name}-no-such-node"]}]
        for role in ("prefill", "decode"):
            gear = {"name": "g", "microBatch": 4, "maxBatch": 32, "stages": stages}
            gs = build.gearset(
                f"{name}-{role}",
                self.ns,
                {"serviceName": name, "role": role, "mode": "explicit", "gears": [gear]},
            )
            self.sandbox.kubectl("apply", "-f", "-", input=json.dumps(gs))
        pds = build.pdservice(name, self.ns, {
            "model": LLAMA_3_2_1B, "engine": "sim",
            "prefill": {"gearSetRef": {"name": f"{name}-prefill"}},
            "decode": {"gearSetRef": {"name": f"{name}-decode"}},
        })  # fmt: skip
        self.sandbox.kubectl("apply", "-f", "-", input=json.dumps(pds))

    def handled(self, name: str) -> bool | None:
        """The PDService was reconciled: its status is of its generation and says it cannot be placed
        (the message changes as later reconciles add the scheduler's view, so only the condition counts)."""
        pds = get_json(self.sandbox, "pds", name, "-n", self.ns)
        status = pds.get("status") or {}
        placed = [c for c in status.get("conditions") or [] if c.get("type") == "Placed"]
        current = status.get("observedGeneration") == pds["metadata"].get("generation")
        return True if current and placed and placed[0]["status"] == "False" else None

    def holder(self) -> str | None:
        lease = get_json(self.sandbox, "lease", LEASE, "-n", self.ns)
        return (lease.get("spec") or {}).get("holderIdentity") or None


@pytest.fixture()
def world(sandbox: Any, tmp_path: Path) -> Iterator[World]:
    w = World(sandbox, tmp_path)
    try:
        yield w
    finally:
        for r in w.replicas:
            r.op.stop()
        for kind in ("pds", "gs"):
            w.sandbox.kubectl("delete", kind, "--all", "-n", w.ns, "--wait=false", check=False)
            w.sandbox.kubectl(
                "patch", kind, "--all", "-n", w.ns, "--type=merge", "-p", '{"metadata":{"finalizers":null}}',
                check=False,
            )  # fmt: skip
        w.sandbox.kubectl("delete", "namespace", w.ns, "--wait=false", check=False)


def test_one_of_two_replicas_acts_and_the_other_takes_over(world: World) -> None:
    world.apply_service("first")  # work waiting when the replicas start
    a = Replica(world.sandbox, world.ns, world.tmp / "a.log")
    b = Replica(world.sandbox, world.ns, world.tmp / "b.log")
    world.replicas += [a, b]

    leader = wait_until(lambda: next((r for r in (a, b) if r.identity()), None), 120, "a leader")
    standby = b if leader is a else a
    wait_until(lambda: world.handled("first"), 120, "the leader handles the waiting service")
    assert world.holder() == leader.identity()
    # The standby saw the holder, runs no kopf, and is healthy (ready to take over).
    wait_until(lambda: "is held by " + str(leader.identity()) in standby.log() or None, 30, "standby's view")
    assert standby.identity() is None, standby.log()
    assert not KOPF_LINE.search(standby.log()), standby.log()[-3000:]
    assert KOPF_LINE.search(leader.log()), (
        "the leader's log shows no kopf line: the check above means nothing"
    )
    health = standby.health()
    assert health == {"leader": False, "lease": f"{world.ns}/{LEASE}", "holder": leader.identity()}

    # A clean shutdown releases the Lease: the standby leads after a retry or two, not a lease duration.
    # The leader's own log line is the evidence of the release; the time bound allows for a loaded machine's
    # slow shutdown before it (3.2 s idle; 7.2 s once in CI at load ~10, with the release logged).
    t0 = time.monotonic()
    leader.op.stop()
    wait_until(standby.identity, 30, "the standby leads")
    took = time.monotonic() - t0
    print(f"clean hand-over {took:.1f} s")
    assert leader.op.proc is not None and leader.op.proc.returncode == 0, leader.log()[-3000:]
    assert f"released Lease {world.ns}/{LEASE}" in leader.log(), leader.log()[-3000:]
    assert took < LEASE_S + 2 * RENEW_S, f"took {took:.1f} s"
    wait_until(lambda: world.holder() == standby.identity() or None, 30, "the Lease names the new leader")
    world.apply_service("second")
    wait_until(lambda: world.handled("second"), 120, "the new leader handles new work")

    # A crash releases nothing: the restarted replica (a standby now) waits out the lease duration.
    leader.op.start()
    wait_until(
        lambda: "is held by " + str(standby.identity()) in leader.log() or None, 60, "restarted standby"
    )
    first_identity = LEADING.findall(leader.log())
    t0 = time.monotonic()
    standby.op.kill()
    wait_until(lambda: len(LEADING.findall(leader.log())) > len(first_identity) or None, 60, "takeover")
    took = time.monotonic() - t0
    print(f"takeover after a crash {took:.1f} s")
    # The follower counts the lease from when it last saw the record change (client-go's observedTime),
    # up to one retry period before the kill, and tries once per retry period after it expires.
    assert LEASE_S - RETRY_S - 0.5 <= took <= LEASE_S + 3 * RETRY_S + 5, took
