"""The sandbox's local pod runner and Prometheus: opted-in pods run as local processes on their pod IPs.

The pods run ``gearshift sandbox echo-server`` / ``exit-with`` (test programs of the sandbox CLI); all HTTP
goes to pod IPs, which are loopback addresses.
"""

from __future__ import annotations

import ipaddress
import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from gearshift.sim.perfmodel import PerfParams

RUN = {"gearshift.io/sandbox-run": "true"}
CPU = {"gearshift.io/node-pool": "cpu"}


@pytest.fixture(autouse=True)
def _only_sandbox(sandbox):
    if not sandbox.is_sandbox:
        pytest.skip("the local pod runner exists only in the gearshift sandbox")


def _get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    assert ipaddress.ip_address(url.split("//")[1].split(":")[0]).is_loopback
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return int(resp.status), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _echo_deployment(name: str, ready_after: float = 0.0, replicas: int = 1) -> dict:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {
                    "labels": {"app": name, **RUN},
                    "annotations": {"prometheus.io/scrape": "true", "prometheus.io/port": "8000"},
                },
                "spec": {
                    "nodeSelector": CPU,
                    "terminationGracePeriodSeconds": 5,
                    "containers": [
                        {
                            "name": "echo",
                            "image": "gearshift-worker:dev",
                            "command": ["gearshift", "sandbox", "echo-server"],
                            "args": ["--port", "$(ECHO_PORT)", "--ready-after", str(ready_after)],
                            "ports": [{"name": "http", "containerPort": 8000}],
                            "env": [
                                {"name": "ECHO_PORT", "value": "8000"},
                                {
                                    "name": "POD_NAME",
                                    "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}},
                                },
                                {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                                {
                                    "name": "NODE_NAME",
                                    "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}},
                                },
                                {
                                    "name": "ECHO_APP",
                                    "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}},
                                },
                                {"name": "ECHO_URL", "value": "http://$(POD_IP):$(ECHO_PORT)/"},
                            ],
                            "readinessProbe": {
                                "httpGet": {"path": "/health", "port": "http"},
                                "periodSeconds": 1,
                                "failureThreshold": 1,
                            },
                        }
                    ],
                },
            },
        },
    }


def _pods(sandbox, namespace, selector):
    return [
        p
        for p in sandbox.kubectl_json("get", "pods", "-n", namespace, "-l", selector)["items"]
        if not p["metadata"].get("deletionTimestamp")
    ]


def _ready(pod) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions", []))


def _pid(pod) -> int:
    cid = pod["status"]["containerStatuses"][0]["containerID"]
    assert cid.startswith("gearshift-sandbox://"), cid
    return int(cid.rsplit("/", 1)[1])


def test_pod_ready_only_once_its_server_answers(sandbox, namespace, wait_for):
    # The server answers /health with 503 for its first 6 s: listening is not yet ready.
    sandbox.apply(_echo_deployment("echo", ready_after=6.0), namespace)
    pod = wait_for(
        lambda: next(
            (p for p in _pods(sandbox, namespace, "app=echo") if p["status"].get("phase") == "Running"), None
        ),
        60,
        "the echo pod to run",
    )
    ip = pod["status"]["podIP"]
    status, _ = wait_for(lambda: _get(f"http://{ip}:8000/health"), 30, "the echo server to listen")
    assert status == 503
    assert not _ready(sandbox.kubectl_json("get", "pod", pod["metadata"]["name"], "-n", namespace))
    pod = wait_for(
        lambda: next((p for p in _pods(sandbox, namespace, "app=echo") if _ready(p)), None),
        60,
        "the pod to be Ready",
    )
    assert _get(f"http://{ip}:8000/health")[0] == 200
    # The process serves on the pod IP with the pod's env resolved (downward API and $(VAR) expansion).
    status, body = _get(f"http://{ip}:8000/")
    assert status == 200
    echo = json.loads(body)
    assert echo["host"] == ip and echo["port"] == 8000
    env = echo["env"]
    assert env["POD_NAME"] == pod["metadata"]["name"]
    assert env["POD_IP"] == ip == env["GEARSHIFT_POD_IP"] == env["GEARSHIFT_HOST"]
    assert env["NODE_NAME"] == pod["spec"]["nodeName"]
    assert env["ECHO_APP"] == "echo"
    assert env["ECHO_URL"] == f"http://{ip}:8000/"
    wait_for(
        lambda: (
            sandbox.kubectl_json("get", "deploy", "echo", "-n", namespace)["status"].get("readyReplicas") == 1
        ),
        30,
        "the Deployment to count the Ready pod",
    )


