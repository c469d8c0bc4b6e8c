"""Medusa heads trained from the target: the sparse tree, training through the same command as
EAGLE, exact serving (chains and trees, alone and in hybrid), bad files and configs."""

import json
import os

import pytest
import torch

from conftest import (build_tiny_model, build_tokenizer, distribution_pair, make_engine,
                      random_prompts, same_distribution_pvalue, third_tokens)
from engine import SamplingParams
from engine.spec_decode import medusa
from engine.spec_decode.eagle import CONFIG_FILE, WEIGHTS_FILE, HeadFileError, save_head
from test_eagle import (LAYERS, grammar_exactness, held_out_prompts, mixed_batch_exactness,
                        preemption_and_prefix_exactness, single_turns, tiny_target,
                        untrained_head)
from training.speculator import TrainOptions, train


def untrained_heads(target, path, num_heads=3, vocab=None):
    heads = medusa.MedusaHeads(medusa.medusa_config(target, "tiny", vocab or list(range(320)),
                                                    num_heads))
    medusa.initialize_from_target(heads, target)
    save_head(heads, str(path))
    return str(path)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Medusa heads trained for 20 passes (about 8 s) on the tiny target's own answers (the
    first 4 held out), with the report."""
    out = tmp_path_factory.mktemp("medusa")
    prompts = out / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"messages": m}) + "\n"
                               for m in single_turns()[:96]))
    opts = TrainOptions(target="tiny", out=str(out), kind="medusa", medusa_heads=3,
                        prompts=str(prompts), minutes=4, epochs=20, max_new_tokens=32,
                        concurrency=16, quantization="none", dtype="float32",
                        draft_vocab_size=0, held_out=4, progress=False, report_k=3,
                        checkpoint_minutes=0.05, batch_tokens=32, lr=1e-3,
                        engine_overrides=dict(num_blocks=512, batch_invariant=False,
                                              cpu_matmul_autotune=False))
    report = train(opts, model=tiny_target(), tokenizer=build_tokenizer())
    return str(out), report


def test_the_sparse_tree_takes_the_likeliest_paths_parents_first():
    accuracy = [[0.6, 0.2, 0.1], [0.5, 0.3, 0.0], [0.4, 0.1, 0.05]]
    tree = medusa.choose_tree(accuracy, max_nodes=6)
    assert tree[:4] == [[0], [0, 0], [1], [0, 1]]  # 0.6, 0.3, 0.2, 0.18
    chances = [medusa.path_chance(accuracy, p) for p in tree]
    assert chances == sorted(chances, reverse=True)
    assert all(p[:-1] in tree[:i] for i, p in enumerate(tree) if len(p) > 1)
    assert all(p[1] != 2 for p in tree if len(p) > 1)  # a zero accuracy is never taken
    # every path of 3 ranks x 3 heads with a nonzero chance, when the budget allows
    assert len(medusa.choose_tree(accuracy, max_nodes=64)) == 3 + 6 + 18


def test_training_medusa_heads_raises_their_held_out_acceptance(trained, tmp_path):
    path, report = trained
    before, after = report["acceptance_length_untrained"], report["acceptance_length"]
    assert after[2] > before[2] + 0.4, report
    config = medusa.config_from(json.loads(open(os.path.join(path, CONFIG_FILE)).read()),
                                "config", "x")
    assert config.num_heads == 3 and config.layers == [LAYERS - 1]
    assert len(config.tree) == medusa.MAX_TREE_NODES and len(config.accuracy) == 3
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    rates = []
    for heads in (untrained_heads(tiny_target(), tmp_path / "untrained"), path):
        engine = make_engine(tiny_target(), "medusa", speculator=heads, k_max=3)
        engine.generate(held_out_prompts(), greedy)
        rates.append(engine.speculator.stats.acceptance_rate)
    assert rates[1] > rates[0] + 0.15, rates


@pytest.mark.parametrize("method,adaptive,tree", [("medusa", False, 0), ("hybrid", True, 0),
                                                 ("medusa", False, 16), ("hybrid", True, 16)])
def test_greedy_and_seeded_with_medusa_equal_plain_in_a_staggered_mixed_batch(
        trained, method, adaptive, tree):
    mixed_batch_exactness("medusa", method, trained[0], 3, adaptive, tree)


def test_medusas_tree_accepts_more_per_step_than_its_chain(trained):
    """The sparse tree (the heads' lower ranks beside their best) against the chain of their
    best tokens: more drafts accepted per verification. (A wrong parent or a node scored from
    the wrong head loses acceptance here while the output stays exact.) On the tiny target
    the heads' lower ranks are rarely right (held-out accuracy of head 1: 0.32 at rank 0, 0.11
    at rank 1), so the margin is small."""
    path, _ = trained
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    accepted = []
    for tree in (0, 16):
        engine = make_engine(tiny_target(), "medusa", speculator=path, k_max=3,
                             adaptive=False, tree_max_nodes=tree)
        engine.generate(held_out_prompts(), greedy)
        st = engine.speculator.stats
        accepted.append(st.num_accepted_tokens / st.by_method["medusa"][0])
    assert accepted[1] > 1.05 * accepted[0], accepted


@pytest.mark.parametrize("tree", [0, 16])
def test_medusa_stays_exact_with_preemption_and_after_prefix_cache_hits(trained, tree):
    preemption_and_prefix_exactness("medusa", trained[0], 3, tree)


def test_medusa_sampled_output_keeps_the_target_distribution(tmp_path):
    """Unseeded sampled requests: the heads' one-hot drafts, rejection-sampled."""
    target, _, prompt = distribution_pair()
    heads = untrained_heads(target, tmp_path / "heads")
    n = 2400

    def params(seed):
        return SamplingParams(temperature=1.0, max_tokens=4, seed=seed, ignore_eos=True)

    plain = third_tokens(make_engine(target), prompt, [params(s) for s in range(n)])
    engine = make_engine(target, "medusa", speculator=heads, k_max=3, adaptive=False,
                         verification="rejection")
    spec = third_tokens(engine, prompt, [params(s) for s in range(n, 2 * n)])
    assert engine.speculator.stats.num_accepted_tokens > 0
    assert same_distribution_pvalue(plain, spec) > 0.001


