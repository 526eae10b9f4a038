#!/usr/bin/env bash
# Download, HERE (a machine with PyPI), the pure-python packages gearshift needs that the device machine's
# image lacks, as wheels for its Python (CPython 3.12, x86-64, manylinux), into e2e/device/wheels/.
# run.sh installs them there with `pip --no-index --target` (the device README's recipe): that machine
# reaches no registry. e2e/device/.gitignore keeps the folder out of git; the `run` call names it in carry.
#
# Which: the device image (/work/.library/device/KINDS.md, "Python packages already there") has numpy,
# pyyaml, aiohttp, prometheus-client, threadpoolctl, uvloop, typing-extensions, but not pydantic (the API
# models, `gearshift render`, the probe's output validation) nor pydantic's own needs, nor orjson (the
# router's JSON, which `gearshift render` imports through the CLI's subcommands: the first device run failed
# there with `No module named 'orjson'`). The versions are the
# project venv's (what the tests ran with), else the pins below. About 2.5 MB in all.
#
# Usage: bash e2e/device/fetch-wheels.sh        # from the repository root
set -euo pipefail
cd "$(dirname "$0")/../.."
py=.venv/bin/python
[[ -x $py ]] || py=python3
ver() { "$py" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1" 2>/dev/null || echo "$2"; }
pkgs=(
  "pydantic==$(ver pydantic 2.14.4)"
  "pydantic-core==$(ver pydantic-core 2.50.5)"
  "annotated-types==$(ver annotated-types 0.8.0)"
  "typing-inspection==$(ver typing-inspection 0.4.5)"
  "typing-extensions==$(ver typing-extensions 4.16.0)"
  "orjson==$(ver orjson 3.13.0)"
)
dest=e2e/device/wheels
rm -rf "$dest"
mkdir -p "$dest"
plats=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
  manylinux2014_x86_64 manylinux1_x86_64; do
  plats+=(--platform "$p")
done
"$py" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${plats[@]}" -d "$dest" "${pkgs[@]}"
ls -l "$dest"
du -sh "$dest"
