"""Token trees in the engine: suffix proposals that branch, verified by pick in one forward,
the accepted path's K/V moved into place: output and cache exactly plain decoding's."""

import time

import numpy as np
import pytest
import torch
from conftest import build_tiny_model, make_engine, random_prompts, staggered

from engine import SamplingParams
from engine.batch import tree_paths
from engine.sample.keys import noise_key
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


@pytest.mark.parametrize("method,num_blocks", [("suffix", 256), ("hybrid", 256),
                                               ("suffix", 20), ("draft_model", 256),
                                               ("draft_model", 20)])
def test_greedy_and_seeded_with_trees_equal_plain_batched(method, num_blocks):
    """A staggered batch whose texts repeat with variations (an agent loop editing its own
    output): trees beside chains and plain rows, greedy and coupled seeded requests, prefix
    cache hits (the repeats) and, with few blocks, preemptions; some ask for logprobs. The
    draft model (alone, and in hybrid) drafts dynamic trees level by level."""
    target = build_tiny_model("qwen2", dtype=torch.bfloat16)
    base = random_prompts([14, 9, 20, 6], seed=21)
    variants = [b[:len(b) // 2] + [(t * 3) % 300 + 5 for t in b[len(b) // 2:]] for b in base]
    prompts = [b * 2 for b in base] + [v + b for v, b in zip(variants, base)]
    prompts = prompts + prompts
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                             logprobs=2 if i % 4 == 1 else None) if i % 2 else
              SamplingParams(temperature=0.9, seed=i, max_tokens=24, ignore_eos=True)
              for i in range(len(prompts))]
    plain = staggered(make_engine(target), prompts, params)
    draft = build_tiny_model("qwen2", seed=1, dtype=torch.bfloat16) \
        if method in ("hybrid", "draft_model") else None
    engine = make_engine(target, method, draft, max_num_seqs=8, tree_max_nodes=16,
                         num_blocks=num_blocks, block_size=8)
    trees = []
    verify = engine.verifier.verify

    def counting(*args, **kw):
        result = verify(*args, **kw)
        trees.extend(p for p in (result.paths or []) if p is not None)
        return result

    engine.verifier.verify = counting
    spec = staggered(engine, prompts, params)
    assert [o.output_token_ids for o in spec] == [o.output_token_ids for o in plain]
    # logprobs read at the accepted paths' rows: plain decoding's, bit for bit
    assert [o.logprobs for o in spec] == [o.logprobs for o in plain]
    assert trees and any(trees)  # trees were verified, and paths through them accepted
    if draft is not None:  # the draft model's own trees among them
        assert engine.speculator.stats.tree_verifications_by_method.get("draft_model", 0) > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert (engine.scheduler.stats.num_preemptions > 0) == (num_blocks < 100)


def _first_tokens(engine, prompt, params_list, batch=64):
    """[requests, 3] the first three generated tokens of `prompt` under each SamplingParams."""
    tokens = []
    for lo in range(0, len(params_list), batch):
        chunk = params_list[lo:lo + batch]
        tokens += [o.output_token_ids[:3] for o in engine.generate([prompt] * len(chunk), chunk)]
    return np.array(tokens)


