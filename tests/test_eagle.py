"""Draft heads trained from the target (EAGLE): capture, training, exact serving, bad files."""

import json
import os
import time

import pytest
import torch

from conftest import (build_tiny_model, build_tokenizer, distribution_pair, make_engine,
                      random_prompts, same_distribution_pvalue, staggered, third_tokens)
from engine import SamplingParams
from engine.batch import RunItem
from engine.model_runner import ModelRunner
from engine.spec_decode.eagle import (CONFIG_FILE, WEIGHTS_FILE, EagleHead, HeadFileError,
                                      head_config, initialize_from_target, save_head)
from training.speculator import TrainOptions, encode, read_prompts, train

LAYERS = 4  # the tiny target's layers (its head reads layers 1, 1 and 0)


def tiny_target():
    return build_tiny_model("qwen2", num_layers=LAYERS)


def untrained_head(target, path, vocab=None):
    head = EagleHead(head_config(target, "tiny", vocab or list(range(320))))
    initialize_from_target(head, target)
    save_head(head, str(path))
    return str(path)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A head trained for a few seconds on the tiny target's own answers to the default
    prompts (the first 4 held out), with its report."""
    out = tmp_path_factory.mktemp("head")
    prompts = out / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"messages": m}) + "\n"
                               for m in single_turns()[:96]))
    # a fixed amount of work (3 passes over 92 answers), the budget only a bound
    opts = TrainOptions(target="tiny", out=str(out), prompts=str(prompts), minutes=4,
                        epochs=4,
                        max_new_tokens=32, concurrency=16, quantization="none",
                        dtype="float32", draft_vocab_size=0, held_out=4, progress=False,
                        report_k=4, checkpoint_minutes=0.05, batch_tokens=32,
                        engine_overrides=dict(num_blocks=512, batch_invariant=False,
                                              cpu_matmul_autotune=False))
    report = train(opts, model=tiny_target(), tokenizer=build_tokenizer())
    return str(out), report


def single_turns():
    """The default set's one-turn conversations (the tiny tokenizer has no chat template:
    follow-ups and tool turns would be their contents joined)."""
    return [c for c in read_prompts(None) if isinstance(c, list) and len(c) == 1]


def held_out_prompts():
    tok = build_tokenizer()
    return [encode(tok, p) for p in single_turns()[:4]]


def test_runner_returns_the_captured_layers_of_every_new_token():
    target = tiny_target()
    reference = target(torch.tensor([list(range(5, 25))]), output_hidden_states=True)
    runner = ModelRunner(build_tiny_model("qwen2", num_layers=LAYERS), num_blocks=8,
                         block_size=16)
    runner.enable_capture([2, 0])
    # two chunks: the second attends to the first's K/V through the cache
    first = runner.execute([RunItem(list(range(5, 17)), 0, [0, 1], 1)])
    second = runner.execute([RunItem(list(range(17, 25)), 12, [0, 1], 1)])
    hidden = torch.cat([first.hidden, second.hidden])
    # hidden_states[i + 1] is layer i's output
    want = torch.cat([reference.hidden_states[3][0], reference.hidden_states[1][0]], dim=-1)
    assert hidden.shape == (20, 2 * 64)
    torch.testing.assert_close(hidden, want, rtol=1e-4, atol=1e-4)


def test_training_raises_acceptance_well_above_an_untrained_head(trained, tmp_path):
    path, report = trained
    before, after = report["acceptance_length_untrained"], report["acceptance_length"]
    assert after[3] > before[3] + 0.5, report  # the training's own held-out report
    assert report["curve"] and report["train_steps"] > 0
    # measured in the engine on the held-out prompts
    prompts = held_out_prompts()
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    rates = []
    for head in (untrained_head(tiny_target(), tmp_path / "untrained"), path):
        engine = make_engine(tiny_target(), "eagle", speculator=head, k_max=4)
        engine.generate(prompts, greedy)
        rates.append(engine.speculator.stats.acceptance_rate)
    assert rates[1] > rates[0] + 0.15, rates


def mixed_batch_exactness(kind: str, method: str, path: str, k_max: int, adaptive: bool,
                          tree: int) -> None:
    """Greedy and seeded requests in a staggered batch (repeated prompts: suffix matches in
    hybrid) with `kind`'s heads at `path`: the tokens of plain decoding, `kind`'s drafts
    accepted, (tree > 0) its trees verified, nothing leaked."""
    target = tiny_target()
    base = random_prompts([12, 7, 20], seed=9)
    prompts = held_out_prompts() + [b * 3 for b in base] + random_prompts([3, 40, 1], seed=4)
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=7, max_tokens=30, ignore_eos=True)] * 5
    plain = staggered(make_engine(target), prompts, params)
    engine = make_engine(target, method, speculator=path, k_max=k_max, adaptive=adaptive,
                         tree_max_nodes=tree)
    spec = staggered(engine, prompts, params)
    assert [o.output_token_ids for o in spec] == [o.output_token_ids for o in plain]
    st = engine.speculator.stats
    assert st.by_method[kind][2] > 0  # the heads' drafts were accepted
    # (a tree of one-hot drafts: no q)
    assert (st.tree_verifications_by_method.get(kind, 0) > 0) == (tree > 0)
    if method == "hybrid":
        assert st.by_method.get("suffix", [0])[0] > 0  # the repeated prompts matched
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert engine.speculator.num_states == 0


@pytest.mark.parametrize("method,adaptive,tree", [("eagle", False, 0), ("hybrid", True, 0),
                                                 ("eagle", False, 16), ("hybrid", True, 16)])
def test_greedy_with_eagle_equals_plain_in_a_staggered_mixed_batch(trained, method, adaptive,
                                                                   tree):
    """Greedy and seeded requests, chains or (tree > 0) EAGLE-2 token trees beside chains."""
    mixed_batch_exactness("eagle", method, trained[0], 4, adaptive, tree)


def test_a_heads_token_tree_accepts_more_per_step_than_its_chain(trained):
    """EAGLE-2's dynamic tree (the head's most probable branches) against the head's chain on
    the held-out prompts: more tokens per verification. (A node's row reading the wrong keys,
    or a wrong parent, loses acceptance here while the output stays exact.)"""
    path, _ = trained
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    lengths = []
    for tree in (0, 16):
        engine = make_engine(tiny_target(), "eagle", speculator=path, k_max=4,
                             tree_max_nodes=tree)
        engine.generate(held_out_prompts(), greedy)
        lengths.append(engine.speculator.stats.mean_accepted_length)
        assert (engine.speculator.stats.num_tree_verifications > 0) == (tree > 0)
    assert lengths[1] > 1.1 * lengths[0], lengths


def preemption_and_prefix_exactness(method: str, path: str, k_max: int, tree: int):
    """Greedy requests sharing a prefix on a pool small enough to preempt, the first alone
    (it caches the prefix): the tokens of plain decoding; returns the speculating engine."""
    target = tiny_target()
    shared = random_prompts([40], seed=3)[0]
    prompts = [shared + p for p in random_prompts([5, 9, 2, 14, 7, 3], seed=5)]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = make_engine(target).generate(prompts, greedy)
    engine = make_engine(target, method, speculator=path, k_max=k_max, num_blocks=24,
                         block_size=8, tree_max_nodes=tree)
    first = engine.generate(prompts[:1], greedy)  # caches the shared prefix
    rest = engine.generate(prompts[1:], greedy)
    assert [o.output_token_ids for o in first + rest] == [o.output_token_ids for o in plain]
    assert engine.scheduler.stats.num_preemptions > 0
    assert engine.block_manager.prefix_stats.hits > 0
    assert engine.speculator.stats.num_accepted_tokens > 0
    return engine


@pytest.mark.parametrize("tree", [0, 16])
def test_eagle_stays_exact_with_preemption_and_after_prefix_cache_hits(trained, tree):
    engine = preemption_and_prefix_exactness("eagle", trained[0], 4, tree)
    # a hit leaves one head row per hit without the feature before it, never the prefix
    assert 0 < engine.speculator.proposer.rows_without_features <= 2 * 6


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_sequence_left_plain_runs_no_head_row_and_keeps_few_features(trained, monkeypatch,
                                                                       dtype):
    """While the guard runs plain steps the head runs nothing and each sequence keeps only its
    newest WAIT_ROWS features; when drafting resumes the head catches up (the dropped rows
    with zero features) and the output, greedy and seeded, is plain decoding's."""
    from engine.spec_decode import eagle_proposer

    monkeypatch.setattr(eagle_proposer, "WAIT_ROWS", 8)
    prompts = held_out_prompts()
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=11, max_tokens=40, ignore_eos=True)] * 2
    target = tiny_target().to(getattr(torch, dtype))
    plain = make_engine(target, dtype=dtype).generate(prompts, params)
    engine = make_engine(target, "eagle", speculator=trained[0], k_max=4, dtype=dtype)
    speculator, proposer = engine.speculator, engine.speculator.proposer
    plain_steps, forwards, waiting = [20], [], []
    mode = speculator.guard.mode

    def guarded(num_running):
        plain_steps[0] -= 1
        return "plain" if plain_steps[0] >= 0 else mode(num_running)

    head_forward = proposer._forward

    def counted(rows, keep_last):
        forwards.append(plain_steps[0])
        return head_forward(rows, keep_last)

    monkeypatch.setattr(speculator.guard, "mode", guarded)
    monkeypatch.setattr(proposer, "_forward", counted)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
        decoding = [s for s in engine.scheduler.running if s.num_output_tokens > 1]
        if plain_steps[0] >= 0 and decoding:
            waiting.append(max(proposer.waiting_rows(s) for s in decoding))
    assert [outputs[i].output_token_ids for i in ids] == [o.output_token_ids for o in plain]
    assert forwards and all(f < 0 for f in forwards)  # none in a plain step
    assert max(waiting) == 8
    assert proposer.rows_without_features >= len(prompts) * 10
    assert speculator.stats.num_accepted_tokens > 0
    assert engine.speculator.num_states == 0


