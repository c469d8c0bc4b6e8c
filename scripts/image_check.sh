#!/usr/bin/env bash
# Builds the image from the Dockerfile and runs docker-compose.yml as a user deploys it: two
# replicas behind nginx, scraped by Prometheus. Checks, through nginx and with the official
# openai client: a chat completion and a streamed one; Prometheus sees both replicas; a `stop`
# of one replica drains it with zero failed requests; a `kill -9` of one fails only its
# in-flight requests, cleanly, and the replica restarts and becomes healthy again.
# Prints a summary; exits non-zero on any failure.
#
#   scripts/image_check.sh            the CPU image and the whole check (`make image-check`)
#   scripts/image_check.sh --gpu      only builds the CUDA image (the Dockerfile's defaults)
#   scripts/image_check.sh --keep     leaves the deployment running afterwards
#
# Uses docker (with its compose plugin) or podman (with podman-compose from PyPI), whichever
# runs; installs podman from Debian's packages if neither is present. Where no container registry
# answers, the base image is made from Debian's packages (mmdebstrap), nginx and Prometheus
# images likewise (scripts/image_check/*.Containerfile), and torch comes from the local pip's
# wheel; everything else is the steps a user runs. Environment: BASE_IMAGE, TORCH_INDEX (build
# args), PIP_CA (a CA bundle for pip behind a TLS-re-signing proxy; default: pip's own `cert`).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
WORK=$ROOT/.image-check            # logs, the helper venv, a local torch index (git-ignored)
PROJECT=specserve-check
IMAGE=specserve:latest
GPU=0 KEEP=0
for arg in "$@"; do
  case $arg in
    --gpu) GPU=1 ;;
    --keep) KEEP=1 ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    *) echo "unknown argument: $arg" >&2; exit 2 ;;
  esac
done
mkdir -p "$WORK"
ARGS="$*"
exec > >(tee "$WORK/output.log") 2>&1  # also written to bench/results/ at the end
RESULTS=() FAILED=0 T0=$(date +%s)
say() { printf '[%4ds] %s\n' $(( $(date +%s) - T0 )) "$*"; }
result() {  # result PASS|FAIL|NOTE text
  RESULTS+=("$1  $2"); say "$1: $2"
  [ "$1" = FAIL ] && FAILED=1
  return 0
}
die() { result FAIL "$*"; summary; exit 1; }
summary() {
  echo; echo "== image check summary ($(date -u +%FT%TZ), $(nproc) CPUs: $CPU)"
  printf '  %s\n' "${RESULTS[@]}"
  [ $FAILED = 0 ] && echo "IMAGE CHECK PASSED" || echo "IMAGE CHECK FAILED"
  sleep 1  # tee catches up
  local out=bench/results/image_check$([ $GPU = 1 ] && echo _gpu).md
  { echo "# \`scripts/image_check.sh $ARGS\` ($(date -u +%F))"; echo
    echo "- machine: $CPU, $(nproc) CPUs, $(free -g | awk '/Mem:/ {print $2}') GiB, $(uname -sr)"
    echo "- engine: ${ENGINE_VERSION:-?}"; echo; echo '```'; cat "$WORK/output.log"; echo '```'
  } > "$out"
}
CPU=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')

# -- the container engine and its compose ---------------------------------------------------
if command -v docker > /dev/null && docker info > /dev/null 2>&1; then
  ENGINE=docker FORMAT=()
  docker compose version > /dev/null 2>&1 || die "docker runs but its compose plugin is missing"
  COMPOSE=(docker compose)