def test_sampled_trees_of_the_draft_model_keep_the_targets_distribution():
    """Unseeded sampled requests (verified by rejection sampling) get the draft model's
    SAMPLED trees: children drawn from q without replacement, verified with q. Each of the
    first three tokens has plain decoding's distribution (two-sample chi-square, 2400
    requests each), the trees branched and were accepted, and no block leaks."""
    from conftest import distribution_pair, same_distribution_pvalue

    target, draft, prompt = distribution_pair()
    n = 2400
    params = SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True)
    plain = _first_tokens(make_engine(target, seed=11), prompt, [params] * n)
    engine = make_engine(target, "draft_model", draft, k_max=3, tree_max_nodes=8, seed=12,
                         sampled_trees=True)
    branched = []
    verify = engine.verifier.verify

    def counting(seqs, logits, row_offsets, drafts, masks=None):
        if drafts is not None:
            branched.extend(drafts.tree_q[i] is not None for i in range(len(seqs))
                            if drafts.parents_of(i) is not None)
        return verify(seqs, logits, row_offsets, drafts, masks)

    engine.verifier.verify = counting
    spec = _first_tokens(engine, prompt, [params] * n)
    for j in range(3):
        assert same_distribution_pvalue(plain[:, j], spec[:, j]) > 0.001, j
    st = engine.speculator.stats
    assert branched and all(branched)  # sampled trees with their q, none one-hot
    assert st.tree_verifications_by_method.get("draft_model", 0) > 0
    assert 0.05 < st.acceptance_rate < 0.99
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_sampled_trees_option_is_checked_and_off_by_default():
    from engine.config import SpeculativeConfig

    assert SpeculativeConfig().sampled_trees is False
    with pytest.raises(ValueError, match="sampled_trees"):
        SpeculativeConfig(method="draft_model", draft_model="d", sampled_trees="yes")


def test_sampled_shape_is_a_tree_of_its_most_likely_nodes():
    from engine.batch import check_tree
    from engine.spec_decode.tree_draft import sampled_confidence, sampled_shape

    shape = sampled_shape(0.6, width=3, max_nodes=10, depth=4, min_prob=0.01)
    check_tree(shape)
    assert len(shape) == 10 and shape[0] == -1
    conf = sampled_confidence(shape, 0.6)
    assert conf[0] == pytest.approx(0.6) and min(conf) >= 0.01
    # likeliest first: a node's children follow it, in rank order, and every prefix is a tree
    assert all(p < j for j, p in enumerate(shape))
    assert conf == sorted(conf, reverse=True)
    for k in range(1, len(shape)):
        check_tree(shape[:k])
    # a likelier acceptance goes deeper, an unlikely one wider
    deep = sampled_shape(0.9, 4, 8, 8, 0.0)
    wide = sampled_shape(0.2, 4, 8, 8, 0.0)
    depth = lambda s: max(len(p) for p in tree_paths(s))  # noqa: E731
    assert depth(deep) > depth(wide) and sum(p == -1 for p in wide) > sum(
        p == -1 for p in deep)
    assert sampled_shape(0.5, 2, 8, 3, min_prob=0.6) == []  # nothing pays for its row
    assert len(sampled_shape(0.5, 2, 100, 3, 0.0)) == 2 + 4 + 8  # a full tree of depth 3
    # the plan's chain (spine) is kept whatever its chances and the budget, branches beside it
    spine = sampled_shape(0.3, 4, 3, 6, min_prob=0.2, spine=5)
    assert spine == [-1, 0, 1]
    assert sampled_shape(0.3, 4, 16, 6, 0.2, spine=3) == [-1, 0, 1, -1]
    # a level below the first only where its chances sum to the price of its draft forward
    assert max(len(p) for p in tree_paths(sampled_shape(0.6, 4, 16, 6, 0.01, 0.5))) == 2


# -- tree_verify: the verification of trees, a pure function --------------------------------
TOKENS, TREE = [2, 4, 1, 3, 5], [-1, -1, 0, 0, 1]  # root: 2, 4; under 2: 1, 3; under 4: 5


def _verify(n, probs, by_pick=False, keys=None, generator=None, picks=None, tokens=TOKENS):
    """n copies of TREE over `probs` ([1 + nodes, V] rows: the root's, then each node's)."""
    from engine.sample.rejection_sampler import TreeOwners, tree_verify

    rows = len(TREE) + 1
    ids = torch.tensor(tokens * n)
    target = probs.repeat(n, 1)
    picks = target.argmax(dim=-1) if picks is None else picks.repeat(n)
    trees = TreeOwners([i * rows for i in range(n)], [i * len(TREE) for i in range(n)],
                       [TREE] * n, [by_pick] * n, keys if keys is not None else [None] * n)
    return tree_verify(ids, picks, None if by_pick else target, trees, generator)


