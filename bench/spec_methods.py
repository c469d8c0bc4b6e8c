"""Speculation methods side by side on the packaged Qwen2.5-Coder pair, in ONE run.

Methods: plain (no speculation), draft_model (the 0.5B draft, adaptive k), ngram (prompt lookup),
suffix (suffix matches in the sequence's own text and in earlier requests' texts), hybrid
(per sequence per step, the suffix match or the draft model, whichever the cost model predicts
pays more). With `--speculator DIR` (a head from `specserve speculator train`; `make
bench-eagle`): plain, draft_model, eagle (the head) and hybrid_eagle (suffix matches or the
head), the per-forward cost of the head against the target's, and an eagle RESULT line. With
`--trees`: suffix, the draft model and hybrid with chains only and with token trees (`make
bench-trees`); with `--trees --speculator DIR`: the head's chains against its EAGLE-2 dynamic
trees (`make bench-trees-eagle`); both report the target pass's measured cost per row count.
With `--medusa DIR --speculator DIR` (`make bench-medusa`): Medusa heads against the EAGLE
head trained on the same pipeline: plain, eagle, medusa_chain (each head's best token),
medusa (its sparse tree of TREE_NODES nodes) and hybrid_medusa (suffix matches or the heads'
tree), the heads' cost against the target's, a medusa RESULT line. With `--lookahead`
(`make bench-lookahead`): lookahead decoding: plain, suffix, lookahead_pool (the n-gram pool
alone: window 0), lookahead (pool and window rows where the guard prices them as paying),
lookahead_unguarded (window rows every step, k not adaptive) and hybrid_lookahead (the draft
model, suffix matches and the pool with its window), a lookahead RESULT line. With both
`--medusa DIR --speculator DIR --lookahead` (`make bench-variants`): the two variants in one
run: plain, eagle, medusa_chain, medusa, hybrid_medusa, lookahead and hybrid_lookahead, with
the RESULT line of both.
Target and draft as `make serve` serves them by default (`--quantization auto`: int4 on the
CPU from the GGUF's blocks; the draft int4 with a 32,768-token vocabulary);
`--quantization none` runs the bf16 target. Greedy unless stated.

Workloads (prompts written for this project's benchmarks, no external dataset):
- chat: bench/prompts/chat.jsonl, 8 coding and prose questions, then chat_more.jsonl, 16
  more of the same kinds;
- code_edit: bench/prompts/code_edit.jsonl, 8 requests whose answer rewrites the given code
  with a small change (rename, type hints, a fix), then code_edit_more.jsonl, 16 more;
  `--edit-max-tokens` (96) new tokens, as the answers open with a sentence before the code;
- repeated: the 8 first chat requests issued three times in a row, as an agent loop re-issues
  its requests (the later ones can be drafted from the earlier ones' outputs);
- chat_t0.7: the chat requests at temperature 0.7, seeded (under coupled verification the
  target's keyed pick verifies them, as greedy ones);
- chat_t0.7_unseeded (`--trees` only): the same, unseeded: verified by rejection sampling, with
  the proposer's sampled trees against its sampled chains.
Each runs at concurrency 1 (one request at a time, the first `--c1-prompts` prompts: 4 by
default, to fit the run in half an hour on 2 cores) and 8; plain and hybrid also chat at 16.
At 8 and 16 the requests run in a closed loop, as clients behind a load balancer keep a server
busy: that many in flight, each one that finishes replaced at once by the next, `--pool` (24)
requests in all (repeated: its 8 prompts three times). A batch of equal requests started
together and awaited together would measure something else: plain decoding finishes them all
in the same step, while speculation advances them unequally and its last ones drain alone,
where a step costs nearly what a full batch's does. Every (method, workload,
concurrency) starts with an empty suffix cache and an empty prefix cache, so no case is helped
by an earlier case's text. Greedy identity: each method's token ids vs plain's. Every case also
measures plain_control, a second plain engine, as if it were a method (an A/A test, off with
`--no-control`): what its ratio to plain moves is this run's noise on a ratio (on a 2-core
cloud machine, several percent at c=8).

    python bench/spec_methods.py [--quantization auto|int4|none] [--max-tokens 48]
                                 [--c1-prompts 4] [--pool 24] [--repeats 2] [--quick] [--no-control]
                                 [--speculator DIR] [--trees] [--medusa DIR] [--lookahead]

Prints a table, ends with a RESULT line, writes bench/results/spec_methods.md
(spec_methods_eagle.md with --speculator, spec_methods_trees.md with --trees,
spec_methods_trees_eagle.md with both, spec_methods_medusa.md with --medusa,
spec_methods_lookahead.md with --lookahead, spec_methods_medusa_lookahead.md with --medusa
and --lookahead).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from results_file import write_results  # noqa: E402

from engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from engine.block_manager import BlockManager  # noqa: E402
from engine.config import SpeculativeConfig  # noqa: E402
from engine.models import recipes  # noqa: E402
from engine.models.draft import prepare_draft  # noqa: E402
from engine.models.loader import load_model  # noqa: E402
from engine.models.quantize import apply_quantization  # noqa: E402
from engine.spec_decode.suffix import SuffixCache  # noqa: E402

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
# a second plain engine, measured like a method in every case (an A/A test): its ratio to
# plain is what a ratio of this run moves without any difference between the engines
CONTROL = "plain_control"
METHODS = ("plain", "draft_model", "ngram", "suffix", "hybrid")
# with --speculator: the draft head alone, and hybrid with the head as its model source
EAGLE_METHODS = ("plain", "draft_model", "eagle", "hybrid_eagle")
# with --trees: suffix, the draft model and hybrid with chains only (tree_max_nodes 0) and
# with token trees (tree_max_nodes TREE_NODES)
TREE_METHODS = ("plain", "suffix_chain", "suffix", "draft_model_chain", "draft_model",
                "hybrid_chain", "hybrid")
# with --trees --speculator: the head's chains against its EAGLE-2 dynamic trees
TREE_EAGLE_METHODS = ("plain", "eagle_chain", "eagle")
# with --medusa: Medusa heads (chains and their sparse tree, alone and in hybrid) beside the
# EAGLE head
MEDUSA_METHODS = ("plain", "eagle", "medusa_chain", "medusa", "hybrid_medusa")
# with --lookahead: lookahead decoding's n-gram pool alone, with its window where the guard
# prices it as paying, with its window always, and inside hybrid
LOOKAHEAD_METHODS = ("plain", "suffix", "lookahead_pool", "lookahead", "lookahead_unguarded",
                     "hybrid_lookahead")
# with --medusa and --lookahead together: the one run of both variants beside plain and
# the EAGLE head (the guarded lookahead and hybrid with its pool; the window's unguarded cost is
# --lookahead's alone)
BOTH_METHODS = ("plain", "eagle", "medusa_chain", "medusa", "hybrid_medusa", "lookahead",
                "hybrid_lookahead")
TREE_NODES = 16


def load_prompts(tok, path):
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [tok.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=True,
                                    return_dict=False) for r in rows]


def tree_result(rates: dict, accept_len: dict) -> str:
    """Trees against chains: per workload at c=1 and c=8, each tree method's tokens/s with
    trees over with chains only; its drafts' tokens per verification with trees and with
    chains (over all cases); the worst tree method against plain."""
    tree_methods = [m for m in ("suffix", "draft_model", "hybrid", "eagle")
                    if any(k[0] == m for k in rates)]
    parts = []
    for m, key in (("eagle", "eagle"), ("draft_model", "draft")):  # the headline: chat, c=1
        if (m, "chat", 1) in rates and (m + "_chain", "chat", 1) in rates:
            parts.append(f"tree_vs_chain_{key}_chat="
                         f"{rates[m, 'chat', 1] / rates[m + '_chain', 'chat', 1]:.2f}")
    for w in ("chat", "code_edit", "repeated", "chat_t0.7", "chat_t0.7_unseeded"):
        for c in (1, 8):
            for m in tree_methods:
                if (m, w, c) in rates and (m + "_chain", w, c) in rates:
                    parts.append(f"tree_vs_chain_{m}_{w}_c{c}="
                                 f"{rates[m, w, c] / rates[m + '_chain', w, c]:.2f}")

    def mean_len(method, proposing):
        lens = [v for (e, m, _, _), v in accept_len.items() if e == method and m == proposing]
        return sum(lens) / len(lens) if lens else 0.0

    worst = min(rates[m, w, c] / rates["plain", w, c] for (m, w, c) in rates
                if m in tree_methods)
    for m in ("suffix", "draft_model", "eagle"):
        if m in tree_methods:
            parts += [f"tree_accept_len_{m}={mean_len(m, m):.2f}",
                      f"chain_accept_len_{m}={mean_len(m + '_chain', m):.2f}"]
    parts.append(f"worst_tree_vs_plain={worst:.2f}")
    return " ".join(parts)


def verify_costs(engine) -> str:
    """The target pass's measured seconds per token count (one sequence: the verify cost of
    1 + n rows), from the engine's cost model."""
    table = engine.speculator.guard.controller.target_cost.table
    return ", ".join(f"{n}: {1e3 * s:.1f} ms" for n, s in zip(table.sizes, table.seconds)
                     if n <= 1 + 2 * TREE_NODES)


