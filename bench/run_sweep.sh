#!/usr/bin/env bash
# Serving sweep through HTTP on the packaged Qwen pair as `make serve` serves it
# (configs/default.yaml: int4 on the CPU, hybrid speculation): speculation off, the default
# (hybrid), the draft model alone; each a concurrency sweep with `specserve bench serve`.
# Writes bench/results/serve_sweep/{plain,hybrid,draft_model}/ and the comparison plots in
# bench/results/serve_sweep/, and ends with the RESULT line (the default vs plain).
# EXTRA="--quantization none" sweeps the bf16 target instead.
#   CONCURRENCY=1,2,4,8,16 MAX_TOKENS=64 DATASET=bench/prompts/chat.jsonl bench/run_sweep.sh
set -euo pipefail
cd "$(dirname "$0")/.."
SPECSERVE=${SPECSERVE:-.venv/bin/specserve}
PY=${PY:-.venv/bin/python}
OUT=${OUT:-bench/results/serve_sweep}
PORT=${PORT:-8011}
CONCURRENCY=${CONCURRENCY:-1,2,4,8,16}
MAX_TOKENS=${MAX_TOKENS:-64}
DATASET=${DATASET:-bench/prompts/chat.jsonl}
EXTRA=${EXTRA:-}
mkdir -p "$OUT"

run() {
  local name=$1; shift
  "$SPECSERVE" serve --config configs/default.yaml --port "$PORT" --fetch-missing \
      --log-level warning $EXTRA "$@" > "$OUT/$name.server.log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 900); do
    curl -fs "http://127.0.0.1:$PORT/ready" > /dev/null 2>&1 && break
    kill -0 "$pid" 2> /dev/null || { cat "$OUT/$name.server.log"; exit 1; }
    sleep 1
  done
  "$SPECSERVE" bench serve --base-url "http://127.0.0.1:$PORT/v1" --dataset "$DATASET" \
      --concurrency "$CONCURRENCY" --max-tokens "$MAX_TOKENS" --label "$name" --out "$OUT/$name"
  kill -TERM "$pid"
  wait "$pid" || true
}

run plain --speculative none
run hybrid
run draft_model --speculative draft_model

"$PY" - "$OUT" <<'PYEOF'
import json, sys
from pathlib import Path
sys.path.insert(0, "bench")
from serving_client import load_results, plot
out = Path(sys.argv[1])
runs = [load_results(out / name) for name in ("plain", "hybrid", "draft_model")]
plot(runs, out)
levels = {label: {lv["concurrency"]: lv["output_tokens_per_s"] for lv in lvs} for label, lvs in runs}
plain, hybrid, draft = levels["plain"], levels["hybrid"], levels["draft_model"]
ratios = {c: hybrid[c] / plain[c] for c in plain if plain[c] > 0}
draft_ratios = {c: draft[c] / plain[c] for c in plain if plain[c] > 0}
lines = ["| concurrency | plain tok/s | hybrid (default) tok/s | draft model tok/s | hybrid/plain | draft/plain |",
         "|---|---|---|---|---|---|"]
lines += [f"| {c} | {plain[c]:.2f} | {hybrid[c]:.2f} | {draft[c]:.2f} | {ratios[c]:.2f} | "
          f"{draft_ratios[c]:.2f} |" for c in sorted(plain)]
first = min(ratios)
result = (f"RESULT c1_speedup={ratios[first]:.2f} worst_ratio={min(ratios.values()):.2f} "
          f"best_ratio={max(ratios.values()):.2f} draft_c1_speedup={draft_ratios[first]:.2f}")
(out / "summary.md").write_text("# Serving sweep\n\n" + "\n".join(lines)
                                + "\n\n![tokens/s](tokens_per_s.png)\n![ITL](itl.png)\n\n`"
                                + result + "`\n")
print("\n".join(lines))
print(result)
PYEOF
