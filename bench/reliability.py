"""A busy machine against a quiet one: the demo's trace window replayed twice, side by side in one run.

- ``quiet``: ``gearshift demo`` as ``make demo`` runs it (same trace, same window, ``--duration``);
- ``busy``: the same, while a background process keeps one core busy for the whole replay (a Python busy
  loop, bounded by time, started before the replay and ended by its process id afterwards). On the
  2-core sandbox machine that is half the CPU: the control plane, the operator, the router and every
  simulated engine share the other half.

What a user would pick instead is the same service on a quiet machine; the busy run has to keep up with it.
Goal (the issue): 0 failed requests in both runs and busy goodput >= 0.8 x quiet goodput. Goodput is
requests meeting the PDService SLO per second of replay (the demo's ``goodput_rps``); both runs report
their simulated GPU-hours of the fleet over the replay (cards × replay time) so the cost of each figure
is stated.

Also written, per row of the robustness work, the tests that cover it (``ROWS``), and for each run the
GearSets' sample -> status lag (goal P99 <= 2 sample intervals): a watch of every GearSet records, for each
new ``status.signals.sampleTime``, the time the watch delivered it minus that sample time (one wall clock: the
operator and this script run on the same machine). It counts the write, the API server and the watch's
delivery, so it bounds the operator's own figure (``gearshift_operator_sample_to_status_seconds``) from
above. Ticks without a sample (``skipped``) and the loops' ``missedSamples`` are counted beside it.
Other sections of ``--out`` (``lease``, written by ``bench/lease.py``) are kept.

Run: ``PYTHONPATH=operator .venv/bin/python bench/reliability.py [--duration S] [--out FILE]``; it brings
the sandbox up (or reuses it) through ``gearshift demo`` and leaves it up. About 2 × (duration + 1 min).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gearshift.dev.sandbox.harness import burner

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "bench/results/reliability.json"

#: the robustness rows and the tests that fail on the code before the fix and pass after it.
ROWS: dict[str, dict[str, Any]] = {
    "1 busy machine loses requests": {
        "fix": "router/outlier.py: Envoy's health-check thresholds, consecutive-5xx ejection with a "
        "10 % cap, panic threshold; prefill 5xx retried on another pod",
        "tests": [
            "tests/unit/test_router_outlier.py",
            "tests/unit/test_router_proxy.py::test_a_slow_health_check_does_not_take_the_only_decode_pod_out",
            "tests/unit/test_router_proxy.py::test_all_pods_dead_is_502_and_never_no_pod",
            "tests/unit/test_router_proxy.py::test_prefill_5xx_is_retried_on_another_prefill_pod",
            "tests/e2e/test_vllm_engine.py (real vLLM through the router on the loaded sandbox)",
            "bench/reliability.py (this file: busy against quiet)",
        ],
    },
    "2 non-finite signals": {
        "fix": "handlers/shifting.py: non-finite values are no data and never reach a patch",
        "tests": [
            "tests/e2e/test_shifting_e2e.py::test_signals_that_are_not_numbers_or_missing_never_freeze_the_status",
            "tests/unit/test_shifting.py::test_non_finite_values_never_reach_the_status_patch",
        ],
    },
    "3 a missing metric is not zero": {
        "fix": "router: unknown KV usage priced as the fullest reporting pod; KV queries fall back to "
        "vllm:gpu_cache_usage_perc; LatencyUnavailable condition and event",
        "tests": [
            "tests/e2e/test_shifting_e2e.py::test_signals_that_are_not_numbers_or_missing_never_freeze_the_status",
            "tests/unit/test_missing_metrics.py",
            "tests/unit/test_shifting.py::TestTicks::test_served_requests_without_latency_histograms_warn_once",
        ],
    },
    "4 objects near the API's limits": {
        "fix": "kopf's diff base without metadata; every status message cut to the schema's maxLength",
        "tests": ["tests/e2e/test_api_limits.py"],
    },
    "5 a stale CRD makes a silent loop": {
        "fix": "handlers/crds.py: start-up check against api.crdgen, exit 3 naming the fields and the fix; "
        "handlers/common.patch_status: a pruned write records FieldsPruned (event, CRDCurrent=False) and "
        "stops the handler; chart README: the CRD upgrade path",
        "tests": [
            "tests/e2e/test_stale_crds.py",
            "tests/unit/test_crdcheck.py",
            "tests/unit/test_status_pruned.py",
        ],
    },
    "6 recovery rules": {
        "fix": "gearHealth.gearHash: an edited gear is tried again (and its stale mark leaves the status); a "
        "forceGear reverted while warming cancels the shift (Aborted, ShiftCancelled); a GearSet deleted "
        "mid-shift frees its shadows",
        "tests": [
            "tests/e2e/test_shifting_e2e.py::test_force_reverted_while_warming_cancels_the_shift",
            "tests/e2e/test_shifting_e2e.py::test_an_edited_gear_is_tried_again_after_it_was_marked_unhealthy",
            "tests/e2e/test_shifting_e2e.py::test_deleting_the_gearset_mid_shift_frees_its_shadows",
            "tests/unit/test_shifting.py",
        ],
    },
    "7 peering at start-up": {
        "fix": "adapters/leader.py: Lease leader election (the kubernetes client's LeaderElection/LeaseLock) "
        "instead of kopf peering; a standby starts no kopf; a renew-deadline watchdog; release on SIGTERM "
        "(the client's loop since replaced by gearshift's own: #31 item 5 below)",
        "tests": [
            "tests/e2e/test_leader_election.py",
            "tests/unit/test_leader_elector.py",
            "tests/e2e/test_helm.py::test_upgrade_rolls_the_operator_not_the_serving_pods",
        ],
    },
    "#31 item 5 no crash loop": {
        "fix": "adapters/leader.py: one resourceVersion-guarded PUT per renewal, paced from its sending; "
        "adapters/kube.py: no write (ours or kopf's) while not leading; handlers/main.py: on a loss, "
        "re-exec in place and campaign again after 4 s doubling to 60 s (exit 4 only if the exec fails)",
        "tests": [
            "tests/e2e/test_lease_starved.py",
            "tests/unit/test_leader_elector.py",
            "tests/unit/test_leader_fence.py",
            "bench/lease.py (this file's lease section: busy machine, starved API server)",
        ],
    },
}


class LagWatch:
    """Watches every GearSet of the sandbox in a thread and records each new sample's lag (see the module
    docstring): ``lags_s`` (s), ``intervals_s`` (each GearSet's ``spec.policy.sampleIntervalS``),
    ``skipped`` (ticks without a sample) and ``missed`` (the largest ``missedSamples`` per GearSet)."""

    def __init__(self) -> None:
        import threading

        self.lags_s: list[float] = []
        self.intervals_s: dict[str, float] = {}
        self.skipped = 0
        self.missed: dict[str, int] = {}
        self.seen: dict[str, str] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        from kubernetes import client, config, watch

        from gearshift.dev.sandbox.layout import Layout
        from gearshift.facts.rfc3339 import from_time

        while not self.stop.is_set():
            try:
                api = config.new_client_from_config(config_file=str(Layout.from_env().kubeconfig))
                custom = client.CustomObjectsApi(api)
                w = watch.Watch()
                for ev in w.stream(custom.list_cluster_custom_object, "gearshift.io", "v1alpha1", "gearsets",
                                   timeout_seconds=30):  # fmt: skip
                    got = time.time()
                    obj = ev["object"]
                    key = f"{obj['metadata']['namespace']}/{obj['metadata']['name']}"
                    policy = (obj.get("spec") or {}).get("policy") or {}
                    self.intervals_s[key] = float(policy.get("sampleIntervalS", 2.0))
                    sig = (obj.get("status") or {}).get("signals") or {}
                    at = sig.get("sampleTime")
                    if not at or self.seen.get(key) == at:
                        continue
                    self.seen[key] = at
                    self.lags_s.append(got - (from_time(at) or got))
                    self.skipped += 1 if sig.get("skipped") else 0
                    self.missed[key] = max(self.missed.get(key, 0), int(sig.get("missedSamples") or 0))
                    if self.stop.is_set():
                        w.stop()
                        break
            except Exception as exc:  # the sandbox coming up: watch again
                print(f"lag watch: {type(exc).__name__}: {exc}", file=sys.stderr)
                self.stop.wait(2.0)

    def close(self) -> dict[str, Any]:
        """Stop watching; the run's figures (lags in s, nearest-rank percentiles)."""
        self.stop.set()
        self.thread.join(40)
        lags = sorted(self.lags_s)

        def q(p: float) -> float | None:
            return round(lags[min(len(lags) - 1, int(p * len(lags)))], 3) if lags else None

        interval = max(self.intervals_s.values(), default=2.0)
        return {
            "samples": len(lags),
            "lag_s": {"p50": q(0.5), "p99": q(0.99), "max": round(lags[-1], 3) if lags else None},
            "sample_interval_s": interval,
            "p99_over_interval": round((q(0.99) or 0.0) / interval, 2),
            "skipped_ticks": self.skipped,
            "missed_samples_max": max(self.missed.values(), default=0),
        }


def demo(duration: float, results: Path, report_dir: Path) -> dict[str, Any]:
    """``gearshift demo`` with this window; its summary (the report's summary.json)."""
    cmd = [
        str(REPO / ".venv/bin/gearshift"), "demo", "--duration", str(duration),
        "--results", str(results), "--report-dir", str(report_dir), "--keep",
    ]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=REPO, timeout=duration + 900)
    return dict(json.loads(results.read_text()))