def test_tree_by_pick_follows_the_targets_picks_to_any_branch():
    from engine.sample.rejection_sampler import PLACEHOLDER

    picks = torch.tensor([4, 0, 5, 0, 0, 7])  # root picks 4 (node 1), node 1 picks 5 (node 4)
    out, node = _verify(1, torch.zeros(6, 8), by_pick=True, picks=picks)
    assert out.tolist() == [[4, 5, 7]] and node.tolist() == [4]
    picks = torch.tensor([2, 3, 0, 0, 6, 0])  # 2 (node 0), then 3 (node 3), then its pick 6
    out, node = _verify(1, torch.zeros(6, 8), by_pick=True, picks=picks)
    assert out.tolist() == [[2, 3, 6]] and node.tolist() == [3]
    picks = torch.tensor([7, 0, 0, 0, 0, 0])  # nothing matches: the root's pick alone
    out, node = _verify(1, torch.zeros(6, 8), by_pick=True, picks=picks)
    assert out.tolist() == [[7, PLACEHOLDER, PLACEHOLDER]] and node.tolist() == [-1]


@pytest.mark.parametrize("tokens", [TOKENS, TOKENS[:-1] + [0]])
def test_tree_rejection_sampling_keeps_the_targets_distribution(tokens):
    """Every emitted position has the target's distribution given the tokens before it:
    the first token ~ p(root), the second after 2 ~ p(node 0), after 4 ~ p(node 1), the third
    after 2, 1 ~ p(node 2); chi-square goodness of fit over 40,000 draws. Second case: node 1's
    one child (fewer than the root's two: padded) is token 0, the padding's own index."""
    from scipy import stats

    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(6, 8, generator=g) * 1.5, dim=-1)
    n = 40000
    out, _ = _verify(n, probs, generator=torch.Generator().manual_seed(1), tokens=tokens)
    out = out.numpy()

    def check(draws, p):
        counts = np.bincount(draws, minlength=8)
        expected = p.double().numpy()
        assert stats.chisquare(counts, expected / expected.sum() * len(draws)).pvalue > 1e-3

    check(out[:, 0], probs[0])
    check(out[out[:, 0] == 2, 1], probs[1])
    check(out[out[:, 0] == 4, 1], probs[2])
    check(out[(out[:, 0] == 2) & (out[:, 1] == 1), 2], probs[3])
    assert (out[:, 1] >= 0).mean() > 0.2  # the tree was accepted often enough to test


def _sampled_trees(n, p_root, p1, p2, q_root, q1, generator, with_q):
    """n trees of TREE's shape whose children were drawn from q WITHOUT replacement (Gumbel
    top-k): the root's two from q_root, node 0's two and node 1's one from q1[its token]; p
    over the path: p_root, p1[a], p2[a, b]. with_q[i]: tree i carries its q (else one-hot)."""
    from engine.sample.rejection_sampler import TreeOwners

    def draw(q, k):  # [n, V] -> [n, k] without replacement, in order
        gumbel = -torch.log(-torch.log(torch.rand(q.shape, generator=generator)))
        return (q.log() + gumbel).topk(k, dim=-1).indices

    root = draw(q_root.expand(n, -1), 2)
    under0, under1 = draw(q1[root[:, 0]], 2), draw(q1[root[:, 1]], 1)
    ids = torch.stack([root[:, 0], root[:, 1], under0[:, 0], under0[:, 1], under1[:, 0]], 1)
    a, b = root[:, 0], root[:, 1]
    target = torch.stack([p_root.expand(n, -1), p1[a], p1[b], p2[a, under0[:, 0]],
                          p2[a, under0[:, 1]], p2[b, under1[:, 0]]], 1)  # [n, 6, V]
    zero = torch.zeros_like(q_root).expand(n, -1)
    q = torch.stack([q_root.expand(n, -1), q1[a], q1[b], zero, zero, zero], 1)
    rows = len(TREE) + 1
    trees = TreeOwners([i * rows for i in range(n)], [i * len(TREE) for i in range(n)],
                       [TREE] * n, [False] * n, [None] * n,
                       [q[i] if with_q[i] else None for i in range(n)])
    return ids.reshape(-1), target.reshape(n * rows, -1), trees


