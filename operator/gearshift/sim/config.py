"""The simulated engine's configuration from the pod contract's environment variables (docs/ARCHITECTURE.md).

Pure: reads a mapping (``os.environ`` or a pod entry of a ``--pods`` file), never the process itself.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from gearshift.facts.gpus import GPU_SPECS
from gearshift.facts.model import ModelArch, ModelConfigError, arch_from_hf_config, load_hf_config
from gearshift.sim.engine import ROLES
from gearshift.sim.perfmodel import (
    DEFAULT_LINK,
    Link,
    PerfParams,
    Pipeline,
    PipelineConfigError,
    parse_pipeline,
)


class SimConfigError(ValueError):
    """A configuration value the simulated engine cannot use; names the variable and the fix."""


@dataclass(frozen=True)
class SimConfig:
    """Everything one simulated pod needs."""

    host: str
    port: int
    role: str
    stage: int
    arch: ModelArch
    served_model_name: str
    pipeline: Pipeline
    kv_link: Link = DEFAULT_LINK
    params: PerfParams = field(default_factory=PerfParams)
    max_model_len: int | None = None
    worker: bool = False

    @property
    def listen(self) -> str:
        return f"{self.host}:{self.port}"


def _json(env: Mapping[str, str], key: str) -> Any:
    raw = env.get(key)
    if raw is None or raw.strip() == "":
        return None
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        raise SimConfigError(f"{key} is not valid JSON ({exc.msg} at char {exc.pos})") from None


def _model(env: Mapping[str, str]) -> ModelArch:
    raw = env.get("GEARSHIFT_MODEL", "").strip()
    if not raw:
        raise SimConfigError(
            "GEARSHIFT_MODEL is not set: give the JSON of ModelArch.to_dict(), an HF config.json mapping, "
            "or a path to an HF config.json (e.g. examples/models/llama-3-8b.json)"
        )
    try:
        if raw.startswith("{"):
            doc = _json(env, "GEARSHIFT_MODEL")
            if "num_layers" in doc:
                return ModelArch(**doc)
            return arch_from_hf_config(doc)
        if not Path(raw).is_file():
            raise SimConfigError(f"GEARSHIFT_MODEL: no such file {raw!r}")
        return load_hf_config(raw)
    except (ModelConfigError, TypeError) as exc:
        raise SimConfigError(f"GEARSHIFT_MODEL: {exc}") from None


def _int(env: Mapping[str, str], key: str, default: int, low: int = 0) -> int:
    raw = env.get(key)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise SimConfigError(f"{key} must be an integer, got {raw!r}") from None
    if value < low:
        raise SimConfigError(f"{key} must be >= {low}, got {value}")
    return value


def _float(env: Mapping[str, str], key: str, default: float) -> float:
    raw = env.get(key)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise SimConfigError(f"{key} must be a number, got {raw!r}") from None
    if not 0 < value <= 1:
        raise SimConfigError(f"{key} must be in (0, 1], got {value}")
    return value


def on_own_card(pipe_doc: dict[str, Any], stage: int, card: str) -> dict[str, Any]:
    """The pipeline document with stage ``stage`` timed on ``card``, the GPU the pod really runs on.

    A replicated stage's pods land on several nodes, possibly of different models (the planner sizes
    a stage over e.g. an A10, an A100 and an H100, and names the slowest card in ``gpu``). A real engine
    runs as fast, and holds as much KV cache, as the card under it, so the sandbox's pod runner tells
    the pod its node's card (``GEARSHIFT_SANDBOX_GPU_MODEL``, the node's ``gearshift.io/gpu-model``) and
    that card wins for the pod's own stage. The other stages keep the planned card: a pod cannot see
    which nodes its peers landed on. ``card`` empty or not a :mod:`gearshift.facts.gpus` name: unchanged.
    """
    stages = pipe_doc.get("stages")
    if not card or card not in GPU_SPECS or not isinstance(stages, list) or not 0 <= stage < len(stages):
        return pipe_doc
    if not isinstance(stages[stage], Mapping) or stages[stage].get("gpu") == card:
        return pipe_doc
    own = {**stages[stage], "gpu": card}
    return {**pipe_doc, "stages": [*stages[:stage], own, *stages[stage + 1 :]]}


def config_from_env(env: Mapping[str, str]) -> SimConfig:
    """Read a :class:`SimConfig` from the ``GEARSHIFT_*`` variables of the pod contract.

    Besides the documented ones: ``GEARSHIFT_KV_LINK`` (JSON ``{"gbps": .., "latencyUs": ..}``, the link
    KV caches arrive over on a decode pod; default 200 Gb/s), ``GEARSHIFT_MAX_MODEL_LEN`` (tokens; at
    most the model's ``max_position_embeddings`` unless ``VLLM_ALLOW_LONG_MAX_MODEL_LEN=1``, as in vLLM),
    ``GEARSHIFT_SIM_MFU``, ``GEARSHIFT_SIM_MBU`` (efficiency constants, see :mod:`perfmodel`),
    ``GEARSHIFT_WORKER`` (``1``: a stage k>0 pod), ``GEARSHIFT_SANDBOX_GPU_MODEL`` (the card the pod runs
    on; see :func:`on_own_card`).

    Raises:
        SimConfigError: naming the variable and what it must hold.
    """
    role = env.get("GEARSHIFT_ROLE", "both")
    if role not in ROLES:
        raise SimConfigError(f"GEARSHIFT_ROLE must be one of {', '.join(ROLES)}, got {role!r}")
    arch = _model(env)
    default_pipe = {"stages": [{"layers": [0, arch.num_layers], "gpu": "H100-80GB"}]}
    pipe_doc = _json(env, "GEARSHIFT_PIPELINE") or default_pipe
    profile = _json(env, "GEARSHIFT_GPU_PROFILE")
    if not isinstance(pipe_doc, dict):
        raise SimConfigError("GEARSHIFT_PIPELINE must be a JSON object with 'stages'")
    stage = _int(env, "GEARSHIFT_STAGE", 0)
    pipe_doc = on_own_card(pipe_doc, stage, env.get("GEARSHIFT_SANDBOX_GPU_MODEL", ""))
    if profile is not None and not isinstance(profile, list):
        raise SimConfigError("GEARSHIFT_GPU_PROFILE must be a JSON list, one object per stage")
    try:
        pipeline = parse_pipeline(pipe_doc, arch, profile)
    except PipelineConfigError as exc:
        raise SimConfigError(f"GEARSHIFT_PIPELINE: {exc}") from None
    link_doc = _json(env, "GEARSHIFT_KV_LINK")
    kv_link = DEFAULT_LINK
    if link_doc is not None:
        try:
            kv_link = Link(float(link_doc["gbps"]), float(link_doc.get("latencyUs", 10.0)))
        except (KeyError, TypeError, ValueError):
            raise SimConfigError('GEARSHIFT_KV_LINK must be {"gbps": <Gb/s>, "latencyUs": <µs>}') from None
    if stage >= len(pipeline.stages):
        raise SimConfigError(f"GEARSHIFT_STAGE {stage} is past the pipeline's {len(pipeline.stages)} stages")
    params = replace(
        PerfParams(),
        mfu=_float(env, "GEARSHIFT_SIM_MFU", PerfParams.mfu),
        mbu=_float(env, "GEARSHIFT_SIM_MBU", PerfParams.mbu),
    )
    max_len = _int(env, "GEARSHIFT_MAX_MODEL_LEN", 0)
    limit = arch.max_position_embeddings
    # vLLM refuses a max_model_len above the model's own unless VLLM_ALLOW_LONG_MAX_MODEL_LEN is set
    # (_get_and_verify_max_len, vllm/config/model.py; the variable read as vllm/envs.py reads it).
    allow_long = env.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "0").strip().lower() in ("1", "true")
    if limit and max_len > limit and not allow_long:
        raise SimConfigError(
            f"GEARSHIFT_MAX_MODEL_LEN (--max-model-len) {max_len} is above the model's context length, "
            f"max_position_embeddings={limit} in its config: give at most {limit} (vLLM refuses it too "
            "unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 is set)"
        )
    return SimConfig(
        host=env.get("GEARSHIFT_HOST", "127.0.0.1"),
        port=_int(env, "GEARSHIFT_PORT", 8000, low=0),
        role=role,
        stage=stage,
        arch=arch,
        served_model_name=env.get("GEARSHIFT_SERVED_MODEL_NAME") or arch.name,
        pipeline=pipeline,
        kv_link=kv_link,
        params=params,
        max_model_len=max_len or None,
        worker=env.get("GEARSHIFT_WORKER", "") in ("1", "true", "True") or stage > 0,
    )