def test_prometheus_scrapes_an_annotated_pod(sandbox, namespace, wait_for):
    assert sandbox.prometheus_url and sandbox.prometheus_url.startswith("http://127.0.0.1:")
    sandbox.apply(_echo_deployment("scraped"), namespace)
    pod = wait_for(
        lambda: next((p for p in _pods(sandbox, namespace, "app=scraped") if _ready(p)), None),
        60,
        "a Ready pod",
    )
    name = pod["metadata"]["name"]
    sel = f'namespace="{namespace}",pod="{name}"'
    # One scrape can fail on a loaded machine (up 0, e.g. a scrape timeout); the next one must succeed.
    up = wait_for(
        lambda: (r := sandbox.prometheus_query(f"up{{{sel}}}")) and r[0]["value"][1] == "1" and r,
        60,
        "Prometheus to scrape the pod successfully (up == 1)",
    )
    assert up[0]["metric"]["instance"] == f"{pod['status']['podIP']}:8000"
    assert up[0]["metric"]["app"] == "scraped"
    series = wait_for(
        lambda: sandbox.prometheus_query(f'gearshift_echo_requests_total{{{sel},path="/health"}}'),
        30,
        "the pod's own metric",
    )
    assert float(series[0]["value"][1]) >= 1


def test_job_pod_reports_exit_code_and_termination_message(sandbox, namespace, wait_for):
    def job(name: str, code: int, message: str) -> dict:
        return {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": name},
            "spec": {
                "backoffLimit": 0,
                "template": {
                    "metadata": {"labels": RUN},
                    "spec": {
                        "restartPolicy": "Never",
                        # On a GPU node but without a GPU request: others' pods may hold the shared
                        # sandbox's GPUs.
                        "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-A10"},
                        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
                        "containers": [
                            {
                                "name": "probe",
                                "image": "gearshift-worker:dev",
                                "command": ["gearshift"],
                                "args": ["sandbox", "exit-with", "--code", str(code), "--message", message],
                            }
                        ],
                    },
                },
            },
        }

    sandbox.apply([job("ok", 0, "measured 65 TFLOPS"), job("bad", 3, "probe failed: no GPU")], namespace)

    def finished(name: str, phase: str):
        pods = _pods(sandbox, namespace, f"job-name={name}")
        return pods[0] if pods and pods[0]["status"].get("phase") == phase else None

    ok = wait_for(lambda: finished("ok", "Succeeded"), 60, "the ok Job pod to succeed")
    term = ok["status"]["containerStatuses"][0]["state"]["terminated"]
    assert (term["exitCode"], term["reason"], term["message"]) == (0, "Completed", "measured 65 TFLOPS")
    bad = wait_for(lambda: finished("bad", "Failed"), 60, "the bad Job pod to fail")
    term = bad["status"]["containerStatuses"][0]["state"]["terminated"]
    assert (term["exitCode"], term["reason"], term["message"]) == (3, "Error", "probe failed: no GPU")
    wait_for(
        lambda: sandbox.kubectl_json("get", "job", "ok", "-n", namespace)["status"].get("succeeded") == 1,
        30,
        "the Job to count its success",
    )


