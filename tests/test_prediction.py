"""Predicted Outputs: the matcher on handmade token streams (following, re-aligning after an
insertion, a deletion, a replacement), and in the engine: the output never depends on the
prediction (greedy and seeded, alone and batched), a correct prediction is accepted nearly
whole."""

import dataclasses

import pytest
from conftest import build_tiny_model, make_engine, random_prompts, staggered

from engine import SamplingParams
from engine.errors import InvalidRequestError
from engine.spec_decode.prediction import ANCHOR, PredictionMatcher

PRED = list(range(100, 180))


def test_the_answers_start_gets_the_predictions_start():
    m = PredictionMatcher(PRED)
    draft = m.propose([], 8)
    assert draft.token_ids == PRED[:8]
    assert all(a > b for a, b in zip(draft.confidence, draft.confidence[1:]))
    assert PredictionMatcher(PRED).propose([5], 8).token_ids == []  # departs at once


def test_following_after_accepted_drafts_and_a_matching_bonus_token():
    m = PredictionMatcher(PRED)
    m.propose([], 8)
    m.record(8, 8)
    assert m.propose(PRED[:9], 4).token_ids == PRED[9:13]  # the bonus token followed too
    m.record(4, 2)
    assert m.propose(PRED[:11] + [7], 4).token_ids == []  # the correction departs from it


@pytest.mark.parametrize("edit", ["insertion", "deletion", "replacement"])
def test_realigns_after_an_edit(edit):
    m = PredictionMatcher(PRED)
    m.propose(PRED[:20], 4)
    answer = {"insertion": PRED[:20] + [1, 2, 3],
              "deletion": PRED[:20],
              "replacement": PRED[:20] + [1, 2, 3]}[edit]
    resume = {"insertion": 20, "deletion": 35, "replacement": 23}[edit]
    if edit != "deletion":
        assert m.propose(answer, 4).token_ids == []
    answer = answer + PRED[resume:resume + ANCHOR]
    assert m.propose(answer, 4).token_ids == PRED[resume + ANCHOR:resume + ANCHOR + 4]


def test_later_occurrence_preferred_and_confidence_tracks_acceptance():
    pred = [1, 2, 3, 4, 50, 51, 1, 2, 3, 4, 60, 61]
    m = PredictionMatcher(pred)
    m.cursor = 6
    assert m.propose([9, 1, 2, 3, 4], 2).token_ids == [60, 61]
    fresh = m.propose([9, 1, 2, 3, 4], 1).confidence[0]
    for _ in range(5):
        m.record(4, 0)
    assert m.propose([9, 1, 2, 3, 4], 1).confidence[0] < fresh / 2


def test_a_prediction_must_be_token_ids():
    with pytest.raises(InvalidRequestError) as caught:
        SamplingParams(prediction=["a"])
    assert caught.value.param == "prediction"


# -- the engine ------------------------------------------------------------------------------
def edited(tokens, seed):
    """The output with a replacement, an insertion and a deletion, as an edit's prediction."""
    t = list(tokens)
    t[5:8] = [seed + 3, seed + 4, seed + 5]
    t[14:14] = [seed + 7] * 3
    del t[22:26]
    return t


@pytest.mark.parametrize("method, adaptive, served", [
    ("suffix", False, False), ("draft_model", True, False), ("suffix", False, True)])
def test_output_never_depends_on_the_prediction(method, adaptive, served):
    """served: as the default config runs on the CPU (bf16, an int4 target), batched and each
    request alone."""
    import torch

    kw = dict(dtype="bfloat16", quantization="int4") if served else {}
    target = build_tiny_model("qwen2", dtype=torch.bfloat16 if served else torch.float32)
    draft = build_tiny_model("qwen2", seed=1) if method == "draft_model" else None
    prompts = random_prompts([12, 30, 7], seed=4)
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    seeded = [SamplingParams(temperature=0.8, seed=50 + i, max_tokens=40, ignore_eos=True)
              for i in range(len(prompts))]
    for params in ([greedy] * len(prompts), seeded):
        plain = [o.output_token_ids
                 for o in staggered(make_engine(target, **kw), prompts, params)]
        predictions = {"correct": plain, "edited": [edited(o, 200) for o in plain],
                       "empty": [[] for _ in plain],
                       "wrong": random_prompts([40] * len(plain), seed=5)}
        for name, predicted in predictions.items():
            if params is seeded and name in ("empty", "wrong"):
                continue
            # a fresh engine each: no suffix match from an earlier run's identical output
            engine = make_engine(target, method, draft, k_max=4, adaptive=adaptive,
                                 max_num_seqs=8, suffix_max_spec_tokens=8, **kw)
            with_prediction = [dataclasses.replace(p, prediction=list(t))
                               for p, t in zip(params, predicted)]
            outs = staggered(engine, prompts, with_prediction)
            assert [o.output_token_ids for o in outs] == plain, name
            if served and name in ("correct", "edited"):
                alone = [engine.generate([p], sp)[0].output_token_ids
                         for p, sp in zip(prompts, with_prediction)]
                assert alone == plain, name
            accepted = sum(o.spec_methods.get("prediction", (0, 0))[1] for o in outs)
            if not adaptive and name == "correct":
                assert accepted >= 0.8 * sum(map(len, plain))
            if not adaptive and name == "edited" and params[0].greedy:
                # (what the matcher alone reaches on these outputs: ~half, tiny random
                # models repeat themselves, which makes re-aligning ambiguous)
                assert accepted >= 0.35 * sum(map(len, plain))
            if name == "empty":
                assert accepted == 0
            bm = engine.block_manager
            assert bm.num_free_blocks == bm.num_blocks


