#!/usr/bin/env bash
# Install the standard LLM benchmark clients that tests/e2e/test_client_tools.py runs against the router,
# into venvs cached outside the repository, keyed by version (e2e/sandbox/versions.env):
#   $GEARSHIFT_CACHE/bench-tools/guidellm-$GUIDELLM_VERSION-aiperf-$AIPERF_VERSION/venv   (Python 3.11)
#   $GEARSHIFT_CACHE/bench-tools/inference-perf-$INFERENCE_PERF_VERSION/venv             (Python >= 3.12)
# and the sandbox tiny model's tokenizer, built here (e2e/sandbox/build_tiny_model.py --tokenizer) as the
# hub repo gearshift/tiny-llama-tokenizer in the Hugging Face cache
#   $GEARSHIFT_CACHE/bench-tools/hf          (HF_HOME)
# so that the clients count tokens with no model hub. A warm cache makes this a no-op (an .installed
# marker per venv, written last).
#
# Why:
# - guidellm and aiperf resolve together (pip finds one set of versions that both accept), so they share
#   one venv. guidellm needs torch at run time (its data loader is torch's DataLoader); PyPI's torch is the
#   CUDA build (it runs on the CPU), pinned to VLLM_TORCH_VERSION so the project has one torch.
# - inference-perf 0.7.0 requires Python >= 3.12. It is installed only where one is found
#   ($BENCH_PYTHON312, python3.13/python3.12 on PATH, or pyenv's versions); elsewhere its test is skipped.
#
# Usage: e2e/sandbox/install-bench-tools.sh          # install what is missing; print name=path lines
#        e2e/sandbox/install-bench-tools.sh --print  # only print what is installed (no install)
# Output lines: guidellm=BIN, aiperf=BIN, inference-perf=BIN (when installed), hf_home=HF_HOME,
# tokenizer_id=gearshift/tiny-llama-tokenizer and tokenizer=DIR (its snapshot, to load as a local path).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=versions.env
source "$here/versions.env"
cache=${GEARSHIFT_CACHE:-$HOME/.cache/gearshift}
base=$cache/bench-tools
main_root=$base/guidellm-$GUIDELLM_VERSION-aiperf-$AIPERF_VERSION
ip_root=$base/inference-perf-$INFERENCE_PERF_VERSION
hf_home=$base/hf
tokenizer_id=gearshift/tiny-llama-tokenizer

report() {
  if [[ -f $main_root/.installed ]]; then
    echo "guidellm=$main_root/venv/bin"
    echo "aiperf=$main_root/venv/bin"
  fi
  [[ -f $ip_root/.installed ]] && echo "inference-perf=$ip_root/venv/bin"
  local ref=$hf_home/hub/models--${tokenizer_id/\//--}/refs/main
  if [[ -f $ref ]]; then
    echo "hf_home=$hf_home"
    echo "tokenizer_id=$tokenizer_id"
    echo "tokenizer=${ref%/refs/main}/snapshots/$(<"$ref")"
  fi
  return 0
}
if [[ ${1:-} == --print ]]; then
  report
  exit 0
fi

start=$(date +%s)
say() { printf '[bench-tools %4ds] %s\n' $(($(date +%s) - start)) "$*" >&2; }
pip_install() { "$1/bin/python" -m pip install -q --disable-pip-version-check "${@:2}"; }

# new_venv ROOT PYTHON: a fresh venv in ROOT/venv with a current pip.
new_venv() {
  rm -rf "$1"
  mkdir -p "$1"
  "$2" -m venv "$1/venv"
  pip_install "$1/venv" --upgrade pip
}

if [[ ! -f $main_root/.installed ]]; then
  python=${PYTHON:-python3.11}
  command -v "$python" >/dev/null || python=python3
  say "guidellm $GUIDELLM_VERSION and aiperf $AIPERF_VERSION in $main_root/venv (torch $VLLM_TORCH_VERSION)"
  new_venv "$main_root" "$python"
  pip_install "$main_root/venv" "guidellm==$GUIDELLM_VERSION" "aiperf==$AIPERF_VERSION" \
    "torch==$VLLM_TORCH_VERSION"
  say "check: guidellm and aiperf run"
  "$main_root/venv/bin/guidellm" --version >&2
  "$main_root/venv/bin/python" -c 'import importlib.metadata as m; print("aiperf", m.version("aiperf"))' >&2
  "$main_root/venv/bin/aiperf" --help >/dev/null
  touch "$main_root/.installed"
fi

# Idempotent (a no-op once built), so always run: a removed cache is rebuilt.
"$main_root/venv/bin/python" "$here/build_tiny_model.py" --tokenizer "$hf_home" >&2

# find_python312: a Python >= 3.12 that runs (pyenv's shims exist for versions that are not selected).
find_python312() {
  local p
  for p in ${BENCH_PYTHON312:-} python3.13 python3.12 "$HOME"/.pyenv/versions/3.1[2-9]*/bin/python3; do
    if "$p" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      echo "$p"
      return 0
    fi
  done
  return 1
}
if [[ ! -f $ip_root/.installed ]]; then
  if py312=$(find_python312); then
    say "inference-perf $INFERENCE_PERF_VERSION in $ip_root/venv ($("$py312" --version))"
    new_venv "$ip_root" "$py312"
    pip_install "$ip_root/venv" "inference-perf==$INFERENCE_PERF_VERSION"
    "$ip_root/venv/bin/inference-perf" --help >/dev/null
    touch "$ip_root/.installed"
  else
    say "inference-perf $INFERENCE_PERF_VERSION skipped: it needs Python >= 3.12 and none was found"
  fi
fi
say "done"
report
