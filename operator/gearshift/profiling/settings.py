"""The operator's profiling settings (:class:`ProbeSettings`): how probe Jobs look, which nodes are GPU
nodes, the re-probe interval, the back-off and the probe kinds accepted, read from ``GEARSHIFT_*``
environment variables (:meth:`ProbeSettings.from_env`; a bad one raises
:class:`~gearshift.facts.errors.SettingsError`, naming it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from gearshift.facts.errors import SettingsError
from gearshift.k8s.probejob import ProbeJobConfig, ProbeJobError, tolerations_from_json
from gearshift.profiling.profiles import parse_selector


@dataclass(frozen=True)
class ProbeSettings:
    """The operator's profiling settings.

    Attributes:
        job: how probe Jobs look (namespace, image, sandbox, deadline, TTL).
        node_selector: label selector GPU nodes must match besides ``nvidia.com/gpu`` capacity ("" = all).
        reprobe_interval_s: seconds between scheduled re-probes of a Ready node, s (0 = never).
        backoff_base_s: first retry delay after a failed probe, s; doubles each failure.
        backoff_max_s: cap of the retry delay, s.
        expected_kinds: probe document kinds accepted (``cuda`` on a real cluster, ``simulated`` in the
            sandbox), so a CPU fallback never becomes a GPU node's profile.
    """

    job: ProbeJobConfig = field(default_factory=ProbeJobConfig)
    node_selector: str = ""
    reprobe_interval_s: float = 24 * 3600.0
    backoff_base_s: float = 30.0
    backoff_max_s: float = 1800.0
    expected_kinds: frozenset[str] = frozenset({"cuda"})

    def __post_init__(self) -> None:
        parse_selector(self.node_selector)
        if self.reprobe_interval_s < 0:
            raise SettingsError(f"reprobe interval must be >= 0 s, got {self.reprobe_interval_s}")
        if not 0 < self.backoff_base_s <= self.backoff_max_s:
            raise SettingsError(
                f"probe back-off must satisfy 0 < base ({self.backoff_base_s}) <= max ({self.backoff_max_s})"
            )

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> ProbeSettings:
        """Settings from environment variables (all optional):

        ``GEARSHIFT_SANDBOX`` (1/true: sandbox pods, simulated probe), ``GEARSHIFT_PROBE_NAMESPACE``
        (else ``GEARSHIFT_NAMESPACE``, else ``gearshift-system``), ``GEARSHIFT_PROBE_IMAGE``,
        ``GEARSHIFT_GPU_NODE_SELECTOR``, ``GEARSHIFT_REPROBE_INTERVAL_S``, ``GEARSHIFT_PROBE_BACKOFF_S``,
        ``GEARSHIFT_PROBE_BACKOFF_MAX_S``, ``GEARSHIFT_PROBE_DEADLINE_S``, ``GEARSHIFT_PROBE_TTL_S``,
        ``GEARSHIFT_PROBE_ARGS`` (space-separated), ``GEARSHIFT_PROBE_TOLERATIONS`` (JSON list),
        ``GEARSHIFT_PROBE_KINDS`` (comma-separated: cuda, cpu, simulated).

        Raises:
            SettingsError: a variable with a bad value (named, with what it must be).
        """

        def num(name: str, default: float) -> float:
            raw = env.get(name)
            if raw is None or raw == "":
                return default
            try:
                return float(raw)
            except ValueError:
                raise SettingsError(f"{name}={raw!r} must be a number of seconds") from None

        sandbox = env.get("GEARSHIFT_SANDBOX", "").lower() in ("1", "true", "yes")
        kinds_raw = env.get("GEARSHIFT_PROBE_KINDS") or ("simulated" if sandbox else "cuda")
        kinds = frozenset(k.strip() for k in kinds_raw.split(",") if k.strip())
        if not kinds <= {"cuda", "cpu", "simulated"}:
            raise SettingsError(
                f"GEARSHIFT_PROBE_KINDS={kinds_raw!r} must list cuda, cpu or simulated, comma-separated"
            )
        try:
            job = ProbeJobConfig(
                namespace=env.get("GEARSHIFT_PROBE_NAMESPACE")
                or env.get("GEARSHIFT_NAMESPACE")
                or ProbeJobConfig.namespace,
                image=env.get("GEARSHIFT_PROBE_IMAGE") or ProbeJobConfig.image,
                sandbox=sandbox,
                active_deadline_s=int(num("GEARSHIFT_PROBE_DEADLINE_S", ProbeJobConfig.active_deadline_s)),
                ttl_s=int(num("GEARSHIFT_PROBE_TTL_S", ProbeJobConfig.ttl_s)),
                probe_args=tuple((env.get("GEARSHIFT_PROBE_ARGS") or "").split()),
                tolerations=tolerations_from_json(env["GEARSHIFT_PROBE_TOLERATIONS"])
                if env.get("GEARSHIFT_PROBE_TOLERATIONS")
                else (),
            )
            return cls(
                job=job,
                node_selector=env.get("GEARSHIFT_GPU_NODE_SELECTOR", ""),
                reprobe_interval_s=num("GEARSHIFT_REPROBE_INTERVAL_S", cls.reprobe_interval_s),
                backoff_base_s=num("GEARSHIFT_PROBE_BACKOFF_S", cls.backoff_base_s),
                backoff_max_s=num("GEARSHIFT_PROBE_BACKOFF_MAX_S", cls.backoff_max_s),
                expected_kinds=kinds,
            )
        except ProbeJobError as exc:
            raise SettingsError(f"probe Job setting: {exc}") from None
        except ValueError as exc:
            if isinstance(exc, SettingsError):
                raise
            raise SettingsError(f"GEARSHIFT_GPU_NODE_SELECTOR: {exc}") from None
