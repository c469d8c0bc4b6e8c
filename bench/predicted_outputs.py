"""Predicted Outputs (OpenAI's `prediction`) on whole-file code edits, against plain decoding
and the default hybrid speculation, in ONE run.

Workload (bench/prompts/predicted_outputs/, written for this project): 10 small source files
(8 Python, 1 TypeScript, 1 Go; 79-110 lines, 656-841 tokens) and edits.jsonl, one small edit per
file in the style of OpenAI's Predicted Outputs examples: rename, add_parameter, docstrings,
fix_bug. The prompt is the instruction (which asks for the full file only, in one code block),
then the file in a fenced code block; the prediction is the unedited file's text, as in
OpenAI's examples, so the answer mostly equals the prediction. All 10 run by default
(`--files N`: the first N; the first 4 hold one edit of each kind). Each request may generate the file's token count + 64
tokens (capped by `--max-tokens`, 1024: no file is capped), greedy, ending at the model's eos.

Cases, on the packaged pair as `make serve` serves it (target qwen2.5-coder-1.5b-instruct,
`--quantization auto`: int4 on the CPU; draft qwen2.5-coder-0.5b-instruct with int4 linears
and the 32,768-token vocabulary; adaptive k, k_max 6):
- plain: no speculation;
- hybrid: the default (suffix matches, which include the prompt's copy of the file, or the
  draft model), no prediction;
- prediction: hybrid + the request's prediction, on the hybrid case's engine (as a server
  serves both kinds of requests from one engine; as in spec_methods.py an engine's guard keeps
  what it measured from run to run, its suffix and prefix caches do not).
At concurrency 1 (the files one at a time) and 4 (`LLMEngine.generate` with 4 requests at
once). Per concurrency: plain, hybrid, prediction, `--repeats` times, then plain once more;
a case's ratio in a round is against the mean of the plain runs before and after it, so a drift
of this machine's speed favours no case. Every run starts with empty suffix and prefix caches.
Greedy identity: every run's token ids against plain's at the same concurrency, and plain's
at 4 against plain's at 1. The
accepted-prediction share is OpenAI's accepted_prediction_tokens
(engine.spec_decode.prediction.predicted_tokens) summed over the answers, over the answers'
tokens: a property of the answer, not of the speculation.

Time (2 cores, ~20 tokens/s plain at c=1, ~50 aggregate at c=4, prompts ~850 tokens prefilled
at ~200 tokens/s): 10 files x ~750 tokens, 1 repeat: 4 runs per concurrency; c=1 ~370 s a
plain run, c=4 ~150 s, ~45 s of prefill a run, ~60 s loading: about 30 minutes.
`--files 4 --repeats 2` is about as long.

    python bench/predicted_outputs.py [--files 10] [--repeats 1] [--max-tokens 1024]
                                      [--quantization auto|int4|none] [--quick]

`--quick`: 2 files, 48 tokens, 1 repeat, no results file (a smoke run). Prints a table per
(case, concurrency) and one per file, ends with a RESULT line, writes
bench/results/predicted_outputs.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import re
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import spec_methods as sm  # noqa: E402  (bench/: this script's directory)
from results_file import write_results  # noqa: E402

from engine import SamplingParams  # noqa: E402
from engine.spec_decode.prediction import predicted_tokens  # noqa: E402

WORKLOAD = ROOT / "bench/prompts/predicted_outputs"
FENCES = {".py": "python", ".ts": "typescript", ".js": "javascript", ".go": "go", ".rs": "rust"}
CASES = ("plain", "hybrid", "prediction")
CONCURRENCIES = (1, 4)
CODE_BLOCK = re.compile(r"```[\w+-]*\n(.*?)(?:```|\Z)", re.DOTALL)


@dataclasses.dataclass
class Edit:
    file: str
    kind: str
    code: str
    prompt: list[int]  # the chat-templated prompt's token ids
    prediction: list[int]  # the unedited file's token ids


@dataclasses.dataclass
class Run:
    outputs: list  # RequestOutput per request, in file order
    seconds: float

    @property
    def tokens(self) -> int:
        return sum(len(o.output_token_ids) for o in self.outputs)

    def by_method(self) -> dict[str, tuple[int, int]]:
        """method -> (drafted, accepted), summed over the requests."""
        by: dict[str, tuple[int, int]] = {}
        for o in self.outputs:
            for m, (d, a, *_) in o.spec_methods.items():
                by[m] = (by.get(m, (0, 0))[0] + d, by.get(m, (0, 0))[1] + a)
        return by


def load_edits(tok, n: int) -> list[Edit]:
    rows = [json.loads(line) for line in (WORKLOAD / "edits.jsonl").read_text().splitlines()
            if line.strip()]
    edits = []
    for row in rows[:n]:
        code = (WORKLOAD / row["file"]).read_text()
        fence = FENCES.get(Path(row["file"]).suffix, "")
        content = f"{row['instruction']}\n\n```{fence}\n{code}```"
        prompt = tok.apply_chat_template([{"role": "user", "content": content}],
                                         add_generation_prompt=True, tokenize=True,
                                         return_dict=False)
        edits.append(Edit(row["file"], row["kind"], code, prompt,
                          tok.encode(code, add_special_tokens=False)))
    return edits


def run(engine, label: str, prompts: list[list[int]], params: list[SamplingParams],
        concurrency: int) -> Run:
    """`concurrency` requests at a time, each group to completion before the next."""
    print(label, end="", flush=True)
    sm.forget_history(engine)
    outputs, t0 = [], time.perf_counter()
    for lo in range(0, len(prompts), concurrency):
        outputs += engine.generate(prompts[lo:lo + concurrency], params[lo:lo + concurrency])
    result = Run(outputs, time.perf_counter() - t0)
    print(f"  ({result.tokens} tokens in {result.seconds:.1f} s)", flush=True)
    return result


def accepted_share(edits: list[Edit], outputs) -> tuple[int, int]:
    """(OpenAI's accepted prediction tokens, answer tokens), summed over the requests."""
    return (sum(predicted_tokens(e.prediction, o.output_token_ids)
                for e, o in zip(edits, outputs)),
            sum(len(o.output_token_ids) for o in outputs))


def answer_vs_file(edit: Edit, output) -> str:
    """How the answer's code block differs from the file, in lines (for a finished answer)."""
    if output.finish_reason != "stop":
        return f"cut at max_tokens ({output.finish_reason})"
    text = output.text or ""
    blocks = list(CODE_BLOCK.finditer(text))
    if not blocks:
        return "no code block"
    block = blocks[0].group(1)
    outside = len((text[:blocks[0].start()] + text[blocks[0].end():]).strip())
    added = removed = 0
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(
            None, edit.code.splitlines(), block.splitlines(), autojunk=False).get_opcodes():
        if op != "equal":
            removed, added = removed + i2 - i1, added + j2 - j1
    more = f", {len(blocks)} code blocks" if len(blocks) > 1 else ""
    return (f"+{added} -{removed} lines of {len(edit.code.splitlines())}"
            f"{f', {outside} characters outside it' if outside else ''}{more}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=10,
                        help="the first N edits of edits.jsonl (4: one of each kind; 10: all)")
    parser.add_argument("--max-tokens", type=int, default=1024,
                        help="cap on each request's max tokens (the file's tokens + 64)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="rounds of every case per concurrency, interleaved with plain")
    sm.add_pair_arguments(parser)
    parser.add_argument("--quick", action="store_true",
                        help="2 files, 48 tokens, 1 repeat, no results file: a smoke run")
    parser.add_argument("--out", default=str(ROOT / "bench/results/predicted_outputs.md"))
    args = parser.parse_args()
    if args.quick:
        args.files, args.max_tokens, args.repeats = 2, 48, 1

    target, tok, form, draft = sm.load_pair(args)
    edits = load_edits(tok, args.files)
    prompts = [e.prompt for e in edits]
    plain_params = [SamplingParams(temperature=0, max_tokens=min(len(e.prediction) + 64,
                                                                  args.max_tokens))
                    for e in edits]
    params = {"plain": plain_params, "hybrid": plain_params,
              "prediction": [dataclasses.replace(p, prediction=e.prediction)
                             for p, e in zip(plain_params, edits)]}
    engines = {m: sm.make_engine(m, target, draft, tok, args.k_max, args.draft_vocab_size)
               for m in ("plain", "hybrid")}
    engines["prediction"] = engines["hybrid"]

    rows, rates, differs, shares, batched = [], {}, [], {}, ""
    reference = None  # plain's outputs at c=1, first round: the answers of record
    for c in CONCURRENCIES:
        # interleaved: plain, hybrid, prediction, `repeats` times, then plain once more
        passes = [{case: run(engines[case], f"c={c} round {i + 1} {case}", prompts,
                             params[case], c) for case in CASES}
                  for i in range(args.repeats)]
        closing = run(engines["plain"], f"c={c} closing plain", prompts, params["plain"], c)
        plain_runs = [p["plain"] for p in passes] + [closing]
        plain_rates = [r.tokens / r.seconds for r in plain_runs]
        plain_ids = [o.output_token_ids for o in plain_runs[0].outputs]
        if reference is None:
            reference = plain_runs[0].outputs
        else:  # batching leaves greedy output alone: plain at c against plain at c=1
            same = sum(o.output_token_ids == r.output_token_ids
                       for o, r in zip(plain_runs[0].outputs, reference))
            batched = f"plain c={c} vs plain c=1: {same}/{len(reference)}"
            if same < len(reference):
                differs.append(batched)
        for case in CASES:
            runs = plain_runs if case == "plain" else [p[case] for p in passes]
            tokens = sum(r.tokens for r in runs)
            seconds = sum(r.seconds for r in runs)
            rates[case, c] = tokens / seconds
            per_round = [p[case].tokens / p[case].seconds
                         / ((plain_rates[i] + plain_rates[i + 1]) / 2)
                         for i, p in enumerate(passes)]
            same = sum(o.output_token_ids == ref for r in runs
                       for o, ref in zip(r.outputs, plain_ids))
            total = sum(len(r.outputs) for r in runs)
            if same < total:
                differs.append(f"{case} c={c}: {same}/{total}")
            by: dict[str, tuple[int, int]] = {}
            for r in runs:
                for m, (d, a) in r.by_method().items():
                    by[m] = (by.get(m, (0, 0))[0] + d, by.get(m, (0, 0))[1] + a)
            accept = ", ".join(f"{m} {a}/{d}" for m, (d, a) in sorted(by.items()))
            share = "-"
            if case == "prediction":
                got, of = map(sum, zip(*(accepted_share(edits, r.outputs) for r in runs)))
                shares[c] = got / max(of, 1)
                share = f"{shares[c]:.2f} ({got}/{of})"
            ratio = rates[case, c] / rates["plain", c]
            spread = f"{min(per_round):.2f}-{max(per_round):.2f}"
            rows.append((case, c, len(edits), tokens, seconds, rates[case, c], ratio, spread,
                         f"{same}/{total}", share, accept))
            print(f"{case:10s} c={c} {rates[case, c]:6.2f} tok/s  x{ratio:.2f} (rounds "
                  f"{spread})  same={same}/{total}  accepted_share={share}  {accept}",
                  flush=True)

    header = ("| case | concurrency | requests | tokens | seconds | tokens/s | x plain | "
              "x plain per round (min-max) | greedy identical to plain | "
              "accepted prediction tokens / answer tokens | accepted/drafted by method |")
    table = "\n".join([header, "|" + "---|" * 11] + [
        f"| {case} | {c} | {n} | {t} | {s:.1f} | {r:.2f} | {x:.2f} | {sp} | {same} | {sh} | "
        f"{acc} |" for case, c, n, t, s, r, x, sp, same, sh, acc in rows])
    file_rows = []
    for e, o in zip(edits, reference):
        got = predicted_tokens(e.prediction, o.output_token_ids)
        file_rows.append(f"| {e.file} | {e.kind} | {len(e.prediction)} | "
                         f"{len(o.output_token_ids)} | {o.finish_reason} | {got} | "
                         f"{got / max(len(o.output_token_ids), 1):.2f} | "
                         f"{answer_vs_file(e, o)} |")
    file_header = ("| file | edit | file tokens | answer tokens | finish | accepted prediction "
                   "tokens | share of the answer | the answer's code block vs the file |")
    file_table = "\n".join([file_header, "|" + "---|" * 8] + file_rows)
    c4 = CONCURRENCIES[-1]
    result = (f"RESULT prediction_vs_plain={rates['prediction', 1] / rates['plain', 1]:.2f} "
              f"prediction_vs_hybrid={rates['prediction', 1] / rates['hybrid', 1]:.2f} "
              f"accepted_share={shares[1]:.2f} "
              f"prediction_vs_plain_c{c4}={rates['prediction', c4] / rates['plain', c4]:.2f} "
              f"prediction_vs_hybrid_c{c4}="
              f"{rates['prediction', c4] / rates['hybrid', c4]:.2f} "
              f"identical={'no' if differs else 'yes'}")
    print(table)
    print()
    print(file_table)
    print(result)
    print(f"greedy outputs that differ from plain: {'; '.join(differs) or 'none'} ({batched})")
    details = [
        (f"target {sm.TARGET} ({form}; --quantization {args.quantization}), draft {sm.DRAFT} "
         f"with int4 linears and a vocabulary of {args.draft_vocab_size or 'all'} tokens, "
         f"hybrid (suffix matches or the draft model), k_max {args.k_max}, adaptive"),
        (f"{len(edits)} whole-file edits of bench/prompts/predicted_outputs/edits.jsonl "
         f"({', '.join(f'{e.file} {e.kind}' for e in edits)}); the prediction is the unedited "
         f"file; each request up to its file's tokens + 64 (cap {args.max_tokens}), greedy, "
         f"to eos; concurrency 1: one request at a time, {c4}: {c4} at once"),
        (f"each concurrency: plain, hybrid, prediction, {args.repeats} times, then plain "
         f"again, every run from empty suffix and prefix caches; x plain is the case's tokens "
         f"over its seconds in all rounds against plain's, per round against the mean of the "
         f"plain runs before and after it"),
        ("accepted prediction tokens: OpenAI's accepted_prediction_tokens "
         "(engine.spec_decode.prediction.predicted_tokens) of the answers, a property of the "
         "answer (the same with or without speculation); accepted/drafted by method: what the "
         "speculator drafted from each source and the target accepted"),
        f"greedy outputs that differ from plain: {'; '.join(differs) or 'none'} ({batched})",
    ]
    if not args.quick:
        write_results(args.out, "Predicted Outputs: plain, hybrid, hybrid + prediction",
                      torch.get_num_threads(), details, f"{table}\n\n{file_table}", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
