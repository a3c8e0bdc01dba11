#!/usr/bin/env bash
# The wheel set of the reference image (docker/Dockerfile runs this in its builder stage):
# one wheel per package (afd-core, afd-models, afd-npu, afd-plugin) built from this checkout
# into OUTDIR, which must be empty or absent, so that OUTDIR holds exactly what the image
# installs. Needs uv 0.13 (UV names another binary) and network or a uv cache holding
# hatchling. tests/afd_plugin/test_reference_image.py checks what it builds.
set -euo pipefail
if [ $# -ne 1 ]; then
  echo "usage: scripts/build_wheels.sh OUTDIR" >&2
  exit 2
fi
out=$1
uv=${UV:-uv}
command -v "$uv" >/dev/null || { echo "build_wheels.sh: $uv not found (install uv 0.13)" >&2; exit 1; }
mkdir -p "$out"
if [ -n "$(ls -A "$out")" ]; then
  echo "build_wheels.sh: $out is not empty; allowed: an empty or absent folder" >&2
  exit 2
fi
out=$(cd "$out" && pwd)
cd "$(dirname "${BASH_SOURCE[0]}")/.."
for package in afd-core afd-models afd-npu afd-plugin; do
  "$uv" build -q --package "$package" --wheel --out-dir "$out"
done
ls "$out"
