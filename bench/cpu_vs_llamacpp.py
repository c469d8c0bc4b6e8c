"""The Qwen2.5-Coder pair on this CPU: specserve (bf16, int4, int4 + speculation) against
llama.cpp's server on the same GGUF files, in one run, through each server's OpenAI API.

    python bench/cpu_vs_llamacpp.py [--llama-server PATH] [--max-tokens 128] [--threads 2]

llama.cpp: `llama-server` built from the `llama-cpp-python` source package (its vendored
llama.cpp; scripts/build_llamacpp.sh builds it native to this CPU, AMX off only where the AMX
build crashes, and its VERSION file, quoted in the results, says which and why), run with the target GGUF (Q4_K_M) plain and with the
draft GGUF (`-md ... --spec-type draft-simple`, its default draft length). specserve: the same
target de-quantized to bf16 (the reference), `--quantization int4` (the GGUF's Q4_K blocks as
they are, its Q6_K layers re-quantized to int4), int4 with the int4 draft and adaptive k, and
int4 with suffix speculation (drafts from the text so far, no draft model).

Workload: the 8 chat prompts of bench/prompts/chat.jsonl, greedy, at most --max-tokens new
tokens each; c=1 (one request at a time: tokens/s = tokens / time of the requests) and c=8 (all
8 at once: tokens / wall time), every request streamed; at c=1 also the decode steps' rate
(the tokens after the first over the time from the first streamed token to the last: what one
decode step costs served, without the prefill). Reported besides speed: each engine's speculative output vs its
own plain output (greedy identity: answers identical, and the mean share of an answer before
the first difference), int4 vs bf16 (what quantization changes), c=8 vs c=1, and memory (RSS
of the server process after the run, and its peak).

Per-forward costs, in this process on the same settings (the int4 target and the int4 draft
with its vocabulary subset, batch invariance on, a 200-token context): the target's forward of
1 new token, of 1 + 4 (a verification), and the draft's forward of 1 token; the median of 12.
The memory roofline: the bytes of weights a decode step reads (every weight but the embedding
table, of which one row), the machine's read bandwidth (a streaming read of 1 GiB, far larger
than the L3, by a vectorised loop compiled for the CPU, in this run), and the fraction of that floor our plain c=1 decode steps reach served (roofline_fraction; with
the prefills counted: roofline_fraction_with_prefill).

Ends with `RESULT ours_plain_vs_llamacpp_plain=… roofline_fraction=…
roofline_fraction_with_prefill=… ours_plain_vs_llamacpp_plain_decode=… verify5_vs_step1=…
draft_vs_target_step=… ours_spec_vs_llamacpp_plain=… ours_c8_vs_llamacpp_c8=…
int4_spec_vs_int4_plain=… suffix_vs_int4_plain=… int4_vs_bf16_plain=…
ours_spec_vs_llamacpp_spec=… ours_suffix_vs_llamacpp_plain=…` (ours spec: int4 + the int4
draft model; at c=8: int4 + the draft; llama.cpp at c=8: the faster of its two settings;
suffix: int4 with suffix speculation, no draft model) and writes
bench/results/cpu_vs_llamacpp_<maker>.md (intel, amd or other: kernels cost differently by CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from results_file import cpu_vendor, write_results  # noqa: E402
from server_utils import ServerProcess, free_port, wait_ok  # noqa: E402

from engine.models import recipes  # noqa: E402

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
CONTEXT = 8192  # tokens of KV cache, both servers
KV_BYTES_PER_TOKEN = {TARGET: 28 * 2 * 256 * 2, DRAFT: 24 * 2 * 128 * 2}  # layers x K,V x bf16
DEFAULT_LLAMA = Path.home() / ".cache" / "specserve" / "llamacpp" / "bin" / "llama-server"


def rss_gb(pid: int, field: str) -> float:
    """VmHWM: the peak (loading included: a memory-mapped weights file counts while it is
    read); VmRSS: now."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1e6
    return float("nan")


