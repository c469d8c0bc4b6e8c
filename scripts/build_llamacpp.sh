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
# This CPU's x86 features, named as ggml's options, without AMX: ggml's AMX backend crashed
# (SIGSEGV in ggml_backend_amx_mul_mat) at the first decode on an Intel Xeon with AMX-INT8, so
# llama.cpp is built for its AVX-512 path there, as on CPUs without AMX.
FLAGS="$(grep -m1 '^flags' /proc/cpuinfo || true)"
ISA=""
for pair in avx:AVX avx2:AVX2 bmi2:BMI2 fma:FMA f16c:F16C avx512f:AVX512 \
    avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16; do
  if grep -qw "${pair%%:*}" <<< "$FLAGS"; then ISA="$ISA -DGGML_${pair#*:}=ON"; fi
done
OPTIONS="-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF$ISA"
mkdir -p "$DEST/src" "$DEST/bin"
cd "$DEST"
if [ -x bin/llama-server ] && grep -qF -- "options: $OPTIONS" VERSION 2> /dev/null; then
  echo "already built: $DEST/bin/llama-server"; exit 0
fi
"$PY" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d src
tar -xzf "src/llama_cpp_python-$VERSION.tar.gz" -C src
# shellcheck disable=SC2086  # OPTIONS is a list of words
cmake -S "src/llama_cpp_python-$VERSION/vendor/llama.cpp" -B build -DCMAKE_BUILD_TYPE=Release \
  $OPTIONS -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
  -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DBUILD_SHARED_LIBS=OFF
nice -n 10 cmake --build build --target llama-server -j "$(nproc)"
cp build/bin/llama-server bin/llama-server
{ echo "llama-cpp-python $VERSION: $("$DEST/bin/llama-server" --version 2>&1 | tr '\n' ' ')"
  echo "options: $OPTIONS"; } > VERSION
echo "built: $DEST/bin/llama-server"
