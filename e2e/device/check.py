"""gearshift's GPU check on a lent device machine (one H200): the probe, and real CUDA vLLM run with the
argument lists gearshift's builders write. e2e/device/README.md says how to run it.

Steps, each under its own timeout and one overall budget (``--budget-s``):

1. versions: python, torch, CUDA, the GPU and its driver (``nvidia-smi``); vLLM, NIXL, transformers from
   the Python that owns ``vllm`` (``$GEARSHIFT_VLLM``, else ``vllm`` on PATH, else this Python's
   ``vllm`` module). No vLLM: ``vllm: missing`` is printed and recorded and steps 5-8 are skipped.
2. probe: ``gearshift-probe device`` (the worker image's probe, CUDA path of
   ``gearshift/probe/backends.py``), its JSON kept whole (``$OUT/probe.json``) and summarised.
2b. layers: ``layer_times.py``, one decoder layer's prefill and decode times per micro-batch (the figures the
   roofline predicts; ``bench/device_calibration.py`` compares them here), once the probe let go of the card.
3. model: ``e2e/sandbox/build_tiny_model.py`` builds ``gearshift/tiny-llama`` into a Hugging Face cache,
   on the CPU, while the probe holds the GPU.
4. render: ``gearshift render --all-gears -o json`` of a GPU variant of ``examples/vllm/tiny-llama.yaml``
   (the edits are listed in :data:`VARIANT` and recorded) on a two-node H200 fleet; each engine container's
   command, args and env are then expanded as a kubelet would (``gearshift.dev.sandbox.podspec``), with each
   "pod" on its own loopback IP.
5. reference + (d) gear shift: prefill gear ``pp1`` (one stage) starts; its greedy output is the reference;
   a client loop runs against it while a second ``pp1`` engine starts beside it; once that one is Ready
   (``/health``) the loop is switched over, the first engine is stopped when nothing is in flight on it,
   and the seconds and the failed requests are counted.
6. (b) pipeline: prefill gear ``pp2`` (two ``vllm serve`` processes, ``--nnodes 2``, rank 1 ``--headless``,
   ``VLLM_PP_LAYER_PARTITION=3,1``); its greedy output must equal the reference.
7. (c) PD: decode gear ``d1`` starts; the two legs of vLLM's toy proxy (``gearshift.router.legs``'s
   ``prefill_leg_body``/``decode_leg_body``/``leg_headers``: prefill ``max_tokens: 1`` with
   ``kv_transfer_params.do_remote_decode``, decode with what prefill returned, one ``X-Request-Id``), once
   from ``pp1`` and once from ``pp2``; the KV moved when decode's
   ``vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}`` grew by the prompt (less the one
   token vLLM recomputes), and the output must equal the reference.
8. every engine this script started is stopped (SIGTERM to its process group, SIGKILL after 30 s).

What the harness adds to the operator's pods, and why (recorded in device.json as ``harness`` and per pod):
``--gpu-memory-utilization`` 0.9 (what explicit gears always get; the flag is operator-owned) is replaced by
this script's ``--gpu-memory-utilization`` (0.15), so several engines share the one card;
``GEARSHIFT_MASTER_ADDR`` (the head pod's DNS name) → the head's loopback IP (no cluster DNS here);
``HF_HOME`` → the local model cache when it is not the container path; offline Hugging Face, no usage
stats; NCCL, gloo and UCX on ``lo``; and ``NCCL_HOSTID`` = the pod's name, one per "pod", as distinct nodes
have distinct host names: NCCL refuses two ranks of one communicator on one GPU of one host ("Duplicate GPU
detected", NCCL >= 2.5), and a two-stage pipeline on a one-GPU machine has both ranks on that GPU.

``--dry-run``: steps 1 (what it can find without importing torch or vLLM) and 4 run for real (rendering is
pure Python); everything else is printed, not run. Nothing is written.

Exit status: 0 all checks passed; 1 a check failed; 3 vLLM missing (probe and model still ran); 4 pydantic
missing (gearshift cannot import: run fetch-wheels.sh and carry e2e/device/wheels).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import itertools
import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ClassVar

ROOT = Path(__file__).resolve().parents[2]
OPERATOR = ROOT / "operator"
if str(OPERATOR) not in sys.path:
    sys.path.insert(0, str(OPERATOR))

EXAMPLE = ROOT / "examples" / "vllm" / "tiny-llama.yaml"
BUILD_MODEL = ROOT / "e2e" / "sandbox" / "build_tiny_model.py"
#: The card the variant's stages name (gearshift.facts.gpus) and the fleet pool that holds it.
GPU_MODEL = "H200-141GB"
POOL = "h200"
#: What the GPU variant changes in examples/vllm/tiny-llama.yaml, and why (recorded in device.json).
VARIANT = [
    "PDService spec.model.dtype float32 -> bfloat16 (float32 was for CPUs without AVX-512 BF16; a Hopper "
    "card serves bfloat16, vLLM's FlashAttention backend takes no float32)",
    "PDService spec.kvBufferDevice cpu -> cuda (NixlConnector moves KV out of GPU memory)",
    f"GearSet stages: nodes gpu-t4-<i> -> gpu-{POOL}-<i>, gpuModel T4-16GB -> {GPU_MODEL} (with a T4 in the "
    "pipeline the operator pins float16)",
]
#: The fleet the variant is rendered on: two H200 nodes, each card time-sliced so every gear fits.
FLEET = {
    "name": "device-h200",
    "network": {"latencyUs": 10},
    "gpuSharing": {"strategy": "time-slicing", "replicas": 4},
    "nodePools": [{"name": POOL, "gpu": GPU_MODEL, "nodes": 2, "gpusPerNode": 1, "nicGbps": 200}],
}
#: Environment the harness adds to every engine process (see the module docstring).
HARNESS_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "NCCL_SOCKET_IFNAME": "lo",
    "NCCL_IB_DISABLE": "1",
    "GLOO_SOCKET_IFNAME": "lo",
    "UCX_NET_DEVICES": "lo",
    "PYTHONUNBUFFERED": "1",
}
PROMPTS = [
    "the gear shift stage pipeline prefill decode token cache",
    "how many layers does the model serve on one card",
    "hello world what is a kernel",
]
MAX_TOKENS = 16
#: One prompt per PD run: the decode engine's prefix cache would answer a repeated one locally.
PD_PROMPTS = {
    "pp1": "the router sends the prompt to prefill then decode reads the cache from the card " * 2,
    "pp2": "two stages hold three layers and one layer and the decode pod pulls both halves " * 2,
}
#: Seconds: one engine's start (import, load, profile, KV allocation; eager), a request, a stop.
START_TIMEOUT_S = 180.0
REQUEST_TIMEOUT_S = 60.0
STOP_GRACE_S = 30.0
PROBE_BUDGET_S = 150.0
MODEL_TIMEOUT_S = 240.0
#: Seconds kept back at the end for stopping engines and writing the results.
RESERVE_S = 25.0


# --------------------------------------------------------------------------------------------- plumbing


class CheckFailed(Exception):
    """A check that ran and failed; the message says what was expected and what came."""


class Interrupted(BaseException):
    """SIGTERM (run.sh's timeout): stop what was started, write what was measured."""


@dataclass
class Run:
    dry_run: bool
    out: Path | None
    work: Path
    python: str
    t0: float
    budget_s: float
    results: dict[str, Any] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def left(self) -> float:
        return self.budget_s - self.elapsed() - RESERVE_S

    def log(self, msg: str) -> None:
        print(f"[device {self.elapsed():6.1f}s] {msg}", flush=True)

    def step(self, name: str, status: str) -> None:
        if self.dry_run and status.startswith("ok"):
            status = "printed (dry run)"
        self.results.setdefault("steps", {})[name] = status
        self.log(f"step {name}: {status}")

    def fail(self, name: str, msg: str) -> None:
        self.failures.append(f"{name}: {msg}")
        self.step(name, f"failed: {msg}")


def _sub_env(extra: dict[str, str] | None = None, drop_pythonpath: bool = False) -> dict[str, str]:
    env = dict(os.environ)
    if drop_pythonpath:
        # vLLM runs on its own packages: not on the pydantic & co. carried for gearshift (run.sh).
        orig = env.get("GEARSHIFT_ORIG_PYTHONPATH", "")
        if orig:
            env["PYTHONPATH"] = orig
        else:
            env.pop("PYTHONPATH", None)
    else:
        env["PYTHONPATH"] = os.pathsep.join([str(OPERATOR), *filter(None, [env.get("PYTHONPATH")])])
    env.update(extra or {})
    return env


def _capture(argv: list[str], timeout: float, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """Run ``argv``, return ``(rc, stdout, stderr)``; rc 124 on timeout, 127 when it cannot start."""
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, check=False)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
        return 124, out, f"timed out after {timeout:g} s"
    except OSError as exc:
        return 127, "", str(exc)
    return p.returncode, p.stdout, p.stderr


def _tail(text: str, n: int = 1500) -> str:
    return text[-n:].strip()


# ------------------------------------------------------------------------------------------- 1. versions

_TORCH_FACTS = r"""
import json, sys
out = {"python": sys.version.split()[0], "executable": sys.executable}
try:
    import torch
    out["torch"] = torch.__version__
    out["cuda"] = torch.version.cuda
    out["cudaAvailable"] = torch.cuda.is_available()
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
        out["gpuCount"] = torch.cuda.device_count()
        out["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
        free, total = torch.cuda.mem_get_info(0)
        out["gpuMemoryGiB"] = round(total / 2**30, 1)
        out["gpuFreeGiB"] = round(free / 2**30, 1)
        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
except Exception as exc:
    out["torchError"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""

_DIST_VERSIONS = r"""
import importlib.metadata as m, importlib.util as u, json, sys
out = {"python": sys.version.split()[0], "executable": sys.executable}
for name in ("vllm", "torch", "nixl", "nixl-cu12", "nixl-cu13", "transformers", "tokenizers", "aiohttp"):
    try:
        out[name] = m.version(name)
    except m.PackageNotFoundError:
        out[name] = None
out["vllmModule"] = u.find_spec("vllm") is not None
print(json.dumps(out))
"""

_VLLM_IMPORT = "import vllm, importlib.metadata as m; print(m.version('vllm'))"


def find_vllm(python: str) -> tuple[list[str] | None, str | None, str]:
    """``(command to run vllm, the Python that owns it, how it was found)``; ``(None, None, why)`` if none."""
    explicit = os.environ.get("GEARSHIFT_VLLM")
    if explicit:
        path = shutil.which(explicit) or explicit
        if Path(path).is_file():
            return [path], _script_python(Path(path)), f"$GEARSHIFT_VLLM={explicit}"
        return None, None, f"$GEARSHIFT_VLLM={explicit} is not a file"
    on_path = shutil.which("vllm")
    if on_path:
        return [on_path], _script_python(Path(on_path)), f"vllm on PATH ({on_path})"
    rc, _, _ = _capture(
        [python, "-c", "import importlib.util as u, sys; sys.exit(0 if u.find_spec('vllm') else 1)"],
        60,
        env=_sub_env(drop_pythonpath=True),
    )
    if rc == 0:
        return [python, "-m", "vllm.entrypoints.cli.main"], python, f"module vllm of {python}"
    return None, None, f"no vllm on PATH, no $GEARSHIFT_VLLM, no module vllm in {python}"


def _script_python(script: Path) -> str | None:
    """The interpreter of a console script's ``#!`` line (the Python whose packages vllm runs on)."""
    try:
        first = script.read_bytes()[:512].split(b"\n", 1)[0].decode(errors="replace")
    except OSError:
        return None
    if first.startswith("#!") and "python" in first:
        return first[2:].strip().split()[0]
    return None


def step_versions(run: Run) -> tuple[list[str] | None, str | None]:
    host: dict[str, Any] = {
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "kernel": platform.release(),
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    if run.dry_run:
        host["python"] = platform.python_version()
        run.log("dry run: torch is not imported (no CUDA context here)")
    else:
        rc, out, err = _capture([run.python, "-c", _TORCH_FACTS], 120)
        host.update(json.loads(out) if rc == 0 and out.strip() else {"torchError": _tail(err, 500)})
        if shutil.which("nvidia-smi"):
            q = "name,driver_version,memory.total"
            rc, out, _ = _capture(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"], 30)
            if rc == 0:
                host["nvidiaSmi"] = out.strip()
    vllm_cmd, vllm_python, how = find_vllm(run.python)
    vinfo: dict[str, Any] = {"found": how}
    if vllm_cmd is None:
        vinfo["status"] = "missing"
        print(f"vllm: missing ({how})", flush=True)
    else:
        vinfo["command"] = vllm_cmd
        if vllm_python:
            rc, out, err = _capture([vllm_python, "-c", _DIST_VERSIONS], 60, _sub_env(drop_pythonpath=True))
            if rc == 0:
                vinfo.update(json.loads(out))
        from gearshift.k8s.engine import VLLM_VERSION

        vinfo["operatorVersion"] = VLLM_VERSION
        vinfo["matchesOperator"] = str(vinfo.get("vllm") or "").split("+")[0] == VLLM_VERSION
        if run.dry_run:
            vinfo["status"] = "found (not imported in a dry run)"
        elif vllm_python:
            rc, out, err = _capture([vllm_python, "-c", _VLLM_IMPORT], 240, _sub_env(drop_pythonpath=True))
            if rc == 0:
                vinfo["status"] = "ok"
            else:
                vinfo["status"] = "broken"
                vinfo["importError"] = _tail(err, 800)
                print(f"vllm: broken (import failed: {_tail(err, 300)})", flush=True)
                vllm_cmd = None
        else:
            vinfo["status"] = "ok (version unknown: no interpreter found for the vllm script)"
        if vllm_cmd is not None:
            print(f"vllm: {vinfo.get('vllm') or '?'} via {how}", flush=True)
    run.results["host"] = host
    run.results["vllm"] = vinfo
    return vllm_cmd, vllm_python


# ------------------------------------------------------------------------------------------- 2. probe


def probe_command(run: Run) -> list[str]:
    """``gearshift-probe`` (the console script pip installs) when present, else ``python -m``."""
    here = Path(run.python).parent / "gearshift-probe"
    exe = str(here) if here.is_file() else shutil.which("gearshift-probe")
    base = [exe] if exe else [run.python, "-m", "gearshift.probe"]
    term = run.work / "probe-termination-log.json"
    return [*base, "--termination-log", str(term), "device", "--time-budget-s", f"{PROBE_BUDGET_S:g}"]


def start_probe(run: Run) -> subprocess.Popen[str] | None:
    argv = probe_command(run)
    run.log(f"probe: {shlex.join(argv)}")
    if run.dry_run:
        return None
    return subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_sub_env(), cwd=run.work
    )


def finish_probe(run: Run, proc: subprocess.Popen[str] | None) -> None:
    if proc is None:
        return
    timeout = PROBE_BUDGET_S + 45
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        run.fail("probe", f"did not finish in {timeout:g} s: {_tail(err, 400)}")
        return
    doc = None
    for line in reversed(out.splitlines()):
        if line.startswith("{"):
            with contextlib.suppress(ValueError):
                doc = json.loads(line)
                break
    if proc.returncode != 0 or doc is None or "error" in doc:
        why = doc.get("error") if doc else _tail(err, 600)
        run.fail("probe", f"exit {proc.returncode}: {why}")
        return
    if run.out:
        (run.out / "probe.json").write_text(json.dumps(doc, indent=1) + "\n")
    keep = ("kind", "backend", "gpuModel", "gpuProduct", "gpuCount", "generation", "dtype", "durationS")
    run.results["probe"] = {k: doc.get(k) for k in keep} | {"summary": doc.get("summary")}
    if doc.get("kind") != "cuda":
        run.fail("probe", f"ran on {doc.get('kind')!r}, not cuda: torch sees no GPU")
        return
    s = doc.get("summary") or {}
    run.step(
        "probe",
        f"ok: {doc.get('gpuProduct')} matmul {s.get('matmulTflops', 0):.0f} TFLOP/s, HBM "
        f"{s.get('hbmGBps', 0):.0f} GB/s, {doc.get('durationS')} s",
    )


LAYER_TIMES = ROOT / "e2e" / "device" / "layer_times.py"
#: The models whose layer times calibrate the cost model (layer_times.py; bench/sim_calibration.py compares).
LAYER_MODELS = ("llama-3-8b", "llama-3-70b")
LAYER_BUDGET_S = 90.0


def step_layers(run: Run) -> None:
    """2b. one decoder layer's prefill and decode times per micro-batch (``layer_times.py``), after the
    probe let go of the card: the figures the roofline predicts (``bench/sim_calibration.py`` compares)."""
    argv = [run.python, str(LAYER_TIMES), "--budget-s", f"{LAYER_BUDGET_S:g}"]
    argv += [str(ROOT / "examples" / "models" / f"{m}.json") for m in LAYER_MODELS]
    run.log(f"layers: {shlex.join(argv)}")
    if run.dry_run:
        return
    rc, out, err = _capture(argv, LAYER_BUDGET_S + 60, env=_sub_env())
    doc = None
    for line in reversed(out.splitlines()):
        if line.startswith("{"):
            with contextlib.suppress(ValueError):
                doc = json.loads(line)
                break
    if rc != 0 or doc is None or "error" in doc:
        run.fail("layers", f"exit {rc}: {(doc or {}).get('error') or _tail(err, 600)}")
        return
    run.results["layerTimes"] = doc
    run.step("layers", f"ok: {', '.join(doc['models'])} in {doc.get('seconds')} s")


# ------------------------------------------------------------------------------------------- 3. model


def model_cache_dir(run: Run, flag: str | None) -> Path:
    """Where the tiny model goes: ``--model-cache DIR``; ``container``: the container's cache path (the
    operator's ``HF_HOME``, so that env stays as written; run.sh passes it on the device machine only);
    default: under the work directory."""
    from gearshift.k8s.engine import HF_CACHE_DIR

    if flag == "container":
        return Path(HF_CACHE_DIR)
    return Path(flag) if flag else run.work / "hf"


def start_model(run: Run, cache: Path) -> subprocess.Popen[str] | None:
    argv = [run.python, str(BUILD_MODEL), str(cache)]
    run.log(f"model: CUDA_VISIBLE_DEVICES= {shlex.join(argv)}")
    if run.dry_run:
        return None
    cache.mkdir(parents=True, exist_ok=True)
    # On the CPU (it is 4 layers of hidden 128), off the GPU the probe is measuring.
    env = _sub_env({"CUDA_VISIBLE_DEVICES": ""}, drop_pythonpath=True)
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def finish_model(run: Run, proc: subprocess.Popen[str] | None, t_start: float) -> bool:
    if proc is None:
        return True
    try:
        out, _ = proc.communicate(timeout=max(10.0, MODEL_TIMEOUT_S - (time.monotonic() - t_start)))
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        run.fail("model", f"build_tiny_model.py did not finish in {MODEL_TIMEOUT_S:g} s")
        return False
    if proc.returncode != 0:
        run.fail("model", f"build_tiny_model.py exit {proc.returncode}: {_tail(out, 600)}")
        return False
    run.results["model"] = {"seconds": round(time.monotonic() - t_start, 1), "output": _tail(out, 300)}
    run.step("model", f"ok: {_tail(out, 200)}")
    return True


# ------------------------------------------------------------------------------------------- 4. render


def gpu_variant(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """examples/vllm/tiny-llama.yaml as for a GPU cluster: the edits of :data:`VARIANT`."""
    out = copy.deepcopy(docs)
    for d in out:
        spec = d.get("spec") or {}
        if d.get("kind") == "PDService":
            spec["model"]["dtype"] = "bfloat16"
            spec["kvBufferDevice"] = "cuda"
        elif d.get("kind") == "GearSet":
            for gear in spec.get("gears") or []:
                for st in gear.get("stages") or []:
                    st["nodes"] = [re.sub(r"^gpu-[a-z0-9]+-", f"gpu-{POOL}-", n) for n in st.get("nodes", [])]
                    st["gpuModel"] = GPU_MODEL
    return out


def render_containers(run: Run) -> dict[tuple[str, str, int], dict[str, Any]]:
    """``gearshift render`` of the GPU variant: ``{(role, gear, stage): {statefulSet, labels, container}}``
    (ordinal 0 of each stage StatefulSet)."""
    import yaml

    from gearshift.k8s import names

    docs = [d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d]
    with tempfile.TemporaryDirectory(prefix="gearshift-device-render-") as tmp:
        fleet = Path(tmp) / "fleet.yaml"
        variant = Path(tmp) / "tiny-llama-gpu.yaml"
        fleet.write_text(yaml.safe_dump(FLEET, sort_keys=False))
        variant.write_text(yaml.safe_dump_all(gpu_variant(docs), sort_keys=False))
        argv = [run.python, "-m", "gearshift.cli", "render", "--fleet", str(fleet), "-f", str(variant)]
        argv += ["--all-gears", "--no-gearsets", "-o", "json"]
        run.log(f"render: {shlex.join(argv)}")
        rc, out, err = _capture(argv, 120, _sub_env())
    if rc != 0:
        raise CheckFailed(f"gearshift render exit {rc}: {_tail(err, 800)}")
    found: dict[tuple[str, str, int], dict[str, Any]] = {}
    for obj in json.loads(out)["items"]:
        if obj.get("kind") != "StatefulSet":
            continue
        tpl = obj["spec"]["template"]
        labels = tpl["metadata"]["labels"]
        key = (labels[names.LABEL_ROLE], labels[names.LABEL_GEAR], int(labels[names.LABEL_STAGE]))
        engine = next(c for c in tpl["spec"]["containers"] if c["name"] == "engine")
        found[key] = {"statefulSet": obj["metadata"]["name"], "labels": labels, "container": engine}
    return found


@dataclass
class PodCmd:
    """One emulated pod: its name, loopback IP, and the expanded command line and env of its engine."""

    name: str
    ip: str
    argv: list[str]
    env: dict[str, str]
    """The container's env as the kubelet builds it, with the harness's changes (not the inherited env)."""
    changes: dict[str, Any]

    @property
    def url(self) -> str:
        from gearshift.k8s.engine import ENGINE_PORT

        return f"http://{self.ip}:{ENGINE_PORT}"


def pod_command(
    rendered: dict[str, Any],
    ip: str,
    head_ip: str,
    vllm_cmd: list[str],
    cache: Path,
    mem_util: float,
    suffix: str = "",
) -> PodCmd:
    """The local command line of ordinal 0 of a rendered StatefulSet, as the kubelet would expand it
    (``gearshift.dev.sandbox.podspec``: env in order with ``$(VAR)``, downward-API fields), plus the harness's
    changes (module docstring)."""
    from gearshift.dev.sandbox.podspec import container_env, expand
    from gearshift.k8s.engine import HF_CACHE_DIR, POD_INDEX_LABEL

    c = rendered["container"]
    name = f"{rendered['statefulSet']}-0{suffix}"
    pod = {
        "metadata": {
            "name": name,
            "namespace": "default",
            "labels": {**rendered["labels"], POD_INDEX_LABEL: "0"},
        },
        "spec": {"nodeName": "device"},
        "status": {"podIP": ip, "hostIP": ip},
    }
    env = container_env(pod, c, lambda kind, ns, n: None)
    changes: dict[str, Any] = {}
    if "GEARSHIFT_MASTER_ADDR" in env:
        changes["GEARSHIFT_MASTER_ADDR"] = [env["GEARSHIFT_MASTER_ADDR"], head_ip]
        env["GEARSHIFT_MASTER_ADDR"] = head_ip
    if env.get("HF_HOME") == HF_CACHE_DIR and cache != Path(HF_CACHE_DIR):
        changes["HF_HOME"] = [env["HF_HOME"], str(cache)]
        env["HF_HOME"] = str(cache)
    elif "HF_HOME" not in env:
        env["HF_HOME"] = str(cache)
        changes["HF_HOME"] = [None, str(cache)]
    args = [expand(str(a), env) for a in [*c["command"][1:], *c.get("args", [])]]
    if c["command"][0] != "vllm":
        raise CheckFailed(f"{name}: the container runs {c['command'][0]!r}, not vllm")
    i = args.index("--gpu-memory-utilization")
    changes["--gpu-memory-utilization"] = [args[i + 1], f"{mem_util:g}"]
    args[i + 1] = f"{mem_util:g}"
    env.update(HARNESS_ENV)
    env["NCCL_HOSTID"] = name
    return PodCmd(name, ip, [*vllm_cmd, *args], env, changes)


# ------------------------------------------------------------------------------------------- engines


class Engine:
    """One ``vllm serve`` process this script started, in its own process group (its children with it)."""

    registry: ClassVar[list[Engine]] = []

    def __init__(self, run: Run, pod: PodCmd) -> None:
        self.run, self.pod = run, pod
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = run.work / "logs" / f"{pod.name}.log"

    def start(self) -> None:
        self.run.log(f"start {self.pod.name} on {self.pod.ip}: {shlex.join(self.pod.argv)}")
        if self.run.dry_run:
            env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.pod.env.items())
            self.run.log(f"  env of {self.pod.name}: {env}")
            return
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = _sub_env(self.pod.env, drop_pythonpath=True)
        with open(self.log_path, "wb") as logf:
            self.proc = subprocess.Popen(
                self.pod.argv,
                stdout=logf,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=self.run.work,
                start_new_session=True,
            )
        Engine.registry.append(self)
        # run.sh kills these groups should this script itself be killed (each is a new session, which the
        # device tool would otherwise leave running until the machine goes back).
        with open(self.run.work / "engine-pgids", "a") as f:
            f.write(f"{self.proc.pid}\n")

    def exited(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def log_tail(self, n: int = 2500) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGTERM to the group (vLLM shuts its engine core and workers down), SIGKILL after the grace."""
        if self.proc is None or (self.proc.poll() is not None and not _group_alive(self.proc.pid)):
            return
        self.run.log(f"stop {self.pod.name} (pid {self.proc.pid})")
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        while time.monotonic() < deadline and (self.proc.poll() is None or _group_alive(self.proc.pid)):
            time.sleep(0.25)
        if self.proc.poll() is None or _group_alive(self.proc.pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)
            t = time.monotonic()
            while _group_alive(self.proc.pid) and time.monotonic() - t < 10:
                time.sleep(0.25)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Replica:
    """The pods of one pipeline replica of a gear: the head (serves HTTP) and its headless ranks."""

    def __init__(self, run: Run, label: str, pods: list[PodCmd]) -> None:
        self.run, self.label = run, label
        self.engines = [Engine(run, p) for p in pods]
        self.t_start = 0.0
        self.startup_s: float | None = None

    @property
    def url(self) -> str:
        return self.engines[0].pod.url

    def start(self) -> None:
        self.t_start = time.monotonic()
        for e in self.engines:
            e.start()

    def wait_ready(self, timeout: float) -> float | None:
        """Seconds from start until the head's ``/health`` answers 200 (the pod's readiness probe).

        Raises:
            CheckFailed: a process exited, or the timeout passed (with the logs' tails).
        """
        if self.run.dry_run:
            self.run.log(f"wait for GET {self.url}/health = 200 (at most {timeout:.0f} s)")
            return None
        deadline = self.t_start + timeout
        while time.monotonic() < deadline:
            for e in self.engines:
                rc = e.exited()
                if rc is not None:
                    raise CheckFailed(f"{e.pod.name} exited {rc} while starting:\n{e.log_tail()}")
            if _health(self.url):
                self.startup_s = round(time.monotonic() - self.t_start, 2)
                self.run.log(f"{self.label} Ready after {self.startup_s} s")
                return self.startup_s
            time.sleep(0.5)
        tails = "\n".join(f"--- {e.pod.name}:\n{e.log_tail(1500)}" for e in self.engines)
        raise CheckFailed(f"{self.label} not Ready after {timeout:.0f} s:\n{tails}")

    def stop(self) -> None:
        for e in reversed(self.engines):
            e.stop()


def _health(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
            return resp.status == 200
    except (OSError, urllib.error.URLError):
        return False


def stop_all() -> None:
    for e in reversed(Engine.registry):
        with contextlib.suppress(Exception):
            e.stop()


# ------------------------------------------------------------------------------------------- HTTP


def post(
    url: str, body: dict[str, Any], headers: dict[str, str] | None = None, timeout: float = REQUEST_TIMEOUT_S
) -> tuple[int, Any]:
    h = {"Content-Type": "application/json", **(headers or {})}
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=h, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
            status = resp.status
    except urllib.error.HTTPError as exc:
        raw, status = exc.read(), exc.code
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")[:500]


def get_text(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read().decode()


def completion_body(served: str, prompt: str, max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    # Greedy and a fixed length: random weights may sample EOS early, which would compare less.
    return {"model": served, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


def complete(url: str, served: str, prompt: str, max_tokens: int = MAX_TOKENS) -> str:
    status, body = post(f"{url}/v1/completions", completion_body(served, prompt, max_tokens))
    if status != 200 or not isinstance(body, dict):
        raise CheckFailed(f"POST {url}/v1/completions: {status} {str(body)[:300]}")
    return str(body["choices"][0]["text"])


def greedy(run: Run, replica: Replica, served: str) -> list[str]:
    if run.dry_run:
        for p in PROMPTS:
            run.log(f"POST {replica.url}/v1/completions {json.dumps(completion_body(served, p))}")
        return []
    return [complete(replica.url, served, p) for p in PROMPTS]


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels`` (Prometheus text format).

    The sandbox's ``vllm_service.metric`` uses prometheus_client's parser; the device machine has no
    prometheus_client and nothing can be installed there beyond the carried wheels, hence this copy."""
    total = 0.0
    for line in text.splitlines():
        m = re.match(r"^([^{ #]+)(\{([^}]*)\})?\s+(\S+)", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(3) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(m.group(4))
    return total


# ------------------------------------------------------------------------------------------- 5. shift


class ClientLoop:
    """Worker threads sending greedy completions back to back to the current target URL."""

    def __init__(self, served: str, workers: int = 2) -> None:
        self.served = served
        self.target = ""
        self.stop_ev = threading.Event()
        self.lock = threading.Lock()
        self.records: list[dict[str, Any]] = []
        self.threads = [threading.Thread(target=self._work, args=(w,), daemon=True) for w in range(workers)]

    def start(self, target: str) -> None:
        self.target = target
        for t in self.threads:
            t.start()

    def _work(self, worker: int) -> None:
        i = 0
        while not self.stop_ev.is_set():
            target = self.target
            t0 = time.monotonic()
            try:
                status, body = post(
                    f"{target}/v1/completions", completion_body(self.served, PROMPTS[i % len(PROMPTS)], 8)
                )
                ok, why = status == 200, "" if status == 200 else f"{status} {str(body)[:200]}"
            except Exception as exc:  # any failure counts: the point is 0 of them
                ok, why = False, repr(exc)[:200]
            rec = {"worker": worker, "t0": t0, "t1": time.monotonic(), "target": target, "ok": ok, "why": why}
            with self.lock:
                self.records.append(rec)
            i += 1

    def ok_on(self, target: str) -> list[dict[str, Any]]:
        with self.lock:
            return [r for r in self.records if r["target"] == target and r["ok"]]

    def moved(self, target: str) -> bool:
        """Every worker has finished a request it sent to ``target``: none is in flight anywhere else."""
        return {r["worker"] for r in self.ok_on(target)} == set(range(len(self.threads)))

    def finish(self) -> None:
        self.stop_ev.set()
        for t in self.threads:
            t.join(timeout=REQUEST_TIMEOUT_S + 5)


def _wait(pred: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.1)
    raise CheckFailed(f"{what}: not within {timeout:.0f} s")


def step_shift(run: Run, old: Replica, shadow: Replica, served: str, reference: list[str]) -> None:
    """(d): the shadow gear starts beside the serving one, the client loop moves over once it is Ready."""
    if run.dry_run:
        run.log(f"client loop (2 workers) -> {old.url}; then start the shadow:")
        shadow.start()
        shadow.wait_ready(START_TIMEOUT_S)
        run.log(f"switch the loop to {shadow.url}; once no request is in flight on {old.url}, stop it")
        greedy(run, shadow, served)
        run.step("shift", "ok")
        return
    loop = ClientLoop(served)
    loop.start(old.url)
    try:
        _wait(lambda: len(loop.ok_on(old.url)) >= 3, 60, "3 requests on the first engine")
        t_spawn = time.monotonic()
        shadow.start()
        ready_s = shadow.wait_ready(min(START_TIMEOUT_S, run.left()))
        t_switch = time.monotonic()
        loop.target = shadow.url
        # Nothing in flight on the old engine once every worker has been answered by the new one.
        _wait(lambda: loop.moved(shadow.url), 60, "every client worker answered by the shadow")
        first_new = min(r["t1"] for r in loop.ok_on(shadow.url))
        old.stop()
        n = len(loop.ok_on(shadow.url))
        _wait(lambda: len(loop.ok_on(shadow.url)) >= n + 5, 60, "5 more requests on the shadow")
    finally:
        loop.finish()
    with loop.lock:
        recs = sorted(loop.records, key=lambda r: r["t1"])
    failed = [r["why"] for r in recs if not r["ok"]]
    ends = [r["t1"] for r in recs if r["ok"]]
    gaps = [b - a for a, b in itertools.pairwise(ends)]
    out = {
        "seconds": round(first_new - t_spawn, 2),
        "shadowReadyS": ready_s,
        "switchToFirstResponseS": round(first_new - t_switch, 3),
        "requests": len(recs),
        "requestsOnOld": len(loop.ok_on(old.url)),
        "requestsOnNew": len(loop.ok_on(shadow.url)),
        "failed": len(failed),
        "failedExamples": failed[:5],
        "maxGapBetweenResponsesS": round(max(gaps), 3) if gaps else None,
    }
    run.results["shift"] = out
    after = greedy(run, shadow, served)
    run.results.setdefault("greedyEqual", {})["shadowPp1VsPp1"] = after == reference
    if failed:
        raise CheckFailed(f"{len(failed)} failed requests during the shift: {failed[:3]}")
    if after != reference:
        raise CheckFailed(f"the shadow's greedy output differs: {after} vs {reference}")
    run.step("shift", f"ok: {out['seconds']} s from start to the first answer on the new engine, 0 failed")


# ------------------------------------------------------------------------------------------- 7. PD


def pd_request(run: Run, prefill: Replica, decode: Replica, served: str, prompt: str) -> dict[str, Any]:
    """One request through vLLM's toy-proxy protocol; returns the KV figures and the decode text."""
    from gearshift.router.legs import decode_leg_body, leg_headers, prefill_leg_body

    body = completion_body(served, prompt)
    rid = uuid.uuid4().hex
    pleg = prefill_leg_body(body, chat=False)
    if run.dry_run:
        run.log(f"POST {prefill.url}/v1/completions X-Request-Id={rid} {json.dumps(pleg)}")
        rest = "<the client's body + prefill's kv_transfer_params>"
        run.log(f"POST {decode.url}/v1/completions X-Request-Id={rid} {rest}")
        return {}
    name = "vllm:prompt_tokens_by_source_total"
    before = get_text(f"{decode.url}/metrics")
    status, presp = post(f"{prefill.url}/v1/completions", pleg, leg_headers(rid), timeout=120)
    if status != 200 or not isinstance(presp, dict):
        raise CheckFailed(f"prefill leg: {status} {str(presp)[:300]}")
    ktp = presp.get("kv_transfer_params")
    if not ktp:
        raise CheckFailed(f"prefill answered no kv_transfer_params: {str(presp)[:300]}")
    status, dresp = post(f"{decode.url}/v1/completions", decode_leg_body(body, presp), leg_headers(rid), 120)
    if status != 200 or not isinstance(dresp, dict):
        raise CheckFailed(f"decode leg: {status} {str(dresp)[:300]}")
    after = get_text(f"{decode.url}/metrics")
    ext = metric(after, name, source="external_kv_transfer") - metric(
        before, name, source="external_kv_transfer"
    )
    local = metric(after, name, source="local_compute") - metric(before, name, source="local_compute")
    prompt_tokens = int(dresp.get("usage", {}).get("prompt_tokens", 0))
    return {
        "promptTokens": prompt_tokens,
        "externalKvTransferTokens": ext,
        "localComputeTokens": local,
        "kvTransferParams": {k: ktp.get(k) for k in ("remote_host", "remote_port", "remote_engine_id")},
        # vLLM recomputes the last prompt token locally (it needs logits); the rest came over NIXL.
        "moved": ext > 0 and ext >= prompt_tokens - 1,
        "text": dresp["choices"][0]["text"],
    }


def step_pd(run: Run, label: str, prefill: Replica, decode: Replica, served: str, ref_pd: str | None) -> None:
    kv = pd_request(run, prefill, decode, served, PD_PROMPTS[label])
    if run.dry_run:
        run.step(f"pd-{label}", "ok")
        return
    run.results.setdefault("kv", {})[label] = {k: v for k, v in kv.items() if k != "text"}
    equal = kv["text"] == ref_pd
    run.results.setdefault("greedyEqual", {})[f"pd{label.capitalize()}VsPp1"] = equal
    if not kv["moved"]:
        raise CheckFailed(
            f"decode counted {kv['externalKvTransferTokens']} external_kv_transfer tokens of a "
            f"{kv['promptTokens']}-token prompt ({kv['localComputeTokens']} computed locally)"
        )
    if not equal:
        raise CheckFailed(f"PD output {kv['text']!r} differs from one engine's {ref_pd!r}")
    run.step(
        f"pd-{label}",
        f"ok: {kv['externalKvTransferTokens']:.0f} of {kv['promptTokens']} prompt tokens arrived over NIXL",
    )


# ------------------------------------------------------------------------------------------- main


@contextlib.contextmanager
def step_guard(run: Run, name: str, need_s: float, stop: tuple[Replica, ...] = ()) -> Iterator[bool]:
    """Run a step if ``need_s`` seconds are left; record a failure instead of raising, and then stop the
    ``stop`` replicas that did not become Ready at once (a half-started engine must not free its memory
    while the next one starts: vLLM's profiling asserts free memory did not grow)."""
    if not run.dry_run and run.left() < need_s:
        run.step(name, f"skipped: {run.left():.0f} s left, needs {need_s:.0f}")
        yield False
        return
    try:
        yield True
    except (CheckFailed, OSError, KeyError, ValueError) as exc:
        run.fail(name, f"{type(exc).__name__}: {exc}"[:4000])
        for r in stop:
            if r.startup_s is None:
                r.stop()


#: Each emulated pod's own loopback IP (every 127.x address is on lo), so the ports the operator writes
#: (8000, NIXL 5600, rendezvous 29500) stay as written, as in the sandbox.
IPS = {
    "pp1": "127.0.1.1",
    "pp1-shadow": "127.0.1.2",
    "pp2-s0": "127.0.2.1",
    "pp2-s1": "127.0.2.2",
    "d1": "127.0.3.1",
}


@dataclass
class Plan:
    served: str
    pp1: Replica
    shadow: Replica
    pp2: Replica
    d1: Replica

    @property
    def replicas(self) -> list[Replica]:
        return [self.pp1, self.shadow, self.pp2, self.d1]


def plan_engines(run: Run, vllm_cmd: list[str], cache: Path, mem_util: float) -> Plan:
    """Render, then the emulated pods of the engines the check starts; recorded in ``render``."""
    rendered = render_containers(run)
    args = rendered[("prefill", "pp1", 0)]["container"]["args"]
    served = args[args.index("--served-model-name") + 1]

    def pod(key: tuple[str, str, int], ip: str, head: str, suffix: str = "") -> PodCmd:
        return pod_command(rendered[key], ip, head, vllm_cmd, cache, mem_util, suffix)

    plan = Plan(
        served,
        Replica(run, "prefill/pp1", [pod(("prefill", "pp1", 0), IPS["pp1"], IPS["pp1"])]),
        Replica(
            run,
            "prefill/pp1 (shadow)",
            [pod(("prefill", "pp1", 0), IPS["pp1-shadow"], IPS["pp1-shadow"], "-shadow")],
        ),
        Replica(
            run,
            "prefill/pp2",
            [
                pod(("prefill", "pp2", 0), IPS["pp2-s0"], IPS["pp2-s0"]),
                pod(("prefill", "pp2", 1), IPS["pp2-s1"], IPS["pp2-s0"]),
            ],
        ),
        Replica(run, "decode/d1", [pod(("decode", "d1", 0), IPS["d1"], IPS["d1"])]),
    )
    pods = {}
    for r in plan.replicas:
        for e in r.engines:
            p = e.pod
            pods[p.name] = {"ip": p.ip, "argv": p.argv, "env": p.env, "harnessChanges": p.changes}
    run.results["render"] = {"variant": VARIANT, "fleet": FLEET, "pods": pods}
    run.results["harness"] = {
        "env": HARNESS_ENV,
        "NCCL_HOSTID": "the pod's name (one host id per pod)",
        "gpuMemoryUtilization": mem_util,
    }
    if run.out:
        (run.out / "rendered.json").write_text(json.dumps(run.results["render"], indent=1) + "\n")
    run.step("render", f"ok: {len(pods)} engine pods from gearshift render")
    return plan


def run_engines(run: Run, plan: Plan) -> None:
    """Steps 5-7 (module docstring), in an order where no engine stops while another one starts: vLLM's
    memory profiling asserts that the card's free memory did not grow while it measured."""
    a, a2, b, d, served = plan.pp1, plan.shadow, plan.pp2, plan.d1, plan.served
    startup = run.results.setdefault("startupS", {})
    reference: list[str] = []
    ref_pd: dict[str, str] = {}

    with step_guard(run, "reference", 60, (a,)) as go:
        if go:
            a.start()
            startup[a.label] = a.wait_ready(min(START_TIMEOUT_S, run.left()))
            reference = greedy(run, a, served)
            if not run.dry_run:
                ref_pd = {k: complete(a.url, served, p) for k, p in PD_PROMPTS.items()}
            run.results["reference"] = reference
            run.step("reference", f"ok: {reference}")
    if not reference and not run.dry_run:
        run.step("shift", "skipped: no reference engine")
    else:
        with step_guard(run, "shift", 90, (a2,)) as go:
            if go:
                step_shift(run, a, a2, served, reference)
                startup[a2.label] = a2.startup_s
    a.stop()
    with step_guard(run, "pipeline", 90, (b,)) as go:
        if go:
            b.start()
            startup[b.label] = b.wait_ready(min(START_TIMEOUT_S, run.left()))
            out = greedy(run, b, served)
            if not run.dry_run:
                run.results.setdefault("greedyEqual", {})["pp2VsPp1"] = out == reference
                run.results["pipelineOutput"] = out
                if out != reference:
                    raise CheckFailed(f"two-stage greedy output {out} differs from one stage's {reference}")
            run.step("pipeline", "ok: pp2 (layers 3,1, --nnodes 2) greedy output equals pp1's")
    with step_guard(run, "pd", 80, (d,)) as go:
        if go:
            d.start()
            startup[d.label] = d.wait_ready(min(START_TIMEOUT_S, run.left()))
            for label, prefill in (("pp1", a2), ("pp2", b)):
                up = prefill.startup_s is not None and all(e.exited() is None for e in prefill.engines)
                if not (run.dry_run or up):
                    run.step(f"pd-{label}", f"skipped: {prefill.label} is not running")
                    continue
                with step_guard(run, f"pd-{label}", 15) as go2:
                    if go2:
                        step_pd(run, label, prefill, d, served, ref_pd.get(label))
    for r in reversed(plan.replicas):
        r.stop()


def write_results(run: Run) -> None:
    run.results["wallS"] = round(run.elapsed(), 1)
    run.results["failures"] = run.failures
    text = json.dumps(run.results, indent=1, default=str) + "\n"
    if run.dry_run:
        run.log("dry run: no results written (device.json is written on the device machine only)")
        return
    if run.out:
        (run.out / "device.json").write_text(text)
        logs = sorted((run.work / "logs").glob("*.log")) if (run.work / "logs").is_dir() else []
        with open(run.out / "engines.log", "w") as f:
            for p in logs:
                f.write(f"===== {p.name} (last 200 lines)\n")
                f.writelines(p.read_text(errors="replace").splitlines(keepends=True)[-200:])
    run.log(f"wrote {run.out / 'device.json' if run.out else 'nothing (no --out)'}")


def summary(run: Run) -> None:
    r = run.results
    print("\n== gearshift device check ==", flush=True)
    print(f"  gpu      {r.get('host', {}).get('gpu')} torch {r.get('host', {}).get('torch')} "
          f"cuda {r.get('host', {}).get('cuda')}")  # fmt: skip
    v = r.get("vllm", {})
    print(f"  vllm     {v.get('status')} {v.get('vllm') or ''} ({v.get('found')})")
    for k, s in (r.get("steps") or {}).items():
        print(f"  {k:<10} {s[:160]}")
    for k in ("startupS", "greedyEqual", "kv", "shift"):
        if k in r:
            print(f"  {k:<10} {json.dumps(r[k], default=str)[:300]}")
    print(f"  failures {len(run.failures)}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="render for real, print every other command")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="results folder (default $OUT)")
    ap.add_argument("--work", default=None, help="logs, pids, model cache (default: a new temporary folder)")
    ap.add_argument("--budget-s", type=float, default=480.0, help="the whole check's time, s")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.15, help="per engine (4 run at once)")
    ap.add_argument(
        "--model-cache",
        default=None,
        help="HF_HOME of the tiny model: DIR, or container (the pods' own path)",
    )
    ap.add_argument("--skip-probe", action="store_true", help="no probe (a rerun with less device time)")
    ap.add_argument("--skip-layers", action="store_true", help="no layer times (layer_times.py)")
    ap.add_argument("--gearshift-install", default="PYTHONPATH", help="how run.sh installed gearshift")
    args = ap.parse_args(argv)

    if args.dry_run:
        work = Path(tempfile.gettempdir()) / "gearshift-device-dry-run"  # named in output, never created
    else:
        work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="gearshift-device-"))
        work.mkdir(parents=True, exist_ok=True)
    out = Path(args.out) if args.out and not args.dry_run else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    run = Run(args.dry_run, out, work, sys.executable, time.monotonic(), args.budget_s)
    run.results.update(
        {
            "schemaVersion": 1,
            "check": "gearshift e2e/device/check.py",
            "startedAt": datetime.now(UTC).isoformat(timespec="seconds"),
            "gearshiftInstall": args.gearshift_install,
            "budgetS": args.budget_s,
        }
    )

    def on_term(signum: int, frame: Any) -> None:
        raise Interrupted(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    try:
        import pydantic  # noqa: F401  (gearshift's API models, render and the probe's report need it)
    except ImportError:
        print("pydantic: missing (run bash e2e/device/fetch-wheels.sh here; carry e2e/device/wheels)")
        run.fail("setup", "pydantic missing: gearshift cannot import")
        write_results(run)
        return 4
    code = 0
    try:
        vllm_cmd, _ = step_versions(run)
        cache = model_cache_dir(run, args.model_cache)
        run.results["modelCache"] = str(cache)
        probe = None if args.skip_probe else start_probe(run)
        t_model = time.monotonic()
        model = start_model(run, cache)
        model_ok = finish_model(run, model, t_model)
        finish_probe(run, probe)
        if not args.skip_layers:
            step_layers(run)
        # Rendered in every case: the argument lists are recorded even where no vLLM can run them.
        plan = plan_engines(run, vllm_cmd or ["vllm"], cache, args.gpu_memory_utilization)
        if vllm_cmd is None:
            why = f"vllm: {run.results['vllm'].get('status')} ({run.results['vllm'].get('found')})"
            if run.dry_run:
                run.log(f"{why}; the vLLM steps as they would run, `vllm` standing for the command:")
                run_engines(run, plan)
            for name in ("reference", "shift", "pipeline", "pd"):
                run.step(name, f"skipped: {why}")
            code = 3
        elif not model_ok:
            run.step("vllm", "skipped: the tiny model was not built")
        else:
            run_engines(run, plan)
    except Interrupted as exc:
        run.fail("interrupted", f"{exc} at {run.elapsed():.0f} s (run.sh's timeout)")
    except Exception as exc:  # recorded, and the results written, whatever broke
        run.fail("error", f"{type(exc).__name__}: {exc}"[:4000])
    finally:
        stop_all()
        summary(run)
        write_results(run)
    if run.failures:
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main())
