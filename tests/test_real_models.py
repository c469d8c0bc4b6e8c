"""The real SmolLM2-135M-Instruct (fetched by its recipe): kept few, they cost seconds each."""

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.models.loader import load_model

pytestmark = pytest.mark.real_model

PROMPTS = [
    "def fibonacci(n):",
    "The capital of France is",
    "Write a haiku about autumn leaves falling on a quiet river.",
    "Q: What is 12 times 12?\nA:",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old "
    "clockmaker who had never once left the valley. Every morning he",
    "import numpy as np\n\ndef normalize(x):\n    \"\"\"Scale x to zero mean and unit variance.\"\"\"",
    "List three uses of copper:",
    "Translate to French: good morning",
]


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    ref, tok = load_model(smollm2_path, dtype="float32", device="cpu")
    mine, _ = load_model(smollm2_path, dtype="float32", device="cpu")
    return ref, mine, tok


def test_smollm2_greedy_staggered_equals_hf_generate(smollm2):
    ref, mine, tok = smollm2
    engine = LLMEngine(EngineConfig(num_blocks=256, max_num_batched_tokens=96), model=mine,
                       tokenizer=tok)
    prompts = [tok.encode(p) for p in PROMPTS]
    n = 16
    ids, final, step = [], {}, 0
    while len(final) < len(prompts):
        if len(ids) < len(prompts):
            ids.append(engine.add_request(prompts[len(ids)],
                                          SamplingParams(temperature=0, max_tokens=n)))
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        step += 1
    eos = ref.generation_config.eos_token_id
    for prompt, rid in zip(prompts, ids):
        hf = ref.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n,
                          pad_token_id=tok.pad_token_id)[0, len(prompt):].tolist()
        if eos in hf:
            hf = hf[:hf.index(eos) + 1]
        assert final[rid].output_token_ids == hf, tok.decode(prompt)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_smollm2_chat_template_and_text(smollm2):
    _, mine, tok = smollm2
    assert tok.chat_template, "the recipe keeps the model's chat template"
    engine = LLMEngine(EngineConfig(num_blocks=64), model=mine, tokenizer=tok)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Say hello."}],
                                     add_generation_prompt=True, tokenize=False)
    out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=12))[0]
    assert out.text and out.text.strip()


def test_smollm2_ngram_speculation_is_exact(smollm2):
    """Prompt lookup on a real model: the same greedy tokens as plain decoding."""
    from engine.config import SpeculativeConfig

    ref, mine, tok = smollm2
    code = ("def area(r):\n    return 3.14159 * r * r\n\n"
            "def perimeter(r):\n    return 2 * 3.14159 * r\n\n")
    prompts = [tok.encode(code + "Rewrite both functions with math.pi:\n"),
               tok.encode(PROMPTS[4]), tok.encode(PROMPTS[5]), tok.encode(code * 2)]
    greedy = SamplingParams(temperature=0, max_tokens=24)
    plain = LLMEngine(EngineConfig(num_blocks=256), model=ref, tokenizer=tok).generate(
        prompts, greedy)
    spec_cfg = SpeculativeConfig(method="ngram", k_max=5, adaptive=False)
    engine = LLMEngine(EngineConfig(num_blocks=256, speculative=spec_cfg), model=mine,
                       tokenizer=tok)
    outs = engine.generate(prompts, greedy)
    assert [o.output_token_ids for o in outs] == [o.output_token_ids for o in plain]
    assert engine.speculator.stats.num_accepted_tokens > 0


def test_health_answers_fast_during_a_long_prefill(smollm2_path):
    """The engine runs off the event loop: /health stays fast while a long prompt is computed."""
    import threading
    import time

    import httpx

    from server_utils import ServerProcess

    srv = ServerProcess(["--model", smollm2_path, "--served-model-name", "smol", "--device",
                         "cpu", "--speculative", "none"]).wait_ready()
    try:
        long_prompt = "The history of the printing press is long and varied. " * 250
        done = threading.Event()

        def generate():
            httpx.post(srv.url + "/v1/completions", timeout=300,
                       json={"model": "smol", "prompt": long_prompt, "max_tokens": 4})
            done.set()

        worker = threading.Thread(target=generate)
        worker.start()
        time.sleep(0.3)  # the prefill is running now
        latencies = []
        with httpx.Client() as c:
            while not done.is_set() and len(latencies) < 40:
                t0 = time.perf_counter()
                assert c.get(srv.url + "/health").status_code == 200
                latencies.append(time.perf_counter() - t0)
                time.sleep(0.02)
        worker.join()
        assert len(latencies) >= 5, "the prefill was too short to measure anything"
        latencies.sort()
        assert max(latencies) < 0.05, latencies
    finally:
        assert srv.terminate() == 0