def summary(run: dict[str, Any], cards: int) -> dict[str, Any]:
    req = run["requests"]
    return {
        "requests": req,
        "goodput_rps": run["goodput_rps"],
        "throughput_rps": run["throughput_rps"],
        "ttft_ms": run["ttft_ms"],
        "itl_ms": run["itl_ms"],
        "replay_s": run["replay_s"],
        "fleet_gpu_hours": round(cards * run["replay_s"] / 3600.0, 3),
        "shifts": [f"{s['role']} {s['from']}→{s['to']} {s['outcome']}" for s in run.get("shifts", [])],
    }


def fleet_cards() -> int:
    """Physical GPU cards of the demo's fleet (``examples/fleets/mixed.yaml``)."""
    from gearshift.dev.demo import DEFAULT_FLEET
    from gearshift.facts.fleet import load_fleet

    return sum(n.gpus for n in load_fleet(DEFAULT_FLEET).nodes)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--duration", type=float, default=240.0, help="replay issuing time per run, s")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument(
        "--rows-only", action="store_true", help="rewrite only the rows-to-tests map of --out (no runs)"
    )
    a = ap.parse_args(argv)
    if a.rows_only:
        kept = json.loads(a.out.read_text())
        kept["rows"] = ROWS
        a.out.write_text(json.dumps(kept, indent=1, ensure_ascii=False) + "\n")
        return 0
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"gs-reliability-{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    cards = fleet_cards()
    t0 = time.time()
    watch = LagWatch()
    try:
        quiet = demo(a.duration, work / "quiet.json", work / "quiet")
    finally:
        quiet_lag = watch.close()
    hog = burner(a.duration + 900)
    watch = LagWatch()
    try:
        busy = demo(a.duration, work / "busy.json", work / "busy")
    finally:
        busy_lag = watch.close()
        os.killpg(hog.pid, signal.SIGTERM)
        hog.wait(10)
    q, b = summary(quiet, cards), summary(busy, cards)
    q["sample_to_status"], b["sample_to_status"] = quiet_lag, busy_lag
    ratio = b["goodput_rps"] / q["goodput_rps"] if q["goodput_rps"] else 0.0
    failed = q["requests"]["failed"] + b["requests"]["failed"]
    kept = json.loads(a.out.read_text()) if a.out.exists() else {}
    lag_ok = (busy_lag["p99_over_interval"] or 0.0) <= 2.0 and busy_lag["samples"] > 0
    out = {
        **kept,
        "command": "PYTHONPATH=operator .venv/bin/python bench/reliability.py "
        + " ".join(argv or sys.argv[1:]),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)),
        "machine": {"cpus": os.cpu_count(), "background_load": "1 busy-loop process (one core)"},
        "trace_window_s": quiet["trace_window_s"],
        "time_scale": quiet["time_scale"],
        "quiet": q,
        "busy": b,
        "busy_over_quiet_goodput": round(ratio, 3),
        "goal": {
            "failed_requests": 0,
            "busy_over_quiet_goodput_min": 0.8,
            "busy_sample_to_status_p99_max_intervals": 2.0,
        },
        "goal_met": failed == 0 and ratio >= 0.8 and lag_ok,
        "rows": ROWS,
        "wall_s": round(time.time() - t0, 1),
    }
    a.out.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
    print(json.dumps({k: out[k] for k in ("busy_over_quiet_goodput", "goal_met")}))
    for name in ("quiet", "busy"):
        r = out[name]
        print(f"{name}: {r['requests']} goodput {r['goodput_rps']} req/s, TTFT P99 {r['ttft_ms']['p99']} ms, "
              f"sample->status {r['sample_to_status']}")  # fmt: skip
    return 0 if out["goal_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
