"""Start a real specserve server subprocess on a free port, with a tiny model saved to disk."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def save_tiny_model(folder: Path) -> Path:
    """A tiny random Qwen2 with the test tokenizer and a ChatML template, as a local folder."""
    from conftest import build_tiny_model, build_tokenizer

    tok = build_tokenizer()
    tok.chat_template = CHATML
    model = build_tiny_model("qwen2", vocab_size=len(tok))
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