def test_tree_rejection_with_q_keeps_the_targets_distribution():
    """Children drawn from the proposer's q without replacement, verified by recursive
    rejection sampling with q: every emitted position has the target's distribution given the
    tokens before it (chi-square over 40,000 trees), and trees without q in the same batch
    (one-hot) too. q lacks tokens p has and p lacks tokens q has; it is far from p, so the
    residuals matter."""
    from scipy import stats

    from engine.sample.rejection_sampler import tree_verify

    g = torch.Generator().manual_seed(5)
    v, n = 8, 40000
    p_root = torch.softmax(torch.randn(v, generator=g) * 1.5, -1)
    p1 = torch.softmax(torch.randn(v, v, generator=g) * 1.5, -1)
    p2 = torch.softmax(torch.randn(v, v, v, generator=g) * 1.5, -1)
    p_root[7] = 0.0  # p lacks a token q has
    p_root /= p_root.sum()
    # peaked: a drawn child takes much of q's mass, so q after it (without replacement) differs
    q_root = torch.softmax(torch.randn(v, generator=g) * 3.0, -1)
    q1 = torch.softmax(torch.randn(v, v, generator=g) * 3.0, -1)
    q_root[0] = 0.0  # q lacks a token p has
    q_root /= q_root.sum()
    with_q = [i % 4 != 0 for i in range(n)]  # every fourth tree one-hot
    ids, target, trees = _sampled_trees(n, p_root, p1, p2, q_root, q1, g, with_q)
    out, node = tree_verify(ids, target.argmax(dim=-1), target, trees,
                            torch.Generator().manual_seed(6))
    out = out.numpy()

    def check(draws, p):
        counts = np.bincount(draws, minlength=v)
        expected = p.double().numpy()
        assert stats.chisquare(counts[expected > 0],
                               (expected / expected.sum() * len(draws))[expected > 0]
                               ).pvalue > 1e-3
        assert counts[expected == 0].sum() == 0

    for part in (np.array(with_q), ~np.array(with_q)):
        first = out[part]
        check(first[:, 0], p_root)
        # (a token drawn from a residual ends the step: what follows an ACCEPTED one)
        for a in range(v):
            after = first[(first[:, 0] == a) & (first[:, 1] >= 0), 1]
            if len(after) > 2000:
                check(after, p1[a])
        deep = first[first[:, 2] >= 0]
        pairs = np.unique(deep[:, :2], axis=0, return_counts=True)
        a, b = pairs[0][pairs[1].argmax()]
        check(deep[(deep[:, 0] == a) & (deep[:, 1] == b), 2], p2[a, b])
    assert (node.numpy() >= 0).mean() > 0.1  # the trees were accepted often enough to test
    # q read: a proposer whose q is p has its first child accepted at every node
    ids, target, trees = _sampled_trees(2000, p_root, p1, p2, p_root, p1, g, [True] * 2000)
    out, node = tree_verify(ids, target.argmax(dim=-1), target, trees,
                            torch.Generator().manual_seed(7))
    assert (out[:, 2] >= 0).all() and set(node.tolist()) == {2}


def test_seeded_tree_rejection_is_reproducible_and_keyed():
    probs = torch.softmax(torch.randn(6, 8, generator=torch.Generator().manual_seed(2)), -1)
    keys = [[noise_key(7, p) for p in (10, 11, 11, 12, 12, 12)]] * 2
    a, _ = _verify(2, probs, keys=keys, generator=torch.Generator().manual_seed(3))
    b, _ = _verify(2, probs, keys=keys, generator=torch.Generator().manual_seed(4))
    assert torch.equal(a, b) and torch.equal(a[0], a[1])  # the keys decide, not the generator


