"""The verifier: greedy cases with exact expectations, determinism, and the distribution."""

import numpy as np
import pytest
import torch
from scipy import stats

from engine.sample import sampler
from engine.sample.keys import noise_key
from engine.sample.rejection_sampler import NO_KEY, PLACEHOLDER, rejection_sample, to_lists
from engine.sampling_params import SamplingParams

V = 8


def verify(drafts, ks, target, by_pick, qs=None, keys=None, generator=None, picks=None):
    """rejection_sample from per-sequence inputs: qs[i] sequence i's q ([k_i, V], None:
    one-hot), keys[i] the noise keys of its k_i + 1 rows (None: unseeded)."""
    B = len(ks)
    has_q = np.array([q is not None for q in qs]) if qs is not None else None
    flat_q = None
    if qs is not None and any(q is not None for q in qs):
        like = next(q for q in qs if q is not None)
        flat_q = torch.cat([q if q is not None else torch.full((k, like.shape[1]), float("nan"))
                            for q, k in zip(qs, ks)])  # rows without q: never read
    flat_keys = None if keys is None else np.array(
        [key for r, k in zip(keys, ks) for key in (r if r is not None else [NO_KEY] * (k + 1))],
        dtype=np.int64)
    return rejection_sample(drafts, ks, target, np.array(by_pick, dtype=bool)[:B],
                            draft_probs=flat_q, has_q=has_q, noise_keys=flat_keys,
                            default_generator=generator, picks=picks)


def one_hot_rows(ids):
    """Target 'probabilities' whose argmax is each id."""
    rows = torch.full((len(ids), V), 0.01)
    rows[torch.arange(len(ids)), torch.tensor(ids)] = 0.9
    return rows


def greedy_run(drafts_per_seq, target_ids_per_seq):
    flat = [t for d in drafts_per_seq for t in d]
    target = one_hot_rows([t for ids in target_ids_per_seq for t in ids])
    return verify(torch.tensor(flat, dtype=torch.long), [len(d) for d in drafts_per_seq],
                  target, [True] * len(drafts_per_seq))


def test_greedy_all_accepted_plus_bonus():
    out = greedy_run([[1, 2, 3]], [[1, 2, 3, 4]])
    assert out.tolist() == [[1, 2, 3, 4]]


def test_greedy_early_mismatch_takes_target_token():
    out = greedy_run([[1, 5, 3]], [[1, 2, 3, 4]])
    assert out.tolist() == [[1, 2, PLACEHOLDER, PLACEHOLDER]]
    out = greedy_run([[6, 2, 3]], [[1, 2, 3, 4]])
    assert to_lists(out) == [[1]]


def test_greedy_empty_drafts_and_mixed_batch():
    out = greedy_run([[], [1, 2], [7], []], [[5], [1, 3, 0], [7, 6], [2]])
    assert to_lists(out) == [[5], [1, 3], [7, 6], [2]]
    assert out.shape == (4, 3)


def test_all_empty_drafts_is_plain_sampling():
    out = greedy_run([[], []], [[3], [4]])
    assert out.tolist() == [[3], [4]]


def test_verified_by_given_picks_ignores_the_distribution():
    """Coupled verification: accept while the draft equals the target's own pick (here not the
    argmax of target_probs), then emit that pick; a sequence verified by rejection beside it."""
    drafts = torch.tensor([1, 5, 3, 2, 2], dtype=torch.long)
    target = one_hot_rows([7, 7, 7, 7, 0, 0, 0])  # argmax 7 for the first sequence's rows
    target[4:6] = torch.nn.functional.one_hot(torch.tensor([2, 2]), V).float()  # p(2) = 1
    picks = torch.tensor([1, 2, 3, 4, 6, 6, 6])  # never read for the second sequence
    out = verify(drafts, [3, 2], target, [True, False], generator=torch.Generator().manual_seed(0),
                 picks=picks)
    assert to_lists(out)[0] == [1, 2]
    assert to_lists(out)[1][:2] == [2, 2] and len(to_lists(out)[1]) == 3  # p(2) = 1: kept


def _random_case(seed, batch=6, k=3, vocab=V):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(batch * (k + 1), vocab, generator=g) * 0.3, -1)
    q = torch.softmax(torch.randn(batch * k, vocab, generator=g) * 0.3, -1)
    drafts = torch.multinomial(q, 1, generator=g)[:, 0]
    return drafts, p, q


def test_seeded_sequences_are_deterministic_regardless_of_batch():
    drafts, p, q = _random_case(0)

    def run(seed, other_seed):
        keys = [[noise_key(other_seed + i, t) for t in range(4)] for i in range(5)]
        keys.insert(2, [noise_key(seed, t) for t in range(4)])  # positions 0..3
        default = torch.Generator().manual_seed(other_seed)
        return verify(drafts, [3] * 6, p, [False] * 6, list(q.split(3)), keys,
                      default)[2].tolist()

    assert run(7, 1) == run(7, 2) == run(7, 3)
    assert len({tuple(run(s, 1)) for s in range(20)}) > 1