def test_a_prompt_longer_than_the_wait_keeps_every_feature_for_its_first_proposal(
        trained, monkeypatch):
    """The cap on waiting features is for sequences the guard leaves plain while decoding: a
    prompt's rows all get their features at its first proposal, however long it is."""
    from engine.spec_decode import eagle_proposer

    monkeypatch.setattr(eagle_proposer, "WAIT_ROWS", 8)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    engine = make_engine(tiny_target(), "eagle", speculator=trained[0], k_max=4,
                         max_num_batched_tokens=16)  # prompts in chunks of 16
    prompts = held_out_prompts()
    assert min(len(p) for p in prompts) > 16
    plain = make_engine(tiny_target()).generate(prompts, greedy)
    out = engine.generate(prompts, greedy)
    assert [o.output_token_ids for o in out] == [o.output_token_ids for o in plain]
    assert engine.speculator.proposer.rows_without_features == 0


def test_a_prompt_keeps_at_most_prompt_wait_rows_features(trained, monkeypatch):
    """A long prompt's waiting features are bounded too (PROMPT_WAIT_ROWS): its oldest rows
    are computed with zero features at its first proposal, and the output is plain's."""
    from engine.spec_decode import eagle_proposer

    monkeypatch.setattr(eagle_proposer, "PROMPT_WAIT_ROWS", 16)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    engine = make_engine(tiny_target(), "eagle", speculator=trained[0], k_max=4,
                         max_num_batched_tokens=8)  # prompts in chunks of 8
    proposer = engine.speculator.proposer
    kept, keep = [], proposer.keep_features

    def keep_and_count(entries, hidden):
        keep(entries, hidden)
        kept.extend(proposer.waiting_rows(seq) for seq, _, _ in entries)

    monkeypatch.setattr(proposer, "keep_features", keep_and_count)
    prompts = held_out_prompts()
    assert min(len(p) for p in prompts) > 16
    plain = make_engine(tiny_target()).generate(prompts, greedy)
    out = engine.generate(prompts, greedy)
    assert [o.output_token_ids for o in out] == [o.output_token_ids for o in plain]
    assert max(kept) == 16
    assert proposer.rows_without_features > 0  # the prompts' oldest rows
    assert engine.speculator.stats.num_accepted_tokens > 0


