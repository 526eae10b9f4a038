"""A real-vLLM PDService on the sandbox, for the vLLM e2e tests and ``bench/vllm_cpu.py``.

The service serves the sandbox's tiny Llama (``gearshift/tiny-llama``, e2e/sandbox/build_tiny_model.py)
with ``engine: vllm``: the pod runner runs each engine pod as a real ``vllm serve`` process on the CPU
(docs/ARCHITECTURE.md, "Real vLLM in the sandbox"). The model is loaded by its id from the Hugging Face
cache that the PDService mounts as ``spec.modelCache`` (hostPath ``/var/lib/gearshift/models``).

Everything here talks to the API server through a :class:`gearshift.dev.sandbox.harness.Kubectl` and to the
pods only at their loopback pod IPs.
"""

from __future__ import annotations

import json
import re
import subprocess
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from gearshift.dev.sandbox.harness import Kubectl, apply, get_json, pod_ready, pods, wait_until
from gearshift.dev.sandbox.layout import Layout
from gearshift.dev.sandbox.podspec import pod_dir_name
from gearshift.k8s import names
from gearshift.k8s.engine import ENGINE_PORT
from gearshift.k8s.services import ROUTER_PORT

#: The sandbox's tiny Llama (e2e/sandbox/build_tiny_model.py), by its Hugging Face id.
MODEL: dict[str, Any] = {
    "name": "gearshift/tiny-llama",
    "numLayers": 4,
    "hiddenSize": 128,
    "numHeads": 4,
    "numKvHeads": 2,
    "headDim": 32,
    "intermediateSize": 256,
    "vocabSize": 512,
    "dtype": "float32",
}
#: The name clients send: the operator serves the model under its own id (``--served-model-name``).
SERVED = MODEL["name"]
#: hostPath of the model cache the sandbox fills (install-vllm.sh; sandbox/layout.py hostpath_root).
MODEL_CACHE = "/var/lib/gearshift/models"
#: Bytes of K and V per token per layer: 2 × KV heads × head_dim × 4 bytes (float32).
KV_BYTES_PER_TOKEN_LAYER = 2 * MODEL["numKvHeads"] * MODEL["headDim"] * 4
#: The sandbox's CPU KV pool per process (podspec.VLLM_CPU_ENV VLLM_CPU_KVCACHE_SPACE), bytes.
KV_POOL_BYTES = 1 << 30
PROMPT = "the gear shift stage pipeline prefill decode token cache"
#: Start-up of a vLLM CPU process is 30-90 s on a quiet 2-core machine; beside two serving engines (each
#: NIXL instance polls a core) a shadow took over 15 min once.
READY_S = 1200.0


def gearset(ns: str, svc: str, role: str, gears: list[dict[str, Any]], initial: str) -> dict[str, Any]:
    """An explicit GearSet; shifts only when forced (a day's dwell), warm 5 s once the shadow is Ready."""
    return {
        "apiVersion": "gearshift.io/v1alpha1",
        "kind": "GearSet",
        "metadata": {"name": f"{svc}-{role}", "namespace": ns},
        "spec": {
            "serviceName": svc,
            "role": role,
            "mode": "explicit",
            "initialGear": initial,
            "gears": gears,
            "policy": {"sampleIntervalS": 2, "warmS": 5, "rollbackWindowS": 5, "drainTimeoutS": 60,
                       "warmupTimeoutS": READY_S, "dwellS": 86400},
        },
    }  # fmt: skip


def one_stage(name: str, nodes: list[str], max_batch: int = 8, gpu: str = "A10-24GB") -> dict[str, Any]:
    """A one-stage gear of the whole model on ``nodes``."""
    return {"name": name, "intent": "latency", "microBatch": 1, "maxBatch": max_batch,
            "stages": [{"layers": [0, MODEL["numLayers"]], "nodes": nodes, "gpuModel": gpu}]}  # fmt: skip


