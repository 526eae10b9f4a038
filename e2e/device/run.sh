#!/usr/bin/env bash
# gearshift's GPU check, as ONE command on the device machine (README.md beside this: the `run` call).
# From the repository root: bash e2e/device/run.sh [check.py flags, e.g. --skip-probe]
#
# 1. gearshift's pure-python needs the image lacks (pydantic & co.), from e2e/device/wheels (fetch-wheels.sh,
#    carried), into /tmp/gearshift-site; gearshift itself from the working tree: `pip install --no-deps -e .`
#    on the device machine (its console scripts, gearshift-probe among them), PYTHONPATH=operator always;
# 2. check.py under `timeout` (the whole script ends inside GEARSHIFT_DEVICE_TOTAL_S, default 525 s);
# 3. engine process groups check.py left (only if it was itself killed) are killed by their ids;
#    on the device machine, $OUT/device.json is copied to bench/results/device.json (of the copy of the
#    tree there: it comes back only through $OUT; README.md says how it lands here).
# Files under $OUT: check.log (all output), device.json, probe.json, rendered.json, engines.log.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
start=$SECONDS
total=${GEARSHIFT_DEVICE_TOTAL_S:-525}
on_device=${OUT:+1}
OUT=${OUT:-$PWD/e2e/device/out}
mkdir -p "$OUT"
work=/tmp/gearshift-device-work

main() {
  py=${PYTHON:-python3}
  echo "== gearshift device check: $(date -u +%FT%TZ) on $(uname -n), $($py --version 2>&1) at $(command -v "$py")"
  if ! command -v nvidia-smi >/dev/null && [[ ${GEARSHIFT_DEVICE_FORCE:-0} != 1 ]]; then
    echo "no nvidia-smi: this is not the device machine. Run this through the device tool (e2e/device/README.md);"
    echo "here, only: .venv/bin/python e2e/device/check.py --dry-run"
    return 2
  fi
  nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader 2>&1 || true
  export PYTHONUNBUFFERED=1
  export GEARSHIFT_ORIG_PYTHONPATH=${PYTHONPATH:-}
  # 1. pydantic & co. (not in the image: /work/.library/device/KINDS.md), as the device README's recipe.
  if compgen -G "e2e/device/wheels/*.whl" >/dev/null; then
    rm -rf /tmp/gearshift-site
    if "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/gearshift-site e2e/device/wheels/*.whl; then
      export PYTHONPATH=/tmp/gearshift-site${PYTHONPATH:+:$PYTHONPATH}
      echo "setup: $(ls e2e/device/wheels | tr '\n' ' ')-> /tmp/gearshift-site"
    else
      echo "setup: installing e2e/device/wheels failed"
    fi
  elif ! "$py" -c "import pydantic" 2>/dev/null; then
    echo "pydantic: missing (no e2e/device/wheels: run bash e2e/device/fetch-wheels.sh there, carry e2e/device/wheels)"
  fi
  export PYTHONPATH=$PWD/operator${PYTHONPATH:+:$PYTHONPATH}
  install=PYTHONPATH
  cache=()
  if [[ -n $on_device ]]; then
    # The tiny model where the pods' HF_HOME points (/root/.cache/huggingface), so that env stays as written.
    cache=(--model-cache container)
    # Only on the device machine (a throwaway one): this writes into that Python's environment.
    if timeout 120 "$py" -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$OUT/pip.log" 2>&1; then
      install="pip install --no-deps -e ."
      rm -f "$OUT/pip.log"
    else
      echo "setup: pip install -e . failed (tail below); gearshift runs from PYTHONPATH=operator"
      tail -5 "$OUT/pip.log"
    fi
  fi
  echo "setup: gearshift from $install ($((SECONDS - start)) s)"
  # 2. the check.
  budget=$((total - (SECONDS - start) - 15))
  rm -rf "$work"
  timeout -k 15 "$budget" "$py" e2e/device/check.py --out "$OUT" --work "$work" --budget-s "$((budget - 5))" \
    --gearshift-install "$install" "${cache[@]}" "$@"
  rc=$?
  # 3. engine groups a killed check.py could not stop (each is its own session, which the device tool would
  #    leave running until the machine goes back).
  if [[ -f $work/engine-pgids ]]; then
    while read -r pg; do
      if kill -0 -- "-$pg" 2>/dev/null; then
        echo "cleanup: killing engine process group $pg"
        kill -KILL -- "-$pg" 2>/dev/null || true
      fi
    done <"$work/engine-pgids"
  fi
  if [[ -n $on_device && -f $OUT/device.json ]]; then
    mkdir -p bench/results
    cp "$OUT/device.json" bench/results/device.json
  fi
  echo "== done in $((SECONDS - start)) s, check.py exit $rc (0 passed, 1 a check failed, 3 vllm missing," \
    "4 pydantic missing, 124 timed out)"
  return "$rc"
}

main "$@" 2>&1 | tee "$OUT/check.log"
exit "${PIPESTATUS[0]}"
