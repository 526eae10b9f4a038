"""The operator at fleet scale on the sandbox: 1,000+ kwok GPU nodes, 100+ PDServices.

Needs a sandbox of at least ``--min-nodes`` GPU nodes whose pod runner runs in light mode (containers are
forks of the runner: a simulated probe runs in the fork, engine and router pods sleep and count as Ready;
1,000 probe programs and 600 engine processes cannot run on 2 cores) and no Prometheus::

    FLEET=examples/fleets/fleet-1000-nodes.yaml
    .venv/bin/gearshift sandbox up --fleet $FLEET --light-pods --no-prometheus \
        --cpu-nodes 6     # 110 routers: a node of the dense address plan holds 30 pods
    .venv/bin/python bench/fleet_operator.py          # about 15 minutes on 2 cores
    .venv/bin/gearshift sandbox down

It runs one ``gearshift operator`` (every handler, ``GEARSHIFT_SANDBOX=1``, probe Jobs in
``gearshift-system``) watching one fresh namespace, and measures, phase by phase:

1. ``profile``: from the operator's start until every GPU node has a Ready GPUProfile (a probe Job, its
   pod, the simulated probe, the status and the node labels per node);
2. ``idle_fleet``: ``--idle-s`` s with 1,000 Ready profiles and no service: the operator's API writes
   (should be none: writes scale with changes, not with nodes), CPU;
3. ``apply``: ``--services`` PDServices (Llama-3-8B, engine ``sim``, 5 engine pods and a router each) applied
   at once: time until every service's StatefulSets exist, until every engine pod is scheduled on a node
   (*placed*), until every PDService is Ready;
4. ``latency``: ``--latency-n`` more PDServices one after another, apply → StatefulSets (the reconcile
   latency a user sees, P50/P99), with the fleet and the other services running;
5. ``shift``: ``spec.forceGear: g2`` on the prefill GearSet of ``--shift-n`` services at once (warmS 2,
   drainTimeoutS 5, rollbackWindowS 5): time until each is Stable on g2;
6. ``idle``: ``--idle-s`` s with everything running: API writes per resource, CPU, RSS.

Per phase: wall time, operator CPU seconds and share, RSS at the end; the API server's request rate (its
``/metrics`` ``apiserver_request_total``, every client: the operator, kwok's node leases, controllers,
the scheduler, the pod runner and this script's own polls, which are counted and reported), its writes
by resource, and WATCH requests that ended (a watch that ends is restarted by its client); the operator's
own API calls (``gearshift_operator_api_requests_total``: kopf's watches and patches are not in it) and its
reconcile-time histogram (P50/P99 from the buckets). Results: ``bench/results/fleet_operator.json``.
Every loop is bounded in time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import urllib.request
import uuid
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import cpu_seconds, free_port
from gearshift.adapters.kube import KubeApiError
from gearshift.facts.rfc3339 import from_rfc3339
from gearshift.k8s import names
from reconcile import (
    REPO,
    STS_PER_SERVICE,
    G,
    apply,
    kubectl,
    objects,
    rest_api,
    rss_mb,
    sandbox_kubeconfig,
    start_operator,
    stop_operator,
)

PROBE_NS = "gearshift-system"
WRITE_VERBS = ("POST", "PUT", "PATCH", "DELETE", "APPLY", "DELETECOLLECTION")
#: Shift timings (spec.policy) of the benchmark's GearSets: the shift's own waits, not the operator's.
POLICY = {"warmS": 2, "drainTimeoutS": 5, "rollbackWindowS": 5}
#: Decode's last stage on L4 cards: the fleet's 160 A10s hold decode's middle stages of 100+ services.
DECODE_LAST = "L4-24GB"
POLL_S = 5.0
FLEET = "examples/fleets/fleet-1000-nodes.yaml"


class Polls:
    """This script's own API requests (they are in the API server's totals); a list the API server
    times out (it did, 504, for 1,000 GPUProfiles of 18 KB each) is retried and counted."""

    def __init__(self) -> None:
        self.n = 0
        self.failed: list[str] = []

    def list(self, api: Any, *args: Any, **kw: Any) -> list[dict[str, Any]]:
        for attempt in range(5):
            self.n += 1
            try:
                return list(api.list(*args, **kw))
            except KubeApiError as exc:
                self.failed.append(str(exc)[:200])
                time.sleep(2.0 * (attempt + 1))
        return list(api.list(*args, **kw))


def apiserver_counts(kubeconfig: Path) -> dict[tuple[str, str], float]:
    """``(verb, resource[/subresource]) → requests`` from the API server's ``apiserver_request_total``."""
    from prometheus_client.parser import text_string_to_metric_families

    text = subprocess.run(
        ["kubectl", "--kubeconfig", str(kubeconfig), "get", "--raw", "/metrics"],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout  # fmt: skip
    out: dict[tuple[str, str], float] = defaultdict(float)
    for fam in text_string_to_metric_families(text):
        if fam.name != "apiserver_request":
            continue
        for s in fam.samples:
            if s.name != "apiserver_request_total":
                continue
            res = s.labels.get("resource", "") + (
                "/" + s.labels["subresource"] if s.labels.get("subresource") else ""
            )
            out[(s.labels.get("verb", ""), res)] += s.value
    return dict(out)


def operator_metrics(port: int) -> dict[str, list[tuple[dict[str, str], float]]]:
    """The operator's metrics: sample name → [(labels, value)]."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name].append((dict(s.labels), s.value))
    return dict(out)


def quantile_from_buckets(buckets: list[tuple[float, float]], q: float) -> float | None:
    """The ``q`` quantile of a cumulative histogram ``[(le, count)]``, linear within a bucket (as
    Prometheus' ``histogram_quantile``)."""
    buckets = sorted(buckets)
    total = buckets[-1][1] if buckets else 0
    if total <= 0:
        return None
    rank, prev_le, prev_n = q * total, 0.0, 0.0
    for le, n in buckets:
        if n >= rank:
            if le == float("inf"):
                return prev_le
            return prev_le + (le - prev_le) * ((rank - prev_n) / max(n - prev_n, 1e-9))
        prev_le, prev_n = le, n
    return prev_le


class Phase:
    """Snapshots at a phase's start; :meth:`end` returns the phase's figures."""

    def __init__(self, name: str, kubeconfig: Path, op_pid: int, mport: int, polls: Polls) -> None:
        self.name, self.kubeconfig, self.pid, self.mport, self.polls = name, kubeconfig, op_pid, mport, polls
        self.t0, self.cpu0, self.polls0 = time.perf_counter(), cpu_seconds(op_pid), polls.n
        self.api0 = apiserver_counts(kubeconfig)
        self.op0 = _op_calls(operator_metrics(mport))
        self.hist0 = _reconcile_buckets(operator_metrics(mport))

    def end(self, **extra: Any) -> dict[str, Any]:
        wall = time.perf_counter() - self.t0
        cpu = cpu_seconds(self.pid) - self.cpu0
        api1 = apiserver_counts(self.kubeconfig)
        m = operator_metrics(self.mport)
        d = {k: v - self.api0.get(k, 0.0) for k, v in api1.items() if v - self.api0.get(k, 0.0) > 0}
        writes: dict[str, float] = defaultdict(float)
        watches: dict[str, float] = defaultdict(float)
        for (verb, res), n in d.items():
            if verb in WRITE_VERBS:
                writes[res] += n
            elif verb == "WATCH":
                watches[res] += n
        op1 = _op_calls(m)
        op = {k: v - self.op0.get(k, 0.0) for k, v in op1.items() if v - self.op0.get(k, 0.0) > 0}
        op_writes = sum(v for (verb, _), v in op.items() if verb in WRITE_VERBS)
        h1 = _reconcile_buckets(m)
        hd = [(le, n - dict(self.hist0).get(le, 0.0)) for le, n in h1]
        total = sum(d.values())
        return {
            "wall_s": round(wall, 1),
            "operator_cpu_s": round(cpu, 1),
            "operator_cpu_share": round(cpu / wall, 3) if wall else None,
            "operator_rss_mb": round(rss_mb(self.pid), 1),
            "apiserver": {
                "requests": int(total),
                "requests_per_s": round(total / wall, 1) if wall else None,
                "writes_per_s": round(sum(writes.values()) / wall, 1) if wall else None,
                "writes_by_resource": {k: int(v) for k, v in sorted(writes.items(), key=lambda x: -x[1])},
                "watches_ended_by_resource": {k: int(v) for k, v in sorted(watches.items())},
                "bench_polls": self.polls.n - self.polls0,
            },
            "operator_api": {
                "requests": int(sum(op.values())),
                "writes": int(op_writes),
                "by_verb_resource": {
                    f"{v} {r}": int(n) for (v, r), n in sorted(op.items(), key=lambda x: -x[1])
                },
            },
            "pdservice_reconciles": int(hd[-1][1]) if hd else 0,
            "pdservice_reconcile_p50_s": _r(quantile_from_buckets(hd, 0.5)),
            "pdservice_reconcile_p99_s": _r(quantile_from_buckets(hd, 0.99)),
            **extra,
        }


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def _op_calls(m: dict[str, list[tuple[dict[str, str], float]]]) -> dict[tuple[str, str], float]:
    return {
        (lab["verb"], lab["resource"]): v for lab, v in m.get("gearshift_operator_api_requests_total", [])
    }


def _reconcile_buckets(m: dict[str, list[tuple[dict[str, str], float]]]) -> list[tuple[float, float]]:
    return [
        (float(lab["le"]), v)
        for lab, v in m.get("gearshift_operator_reconcile_seconds_bucket", [])
        if lab.get("kind") == "PDService"
    ]


def _ts(text: str | None) -> float | None:
    return from_rfc3339(text).timestamp() if text else None


def _pcts(xs: list[float]) -> dict[str, float | int | None]:
    xs = sorted(xs)
    if not xs:
        return {"n": 0}
    p99 = xs[min(len(xs) - 1, int(0.99 * len(xs)))]
    return {"n": len(xs), "p50": round(xs[len(xs) // 2], 1), "p99": round(p99, 1), "max": round(xs[-1], 1)}


def probe_timeline(api: Any, polls: Polls) -> dict[str, Any]:
    """Per Ready GPUProfile, from its probe Job (``status.probe.job``): Job created → Job complete (the
    sandbox: scheduler, pod runner, the probe) and Job complete → profile Ready (the operator: its timer
    sees the Job, writes the status), s."""
    jobs = {j["metadata"]["name"]: j for j in polls.list(api, "batch/v1", "Job", PROBE_NS)}
    run, react = [], []
    for prof in polls.list(api, G, "GPUProfile"):
        st = prof.get("status") or {}
        job = jobs.get((st.get("probe") or {}).get("job", ""))
        ready = next(
            (c for c in st.get("conditions") or [] if c["type"] == "Ready" and c["status"] == "True"), None
        )
        if job is None or ready is None:
            continue
        created, done = _ts(job["metadata"]["creationTimestamp"]), _ts(job["status"].get("completionTime"))
        t_ready = _ts(ready["lastTransitionTime"])
        if created is None or done is None or t_ready is None:
            continue
        run.append(done - created)
        react.append(max(0.0, t_ready - done))
    return {"job_created_to_complete_s": _pcts(run), "job_complete_to_profile_ready_s": _pcts(react)}


def goals(result: dict[str, Any]) -> dict[str, Any]:
    """Fleet-scale planning's goals for the operator at 1,000 nodes, each with the measured figure and met or
    not."""
    ph = result["phases"]
    placed = next((p for p in ph.get("apply", {}).get("progress", []) if "scheduled" in p["what"]), {})
    rss = max((x.get("operator_rss_mb") or 0) for x in ph.values()) if ph else None
    rows = {
        "reconcile_p50_s": (ph.get("latency", {}).get("p50_s"), 2.0),
        "all_services_placed_s": (placed.get("all_s"), 300.0),
        "operator_rss_mb": (rss, 1024.0),
    }
    return {k: {"measured": v, "goal": g, "met": v is not None and v <= g} for k, (v, g) in rows.items()}


def wait_until(
    what: str,
    check: Callable[[], int],
    goal: int,
    timeout_s: float,
    every_s: float = POLL_S,
    since: float | None = None,
) -> dict[str, Any]:
    """Poll ``check`` (how many are done) until ``goal`` or ``timeout_s``; the times since ``since``
    (``perf_counter``; default now) at which it reached 50 % and 100 %."""
    start = time.perf_counter()
    t0 = start if since is None else since
    half = None
    n = 0
    while time.perf_counter() - start < timeout_s:
        n = check()
        el = time.perf_counter() - t0
        if half is None and n >= goal / 2:
            half = el
        if n >= goal:
            return {"what": what, "goal": goal, "done": n, "half_s": round(half, 1), "all_s": round(el, 1)}
        time.sleep(every_s)
    return {"what": what, "goal": goal, "done": n, "half_s": _r(half), "all_s": None, "timeout_s": timeout_s}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--services", type=int, default=100)
    ap.add_argument("--latency-n", type=int, default=20)
    ap.add_argument("--shift-n", type=int, default=10)
    ap.add_argument("--idle-s", type=float, default=60.0)
    ap.add_argument("--min-nodes", type=int, default=1000)
    ap.add_argument("--profile-timeout", type=float, default=900.0)
    ap.add_argument("--place-timeout", type=float, default=600.0)
    ap.add_argument("--shift-timeout", type=float, default=300.0)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "fleet_operator.json")
    args = ap.parse_args()

    kubeconfig = sandbox_kubeconfig()
    api = rest_api(kubeconfig)
    polls = Polls()
    gpu_nodes = [
        n
        for n in api.list("v1", "Node")
        if int((n["status"].get("capacity") or {}).get(names.GPU_RESOURCE, 0))
    ]
    if len(gpu_nodes) < args.min_nodes:
        up = f"gearshift sandbox up --fleet {FLEET} --light-pods --no-prometheus --cpu-nodes 6"
        print(f"{len(gpu_nodes)} GPU nodes, fewer than --min-nodes {args.min_nodes}: {up}", file=sys.stderr)
        return 2
    ns = f"bench-fleet-{uuid.uuid4().hex[:6]}"
    kubectl(kubeconfig, "apply", "-f", str(REPO / "crds"))
    kubectl(kubeconfig, "create", "namespace", ns)
    subprocess.run(["kubectl", "--kubeconfig", str(kubeconfig), "create", "namespace", PROBE_NS],
                   capture_output=True, timeout=60)  # fmt: skip
    mport = free_port()
    log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"{ns}-operator.log"
    log = log_path.open("w")
    load = os.getloadavg()
    result: dict[str, Any] = {
        "benchmark": "fleet_operator",
        "command": f"gearshift sandbox up --fleet {FLEET} --light-pods --no-prometheus --cpu-nodes 6; "
        ".venv/bin/python bench/fleet_operator.py " + " ".join(sys.argv[1:]),
        "machine": {
            "cpus": os.cpu_count(),
            "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30),
            "python": platform.python_version(),
            "shared": True,
            "loadavg_1m_at_start": round(load[0], 2),
        },
        "setup": {
            "gpu_nodes": len(gpu_nodes),
            "gpus": sum(int(n["status"]["capacity"][names.GPU_RESOURCE]) for n in gpu_nodes),
            "services": args.services,
            "engine": "sim",
            "replicas": 1,
            "engine_pods_per_service": STS_PER_SERVICE,
            "pods": "light (forks of the pod runner)",
            "prometheus": False,
            "policy": POLICY,
        },
        "phases": {},
    }
    op = start_operator(kubeconfig, ns, mport, log, [], env={"GEARSHIFT_SANDBOX": "1"})
    phases = result["phases"]
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                operator_metrics(mport)
                break
            except OSError:
                time.sleep(0.5)

        def ready_profiles() -> int:
            ps = polls.list(api, G, "GPUProfile")
            return sum(1 for p in ps if (p.get("status") or {}).get("phase") == "Ready")

        ph = Phase("profile", kubeconfig, op.pid, mport, polls)
        w = wait_until("Ready GPUProfiles", ready_profiles, len(gpu_nodes), args.profile_timeout, 10.0)
        jobs = len(polls.list(api, "batch/v1", "Job", PROBE_NS))
        labelled = sum(
            1 for n in polls.list(api, "v1", "Node") if names.NODE_GPU_MODEL in n["metadata"]["labels"]
        )
        phases["profile"] = ph.end(
            progress=w, probe_jobs=jobs, labelled_nodes=labelled, timeline=probe_timeline(api, polls)
        )
        print(json.dumps({"profile": phases["profile"]["progress"]}), file=sys.stderr, flush=True)

        ph = Phase("idle_fleet", kubeconfig, op.pid, mport, polls)
        time.sleep(args.idle_s)
        phases["idle_fleet"] = ph.end()
        print(json.dumps({"idle_fleet": phases["idle_fleet"]["operator_api"]}), file=sys.stderr, flush=True)

        def make(name: str) -> list[dict[str, Any]]:
            return objects(
                name, replicas=1, engine="sim", decode_last=DECODE_LAST, policy=POLICY, second_gear=True
            )

        ph = Phase("apply", kubeconfig, op.pid, mport, polls)
        t0 = time.perf_counter()
        objs = [o for i in range(args.services) for o in make(f"s{i}")]
        for k in range(0, len(objs), 60):
            apply(kubeconfig, ns, objs[k : k + 60])
        applied_s = time.perf_counter() - t0
        want = {f"s{i}" for i in range(args.services)}

        def by_service(kind: tuple[str, str], pred: Callable[[dict[str, Any]], bool]) -> dict[str, int]:
            out: dict[str, int] = defaultdict(int)
            for o in polls.list(api, *kind, ns, {names.LABEL_COMPONENT: names.COMPONENT_ENGINE}):
                if pred(o):
                    out[o["metadata"]["labels"].get(names.LABEL_SERVICE, "")] += 1
            return out

        def with_sts() -> int:
            c = by_service(("apps/v1", "StatefulSet"), lambda o: True)
            return sum(1 for s in want if c.get(s, 0) >= STS_PER_SERVICE)

        def placed() -> int:
            c = by_service(("v1", "Pod"), lambda o: bool(o["spec"].get("nodeName")))
            return sum(1 for s in want if c.get(s, 0) >= STS_PER_SERVICE)

        def ready() -> int:
            return sum(
                1 for p in polls.list(api, G, "PDService", ns)
                if p["metadata"]["name"] in want and (p.get("status") or {}).get("phase") == "Ready"
            )  # fmt: skip

        # Times from the first apply.
        progress = [
            wait_until("services with all StatefulSets", with_sts, len(want), args.place_timeout, since=t0),
            wait_until(
                "services with every engine pod scheduled", placed, len(want), args.place_timeout, since=t0
            ),
            wait_until("PDServices Ready", ready, len(want), args.place_timeout, since=t0),
        ]
        phases["apply"] = ph.end(apply_s=round(applied_s, 1), progress=progress, goal_all_placed_s=300)
        print(json.dumps({"apply": progress}), file=sys.stderr, flush=True)

        ph = Phase("latency", kubeconfig, op.pid, mport, polls)
        lat = []
        for i in range(args.latency_n):
            name = f"lat{i}"
            t0 = time.perf_counter()
            apply(kubeconfig, ns, make(name))
            deadline = t0 + 60
            n = 0
            while time.perf_counter() < deadline:
                n = sum(1 for o in polls.list(api, "apps/v1", "StatefulSet", ns, {names.LABEL_SERVICE: name}))
                if n >= STS_PER_SERVICE:
                    break
                time.sleep(0.05)
            lat.append(time.perf_counter() - t0 if n >= STS_PER_SERVICE else float("inf"))
        lat_sorted = sorted(lat)
        phases["latency"] = ph.end(
            apply_to_all_statefulsets_s=[round(x, 3) for x in lat],
            p50_s=round(statistics.median(lat), 3),
            p99_s=round(lat_sorted[min(len(lat) - 1, int(0.99 * len(lat)))], 3),
            goal_p50_s=2.0,
        )
        print(json.dumps({"latency": phases["latency"]["p50_s"]}), file=sys.stderr, flush=True)

        ph = Phase("shift", kubeconfig, op.pid, mport, polls)
        shifted = [f"s{i}-prefill" for i in range(args.shift_n)]
        for gsname in shifted:
            kubectl(kubeconfig, "-n", ns, "patch", "gearset", gsname, "--type", "merge", "-p",
                    json.dumps({"spec": {"forceGear": "g2"}}))  # fmt: skip

        def stable_on_g2() -> int:
            return sum(
                1 for g in polls.list(api, G, "GearSet", ns)
                if g["metadata"]["name"] in shifted and (g.get("status") or {}).get("activeGear") == "g2"
                and (g.get("status") or {}).get("phase") == "Stable"
            )  # fmt: skip

        w = wait_until("GearSets Stable on g2", stable_on_g2, len(shifted), args.shift_timeout, 2.0)
        phases["shift"] = ph.end(progress=w, shifted=len(shifted))
        print(json.dumps({"shift": w}), file=sys.stderr, flush=True)

        ph = Phase("idle", kubeconfig, op.pid, mport, polls)
        time.sleep(args.idle_s)
        phases["idle"] = ph.end(services=args.services + args.latency_n)
    finally:
        result["bench_poll_failures"] = polls.failed
        result["goals"] = goals(result)
        kc = ["kubectl", "--kubeconfig", str(kubeconfig)]
        subprocess.run([*kc, "delete", "namespace", ns, "--timeout=300s"], capture_output=True, timeout=400)
        stop_operator(op)
        log.close()
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    print(f"operator log: {log_path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
