#!/usr/bin/env bash
# The engine lane: install the transformers releases tests/oracle/engine_releases.py names (once, cached under
# ~/.cache/kvtool/engines), then compare kvtool's verdict for each release with the release itself
# (tests/oracle/test_engine_releases.py). Also run by `bash .ci/run engines`. Time: docs/lint.md, "Engine versions".
set -euo pipefail
cd "$(dirname "$0")/.."
python3 tests/oracle/engine_releases.py install
python3 -m pytest -q -m engines -n "${KVTOOL_ENGINE_LANE_WORKERS:-2}" tests/oracle/test_engine_releases.py "$@"
