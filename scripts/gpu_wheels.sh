#!/usr/bin/env bash
# Fetch, here (PyPI reachable), what scripts/gpu_check.sh needs on a GPU machine that has no network:
#   .whl/  the pure-Python packages its image lacks, plus the two compiled ones for its Python
#          (jsonschema and its deps; compressed-tensors and pydantic, which transformers needs for a
#          kv_cache_scheme config); pinned, one version each.
#   .gpu/  config + tokenizer of each real fixture (scripts/gpu_standin.py pack), from which the GPU
#          machine builds stand-in checkpoints (scripts/gpu_standin.py build).
# Both are git-ignored; carry them: the device tool's run with carry [".whl", ".gpu"].
#   bash scripts/gpu_wheels.sh                 # cp312 manylinux x86_64 (the GPU image's Python 3.12)
#   PYVER=3.11 WHL=.whl-rehearse bash scripts/gpu_wheels.sh   # wheels for an offline rehearsal here
set -euo pipefail
cd "$(dirname "$0")/.."
PYVER=${PYVER:-3.12}
WHL=${WHL:-.whl}
PINS=(
  "jsonschema==4.26.0" "jsonschema-specifications==2025.9.1" "referencing==0.37.0" "rpds-py==0.30.0"
  "compressed-tensors==0.20.1" "loguru==0.7.3" "pydantic==2.13.4" "pydantic-core==2.46.4"
  "annotated-types==0.7.0" "typing-inspection==0.4.2"
)
mkdir -p "$WHL"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$WHL" "${PINS[@]}"
ls -l "$WHL"
du -sh "$WHL"
if [ "$WHL" = ".whl" ]; then
  python3 scripts/gpu_standin.py pack .gpu
  du -sh .gpu
fi