def test_server_reports_token_trees_in_usage_and_metrics(tmp_path):
    """The official client: seeded sampled answers to one prompt differ, so a later request's
    suffix proposals branch; usage and /metrics count the trees and their nodes."""
    import httpx
    import openai
    from server_utils import ServerProcess, save_tiny_model

    model = save_tiny_model(tmp_path / "tiny")
    cfg = tmp_path / "trees.yaml"
    cfg.write_text(f"engine:\n  model: {model}\n  device: cpu\n  num_threads: 1\n"
                   f"  speculative:\n    method: suffix\n    adaptive: false\n"
                   f"    tree_max_nodes: 16\n")
    srv = ServerProcess(["--config", str(cfg), "--served-model-name", "tiny"]).wait_ready()
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        trees = {"tree_verifications": 0, "tree_drafted_tokens": 0}
        for seed in range(8):
            out = client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "the lazy dog jumps"}],
                temperature=0.8, seed=seed, max_tokens=40, extra_body={"ignore_eos": True})
            spec = (out.usage.model_extra or {}).get("speculative") or {}
            for key in trees:
                trees[key] += spec.get(key, 0)
        assert trees["tree_verifications"] > 0
        assert trees["tree_drafted_tokens"] > trees["tree_verifications"]  # they branched
        time.sleep(1.5)  # the idle refresh publishes the last step's counts
        text = httpx.get(srv.url + "/metrics").text
        counted = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                   if line.startswith("specserve:spec_decode_num_tree")}
        assert counted["specserve:spec_decode_num_tree_verifications_total"] \
            == trees["tree_verifications"]
        assert counted["specserve:spec_decode_num_tree_nodes_total"] \
            == trees["tree_drafted_tokens"]
    finally:
        assert srv.terminate() == 0, srv.log()


def test_a_heads_features_follow_the_accepted_path():
    """A draft head reads the target's features at committed positions: after a tree, the
    committed tokens' rows and then the accepted path's nodes' rows, in path order."""
    from types import SimpleNamespace

    from engine.batch import StepLogits
    from engine.spec_decode.speculator import NoSpeculation

    kept = []

    class Recorder(NoSpeculation):
        def keep_features(self, entries, step):
            kept.append(([(seq, start, n) for seq, start, n in entries], step.hidden.tolist()))

    a, b = Sequence("a", [1], SamplingParams()), Sequence("b", [1], SamplingParams())
    out = SimpleNamespace(scheduled=[
        SimpleNamespace(seq=a, start=10, token_ids=[7], num_drafts=4),  # a tree
        SimpleNamespace(seq=b, start=20, token_ids=[8], num_drafts=2)])  # a chain
    hidden = torch.arange(8.0)[:, None]  # row r's feature: r
    Recorder().verified(out, StepLogits(torch.zeros(8, 3), [0, 5, 8], hidden), [[], []],
                        None, [[1, 3], None])
    entries, rows = kept[0]
    assert entries == [(a, 10, 3), (b, 20, 3)]
    assert [r[0] for r in rows] == [0, 2, 4, 5, 6, 7]  # a: row 0, nodes 1 and 3; b: all


# -- the price of a tree's node: measured costs and calibrated confidences -------------------
def test_a_tree_nodes_price_comes_from_the_measured_verify_costs():
    """A node is worth its row where its chance of acceptance beats the target's marginal
    cost per verified row at the rate the plan predicts: dearer rows, a higher bar; nothing
    measured yet, no bar (the tree takes what its limit allows)."""
    from engine.spec_decode.adaptive import KController

    def controller(costs):
        ctl = KController(k_max=4)
        for tokens, seconds in costs:
            ctl.target_cost.record(tokens, 1, seconds)
        return ctl

    def node(ctl):
        return ctl.tree_prices([0.8], [4], 0, 0, 4)[0]

    def level(ctl):
        return ctl.tree_prices([0.8], [4], 0, 0, 4)[1]

    assert node(KController(k_max=4)) == 0.0
    cheap = controller([(1, 0.050), (5, 0.065), (9, 0.090)])
    dear = controller([(1, 0.050), (5, 0.100), (9, 0.150)])
    assert 0.1 < node(cheap) < node(dear) < 0.6
    # a level of the tree pays for its draft forward: a third of a step (the 0.5B draft
    # model) asks for more than a head's twentieth does
    assert level(cheap) == 0.0  # no draft cost measured yet
    prices = []
    for seconds in (0.003, 0.017):  # a head's forward of 4 rows, the draft model's
        ctl = controller([(1, 0.050), (5, 0.065), (9, 0.090)])
        ctl.draft_cost.record(4, 1, seconds)
        prices.append(level(ctl))
    # in tokens: the share of a 3.4-token step of 65 ms the forward costs
    assert prices == pytest.approx([3.36 * 3 / 65, 3.36 * 17 / 65], rel=0.01)


