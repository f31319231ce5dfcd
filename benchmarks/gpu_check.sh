#!/usr/bin/env bash
# The kernels' GPU check: one prepared run for a CUDA machine (e.g. the device tool's H200).
#
#   bash benchmarks/gpu_check.sh [RESULTS_DIR]     # default: $OUT if set, else ./gpu_results
#
# Needs nothing but this repo and a Python that has what the repo's `cuda` and `dev` extras bring:
# torch with CUDA, triton, liger-kernel (only for the Liger comparison; its absence is reported in
# the JSON as liger_error), numpy, pytest, pytest-timeout. It installs nothing. If `agentrl` is not
# installed, it is imported from this checkout through a throw-away sitecustomize on PYTHONPATH
# (the repo maps kernels/ -> agentrl.kernels, which a plain PYTHONPATH entry cannot express).
#
# Writes to RESULTS_DIR: env.txt (GPU, versions), tests.txt (pytest: the GPU tests, the CPU tests and
# the Triton-interpreter tests), benchmark.txt (progress) and benchmark.json (the benchmark's JSON
# line). Exit status: non-zero if the tests or the benchmark failed (both always run).
# Expected wall time on an H200: ~1 min of tests, ~3-5 min of benchmark (torch.compile and Liger's
# compiled chunks dominate the first calls).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
RESULTS=${1:-${OUT:-$REPO/gpu_results}}
mkdir -p "$RESULTS"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1

if ! "$PY" -c "import agentrl.kernels" 2>/dev/null; then
    # agentrl's own modules live in ./agentrl and its components (kernels/, ...) at the repo root; a
    # sitecustomize on PYTHONPATH imports agentrl from here and adds the root to its __path__.
    SHIM=$(mktemp -d)
    cat > "$SHIM/sitecustomize.py" <<PYEOF
import sys
sys.path.insert(0, "$REPO")
import agentrl
agentrl.__path__.append("$REPO")
PYEOF
    export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
    echo "agentrl is not installed; importing it from $REPO through $SHIM/sitecustomize.py" | tee "$RESULTS/env.txt"
    "$PY" -c "import agentrl.kernels" || { echo "gpu_check: cannot import agentrl.kernels"; exit 2; }
fi

{
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
    "$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__); assert torch.cuda.is_available(), 'torch sees no GPU'"
    "$PY" -c "import liger_kernel, importlib.metadata as m; print('liger-kernel', m.version('liger-kernel'))" 2>&1
    git -C "$REPO" rev-parse --short HEAD 2>&1
} >> "$RESULTS/env.txt" 2>&1
cat "$RESULTS/env.txt"

rc=0
"$PY" -m pytest -q -ra -p no:cacheprovider tests/test_kernels_gpu.py tests/test_kernels.py tests/test_kernels_triton.py tests/test_learner_device.py \
    2>&1 | tee "$RESULTS/tests.txt" || rc=1
"$PY" benchmarks/kernels.py --device cuda 2> >(tee "$RESULTS/benchmark.txt" >&2) | tee "$RESULTS/benchmark.json" || rc=1
echo "gpu_check: exit $rc; results in $RESULTS"
exit $rc