@pytest.mark.parametrize("seeded,sampled_trees", [(True, True), (False, True), (False, False)])
def test_eagle_sampled_output_keeps_the_target_distribution(tmp_path, seeded, sampled_trees):
    """Rejection sampling of the head's drafts, trees on: a seeded request (verification
    "rejection") drafts chains sampled from q; an unseeded one the head's sampled trees
    (children drawn from q without replacement, verified with q) where `sampled_trees` is on,
    chains where it is off."""
    target, _, prompt = distribution_pair()
    head = untrained_head(target, tmp_path / "head")
    n = 2400

    def params(seed):
        return SamplingParams(temperature=1.0, max_tokens=4, seed=seed if seeded else None,
                              ignore_eos=True)

    plain = third_tokens(make_engine(target), prompt, [params(s) for s in range(n)])
    engine = make_engine(target, "eagle", speculator=head, k_max=3, verification="rejection",
                         tree_max_nodes=8, sampled_trees=sampled_trees)
    spec = third_tokens(engine, prompt, [params(s) for s in range(n, 2 * n)])
    assert 0.05 < engine.speculator.stats.acceptance_rate < 0.99
    trees = engine.speculator.stats.num_tree_verifications
    assert (trees > 0) == (sampled_trees and not seeded)
    assert same_distribution_pvalue(plain, spec) > 0.001


