"""kwok configuration of the sandbox: which pods kwok fakes and which it leaves to the local pod runner.

kwokctl takes Stage documents through ``--config``; when any are given they *replace* its defaults
(kwok v0.8.0, ``pkg/kwokctl/runtime/cluster.go``), so we pass kwok's own defaults — the ``fast`` pod
stages and the node stages kwokctl would pick, copied out of kwok's module by ``e2e/sandbox/build.sh`` —
with one change: every default pod stage skips pods labelled ``gearshift.io/sandbox-run: "true"``. For
those pods two stages of ours apply instead:

  - ``gearshift-run-assign``: give the pod its IP from the node's podCIDR and leave it ``Pending`` and not
    Ready, with its containers waiting; the pod runner starts the process and reports the rest;
  - ``gearshift-run-delete-fallback``: when the runner is not there to finish a deletion, kwok deletes
    the pod after ``RUN_DELETE_FALLBACK_MS`` so namespaces can still be removed.

Pure: documents in, documents out.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from gearshift.dev.sandbox.nodes import SANDBOX_RUN_LABEL

#: kwok's default stage files, as ``build.sh`` copies them (kwok ``kustomize/stage/...``).
DEFAULT_STAGE_FILES = (
    "node-initialize.yaml",
    "node-heartbeat-with-lease.yaml",
    "pod-ready.yaml",
    "pod-complete.yaml",
    "pod-delete.yaml",
)
#: How long kwok waits for the runner to finish a deletion before it deletes the pod itself, ms.
RUN_DELETE_FALLBACK_MS = 30_000
#: kwok's selector key (a jq query) for the opt-in label.
RUN_LABEL_QUERY = f'.metadata.labels["{SANDBOX_RUN_LABEL}"]'

_NOT_OPTED_IN = {"key": RUN_LABEL_QUERY, "operator": "NotIn", "values": ["true"]}
_OPTED_IN = {"key": RUN_LABEL_QUERY, "operator": "In", "values": ["true"]}

_ASSIGN_TEMPLATE = """\
{{ $now := Now }}
conditions:
- lastTransitionTime: {{ $now | Quote }}
  status: "True"
  type: Initialized
- lastTransitionTime: {{ $now | Quote }}
  status: "False"
  reason: ContainersNotReady
  message: "the gearshift sandbox pod runner has not started the container yet"
  type: Ready
- lastTransitionTime: {{ $now | Quote }}
  status: "False"
  reason: ContainersNotReady
  type: ContainersReady
containerStatuses:
{{ range .spec.containers }}
- image: {{ .image | Quote }}
  name: {{ .name | Quote }}
  ready: false
  restartCount: 0
  started: false
  state:
    waiting:
      reason: ContainerCreating
      message: "waiting for the gearshift sandbox pod runner"
{{ end }}
hostIP: {{ NodeIPWith .spec.nodeName | Quote }}
podIP: {{ PodIPWith .spec.nodeName ( or .spec.hostNetwork false ) ( or .metadata.uid "" ) \
( or .metadata.name "" ) ( or .metadata.namespace "" ) | Quote }}
phase: Pending
startTime: {{ $now | Quote }}
"""


class StageError(ValueError):
    """kwok's default stages are missing or not what we expect; rebuilding the binaries fixes it."""


def load_default_stages(stages_dir: Path) -> list[dict[str, Any]]:
    """Read kwok's default Stage documents from ``stages_dir``.

    Raises:
        StageError: a file is missing or is not a kwok Stage (run ``bash e2e/sandbox/build.sh``).
    """
    out = []
    for name in DEFAULT_STAGE_FILES:
        path = stages_dir / name
        try:
            doc = yaml.safe_load(path.read_text())
        except OSError as exc:
            raise StageError(
                f"{path}: {exc}; run `bash e2e/sandbox/build.sh` to copy kwok's stages"
            ) from None
        if not isinstance(doc, dict) or doc.get("kind") != "Stage":
            raise StageError(f"{path} is not a kwok Stage; rerun `bash e2e/sandbox/build.sh`")
        out.append(doc)
    return out


