"""The pairwise link probe over loopback TCP, and the choice of pairs to measure."""

from __future__ import annotations

import itertools
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gearshift.api.probedoc import validate_link_output
from gearshift.facts.fleet import load_fleet
from gearshift.probe import link

REPO = Path(__file__).resolve().parents[2]
SMALL = link.LinkBudget(pings=20, frame_bytes=1 << 20, max_bytes=8 << 20, max_seconds=5, connect_timeout_s=5)


class Served:
    def __init__(self, server: link.LinkServer, port: int) -> None:
        self.server, self.port = server, port
        self.result: dict[str, Any] = {}
        self.thread = threading.Thread(target=lambda: self.result.update(server.serve()), daemon=True)
        self.thread.start()

    def join(self) -> dict[str, Any]:
        self.thread.join(timeout=10)
        assert not self.thread.is_alive(), "link server did not stop"
        return self.result


@pytest.fixture
def served() -> Iterator[Any]:
    started: list[Served] = []

    def start(**kw: Any) -> Served:
        server = link.LinkServer("127.0.0.1", 0, idle_timeout_s=kw.pop("idle_timeout_s", 5), **kw)
        s = Served(server, server.bind())
        started.append(s)
        return s

    yield start
    for s in started:
        s.server.close()
        s.thread.join(timeout=10)


class TestMeasure:
    def test_measures_a_loopback_link(self, served):
        s = served(max_sessions=1)
        doc = link.measure_link("127.0.0.1", s.port, SMALL, node="a", peer="b")
        stats = s.join()
        assert validate_link_output(doc) is doc
        assert doc["bytes"] == doc["frames"] * (1 << 20) == stats["bytesReceived"] == 8 << 20
        assert stats == {"sessions": 1, "bytesReceived": 8 << 20, "errors": []}
        assert doc["bandwidthGbps"] == pytest.approx(8 * doc["bandwidthGBps"])
        assert doc["latencyUs"] == pytest.approx(doc["rttUs"]["medianUs"] / 2)
        assert doc["rttUs"]["pings"] == 20
        # The streaming phase lies inside the whole run, so its rate is at least bytes / whole duration.
        assert doc["bandwidthGBps"] >= doc["bytes"] / doc["durationS"] / 1e9 * 0.99
        assert 0 < doc["rttUs"]["minUs"] <= doc["rttUs"]["medianUs"] <= doc["rttUs"]["maxUs"]

    def test_time_bound_stops_streaming(self, served):
        s = served(max_sessions=1)
        budget = link.LinkBudget(pings=2, frame_bytes=1 << 16, max_bytes=1 << 40, max_seconds=0.3)
        t0 = time.monotonic()
        doc = link.measure_link("127.0.0.1", s.port, budget)
        assert time.monotonic() - t0 < 5
        assert doc["frames"] >= budget.min_frames
        assert doc["bytes"] < 1 << 40
        s.join()

    def test_server_serves_sessions_in_turn(self, served):
        s = served(max_sessions=2)
        for _ in range(2):
            link.measure_link("127.0.0.1", s.port, link.LinkBudget(pings=2, frame_bytes=1024, max_bytes=4096))
        assert s.join()["sessions"] == 2

    def test_server_refuses_an_oversized_frame(self, served):
        s = served(max_sessions=1)
        with socket.create_connection(("127.0.0.1", s.port), timeout=5) as sock:
            sock.sendall(link.HEADER.pack(link.OP_DATA, link.MAX_FRAME_BYTES + 1))
            assert sock.recv(16) == b""  # the server hangs up
        assert "exceeds" in s.join()["errors"][0]

    def test_server_stops_when_idle(self, served):
        s = served(max_sessions=None, idle_timeout_s=0.2)
        assert s.join()["sessions"] == 0

    def test_nobody_listening(self):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]  # bound but not listening: connections are refused
            with pytest.raises(link.LinkProbeError, match="cannot connect"):
                link.measure_link("127.0.0.1", port, link.LinkBudget(connect_timeout_s=0.5))

    @pytest.mark.parametrize(
        "kw",
        [{"ping_bytes": 0}, {"frame_bytes": link.MAX_FRAME_BYTES + 1}, {"max_bytes": 1}, {"max_seconds": 0}],
    )
    def test_bad_budget(self, kw):
        with pytest.raises(ValueError):
            link.LinkBudget(**kw)


def N(name: str, cls: str, score: float = 0.0, zone: str = "") -> link.LinkNode:
    return link.LinkNode(name, cls, score, zone)


class TestPairs:
    def test_small_example_exactly(self):
        nodes = [N("a1", "A", 1.0), N("a2", "A", 1.0), N("b1", "B", 0.3)]
        # Groups A = [a1, a2], B = [b1]: within A (a1, a2); A x B rep (a2, b1) (rotation: A's rep is
        # index 1 for the second group); nearest: a1 -> a2, a2 -> a1, b1 -> a1 (score 1.0 ties, name).
        assert link.pairs_to_measure(nodes) == [("a1", "a2"), ("a1", "b1"), ("a2", "b1")]
        assert link.pairs_to_measure(nodes, nearest=0) == [("a1", "a2"), ("a2", "b1")]

    def test_mixed_fleet_covers_every_class_pair_and_node(self):
        fleet = load_fleet(REPO / "examples" / "fleets/mixed.yaml")
        nodes = [N(n.name, n.pool, n.compute_score) for n in fleet.nodes]
        pairs = link.pairs_to_measure(nodes)
        cls = {n.name: n.gpu_class for n in nodes}
        covered = {tuple(sorted((cls[a], cls[b]))) for a, b in pairs}
        pools = sorted({n.gpu_class for n in nodes})
        assert covered == set(itertools.combinations_with_replacement(pools, 2))
        assert {x for p in pairs for x in p} == set(cls)
        assert all(a < b for a, b in pairs) and len(set(pairs)) == len(pairs)
        # 4 groups: at most 10 group pairs + 10 nearest links, fewer than the 45 of all pairs.
        assert len(pairs) <= 4 * 5 // 2 + len(nodes) < len(nodes) * (len(nodes) - 1) // 2

    def test_nearest_prefers_same_zone_then_score(self):
        nodes = [N("x", "A", 1.0, "z1"), N("y", "B", 0.1, "z1"), N("w", "A", 1.0, "z2")]
        pairs = link.pairs_to_measure(nodes, nearest=1)
        assert ("x", "y") in pairs  # same zone beats the same score in another zone

    def test_duplicates_refused(self):
        with pytest.raises(ValueError, match="duplicate"):
            link.pairs_to_measure([N("a", "A"), N("a", "B")])

    def test_rounds_never_share_a_node(self):
        fleet = load_fleet(REPO / "examples" / "fleets/mixed.yaml")
        pairs = link.pairs_to_measure([N(n.name, n.pool, n.compute_score) for n in fleet.nodes], nearest=2)
        rounds = link.schedule_rounds(pairs)
        assert sorted(p for r in rounds for p in r) == pairs
        for r in rounds:
            members = [x for p in r for x in p]
            assert len(members) == len(set(members))

    def test_link_between_falls_back_to_the_group_pair(self):
        nodes = [N("a1", "A"), N("a2", "A"), N("b1", "B"), N("b2", "B")]
        measured = {("a1", "b1"): {"bandwidthGbps": 80.0}}
        assert link.link_between("b1", "a1", nodes, measured) == {"bandwidthGbps": 80.0}
        assert link.link_between("a2", "b2", nodes, measured) == {"bandwidthGbps": 80.0}
        assert link.link_between("a1", "a2", nodes, measured) is None