def two_stage(name: str, head: tuple[str, str], tail: tuple[str, str], split: int = 3) -> dict[str, Any]:
    """A two-stage gear: layers ``[0, split)`` on ``head`` (node, GPU model), the rest on ``tail``."""
    n = MODEL["numLayers"]
    return {"name": name, "intent": "balanced", "microBatch": 1, "maxBatch": 8,
            "stages": [{"layers": [0, split], "nodes": [head[0]], "gpuModel": head[1]},
                       {"layers": [split, n], "nodes": [tail[0]], "gpuModel": tail[1]}]}  # fmt: skip


def pdservice(
    ns: str,
    svc: str,
    prometheus_url: str | None,
    kv_lease_s: int | None = None,
    aggregated: bool = False,
) -> dict[str, Any]:
    """The PDService: PD with NixlConnector, KV staged in host memory (there is no GPU), or ``aggregated``
    (``spec.serving``, one GearSet of role both, no KV transfer); ``kv_lease_s`` sets ``spec.kvLeaseS``
    (None: the default)."""
    roles: dict[str, Any] = (
        {"serving": {"gearSetRef": {"name": f"{svc}-both"}}}
        if aggregated
        else {
            "kvBufferDevice": "cpu",
            "prefill": {"gearSetRef": {"name": f"{svc}-prefill"}},
            "decode": {"gearSetRef": {"name": f"{svc}-decode"}},
        }
    )
    return {
        "apiVersion": "gearshift.io/v1alpha1",
        "kind": "PDService",
        "metadata": {"name": svc, "namespace": ns},
        "spec": {
            "model": MODEL,
            "engine": "vllm",
            "modelCache": {"hostPath": MODEL_CACHE},
            **roles,
            "slo": {"ttftMs": 2000, "itlMs": 500},
            "router": {"policy": "shortest-queue" if aggregated else "pd-score"},
            **({"prometheusUrl": prometheus_url} if prometheus_url else {}),
            **({"kvLeaseS": kv_lease_s} if kv_lease_s else {}),
        },
    }


def post(
    url: str, body: dict[str, Any], timeout: float = 180.0, headers: dict[str, str] | None = None
) -> tuple[int, bytes]:
    """POST JSON; returns (status, body) for any HTTP status."""
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def get(url: str, timeout: float = 10.0) -> str:
    """GET a text body."""
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read().decode()