@pytest.mark.parametrize("tree", [0, 16])
def test_medusa_under_a_grammar_stays_exact(trained, tree):
    engine = grammar_exactness("medusa", trained[0], tree, k_max=3)
    assert (engine.speculator.stats.num_tree_verifications > 0) == (tree > 0)


def _error(path, method="medusa") -> str:
    with pytest.raises(HeadFileError) as info:
        make_engine(tiny_target(), method, speculator=str(path))
    assert "speculative.speculator" in str(info.value)
    return str(info.value)


def test_wrong_kind_corrupt_and_foreign_medusa_heads_are_refused_at_start_up(tmp_path):
    good = untrained_heads(tiny_target(), tmp_path / "good")
    eagle = untrained_head(tiny_target(), tmp_path / "eagle")
    assert "holds eagle heads; method medusa needs medusa" in _error(eagle)
    assert "holds medusa heads; method eagle needs eagle" in _error(good, "eagle")
    corrupt = tmp_path / "corrupt"
    os.makedirs(corrupt)
    (corrupt / CONFIG_FILE).write_text(open(os.path.join(good, CONFIG_FILE)).read())
    (corrupt / WEIGHTS_FILE).write_bytes(b"\x00garbage" * 64)
    assert "corrupt" in _error(corrupt)
    other = untrained_heads(build_tiny_model("qwen2", num_layers=LAYERS, seed=5),
                            tmp_path / "other")
    assert "embeddings differ" in _error(other)
    cfg = json.loads(open(os.path.join(good, CONFIG_FILE)).read())
    for bad, says in ((dict(tree=[[0, 9]]), "tree path"), (dict(num_heads=0), "num_heads"),
                      (dict(num_heads=2), "does not hold")):
        folder = tmp_path / f"bad{len(os.listdir(tmp_path))}"
        os.makedirs(folder)
        (folder / CONFIG_FILE).write_text(json.dumps({**cfg, **bad}))
        (folder / WEIGHTS_FILE).write_bytes(open(os.path.join(good, WEIGHTS_FILE),
                                                 "rb").read())
        assert says in _error(folder)


def test_medusa_config_errors_name_the_option(tmp_path):
    from engine.config import SpeculativeConfig

    with pytest.raises(ValueError, match="speculator.*medusa"):
        SpeculativeConfig(method="medusa")
    assert SpeculativeConfig(method="medusa", speculator="s").uses_head
    with pytest.raises(ValueError, match="--kind"):
        train(TrainOptions(target="tiny", out=str(tmp_path), kind="lookahead"),
              model=tiny_target(), tokenizer=build_tokenizer())


