"""Status that tells the truth under change on the sandbox twin, with the simulated engine.

One aggregated PDService (sim engine, one one-stage gear on a private A10 node, the operator watching only
this module's namespace) serves; its Prometheus URL is a loopback proxy of the sandbox's Prometheus
(:class:`DroppingPrometheus`) that can answer chosen queries with an empty vector, as a dropped scrape, a
relabel rule or an engine without that histogram would.

- Ready means served by the current spec (dynamo#3567's class): editing the active gear's ``microBatch``
  rolls its StatefulSet; from the reconcile that applies the new revision until its pod serves, the
  PDService is not Ready and is Progressing (message naming the role and gear), never both Ready and
  Progressing, and never Ready in a status written after the StatefulSet showed its rollout (not rolled
  out by ``kubectl rollout status``'s rule); the GearSet's ``observedGeneration`` follows the edit.
- Missing is never fine (aibrix#2592's class): while requests flow to the head pod, the proxy drops the
  TTFT histogram's series; the GearSet says ``SignalsAvailable=False`` (``LatencyUnavailable``, naming
  the series) within a few sample intervals, with one Warning event however many samples it lasts, and
  clears by itself once the series is back.
- Status keeps pace: while Prometheus does not answer, ``status.signals`` still advances
  every sample interval, each tick saying why it has no sample (``skipped``) with no value of the last
  sample left standing; the next sample clears it.

Each test runs on the machine as it is and with one core taken by a CPU hog (``harness.machine_load``,
the busy machine of ``bench/reliability.py``): timing bugs show only under load.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from gearshift.adapters.kube import RestKubeApi
from gearshift.api.common import API_VERSION
from gearshift.dev.sandbox.harness import (
    LLAMA_3_2_1B,
    GpuNodes,
    OperatorProcess,
    install_crds,
    machine_load,
    pod_ready,
    pods,
    teardown_run,
    wait_until,
)
from gearshift.k8s.engine import ENGINE_PORT
from gearshift.testing import manifests as build

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SERVICE = "truth"
GEARSET = "truth"
G = API_VERSION
STS = f"{SERVICE}-both-one-s0"
#: Seconds the API objects are read apart while a rollout is watched (REST calls, not kubectl).
POLL_S = 0.1


def manifests(ns: str, prom_url: str, a10: dict[str, str]) -> list[dict[str, Any]]:
    """The aggregated GearSet (one one-stage gear ``one`` on the ``a10`` selector) and the PDService."""
    layers = LLAMA_3_2_1B["numLayers"]
    gearset = build.gearset(GEARSET, ns, {
        "serviceName": SERVICE,
        "role": "both",
        "mode": "explicit",
        "gears": [
            {"name": "one", "intent": "latency", "microBatch": 4, "maxBatch": 64,
             "stages": [{"layers": [0, layers], "nodeSelector": a10, "gpuModel": "A10-24GB"}]},
        ],
        "policy": {"sampleIntervalS": 1},
    })  # fmt: skip
    pds = build.pdservice(SERVICE, ns, {
        "model": LLAMA_3_2_1B,
        "engine": "sim",
        "serving": {"gearSetRef": {"name": GEARSET}},
        "router": {"policy": "shortest-queue"},
        "slo": {"ttftMs": 200, "itlMs": 50},
        "prometheusUrl": prom_url,
    })  # fmt: skip
    return [gearset, pds]


class DroppingPrometheus:
    """A loopback HTTP proxy of Prometheus' query API that answers every query containing one of
    :attr:`drop` with an empty vector (the series are not there) and forwards the rest; while
    :attr:`down` is set it answers every query 503, as a Prometheus restarting does."""

    def __init__(self, upstream: str) -> None:
        import http.server
        import urllib.parse
        import urllib.request

        assert upstream.startswith("http://127."), upstream  # loopback only
        self.drop: tuple[str, ...] = ()
        self.down = False
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *_: Any) -> None:
                pass

            def _answer(self, query: str, forward: urllib.request.Request) -> None:
                if proxy.down:
                    body, code = b"Service Unavailable", 503
                elif any(d in query for d in proxy.drop):
                    body = b'{"status":"success","data":{"resultType":"vector","result":[]}}'
                    code = 200
                else:
                    try:
                        with urllib.request.urlopen(forward, timeout=10) as r:
                            body, code = r.read(), r.status
                    except Exception as exc:
                        body, code = str(exc).encode(), 502
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                parsed = urllib.parse.urlsplit(self.path)
                query = " ".join(urllib.parse.parse_qs(parsed.query).get("query", []))
                self._answer(query, urllib.request.Request(upstream + self.path))

            def do_POST(self) -> None:
                data = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                query = " ".join(urllib.parse.parse_qs(data.decode()).get("query", []))
                headers = {"Content-Type": self.headers.get("Content-Type", "")}
                self._answer(query, urllib.request.Request(upstream + self.path, data=data, headers=headers))

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _cond(body: dict[str, Any] | None, type_: str) -> dict[str, Any]:
    conds = ((body or {}).get("status") or {}).get("conditions") or []
    return next((c for c in conds if c.get("type") == type_), {})


def sts_rolled(sts: dict[str, Any] | None) -> bool:
    """``kubectl rollout status``'s rule for a StatefulSet: generation observed, every pod Ready and
    updated, the rollout complete (``currentRevision == updateRevision``)."""
    if sts is None:
        return False
    s, want = sts.get("status") or {}, int(sts["spec"].get("replicas", 1))
    return (
        s.get("observedGeneration") == sts["metadata"]["generation"]
        and int(s.get("readyReplicas") or 0) >= want
        and int(s.get("updatedReplicas") or 0) >= want
        and s.get("currentRevision") == s.get("updateRevision")
    )


def _diagnose(api: RestKubeApi, ns: str, op: OperatorProcess) -> str:
    pds = api.get(G, "PDService", ns, SERVICE)
    sts = api.get("apps/v1", "StatefulSet", ns, STS)
    return (
        f"PDService status: {(pds or {}).get('status')}\nStatefulSet status: {(sts or {}).get('status')}\n"
        f"operator log (tail):\n{op.log_tail(3000)}"
    )


@pytest.fixture(scope="module")
def env(sandbox: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    if not sandbox.prometheus_url:
        pytest.skip("needs the sandbox's Prometheus")
    if not getattr(sandbox, "is_sandbox", False):
        pytest.skip("needs the gearshift sandbox (private GPU nodes on loopback pod IPs)")
    install_crds(sandbox)
    ns = f"e2e-truth-{uuid.uuid4().hex[:6]}"
    sandbox.kubectl("create", "namespace", ns)
    nodes = GpuNodes(sandbox, "e2e-truth", cidr_base=110, gpu_replicas=1)
    prom = DroppingPrometheus(sandbox.prometheus_url)
    op: OperatorProcess | None = None
    api = RestKubeApi(sandbox.api_client())
    try:
        nodes.add("A10-24GB", "a10")
        sandbox.apply(manifests(ns, prom.url, {"gearshift.io/node-pool": nodes.pool("a10")}))
        op = OperatorProcess(sandbox, ns, tmp_path_factory.mktemp("operator") / "operator.log")
        try:
            wait_until(
                lambda: _cond(api.get(G, "PDService", ns, SERVICE), "Ready").get("status") == "True",
                240,
                "the PDService Ready",
                interval_s=0.5,
            )
        except TimeoutError as exc:
            raise AssertionError(f"{exc}\n{_diagnose(api, ns, op)}") from None
        yield {"ns": ns, "api": api, "op": op, "prom": prom}
    finally:
        prom.close()
        left = teardown_run(sandbox, ns, op, nodes)
        assert not left, f"not deleted: {left}"


@pytest.fixture(params=["quiet", "one-core-busy"])
def load(request: pytest.FixtureRequest) -> Iterator[str]:
    """The machine as it is, or with one core taken by a CPU hog for the test."""
    with machine_load(str(request.param)) as how:
        yield how


def test_ready_only_once_the_new_revision_serves(sandbox: Any, env: dict[str, Any], load: str) -> None:
    ns, api, op = env["ns"], env["api"], env["op"]
    t_start = time.monotonic()
    gs_now = api.get(G, "GearSet", ns, GEARSET) or {}
    micro = 2 if gs_now["spec"]["gears"][0]["microBatch"] != 2 else 4  # a change on every run
    before = api.get("apps/v1", "StatefulSet", ns, STS)
    assert sts_rolled(before), before.get("status")
    old_revision = before["status"]["updateRevision"]
    polls: list[tuple[float, dict[str, Any], dict[str, Any], dict[str, Any], bool]] = []
    stop = threading.Event()

    def watch() -> None:
        end = time.monotonic() + 180  # bounded, whatever the test does
        while not stop.is_set() and time.monotonic() < end:
            # The StatefulSet first: a PDService read after it was written no earlier than the rollout
            # it may show, so "Ready while rolling" in one poll is a status that lied when it was read.
            sts = api.get("apps/v1", "StatefulSet", ns, STS)
            pds = api.get(G, "PDService", ns, SERVICE) or {}
            gs = api.get(G, "GearSet", ns, GEARSET) or {}
            polls.append((time.monotonic(), pds, gs, sts or {}, sts_rolled(sts)))
            time.sleep(POLL_S)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        time.sleep(1.0)  # a few polls of the settled state first
        edit = [{"op": "replace", "path": "/spec/gears/0/microBatch", "value": micro}]
        sandbox.kubectl("patch", "gearset", GEARSET, "-n", ns, "--type=json", "-p", json.dumps(edit))
        edited = time.monotonic()
        # What a user types next: kubectl's wait compares the condition's observedGeneration with the
        # GearSet's generation, so it must not return before the edit has rolled out.
        waited: list[float] = []

        def kubectl_wait() -> None:
            sandbox.kubectl("wait", "--for=condition=Ready", f"gearset/{GEARSET}", "-n", ns, "--timeout=150s",
                            timeout=160)  # fmt: skip
            waited.append(time.monotonic())

        waiter = threading.Thread(target=kubectl_wait, daemon=True)
        waiter.start()

        def served_again() -> bool:
            if not polls or polls[-1][0] < edited:
                return False
            _, pds, gs, sts, rolled = polls[-1]
            return (
                rolled
                and sts["status"].get("updateRevision") != old_revision
                and _cond(pds, "Ready").get("status") == "True"
                and gs["status"].get("observedGeneration") == gs["metadata"]["generation"]
            )

        try:
            wait_until(served_again, 150, "the new revision rolled out and the PDService Ready again", 0.2)
        except TimeoutError as exc:
            raise AssertionError(f"{exc}\n{_diagnose(api, ns, op)}") from None
        waiter.join(160)
    finally:
        stop.set()
        watcher.join(10)
    after = [p for p in polls if p[0] >= edited]
    assert waited, "kubectl wait --for=condition=Ready on the GearSet did not return"
    lied = [round(t - edited, 2) for t, *_, rolled in after if t > waited[0] and not rolled]
    assert lied == [], (
        f"kubectl wait returned {waited[0] - edited:.2f} s after the edit, before the rollout: {lied[:5]}"
    )

    # Ready and Progressing never say both: one write computes them together.
    def says(pds: dict[str, Any], type_: str) -> bool:
        return _cond(pds, type_).get("status") == "True"

    both = [
        (round(t - edited, 2), _cond(pds, "Progressing").get("message"))
        for t, pds, *_ in after
        if says(pds, "Ready") and says(pds, "Progressing")
    ]
    assert both == [], f"Ready=True and Progressing=True at once (s after the edit, message): {both[:5]}"
    # Never Ready while the StatefulSet rolls, at any poll: the reconcile says Progressing before it
    # applies the new template, and each poll reads the StatefulSet before the PDService.
    assert any(not rolled for *_, rolled in after), "the StatefulSet never showed the rollout"
    early = [
        (round(t - edited, 2), sts["status"])
        for t, pds, _, sts, rolled in after
        if not rolled and says(pds, "Ready")
    ]
    assert early == [], f"Ready=True while the StatefulSet rolled out: {early[:3]}"
    gs_early = [round(t - edited, 2) for t, _, gs, _, rolled in after if not rolled and says(gs, "Ready")]
    assert gs_early == [], f"the GearSet said Ready=True while its StatefulSet rolled out: {gs_early[:3]}"
    # The window was reported as it should: Progressing=True naming the role and gear, phase Progressing.
    rolling = [pds for _, pds, *_ in after if _cond(pds, "Progressing").get("status") == "True"]
    assert rolling, "Progressing=True never seen during the rollout"
    assert any("both gear one" in _cond(p, "Progressing").get("message", "") for p in rolling), [
        _cond(p, "Progressing") for p in rolling[:3]
    ]
    assert any((p.get("status") or {}).get("phase") == "Progressing" for p in rolling)
    # The GearSet said it had read the edit well before the rollout ended.
    gs_seen = next(
        t for t, _, gs, *_ in after if gs["status"].get("observedGeneration") == gs["metadata"]["generation"]
    )
    assert gs_seen - edited < 10.0, (
        f"GearSet observedGeneration followed the edit {gs_seen - edited:.1f} s late"
    )
    final = api.get(G, "PDService", ns, SERVICE)
    assert final["status"]["phase"] == "Ready"
    assert final["status"]["observedGeneration"] == final["metadata"]["generation"]
    print(
        f"\nrollout ({load}): Ready again {polls[-1][0] - edited:.1f} s after the edit; not "
        f"Ready/Progressing for {len(rolling)} of {len(after)} polls; test {time.monotonic() - t_start:.0f} s"
    )


class HeadLoad:
    """Small completions to the head pod's loopback IP, ``rps`` a second, until stopped (at most
    ``max_s``); counts answers and failures."""

    def __init__(self, url: str, rps: float = 2.0, max_s: float = 150.0) -> None:
        assert url.startswith("http://127."), url  # loopback only
        self.url, self.period, self.max_s = url, 1.0 / rps, max_s
        self.ok, self.failed = 0, 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        import json
        import urllib.request

        body = json.dumps({"model": LLAMA_3_2_1B["name"], "prompt": "hello " * 16, "max_tokens": 4}).encode()
        end = time.monotonic() + self.max_s
        while not self.stop.is_set() and time.monotonic() < end:
            req = urllib.request.Request(
                f"{self.url}/v1/completions", data=body, headers={"Content-Type": "application/json"}
            )
            try:
                with urllib.request.urlopen(req, timeout=10) as r:
                    r.read()
                self.ok += 1
            except Exception:
                self.failed += 1
            self.stop.wait(self.period)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(15)


def _gs_signals(api: RestKubeApi, ns: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(SignalsAvailable condition, status.signals)`` of the GearSet."""
    gs = api.get(G, "GearSet", ns, GEARSET) or {}
    return _cond(gs, "SignalsAvailable"), (gs.get("status") or {}).get("signals") or {}