def test_eagle_with_a_vocabulary_subset_and_penalties_stays_exact(tmp_path):
    target = tiny_target()
    head = untrained_head(target, tmp_path / "head", vocab=list(range(0, 320, 2)))
    prompts = random_prompts([6, 30], seed=12)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                            repetition_penalty=1.2)
    plain = make_engine(target).generate(prompts, params)
    engine = make_engine(target, "eagle", speculator=head, k_max=3)
    spec = engine.generate(prompts, params)
    assert [o.output_token_ids for o in spec] == [o.output_token_ids for o in plain]


def grammar_exactness(method: str, path: str, tree: int, k_max: int = 4):
    """Greedy and seeded requests under a regex grammar, with `method`'s heads at `path` and
    without speculation: the same tokens; returns the speculating engine."""
    from engine import EngineConfig, LLMEngine, structured
    from engine.config import SpeculativeConfig

    tok = build_tokenizer()
    grammar = structured.regex(r"[a-z ]{1,40}[0-9]{2,6}")
    params = [SamplingParams(temperature=0, max_tokens=40, grammar=grammar),
              SamplingParams(temperature=1.0, seed=3, max_tokens=40, grammar=grammar)] * 2
    prompts = ["hello world", "def add(a, b):", "Speculative decoding", "The scheduler"]

    def run(spec):
        engine = LLMEngine(EngineConfig(num_blocks=256, max_num_seqs=8, speculative=spec),
                           model=tiny_target(), tokenizer=tok)
        return engine, engine.generate(prompts, params)

    _, plain = run(SpeculativeConfig())
    engine, spec = run(SpeculativeConfig(method=method, speculator=path, k_max=k_max,
                                         adaptive=False, calibrate=False,
                                         tree_max_nodes=tree))
    assert [o.output_token_ids for o in spec] == [o.output_token_ids for o in plain]
    assert engine.speculator.stats.num_draft_tokens > 0
    return engine


@pytest.mark.parametrize("tree", [0, 16])
def test_eagle_under_a_grammar_stays_exact(trained, tree):
    """Chains cut at the first token the grammar refuses; trees (tree > 0) cut to the nodes
    whose paths it allows, verified with each node's mask after its path."""
    engine = grammar_exactness("eagle", trained[0], tree)
    assert (engine.speculator.stats.num_tree_verifications > 0) == (tree > 0)


