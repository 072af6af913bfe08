#!/usr/bin/env bash
# Run THERE, on a lent GPU machine, as one command of the device tool, with .whl carried
# (tests/device/wheels.sh fills it here first):
#
#     run(command="bash tests/device/run.sh", carry=[".whl"], timeout_s=540)
#
# Installs the wheels into /tmp/site (no network there), builds casckpt's own metadata from
# this checkout (its storage backends are entry points), puts the checkout and /tmp/site on
# PYTHONPATH, and runs the tests marked gpu (pyproject.toml): DeepSpeed on its CUDA accelerator
# and NCCL (bf16, fp16), Megatron-Core's own torch_dist save strategy on CUDA tensors against
# casckpt's, CUDA tensors through Store.commit/restore (the staging path, change hints, the
# hint check). The log goes to $OUT/gpu-checks.log
# (and a JUnit XML beside it). Without CUDA it stops after the install: "skipped: no CUDA".
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$(mktemp -d)}
PYTHON=${PYTHON:-python3}
SITE=${CASCKPT_DEVICE_SITE:-/tmp/site}
LOG="$OUT/gpu-checks.log"
exec > >(tee -a "$LOG") 2>&1
trap 'sleep 0.2' EXIT  # let tee write the last lines

echo "== $(date -u +%FT%TZ) $(uname -m) $("$PYTHON" -V 2>&1), log: $LOG"
ls .whl/*.whl >/dev/null 2>&1 || { echo "no wheels in .whl: run tests/device/wheels.sh here, carry .whl"; exit 2; }
"$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    .whl/*.whl || { echo "installing .whl failed"; exit 1; }
export PYTHONPATH="$SITE"
# casckpt's metadata (entry points): built by hatchling from .whl, no network
"$PYTHON" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --upgrade \
    --target "$SITE" . || { echo "building casckpt's metadata failed"; exit 1; }
export PYTHONPATH="$PWD:$SITE"  # this checkout's code first

if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "skipped: no CUDA (torch is missing or torch.cuda.is_available() is False): nothing was run"
    exit 0
fi
nvidia-smi -L || true
"$PYTHON" - <<'EOF' || { echo "an import failed"; exit 1; }
import importlib.metadata as md
import torch, deepspeed, megatron.core, casckpt, casckpt.integrations.deepspeed, casckpt.integrations.megatron
print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version(),
      torch.cuda.get_device_name(0))
print({name: md.version(name) for name in ("deepspeed", "megatron-core", "casckpt", "pytest")})
EOF

# NVML answers torch.cuda.is_available() without initialising CUDA: the Megatron ranks are
# forked from a process that imported Megatron, which asks (tests/integrations/test_megatron.py).
export PYTORCH_NVML_BASED_CUDA_CHECK=1 NCCL_DEBUG=WARN PYTHONUNBUFFERED=1
# -n 0: in this process (the addopts ask xdist for every core); -m gpu replaces addopts' -m
timeout 480 "$PYTHON" -m pytest -n 0 -m gpu -p no:cacheprovider -rA -v --basetemp=/tmp/casckpt-gpu-pt \
    --junitxml="$OUT/gpu-junit.xml" \
    tests/engine/memory/test_staging.py tests/engine/write/test_change_hint.py \
    tests/engine/maintenance/test_check_hint.py \
    tests/integrations/test_deepspeed.py tests/integrations/test_megatron.py
code=$?
grep -h "casckpt / torch_dist" "$LOG" | tail -1  # the Megatron save-time ratio, if it ran
echo "== pytest exit $code ($([ $code -eq 124 ] && echo 'timed out after 480 s' || echo done))"
exit $code
