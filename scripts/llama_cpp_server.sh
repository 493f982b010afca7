#!/usr/bin/env bash
# Install llama-cpp-python's OpenAI-compatible server, the real engine tests/eval/test_eval_served.py starts.
# The wheel is built from PyPI's sdist once (CPU only, generic x86-64 with AVX2: ~8 min on 2 quiet cores, 55 min on busy ones) and kept in
# the cache, keyed by the version and the build flags; later runs install the cached wheel in seconds.
set -euo pipefail
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
# GGML_NATIVE=OFF: a wheel that runs on any machine of this kind, not only the CPU that built it; no multimodal
# library (LLAVA_BUILD), tests, examples, tools or llama.cpp's own server; ggml's thread pool instead of OpenMP
export CMAKE_ARGS="-DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DGGML_OPENMP=OFF"
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}"
KEY="$(printf '%s %s' "$VERSION" "$CMAKE_ARGS" | sha256sum | cut -c1-12)"
CACHE="${KVTOOL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvtool}/wheels/llama-cpp-python-$VERSION-$KEY"
have="$(python3 -c 'import llama_cpp; print(llama_cpp.__version__)' 2>/dev/null || true)"
if [ "$have" != "$VERSION" ] || [ ! -f "$CACHE/installed" ]; then
    if ! ls "$CACHE"/llama_cpp_python-"$VERSION"-*.whl >/dev/null 2>&1; then
        echo "building llama-cpp-python $VERSION (cached in $CACHE)" >&2
        mkdir -p "$CACHE.tmp"
        python3 -m pip wheel -q --no-deps --no-binary llama-cpp-python -w "$CACHE.tmp" "llama-cpp-python==$VERSION"
        mkdir -p "$CACHE" && mv "$CACHE.tmp"/llama_cpp_python-"$VERSION"-*.whl "$CACHE"/ && rm -rf "$CACHE.tmp"
    fi
    python3 -m pip install -q --force-reinstall --no-deps "$CACHE"/llama_cpp_python-"$VERSION"-*.whl
    touch "$CACHE/installed"
fi
# its own dependencies and the [server] extra's (llama-cpp-python 0.3.36 pyproject.toml)
python3 -m pip install -q "typing-extensions>=4.5.0" "numpy>=1.20.0" "diskcache>=5.6.1" "jinja2>=2.11.3" \
    "uvicorn>=0.22.0" "fastapi>=0.100.0" "pydantic-settings>=2.0.1" "sse-starlette>=1.6.1" \
    "starlette-context>=0.3.6,<0.4" "PyYAML>=5.1"
python3 -c 'import llama_cpp.server.app' # fails here, not in the tests, when the install is incomplete