def test_deleting_a_pod_stops_its_process_and_the_replacement_runs(sandbox, namespace, wait_for):
    sandbox.apply(_echo_deployment("doomed"), namespace)
    pod = wait_for(
        lambda: next((p for p in _pods(sandbox, namespace, "app=doomed") if _ready(p)), None),
        60,
        "a Ready pod",
    )
    pid, ip, name = _pid(pod), pod["status"]["podIP"], pod["metadata"]["name"]
    assert Path(f"/proc/{pid}").exists()
    sandbox.kubectl("delete", "pod", name, "-n", namespace, "--wait=false")
    wait_for(lambda: not Path(f"/proc/{pid}").exists() or _zombie(pid), 20, f"process {pid} to stop")
    wait_for(
        lambda: sandbox.kubectl("get", "pod", name, "-n", namespace, check=False).returncode != 0,
        20,
        "the pod object to go",
    )
    new = wait_for(
        lambda: next((p for p in _pods(sandbox, namespace, "app=doomed") if _ready(p)), None),
        60,
        "the replacement pod to be Ready",
    )
    assert new["metadata"]["uid"] != pod["metadata"]["uid"]
    new_ip = new["status"]["podIP"]
    assert _get(f"http://{new_ip}:8000/health")[0] == 200
    if new_ip != ip:
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://{ip}:8000/health", timeout=1)


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


def test_crashing_container_restarts_with_backoff(sandbox, namespace, wait_for):
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "crasher", "labels": RUN},
        "spec": {
            "nodeSelector": CPU,
            "containers": [
                {
                    "name": "c",
                    "image": "gearshift-worker:dev",
                    "command": ["gearshift", "sandbox", "exit-with", "--code", "7", "--message", "boom"],
                }
            ],
        },
    }
    sandbox.apply(pod, namespace)

    def restarted_twice():
        cs = (
            sandbox.kubectl_json("get", "pod", "crasher", "-n", namespace)["status"].get("containerStatuses")
            or []
        )
        return cs[0] if cs and cs[0].get("restartCount", 0) >= 2 else None

    cs = wait_for(restarted_twice, 60, "two restarts")
    assert cs["lastState"]["terminated"]["exitCode"] == 7
    assert cs["lastState"]["terminated"]["message"] == "boom"
    assert cs["ready"] is False


def test_disallowed_command_fails_with_a_clear_message(sandbox, namespace, wait_for):
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "sneaky", "labels": RUN},
        "spec": {
            "restartPolicy": "Never",
            "nodeSelector": CPU,
            "containers": [{"name": "c", "image": "busybox", "command": ["/bin/sh", "-c", "echo hi"]}],
        },
    }
    sandbox.apply(pod, namespace)
    failed = wait_for(
        lambda: (
            (p := sandbox.kubectl_json("get", "pod", "sneaky", "-n", namespace))["status"].get("phase")
            == "Failed"
            and p
        ),
        30,
        "the pod to fail",
    )
    msg = failed["status"]["containerStatuses"][0]["state"]["terminated"]["message"]
    assert "/bin/sh" in msg and "not allowed" in msg and "gearshift-sim" in msg