def _engine_error(path) -> str:
    with pytest.raises(HeadFileError) as info:
        make_engine(tiny_target(), "eagle", speculator=str(path))
    assert "speculative.speculator" in str(info.value)
    return str(info.value)


def test_missing_corrupt_and_foreign_heads_are_refused_at_start_up(tmp_path):
    assert "not a folder" in _engine_error(tmp_path / "nowhere")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert CONFIG_FILE in _engine_error(empty)
    good = untrained_head(tiny_target(), tmp_path / "good")
    corrupt = tmp_path / "corrupt"
    os.makedirs(corrupt)
    (corrupt / CONFIG_FILE).write_text(open(os.path.join(good, CONFIG_FILE)).read())
    (corrupt / WEIGHTS_FILE).write_bytes(b"\x00garbage" * 64)
    assert "corrupt" in _engine_error(corrupt)
    (tmp_path / "badjson").mkdir()
    (tmp_path / "badjson" / CONFIG_FILE).write_text("{not json")
    assert "not a speculator config" in _engine_error(tmp_path / "badjson")
    # the same shape, other weights: another model
    other = untrained_head(build_tiny_model("qwen2", num_layers=LAYERS, seed=5),
                           tmp_path / "other")
    assert "embeddings differ" in _engine_error(other)
    # another shape
    deeper = untrained_head(build_tiny_model("qwen2", num_layers=2), tmp_path / "deeper")
    assert "another shape" in _engine_error(deeper)
    # weights of another config's head
    cfg = json.loads(open(os.path.join(good, CONFIG_FILE)).read())
    cfg["vocab"] = cfg["vocab"][:64]
    mismatch = tmp_path / "mismatch"
    os.makedirs(mismatch)
    (mismatch / CONFIG_FILE).write_text(json.dumps(cfg))
    (mismatch / WEIGHTS_FILE).write_bytes(open(os.path.join(good, WEIGHTS_FILE), "rb").read())
    assert "does not hold" in _engine_error(mismatch)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_eagle_on_cuda_with_cuda_graphs_equals_plain(tmp_path):
    target = tiny_target().to(torch.bfloat16).cuda()
    head = untrained_head(target, tmp_path / "head")
    prompts = random_prompts([5, 40, 17], seed=6)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = make_engine(target, dtype="bfloat16").generate(prompts, greedy)
    engine = make_engine(target, "eagle", speculator=head, k_max=3, dtype="bfloat16")
    spec = engine.generate(prompts, greedy)
    assert [o.output_token_ids for o in spec] == [o.output_token_ids for o in plain]
    assert engine.runner.static is not None and engine.runner.static.num_replays > 0
    assert engine.speculator.stats.num_draft_tokens > 0


def test_eagle_config_errors_name_the_option():
    from engine.config import SpeculativeConfig

    with pytest.raises(ValueError, match="speculator"):
        SpeculativeConfig(method="eagle")
    with pytest.raises(ValueError, match="speculator"):
        SpeculativeConfig(method="hybrid", draft_model="d", speculator="s")
    assert SpeculativeConfig(method="hybrid", speculator="s").uses_head
    assert not SpeculativeConfig(method="hybrid", speculator="s").uses_draft_model


def test_default_training_prompts_are_disjoint_from_the_benchmark_prompts():
    root = os.path.join(os.path.dirname(__file__), "..", "bench", "prompts")
    bench = set()
    for name in ("chat.jsonl", "code_edit.jsonl", "structured.jsonl"):
        for line in open(os.path.join(root, name)):
            if line.strip():
                row = json.loads(line)
                bench.update(m["content"][:60] for m in row.get("messages", []))
                bench.update([row["prompt"][:60]] if "prompt" in row else [])
    convs = read_prompts(None)
    ours = [m["content"][:60] for conv in convs
            for m in (conv["messages"] if isinstance(conv, dict) else conv)]
    assert len(convs) >= 400 and not bench & set(ours)
    # follow-up turns and tool turns (with their tools) are among them
    assert sum(isinstance(c, list) and len(c) == 3 for c in convs) >= 50
    tool_turns = [c for c in convs if isinstance(c, dict)]
    assert len(tool_turns) >= 20 and all(c["tools"] for c in tool_turns)
    assert any(m["role"] == "tool" for c in tool_turns for m in c["messages"])