def test_sequences_with_and_without_q_verify_as_they_would_alone():
    """q is given per sequence (None: one-hot on its drafts, as n-gram drafts are): a seeded
    sequence's tokens are the same in a batch that mixes both kinds as alone."""
    drafts, p, q = _random_case(1, batch=3)
    keys = [[noise_key(s, t) for t in range(4)] for s in (3, 4, 5)]
    qs = [q[0:3], None, q[6:9]]

    def run(seqs):
        flat = torch.cat([drafts[3 * i:3 * i + 3] for i in seqs])
        target = torch.cat([p[4 * i:4 * i + 4] for i in seqs])
        return to_lists(verify(flat, [3] * len(seqs), target, [False] * len(seqs),
                               [qs[i] for i in seqs], [keys[i] for i in seqs]))

    together = run([0, 1, 2])
    assert together == run([0]) + run([1]) + run([2])
    assert together[:1] + together[2:] == run([0, 2]) and together[1:2] == run([1])


def test_emitted_tokens_stay_inside_top_k_top_p_set():
    g = torch.Generator().manual_seed(3)
    params = SamplingParams(temperature=1.0, top_k=3, top_p=0.8)
    batch, k, vocab = 50, 3, 30
    raw_t = torch.randn(batch * (k + 1), vocab, generator=g) * 3
    raw_d = torch.randn(batch * k, vocab, generator=g) * 3
    rows_t = [sampler.RowSpec(params, [], [], None)] * len(raw_t)
    rows_d = [sampler.RowSpec(params, [], [], None)] * len(raw_d)
    proc_t = sampler.process_logits(raw_t, sampler.build_sampling_tensors(rows_t, vocab, "cpu"))
    proc_d = sampler.process_logits(raw_d, sampler.build_sampling_tensors(rows_d, vocab, "cpu"))
    p, q = torch.softmax(proc_t, -1), torch.softmax(proc_d, -1)
    drafts = torch.multinomial(q, 1, generator=g)[:, 0]
    for trial in range(5):
        out = verify(drafts, [k] * batch, p, [False] * batch, list(q.split(k)),
                     generator=torch.Generator().manual_seed(trial))
        for i, row in enumerate(to_lists(out)):
            for j, tok in enumerate(row):
                assert p[i * (k + 1) + j, tok] > 0, "token outside the allowed set"


def _expected(probs, n):
    probs = probs.double().numpy()
    return probs / probs.sum() * n


def _first_token_frequencies(p_rows, q_rows, drafts, n, seed, one_hot):
    """Emitted first token of n sequences that all share one position's p and q."""
    k = 1
    target = torch.cat([p_rows[0:1], p_rows[1:2]]).repeat(n, 1)  # [n * 2, V]
    dprobs = None if one_hot else [q_rows[0:1]] * n
    out = verify(drafts, [k] * n, target, [False] * n, dprobs,
                 generator=torch.Generator().manual_seed(seed))
    return torch.bincount(out[:, 0], minlength=p_rows.shape[1]).numpy()


@pytest.mark.parametrize("one_hot", [False, True])
@pytest.mark.parametrize("case", range(3))
def test_emitted_distribution_is_the_target_distribution(one_hot, case):
    """χ² test over 200k draws: emitted ~ p whatever q is (vocab 20, random p and q)."""
    vocab, n = 20, 200_000
    g = torch.Generator().manual_seed(100 + case)
    p = torch.softmax(torch.randn(2, vocab, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(1, vocab, generator=g) * 1.5, -1)
    if one_hot:  # a deterministic draft (n-gram): always the same proposed token
        drafts = torch.full((n,), int(torch.randint(vocab, (1,), generator=g)))
    else:
        drafts = torch.multinomial(q[0], n, replacement=True, generator=g)
    counts = _first_token_frequencies(p, q, drafts, n, seed=case, one_hot=one_hot)
    expected = _expected(p[0], n)
    _, pvalue = stats.chisquare(counts, expected)
    assert pvalue > 0.001, (counts, expected)
    # and the check has teeth: the draft distribution itself is rejected
    if not one_hot:
        _, p_draft = stats.chisquare(np.bincount(drafts.numpy(), minlength=vocab),
                                     expected)
        assert p_draft < 1e-6


def test_bonus_token_distribution_when_all_accepted():
    """q == p: everything is accepted and the bonus token follows the next row's p."""
    vocab, n = 10, 100_000
    g = torch.Generator().manual_seed(5)
    p = torch.softmax(torch.randn(2, vocab, generator=g), -1)
    drafts = torch.multinomial(p[0], n, replacement=True, generator=g)
    target = p.repeat(n, 1)
    out = verify(drafts, [1] * n, target, [False] * n, [p[0:1]] * n,
                 generator=torch.Generator().manual_seed(0))
    assert bool((out[:, 0] == drafts).all())
    counts = torch.bincount(out[:, 1], minlength=vocab).numpy()
    _, pvalue = stats.chisquare(counts, _expected(p[1], n))
    assert pvalue > 0.001
