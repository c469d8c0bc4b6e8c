"""Token trees in the engine: suffix proposals that branch, verified by pick in one forward,
the accepted path's K/V moved into place: output and cache exactly plain decoding's."""

import pytest
import torch
from conftest import build_tiny_model, make_engine, random_prompts, staggered

from engine import SamplingParams
from engine.batch import tree_paths
from engine.sequence import Sequence
from engine.spec_decode.suffix import SuffixCache

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def _finish(cache: SuffixCache, tokens: list[int], salt=None) -> None:
    s = Sequence(f"h{len(tokens)}-{tokens[0]}-{tokens[-1]}-{id(tokens)}", list(tokens),
                 SamplingParams(), cache_salt=salt)
    cache.finish(s)


def test_suffix_tree_branches_where_earlier_texts_continue_differently():
    cache = SuffixCache(max_spec_tokens=8, min_token_prob=0.1)
    ctx = [5, 6, 7, 8]
    _finish(cache, ctx + [10, 11, 12, 13])
    _finish(cache, ctx + [10, 11, 14, 15])
    _finish(cache, ctx + [20, 21, 22, 23])
    s = Sequence("q", [1, 2] + ctx, SamplingParams())
    cache.sync(s)
    draft = cache.propose_tree(s, max_depth=8, max_nodes=16)
    paths = tree_paths(draft.parents)
    texts = {tuple(draft.token_ids[a] for a in p) for p in paths}
    assert (10, 11, 12, 13) in texts and (10, 11, 14, 15) in texts and (20, 21, 22, 23) in texts
    assert draft.confidence == sorted(draft.confidence, reverse=True)  # best first
    assert all(p < i for i, p in enumerate(draft.parents))  # parents first: a prefix is a tree
    assert draft.token_ids[0] == 10  # the most frequent continuation first
    small = cache.propose_tree(s, max_depth=8, max_nodes=3)
    assert small.token_ids == draft.token_ids[:3] and small.parents == draft.parents[:3]
    assert cache.propose_tree(s, max_depth=2, max_nodes=16).parents is not None
    assert max(len(p) for p in tree_paths(cache.propose_tree(s, 2, 16).parents)) == 2


def _kv(engine, seq, n):
    """Every layer's K and V at the sequence's positions 0..n-1."""
    bs, table = engine.config.block_size, seq.block_table
    slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(n)])
    runner = engine.runner
    return [flat[slots].clone() for layer in range(runner.shape.num_layers)
            for flat in runner.kv.flat(layer)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tree_whose_right_branch_is_accepted_gives_plain_output_and_plain_kv(dtype):
    """The suffix cache is primed so that the sequence's true continuation is the tree's
    less frequent branch (its nodes interleaved with a wrong branch's): the accepted path's
    K/V must move, and the cache must then hold what plain decoding wrote."""
    target = build_tiny_model("qwen2", dtype=dtype)
    prompt = random_prompts([24], seed=3)[0]
    plain = make_engine(target)
    rid = plain.add_request(prompt, GREEDY)
    plain.step()
    while plain.scheduler.running[0].num_computed_tokens < len(prompt) + 30:
        plain.step()
    truth = plain.scheduler.running[0].token_ids[len(prompt):]
    engine = make_engine(target, "suffix", tree_max_nodes=16)
    suffix = engine.speculator.suffix
    head = prompt[-8:] + truth[:1]
    wrong = [(t + 7) % 300 + 10 for t in truth[1:30]]
    for _ in range(2):  # the wrong continuation twice, the true one once: a 1/3 branch
        _finish(suffix, head + wrong)
    _finish(suffix, head + truth[1:30])
    moves = []
    compact = engine.runner.compact
    engine.runner.compact = lambda m: (moves.extend(m), compact(m))
    engine.add_request(prompt, GREEDY)
    engine.step()
    steps = 0
    while engine.scheduler.running[0].num_computed_tokens < len(prompt) + 30:
        engine.step()
        steps += 1
    seq = engine.scheduler.running[0]
    n = len(prompt) + 30
    assert seq.token_ids[len(prompt):n] == truth[:30]
    assert steps < 10  # the true branch was accepted many tokens at a time
    assert moves  # and its nodes' K/V moved into place
    moved = [torch.equal(a, b) for a, b in zip(_kv(engine, seq, n),
                                               _kv(plain, plain.scheduler.running[0], n))]
    assert all(moved)
    engine.abort(seq.request_id), plain.abort(rid)


@pytest.mark.parametrize("method", ["suffix", "hybrid"])
def test_greedy_and_seeded_with_trees_equal_plain_batched(method):
    """A staggered batch whose texts repeat with variations (an agent loop editing its own
    output): trees beside chains and plain rows, greedy and coupled seeded requests."""
    target = build_tiny_model("qwen2", dtype=torch.bfloat16)
    base = random_prompts([14, 9, 20, 6], seed=21)
    variants = [b[:len(b) // 2] + [(t * 3) % 300 + 5 for t in b[len(b) // 2:]] for b in base]
    prompts = [b * 2 for b in base] + [v + b for v, b in zip(variants, base)]
    prompts = prompts + prompts
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True) if i % 2 else
              SamplingParams(temperature=0.9, seed=i, max_tokens=24, ignore_eos=True)
              for i in range(len(prompts))]
    plain = staggered(make_engine(target), prompts, params)
    draft = build_tiny_model("qwen2", seed=1, dtype=torch.bfloat16) if method == "hybrid" \
        else None
    engine = make_engine(target, method, draft, max_num_seqs=8, tree_max_nodes=16)
    trees = []
    verify = engine.verifier.verify

    def counting(*args, **kw):
        result = verify(*args, **kw)
        trees.extend(p for p in (result.paths or []) if p is not None)
        return result

    engine.verifier.verify = counting
    spec = staggered(engine, prompts, params)
    assert [o.output_token_ids for o in spec] == [o.output_token_ids for o in plain]
    assert trees and any(trees)  # trees were verified, and paths through them accepted
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