def sim_statefulset(
    name: str,
    model: Path,
    placement: dict[str, Any],
    *,
    env: list[dict[str, str]] | None = None,
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A 2-pod StatefulSet of ``gearshift-sim`` (Llama-3-8B served as ``llama3-8b``) run by the sandbox's pod
    runner on GPU nodes (the GPU taint tolerated); ``placement`` is merged into the pod spec."""
    meta: dict[str, Any] = {"labels": {"app": name, **RUN}}
    if annotations:
        meta["annotations"] = annotations
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": name},
        "spec": {
            "replicas": 2,
            "serviceName": name,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": meta,
                "spec": {
                    **placement,
                    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
                    "containers": [
                        {
                            "name": "engine",
                            "image": "gearshift-worker:dev",
                            "command": ["gearshift-sim"],
                            "env": [
                                {"name": "GEARSHIFT_MODEL", "value": str(model)},
                                {"name": "GEARSHIFT_SERVED_MODEL_NAME", "value": "llama3-8b"},
                                *(env or []),
                            ],
                            "ports": [{"name": "http", "containerPort": 8000}],
                            "readinessProbe": {
                                "httpGet": {"path": "/health", "port": "http"},
                                "periodSeconds": 2,
                            },
                        }
                    ],
                },
            },
        },
    }


def test_simulated_engine_statefulset_serves_and_is_scraped(sandbox, namespace, wait_for):
    """The pod contract end to end with the real ``gearshift-sim`` (docs/ARCHITECTURE.md)."""
    model = Path(__file__).resolve().parents[2] / "examples" / "models" / "llama-3-8b.json"
    sts = sim_statefulset(
        "sim",
        model,
        {"nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-A10"}},
        annotations={"prometheus.io/scrape": "true", "prometheus.io/port": "8000"},
    )
    sandbox.apply(sts, namespace)
    wait_for(
        lambda: (
            sandbox.kubectl_json("get", "sts", "sim", "-n", namespace)["status"].get("readyReplicas") == 2
        ),
        90,
        "2 Ready simulated-engine pods",
    )
    pods = _pods(sandbox, namespace, "app=sim")
    for pod in pods:
        ip = pod["status"]["podIP"]
        req = urllib.request.Request(
            f"http://{ip}:8000/v1/completions",
            data=json.dumps({"model": "llama3-8b", "prompt": "hello", "max_tokens": 4}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=30) as resp:
            body = json.loads(resp.read())
        assert body["usage"]["completion_tokens"] == 4
    series = wait_for(
        lambda: (
            (r := sandbox.prometheus_query(f'vllm:num_requests_running{{namespace="{namespace}"}}'))
            and len(r) == 2
            and r
        ),
        30,
        "vllm:num_requests_running of both pods in Prometheus",
    )
    assert {s["metric"]["pod"] for s in series} == {"sim-0", "sim-1"}


def _metric_samples(ip: str, name: str) -> list[tuple[dict[str, str], float]]:
    """The samples named ``name`` on the pod's own ``/metrics`` (HTTP to its loopback pod IP)."""
    from prometheus_client.parser import text_string_to_metric_families

    status, body = _get(f"http://{ip}:8000/metrics")
    assert status == 200, body[:300]
    return [
        (dict(s.labels), float(s.value))
        for fam in text_string_to_metric_families(body.decode())
        for s in fam.samples
        if s.name == name
    ]


def _ttft_s(ip: str, prompt_tokens: int) -> float:
    """The server-reported TTFT of one lone completion: the rise of its TTFT histogram's sum."""

    def ttft_sum() -> float:
        return sum(v for _, v in _metric_samples(ip, "vllm:time_to_first_token_seconds_sum"))

    before = ttft_sum()
    req = urllib.request.Request(
        f"http://{ip}:8000/v1/completions",
        data=json.dumps({"model": "llama3-8b", "prompt": [1] * prompt_tokens, "max_tokens": 1}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert json.loads(resp.read())["usage"]["prompt_tokens"] == prompt_tokens
    return ttft_sum() - before


def test_simulated_engine_pods_of_one_stage_run_as_the_card_under_them(sandbox, namespace, wait_for):
    """Two ``gearshift-sim`` pods of one StatefulSet whose pipeline names one card (A10-24GB) for the stage,
    placed one on an A10-24GB node and one on an H100-80GB node: each pod sizes its KV pool (and times its
    steps) on the card of its own node (the pod runner's ``GEARSHIFT_SANDBOX_GPU_MODEL``), not on the
    card the pipeline names (``gearshift.sim.config.on_own_card``)."""
    config = Path(__file__).resolve().parents[2] / "examples" / "models" / "llama-3-8b.json"
    cards = ("A10-24GB", "H100-80GB")
    by_card: dict[str, str] = {}
    for node in sorted(sandbox.kubectl_json("get", "nodes")["items"], key=lambda n: n["metadata"]["name"]):
        card = (node["metadata"].get("annotations") or {}).get("gearshift.io/gpu-model")
        ready = any(
            c["type"] == "Ready" and c["status"] == "True" for c in node["status"].get("conditions", [])
        )
        if card in cards and ready and not node["spec"].get("unschedulable"):
            by_card.setdefault(card, node["metadata"]["labels"]["kubernetes.io/hostname"])
    if set(by_card) != set(cards):
        pytest.skip(f"the sandbox's fleet lacks a Ready A10-24GB or H100-80GB node (found {by_card})")
    pipeline = {"stages": [{"layers": [0, 32], "gpu": "A10-24GB"}]}
    # One pod on the A10 node, one on the H100 node. No nvidia.com/gpu request: others' pods may hold the
    # shared sandbox's GPUs, and the pod runner passes the node's card to every pod on it.
    placement = {
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {
                            "matchExpressions": [
                                {
                                    "key": "kubernetes.io/hostname",
                                    "operator": "In",
                                    "values": sorted(by_card.values()),
                                }
                            ]
                        }
                    ]
                }
            },
            "podAntiAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": [
                    {
                        "labelSelector": {"matchLabels": {"app": "sim-own"}},
                        "topologyKey": "kubernetes.io/hostname",
                    }
                ]
            },
        },
        "terminationGracePeriodSeconds": 5,
    }
    sts = sim_statefulset(
        "sim-own",
        config,
        placement,
        env=[
            {"name": "GEARSHIFT_PIPELINE", "value": json.dumps(pipeline)},
            {"name": "GEARSHIFT_STAGE", "value": "0"},
        ],
    )
    sandbox.apply(sts, namespace)
    wait_for(
        lambda: (
            sandbox.kubectl_json("get", "sts", "sim-own", "-n", namespace)["status"].get("readyReplicas") == 2
        ),
        120,
        "2 Ready simulated-engine pods",
    )
    ip_of = {}
    for pod in _pods(sandbox, namespace, "app=sim-own"):
        card = next(c for c, n in by_card.items() if n == pod["spec"]["nodeName"])
        ip_of[card] = pod["status"]["podIP"]
    assert set(ip_of) == set(cards), f"the pods did not land one per card: {ip_of}"

    # The expected KV pool, from the datasheets and the model's config.json alone (vLLM's rule: what is
    # left of gpu_memory_utilization x the card's memory after the weights, in blocks of 16 tokens).
    cfg = json.loads(config.read_text())
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads, kv_heads, vocab = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]
    head_dim, dtype_bytes = h // heads, 2  # bfloat16
    layer_params = 2 * h * h + 2 * h * kv_heads * head_dim + 3 * h * inter + 2 * h  # q,o; k,v; MLP; 2 norms
    weights = dtype_bytes * (layers * layer_params + 2 * vocab * h)  # + embedding and untied LM head
    kv_per_token = 2 * kv_heads * head_dim * dtype_bytes * layers
    u = PerfParams().gpu_memory_utilization
    gib = 1024**3
    budget = {"A10-24GB": 24 * gib * u - weights, "H100-80GB": 80 * gib * u - weights}
    expected = {card: int(budget[card] // kv_per_token) // 16 for card in cards}

    blocks = {}
    for card, ip in ip_of.items():
        info = _metric_samples(ip, "vllm:cache_config_info")
        assert len(info) == 1, info
        labels, value = info[0]
        assert value == 1 and labels["block_size"] == "16", info
        blocks[card] = int(labels["num_gpu_blocks"])
    print(f"num_gpu_blocks measured {blocks}, expected {expected}")
    for card in cards:
        assert abs(blocks[card] - expected[card]) <= 1, (card, blocks, expected)
    ratio = budget["H100-80GB"] / budget["A10-24GB"]
    a10, h100 = blocks["A10-24GB"], blocks["H100-80GB"]
    # Each count is floored to whole blocks: the ratio of the counts is within (ratio + 1) / a10 of it.
    assert h100 / a10 == pytest.approx(ratio, abs=(ratio + 1) / a10), (blocks, ratio)

    # Timing on the own card: a 2000-token prefill takes ~0.46 s on an A10 and ~0.06 s on an H100
    # (roofline, mfu 0.5). The fastest of three lone requests per pod keeps scheduling noise out.
    ttft = {card: min(_ttft_s(ip, 2000) for _ in range(3)) for card, ip in ip_of.items()}
    print(f"server-reported TTFT, fastest of 3 (s): {ttft}")
    assert ttft["H100-80GB"] < ttft["A10-24GB"], ttft
