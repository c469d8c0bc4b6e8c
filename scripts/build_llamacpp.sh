#!/usr/bin/env bash
# Build llama.cpp's `llama-server` for bench/cpu_vs_llamacpp.py from the llama-cpp-python
# source package on PyPI (its vendored llama.cpp), into a cache outside the repository:
# $SPECSERVE_LLAMACPP (default ~/.cache/specserve/llamacpp)/bin/llama-server. About 8 minutes
# on 2 cores. Needs cmake and a C++ compiler.
set -euo pipefail
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
DEST="${SPECSERVE_LLAMACPP:-$HOME/.cache/specserve/llamacpp}"
PY="${PYTHON:-python3}"
# a relative PYTHON (the Makefile passes .venv/bin/python) must survive the cd below
case "$PY" in */*) PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")" ;; esac
mkdir -p "$DEST/src" "$DEST/bin"
cd "$DEST"
if [ -x bin/llama-server ]; then echo "already built: $DEST/bin/llama-server"; exit 0; fi
"$PY" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d src
tar -xzf "src/llama_cpp_python-$VERSION.tar.gz" -C src
cmake -S "src/llama_cpp_python-$VERSION/vendor/llama.cpp" -B build -DCMAKE_BUILD_TYPE=Release \
  -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
  -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DBUILD_SHARED_LIBS=OFF
nice -n 10 cmake --build build --target llama-server -j "$(nproc)"
cp build/bin/llama-server bin/llama-server
echo "llama-cpp-python $VERSION: $("$DEST/bin/llama-server" --version 2>&1 | tr '\n' ' ')" \
  > VERSION
echo "built: $DEST/bin/llama-server"
