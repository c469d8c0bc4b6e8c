#!/usr/bin/env bash
# Build llama.cpp's `llama-server` for bench/cpu_vs_llamacpp.py from the llama-cpp-python
# source package on PyPI (its vendored llama.cpp), into a cache outside the repository:
# $SPECSERVE_LLAMACPP (default ~/.cache/specserve/llamacpp)/bin/llama-server. About 8 minutes
# on 2 cores (twice that where AMX must be turned off). Needs cmake and a C++ compiler.
# Usage: scripts/build_llamacpp.sh [GGUF to check the build with]
set -euo pipefail
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
DEST="${SPECSERVE_LLAMACPP:-$HOME/.cache/specserve/llamacpp}"
PY="${PYTHON:-python3}"
# a relative PYTHON (the Makefile passes .venv/bin/python) must survive the cd below
case "$PY" in */*) PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")" ;; esac
# llama.cpp at its best on this CPU: -march=native (GGML_NATIVE=ON), which turns on every
# feature the CPU has, AMX included. ggml's AMX backend has crashed (SIGSEGV in
# ggml_backend_amx_mul_mat at the first decode) on an Intel Xeon with AMX-INT8, so with a GGUF
# given ($1) the native build first serves a few tokens of it; where that fails and the CPU has
# AMX, it is rebuilt native with AMX off (-mno-amx-*, which GCC honours whatever -march says)
# and VERSION says why. Without a GGUF to try, AMX is left as native sets it.
CHECK_GGUF="${1:-}"
NATIVE="-DGGML_NATIVE=ON"
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
mkdir -p "$DEST/src" "$DEST/bin"
cd "$DEST"

build() {  # $1: extra C/C++ flags ("" for none)
  if [ ! -d "src/llama_cpp_python-$VERSION" ]; then
    "$PY" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d src
    tar -xzf "src/llama_cpp_python-$VERSION.tar.gz" -C src
  fi
  rm -rf build
  cmake -S "src/llama_cpp_python-$VERSION/vendor/llama.cpp" -B build \
    -DCMAKE_BUILD_TYPE=Release $NATIVE -DCMAKE_C_FLAGS="$1" -DCMAKE_CXX_FLAGS="$1" \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DBUILD_SHARED_LIBS=OFF
  nice -n 10 cmake --build build --target llama-server -j "$(nproc)"
  cp build/bin/llama-server bin/llama-server
}

serves() {  # does bin/llama-server answer a short greedy completion of $CHECK_GGUF?
  local port=$((40000 + RANDOM % 20000)) ok=1
  bin/llama-server -m "$CHECK_GGUF" -t 2 -c 512 --host 127.0.0.1 --port "$port" \
    > check.log 2>&1 &
  local pid=$!
  "$PY" - "$port" "$pid" <<'PYEOF' && ok=0
import json, os, sys, time, urllib.request
port, pid = sys.argv[1], int(sys.argv[2])
for _ in range(600):
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit(1)  # the server died
    try:
        body = json.dumps({"prompt": "def fib(n):", "n_predict": 8, "temperature": 0}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", body,
                                     {"Content-Type": "application/json"})
        json.load(urllib.request.urlopen(req, timeout=60))["content"]
        sys.exit(0)
    except Exception:
        time.sleep(0.5)
sys.exit(1)
PYEOF
  kill "$pid" 2> /dev/null || true
  wait "$pid" 2> /dev/null || true
  return $ok
}

AMX=no
grep -m1 '^flags' /proc/cpuinfo | grep -qw amx_int8 && AMX=yes
want="options: $NATIVE"
if [ -x bin/llama-server ] && grep -q -- "^options: $NATIVE" VERSION 2> /dev/null; then
  echo "already built: $DEST/bin/llama-server ($(grep '^options' VERSION))"; exit 0
fi
build ""
why="native: every feature of this CPU (AMX: $AMX)"
if [ -n "$CHECK_GGUF" ] && ! serves; then
  if [ "$AMX" = no ]; then
    echo "llama-server built native does not serve $CHECK_GGUF; see $DEST/check.log" >&2
    exit 1
  fi
  echo "the native build with AMX crashed serving $CHECK_GGUF: rebuilding with AMX off" >&2
  tail -5 check.log >&2 || true
  build "$NO_AMX"
  want="options: $NATIVE $NO_AMX"
  why="native with AMX off: the native build (AMX on) failed to serve a completion"
  if ! serves; then echo "llama-server does not serve $CHECK_GGUF; see check.log" >&2; exit 1; fi
elif [ -n "$CHECK_GGUF" ]; then
  why="$why; served a completion of the bench's model"
fi
{ echo "llama-cpp-python $VERSION: $("$DEST/bin/llama-server" --version 2>&1 | tr '\n' ' ')"
  echo "$want"
  echo "why: $why"; } > VERSION
echo "built: $DEST/bin/llama-server"
