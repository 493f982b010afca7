#!/usr/bin/env bash
# The GPU check: kvtool's eval tests on CUDA, a tokens/s bench against a plain transformers loop, then the
# calibrated commands (convert --method aware with refinement, convert --to mla refined and distilled,
# quantize-kv) on the GPU, with timings.
#
# Runs offline. The target machine (one H200, Python 3.12, torch 2.11, transformers 5.17, accelerate,
# safetensors, pytest; no network; at most 64 MiB carried) lacks jsonschema and compressed-tensors and cannot
# build the real-model fixtures, so, prepared here with network (bash scripts/gpu_wheels.sh):
#   .whl/  pinned wheels, installed with pip --no-index into $KVTOOL_SITE (nothing is fetched)
#   .gpu/  SmolLM2-135M's config and tokenizer: scripts/gpu_standin.py builds a stand-in checkpoint of the same
#          shape there (seeded, briefly trained); tests asserting the real model's figures (real_weights) are
#          deselected then, and said so
# kvtool itself runs from this checkout (PYTHONPATH; no pip install -e, which would need the build backend).
#   bash scripts/gpu_check.sh                          # on the GPU machine (device tool: carry [".whl", ".gpu"])
#   KVTOOL_GPU_CHECK_BENCH=0 bash scripts/gpu_check.sh # tests only
#   KVTOOL_GPU_CHECK_CPU=1 bash scripts/gpu_check.sh   # rehearsal without a GPU: same steps, CPU, shorter runs
# The offline rehearsal done before each GPU run (docs/DEVELOPING.md, "GPU check"):
#   PYVER=3.11 WHL=.whl-rehearse bash scripts/gpu_wheels.sh
#   HOME=$(mktemp -d) KVTOOL_GPU_CHECK_CPU=1 KVTOOL_GPU_CHECK_STANDIN=1 KVTOOL_WHL=.whl-rehearse \
#     unshare -rn bash scripts/gpu_check.sh            # no network namespace: any download would fail
# Target: under 5 minutes on one H100/H200-class GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INDEX=1 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
t_start=$(date +%s)
stamp() { echo "[gpu_check +$(( $(date +%s) - t_start ))s] $*"; }
PY=${PYTHON:-python3}
CPU=${KVTOOL_GPU_CHECK_CPU:-0}
WHL=${KVTOOL_WHL:-.whl}
SITE=${KVTOOL_SITE:-/tmp/kvtool-site}

if [ "$CPU" = "1" ]; then
  stamp "rehearsal on CPU (KVTOOL_GPU_CHECK_CPU=1): the steps of the GPU run, shortened"
  DEVICE=cpu DTYPE=fp32
else
  stamp "nvidia-smi"
  nvidia-smi || { echo "gpu_check: nvidia-smi failed: no NVIDIA GPU here (KVTOOL_GPU_CHECK_CPU=1 rehearses on CPU)" >&2; exit 2; }
  DEVICE=cuda DTYPE=bf16
fi