def _warnings(api: RestKubeApi, ns: str, reason: str) -> list[dict[str, Any]]:
    return [
        e
        for e in api.list("v1", "Event", ns)
        if e.get("reason") == reason
        and e.get("type") == "Warning"
        and (e.get("involvedObject") or {}).get("kind") == "GearSet"
    ]


def test_a_missing_latency_series_while_requests_flow_is_reported_once(
    sandbox: Any, env: dict[str, Any], load: str
) -> None:
    ns, api, op, prom = env["ns"], env["api"], env["op"], env["prom"]
    t_start = time.monotonic()
    heads = [
        p for p in pods(sandbox, ns, f"gearshift.io/service={SERVICE},gearshift.io/stage=0") if pod_ready(p)
    ]
    assert heads, "no Ready head pod"
    traffic = HeadLoad(f"http://{heads[0]['status']['podIP']}:{ENGINE_PORT}")
    try:
        try:
            wait_until(
                lambda: (
                    (c := _gs_signals(api, ns))[0].get("reason") == "SignalsOk" and (c[1].get("qps") or 0) > 0
                ),
                120,
                "SignalsOk with requests served",
                interval_s=0.5,
            )
        except TimeoutError as exc:
            raise AssertionError(f"{exc}: {_gs_signals(api, ns)}\n{op.log_tail(2000)}") from None
        events_before = len(_warnings(api, ns, "LatencyUnavailable"))  # the other load's run left one
        prom.drop = ("vllm:time_to_first_token_seconds_bucket",)
        dropped = time.monotonic()

        def reported() -> dict[str, Any] | None:
            cond = _gs_signals(api, ns)[0]
            return cond if cond.get("status") == "False" else None

        try:
            cond = wait_until(reported, 60, "SignalsAvailable=False", interval_s=0.2)
        except TimeoutError as exc:
            raise AssertionError(f"{exc}: {_gs_signals(api, ns)[0]}") from None
        lag = time.monotonic() - dropped
        assert cond["reason"] == "LatencyUnavailable", cond
        assert "vllm:time_to_first_token_seconds P99 (missing)" in cond["message"], cond["message"]
        assert "p99-high" in cond["message"], cond["message"]
        assert lag < 10.0, f"reported {lag:.1f} s after the series went (sample interval 1 s)"
        # Several more samples without the series: still False, and still one event.
        time.sleep(5.0)
        assert _gs_signals(api, ns)[0].get("status") == "False"
        assert len(_warnings(api, ns, "LatencyUnavailable")) == events_before + 1
        prom.drop = ()
        restored = time.monotonic()
        wait_until(
            lambda: _gs_signals(api, ns)[0].get("status") == "True", 60, "SignalsAvailable=True again", 0.2
        )
        cleared = time.monotonic() - restored
    finally:
        prom.drop = ()
        traffic.close()
    assert len(_warnings(api, ns, "LatencyUnavailable")) == events_before + 1
    assert traffic.ok > 0 and traffic.failed == 0, (traffic.ok, traffic.failed)
    print(
        f"\nmissing TTFT series ({load}): reported after {lag:.1f} s, cleared after {cleared:.1f} s; "
        f"{traffic.ok} requests; test {time.monotonic() - t_start:.0f} s"
    )


