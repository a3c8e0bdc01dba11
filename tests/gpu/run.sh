#!/usr/bin/env bash
# The GPU check of the CUDA path, as one command for a machine with one CUDA GPU, PyTorch
# and NCCL (vLLM not needed): the multi-process NCCL scenarios (tests/gpu/nccl_check.py),
# then the single-process checks (tests/gpu/check.py). Reports and logs go to $OUT (or a
# new temporary folder).
# Needs: `python3` 3.11+ with a CUDA build of torch (the one the device machine has).
# Where pydantic is missing (afd-core's one dependency), the wheels in .whl/ are installed
# first: fetch them on the development machine with tests/gpu/wheels.sh (pydantic,
# pydantic-core, annotated-types, typing-inspection, typing-extensions at uv.lock's
# versions, built for CPython 3.12, the device machine's Python) and carry `.whl` (it is
# git-ignored; ~3 MB). A Python other than 3.12 needs wheels.sh's --python-version changed.
# Give the device call a timeout of at least 540 s (330 + 150 + the wheels): a hang costs
# each bounded step.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT/nccl"
if ! python3 -c "import pydantic" 2>/dev/null; then
  [ -d .whl ] || { echo "pydantic is missing and there is no .whl/ (tests/gpu/wheels.sh)"; exit 2; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/afd-site .whl/*.whl || exit 2
  export PYTHONPATH=/tmp/afd-site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -c "import sys; sys.exit(sys.version_info < (3, 11))" || {
  echo "tests/gpu/run.sh needs Python 3.11+ (found $(python3 -V))"; exit 2; }
export PYTHONUNBUFFERED=1
export NCCL_DEBUG=${NCCL_DEBUG:-INFO} NCCL_DEBUG_FILE=${NCCL_DEBUG_FILE:-$OUT/nccl/%h.%p.log}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
echo "== tests/gpu/nccl_check.py"
timeout 330 python3 tests/gpu/nccl_check.py --out "$OUT/nccl_check.json" 2>&1 | tee "$OUT/nccl_check.log"
nccl_rc=${PIPESTATUS[0]}
echo "== tests/gpu/check.py"
unset NCCL_DEBUG_FILE
timeout 150 python3 tests/gpu/check.py --out "$OUT/check.json" > "$OUT/check.log" 2>&1
check_rc=$?
python3 - "$OUT/check.json" <<'PY' || tail -20 "$OUT/check.log"
import json, sys
r = json.load(open(sys.argv[1]))
for k, v in r.items():
    if isinstance(v, dict):
        print("PASS" if v.get("ok") else "FAIL", k, json.dumps({a: b for a, b in v.items() if a != "error"})[:300])
        if "error" in v: print("   ", v["error"][-1500:])
PY
(cd "$OUT" && tar czf nccl_logs.tgz nccl && rm -rf nccl)
echo "== nccl_check rc=$nccl_rc check rc=$check_rc (reports in $OUT)"
[ "$nccl_rc" = 0 ] && [ "$check_rc" = 0 ]