def make_engine(method, target, draft, tok, k_max, draft_vocab_size, speculator=None,
                trees=False, medusa=None):
    """trees: suffix and hybrid draft token trees (a "_chain" method: chains only); medusa:
    Medusa heads for medusa and hybrid_medusa, whose trees are on unless "_chain"; CONTROL: a
    second plain engine."""
    if method == CONTROL:
        method = "plain"
    chains = method.endswith("_chain")
    method = method.removesuffix("_chain")
    lookahead = None
    adaptive = not method.endswith("_unguarded")
    method = method.removesuffix("_unguarded")
    if method in ("lookahead", "lookahead_pool", "hybrid_lookahead"):
        lookahead = {"window": 0} if method == "lookahead_pool" else {}
        method = "hybrid" if method == "hybrid_lookahead" else "lookahead"
    folder = (speculator if method in ("eagle", "hybrid_eagle")
              else medusa if method in ("medusa", "hybrid_medusa") else None)
    if method in ("medusa", "hybrid_medusa"):
        trees = True
    tree_nodes = TREE_NODES if trees and not chains else 0
    spec = SpeculativeConfig(method={"plain": "none", "hybrid_eagle": "hybrid",
                                     "hybrid_medusa": "hybrid"}.get(method, method),
                             draft_model=DRAFT if method in ("draft_model", "hybrid") else None,
                             speculator=folder,
                             k_max=k_max, adaptive=adaptive,
                             draft_vocab_size=draft_vocab_size, tree_max_nodes=tree_nodes,
                             sampled_trees=tree_nodes > 0,
                             lookahead=lookahead)
    uses_draft = method in ("draft_model", "hybrid")  # (a "_chain" method's too)
    return LLMEngine(EngineConfig(kv_cache_memory_gb=1.5, max_num_seqs=32,
                                  max_num_batched_tokens=512, speculative=spec),
                     model=target, tokenizer=tok, draft_model=draft if uses_draft else None)