# -- the server, through the official client -------------------------------------------------
@pytest.fixture(scope="module")
def client(tmp_path_factory):
    import openai
    from server_utils import ServerProcess, save_tiny_model

    folder = tmp_path_factory.mktemp("prediction")
    model = save_tiny_model(folder / "tiny")
    cfg = folder / "suffix.yaml"  # suffix speculation, no cross-request cache: drafts come
    cfg.write_text(f"engine:\n  model: {model}\n  device: cpu\n  num_threads: 1\n"  # from the
                   f"  speculative:\n    method: suffix\n    adaptive: false\n"  # prediction
                   f"    suffix_cross_request: false\n")
    srv = ServerProcess(["--config", str(cfg), "--served-model-name", "tiny"]).wait_ready()
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    assert srv.terminate() == 0, srv.log()


ASK = [{"role": "user", "content": "Rename the variable in: def f(x): return x + 1"}]


def answer(client, prediction=None, stream=False, **extra):
    kwargs = dict(model="tiny", messages=ASK, temperature=0, max_tokens=48,
                  extra_body={"ignore_eos": True, **extra})
    if prediction is not None:
        kwargs["prediction"] = {"type": "content", "content": prediction}
    if not stream:
        out = client.chat.completions.create(**kwargs)
        return out.choices[0].message.content, out.usage
    text, usage = "", None
    for chunk in client.chat.completions.create(stream=True,
                                                stream_options={"include_usage": True},
                                                **kwargs):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        usage = chunk.usage or usage
    return text, usage


def prediction_counts(usage):
    details = usage.completion_tokens_details
    methods = ((usage.model_extra or {}).get("speculative") or {}).get("methods", {})
    drafted = methods.get("prediction", {"accepted_tokens": 0})["accepted_tokens"]
    return details.accepted_prediction_tokens, details.rejected_prediction_tokens, drafted


def test_predicted_outputs_are_exact_and_counted(client):
    """Any prediction leaves the answer as it is, streamed or not. (A tiny random model's
    answer is a random token string whose text tokenizes otherwise: how much of a correct
    prediction is accepted is checked on a real model, test_real_models.py.)"""
    plain, usage = answer(client)
    assert usage.completion_tokens_details is None or \
        not usage.completion_tokens_details.accepted_prediction_tokens
    edited = plain[: len(plain) // 3] + " and so on " + plain[len(plain) // 2:]
    wrong = "lorem ipsum dolor sit amet " * 5
    for stream in (False, True):
        for name, prediction in (("correct", plain), ("edited", edited), ("empty", ""),
                                 ("wrong", wrong), ("list", [{"type": "text", "text": plain}])):
            text, usage = answer(client, prediction, stream)
            assert text == plain, (name, stream)
            accepted, rejected, drafted = prediction_counts(usage)
            assert max(drafted, accepted) <= usage.completion_tokens, name
            if name == "empty":
                assert accepted == rejected == drafted == 0
            else:
                assert rejected >= 0 and accepted + rejected > 0
    # opted out of speculation: nothing drafted; the counts are the answer's own
    text, usage = answer(client, edited, speculative=False)
    assert text == plain and prediction_counts(usage)[2] == 0
    _, usage_drafted = answer(client, edited)
    assert prediction_counts(usage)[:2] == prediction_counts(usage_drafted)[:2]
    # the completions endpoint takes it too (an extra there)
    out = client.completions.create(model="tiny", prompt="The quick", max_tokens=12,
                                    temperature=0, extra_body={"prediction": {
                                        "type": "content", "content": " brown fox"}})
    same = client.completions.create(model="tiny", prompt="The quick", max_tokens=12,
                                     temperature=0)
    assert out.choices[0].text == same.choices[0].text
    assert out.usage.completion_tokens_details.rejected_prediction_tokens >= 0


@pytest.mark.parametrize("prediction, param", [
    ({"type": "file", "content": "x"}, "prediction.type"),
    ({"type": "content", "content": 5}, "prediction.content"),
    ({"type": "content", "content": "fox " * 3000}, "prediction"),
], ids=["type", "content", "too long"])
def test_a_bad_prediction_is_a_400_naming_it(client, prediction, param):
    import openai

    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", messages=ASK, max_tokens=4,
                                       prediction=prediction)
    assert caught.value.body["param"] == param, caught.value.body