def sse_text(raw: bytes, chat: bool) -> tuple[str, bool]:
    """The streamed text of an SSE body and whether it ended with ``data: [DONE]``."""
    text, done = [], False
    for line in raw.decode().splitlines():
        if not line.startswith("data: "):
            continue
        data = line[len("data: ") :]
        if data == "[DONE]":
            done = True
            continue
        for ch in json.loads(data).get("choices", []):
            text.append(((ch.get("delta") or {}).get("content") or "") if chat else (ch.get("text") or ""))
    return "".join(text), done


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``, in a Prometheus text exposition
    (parsed with prometheus_client's own parser)."""
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += float(sample.value)
    return total


def kv_tokens_logged(log: str) -> int:
    """The KV capacity vLLM logs at start-up (``CPU KV cache size: 699,008 tokens``, v1/core/
    kv_cache_utils.py), tokens: the last such line.

    Raises:
        ValueError: the log has no such line.
    """
    found = re.findall(r"KV cache size: ([0-9,]+) tokens", log)
    if not found:
        raise ValueError("no 'KV cache size' line in the engine log")
    return int(found[-1].replace(",", ""))


def pod_dir(pod: dict[str, Any], layout: Layout | None = None) -> Path:
    """The pod runner's directory of ``pod`` (logs, pid files)."""
    return (layout or Layout.from_env()).pods_dir / pod_dir_name(pod)


def engine_log(pod: dict[str, Any]) -> str:
    """The engine container's log of ``pod`` ('' before it started)."""
    path = pod_dir(pod) / "engine.log"
    return path.read_text(errors="replace") if path.exists() else ""


def host_summary() -> str:
    """The host's load average and available memory, and every vLLM process (``ps``: pid, process group,
    state, CPU %, RSS in KiB, age, name): a stalled engine on the sandbox's 2 cores is most often one
    starved by others (orphans of an engine that went, too many at once)."""
    try:
        load = Path("/proc/loadavg").read_text().split()[:3]
        avail = next(
            ln.split()[1]
            for ln in Path("/proc/meminfo").read_text().splitlines()
            if ln.startswith("MemAvailable")
        )
    except (OSError, StopIteration):
        load, avail = ["?"], "?"
    ps = subprocess.run(
        ["ps", "-eo", "pid,pgid,stat,pcpu,rss,etime,comm"], capture_output=True, text=True, check=False
    ).stdout.splitlines()
    engines = [ln for ln in ps[1:] if "vllm" in ln.lower()]
    head = f"--- host: load {' '.join(load)}, MemAvailable {avail} kB; vLLM processes ({len(engines)}):"
    return "\n".join([head, *(ps[:1] if engines else []), *engines])


#: An engine log line worth showing from a pod that is gone: a vLLM ERROR line other than a traceback's
#: frames (its first line and its exception), or an exception printed bare.
_ERROR_LINE = re.compile(r" ERROR .*?\] (?! )(?!Traceback)|^[\w.]*(Error|Exception): ")


def ended_engine_errors(ns: str, current: set[str], per_pod: int = 8) -> str:
    """The last ``per_pod`` error lines (:data:`_ERROR_LINE`) of every engine log of ``ns``'s pods that are
    gone (pod directories not in ``current``, oldest first): why an earlier incarnation of a pipeline
    replica ended, which the deleted pod no longer shows."""
    out = []
    pods_dir = Layout.from_env().pods_dir
    dirs = sorted(pods_dir.glob(f"{ns}_*"), key=lambda d: d.stat().st_mtime) if pods_dir.is_dir() else []
    for d in dirs:
        log = d / "engine.log"
        if d.name in current or not log.exists():
            continue
        lines = [ln[:240] for ln in log.read_text(errors="replace").splitlines() if _ERROR_LINE.search(ln)]
        out.append(f"  {d.name}: " + ("\n    ".join(["", *lines[-per_pod:]]) if lines else "no error lines"))
    return "--- engine pods gone from this namespace (error lines):\n" + ("\n".join(out) or "  none")


def _quiet(log: str) -> str:
    """A log without its probe and scrape lines (``GET /health``, ``GET /metrics``), which fill a tail."""
    return "\n".join(ln for ln in log.splitlines() if "GET /health" not in ln and "GET /metrics" not in ln)


def container_pid(pod: dict[str, Any]) -> int:
    """The process id of the pod's first container (``containerID`` ``gearshift-sandbox://PID``)."""
    cid = pod["status"]["containerStatuses"][0]["containerID"]
    return int(cid.rsplit("/", 1)[1])


class VllmService:
    """One real-vLLM PDService in ``ns``: its router URL, pods and requests."""

    def __init__(self, cluster: Kubectl, ns: str, name: str) -> None:
        self.cluster, self.ns, self.name = cluster, ns, name
        self.router = ""

    def apply(
        self,
        gears: dict[str, tuple[list[dict[str, Any]], str]],
        prometheus_url: str | None,
        kv_lease_s: int | None = None,
    ) -> None:
        """Apply the GearSets (``role -> (gears, initial)``) and the PDService."""
        objs = [gearset(self.ns, self.name, role, g, initial) for role, (g, initial) in gears.items()]
        aggregated = set(gears) == {"both"}
        apply(self.cluster, [*objs, pdservice(self.ns, self.name, prometheus_url, kv_lease_s, aggregated)])

    def engine_pods(
        self, role: str, gear: str | None = None, stage: int | None = None
    ) -> list[dict[str, Any]]:
        """The engine pods of ``role`` (and ``gear``, ``stage``)."""
        sel = f"gearshift.io/service={self.name},gearshift.io/role={role}"
        sel += f",gearshift.io/gear={gear}" if gear else ""
        sel += f",gearshift.io/stage={stage}" if stage is not None else ""
        return pods(self.cluster, self.ns, sel)

    def ready(self) -> bool:
        """The PDService's Ready condition is True (False while the API server does not answer)."""
        try:
            pds = get_json(self.cluster, "pds", self.name, "-n", self.ns)
        except Exception:  # a busy machine's API server may time out a read: ask again
            return False
        conds = {c["type"]: c["status"] for c in pds.get("status", {}).get("conditions", [])}
        return conds.get("Ready") == "True"

    def wait_ready(self, timeout_s: float = READY_S) -> None:
        """Wait for Ready and for a Ready router pod; sets :attr:`router`.

        Raises:
            TimeoutError: not Ready in ``timeout_s`` (from ``harness.wait_until``).
        """
        wait_until(lambda: self.ready() or None, timeout_s, f"PDService {self.name} Ready", interval_s=2.0)
        sel = f"gearshift.io/service={self.name},app.kubernetes.io/component=router"

        def router_ip() -> str | None:
            ready = [p for p in pods(self.cluster, self.ns, sel) if pod_ready(p)]
            return ready[0]["status"]["podIP"] if ready else None

        ip = wait_until(router_ip, 180, "the router pod Ready", interval_s=1.0)
        if not ip.startswith("127."):
            raise AssertionError(f"router pod IP {ip} is not a loopback address")
        self.router = f"http://{ip}:{ROUTER_PORT}"

    def complete(self, prompt: str = PROMPT, max_tokens: int = 12, timeout_s: float = 180) -> str:
        """A greedy completion through the router; its text.

        Raises:
            AssertionError: not HTTP 200 (the body, kubectl's view and each engine's log tail in the message).
        """
        try:
            status, body = post(
                f"{self.router}/v1/completions",
                {"model": SERVED, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
                timeout=timeout_s,
            )
        except (TimeoutError, urllib.error.URLError) as exc:
            raise AssertionError(
                f"completion through the router: no answer within {timeout_s:g} s ({exc})\n{self.diagnose()}"
            ) from None
        if status != 200:
            raise AssertionError(
                f"completion through the router: HTTP {status}: {body[:500]!r}\n{self.diagnose()}"
            )
        return str(json.loads(body)["choices"][0]["text"])

    def pod_url(self, pod: dict[str, Any]) -> str:
        """``http://<pod IP>:8000``."""
        return f"http://{pod['status']['podIP']}:{ENGINE_PORT}"

    def diagnose(self, operator_log: str = "") -> str:
        """For assertion messages, what explains a stall first (a CI summary keeps a message's start): the
        host's load and memory, every vLLM process on it, and the pod runner's lines for this namespace
        (which process it started, stopped or lost, and when); then kubectl's view, each engine pod's
        log tail, the router's and the operator's."""
        out = [host_summary()]
        # The runner is every pod's kubelet.
        runner_log = Layout.from_env().logs_dir / "podrunner.log"
        if runner_log.exists():
            text = runner_log.read_text(errors="replace")
            lines = [ln[:240] for ln in text.splitlines() if self.ns in ln or "fail" in ln]
            out.append("--- pod runner log (this namespace, failures):\n" + "\n".join(lines[-30:]))
        engines = pods(self.cluster, self.ns, "app.kubernetes.io/managed-by=gearshift")
        out.append(ended_engine_errors(self.ns, {pod_dir_name(p) for p in engines}))
        out.append(
            self.cluster.kubectl("get", "pds,gs,sts,pods", "-n", self.ns, "-o", "wide", check=False).stdout
        )
        for p in engines:
            out.append(f"--- {p['metadata']['name']} engine.log tail:\n{_quiet(engine_log(p))[-3000:]}")
        for p in pods(self.cluster, self.ns, f"{names.LABEL_COMPONENT}={names.COMPONENT_ROUTER}"):
            log = pod_dir(p) / "router.log"
            text = log.read_text(errors="replace") if log.exists() else ""
            out.append(f"--- {p['metadata']['name']} router.log tail:\n{_quiet(text)[-3000:]}")
        if operator_log:
            out.append(f"--- operator log tail:\n{operator_log}")
        return "\n".join(out)

    def wait_engines_gone(self, timeout_s: float = 180) -> None:
        """Wait until the namespace's engine pods (and so their vLLM processes) are gone."""
        wait_until(
            lambda: not pods(self.cluster, self.ns, "app.kubernetes.io/managed-by=gearshift") or None,
            timeout_s,
            f"engine pods of {self.ns} gone",
            interval_s=1.0,
        )