class LlamaServer:
    def __init__(self, binary: Path, target: Path, draft: Path | None, threads: int) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [str(binary), "-m", str(target), "-t", str(threads), "-tb", str(threads),
               "-c", str(CONTEXT), "-np", "8", "--temp", "0", "--host", "127.0.0.1",
               "--port", str(self.port)]
        if draft is not None:
            cmd += ["-md", str(draft), "--spec-type", "draft-simple", "-td", str(threads)]
        self.cmd = cmd
        self.log_path = Path("/tmp") / f"llama-server-{self.port}.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 300) -> "LlamaServer":
        if not wait_ok(self.url + "/health", timeout, lambda: self.proc.poll() is None):
            raise RuntimeError(f"llama-server did not start:\n{self.log_path.read_text()[-3000:]}")
        return self

    def terminate(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        self._log.close()


def chat(url: str, messages: list, max_tokens: int) -> dict:
    """One streamed greedy chat completion: its text, tokens, seconds, and the decode steps'
    seconds (from the first content to the last: every token after the prefill's)."""
    body = {"model": "bench", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    text, stamps, tokens = [], [], None
    t0 = time.perf_counter()
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=1800) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices") or []:
                if (choice.get("delta") or {}).get("content"):
                    text.append(choice["delta"]["content"])
                    stamps.append(time.perf_counter())
    if tokens is None:
        raise RuntimeError(f"{url}: no usage in the stream")
    return {"text": "".join(text), "tokens": tokens, "seconds": time.perf_counter() - t0,
            "decode": stamps[-1] - stamps[0] if len(stamps) > 1 else 0.0}


def measure(url: str, prompts: list, max_tokens: int) -> dict:
    """c=1: tokens over the requests' time (prefill included) and the decode steps' rate
    (tokens after the first over the time from the first to the last); c=8: over the wall."""
    chat(url, [{"role": "user", "content": "Hello"}], 8)  # warm-up
    c1 = [chat(url, p, max_tokens) for p in prompts]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        c8 = list(pool.map(lambda p: chat(url, p, max_tokens), prompts))
    wall = time.perf_counter() - t0
    return {"texts": [c["text"] for c in c1], "texts_c8": [c["text"] for c in c8],
            "c1": sum(c["tokens"] for c in c1) / sum(c["seconds"] for c in c1),
            "c1_decode": sum(c["tokens"] - 1 for c in c1) / sum(c["decode"] for c in c1),
            "c8": sum(c["tokens"] for c in c8) / wall, "tokens": sum(c["tokens"] for c in c1)}


_READ_LOOP = r"""
#include <torch/extension.h>
#include <cstring>
typedef long long v8 __attribute__((vector_size(64)));
// XOR of every 64-byte line of x, over `threads` OpenMP threads: four independent vector
// accumulators per 256 bytes (zmm registers where the CPU has AVX-512, two ymm elsewhere)
int64_t read_all(torch::Tensor x, int64_t threads) {
  const char* p = reinterpret_cast<const char*>(x.data_ptr());
  const int64_t n = x.numel() * x.element_size() / 256;
  int64_t out = 0;
  #pragma omp parallel num_threads(threads) reduction(+:out)
  {
    v8 a[4] = {};
    #pragma omp for schedule(static)
    for (int64_t c = 0; c < n; ++c)
      for (int j = 0; j < 4; ++j) { v8 v; std::memcpy(&v, p + c * 256 + j * 64, 64); a[j] ^= v; }
    v8 s = a[0] ^ a[1] ^ a[2] ^ a[3];
    for (int j = 0; j < 8; ++j) out += s[j];
  }
  return out;
}
"""


def read_bandwidth(threads: int, gib: int = 1) -> tuple[float, str]:
    """Bytes per second of a streaming read of a buffer far larger than any L3 over `threads`
    threads, the best of 8, and how it was read: a vectorised read loop compiled for this CPU
    (torch's fp32 sum reads ~10% slower on a Xeon: it is not the machine's bound), or torch's
    sum where nothing compiles."""
    import torch

    torch.set_num_threads(threads)
    x = torch.ones(gib << 28, dtype=torch.float32)
    how, read = "torch's fp32 sum", x.sum
    try:
        from torch.utils.cpp_extension import load_inline

        ext = load_inline("specserve_read_bandwidth", cpp_sources=_READ_LOOP,
                          functions=["read_all"], extra_cflags=["-O3", "-march=native",
                                                                "-fopenmp"],
                          extra_ldflags=["-fopenmp"])
        how, read = "a vectorised read loop, -march=native", lambda: ext.read_all(x, threads)
    except Exception as exc:  # noqa: BLE001 - no compiler: torch's sum, said so in the table
        print(f"read loop did not compile ({type(exc).__name__}); torch's sum measures")
    read()
    best = min(_timed(read) for _ in range(8))
    return x.numel() * 4 / best, how


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def step_bytes(model) -> int:
    """Bytes of weights one decode step reads: every weight but the embedding table, of which
    it reads one row (each storage once: merged projections are viewed by their parts)."""
    from engine.parallel.workers import model_bytes

    embed = model.get_input_embeddings().weight
    return model_bytes(model) - embed.untyped_storage().nbytes() \
        + embed.shape[1] * embed.element_size()


def forward_costs(threads: int, draft_vocab_size: int, context: int = 200) -> dict:
    """Median seconds of one runner forward: target 1 row, target 1 + 4 rows, draft 1 row;
    and the bytes of weights a decode step of each reads."""
    import torch

    from engine import EngineConfig, LLMEngine
    from engine.batch import RunItem

    torch.set_num_threads(threads)
    engine = LLMEngine(EngineConfig(
        model=TARGET, dtype="bfloat16", device="cpu", quantization="int4", num_threads=threads,
        kv_cache_memory_gb=0.25,
        speculative={"method": "draft_model", "draft_model": DRAFT,
                     "draft_quantization": "int4", "draft_vocab_size": draft_vocab_size,
                     "calibrate": False}))
    table = list(range(context // engine.config.block_size + 2))
    prompt = RunItem(list(range(1000, 1000 + context)), 0, table, 1, None)

    def median(runner, rows: int) -> float:
        item = RunItem(list(range(100, 100 + rows)), context, table, rows, context - 50)
        times = [_timed(lambda: runner.execute([item])) for _ in range(15)]
        return sorted(times[3:])[6]

    target, draft = engine.runner, engine.speculator.proposer.runner
    target.execute([prompt]), draft.execute([prompt])
    return {"target 1 row": median(target, 1), "target 1 + 4 rows": median(target, 5),
            "draft 1 row": median(draft, 1), "target bytes": step_bytes(target.model),
            "draft bytes": step_bytes(draft.model)}


def same(a: list[str], b: list[str]) -> str:
    """Answers identical, and the mean share of an answer before the first difference."""
    shared = [len(os.path.commonprefix([x, y])) / max(len(x), len(y), 1) for x, y in zip(a, b)]
    return f"{sum(x == y for x, y in zip(a, b))}/{len(a)} ({sum(shared) / len(shared):.0%})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-server", default=str(DEFAULT_LLAMA))
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--k-max", type=int, default=4)
    parser.add_argument("--draft-vocab-size", type=int, default=32768)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"
                                             / f"cpu_vs_llamacpp_{cpu_vendor()}.md"),
                        help="default: one file per CPU maker (intel, amd, other)")
    args = parser.parse_args()
    binary = Path(args.llama_server)
    if not binary.is_file():
        print(f"error: no llama-server at {binary}; build it with scripts/build_llamacpp.sh",
              file=sys.stderr)
        return 2
    version_file = binary.parent.parent / "VERSION"
    llama_version = ("; ".join(version_file.read_text().splitlines()) if version_file.is_file()
                     else "version unknown")  # the package, then the build options
    version = subprocess.run([str(binary), "--version"], capture_output=True, text=True)
    llama_version += "; " + " ".join((version.stdout + version.stderr).split())
    target_gguf, draft_gguf = recipes.source_gguf(TARGET), recipes.source_gguf(DRAFT)
    prompts = [json.loads(line)["messages"] for line in
               (ROOT / "bench" / "prompts" / "chat.jsonl").read_text().splitlines()
               if line.strip()]

    runs: dict[str, dict] = {}
    common = ["--model", TARGET, "--served-model-name", "bench", "--device", "cpu",
              "--dtype", "bfloat16", "--num-threads", str(args.threads)]
    ours = {
        "specserve bf16 plain": ["--speculative", "none"],
        "specserve int4 plain": ["--speculative", "none", "--quantization", "int4"],
        "specserve int4 + draft int4 (adaptive)": [
            "--quantization", "int4", "--speculative", "draft_model", "--draft-model", DRAFT,
            "--draft-quantization", "int4", "--k-max", str(args.k_max),
            "--draft-vocab-size", str(args.draft_vocab_size)],
        "specserve int4 + suffix (adaptive)": ["--quantization", "int4",
                                               "--speculative", "suffix"],
    }
    for name, extra in ours.items():
        # KV pools for CONTEXT tokens, as llama.cpp's -c (the pool is allocated up front)
        per_token = KV_BYTES_PER_TOKEN[TARGET] + (KV_BYTES_PER_TOKEN[DRAFT]
                                                  if "--draft-model" in extra else 0)
        env = {"SPECSERVE_KV_CACHE_MEMORY_GB": f"{CONTEXT * per_token / (1 << 30):.4f}"}
        srv = ServerProcess(common + extra, env=env).wait_ready(600)
        try:
            runs[name] = measure(srv.url, prompts, args.max_tokens)
            runs[name]["rss"] = (rss_gb(srv.proc.pid, "VmRSS"), rss_gb(srv.proc.pid, "VmHWM"))
        finally:
            srv.terminate()
        print(f"{name}: c1 {runs[name]['c1']:.2f} tok/s (decode "
              f"{runs[name]['c1_decode']:.2f}), c8 {runs[name]['c8']:.2f} tok/s",
              flush=True)
    for name, draft in (("llama.cpp Q4_K_M plain", None),
                        ("llama.cpp Q4_K_M + draft", draft_gguf)):
        srv = LlamaServer(binary, target_gguf, draft, args.threads).wait_ready()
        try:
            runs[name] = measure(srv.url, prompts, args.max_tokens)
            runs[name]["rss"] = (rss_gb(srv.proc.pid, "VmRSS"), rss_gb(srv.proc.pid, "VmHWM"))
            runs[name]["cmd"] = " ".join(Path(c).name if "/" in c else c for c in srv.cmd)
        finally:
            srv.terminate()
        print(f"{name}: c1 {runs[name]['c1']:.2f} tok/s (decode "
              f"{runs[name]['c1_decode']:.2f}), c8 {runs[name]['c8']:.2f} tok/s",
              flush=True)

    costs = forward_costs(args.threads, args.draft_vocab_size)
    bf16, int4, spec, suffix = (runs[n] for n in ours)
    lplain, lspec = runs["llama.cpp Q4_K_M plain"], runs["llama.cpp Q4_K_M + draft"]
    identity = {
        "specserve bf16 plain": "reference",
        "specserve int4 plain": f"vs bf16: {same(int4['texts'], bf16['texts'])}",
        "specserve int4 + draft int4 (adaptive)": f"vs int4 plain: "
                                                  f"{same(spec['texts'], int4['texts'])}",
        "specserve int4 + suffix (adaptive)": f"vs int4 plain: "
                                              f"{same(suffix['texts'], int4['texts'])}",
        "llama.cpp Q4_K_M plain": f"vs specserve bf16: {same(lplain['texts'], bf16['texts'])}",
        "llama.cpp Q4_K_M + draft": f"vs llama.cpp plain: "
                                    f"{same(lspec['texts'], lplain['texts'])}",
    }
    lines = ["| engine | c=1 tok/s | c=1 decode tok/s | c=8 tok/s | greedy identity (c=1) | "
             "c=8 == c=1 | RSS GB after the run (peak) |", "|---|---|---|---|---|---|---|"]
    for name, r in runs.items():
        lines.append(f"| {name} | {r['c1']:.2f} | {r['c1_decode']:.2f} | {r['c8']:.2f} | "
                     f"{identity[name]} | "
                     f"{same(r['texts_c8'], r['texts'])} | {r['rss'][0]:.2f} "
                     f"({r['rss'][1]:.2f}) |")
    bandwidth, read_how = read_bandwidth(args.threads)
    floor = costs["target bytes"] / bandwidth  # seconds: reading the weights once
    lines += ["", "| forward (in process, int4, 200-token context) | ms |", "|---|---|"]
    lines += [f"| {name} | {costs[name] * 1e3:.1f} |"
              for name in ("target 1 row", "target 1 + 4 rows", "draft 1 row")]
    lines += ["", "| memory roofline (c=1 plain decoding) | value |", "|---|---|",
              f"| weights read per decode step, target int4 | "
              f"{costs['target bytes'] / 1e9:.3f} GB |",
              f"| weights read per decode step, draft int4 (vocabulary subset) | "
              f"{costs['draft bytes'] / 1e9:.3f} GB |",
              f"| read bandwidth (streaming read of 1 GiB, {args.threads} threads, {read_how}) | "
              f"{bandwidth / 1e9:.1f} GB/s |",
              f"| floor: one target step reading its weights once | {floor * 1e3:.1f} ms "
              f"({1 / floor:.1f} tokens/s) |",
              f"| specserve int4 plain, served c=1: the decode steps / with the prefills | "
              f"{int4['c1_decode'] * floor:.2f} / {int4['c1'] * floor:.2f} of the roofline |",
              f"| specserve int4 target forward, 1 row | "
              f"{floor / costs['target 1 row']:.2f} of the roofline |",
              f"| llama.cpp Q4_K_M plain, served c=1: the decode steps / with the prefills | "
              f"{lplain['c1_decode'] * floor:.2f} / {lplain['c1'] * floor:.2f} of the "
              f"roofline (its own file's bytes differ a little) |"]
    table = "\n".join(lines)
    result = (f"RESULT ours_plain_vs_llamacpp_plain={int4['c1'] / lplain['c1']:.2f} "
              f"roofline_fraction={int4['c1_decode'] * floor:.2f} "
              f"roofline_fraction_with_prefill={int4['c1'] * floor:.2f} "
              f"ours_plain_vs_llamacpp_plain_decode="
              f"{int4['c1_decode'] / lplain['c1_decode']:.2f} "
              f"verify5_vs_step1={costs['target 1 + 4 rows'] / costs['target 1 row']:.2f} "
              f"draft_vs_target_step={costs['draft 1 row'] / costs['target 1 row']:.2f} "
              f"ours_spec_vs_llamacpp_plain={spec['c1'] / lplain['c1']:.2f} "
              f"ours_c8_vs_llamacpp_c8={spec['c8'] / max(lplain['c8'], lspec['c8']):.2f} "
              f"int4_spec_vs_int4_plain={spec['c1'] / int4['c1']:.2f} "
              f"suffix_vs_int4_plain={suffix['c1'] / int4['c1']:.2f} "
              f"int4_vs_bf16_plain={int4['c1'] / bf16['c1']:.2f} "
              f"ours_spec_vs_llamacpp_spec={spec['c1'] / lspec['c1']:.2f} "
              f"ours_suffix_vs_llamacpp_plain={suffix['c1'] / lplain['c1']:.2f}")
    print(table)
    print(result)
    write_results(args.out, "specserve vs llama.cpp on this CPU (Qwen2.5-Coder 1.5B + 0.5B)",
                  args.threads,
                  [f"llama.cpp: {llama_version}, "
                   f"`{lplain['cmd']}`; with draft: `{lspec['cmd']}`",
                   f"workload: bench/prompts/chat.jsonl (8 chat prompts), greedy, at most "
                   f"{args.max_tokens} new tokens, c=1 then all 8 at once (c=8); KV cache for "
                   f"{CONTEXT} tokens in both servers",
                   "specserve int4: the GGUF's Q4_K blocks as they are, Q6_K layers "
                   "(lm_head, half of v/down) re-quantized to int4 group 32; draft int4 likewise, "
                   f"its vocabulary cut to {args.draft_vocab_size} tokens (0: all)"],
                  table, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