def sandbox_stages(defaults: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """kwok's default stages with pod stages restricted to pods that did not opt in, plus ours.

    Args:
        defaults: kwok Stage documents (``load_default_stages``); not modified.
    Returns:
        The Stage documents to give kwokctl.
    """
    out = []
    for stage in defaults:
        stage = copy.deepcopy(stage)
        if stage["spec"]["resourceRef"].get("kind") == "Pod":
            selector = stage["spec"].setdefault("selector", {})
            selector.setdefault("matchExpressions", []).append(dict(_NOT_OPTED_IN))
        out.append(stage)
    out.append(_stage("gearshift-run-assign", [
        dict(_OPTED_IN),
        {"key": ".metadata.deletionTimestamp", "operator": "DoesNotExist"},
        {"key": ".status.podIP", "operator": "DoesNotExist"},
    ], {"statusTemplate": _ASSIGN_TEMPLATE}))  # fmt: skip
    fallback = _stage("gearshift-run-delete-fallback", [
        dict(_OPTED_IN),
        {"key": ".metadata.deletionTimestamp", "operator": "Exists"},
    ], {"finalizers": {"empty": True}, "delete": True})  # fmt: skip
    fallback["spec"]["delay"] = {"durationMilliseconds": RUN_DELETE_FALLBACK_MS}
    out.append(fallback)
    return out


def _stage(name: str, exprs: list[dict[str, Any]], nxt: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "kwok.x-k8s.io/v1alpha1",
        "kind": "Stage",
        "metadata": {"name": name},
        "spec": {
            "resourceRef": {"apiGroup": "v1", "kind": "Pod"},
            "selector": {"matchExpressions": exprs},
            "next": nxt,
        },
    }


def kwok_configuration(octet: int) -> dict[str, Any]:
    """kwok-controller's configuration: pods on nodes without a podCIDR still get loopback IPs.

    ``127.<octet>.255.0/24`` is outside every node's podCIDR (``nodes.node_pod_cidr`` uses .1-.254).
    """
    return {
        "apiVersion": "config.kwok.x-k8s.io/v1alpha1",
        "kind": "KwokConfiguration",
        "options": {
            "cidr": f"127.{octet}.255.0/24",
            "nodeIP": f"127.{octet}.0.254",
            # A KwokConfiguration given to kwokctl is not defaulted (kwok v0.8.0), so kwok's defaults
            # (``zz_generated.defaults.go``) are spelled out.
            "podPlayStageParallelism": 4,
            "nodePlayStageParallelism": 4,
            "nodeLeaseParallelism": 4,
            "podsOnNodeSyncParallelism": 1,
            "enablePodsOnNodeSyncListPager": True,
            "enablePodsOnNodeSyncStreamWatch": False,
            "enableDebuggingHandlers": True,
            "enableContentionProfiling": False,
            "enableProfilingHandler": True,
        },
    }


def kwokctl_configuration(binaries: dict[str, Path], kube_version: str) -> dict[str, Any]:
    """kwokctl's configuration: binary runtime, every binary a local path (nothing is downloaded).

    Args:
        binaries: paths of ``kube-apiserver``, ``kube-controller-manager``, ``kube-scheduler``,
            ``kubectl``, ``etcd`` and ``kwok``.
        kube_version: the Kubernetes version of those binaries (kwokctl picks flags by it).
    """
    return {
        "apiVersion": "config.kwok.x-k8s.io/v1alpha1",
        "kind": "KwokctlConfiguration",
        "options": {
            "runtime": "binary",
            # Every component listens on loopback only (kwokctl's default is 0.0.0.0).
            "bindAddress": "127.0.0.1",
            "kubeVersion": kube_version,
            "kubeApiserverBinary": str(binaries["kube-apiserver"]),
            "kubeControllerManagerBinary": str(binaries["kube-controller-manager"]),
            "kubeSchedulerBinary": str(binaries["kube-scheduler"]),
            "kubectlBinary": str(binaries["kubectl"]),
            "etcdBinary": str(binaries["etcd"]),
            "kwokControllerBinary": str(binaries["kwok"]),
            # The controllers' client-side rate limits only slow a one-machine cluster down.
            "disableQPSLimits": True,
        },
        # The API server reaches a node's kubelet (``kubectl logs``/``exec``) by the first address type
        # it finds; the default order starts with Hostname, which it would resolve through the host's
        # DNS server -- traffic off loopback. The fake nodes' InternalIPs are loopback addresses.
        # One controller manager and one scheduler: leader election only adds a way to die. Under load
        # (real vLLM processes on 2 cores) a lease renewal outlasted its 10 s deadline, both logged
        # "leaderelection lost" and exited, and nothing restarts a kwokctl binary component.
        "componentsPatches": [
            {
                "name": "kube-apiserver",
                "extraArgs": [{"key": "kubelet-preferred-address-types", "value": "InternalIP"}],
            },
            {"name": "kube-controller-manager", "extraArgs": [{"key": "leader-elect", "value": "false"}]},
            {"name": "kube-scheduler", "extraArgs": [{"key": "leader-elect", "value": "false"}]},
        ],
    }