stamp "installing the carried wheels ($WHL) without network"
if compgen -G "$WHL/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHL"/*.whl \
    || { echo "gpu_check: installing the wheels in $WHL failed" >&2; exit 2; }
  export PYTHONPATH="$SITE:$REPO"
else
  echo "gpu_check: no wheels in $WHL (bash scripts/gpu_wheels.sh makes them); using what is installed" >&2
  export PYTHONPATH="$REPO"
fi
$PY - <<'PY' || { echo "gpu_check: a package kvtool needs is missing (see above)" >&2; exit 2; }
import importlib, sys
missing = []
for name in ("kvtool", "typer", "jsonschema", "yaml", "numpy", "torch", "transformers", "safetensors", "accelerate",
             "compressed_tensors", "pytest"):
    try:
        importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001
        missing.append(f"{name} ({type(exc).__name__}: {exc})")
if missing:
    print("missing: " + "; ".join(missing), file=sys.stderr)
    sys.exit(1)
import jsonschema, torch, transformers, compressed_tensors
from importlib.metadata import version
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, transformers {transformers.__version__}, "
      f"jsonschema {version('jsonschema')} ({jsonschema.__file__.rsplit('/', 2)[0]}), "
      f"compressed-tensors {version('compressed-tensors')}")
if torch.cuda.is_available():
    print(f"CUDA {torch.version.cuda}, device {torch.cuda.get_device_name(0)}, bf16 {torch.cuda.is_bf16_supported()}")
PY

stamp "fixtures"
MARK=()
# KVTOOL_GPU_CHECK_STANDIN=1 skips the real build (a rehearsal where the GGUF packages happen to be installed)
if [ "${KVTOOL_GPU_CHECK_STANDIN:-0}" = "1" ] || ! $PY -m kvtool.testing.fixtures smollm2-135m; then
  STEPS=${KVTOOL_STANDIN_STEPS:-$([ "$CPU" = "1" ] && echo 2 || echo 300)}
  stamp "real fixture unavailable offline: building a stand-in SmolLM2-135M from .gpu/ ($STEPS training steps)"
  $PY scripts/gpu_standin.py build .gpu --train-steps "$STEPS" || { echo "gpu_check: no fixture" >&2; exit 2; }
fi
if $PY scripts/gpu_standin.py is-standin; then
  MARK=(-m "not real_weights")
  stamp "stand-in weights: deselecting the tests that assert the real SmolLM2 / Gemma-3 figures (marker real_weights)"
fi

# kvtool picks CUDA by itself (--device auto); KVTOOL_TEST_DEVICE lets the tests that take a device use it.
export KVTOOL_TEST_DEVICE=$DEVICE
stamp "pytest tests/eval on $DEVICE"
rc=0
timeout 300 $PY -m pytest tests/eval -x -q -p no:cacheprovider --durations=10 "${MARK[@]}" || rc=$?
stamp "pytest tests/eval finished (rc=$rc)"

others=$(grep -rl "cuda" tests --include='test_*.py' | grep -v '^tests/eval/' || true)
if [ -n "$others" ]; then
  stamp "other tests that mention CUDA: $others"
  timeout 120 $PY -m pytest -x -q -p no:cacheprovider "${MARK[@]}" $others || rc=$((rc ? rc : $?))
fi

# --device-map with a forced split (GPU 0 + CPU; on the CPU rehearsal, CPU + disk offload) against the
# layer-by-layer run on one device: the figures must agree (fp32, one window per forward in both).
smol=$($PY -c "from kvtool.testing.fixtures import smollm2_dir; print(smollm2_dir())" 2>/dev/null)
if [ -n "$smol" ]; then
  if [ "$CPU" = "1" ]; then SPLIT="cpu=150MB" SPLIT_TOKENS=256; else SPLIT="0=200MiB,cpu=8GiB" SPLIT_TOKENS=2048; fi
  stamp "eval --device-map auto --max-memory $SPLIT vs layer by layer on $DEVICE (SmolLM2, fp8 KV, $SPLIT_TOKENS tokens)"
  common=("$smol" --baseline "$smol" --kv-cache-dtype fp8 --kv-scales one --max-tokens "$SPLIT_TOKENS"
          --max-length 256 --batch-size 1 --dtype fp32 --format json --no-progress --max-ppl-increase off)
  timeout 240 $PY -m kvtool eval "${common[@]}" --device "$DEVICE" > /tmp/kvtool-split-layerwise.json \
    && timeout 240 $PY -m kvtool eval "${common[@]}" --device-map auto --max-memory "$SPLIT" \
      > /tmp/kvtool-split-mapped.json \
    && $PY - /tmp/kvtool-split-layerwise.json /tmp/kvtool-split-mapped.json <<'PY' || rc=$((rc ? rc : 1))
import json, sys
a, b = (json.load(open(f)) for f in sys.argv[1:3])
print(f"layer by layer: {a['device']}, {a['memory']}")
print(f"device map:     {b['device']}, {b['memory']}")
worst = 0.0
for key in ("ppl", "baseline_ppl", "ppl_ratio", "kld_mean", "top1_agreement"):
    rel = abs(a[key] - b[key]) / abs(b[key]) if b[key] else abs(a[key] - b[key])
    worst = max(worst, rel)
    print(f"  {key:15s} {a[key]:.8g}  {b[key]:.8g}  rel {rel:.1e}")
placed = b["memory"]["modules_per_device"]
if len(placed) < 2 and "disk" not in placed:
    sys.exit(f"gpu_check: the device map did not split the model: {placed}")
if worst > 1e-4:
    sys.exit(f"gpu_check: the sharded figures differ from the layer-by-layer ones by {worst:.1e} (> 1e-4)")
print(f"split check passed (worst relative difference {worst:.1e})")
PY
  stamp "split check finished (rc=$rc)"
fi

if [ "${KVTOOL_GPU_CHECK_BENCH:-1}" != "0" ]; then
  if [ "$CPU" = "1" ]; then TOKENS=768 LEN=256 STRIDE=128 BATCH=4 REPEATS=1 REFINE=2 DISTILL=2 EVT=256; else
    TOKENS=16384 LEN=1024 STRIDE=512 BATCH=8 REPEATS=3 REFINE=64 DISTILL=48 EVT=2048; fi
  stamp "bench: kvtool eval vs plain transformers loop ($DTYPE, L=$LEN, S=$STRIDE, $TOKENS tokens)"
  timeout 180 $PY bench/eval_bench.py --device "$DEVICE" --dtype "$DTYPE" --max-length "$LEN" --stride "$STRIDE" \
    --tokens "$TOKENS" --batch-size 1 --repeats "$REPEATS" || echo "gpu_check: bench failed (rc=$?; 124: timed out)" >&2
  timeout 120 $PY bench/eval_bench.py --device "$DEVICE" --dtype "$DTYPE" --max-length "$LEN" --stride "$STRIDE" \
    --tokens "$TOKENS" --batch-size "$BATCH" --repeats "$REPEATS" \
    || echo "gpu_check: bench (batched) failed (rc=$?; 124: timed out)" >&2
  smol=$($PY -c "from kvtool.testing.fixtures import smollm2_dir; print(smollm2_dir())" 2>/dev/null)
  if [ -n "$smol" ]; then
    # calibration runs on the GPU (one decoder layer at a time); CPU reference: 1.93x in ~200-280 s on 2 cores, on
    # 4096 calibration tokens (pinned: with refinement the default is now 16384)
    stamp "convert --method aware --refine-steps $REFINE on $DEVICE (SmolLM2 -> MQA)"
    t0=$(date +%s)
    timeout 300 $PY -m kvtool convert "$smol" /tmp/kvtool-gpu-aware --to mqa --method aware --refine-steps "$REFINE" \
      --calib-tokens 4096 --eval --eval-tokens "$EVT" --force --no-progress || rc=$((rc ? rc : $?))
    stamp "convert took $(( $(date +%s) - t0 )) s"
    # GQA -> MLA at MQA's bytes, refined and distilled: the solve on the CPU, refinement, distillation and the
    # calibration forward on the device; CPU reference (2 cores, real SmolLM2): docs/convert-mla.md, "Refined"
    stamp "convert --to mla --kv-budget 18.75KiB --refine-steps $REFINE --distill-steps $DISTILL on $DEVICE (SmolLM2)"
    t0=$(date +%s)
    timeout 300 $PY -m kvtool convert "$smol" /tmp/kvtool-gpu-mla --to mla --kv-budget 18.75KiB --refine-steps "$REFINE" \
      --distill-steps "$DISTILL" --calib-tokens 4096 --eval --eval-tokens "$EVT" --force --no-progress \
      || rc=$((rc ? rc : $?))
    stamp "convert --to mla took $(( $(date +%s) - t0 )) s"
    $PY -m kvtool lint /tmp/kvtool-gpu-mla | tail -2 || rc=$((rc ? rc : $?))
    stamp "quantize-kv on $DEVICE (SmolLM2)"
    t0=$(date +%s)
    $PY -c "from kvtool.testing.text import calibration_text as t; open('/tmp/kvtool-calib.txt', 'w').write(t())"
    timeout 180 $PY -m kvtool quantize-kv "$smol" /tmp/kvtool-gpu-fp8 --calib-text /tmp/kvtool-calib.txt --force \
      || rc=$((rc ? rc : $?))
    stamp "quantize-kv took $(( $(date +%s) - t0 )) s"
    $PY -m kvtool lint /tmp/kvtool-gpu-fp8 | tail -2 || rc=$((rc ? rc : $?))
    # FP8 attention as vLLM's backends compute it (kvtool/eval/fp8_backends.py), with the q scales just written
    for backend in flash-attn triton; do
      stamp "eval --fp8-attention $backend on $DEVICE (SmolLM2 with calibrated K/V/q scales, $EVT tokens)"
      timeout 180 $PY -m kvtool eval /tmp/kvtool-gpu-fp8 --baseline "$smol" --fp8-attention "$backend" \
        --max-tokens "$EVT" --max-length "$LEN" --max-ppl-increase off --no-progress | grep -E "^(fp8|kld|ppl) " \
        || rc=$((rc ? rc : 1))
    done
  fi
fi
stamp "done, rc=$rc"
exit $rc
