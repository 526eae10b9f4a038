"""What a PDService's engine pods run with: extra ``vllm serve`` arguments (``spec.engineArgs``, refused
where they set a flag the operator owns: :data:`OPERATOR_OWNED_FLAGS`, :func:`owned_flag`), CPU and memory
(``spec.resources``), the model cache (``spec.modelCache``) and the Hugging Face token's Secret
(``spec.hfTokenSecret``).
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import ConfigDict, Field, model_validator

from gearshift.api.common import SpecModel

#: A Kubernetes resource quantity (``k8s.io/apimachinery`` resource.Quantity's regular expression).
QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)"
    r"|(\.[0-9]+))))?$"
)
#: A DNS subdomain (Secret and PersistentVolumeClaim names).
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
#: A Secret data key (``k8s.io/apimachinery`` IsConfigMapKey).
SECRET_KEY_PATTERN = r"^[-._a-zA-Z0-9]+$"
#: Bounds of ``spec.engineArgs`` (they also keep the CRD's CEL cost finite).
MAX_ENGINE_ARGS = 64
MAX_ENGINE_ARG_LENGTH = 256

#: ``vllm serve`` flags the operator writes itself, with where the value comes from (the fix a refusal
#: names). Flag names as vLLM 0.32's parser spells them (``vllm/engine/arg_utils.py`` EngineArgs;
#: ``vllm/entrypoints/launchers/cli_args.py`` for ``--headless`` and FrontendArgs' ``--host``/``--port``);
#: vLLM also reads ``_`` for ``-`` in names, ``--flag=value``, dotted ``--flag.key value`` for JSON flags
#: (``vllm/utils/argparse_utils.py``) and unambiguous abbreviations (argparse ``allow_abbrev``).
#: tests/unit/test_vllm_args.py checks every name against vLLM's parser.
OPERATOR_OWNED_FLAGS: dict[str, str] = {
    "--host": "the pod IP (env GEARSHIFT_POD_IP from the downward API)",
    "--port": "the engine port 8000 the Services, probes and Prometheus annotations use",
    "--served-model-name": "spec.model.name",
    "--model": "spec.model.name (the positional model of `vllm serve`)",
    "--tensor-parallel-size": "the gear's stages[].gpus",
    "--pipeline-parallel-size": "the number of stages of the gear",
    "--nnodes": "the number of stages of the gear (one pod per stage)",
    "--node-rank": "the pod's stage index",
    "--master-addr": "the head pod's DNS name through the gear's headless Service",
    "--master-port": "the operator's rendezvous port 29500",
    "--headless": "stages k > 0 of a multi-stage gear",
    "--distributed-executor-backend": "mp, the multi-node backend the operator runs without Ray",
    "--kv-transfer-config": "the role (prefill: kv_producer, decode: kv_consumer) and spec.kvBufferDevice",
    "--dtype": "spec.model.dtype, pinned per pipeline (float16 on a pipeline with a card lacking bfloat16)",
    "--max-num-seqs": "the gear's maxBatch (GearSet spec.gears[].maxBatch)",
    "--max-num-batched-tokens": "the gear's microBatch x 2048 (GearSet spec.gears[].microBatch)",
    "--gpu-memory-utilization": "the GearSet's spec.plan.constraints.memoryUtilization",
}
#: Short aliases vLLM 0.32 gives some of them (``vllm/engine/arg_utils.py``).
OPERATOR_OWNED_SHORT_FLAGS: dict[str, str] = {
    "-tp": "--tensor-parallel-size",
    "-pp": "--pipeline-parallel-size",
    "-n": "--nnodes",
    "-r": "--node-rank",
}
#: The same refusal as a regular expression for the CRD (RE2): exact names with ``_`` read as ``-``,
#: ``=value`` and dotted sub-keys; the operator's validator also refuses abbreviations.
_OWNED_RE = (
    "^(--("
    + "|".join(f.removeprefix("--") for f in OPERATOR_OWNED_FLAGS)
    + ")([=.].*)?|-("
    + "|".join(f.removeprefix("-") for f in OPERATOR_OWNED_SHORT_FLAGS)
    + ")([=0-9].*)?)$"
)


def owned_flag(arg: str) -> str | None:
    """The operator-owned ``vllm serve`` flag ``arg`` sets, or None (a value or another flag).

    Reads ``arg`` as vLLM's FlexibleArgumentParser does (``vllm/utils/argparse_utils.py``): the name is
    what lies between ``--`` and the first ``=`` or ``.``, with ``_`` read as ``-``; a strict prefix of an
    owned flag counts (argparse resolves unambiguous abbreviations, and refuses ambiguous ones anyway).
    """
    if arg.startswith("--"):
        name = "--" + arg[2:].split("=", 1)[0].split(".", 1)[0].replace("_", "-")
        if name in OPERATOR_OWNED_FLAGS:
            return name
        if len(name) > 2:
            hits = [f for f in OPERATOR_OWNED_FLAGS if f.startswith(name)]
            if hits:
                return hits[0]
        return None
    for short, flag in OPERATOR_OWNED_SHORT_FLAGS.items():
        rest = arg[len(short) :]
        if arg.startswith(short) and (rest == "" or rest[0] == "=" or rest[0].isdigit()):
            return flag
    return None


#: CRD rules per model (see :mod:`gearshift.api.gearset` for the convention, ``messageExpression`` too).
CEL: dict[str, list[dict[str, str]]] = {
    "ModelCache": [
        {
            "rule": "has(self.hostPath) != has(self.claimName)",
            "message": "modelCache: give exactly one of hostPath (a node directory) or claimName (a "
            "PersistentVolumeClaim)",
            "reason": "FieldValueInvalid",
        },
    ],
    "EngineArg": [
        {
            "rule": f"!self.replace('_', '-').matches('{_OWNED_RE}')",
            "message": "spec.engineArgs: this flag is set by the operator (its value comes from the gear, "
            "the role or another spec field); remove it from spec.engineArgs",
            "messageExpression": "'spec.engineArgs: %s is set by the operator (its value comes from the "
            "gear, the role or another spec field); remove it from spec.engineArgs'.format([self])",
        },
    ],
}


def _cel(name: str) -> dict[str, Any]:
    return {"x-kubernetes-validations": CEL[name]}


class HFTokenSecret(SpecModel):
    """A Secret holding a Hugging Face access token (gated models): the engine gets it as ``HF_TOKEN``."""

    name: str = Field(
        min_length=1,
        max_length=253,
        pattern=DNS_SUBDOMAIN_PATTERN,
        description="Secret name (same namespace).",
    )
    key: str = Field(
        default="token",
        min_length=1,
        max_length=253,
        pattern=SECRET_KEY_PATTERN,
        description="Key in the Secret's data holding the token (vLLM's Kubernetes guide uses token).",
    )


class ModelCache(SpecModel):
    """Where the engines keep the Hugging Face cache, shared by every gear so a shift reuses the download.

    Mounted at ``/root/.cache/huggingface`` (the vLLM image's cache, as vLLM's Kubernetes guide
    docs/deployment/k8s.md mounts it) with ``HF_HOME`` pointing there. A claim shared by pods on several
    nodes needs an access mode that allows it (ReadWriteMany, or ReadOnlyMany when filled beforehand).
    """

    model_config = ConfigDict(json_schema_extra=_cel("ModelCache"))

    host_path: str | None = Field(
        default=None,
        min_length=1,
        max_length=4096,
        pattern=r"^/",
        description="Absolute directory on each node (hostPath, created when missing).",
    )
    claim_name: str | None = Field(
        default=None,
        min_length=1,
        max_length=253,
        pattern=DNS_SUBDOMAIN_PATTERN,
        description="PersistentVolumeClaim in the PDService's namespace.",
    )

    @model_validator(mode="after")
    def _exactly_one(self) -> ModelCache:
        if (self.host_path is None) == (self.claim_name is None):
            raise ValueError(
                "modelCache: give exactly one of hostPath (a node directory) or claimName (a "
                "PersistentVolumeClaim)"
            )
        return self


def _quantity(what: str) -> Any:
    return Field(
        default=None,
        json_schema_extra={"pattern": QUANTITY_PATTERN},
        description=f"{what}: request of each vLLM engine container, a Kubernetes quantity; unset: the "
        "operator's default (gearshift.k8s.engine).",
    )


class EngineResources(SpecModel):
    """CPU and memory requests of the vLLM engine containers (GPUs come from the gear's stages)."""

    cpu: int | str | None = _quantity("CPU, cores (e.g. 6 or 5500m); unset: 2 + the pod's GPUs")
    memory: int | str | None = _quantity("Memory, bytes (e.g. 16Gi); unset: 6G")

    @model_validator(mode="after")
    def _quantities(self) -> EngineResources:
        for name in ("cpu", "memory"):
            value = getattr(self, name)
            if isinstance(value, int) and value < 0:
                raise ValueError(f"resources.{name} must not be negative, got {value}")
            if isinstance(value, str) and (value[:1] == "-" or not re.fullmatch(QUANTITY_PATTERN, value)):
                raise ValueError(
                    f"resources.{name} {value!r} is not a Kubernetes quantity (e.g. '4', '500m', '16Gi')"
                )
        return self


def check_engine_args(args: list[str]) -> None:
    for i, arg in enumerate(args):
        flag = owned_flag(arg)
        if flag is not None:
            raise ValueError(
                f"spec.engineArgs[{i}] {arg!r}: {flag} is set by the operator from "
                f"{OPERATOR_OWNED_FLAGS[flag]}; remove it from spec.engineArgs"
            )


EngineArg = Annotated[
    str,
    Field(min_length=1, max_length=MAX_ENGINE_ARG_LENGTH, json_schema_extra=_cel("EngineArg")),
]
