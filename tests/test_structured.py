"""Structured output in the engine: grammar-masked sampling, exact with speculation."""

import json

import jsonschema
import numpy as np
import pytest

from conftest import (build_tiny_model, build_tokenizer, clone_model, distribution_pair,
                      same_distribution_pvalue, third_tokens)
from engine import EngineConfig, InvalidRequestError, LLMEngine, SamplingParams, structured
from engine.config import SpeculativeConfig

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "size": {"enum": ["small", "large"]},
        "point": {"type": "object",
                  "properties": {"x": {"type": "integer", "minimum": -99, "maximum": 99},
                                 "y": {"type": "integer", "minimum": 0, "maximum": 999}},
                  "required": ["x", "y"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
    },
    "required": ["name", "size", "point", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def engine(tok, method="none", model=None, draft=None, tree=0, **kw):
    spec = SpeculativeConfig(method=method, k_max=4, adaptive=False, calibrate=False,
                             draft_model="in-memory" if method == "draft_model" else None,
                             tree_max_nodes=tree)
    model = model if model is not None else build_tiny_model("qwen2", vocab_size=len(tok))
    if method == "draft_model" and draft is None:
        draft = build_tiny_model("qwen2", vocab_size=len(tok), seed=3)
    return LLMEngine(EngineConfig(num_blocks=256, max_num_seqs=16, speculative=spec, **kw),
                     model=clone_model(model), tokenizer=tok,
                     draft_model=clone_model(draft) if draft is not None else None)


def requests(grammar):
    greedy = [SamplingParams(temperature=0, max_tokens=120, grammar=grammar)] * 3
    seeded = [SamplingParams(temperature=t, max_tokens=120, grammar=grammar, seed=s)
              for t, s in ((1.0, 1), (0.7, 2), (1.0, 3))]
    return ["hello world", "def add(a, b):", "Speculative decoding drafts"] * 2, greedy + seeded


@pytest.mark.parametrize("method,tree", [("ngram", 0), ("draft_model", 0),
                                         ("draft_model", 16)])
def test_json_schema_output_is_valid_and_identical_with_speculation(tok, method, tree):
    """tree > 0: the draft model's token trees, cut to the nodes whose paths the grammar
    allows and verified with each node's mask after its path."""
    grammar = structured.json_schema(SCHEMA)
    prompts, params = requests(grammar)
    model = build_tiny_model("qwen2", vocab_size=len(tok))
    plain = engine(tok, model=model).generate(prompts, params)
    spec_engine = engine(tok, method, model=model, tree=tree)
    spec = spec_engine.generate(prompts, params)
    for a, b in zip(plain, spec):
        assert a.finish_reason == "stop", a.text
        jsonschema.validate(json.loads(a.text), SCHEMA)
        assert a.output_token_ids == b.output_token_ids  # greedy and seeded: exact
    assert spec_engine.speculator.stats.num_accepted_tokens > 0  # speculation did run
    assert (spec_engine.speculator.stats.num_tree_verifications > 0) == (tree > 0)
    assert spec_engine.num_grammar_requests == len(prompts)
    assert spec_engine.grammar_mask_seconds > 0


def test_unconstrained_rows_share_the_batch_with_constrained_ones(tok):
    grammar = structured.choice(["yes", "no"])
    e = engine(tok, "ngram")
    outs = e.generate(["hello world"] * 4, [
        SamplingParams(temperature=0, max_tokens=8, grammar=grammar),
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=1.0, max_tokens=8, grammar=grammar, seed=5),
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)])
    assert outs[0].text in ("yes", "no") and outs[2].text in ("yes", "no")
    assert len(outs[1].output_token_ids) == 8
    alone = engine(tok).generate(["hello world"], SamplingParams(temperature=0, max_tokens=8,
                                                                 ignore_eos=True))
    assert outs[1].output_token_ids == outs[3].output_token_ids == alone[0].output_token_ids


def test_ngram_drafts_stop_at_the_first_token_the_grammar_refuses(tok):
    """Every digit in the prompt is followed by more digits and then a space, so prompt lookup
    drafts a space sooner or later; under a grammar of digits only, drafts are cut before it."""
    e = engine(tok, "ngram")
    seq_id = e.add_request("0123456789 0123456789 0123456789", SamplingParams(
        temperature=0, max_tokens=30, grammar=structured.regex(r"[0-9]{1,30}")))
    drafted, final = 0, None
    while e.has_unfinished():
        final = next((o for o in e.step() if o.finished), final)
        seq = e._sequences.get(seq_id)
        pending = e.speculator.pending_drafts(seq) if seq is not None else None
        if pending:
            drafted += len(pending)
            text = tok.decode(seq.output_token_ids + pending)
            assert text.isdigit(), text
    assert drafted > 0 and tok.decode(final.output_token_ids).isdigit()


def test_sampled_tokens_follow_the_masked_target_distribution_with_speculation():
    """The 3rd token under a regex grammar: speculative sampling (draft model, rejection
    verification of unseeded rows) has the same distribution as plain masked sampling, and
    no sample breaks the grammar."""
    target, draft, _ = distribution_pair()
    tok = build_tokenizer()
    grammar = structured.regex(r"[a-z ]{20,30}")
    params = [SamplingParams(temperature=1.0, max_tokens=4, grammar=grammar)] * 1500
    prompt = tok.encode("the output distribution")
    plain = third_tokens(engine(tok, model=target), prompt, params)
    spec_engine = engine(tok, "draft_model", model=target, draft=draft)
    spec = third_tokens(spec_engine, prompt, params)
    assert spec_engine.speculator.stats.num_accepted_tokens > 0
    texts = {tok.decode([t]) for t in np.union1d(plain, spec).tolist()}
    assert all(set(t) <= set("abcdefghijklmnopqrstuvwxyz ") for t in texts), texts
    assert len(set(spec.tolist())) > 5  # a spread-out distribution, not one token
    assert same_distribution_pvalue(plain, spec) > 1e-3


def test_bad_grammars_and_combinations_are_refused_naming_the_field(tok):
    e = engine(tok)
    with pytest.raises(InvalidRequestError) as exc:
        e.add_request("hi", SamplingParams(grammar=structured.json_schema(
            {"type": "object", "properties": {"a": {"type": "strin"}}})))
    assert exc.value.param == "grammar" and "strin" in exc.value.message
    with pytest.raises(InvalidRequestError) as exc:
        e.add_request("hi", SamplingParams(grammar=structured.json_schema(
            {"type": "object", "if": {"required": ["a"]}})))
    assert exc.value.param == "grammar" and "if" in exc.value.message
    with pytest.raises(InvalidRequestError) as exc:
        SamplingParams(grammar=structured.choice(["a"]), ignore_eos=True)
    assert exc.value.param == "ignore_eos"
    no_tokenizer = LLMEngine(EngineConfig(num_blocks=64),
                             model=build_tiny_model("qwen2", vocab_size=len(tok)))
    with pytest.raises(InvalidRequestError) as exc:
        no_tokenizer.add_request([5, 6], SamplingParams(grammar=structured.choice(["a"])))
    assert exc.value.param == "grammar"
    assert not e.has_unfinished()
