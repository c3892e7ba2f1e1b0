#!/usr/bin/env bash
# The GPU checks in one go, on a machine with a CUDA device: the conformance suite (tests/gpu)
# and the device-to-host step benchmark with its copies launched per step (bench/gpu_step.py).
# About 2 minutes; at most 8.
#
# Installs nothing: it runs the machine's own python (PYTHON, default python3) with the torch,
# attrs, numpy, pytest and hypothesis already there, and the packages from this checkout
# through PYTHONPATH. It prints what it found first, so a missing one is named up front.
# Output goes to the terminal and, when OUT is set, to "$OUT/gpu_checks.log".
#
# Run: bash bench/run_gpu_checks.sh        (from any directory)
# Exit status: 0 when every step passed, 3 when torch sees no CUDA device (the tests only
# skip), else the first failing step's status.
set -u

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
PYTHON=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1
export PYTHONFAULTHANDLER=1

LOG=/dev/null
if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT" && LOG="$OUT/gpu_checks.log"
fi

run_checks() {
    local status=0 rc

    echo "== machine"
    date -u '+%Y-%m-%d %H:%M:%S UTC'
    uname -srm
    git rev-parse --short HEAD 2>/dev/null || echo "(not a git checkout)"
    if command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,clocks.sm,clocks.mem,temperature.gpu \
            --format=csv || echo "nvidia-smi failed"
    else
        echo "nvidia-smi: not found"
    fi

    echo "== python and packages"
    command -v "$PYTHON" || { echo "no $PYTHON on PATH"; return 2; }
    "$PYTHON" - <<'PY'
import importlib
import sys

print("python", sys.version.split()[0], sys.executable)
missing = []
for name in ("torch", "attrs", "numpy", "pytest", "hypothesis"):
    try:
        mod = importlib.import_module(name)
    except ImportError as exc:
        missing.append(name)
        print(f"{name}: MISSING ({exc})")
        continue
    print(name, getattr(mod, "__version__", "?"))
import torch

print("torch CUDA", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    props = torch.cuda.get_device_properties(0)
    print(f"device 0: {props.name}, capability {props.major}.{props.minor}, "
          f"{props.total_memory / 2**30:.1f} GiB")
import omni_cache_cuda

print("omni_cache_cuda from", omni_cache_cuda.__file__)
sys.exit(1 if missing else 0)
PY
    rc=$?
    if [ "$rc" -ne 0 ]; then
        echo "== packages missing or broken (status $rc); nothing else runs"
        return "$rc"
    fi
    if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
        # The suite would only skip: run it anyway, but do not report a pass.
        echo "== WARNING: torch sees no CUDA device; the GPU tests skip and nothing is measured"
        status=3
    fi

    echo "== pytest tests/gpu"
    # faulthandler dumps every thread's stack if one test hangs, well before the outer timeout.
    timeout 330 "$PYTHON" -m pytest -q tests/gpu -p no:cacheprovider -raP --durations=8 \
        -o faulthandler_timeout=150
    rc=$?
    echo "== pytest status $rc"
    [ "$rc" -ne 0 ] && [ "$status" -eq 0 ] && status=$rc

    echo "== bench/gpu_step.py"
    timeout 120 "$PYTHON" bench/gpu_step.py
    rc=$?
    echo "== gpu_step status $rc"
    [ "$rc" -ne 0 ] && [ "$status" -eq 0 ] && status=$rc

    echo "== after"
    if command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi --query-gpu=memory.used,clocks.sm,temperature.gpu --format=csv || true
    fi
    echo "== done: status $status"
    return "$status"
}

run_checks 2>&1 | tee "$LOG"
exit "${PIPESTATUS[0]}"