else
  if ! command -v podman > /dev/null; then
    say "no docker engine and no podman: installing podman from Debian's packages"
    SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
    $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq \
      podman runc uidmap netavark aardvark-dns slirp4netns fuse-overlayfs mmdebstrap \
      > "$WORK/apt.log" 2>&1 || die "apt-get install podman failed (see $WORK/apt.log)"
  fi
  ENGINE=podman
  FORMAT=(--format docker)  # OCI images drop HEALTHCHECK
  # some kernels refuse crun's cgroup setup or podman's default rlimits: runc, no ulimits
  if ! podman run --rm --network none "$(podman images -q | head -1)" true > /dev/null 2>&1; then
    printf '[containers]\ndefault_ulimits = []\n[engine]\nruntime = "runc"\n' \
      > "$WORK/containers.conf"
    export CONTAINERS_CONF=$WORK/containers.conf
  fi
  if [ ! -x "$WORK/venv/bin/podman-compose" ]; then
    python3 -m venv "$WORK/venv" && "$WORK/venv/bin/pip" install -q podman-compose openai \
      2> "$WORK/pip.log" || die "pip install podman-compose failed"
  fi
  COMPOSE=("$WORK/venv/bin/podman-compose")
fi
[ -x "$WORK/venv/bin/python" ] || { python3 -m venv "$WORK/venv" \
  && "$WORK/venv/bin/pip" install -q openai 2> "$WORK/pip.log"; } || die "pip install openai failed"
PY=$WORK/venv/bin/python
ENGINE_VERSION="$($ENGINE --version); compose: $("${COMPOSE[@]}" version 2>/dev/null | head -1)"
say "engine: $ENGINE_VERSION"

# -- where the base image, torch and pip's CA come from ----------------------------------------
REGISTRY=0
if timeout 120 $ENGINE pull -q docker.io/library/debian:bookworm-slim > /dev/null 2>&1; then
  REGISTRY=1
fi
BUILD_ARGS=() BUILD_NET=()
if [ $GPU = 1 ]; then
  [ $REGISTRY = 1 ] || die "no container registry answers: the CUDA base image cannot be pulled here"
  say "building the GPU image (the Dockerfile's defaults: CUDA base, cu124 torch)"
  $ENGINE build "${FORMAT[@]}" -t specserve:gpu . \
    || die "the GPU image did not build"
  result PASS "GPU image specserve:gpu built ($($ENGINE image inspect specserve:gpu \
    --format '{{.Size}}') bytes); running it needs a GPU host: docker-compose.gpu.yml"
  summary; exit $FAILED
fi
if [ $REGISTRY = 1 ]; then
  BASE=${BASE_IMAGE:-debian:bookworm-slim}
else
  BASE=${BASE_IMAGE:-localhost/debian:bookworm}
  if ! $ENGINE image inspect "$BASE" > /dev/null 2>&1; then
    say "no container registry answers: making $BASE from Debian's packages (mmdebstrap)"
    command -v mmdebstrap > /dev/null || apt-get install -y -qq mmdebstrap > /dev/null
    mmdebstrap --variant=minbase --quiet bookworm "$WORK/base.tar" \
      && $ENGINE import "$WORK/base.tar" "$BASE" > /dev/null && rm -f "$WORK/base.tar" \
      || die "could not make the base image"
  fi
  result NOTE "no container registry answers here: base image $BASE made from Debian's packages"
fi
BUILD_ARGS+=(--build-arg "BASE_IMAGE=$BASE")
if [ -n "${TORCH_INDEX:-}" ]; then
  BUILD_ARGS+=(--build-arg "TORCH_INDEX=$TORCH_INDEX")
