"""One real HTTP request through the server on cuda (part of `make gpu-check`).

No weights travel to a GPU machine, so the model is random-init with the real configuration of
Qwen2.5-Coder-1.5B (bench/model_shapes/), saved with the tests' small trained tokenizer and a
ChatML template. The server runs it in bf16 on cuda with speculation (suffix); the official
`openai` client sends a chat completion and a streamed one and checks their shape.

    python scripts/gpu_http_check.py [--shape qwen2.5-coder-1.5b]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def save_model(folder: Path, shape: str, device: str) -> None:
    import torch
    from conftest import build_tokenizer
    from server_utils import CHATML
    from transformers import AutoConfig, AutoModelForCausalLM

    tok = build_tokenizer()
    tok.chat_template = CHATML
    config = AutoConfig.for_model(**json.loads(
        (ROOT / "bench/model_shapes" / f"{shape}.json").read_text()))
    config.eos_token_id = tok.eos_token_id
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():  # answer with ids the small tokenizer can decode
        head = model.get_output_embeddings().weight
        head[len(tok):] = 0
        head[:len(tok)] *= 20
    model.save_pretrained(folder)
    tok.save_pretrained(folder)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen2.5-coder-1.5b")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    import openai
    from server_utils import ServerProcess

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        t0 = time.perf_counter()
        save_model(folder, args.shape, args.device)
        print(f"saved a random-init {args.shape} in {time.perf_counter() - t0:.1f} s")
        cfg = Path(tmp) / "serve.yaml"
        cfg.write_text(f"engine:\n  model: {folder}\n  device: {args.device}\n"
                       f"  dtype: bfloat16\n  kv_cache_memory_gb: 4\n"
                       f"  speculative:\n    method: suffix\n")
        srv = ServerProcess(["--config", str(cfg), "--served-model-name", "shape"])
        try:
            t0 = time.perf_counter()
            srv.wait_ready(timeout=120)
            print(f"server ready in {time.perf_counter() - t0:.1f} s")
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
            messages = [{"role": "user", "content": "The quick brown fox " * 20}]
            t0 = time.perf_counter()
            out = client.chat.completions.create(model="shape", messages=messages,
                                                 max_tokens=64, temperature=0,
                                                 extra_body={"ignore_eos": True})
            seconds = time.perf_counter() - t0
            assert out.usage.completion_tokens == 64, out.usage
            chunks = list(client.chat.completions.create(
                model="shape", messages=messages, max_tokens=64, temperature=0, stream=True,
                extra_body={"ignore_eos": True}))
            streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert out.choices[0].message.content and streamed == out.choices[0].message.content
            print(f"chat completion: 64 tokens in {seconds:.2f} s ({64 / seconds:.1f} tok/s, "
                  f"first request); streamed: {len(chunks)} chunks, same text; "
                  f"usage {out.usage.model_dump()}")
        finally:
            code = srv.terminate()
            if code != 0:
                print(srv.log())
        print("http check: passed" if code == 0 else f"http check: server exited {code}")
        return 0 if code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
