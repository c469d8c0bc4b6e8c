"""Record the engine's outputs on tiny random-init models, to diff before and after a refactor.

Every speculative method (none, draft_model, ngram, suffix, hybrid, eagle, hybrid with a draft
head: an untrained head started from the target's weights), both verification modes,
adaptive k on and off, drafts read by the host and left on the device, each with greedy,
seeded, logprobs and penalty requests (and a grammar request), alone and batched with staggered
arrivals. Writes every output's token ids, finish reason and logprobs (exact floats: compare
on the same machine) to a JSON file:

    python scripts/record_outputs.py --out /tmp/outputs_before.json
    ... refactor ...
    python scripts/record_outputs.py --out /tmp/outputs_after.json
    diff /tmp/outputs_before.json /tmp/outputs_after.json

Adaptive k chooses from measured costs. So that the guard's decisions can be compared too, the
host clock (`time.perf_counter`) is replaced by a deterministic one that advances by a
pseudo-random 0.5-5 ms per call (per thread): every measured cost and realized rate, and so
every k chosen, is then a function of the engine's calls alone. Each adaptive case records the
k chosen per step (its histogram and the steps that drafted) beside the outputs; a change in
the order or number of the engine's clock reads shows as a difference there.

To record an older tree with this script: PYTHONPATH=/path/to/that/tree python ...
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from conftest import (build_tiny_model, build_tokenizer, clone_model,  # noqa: E402
                      random_prompts, staggered)

from engine import structured  # noqa: E402
from engine.config import EngineConfig, SpeculativeConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.spec_decode.eagle import (EagleHead, head_config,  # noqa: E402
                                      initialize_from_target, save_head)

METHODS = ["none", "draft_model", "ngram", "suffix", "hybrid", "eagle", "hybrid+head"]


class FakeClock:
    """A perf_counter that advances by a pseudo-random 0.5-5 ms per call, in each thread on
    its own (the grammar-mask thread's reads do not shift the engine thread's)."""

    def __init__(self) -> None:
        self.local = threading.local()

    def __call__(self) -> float:
        state = getattr(self.local, "state", None)
        if state is None:
            state = self.local.state = [1000.0, 12345]
        state[1] = (state[1] * 6364136223846793005 + 1442695040888963407) % (1 << 64)
        state[0] += 0.0005 + 0.0045 * (state[1] >> 11) / (1 << 53)
        return state[0]


def models():
    """A target and a draft that agrees with it partly (so drafts are accepted and rejected)."""
    target = build_tiny_model("qwen2", num_layers=2)
    draft = build_tiny_model("qwen2", seed=3, num_layers=1)
    with torch.no_grad():
        draft.lm_head.weight.copy_(target.lm_head.weight * 0.8 + draft.lm_head.weight * 0.05)
        draft.model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
    return target, draft


def cases():
    """(name, method, verification, adaptive, defer_reads) of every engine to record."""
    for method in METHODS:
        for verification in (["coupled"] if method == "none" else ["coupled", "rejection"]):
            for adaptive in ([False] if method == "none" else [False, True]):
                yield f"{method}/{verification}/adaptive={adaptive}", method, verification, \
                    adaptive, False
    for method in ("draft_model", "hybrid"):
        for verification in ("coupled", "rejection"):
            yield f"{method}/{verification}/on_device", method, verification, False, True


def untrained_head(target, folder: str) -> str:
    """A draft head for `target` started from its weights (drafts some tokens right)."""
    head = EagleHead(head_config(target, "tiny", list(range(320))))
    initialize_from_target(head, target)
    save_head(head, folder)
    return folder


def engine(target, draft, tokenizer, method, verification, adaptive, defer_reads, head=None):
    speculator = head if method in ("eagle", "hybrid+head") else None
    method = "hybrid" if method == "hybrid+head" else method
    spec = SpeculativeConfig(method=method, draft_model="in-memory" if method in (
        "draft_model", "hybrid") and speculator is None else None, speculator=speculator,
        k_max=4, adaptive=adaptive, calibrate=adaptive, verification=verification)
    eng = LLMEngine(EngineConfig(speculative=spec, num_blocks=256, max_num_batched_tokens=48,
                                 max_num_seqs=8, seed=7),
                    model=clone_model(target), tokenizer=tokenizer,
                    draft_model=clone_model(draft) if spec.uses_draft_model else None)
    proposer = getattr(eng.speculator, "proposer", None)
    if defer_reads and hasattr(proposer, "defer_reads"):
        proposer.defer_reads = True
    return eng


def requests(grammar: str):
    """(prompt, params) pairs: greedy, seeded, logprobs, penalties and a grammar."""
    prompts = random_prompts([5, 23, 9, 17, 12, 30], seed=3)
    prompts.append(prompts[0] * 4)  # repeats itself: n-gram and suffix drafts
    prompts.append(prompts[1][:8] * 3)
    params = [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=11, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=5, top_p=0.9, logprobs=2, max_tokens=20),
        SamplingParams(temperature=0, logprobs=3, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.7, seed=3, top_k=20, frequency_penalty=0.5, max_tokens=20),
        SamplingParams(temperature=0, max_tokens=16, grammar=grammar),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=2, max_tokens=30, ignore_eos=True, logprobs=1),
    ]
    return prompts, params


def record(out) -> dict:
    entry = {"tokens": out.output_token_ids, "finish_reason": out.finish_reason}
    if out.logprobs is not None:
        entry["logprobs"] = [[lp, [list(t) for t in top]] for lp, top in out.logprobs]
    return entry


def choices(eng) -> dict:
    """What the engine chose: the k summed over its drafting decisions, the drafts it
    verified and accepted."""
    stats = eng.speculator.stats
    if stats is None:
        return {}
    return {"k_chosen_sum": stats.k_chosen_sum, "k_chosen_count": stats.k_chosen_count,
            "num_drafts": stats.num_drafts, "num_draft_tokens": stats.num_draft_tokens,
            "num_accepted_tokens": stats.num_accepted_tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(2)
    time.perf_counter = FakeClock()  # the guard's decisions: a function of the calls alone
    import engine as engine_pkg
    print("engine from", Path(engine_pkg.__file__).parent, file=sys.stderr)
    target, draft = models()
    tokenizer = build_tokenizer()
    grammar = structured.regex(r"[0-9]{1,12}")
    prompts, params = requests(grammar)
    result = {}
    head = untrained_head(target, tempfile.mkdtemp(prefix="record-head-"))
    for name, *case in cases():
        eng = engine(target, draft, tokenizer, *case, head=head)
        runs = {"alone": [eng.generate([p], [sp])[0] for p, sp in zip(prompts, params)],
                "staggered": staggered(eng, prompts, params),
                "at_once": eng.generate(prompts, params)}
        result[name] = {run: [record(o) for o in outs] for run, outs in runs.items()}
        result[name]["choices"] = choices(eng)
        print(name, "done", file=sys.stderr)
    Path(args.out).write_text(json.dumps(result, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