def test_the_status_advances_every_interval_without_a_sample_and_says_why(
    sandbox: Any, env: dict[str, Any], load: str
) -> None:
    """Prometheus answers 503 for a while. Every tick still writes ``status.signals``: a new
    ``sampleTime`` each sample interval (1 s here), ``skipped`` naming why, no value of the last sample
    left standing; the first sample after it clears ``skipped``. Before, the status kept the last sample's
    values and time until Prometheus came back."""
    ns, api, prom = env["ns"], env["api"], env["prom"]
    wait_until(lambda: _gs_signals(api, ns)[1].get("sampleTime"), 60, "a first sample", interval_s=0.5)
    times: list[str] = []
    prom.down = True
    try:

        def skipped_ticks() -> bool:
            sig = _gs_signals(api, ns)[1]
            if sig.get("skipped") and sig.get("sampleTime") not in times:
                times.append(sig["sampleTime"])
                assert sig.get("qps") is None and sig.get("p99Ms") is None, sig
                assert "did not answer" in sig["skipped"], sig["skipped"]
            return len(times) >= 4

        try:
            wait_until(skipped_ticks, 60, "four ticks recorded as skipped", interval_s=0.25)
        except TimeoutError as exc:
            raise AssertionError(f"{exc}: {times}; {_gs_signals(api, ns)}") from None
    finally:
        prom.down = False

    def sampled_again() -> dict[str, Any] | None:
        sig = _gs_signals(api, ns)[1]
        return sig if sig.get("sampleTime") not in times and not sig.get("skipped") else None

    after = wait_until(sampled_again, 60, "a sample again", interval_s=0.25)
    print(f"\nskipped ticks ({load}): {len(times)} distinct sampleTimes while Prometheus answered 503; "
          f"then {after.get('sampleTime')}, missedSamples {after.get('missedSamples')}")  # fmt: skip
