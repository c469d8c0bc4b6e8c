"""One host-device synchronization per step: the target pass, sampling, verification and
logprobs read nothing back from the device except through ONE `device_io.fetch` of the step's
results, and never build a device tensor from a Python list in a way that blocks.

On the CPU every tensor is a host tensor, so the test hooks the Python-level ways to read a
tensor's values (`tolist`, `item`, `bool`, `int`, `float`, `numpy`, indexing a list by a tensor)
and `torch.tensor(..., device=...)`, and counts them outside `fetch` while a step runs (the
draft model's own loop is the speculator's and is left out). On CUDA, tests/test_cuda.py runs
the same steps under torch's sync debug mode.
"""

import pytest
import torch
from conftest import build_tiny_model, clone_model, make_engine, random_prompts

from engine import EngineConfig, LLMEngine, SamplingParams, device_io
from engine.config import SpeculativeConfig

READS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy")


class StrayReads:
    """Counts the hooked reads made outside `device_io.fetch` while `active`."""

    def __init__(self, monkeypatch):
        self.active = False
        self.reads: list[str] = []
        self._in_fetch = False
        for name in READS:
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._wrap(name, original))
        tensor = torch.tensor
        for name in ("fetch", "lists"):  # lists: fetch, then the host copies' values
            monkeypatch.setattr(device_io, name, self._exempt(getattr(device_io, name)))

        def checked_tensor(*args, **kwargs):
            if kwargs.get("device") is not None:
                self._note("torch.tensor(device=...)")
            return tensor(*args, **kwargs)

        monkeypatch.setattr(torch, "tensor", checked_tensor)

    def _exempt(self, fn):
        def wrapper(*args):
            outer, self._in_fetch = self._in_fetch, True
            try:
                return fn(*args)
            finally:
                self._in_fetch = outer

        return wrapper

    def _note(self, what):
        if self.active and not self._in_fetch:
            self.reads.append(what)

    def _wrap(self, name, original):
        def wrapper(t, *args, **kwargs):
            self._note(name)
            return original(t, *args, **kwargs)

        return wrapper


def run_counting(engine, prompts, params, monkeypatch, proposals=None, whole=False):
    """Run to completion; per step (fetches, stray reads, tokens emitted) of the step without
    its proposal (with it when `whole`). `proposals`, when a list, gets (fetches, stray reads,
    tokens drafted) of every proposal instead."""
    stray = StrayReads(monkeypatch)
    propose = engine.speculator.propose
    if whole:
        propose = None
    apart = [0]  # fetches of proposals (not the step's)

    def propose_apart(running, *args, **kwargs):
        stray.active = proposals is not None
        before, stray.reads = device_io.stats.fetches, []
        try:
            return propose(running, *args, **kwargs)
        finally:
            apart[0] += device_io.stats.fetches - before
            if proposals is not None:
                proposals.append((device_io.stats.fetches - before, list(stray.reads),
                                  sum(s.num_draft_tokens for s in running)))
            stray.active = proposals is None

    if propose is not None:
        monkeypatch.setattr(engine.speculator, "propose", propose_apart)
    for i, p in enumerate(prompts):
        engine.add_request(p, params[i] if isinstance(params, list) else params)
    steps = []
    while engine.has_unfinished():
        before, apart[0] = device_io.stats.fetches, 0
        stray.active, stray.reads = proposals is None, []
        outputs = engine.step()
        stray.active = False
        steps.append((device_io.stats.fetches - before - apart[0], list(stray.reads),
                      sum(len(o.new_token_ids) for o in outputs)))
    return steps


def assert_one_fetch_per_step(steps):
    assert steps
    for fetches, reads, emitted in steps:
        assert reads == [], reads
        assert fetches == (1 if emitted else 0), (fetches, emitted)
    assert sum(1 for f, _, _ in steps if f) >= 5


@pytest.fixture(scope="module")
def target():
    return build_tiny_model("qwen2", seed=0, num_layers=2)


@pytest.fixture(scope="module")
def draft():
    return build_tiny_model("qwen2", seed=5, num_layers=1)


