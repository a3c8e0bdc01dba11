#!/usr/bin/env bash
# Fetch, into .whl/, the wheels tests/gpu/run.sh installs on a GPU machine whose Python
# (3.12) lacks afd-core's dependency pydantic (and its own), at the versions uv.lock pins.
set -euo pipefail
cd "$(dirname "$0")/../.."
pin() { grep -A1 "^name = \"$1\"$" uv.lock | sed -n 's/^version = "\(.*\)"/\1/p'; }
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl \
  "pydantic==$(pin pydantic)" "pydantic-core==$(pin pydantic-core)" \
  "annotated-types==$(pin annotated-types)" "typing-inspection==$(pin typing-inspection)" \
  "typing-extensions==$(pin typing-extensions)"
ls .whl
