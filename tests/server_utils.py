"""Start a real specserve server subprocess on a free port, with a tiny model saved to disk."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def save_tiny_model(folder: Path, max_positions: int = 1024) -> Path:
    """A tiny random Qwen2 with the test tokenizer and a ChatML template, as a local folder."""
    from conftest import build_tiny_model, build_tokenizer

    tok = build_tokenizer()
    tok.chat_template = CHATML
    model = build_tiny_model("qwen2", vocab_size=len(tok), max_positions=max_positions)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.config.eos_token_id = tok.eos_token_id
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def wait_ok(url: str, timeout: float, alive=lambda: True) -> bool:
    """Poll `url` until it answers 200 (True), `alive()` turns False or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and alive():
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, args: list[str], env: dict | None = None, port: int | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        root = Path(__file__).resolve().parents[1]
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"specserve-{self.port}.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "server", "--port", str(self.port), *args],
            cwd=root, env=full_env, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 120) -> "ServerProcess":
        if wait_ok(self.url + "/ready", timeout, lambda: self.proc.poll() is None):
            return self
        if self.proc.poll() is not None:
            raise RuntimeError(f"server exited {self.proc.returncode}:\n{self.log()}")
        raise TimeoutError(f"server not ready in {timeout}s:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()[-5000:]

    def terminate(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def chat_prompt_ids(tokenizer, body: dict) -> list[int]:
    """The prompt the server renders for a chat request `body` (its own function)."""
    from types import SimpleNamespace

    from server.protocol import ChatCompletionRequest
    from server.validation import chat_prompt_ids as render

    return render(SimpleNamespace(tokenizer=tokenizer), ChatCompletionRequest(**body))


def save_scripted_tiny_model(folder: Path, scripts: list[tuple[dict, str]],
                             steps: int = 400) -> Path:
    """A tiny Qwen2 (as `save_tiny_model`) trained until its greedy reply to each chat request
    body of `scripts` is the given text: a real model that writes what a test needs (a fenced
    call, a call repeated in a loop, a text answer after a tool result)."""
    import torch

    from conftest import build_tiny_model, build_tokenizer

    tok = build_tokenizer()
    tok.chat_template = CHATML
    model = build_tiny_model("qwen2", vocab_size=len(tok)).train()
    rows = []
    for body, reply in scripts:
        prompt = chat_prompt_ids(tok, body)
        rows.append((prompt, tok.encode(reply, add_special_tokens=False) + [tok.eos_token_id]))
    optim = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(steps):
        for prompt, reply in rows:
            ids = torch.tensor([prompt + reply])
            labels = torch.tensor([[-100] * len(prompt) + reply])
            loss = model(input_ids=ids, labels=labels).loss
            optim.zero_grad()
            loss.backward()
            optim.step()
    model.eval()
    model.generation_config.eos_token_id = tok.eos_token_id
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@contextmanager
def tiny_server(model_dir: Path, name: str):
    """A running server of a tiny model folder on one thread, with n-gram speculation on; it
    must exit cleanly."""
    srv = ServerProcess(["--model", str(model_dir), "--served-model-name", name,
                         "--device", "cpu", "--num-threads", "1", "--speculative", "ngram",
                         "--k-max", "4"]).wait_ready()
    yield srv
    assert srv.terminate() == 0, srv.log()


def openai_client(srv: ServerProcess):
    import openai

    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
