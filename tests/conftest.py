"""Shared fixtures: a tiny tokenizer trained here, tiny random-init models, the real SmolLM2."""

from __future__ import annotations

import os

import pytest
import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))
if not torch.cuda.is_available():  # Triton kernels run in its interpreter (before any import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

CORPUS = """
The quick brown fox jumps over the lazy dog. A continuous batching engine serves many
requests at once. Each request has a prompt and a number of tokens to generate. The
scheduler counts tokens, not phases: a prefill chunk, one decode token and the verification
of several draft tokens are the same thing with different counts. Blocks of the key value
cache are handed out by a block manager that keeps reference counts and a free list.
def add(a, b):
    return a + b
for i in range(10):
    print(i, add(i, i))
Speculative decoding drafts k tokens with a small model and verifies them in one pass of the
large model. The output distribution stays exactly the target model's distribution.
""" * 4


def build_tokenizer(vocab_size: int = 320):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([CORPUS], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")


def build_tiny_model(arch: str = "qwen2", vocab_size: int = 320, seed: int = 0,
                     num_layers: int = 2, dtype: torch.dtype = torch.float32,
                     max_positions: int = 1024, **config):
    """config: overrides of the model config (num_attention_heads, intermediate_size...)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=max_positions, eos_token_id=1, bos_token_id=None,
                  pad_token_id=None, tie_word_embeddings=False)
    common.update(config)
    cfg_cls, model_cls = {"qwen2": (Qwen2Config, Qwen2ForCausalLM),
                          "llama": (LlamaConfig, LlamaForCausalLM)}[arch]
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**common)).to(dtype).eval()
    # Sharper logits than the default init, so greedy choices are not near-ties.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


def clone_model(model):
    """An independent copy (the engine switches its model to paged attention)."""
    import copy

    return copy.deepcopy(model)


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return build_tokenizer()


@pytest.fixture
def tiny_model():
    return build_tiny_model("qwen2")


def make_engine(target, method="none", draft=None, k_max=4, adaptive=False, stop_confidence=0.0,
                verification="coupled", **kw):
    """An engine on a copy of `target` (and of `draft`) speculating with `method`.

    stop_confidence 0 by default: random tiny drafts are unsure, and the tests want full
    k-token drafts; the confidence stop has tests of its own. `kw`: SpeculativeConfig fields
    (draft_vocab_size, ngram_max_n, ...) and EngineConfig fields (num_blocks, seed, ...);
    `speculative=` replaces the whole speculative config."""
    from dataclasses import fields

    from engine import EngineConfig, LLMEngine
    from engine.config import SpeculativeConfig

    spec_fields = {f.name for f in fields(SpeculativeConfig)}
    spec_kw = {name: kw.pop(name) for name in list(kw) if name in spec_fields}
    cfg = dict(num_blocks=256, max_num_batched_tokens=128, max_num_seqs=16)
    cfg.update(kw)
    cfg.setdefault("speculative", SpeculativeConfig(
        method=method, draft_model="in-memory" if draft is not None else None, k_max=k_max,
        adaptive=adaptive, calibrate=adaptive, draft_stop_confidence=stop_confidence,
        verification=verification, **spec_kw))
    return LLMEngine(EngineConfig(**cfg), model=clone_model(target),
                     draft_model=clone_model(draft) if draft is not None else None)


def staggered(engine, prompts, params, arrive_every=2, max_steps=3000):
    """Run `prompts` adding one request every `arrive_every` steps (`params`: one
    SamplingParams or one per prompt); the finished outputs in arrival order."""
    if not isinstance(params, list):
        params = [params] * len(prompts)
    ids, final, step = [], {}, 0
    while len(final) < len(prompts):
        if len(ids) < len(prompts) and step % arrive_every == 0:
            ids.append(engine.add_request(prompts[len(ids)], params[len(ids)]))
        final.update((out.request_id, out) for out in engine.step() if out.finished)
        step += 1
        assert step < max_steps
    return [final[i] for i in ids]


def random_prompts(lengths, vocab_size=320, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab_size, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="session")
def smollm2_path():
    """The real SmolLM2-135M-Instruct, fetched and converted by its recipe (once per cache)."""
    from engine.models.recipes import fetch

    return str(fetch("smollm2-135m-instruct"))


def third_tokens(engine, prompt, params_list, batch=64):
    """The 3rd generated token of `prompt` under each SamplingParams (in batches)."""
    import numpy as np

    tokens = []
    for lo in range(0, len(params_list), batch):
        chunk = params_list[lo:lo + batch]
        outs = engine.generate([prompt] * len(chunk), chunk)
        tokens += [o.output_token_ids[2] for o in outs]
    return np.array(tokens)


def same_distribution_pvalue(a, b) -> float:
    """Two-sample chi-square over tokens seen at least 10 times in total; the rest pooled."""
    import numpy as np
    from scipy import stats

    values = np.union1d(a, b)
    table = np.array([[np.sum(a == v), np.sum(b == v)] for v in values])
    common = table.sum(1) >= 10
    table = np.vstack([table[common], table[~common].sum(0, keepdims=True)])
    table = table[table.sum(1) > 0]
    return stats.chi2_contingency(table)[1]


def distribution_pair():
    """A 1-layer target with spread-out distributions, a draft that agrees with it partly, and
    a prompt: the setting of the engine-level distribution tests."""
    target = build_tiny_model("qwen2", num_layers=1)
    with torch.no_grad():  # flatter logits: a spread-out distribution to compare
        target.lm_head.weight.mul_(0.25)
    draft = build_tiny_model("qwen2", seed=3, num_layers=1)
    with torch.no_grad():
        draft.lm_head.weight.copy_(target.lm_head.weight * 0.8 + draft.lm_head.weight * 0.05)
    return target, draft, random_prompts([6], seed=2)[0]