SETTINGS = {
    "greedy": SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
    "sampled with everything": SamplingParams(
        temperature=0.9, top_k=40, top_p=0.9, min_p=0.01, presence_penalty=0.5,
        frequency_penalty=0.3, repetition_penalty=1.2, logit_bias={3: 2.0, 7: -1.0},
        logprobs=3, max_tokens=12, ignore_eos=True),
    "seeded with logprobs": SamplingParams(temperature=0.8, seed=7, logprobs=2, max_tokens=12,
                                           ignore_eos=True),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("method", ["none", "ngram", "draft_model"])
def test_a_step_reads_the_device_once(target, draft, method, setting, monkeypatch):
    verification = "rejection" if setting == "seeded with logprobs" else "coupled"
    eng = make_engine(target, method, draft if method == "draft_model" else None,
                      verification=verification, max_num_batched_tokens=32)
    prompts = random_prompts([5, 40, 9], seed=2)  # 40 tokens: prompt chunks without rows
    params = SETTINGS[setting]
    steps = run_counting(eng, prompts, [params, params, params], monkeypatch)
    assert_one_fetch_per_step(steps)
    if method != "none":
        assert eng.speculator.stats.num_draft_tokens > 0


@pytest.mark.parametrize("setting", ["greedy", "seeded coupled", "seeded rejection"])
@pytest.mark.parametrize("method", ["draft_model", "hybrid"])
def test_drafts_left_on_the_device_make_one_read_per_step(target, method, setting, monkeypatch):
    """defer_reads without the confidence stop (the CUDA default): the k draft forwards chain
    on the device, the drafts stay there, and the next step feeds them to the target and to
    the verifier from there: a speculative step, its proposal included, reads the device
    once. The draft is the target's own weights, so drafts are accepted (the emitted tokens
    come from the device-held drafts). Greedy and coupled seeded output still equals plain;
    batches cut drafts short (a 32-token budget), and hybrid mixes host-held suffix drafts
    in."""
    params = (SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
              if setting == "greedy" else
              SamplingParams(temperature=0.8, seed=11, logprobs=2, max_tokens=16,
                             ignore_eos=True))
    verification = "rejection" if setting == "seeded rejection" else "coupled"
    prompts = random_prompts([5, 30, 9, 20], seed=3)
    prompts.append(prompts[0] * 3)  # repeats itself: suffix drafts for hybrid
    eng = make_engine(target, method, target, k_max=5, max_num_batched_tokens=32,
                      verification=verification)
    eng.speculator.proposer.defer_reads = True
    steps = run_counting(eng, prompts, params, monkeypatch, whole=True)
    assert_one_fetch_per_step(steps)
    st = eng.speculator.stats
    assert st.num_draft_tokens / st.num_drafts > 3.0
    assert st.num_accepted_tokens > 0.8 * st.num_draft_tokens
    if verification == "coupled":
        plain = [o.output_token_ids for o in make_engine(target).generate(prompts, params)]
        assert [o.output_token_ids for o in eng.generate(prompts, params)] == plain
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_the_confidence_stop_reads_deferred_drafts_once_and_still_cuts(target, draft,
                                                                      monkeypatch):
    """With the confidence stop on, the chained drafts are read in one transfer at the end
    of the proposal (the step needs the cut lengths), and the stop still cuts them."""
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = random_prompts([5, 30, 9, 20], seed=3)
    plain = [o.output_token_ids for o in make_engine(target).generate(prompts, greedy)]
    eng = make_engine(target, "draft_model", draft, k_max=5, stop_confidence=0.05,
                      max_num_batched_tokens=32)
    eng.speculator.proposer.defer_reads = True
    proposals = []
    steps = run_counting(eng, prompts, greedy, monkeypatch, proposals)
    assert [s[2] > 0 for s in steps].count(True) >= 5
    drafted = [p for p in proposals if p[2]]
    assert len(drafted) >= 5
    for fetches, reads, _ in proposals:
        assert reads == [] and fetches == (1 if _ else 0), (fetches, reads)
    assert [o.output_token_ids for o in eng.generate(prompts, greedy)] == plain
    st = eng.speculator.stats
    assert st.num_draft_tokens / st.num_drafts < 2.5
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_static_steps_read_the_device_once(target, monkeypatch):
    """The padded static-buffer path (CUDA graphs without capture) on the Triton kernel."""
    eng = LLMEngine(EngineConfig(num_blocks=256, max_num_seqs=8, attention_backend="triton",
                                 cuda_graphs="static", cuda_graph_batch_sizes=[1, 2, 4, 8],
                                 speculative=SpeculativeConfig(method="ngram", k_max=3,
                                                               adaptive=False)),
                    model=clone_model(target))
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)
    steps = run_counting(eng, random_prompts([6, 11, 3], seed=4), params, monkeypatch)
    assert_one_fetch_per_step(steps)
    assert eng.runner.static.num_static > 0


def test_fetch_returns_host_copies_and_counts():
    before = device_io.stats.fetches
    a, b, c = device_io.fetch(torch.arange(3), None, torch.ones(2, 2))
    assert device_io.stats.fetches == before + 1
    assert a.tolist() == [0, 1, 2] and b is None and c.shape == (2, 2)
    assert device_io.lists(torch.tensor([[1, 2]]))[0] == [[1, 2]]