def test_resume_refuses_heads_of_the_other_kind(tmp_path):
    eagle = untrained_head(tiny_target(), tmp_path / "eagle")
    with pytest.raises(HeadFileError, match="--resume.*holds eagle heads"):
        train(TrainOptions(target="tiny", out=str(tmp_path / "out"), kind="medusa",
                           resume=eagle, quantization="none", dtype="float32",
                           progress=False,
                           engine_overrides=dict(num_blocks=64, cpu_matmul_autotune=False)),
              model=tiny_target(), tokenizer=build_tokenizer())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_medusa_on_cuda_with_cuda_graphs_equals_plain(tmp_path):
    target = tiny_target().to(torch.bfloat16).cuda()
    heads = untrained_heads(target, tmp_path / "heads")
    prompts = random_prompts([5, 40, 17], seed=6)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = make_engine(target, dtype="bfloat16").generate(prompts, greedy)
    for tree in (0, 16):
        engine = make_engine(target, "medusa", speculator=heads, k_max=3, dtype="bfloat16",
                             tree_max_nodes=tree)
        assert [o.output_token_ids for o in engine.generate(prompts, greedy)] == \
            [o.output_token_ids for o in plain]


def test_answers_saved_for_an_eagle_head_serve_medusa_with_its_own_layers_features(tmp_path,
                                                                                   monkeypatch):
    """A folder whose saved answers an EAGLE head's run captured (three layers) and a Medusa
    run (the last layer) reads them back: same answers and distributions, the features of
    Medusa's layer, equal to those a Medusa run's own collection records (within 2e-5: one
    teacher-forced forward against the decode steps)."""
    import time

    from engine.spec_decode.eagle import head_config
    from training.speculator import Collector, _engine, encode, read_prompts

    tok = build_tokenizer()
    prompts = [(i, encode(tok, p)) for i, p in enumerate(read_prompts(None)[:4])]
    eagle_layers = head_config(tiny_target(), "tiny", list(range(320))).layers
    medusa_layers = medusa.medusa_config(tiny_target(), "tiny", list(range(320)), 3).layers
    assert len(eagle_layers) == 3 and medusa_layers == [LAYERS - 1]

    def collector(out, layers):
        opts = TrainOptions(target="tiny", out=str(out), max_new_tokens=12, concurrency=4,
                            quantization="none", dtype="float32", progress=False,
                            temperatures=(0.0,),
                            engine_overrides=dict(num_blocks=256, cpu_matmul_autotune=False))
        return Collector(opts, _engine(opts, tiny_target(), tok), layers)

    assert collector(tmp_path / "mixed", eagle_layers).collect(
        prompts, time.monotonic() + 600, "test") == 4
    assert collector(tmp_path / "own", medusa_layers).collect(
        prompts, time.monotonic() + 600, "test") == 4
    eagle = collector(tmp_path / "mixed", eagle_layers).answered()
    read = collector(tmp_path / "mixed", medusa_layers).answered()
    own = collector(tmp_path / "own", medusa_layers).answered()
    assert sorted(read) == sorted(own) == list(range(4))
    for i in range(4):
        assert eagle[i].features.shape[-1] == 3 * read[i].features.shape[-1]
        assert read[i].features.shape == own[i].features.shape
        assert torch.equal(read[i].ids, own[i].ids) and torch.equal(read[i].mask, own[i].mask)
        assert torch.equal(read[i].top_ids, eagle[i].top_ids)
        scale = own[i].features.float().abs().max()
        assert (read[i].features.float() - own[i].features.float()).abs().max() <= 2e-5 * scale
    # the shards were saved with Medusa's features, and name their layers: a second read
    # computes nothing and gets the same
    shards = collector(tmp_path / "mixed", medusa_layers).shards()
    assert shards and all(shard["layers"] == medusa_layers for _, shard in shards)
    import training.speculator

    def forward(*args):
        raise AssertionError("re-read features of a shard that has them")

    monkeypatch.setattr(training.speculator, "refeature", forward)
    second = collector(tmp_path / "mixed", medusa_layers).answered()
    assert all(torch.equal(second[i].features, read[i].features) for i in range(4))