def test_a_heads_tree_confidences_are_calibrated_by_what_verification_accepts():
    from engine.config import SpeculativeConfig
    from engine.spec_decode.guard import Choice, Guard
    from engine.spec_decode.stats import SpecDecodeStats

    guard = Guard(SpeculativeConfig(method="eagle", speculator="s"), SpecDecodeStats(k_max=4),
                  "eagle", True, False, 128)
    choice = Choice([4], [0], [0.7], node_threshold=0.2, level_price=0.3)
    assert guard.tree_scale == 1.0 and guard.tree_prices(choice) == pytest.approx((0.2, 0.3))
    for _ in range(6):  # the head's nodes promised 4 tokens a tree, verification gave 2
        guard.tree_verification(2, True, 4.0)
    assert guard.tree_scale == pytest.approx(0.5)
    # a node needs twice the chance, a level twice the sum
    assert guard.tree_prices(choice) == pytest.approx((0.4, 0.6))


def _shape_steps(guard, tree_seconds, chain_seconds, steps=240):
    """Decode steps of one sequence verifying 4 drafts and accepting 2, each as long as its
    shape costs; the shapes the guard chose, in order."""
    from engine.spec_decode.guard import StepRecord

    class Clock:
        @staticmethod
        def seconds(start, end):
            return end - start

    now, chosen = 0.0, []
    for _ in range(steps):
        chosen.append(guard.trees(1))
        seconds = tree_seconds if chosen[-1] else chain_seconds
        record = StepRecord(started=now, num_tokens=5, num_seqs=1, verified=[(4, 2)],
                            marks=Clock, target_start=now, target_end=now + seconds)
        now += seconds
        guard.step(record, now)
    return chosen


@pytest.mark.parametrize("tree_seconds,chain_seconds", [(0.08, 0.05), (0.05, 0.06)])
def test_the_guard_drafts_chains_where_trees_realized_less(tree_seconds, chain_seconds):
    """Trees and chains of the same accepted tokens: where the tree steps take longer the
    guard drafts chains after its first measurements, with a few tree steps now and then;
    where they are faster it keeps trees, with a chain step now and then; not adaptive:
    trees whatever they cost."""
    from engine.config import SpeculativeConfig
    from engine.spec_decode.guard import Guard
    from engine.spec_decode.stats import SpecDecodeStats

    def guard(adaptive=True):
        return Guard(SpeculativeConfig(method="draft_model", draft_model="d", tree_max_nodes=16,
                                       adaptive=adaptive),
                     SpecDecodeStats(k_max=4), "draft_model", True, False, 128)

    g = guard()
    chosen = _shape_steps(g, tree_seconds, chain_seconds)
    # the first steps measure both (a chain in 4) until each shape has its rate
    assert chosen[:16] == [True, True, True, False] * 4
    later = chosen[24:]
    if tree_seconds > chain_seconds:
        assert 0 < later.count(True) <= 0.1 * len(later)  # exploring bursts only
    else:
        assert 0 < later.count(False) <= 0.05 * len(later)  # refreshes of the chains' rate
    assert g.stats.num_chain_steps_chosen == chosen.count(False)
    assert all(_shape_steps(guard(adaptive=False), tree_seconds, chain_seconds, steps=40))