elif ! curl -fsS --max-time 20 -o /dev/null https://download.pytorch.org/whl/cpu/torch/ 2> /dev/null; then
  # the same wheels as pip install torch==2.13.0 here, as a simple index on loopback
  say "download.pytorch.org does not answer: torch from this machine's pip, on a local index"
  rm -rf "$WORK/torch-index" && mkdir -p "$WORK/torch-index/wheels"
  python3 -m pip download -q --only-binary=:all: -d "$WORK/torch-index/wheels" torch==2.13.0 \
    2> "$WORK/torch-index.log" || die "pip download torch==2.13.0 failed"
  for whl in "$WORK"/torch-index/wheels/*.whl; do
    name=$(basename "$whl" | cut -d- -f1 | tr 'A-Z_.' 'a-z--')
    mkdir -p "$WORK/torch-index/$name" && mv "$whl" "$WORK/torch-index/$name/"
  done
  # a fixed port where free: the index's address is a build arg, and a new one each run would
  # rebuild every layer from torch on
  PORT=$(python3 -c 'import socket
s = socket.socket()
try: s.bind(("127.0.0.1", 18765))
except OSError: s.bind(("127.0.0.1", 0))
print(s.getsockname()[1])')
  python3 -m http.server "$PORT" --bind 127.0.0.1 --directory "$WORK/torch-index" \
    > "$WORK/torch-index.http.log" 2>&1 &
  INDEX_PID=$!
  BUILD_ARGS+=(--build-arg "TORCH_INDEX=http://127.0.0.1:$PORT/")
  BUILD_NET=(--network host)
  result NOTE "torch from this machine's pip (torch==2.13.0, CPU build) on a local index"
else
  BUILD_ARGS+=(--build-arg "TORCH_INDEX=https://download.pytorch.org/whl/cpu")
fi
PIP_CA=${PIP_CA:-${PIP_CERT:-$(python3 -m pip config list 2>/dev/null \
  | sed -n "s/^[a-z:]*\.cert='\(.*\)'$/\1/p" | head -1)}}
if [ -n "$PIP_CA" ] && [ -f "$PIP_CA" ]; then
  BUILD_ARGS+=(--secret "id=ca,src=$PIP_CA")
  # the models are fetched by pip inside the fetch-models container: the same CA, mounted
  cat > "$WORK/ca.override.yml" <<EOF
services:
  fetch-models:
    volumes:
      - $PIP_CA:/run/specserve-ca.crt:ro
    environment:
      PIP_CERT: /run/specserve-ca.crt
EOF
  CA_FILES=(-f "$WORK/ca.override.yml")
  result NOTE "pip's CA bundle $PIP_CA passed as a build secret and mounted into fetch-models"
else
  CA_FILES=()
fi

cleanup() {
  if [ -n "${UP:-}" ]; then  # every container's log, for a look after a failure
    mkdir -p "$WORK/logs"
    for c in $($ENGINE ps -a -q --filter "label=com.docker.compose.project=$PROJECT"); do
      $ENGINE logs "$c" > "$WORK/logs/$($ENGINE inspect "$c" --format '{{.Name}}' | tr -d /).log" 2>&1
    done
  fi
  [ -n "${INDEX_PID:-}" ] && kill "$INDEX_PID" 2> /dev/null
  [ -n "${HEALTH_PID:-}" ] && kill "$HEALTH_PID" 2> /dev/null
  [ -n "${LOAD_PID:-}" ] && kill "$LOAD_PID" 2> /dev/null
  if [ $KEEP = 0 ] && [ -n "${UP:-}" ]; then
    "${COMPOSE_CMD[@]}" down > "$WORK/down.log" 2>&1
  fi
}
trap cleanup EXIT

# -- 1. the image ----------------------------------------------------------------------------
say "building $IMAGE from the Dockerfile (log: $WORK/build.log)"
start=$(date +%s)
$ENGINE build "${FORMAT[@]}" "${BUILD_NET[@]}" \
  "${BUILD_ARGS[@]}" -t "$IMAGE" . > "$WORK/build.log" 2>&1 \
  || { tail -20 "$WORK/build.log"; die "the image did not build"; }
[ -n "${INDEX_PID:-}" ] && kill "$INDEX_PID" 2> /dev/null && INDEX_PID=
SIZE=$($ENGINE image inspect "$IMAGE" --format '{{.Size}}')
USER_=$($ENGINE image inspect "$IMAGE" --format '{{.Config.User}}')
if [ $ENGINE = podman ]; then
  HC=$(podman image inspect "$IMAGE" --format '{{json .HealthCheck}}')
else
  HC=$(docker image inspect "$IMAGE" --format '{{json .Config.Healthcheck}}')
fi
result PASS "image $IMAGE built in $(( $(date +%s) - start ))s: $(( SIZE / 1000000 )) MB, user $USER_"
[ "$USER_" = specserve ] || result FAIL "the image runs as '$USER_', not the non-root specserve"
[[ $HC == *"/health"* ]] || result FAIL "the image has no HEALTHCHECK on /health: $HC"

# -- 2. nginx and Prometheus images ------------------------------------------------------------
export SPECSERVE_IMAGE=$IMAGE
SERVICES=(fetch-models specserve-1 specserve-2 nginx prometheus)
if [ $REGISTRY = 0 ]; then
  for tool in nginx prometheus; do
    $ENGINE build "${FORMAT[@]}" --build-arg "BASE_IMAGE=$BASE" \
      -t "localhost/specserve-check-$tool:debian" -f "scripts/image_check/$tool.Containerfile" \
      scripts/image_check > "$WORK/build-$tool.log" 2>&1 || die "the $tool image did not build"
  done
  export NGINX_IMAGE=localhost/specserve-check-nginx:debian
  export PROMETHEUS_IMAGE=localhost/specserve-check-prometheus:debian
  result NOTE "nginx and Prometheus images made from Debian's packages (nginx 1.22, Prometheus 2.42)"
  result NOTE "Grafana's image cannot be fetched here (no registry, not in Debian): grafana not \
started; the dashboard's queries are evaluated by the real Prometheus below instead"
else
  SERVICES+=(grafana)
fi

# -- 3. compose up: the models into the volume, two replicas, nginx, Prometheus ---------------
COMPOSE_CMD=("${COMPOSE[@]}" -p "$PROJECT" -f docker-compose.yml "${CA_FILES[@]}")
ctr() {  # the container of a service
  $ENGINE ps -a -q --filter "label=com.docker.compose.project=$PROJECT" \
    --filter "label=com.docker.compose.service=$1" | head -1
}
health() {  # a container's health-check status
  $ENGINE inspect "$1" --format '{{if .State.Health}}{{.State.Health.Status}}{{end}}' 2>/dev/null
}
ready() { $ENGINE exec "$1" curl -fsS -o /dev/null --max-time 3 http://127.0.0.1:8000/ready 2>/dev/null; }
wait_ready() {  # wait_ready CONTAINER SECONDS: polls /ready inside the container
  local deadline=$(( $(date +%s) + $2 ))
  until ready "$1"; do
    [ "$(date +%s)" -ge $deadline ] && return 1
    sleep 1
  done
}
started_at() { date -d "$($ENGINE inspect "$1" --format '{{.State.StartedAt}}' | sed 's/ [A-Z]*$//; s/ +0000/Z/')" +%s.%N; }

"${COMPOSE_CMD[@]}" down > /dev/null 2>&1  # what a previous --keep run left
# fetch-models first, then the rest with --no-deps: podman-compose turns depends_on into podman's
# --requires, and podman then never restarts a killed replica (its requirement, the finished
# fetch-models job, is not running). docker compose gives the same result either way.
say "compose up fetch-models (log: $WORK/up.log)"
UP=1
"${COMPOSE_CMD[@]}" up -d fetch-models > "$WORK/up.log" 2>&1 \
  || { tail -20 "$WORK/up.log"; die "compose up fetch-models failed"; }
FETCH=$(ctr fetch-models)
$ENGINE wait "$FETCH" > /dev/null 2>&1
code=$($ENGINE inspect "$FETCH" --format '{{.State.ExitCode}}')
[ "$code" = 0 ] || { $ENGINE logs "$FETCH" 2>&1 | tail -20; die "fetch-models exited $code"; }
result PASS "fetch-models: \`specserve models fetch\` filled the models volume (exit 0)"
say "compose up --no-deps ${SERVICES[*]:1}"
"${COMPOSE_CMD[@]}" up -d --no-deps "${SERVICES[@]:1}" >> "$WORK/up.log" 2>&1 \
  || { tail -20 "$WORK/up.log"; die "compose up failed"; }
R1=$(ctr specserve-1) R2=$(ctr specserve-2)
[ -n "$R1" ] && [ -n "$R2" ] || die "the replicas were not created"

# podman runs health checks from systemd timers; where systemd is not running, nothing would.
if [ $ENGINE = podman ] && [ ! -d /run/systemd/system ]; then
  ( while sleep 15; do for c in "$R1" "$R2"; do podman healthcheck run "$c" > /dev/null 2>&1; done; done ) &
  HEALTH_PID=$!
  result NOTE "podman without systemd runs no health-check timers: this script runs \
\`podman healthcheck run\` every 15 s (the compose interval) in their place"
fi
for c in "$R1" "$R2"; do
  s=$(health "$c")
  [ "$s" = starting ] || result FAIL "$(name "$c"): health '$s' right after start, not 'starting'"
done
name() { $ENGINE inspect "$1" --format '{{index .Config.Labels "com.docker.compose.service"}}'; }
for c in "$R1" "$R2"; do
  wait_ready "$c" 900 || { $ENGINE logs "$c" 2>&1 | tail -30; die "$(name "$c") not ready within 900 s"; }
  result PASS "$(name "$c") ready $(printf '%.0f' "$(echo "$(date +%s.%N) - $(started_at "$c")" | bc)")s \
after its container started (first start: kernels built into the image, models in the volume)"
done
deadline=$(( $(date +%s) + 60 ))
until [ "$(health "$R1")" = healthy ] && [ "$(health "$R2")" = healthy ]; do
  [ "$(date +%s)" -ge $deadline ] && break
  sleep 2
done
for c in "$R1" "$R2"; do
  s=$(health "$c")
  [ "$s" = healthy ] && result PASS "$(name "$c"): health check starting -> healthy" \
    || result FAIL "$(name "$c"): health '$s', not healthy, after /ready answered"
done

# -- 4. requests through nginx -----------------------------------------------------------------
API=http://127.0.0.1:8080/v1
if "$PY" scripts/image_check/client.py basic "$API"; then
  result PASS "a chat completion and a streamed completion through nginx (openai client)"
else
  result FAIL "requests through nginx"
fi

# -- 5. Prometheus -----------------------------------------------------------------------------
for _ in 1 2; do "$PY" scripts/image_check/client.py basic "$API" > /dev/null; done  # both busy
sleep 12  # two scrape intervals
if "$PY" scripts/image_check/client.py prom http://127.0.0.1:9090 deploy/grafana/specserve.json; then
  result PASS "Prometheus scrapes both replicas; acceptance and tokens/s series; dashboard queries"
else
  result FAIL "Prometheus"
fi

# -- 6. stop one replica under load: it drains, nginx sends new requests to the other --------
in_flight() {  # requests running on a replica, from its own /metrics
  $ENGINE exec "$1" curl -fsS --max-time 3 http://127.0.0.1:8000/metrics 2>/dev/null \
    | awk '/^specserve:num_requests_running/ {print int($2)}'
}
start_load() {  # start_load NAME
  rm -f "$WORK/$1.stop" "$WORK/$1.json"
  "$PY" scripts/image_check/client.py load "$API" "$WORK/$1.json" "$WORK/$1.stop" \
    --concurrency 3 &
  LOAD_PID=$!
}
stop_load() { touch "$WORK/$1.stop"; wait "$LOAD_PID"; LOAD_PID=; }
wait_busy() {  # wait until the replica has a request running
  local deadline=$(( $(date +%s) + 120 ))
  until [ "$(in_flight "$1")" -gt 0 ] 2>/dev/null; do
    [ "$(date +%s)" -ge $deadline ] && return 1
    sleep 0.5
  done
}

say "stop of specserve-1 under a client sending requests throughout"
start_load stop
wait_busy "$R1" || result FAIL "specserve-1 never had a request in flight"
busy=$(in_flight "$R1")
start=$(date +%s.%N)
"${COMPOSE_CMD[@]}" stop specserve-1 > "$WORK/stop.log" 2>&1
took=$(echo "$(date +%s.%N) - $start" | bc)
code=$($ENGINE inspect "$R1" --format '{{.State.ExitCode}}')
sleep 10  # requests after the stop go to specserve-2 alone
stop_load stop
grace=$(awk '/stop_grace_period/ {gsub("s","",$2); print $2; exit}' docker-compose.yml)
if [ "$code" = 0 ] && [ "$(echo "$took < $grace" | bc)" = 1 ]; then
  result PASS "stop: specserve-1 ($busy in flight) drained and exited 0 in $(printf %.1f "$took")s (grace ${grace}s)"
else
  result FAIL "stop: specserve-1 exited $code after $(printf %.1f "$took")s (grace ${grace}s)"
fi
if "$PY" scripts/image_check/client.py verdict "$WORK/stop.json" --expect-failures none; then
  result PASS "stop: zero failed requests through nginx"
else
  result FAIL "stop: requests failed through nginx while a replica drained"
fi
"${COMPOSE_CMD[@]}" start specserve-1 >> "$WORK/stop.log" 2>&1
start=$(date +%s)
wait_ready "$R1" 600 || die "specserve-1 not ready again after start"
result PASS "specserve-1 started again: ready in $(( $(date +%s) - start ))s (kernels cached)"

# -- 7. kill -9 one replica under load: clean errors, failover, restart, healthy again -------
say "kill -9 of specserve-2's server process under a client sending requests throughout"
start_load kill
wait_busy "$R2" || result FAIL "specserve-2 never had a request in flight"
busy=$(in_flight "$R2")
pid=$($ENGINE inspect "$R2" --format '{{.State.Pid}}')
restarts=$($ENGINE inspect "$R2" --format '{{.RestartCount}}')
killed_at=$(date +%s.%N)
kill -9 "$pid" || die "kill -9 $pid failed"
killed=$(date +%s)
seen_starting=0 deadline=$(( killed + 600 ))
until [ "$($ENGINE inspect "$R2" --format '{{.State.Running}}')" = true ] \
    && [ "$($ENGINE inspect "$R2" --format '{{.State.Pid}}')" != "$pid" ]; do
  [ "$(date +%s)" -ge $deadline ] && die "specserve-2 was not restarted by its restart policy"
  sleep 0.5
done
result PASS "kill -9: the restart policy restarted specserve-2 after $(( $(date +%s) - killed ))s \
(restart count $restarts -> $($ENGINE inspect "$R2" --format '{{.RestartCount}}'))"
[ "$(health "$R2")" = starting ] && seen_starting=1
wait_ready "$R2" 600 || die "specserve-2 not ready after its restart"
result PASS "kill -9: specserve-2 ready again $(( $(date +%s) - killed ))s after the kill"
deadline=$(( $(date +%s) + 60 ))
until [ "$(health "$R2")" = healthy ] || [ "$(date +%s)" -ge $deadline ]; do sleep 2; done
s=$(health "$R2")
if [ $seen_starting = 1 ] && [ "$s" = healthy ]; then
  result PASS "kill -9: specserve-2's health check went starting -> healthy"
else
  result FAIL "kill -9: specserve-2's health: starting seen=$seen_starting, now '$s'"
fi
sleep 10  # requests with both replicas up again
stop_load kill
served() {  # chat completions a replica answered 200 since its (re)start, from its /metrics
  $ENGINE exec "$1" curl -fsS --max-time 3 http://127.0.0.1:8000/metrics 2>/dev/null | awk \
    '/^specserve:http_requests_total\{.*chat\/completions.*status="200"/ {s += $2} END {print int(s)}'
}
n=$(served "$R2")
[ "${n:-0}" -gt 0 ] && result PASS "kill -9: nginx sends requests to the restarted specserve-2 ($n answered)" \
  || result FAIL "kill -9: nginx sent no request to the restarted specserve-2"
if "$PY" scripts/image_check/client.py verdict "$WORK/kill.json" --expect-failures clean \
    --kill-time "$killed_at"; then
  result PASS "kill -9 ($busy in flight on it): only requests in flight on it failed, as clean \
errors; nginx sent every later one to the other replica"
else
  result FAIL "kill -9: a request hung or nothing succeeded after the kill"
fi

summary
exit $FAILED