def medusa_vs_target_cost(engine, repeats: int = 20) -> tuple[float, float]:
    """Median seconds of one forward of the Medusa heads (1 row: every head's scores) and of
    the target's decode forward (1 row, after 256 tokens), the latter from head_vs_target_cost's
    way of timing it."""
    heads = engine.speculator.proposer.heads
    x = torch.zeros((1, heads.config.hidden_size), dtype=heads.norm.weight.dtype)
    samples = []
    with torch.inference_mode():
        for _ in range(repeats):
            t0 = time.perf_counter()
            heads(x).argmax(-1).tolist()
            samples.append(time.perf_counter() - t0)
    return sorted(samples)[len(samples) // 2], target_decode_seconds(engine)


def head_vs_target_cost(engine, context: int = 256, repeats: int = 20) -> tuple[float, float]:
    """Median seconds of one head forward (1 row, as a chained draft step) and of one target
    decode forward (1 row), both after `context` tokens."""
    return (_median_forward(engine, engine.speculator.proposer.execute, context, repeats),
            target_decode_seconds(engine, context, repeats))


def target_decode_seconds(engine, context: int = 256, repeats: int = 20) -> float:
    return _median_forward(engine, engine.runner.execute, context, repeats)


def _median_forward(engine, execute, context: int, repeats: int) -> float:
    """Median seconds of `execute` on one row after `context` tokens of a dummy sequence."""
    from engine.batch import RunItem
    from engine.sequence import Sequence

    bm = engine.block_manager
    dummy = Sequence("__cost__", [0] * (context + 1), SamplingParams())
    assert bm.allocate(dummy, context + 1)
    item = RunItem([0], context, dummy.block_table, 1, context)
    try:
        engine.runner.execute([RunItem([0] * context, 0, dummy.block_table, 1, context)])
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            execute([item]).logits.argmax(-1).tolist()
            samples.append(time.perf_counter() - t0)
    finally:
        bm.free(dummy)
    return sorted(samples)[len(samples) // 2]


def medusa_details(args, engines) -> str:
    heads, target = medusa_vs_target_cost(engines["medusa"])
    eagle, _ = head_vs_target_cost(engines["eagle"])
    config = engines["medusa"].speculator.proposer.heads.config
    accuracy = "; ".join(f"head {j + 1}: " + ", ".join(f"{a:.2f}" for a in row[:4])
                         for j, row in enumerate(config.accuracy))
    return (f"medusa {args.medusa}: {config.num_heads} heads, {describe_head(args.medusa)}; "
            f"held-out accuracy by rank 1-4 per head: {accuracy}; one forward of all heads "
            f"(1 row) {1e3 * heads:.2f} ms, the EAGLE head's {1e3 * eagle:.2f} ms, a target "
            f"decode forward {1e3 * target:.1f} ms; eagle {args.speculator}: "
            f"{describe_head(args.speculator)}; medusa and hybrid_medusa draft trees of at "
            f"most {TREE_NODES} nodes, eagle and medusa_chain chains")


def medusa_result(rates, accept_len, engines, worst_any) -> str:
    def x(a, b, w="chat"):
        return rates[a, w, 1] / rates[b, w, 1]

    heads, target = medusa_vs_target_cost(engines["medusa"])
    return (f"RESULT medusa_chat_vs_plain={x('medusa', 'plain'):.2f} "
            f"medusa_vs_eagle_chat={x('medusa', 'eagle'):.2f} "
            f"medusa_tree_vs_chain_chat={x('medusa', 'medusa_chain'):.2f} "
            f"medusa_code_edit_vs_plain={x('medusa', 'plain', 'code_edit'):.2f} "
            f"hybrid_medusa_code_edit={x('hybrid_medusa', 'plain', 'code_edit'):.2f} "
            f"medusa_accept_len={accept_len.get(('medusa', 'medusa', 'chat', 1), 0):.2f} "
            f"eagle_accept_len={accept_len.get(('eagle', 'eagle', 'chat', 1), 0):.2f} "
            f"medusa_heads_cost={heads / target:.3f} worst_vs_plain={worst_any:.2f}")


def lookahead_details(engines) -> str:
    """The pool's settings, what the window's rows brought (tokens of window-only n-grams per
    lookahead row, over the whole run) guarded and unguarded, and the guard's price of them."""
    parts = []
    for method in [m for m in ("lookahead", "lookahead_unguarded", "hybrid_lookahead")
                   if m in engines]:
        pool = engines[method].speculator.lookahead
        parts.append(f"{method}: {pool.window_rows} window rows run, {pool.window_tokens} "
                     f"accepted tokens from window-only n-grams "
                     f"({pool.window_tokens / max(pool.window_rows, 1):.4f} per row; recent "
                     f"value with the prior {pool.row_value:.4f}), {pool.pool_probes} probes of "
                     f"priced-out pool proposals")
    pool = engines["lookahead"].speculator.lookahead
    rows = pool.width * (pool.n - 1)
    price = engines["lookahead"].speculator.guard.row_price(1, 1, rows)
    return (f"lookahead window {pool.width}, ngram {pool.n}, max_candidates {pool.g} "
            f"({rows} window rows a step); the guard's price of a window row at c=1: "
            f"{price:.3f} accepted tokens; " + "; ".join(parts) + "; the target pass's "
            f"measured cost by rows: {verify_costs(engines['lookahead'])}")


def lookahead_result(rates, worst_any) -> str:
    """worst_vs_plain: the guarded methods' worst case (lookahead_unguarded runs its window
    rows every step on purpose, to show what they cost)."""
    def x(a, w, c=1):
        return rates[a, w, c] / rates["plain", w, c]

    guarded = min(x(m, w, c) for (m, w, c) in rates if m != "lookahead_unguarded")

    return (f"RESULT lookahead_code_edit_vs_plain={x('lookahead', 'code_edit'):.2f} "
            f"lookahead_chat_vs_plain={x('lookahead', 'chat'):.2f} "
            f"lookahead_repeated_vs_plain={x('lookahead', 'repeated'):.2f} "
            f"lookahead_pool_code_edit_vs_plain={x('lookahead_pool', 'code_edit'):.2f} "
            f"lookahead_unguarded_code_edit_vs_plain="
            f"{x('lookahead_unguarded', 'code_edit'):.2f} "
            f"hybrid_lookahead_code_edit={x('hybrid_lookahead', 'code_edit'):.2f} "
            f"lookahead_code_edit_c8_vs_plain={x('lookahead', 'code_edit', 8):.2f} "
            f"worst_vs_plain={guarded:.2f} worst_unguarded_vs_plain={worst_any:.2f}")


def both_result(rates, accept_len, engines, worst_any) -> str:
    """The medusa and lookahead RESULT of one run with both: each against plain on chat and
    code_edit at c=1, medusa against the EAGLE head, and the worst of every method and case."""
    def x(a, b="plain", w="chat"):
        return rates[a, w, 1] / rates[b, w, 1]

    heads, target = medusa_vs_target_cost(engines["medusa"])
    return (f"RESULT medusa_chat_vs_plain={x('medusa'):.2f} "
            f"medusa_vs_eagle_chat={x('medusa', 'eagle'):.2f} "
            f"lookahead_code_edit_vs_plain={x('lookahead', w='code_edit'):.2f} "
            f"lookahead_chat_vs_plain={x('lookahead'):.2f} "
            f"medusa_code_edit_vs_plain={x('medusa', w='code_edit'):.2f} "
            f"medusa_tree_vs_chain_chat={x('medusa', 'medusa_chain'):.2f} "
            f"hybrid_medusa_code_edit={x('hybrid_medusa', w='code_edit'):.2f} "
            f"hybrid_lookahead_code_edit={x('hybrid_lookahead', w='code_edit'):.2f} "
            f"medusa_accept_len={accept_len.get(('medusa', 'medusa', 'chat', 1), 0):.2f} "
            f"eagle_accept_len={accept_len.get(('eagle', 'eagle', 'chat', 1), 0):.2f} "
            f"medusa_heads_cost={heads / target:.3f} worst_vs_plain={worst_any:.2f}")


def describe_head(path) -> str:
    report = json.loads((Path(path) / "report.json").read_text())
    return (f"trained {report.get('train_seconds', 0) / 60:.0f} min on "
            f"{report['conversations']} answers ({report['training_tokens']} tokens) in "
            f"{report['minutes']:.0f} min in all; held-out acceptance length by k "
            f"{[round(a, 2) for a in report['acceptance_length']]}")


def describe_linears(model) -> str:
    """What the model's linear layers are: bf16, or how many of each quantized form."""
    kinds: dict[str, int] = {}
    for module in model.modules():
        name = type(module).__name__
        if name.endswith("Linear"):
            kinds[name] = kinds.get(name, 0) + 1
    if set(kinds) <= {"Linear"}:
        return "bf16"
    return ", ".join(f"{n} {name}" for name, n in sorted(kinds.items()))


def forget_history(engine) -> None:
    """An empty suffix cache (same settings) and an empty prefix cache."""
    bm = engine.block_manager
    engine.block_manager.__dict__.update(BlockManager(bm.num_blocks, bm.block_size,
                                                      bm.enable_prefix_caching).__dict__)
    spec = engine.speculator
    if getattr(spec, "suffix", None) is not None:
        old = spec.suffix
        spec.suffix = SuffixCache(max_tokens=old.max_tokens, cross_request=old.cross_request,
                                  max_spec_tokens=old.max_spec_tokens,
                                  spec_factor=old.spec_factor,
                                  min_token_prob=old.min_token_prob)


def run(engine, prompts, params, concurrency):
    """A closed loop, as a load balancer keeps a server busy: `concurrency` requests in flight,
    each one that finishes replaced at once by the next prompt, until all have finished (the
    run's last requests drain with fewer in flight). params: one SamplingParams, or one per
    prompt. Returns (token ids per request in prompt order, tokens, seconds)."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    index: dict[str, int] = {}
    outputs: list[list[int] | None] = [None] * len(prompts)
    t0 = time.perf_counter()

    def admit():
        i = len(index)
        index[engine.add_request(prompts[i], params[i])] = i

    while len(index) < min(concurrency, len(prompts)):
        admit()
    done = 0
    while done < len(prompts):
        for o in engine.step():
            if o.finished:
                outputs[index[o.request_id]] = o.output_token_ids
                done += 1
                if len(index) < len(prompts):
                    admit()
    seconds = time.perf_counter() - t0
    return outputs, sum(len(o) for o in outputs), seconds


def add_pair_arguments(parser: argparse.ArgumentParser) -> None:
    """The packaged pair's options (`load_pair` reads them)."""
    parser.add_argument("--k-max", type=int, default=6)
    parser.add_argument("--quantization", default="auto", choices=("auto", "int4", "none"),
                        help="the target's (auto: int4 on the CPU, as make serve serves it)")
    parser.add_argument("--draft-vocab-size", type=int, default=32768,
                        help="the draft's vocabulary subset, as configs/default.yaml (0: all)")
    parser.add_argument("--threads", type=int, default=None)


def load_pair(args):
    """(target, tokenizer, what its linears are, draft) as `make serve` serves them: the
    target quantized as --quantization says, the draft with int4 linears."""
    if args.threads:
        torch.set_num_threads(args.threads)
    target, tok = load_model(TARGET, dtype="bfloat16")
    target = apply_quantization(target, args.quantization, str(recipes.model_dir(TARGET)),
                                what="target")
    draft, _ = load_model(DRAFT, dtype="bfloat16")
    draft = prepare_draft(draft, "int4", owned=True, source=str(recipes.model_dir(DRAFT)))
    return target, tok, describe_linears(target), draft


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--edit-max-tokens", type=int, default=96,
                        help="code_edit: long enough to reach the rewritten code")
    add_pair_arguments(parser)
    parser.add_argument("--c1-prompts", type=int, default=4,
                        help="prompts per workload at concurrency 1")
    parser.add_argument("--pool", type=int, default=24,
                        help="requests per workload at concurrency 8 and 16 (closed loop; at "
                             "most 24: the 8 prompts of a workload, then its 16 more)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="rounds of every method per case, interleaved with plain")
    parser.add_argument("--quick", action="store_true", help="2 prompts, 24 tokens: a smoke run")
    parser.add_argument("--no-control", dest="control", action="store_false",
                        help=f"without {CONTROL}, the second plain engine (the A/A test)")
    parser.add_argument("--cases", default=None,
                        help="only these workload:concurrency pairs, e.g. chat:8,chat_t0.7:8 "
                             "(no RESULT line)")
    parser.add_argument("--speculator", default=None,
                        help="a draft head for the target (specserve speculator train): run "
                             "plain, draft_model, eagle and hybrid with the head instead")
    parser.add_argument("--medusa", default=None,
                        help="Medusa heads for the target (speculator train --kind medusa), "
                             "with --speculator: plain, eagle, medusa chains and trees, "
                             "hybrid with the heads")
    parser.add_argument("--trees", action="store_true",
                        help="plain, suffix, draft model, hybrid: chains only and with token trees "
                             f"(tree_max_nodes 0 and --tree-nodes)")
    parser.add_argument("--tree-nodes", type=int, default=TREE_NODES,
                        help="tree_max_nodes of the engines that draft trees (1 to 64)")
    parser.add_argument("--lookahead", action="store_true",
                        help="lookahead decoding: its pool alone, with its window guarded and "
                             "unguarded, in hybrid; beside plain and suffix")
    parser.add_argument("--out", default=None,
                        help="results file (default bench/results/spec_methods.md, "
                             "spec_methods_eagle.md with --speculator, spec_methods_trees.md "
                             "with --trees)")
    args = parser.parse_args()
    if args.medusa and not args.speculator:
        parser.error("--medusa needs --speculator (the EAGLE head it is compared with)")
    if not 1 <= args.tree_nodes <= 64:
        parser.error("--tree-nodes must be within 1..64")
    globals()["TREE_NODES"] = args.tree_nodes  # (the engines' and the results' tree size)
    default_out = str(ROOT / "bench/results" / (
        "spec_methods_medusa_lookahead.md" if args.medusa and args.lookahead
        else "spec_methods_medusa.md" if args.medusa
        else "spec_methods_lookahead.md" if args.lookahead
        else "spec_methods_trees_eagle.md" if args.speculator and args.trees
        else "spec_methods_eagle.md" if args.speculator
        else "spec_methods_trees.md" if args.trees else "spec_methods.md"))
    args.out = args.out or default_out
    methods_run = (BOTH_METHODS if args.medusa and args.lookahead
                   else MEDUSA_METHODS if args.medusa else LOOKAHEAD_METHODS if args.lookahead
                   else TREE_EAGLE_METHODS if args.speculator and args.trees
                   else EAGLE_METHODS if args.speculator else TREE_METHODS if args.trees
                   else METHODS)
    target, tok, form, draft = load_pair(args)
    n = 2 if args.quick else 8
    pool = 4 if args.quick else args.pool
    # the first 8 of each workload (concurrency 1 takes its first --c1-prompts), then more of
    # the same kind for the closed loops at 8 and 16
    chat = (load_prompts(tok, ROOT / "bench/prompts/chat.jsonl")[:n]
            + load_prompts(tok, ROOT / "bench/prompts/chat_more.jsonl"))[:pool]
    edit = (load_prompts(tok, ROOT / "bench/prompts/code_edit.jsonl")[:n]
            + load_prompts(tok, ROOT / "bench/prompts/code_edit_more.jsonl"))[:pool]
    max_tokens = 24 if args.quick else args.max_tokens
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    edit_tokens = max_tokens if args.quick else args.edit_max_tokens
    greedy_edit = SamplingParams(temperature=0, max_tokens=edit_tokens, ignore_eos=True)
    sampled = [SamplingParams(temperature=0.7, seed=100 + i, max_tokens=max_tokens,
                              ignore_eos=True) for i in range(pool)]
    c1 = 2 if args.quick else args.c1_prompts
    # name -> (its requests at concurrency 1, at 8 and 16, params (one, or one per request),
    # concurrencies); repeated: the first prompts three times in a row
    workloads = {
        "chat": (chat[:c1], chat, greedy, (1, 8, 16)),
        "code_edit": (edit[:c1], edit, greedy_edit, (1, 8)),
        "repeated": (chat[:c1] * 3, chat[:n] * 3, greedy, (1, 8)),
        "chat_t0.7": (chat[:c1], chat, sampled, (1, 8)),
    }
    if args.trees:  # unseeded: verified by rejection sampling, with sampled trees
        workloads["chat_t0.7_unseeded"] = (chat[:c1], chat, SamplingParams(
            temperature=0.7, max_tokens=max_tokens, ignore_eos=True), (1, 8))
    rates: dict[tuple[str, str, int], float] = {}
    # (engine's method, proposing method, workload, concurrency) -> tokens per verification
    accept_len: dict[tuple[str, str, str, int], float] = {}
    accept_sums: dict[tuple[str, str, str, int], list[int]] = {}  # verifications, accepted
    rows, plain_out, identical = [], {}, {}
    engines = {m: make_engine(m, target, draft, tok, args.k_max, args.draft_vocab_size,
                              args.speculator, args.trees, args.medusa) for m in methods_run}
    hybrid = methods_run[-1]
    if args.control:
        engines[CONTROL] = make_engine(CONTROL, target, draft, tok, args.k_max,
                                       args.draft_vocab_size)

    def measure(method, name, c, prompts_c, params_c):
        engine = engines[method]
        forget_history(engine)
        st = engine.speculator.stats
        before = {m: list(v) for m, v in (st.by_method.items() if st else [])}
        verifications = dict((m, v[0]) for m, v in (st.by_method.items() if st else []))
        outs, tokens, seconds = run(engine, prompts_c, params_c, c)
        for m, v in (st.by_method.items() if st else []):
            done = v[0] - verifications.get(m, 0)
            if done:  # tokens per verification of this method's drafts, over every round
                b = before.get(m, [0, 0, 0])
                sums = accept_sums.setdefault((method, m, name, c), [0, 0])
                sums[0], sums[1] = sums[0] + done, sums[1] + v[2] - b[2]
                accept_len[method, m, name, c] = 1.0 + sums[1] / sums[0]
        by = {}
        for m, (_, d, a) in (st.by_method.items() if st else []):
            b = before.get(m, [0, 0, 0])
            if d - b[1]:
                by[m] = (d - b[1], a - b[2])
        return outs, tokens, seconds, by

    only = None if args.cases is None else {
        (w, int(c)) for w, c in (case.split(":") for case in args.cases.split(","))}
    for name, (first, many, params, concs) in workloads.items():
        for c in concs:
            if only is not None and (name, c) not in only:
                continue
            prompts_c = first if c == 1 else many
            params_c = params[:len(prompts_c)] if isinstance(params, list) else params
            methods = ("plain", hybrid) if c == 16 else methods_run
            methods = (*methods, CONTROL) if args.control else methods
            # interleaved: plain, then every method, `repeats` times, and plain once more; a
            # method's ratio in a round is against the mean of the plain runs around it, so a
            # drift of this machine's speed during the case favours no side, and the spread of
            # the rounds' ratios says what the ratio's noise is
            passes = [{m: measure(m, name, c, prompts_c, params_c) for m in methods}
                      for _ in range(args.repeats)]
            closing = measure("plain", name, c, prompts_c, params_c)
            plain_rates = [p["plain"][1] / p["plain"][2] for p in passes]
            plain_rates.append(closing[1] / closing[2])
            plain_out[name, c] = passes[0]["plain"][0]
            plain_tokens = sum(p["plain"][1] for p in passes) + closing[1]
            plain_seconds = sum(p["plain"][2] for p in passes) + closing[2]
            rates["plain", name, c] = plain_tokens / plain_seconds
            for method in methods:
                outs = passes[0][method][0]
                tokens = sum(p[method][1] for p in passes)
                seconds = sum(p[method][2] for p in passes)
                if method == "plain":
                    tokens, seconds = plain_tokens, plain_seconds
                by: dict[str, tuple[int, int]] = {}
                for p in passes:
                    for m, (d, a) in p[method][3].items():
                        by[m] = (by.get(m, (0, 0))[0] + d, by.get(m, (0, 0))[1] + a)
                rates[method, name, c] = tokens / seconds
                per_round = [p[method][1] / p[method][2] / ((plain_rates[i]
                                                             + plain_rates[i + 1]) / 2)
                             for i, p in enumerate(passes)]
                spread = f"{min(per_round):.2f}-{max(per_round):.2f}"
                same = ("" if name.startswith("chat_t0.7") else
                        f"{sum(a == b for a, b in zip(outs, plain_out[name, c]))}/{len(outs)}")
                if same:
                    identical[method, name, c] = same
                accept = ", ".join(f"{m} {a}/{d}" for m, (d, a) in sorted(by.items()))
                suffix = getattr(engines[method].speculator, "suffix", None)
                upd = (f"{1e3 * suffix.max_update_seconds:.1f}" if suffix is not None else "")
                rows.append((method, name, c, tokens, seconds, tokens / seconds,
                             rates[method, name, c] / rates["plain", name, c], spread, same,
                             accept, upd))
                print(f"{method:12s} {name:10s} c={c:<3d} {tokens / seconds:6.2f} tok/s  "
                      f"x{rows[-1][6]:.2f} (rounds {spread})  same={same}  {accept}  "
                      f"max_update_ms={upd}", flush=True)
    header = ("| method | workload | concurrency | tokens | seconds | tokens/s | x plain | "
              "x plain per round (min-max) | greedy identical to plain | "
              "accepted/drafted by method | suffix update max ms |")
    table = "\n".join([header, "|" + "---|" * 11] + [
        f"| {m} | {w} | {c} | {t} | {s:.1f} | {r:.2f} | {x:.2f} | {sp} | {same} | {acc} | "
        f"{upd} |" for m, w, c, t, s, r, x, sp, same, acc, upd in rows])
    control = {(w, c): rates.pop((m, w, c)) / rates["plain", w, c]
               for (m, w, c) in list(rates) if m == CONTROL}
    noise = (f" control_vs_plain_min={min(control.values()):.2f} "
             f"control_vs_plain_max={max(control.values()):.2f}" if control else "")
    worst = min(rates[hybrid, w, c] / rates["plain", w, c] for (m, w, c) in rates
                if m == hybrid)
    # the never-slower promise: every method, every case
    worst_any = min(rates[m, w, c] / rates["plain", w, c] for (m, w, c) in rates)
    details = [f"target {TARGET} ({form}; --quantization {args.quantization}), draft {DRAFT} "
               f"with int4 linears and a vocabulary of {args.draft_vocab_size or 'all'} tokens, "
               f"k_max {args.k_max} (draft model), suffix defaults (max 32 drafts), adaptive",
               f"requests per workload: {c1} at concurrency 1 (one at a time), {pool} at 8 "
               f"and 16 (a closed loop: each request that finishes is replaced by the next; "
               f"repeated: the first {n} prompts three times), {max_tokens} new tokens "
               f"each ({edit_tokens} for code_edit), ignore_eos",
               f"each case: plain, then every method, {args.repeats} times, then plain again; "
               f"x plain is the method's tokens over its seconds in all rounds against "
               f"plain's, and per round against the mean of the plain runs before and after "
               f"it (the spread is the noise of the ratio)"]
    if control:
        details.append(f"{CONTROL}: a second plain engine (same model, same settings) measured "
                       f"as a method in every case, an A/A test: its ratio to plain, "
                       f"{min(control.values()):.2f}-{max(control.values()):.2f} over the cases "
                       f"(control_vs_plain_min/max), is what a ratio of this run moves with no "
                       f"difference between the engines; worst_*_vs_plain leave it out")
    if only is not None:
        print(table)
        print(f"worst hybrid / plain over these cases: {worst:.2f}{noise}")
        summary = f"worst_hybrid_vs_plain={worst:.2f}{noise} (these cases only)"
        if args.trees:
            details.append(f"token trees of at most {TREE_NODES} nodes; the target pass's "
                           f"measured cost by rows: {verify_costs(engines[methods_run[-1]])}")
            summary = tree_result(rates, accept_len) + noise + " (these cases only)"
            print("trees over these cases: " + summary)
        if args.out != default_out:
            write_results(args.out, f"Speculation methods, cases {args.cases}",
                          torch.get_num_threads(), details, table, summary)
        return 0
    if args.medusa and args.lookahead:
        details += [medusa_details(args, engines), lookahead_details(engines)]
        result = both_result(rates, accept_len, engines, worst_any)
    elif args.medusa:
        details.append(medusa_details(args, engines))
        result = medusa_result(rates, accept_len, engines, worst_any)
    elif args.lookahead:
        details.append(lookahead_details(engines))
        result = lookahead_result(rates, worst_any)
    elif args.trees:
        details.append(f"token trees of at most {TREE_NODES} nodes; the target pass's "
                       f"measured cost by rows (one sequence, the tree engine's cost model): "
                       f"{verify_costs(engines[methods_run[-1]])}")
        result = "RESULT " + tree_result(rates, accept_len)
    elif args.speculator:
        head_cost = head_vs_target_cost(engines["eagle"])
        eagle_stats = accept_len["eagle", "eagle", "chat", 1]
        details.append(f"speculator {args.speculator}: {describe_head(args.speculator)}; one "
                       f"head forward (1 row) {1e3 * head_cost[0]:.1f} ms, one target decode "
                       f"forward {1e3 * head_cost[1]:.1f} ms")
        from eagle_training import rate_per_min  # (bench/: the head's training bench)

        report = json.loads((Path(args.speculator) / "report.json").read_text())
        result = (f"RESULT answer_tokens_per_min={rate_per_min(report):.0f} "
                  f"eagle_accept_len_k5={report['acceptance_length'][-1]:.2f} "
                  f"eagle_chat_vs_plain={rates['eagle', 'chat', 1] / rates['plain', 'chat', 1]:.2f} "
                  f"eagle_vs_draft_chat={rates['eagle', 'chat', 1] / rates['draft_model', 'chat', 1]:.2f} "
                  f"hybrid_code_edit={rates[hybrid, 'code_edit', 1] / rates['plain', 'code_edit', 1]:.2f} "
                  f"eagle_head_cost={head_cost[0] / head_cost[1]:.3f} "
                  f"eagle_accept_len={eagle_stats:.2f} "
                  f"worst_hybrid_vs_plain={worst:.2f} worst_any_vs_plain={worst_any:.2f}")
    else:
        result = (f"RESULT code_edit_hybrid={rates['hybrid', 'code_edit', 1] / rates['plain', 'code_edit', 1]:.2f} "
                  f"repeated_hybrid={rates['hybrid', 'repeated', 1] / rates['plain', 'repeated', 1]:.2f} "
                  f"chat_hybrid_vs_draft={rates['hybrid', 'chat', 1] / rates['draft_model', 'chat', 1]:.2f} "
                  f"worst_hybrid_vs_plain={worst:.2f} worst_any_vs_plain={worst_any:.2f}")
    result += noise
    print(table)
    print(result)
    not_same = {k: v for k, v in identical.items() if v.split("/")[0] != v.split("/")[1]}
    details.append(f"greedy outputs that differ from plain: {not_same or 'none'}")
    if not args.quick:
        write_results(args.out, "Speculation methods: " + ", ".join(methods_run),
                      torch.get_num_threads(), details, table, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