def test_a_step_whose_tree_capable_sources_drafted_nothing_counts_for_neither_shape():
    """Only steps where a proposer that may draft a tree (or a suffix match) drafted count for
    the shape the guard chose: in hybrid, a step whose drafts all came from the draft model's
    chains for requests verified by rejection (seeded: no trees) is neither's."""
    from engine.spec_decode.suffix import SuffixDraft

    target = build_tiny_model("qwen2")
    draft = build_tiny_model("qwen2", seed=1)
    engine = make_engine(target, "hybrid", draft, tree_max_nodes=8, verification="rejection")
    spec = engine.speculator
    spec.suffix.propose = spec.suffix.propose_tree = lambda *a, **kw: SuffixDraft()
    recorded = []
    record = spec.guard.shapes.record
    spec.guard.shapes.record = lambda seqs, trees, tokens, seconds: (
        recorded.append(trees), record(seqs, trees, tokens, seconds))
    engine.generate(random_prompts([6, 9], seed=2),
                    [SamplingParams(temperature=0.8, seed=s, max_tokens=12, ignore_eos=True)
                     for s in (1, 2)])
    assert spec.stats.num_drafts > 0 and recorded == []
    # greedy requests draft the draft model's trees: their steps count for trees
    engine.generate(random_prompts([6, 9], seed=3),
                    SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert recorded and all(recorded)


@pytest.mark.parametrize("method", ["draft_model", "hybrid"])
def test_trees_and_chains_switched_per_step_equal_plain(method):
    """The guard's shape changes from step to step (here at random): a sequence that drafted
    a tree drafts a chain next and back, beside others, greedy and coupled seeded, suffix
    trees with them in hybrid: plain decoding's output, token for token."""
    import random

    target = build_tiny_model("qwen2", dtype=torch.bfloat16)
    draft = build_tiny_model("qwen2", seed=1, dtype=torch.bfloat16)
    base = random_prompts([11, 7, 16, 5], seed=5)
    prompts = [b * 3 for b in base] * 2
    params = [SamplingParams(temperature=0, max_tokens=28, ignore_eos=True) if i % 2 else
              SamplingParams(temperature=0.8, seed=i, max_tokens=28, ignore_eos=True)
              for i in range(len(prompts))]
    plain = staggered(make_engine(target), prompts, params)
    engine = make_engine(target, method, draft, max_num_seqs=8, tree_max_nodes=12)
    rng, shapes = random.Random(3), []
    engine.speculator.guard.trees = lambda n: shapes.append(rng.random() < 0.5) or shapes[-1]
    spec = staggered(engine, prompts, params)
    assert [o.output_token_ids for o in spec] == [o.output_token_ids for o in plain]
    assert shapes.count(False) > 10
    assert engine.speculator.stats.tree_verifications_by_method.get("draft_model", 0) > 10
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


# -- dynamic trees (EAGLE-2): which nodes a proposer runs and which the tree keeps ------------
def test_a_dynamic_tree_expands_the_most_probable_nodes_and_keeps_the_best():
    """A proposer whose next-token probabilities are given: the first forward scores the root;
    each level expands its `width` most probable nodes by path probability, one row each,
    reading its ancestors' slots; the tree keeps the most probable nodes above min_prob, a
    parent before its children."""
    from engine.spec_decode.draft_model import DraftSampler
    from engine.spec_decode.tree_draft import grow

    vocab = 6

    def dist(pairs):
        p = torch.full((vocab,), 1e-9)
        for t, v in pairs:
            p[t] = v
        return torch.log(p)

    root = dist([(0, 0.6), (1, 0.3), (2, 0.1)])
    after = {0: dist([(3, 0.9), (4, 0.1)]), 1: dist([(3, 0.6), (5, 0.4)]),
             3: dist([(0, 0.7), (1, 0.3)])}

    class Model:
        rows: list = []

        def first_forward(self, seqs):
            return torch.stack([root] * len(seqs)), [None] * len(seqs), 7

        def node_forward(self, rows):
            self.rows.append([(n.token, n.depth, n.keys()) for _, n in rows])
            return torch.stack([after[n.token] for _, n in rows]), [None] * len(rows)

    seq = Sequence("r", list(range(7)), SamplingParams(temperature=0))
    n = seq.num_tokens
    model = Model()
    proposal = grow(model, DraftSampler(vocab, torch.device("cpu"), 0, True), [seq], [3],
                    [8], width=2, min_prob=0.1)
    # level 2 runs the root's two best children, level 3 the two best grandchildren by path
    # probability (0.6 x 0.9 and 0.3 x 0.6), each on its own slot after the committed tokens
    assert model.rows == [[(0, 1, (n,)), (1, 1, (n + 1,))],
                          [(3, 2, (n, n + 2)), (3, 2, (n + 1, n + 3))]]
    assert proposal.token_ids == [[0, 3, 0, 1, 3, 1, 0, 5]]
    assert proposal.parents == [[-1, 0, 1, -1, 3, 1, 4, 3]]
    assert proposal.confidence[0] == pytest.approx([0.6, 0.54, 0.378, 0.3, 0.18, 0.162, 0.126,
                                                    0.12], rel=1e-5)
    assert [f[0] for f in proposal.forwards] == [7, 2, 2]  # rows per forward
    # a tighter bar keeps fewer nodes and expands fewer
    model.rows = []
    proposal = grow(model, DraftSampler(vocab, torch.device("cpu"), 0, True), [seq], [3],
                    [8], width=2, min_prob=0.5)
    assert proposal.token_ids == [[0, 3]] and proposal.parents == [[-1, 0]]
    assert model.rows == [[(0, 1, (n,))], [(3, 2, (n, n + 1))]]
    # a level is drafted only where what it expands may add enough: 0.6 + 0.3 does, the
    # next level's 0.54 + 0.18 does not
    model.rows = []
    proposal = grow(model, DraftSampler(vocab, torch.device("cpu"), 0, True), [seq], [3],
                    [8], width=2, min_prob=0.1, min_level=0.85)
    assert len(model.rows) == 1 and proposal.token_ids == [[0, 3, 1, 3, 5]]


def test_a_heads_features_after_a_tree_are_its_accepted_paths_rows():
    """After a token tree's verification, a head gets the target's features of the committed
    tokens and then of the accepted path's nodes in depth order (not the first nodes)."""
    from types import SimpleNamespace

    from engine.batch import Drafts, StepLogits
    from engine.config import SpeculativeConfig
    from engine.spec_decode.proposer import Proposal, Proposer
    from engine.spec_decode.speculator import Speculator

    kept = []

    class Head(Proposer):
        method = "eagle"

        def propose(self, seqs, ks):
            return Proposal([[] for _ in seqs], [None] * len(seqs))

        def keep_features(self, entries, hidden):
            kept.append((entries, hidden.clone()))

    spec = Speculator(SpeculativeConfig(method="eagle", speculator="x", tree_max_nodes=8),
                      Head(), 64, 64, torch.device("cpu"))
    seq = Sequence("r", [1, 2, 3], SamplingParams(temperature=0))
    seq.num_computed_tokens = 2
    parents = [-1, -1, 0, 1]  # root -> 0 -> 2, root -> 1 -> 3
    drafts = Drafts([4], torch.tensor([7, 8, 9, 10]), [7, 8, 9, 10], parents=parents)
    out = SimpleNamespace(scheduled=[SimpleNamespace(seq=seq, start=2, token_ids=[3],
                                                     num_drafts=4)])
    hidden = torch.arange(5, dtype=torch.float32)[:, None]  # row r: the committed token, nodes
    step = StepLogits(torch.zeros(5, 4), [0, 5], hidden)
    spec.verified(out, step, [[8, 10, 11]], drafts, [[1, 3]])
    (entries, features), = kept
    assert entries == [(seq, 2, 3)]
    assert features[:, 0].tolist() == [0.0, 2.0, 4.0]  # the root's row, then nodes 1 and 3
