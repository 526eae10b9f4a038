"""Unit tests of gearshift.control.windows and the reconciler's handling of time-limited nodes."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

from test_handlers_reconcile import NS, api, reconcile  # noqa: F401  (api is a fixture)

from gearshift.control.windows import (
    WindowTiming,
    leave_by_due,
    next_leave_by,
    planner_windows,
    stages_on,
    windowed_nodes,
)
from gearshift.testing.kube import FakeKubeApi

T0 = datetime(2025, 1, 31, 12, 0, tzinfo=UTC)
GS = ("gearshift.io/v1alpha1", "GearSet")


def gear(name: str, *stage_nodes: list[str]) -> Any:
    return SimpleNamespace(name=name, stages=[SimpleNamespace(nodes=n) for n in stage_nodes])


class TestTiming:
    def test_leave_by_is_deadline_minus_margin_minus_the_longer_of_dwell_and_shift(self) -> None:
        # 3600 − 300 − max(600, 60 + 120) = 2700 s after T0.
        t = WindowTiming(margin_s=300, dwell_s=600, shift_s=180)
        assert t.leave_by(T0 + timedelta(hours=1)) == T0 + timedelta(seconds=2700)
        # A shift slower than the dwell sets the lead: 3600 − 300 − 900 = 2400 s.
        assert WindowTiming(300, 600, 900).leave_by(T0 + timedelta(hours=1)) == T0 + timedelta(seconds=2400)

    def test_planner_fingerprint_flips_exactly_at_leave_by(self) -> None:
        t = WindowTiming(margin_s=30, dwell_s=60, shift_s=20)
        deadline = T0 + timedelta(seconds=200)  # leaveBy = T0 + 110 s
        for at, want in [(0, "usable"), (109, "usable"), (110, "usable"), (111, "left")]:
            w, key = planner_windows({"w": deadline}, T0 + timedelta(seconds=at), t)
            assert key == {"w": want}
            assert w.usable("w") is (want == "usable")


class TestReport:
    def test_windowed_nodes_report(self) -> None:
        t = WindowTiming(margin_s=30, dwell_s=60, shift_s=20)
        deadlines = {"w1": T0 + timedelta(seconds=200), "w2": T0 + timedelta(seconds=1000)}
        gears = [gear("latency", ["d0", "w1"], ["d1"]), gear("throughput", ["d0"], ["d1", "w1"])]
        assert stages_on("w1", gears) == ["latency/s0", "throughput/s1"]
        rep = windowed_nodes(deadlines, gears, T0, t)
        assert rep == [
            {
                "node": "w1",
                "availableUntil": "2025-01-31T12:03:20+00:00",
                "leaveBy": "2025-01-31T12:01:50+00:00",
                "stages": ["latency/s0", "throughput/s1"],
                "state": "InUse",
            },
            {
                "node": "w2",
                "availableUntil": "2025-01-31T12:16:40+00:00",
                "leaveBy": "2025-01-31T12:15:10+00:00",
                "stages": [],
                "state": "Unused",
            },
        ]
        assert next_leave_by(rep) == "2025-01-31T12:01:50+00:00"
        late = windowed_nodes(deadlines, gears, T0 + timedelta(seconds=111), t)
        # Past leaveBy with stages still there: Leaving (the executor shifts off); the timer keeps looking.
        assert late[0]["state"] == "Leaving" and next_leave_by(late) == "2025-01-31T12:01:50+00:00"
        gone = windowed_nodes(deadlines, [], T0 + timedelta(seconds=111), t)
        assert gone[0]["state"] == "Left" and next_leave_by(gone) is None


class TestLeaveByDue:
    def test_due_once_per_value_from_the_instant(self) -> None:
        by = "2025-01-31T12:01:50+00:00"
        at = datetime(2025, 1, 31, 12, 1, 50, tzinfo=UTC)
        assert not leave_by_due(by, at - timedelta(seconds=1), None)  # not yet
        # Through leaveBy's own second the node is still usable to the reconciler (whole seconds,
        # deadline − now ≥ lead + margin): a reconcile then would move nothing.
        assert not leave_by_due(by, at, None)
        assert not leave_by_due(by, at + timedelta(milliseconds=999), None)
        assert leave_by_due(by, at + timedelta(seconds=1), None)
        assert leave_by_due(by, at + timedelta(seconds=40), None)  # late (operator restarted): still due
        assert not leave_by_due(by, at + timedelta(seconds=2), by)  # already re-planned for this value
        later = "2025-01-31T12:05:00+00:00"  # another node's leaveBy once the first has left
        assert not leave_by_due(later, at + timedelta(seconds=2), by)
        assert leave_by_due(later, datetime(2025, 1, 31, 12, 5, 1, tzinfo=UTC), by)

    def test_unset_unparsable_naive_and_offsets(self) -> None:
        assert not leave_by_due(None, T0, None)
        assert not leave_by_due("soon", T0, None)
        # A naive time is read as UTC (T0 is 12:00 UTC).
        assert leave_by_due("2025-01-31T11:59:59", T0, None)
        assert not leave_by_due("2025-01-31T12:00:00", T0, None)
        # 12:59:59 at UTC+1 is a second before T0; compared as instants, not as text.
        assert leave_by_due("2025-01-31T12:59:59+01:00", T0, None)
        assert not leave_by_due("2025-01-31T13:00:00+01:00", T0, None)


def _set_window(api: FakeKubeApi, node: str, until: datetime) -> None:  # noqa: F811
    prof = api.get("gearshift.io/v1alpha1", "GPUProfile", None, node)
    prof["status"]["availableUntil"] = until.isoformat()
    api.put(prof)


def _used(api: FakeKubeApi, gs: str) -> set[str]:  # noqa: F811
    body = api.get(*GS, NS, gs)
    return {n for g in body["status"]["plannedGears"] for s in g["stages"] for n in s["nodes"]}


class TestReconcileWindows:
    def test_windowed_node_used_only_as_extra_then_left_at_leave_by(self, api: FakeKubeApi) -> None:  # noqa: F811
        reconcile(api)
        victim = sorted(_used(api, "llama3-8b-decode"))[-1]
        _set_window(api, victim, datetime.now(UTC) + timedelta(hours=3))
        reconcile(api)
        body = api.get(*GS, NS, "llama3-8b-decode")
        (entry,) = body["status"]["windowedNodes"]
        assert entry["node"] == victim and entry["state"] in ("InUse", "Unused")
        for g in body["status"]["plannedGears"]:
            for s in g["stages"]:
                assert s["nodes"][0] != victim  # never the only (first) copy of a stage
        pds = api.get("gearshift.io/v1alpha1", "PDService", NS, "llama3-8b")
        assert (pds["status"].get("windowLeaveBy") is not None) == (entry["state"] == "InUse")
        # The window now closes within margin + lead: the node is past its leaveBy and left out.
        _set_window(api, victim, datetime.now(UTC) + timedelta(seconds=60))
        out = reconcile(api)
        assert out.planned == ["decode"]
        status = api.get(*GS, NS, "llama3-8b-decode")["status"]
        (entry,) = status["windowedNodes"]
        # The plan's gears (one per intent, first) leave the node; only the serving gear may still be on
        # it, kept as it is until the executor shifts off it (test_window_vacate.py).
        seen: set[str] = set()
        for g in status["plannedGears"]:
            if g["intent"] not in seen:
                seen.add(g["intent"])
                assert all(victim not in s["nodes"] for s in g["stages"])
        serving = [g for g in status["plannedGears"] if g["name"] == status["activeGear"]]
        on_victim = any(victim in s["nodes"] for g in serving for s in g["stages"])
        assert entry["state"] == ("Leaving" if on_victim else "Left")
        assert (entry["stages"] != []) == on_victim
        pds = api.get("gearshift.io/v1alpha1", "PDService", NS, "llama3-8b")
        leave_by = pds["status"].get("windowLeaveBy")
        assert (leave_by is not None) == on_victim
