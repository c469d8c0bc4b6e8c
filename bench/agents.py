"""Agent-shaped traffic: 8 multi-turn tool-calling tasks against the server on the default
config, with speculation and without, in ONE run.

    python bench/agents.py [--config configs/default.yaml] [--quick] [-- extra serve flags]

Each task of bench/prompts/agents.json (written for this benchmark) is a user question that
needs one or two tool calls; the loop is an agent's: the official client with `tools` and
`tool_choice` left at auto, greedy, each call answered with the task's canned result, the
conversation growing each turn, until the model answers in text (4 model turns at most). A task
is done correctly when the model called exactly the expected tools with the expected arguments
and its final answer quotes the results.

The 8 tasks run twice on one server: with speculation, then with `"speculative": false`, each
pass with its own `cache_salt` (so neither pass drafts from, nor reuses the prefix cache of, the
other). Reports tasks correct, completion tokens/s per pass (tokens over the requests' wall
time, prefill included; and after the first token: decode), whether the greedy answers were
identical, the prompt tokens the prefix cache served and the suffix proposer's drafted/accepted
tokens. Prints a table, ends with a RESULT line, writes bench/results/agents.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from results_file import write_results  # noqa: E402
from server_utils import ServerProcess  # noqa: E402

MAX_TURNS = 4
FIELDS = ("tokens", "seconds", "decode_tokens", "decode_seconds", "prompt", "cached", "drafted",
          "accepted", "suffix_drafted", "suffix_accepted")


def run_task(client, model: str, spec: dict, task: dict, salt: str, max_tokens: int) -> dict:
    """One agent loop; returns what it did and what it cost."""
    messages = [{"role": "system", "content": spec["instructions"]},
                {"role": "user", "content": task["question"]}]
    made, answers = [], []
    stats = dict.fromkeys(FIELDS, 0)
    for _ in range(MAX_TURNS):
        content, calls = _turn(client, model, spec, messages, salt, max_tokens, stats)
        answers.append((content, [(c["function"]["name"], c["function"]["arguments"])
                                  for c in calls]))
        if not calls:
            break
        messages.append({"role": "assistant", "content": content, "tool_calls": calls})
        for call in calls:
            made.append((call["function"]["name"], json.loads(call["function"]["arguments"])))
            messages.append({"role": "tool", "tool_call_id": call["id"],
                             "content": _result(task, made[-1])})
    final = answers[-1][0] if not answers[-1][1] else None
    return {"ok": _correct(task, made, final), "made": made, "final": final,
            "answers": answers, "turns": len(answers), **stats}


def _turn(client, model: str, spec: dict, messages: list, salt: str, max_tokens: int,
          stats: dict) -> tuple[str | None, list[dict]]:
    """One streamed model turn: (content, tool calls); the time from the request to the first
    token (a chunk with its logprob) and from there to the end go into `stats`."""
    content, calls, usage, first = [], {}, None, None
    t0 = time.perf_counter()
    for chunk in client.chat.completions.create(
            model=model, messages=messages, tools=spec["tools"], temperature=0,
            max_tokens=max_tokens, stream=True, logprobs=True,
            stream_options={"include_usage": True},
            extra_body={"cache_salt": salt, "speculative": salt != "plain"}):
        usage = chunk.usage or usage
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        if first is None and chunk.choices[0].logprobs and chunk.choices[0].logprobs.content:
            first = time.perf_counter()
        content.append(delta.content or "")
        for tc in delta.tool_calls or []:  # each call arrives whole
            calls[tc.index] = {"id": tc.id, "type": "function", "function": {
                "name": tc.function.name, "arguments": tc.function.arguments}}
    end = time.perf_counter()
    _count(stats, usage, end - t0, end - (first or end))
    return "".join(content) or None, [calls[i] for i in sorted(calls)]


def _count(stats: dict, usage, seconds: float, decode_seconds: float) -> None:
    stats["tokens"] += usage.completion_tokens
    stats["seconds"] += seconds
    stats["decode_tokens"] += usage.completion_tokens - 1
    stats["decode_seconds"] += decode_seconds
    stats["prompt"] += usage.prompt_tokens
    stats["cached"] += usage.prompt_tokens_details.cached_tokens
    spec = (usage.model_extra or {}).get("speculative") or {}
    stats["drafted"] += spec.get("drafted_tokens", 0)
    stats["accepted"] += spec.get("accepted_tokens", 0)
    suffix = spec.get("methods", {}).get("suffix", {})
    stats["suffix_drafted"] += suffix.get("drafted_tokens", 0)
    stats["suffix_accepted"] += suffix.get("accepted_tokens", 0)


def _matches(expected: dict, args: dict) -> bool:
    """Numbers equal, strings containing the expected text (case-insensitive)."""
    for key, want in expected.items():
        got = args.get(key)
        if isinstance(want, str):
            if not isinstance(got, str) or want not in got.lower():
                return False
        elif got != want:
            return False
    return True


def _result(task: dict, call: tuple[str, dict]) -> str:
    for expected in task["calls"]:
        if expected["name"] == call[0] and _matches(expected["args"], call[1]):
            return expected["result"]
    return "error: no such record"


def _correct(task: dict, made: list, final: str | None) -> bool:
    """Exactly the expected calls (in any order) and a final answer quoting every result."""
    if final is None or len(made) != len(task["calls"]):
        return False
    unmatched = list(task["calls"])
    for name, args in made:
        hit = next((e for e in unmatched if e["name"] == name and _matches(e["args"], args)),
                   None)
        if hit is None:
            return False
        unmatched.remove(hit)
    text = final.replace(",", "").lower()
    return all(a.lower() in text for a in task["answer"])


def run_pass(client, model: str, spec: dict, tasks: list, salt: str, max_tokens: int) -> list:
    return [run_task(client, model, spec, t, salt, max_tokens) for t in tasks]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "default.yaml"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--quick", action="store_true", help="2 tasks")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "agents.md"))
    parser.add_argument("serve_flags", nargs="*", help="more `specserve serve` flags")
    args = parser.parse_args()
    spec = json.loads((ROOT / "bench" / "prompts" / "agents.json").read_text())
    tasks = spec["tasks"][:2] if args.quick else spec["tasks"]

    import openai

    srv = ServerProcess(["--config", args.config, "--num-threads", str(args.threads),
                         *args.serve_flags]).wait_ready(timeout=600)
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        run_task(client, model, spec, tasks[0], "warm-up", 8)  # load, compile, first masks
        runs = {salt: run_pass(client, model, spec, tasks, salt, args.max_tokens)
                for salt in ("spec", "plain")}
    finally:
        srv.terminate()
    return report(args, model, tasks, runs)


def report(args, model: str, tasks: list, runs: dict) -> int:
    spec_runs, plain_runs = runs["spec"], runs["plain"]
    lines = ["| task | ok spec | ok plain | turns | calls made | completion tokens | "
             "spec tok/s | plain tok/s | same answers | cached prompt share | "
             "suffix accepted/drafted |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for i, (s, p) in enumerate(zip(spec_runs, plain_runs)):
        calls = "; ".join(f"{n}({json.dumps(a)})" for n, a in s["made"]) or "none"
        lines.append(
            f"| {i + 1} | {'yes' if s['ok'] else 'no'} | {'yes' if p['ok'] else 'no'} | "
            f"{s['turns']} | {calls} | {s['tokens']} | {s['tokens'] / s['seconds']:.2f} | "
            f"{p['tokens'] / p['seconds']:.2f} | {'yes' if s['answers'] == p['answers'] else 'NO'}"
            f" | {s['cached'] / max(s['prompt'], 1):.2f} | "
            f"{s['suffix_accepted']}/{s['suffix_drafted']} |")
    total = {k: {f: sum(r[f] for r in rs) for f in FIELDS} for k, rs in runs.items()}
    rate = {k: t["tokens"] / t["seconds"] for k, t in total.items()}
    decode = {k: t["decode_tokens"] / t["decode_seconds"] for k, t in total.items()}
    ok = sum(r["ok"] for r in spec_runs)
    same = sum(s["answers"] == p["answers"] for s, p in zip(spec_runs, plain_runs))
    t = total["spec"]
    lines.append(f"| all | {ok}/{len(tasks)} | {sum(r['ok'] for r in plain_runs)}/{len(tasks)} "
                 f"| | | {t['tokens']} | {rate['spec']:.2f} | {rate['plain']:.2f} | "
                 f"{same}/{len(tasks)} | {t['cached'] / max(t['prompt'], 1):.2f} | "
                 f"{t['suffix_accepted']}/{t['suffix_drafted']} |")
    table = "\n".join(lines)
    result = (f"RESULT agent_tasks_ok={ok}/{len(tasks)} "
              f"agent_spec_vs_plain={rate['spec'] / rate['plain']:.2f} "
              f"agent_decode_spec_vs_plain={decode['spec'] / decode['plain']:.2f}")
    print(table)
    for i, r in enumerate(spec_runs):
        print(f"task {i + 1} final answer: {r['final']!r}")
    print(result)
    write_results(args.out, "Agent tasks (tool calling, multi-turn)", args.threads, [
        f"server: `specserve serve --config {Path(args.config).name}"
        f"{' ' + ' '.join(args.serve_flags) if args.serve_flags else ''}`, model {model}",
        f"{len(tasks)} tasks from bench/prompts/agents.json, tool_choice auto, greedy, "
        f"{args.max_tokens} new tokens at most per turn, {MAX_TURNS} model turns at most",
        "the same tasks with speculation, then with `speculative: false`, each pass with its "
        "own cache_salt; ok = exactly the expected calls and a final answer quoting the results",
        "tok/s: completion tokens over the requests' wall time (prefill included); decode: "
        "after the first token (streamed with logprobs, so every step sends a chunk)",
        f"decode tok/s with speculation {decode['spec']:.2f}, plain {decode['plain']:.2f}",
        f"all drafted/accepted tokens with speculation: {t['drafted']}/{t['accepted']}; "
        f"prompt tokens {t['prompt']}, of which the prefix cache served {t['cached']}",
        *[f"task {i + 1} final answer: {r['final']!r}" for i, r in enumerate(spec_runs)]],
        table, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