def test_prompts_file_errors_name_the_line(tmp_path):
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n{"x": 1}\n')
    with pytest.raises(ValueError, match="p.jsonl:2"):
        read_prompts(str(bad))


def test_the_train_command_reports_a_bad_target_clearly(tmp_path, capsys):
    from server.cli import main

    assert main(["speculator", "train", "--target", str(tmp_path / "no-such-model"),
                 "--out", str(tmp_path / "head"), "--no-progress"]) == 2
    assert "error:" in capsys.readouterr().err


def test_training_on_raw_text_adds_teacher_forced_windows(tmp_path):
    text = tmp_path / "src"
    text.mkdir()
    (text / "a.py").write_text("def add(a, b):\n    return a + b\n" * 40)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"messages": m}) + "\n"
                               for m in read_prompts(None)[:12]))
    opts = TrainOptions(target="tiny", out=str(tmp_path / "head"), prompts=str(prompts),
                        text=str(text), minutes=2, epochs=1, max_new_tokens=8,
                        max_seq_len=128, quantization="none", dtype="float32",
                        draft_vocab_size=0, held_out=2, progress=False, report_k=2,
                        batch_tokens=64,
                        engine_overrides=dict(num_blocks=128, batch_invariant=False,
                                              cpu_matmul_autotune=False))
    report = train(opts, model=tiny_target(), tokenizer=build_tokenizer())
    assert report["text_windows"] > 0 and report["train_steps"] > 0
    assert os.path.exists(tmp_path / "head" / WEIGHTS_FILE)


def test_answers_are_collected_continuously_and_a_rerun_answers_only_the_rest(tmp_path):
    """The collector keeps `concurrency` requests in flight (a finished answer's place is
    taken at once); its shards name their prompts, so a rerun answers only those missing,
    and an answer is the same whether collected in one run or two (greedy ones)."""
    from training.speculator import Collector, _engine

    tok = build_tokenizer()
    prompts = [(i, encode(tok, p)) for i, p in enumerate(read_prompts(None)[:10])]
    layers = head_config(tiny_target(), "tiny", list(range(320))).layers

    def collector(out):
        opts = TrainOptions(target="tiny", out=str(out), max_new_tokens=12, concurrency=4,
                            quantization="none", dtype="float32", progress=False,
                            engine_overrides=dict(num_blocks=256,  # batch-invariant (serving's)
                                                  cpu_matmul_autotune=False))
        return Collector(opts, _engine(opts, tiny_target(), tok), layers)

    one = collector(tmp_path / "one")
    running = []
    step = one.engine.step
    one.engine.step = lambda: (running.append(len(one.engine.scheduler.running)), step())[1]
    assert one.collect(prompts, time.monotonic() + 600, "test") == 10
    assert max(running) == 4 and running.count(4) > len(running) // 2  # kept full
    first = collector(tmp_path / "two")
    assert first.collect(prompts[:6], time.monotonic() + 600, "test") == 6
    again = collector(tmp_path / "two")
    have = again.answered()
    assert sorted(have) == list(range(6))
    assert again.collect([p for p in prompts if p[0] not in have],
                         time.monotonic() + 600, "test") == 4
    both, whole = again.answered(), one.answered()
    assert sorted(both) == sorted(whole) == list(range(10))
    for i in range(0, 10, 2):  # the greedy ones (odd prompts are sampled at T 0.7)
        assert torch.equal(both[i].ids, whole[i].ids)
        assert torch.equal(both[i].features, whole[i].features)
