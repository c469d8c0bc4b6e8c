"""ServerState: the one object the routes share (config, engine client, tokenizer, readiness).

It loads the engine (in a thread of this process, or in an engine process of its own) and starts
its client. Must not touch HTTP (no requests, no responses), a `Sequence`, or an engine's
insides: everything about the engine comes through `EngineClient`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from engine import EngineConfig, LLMEngine
from server.config import AppConfig
from engine.models.loader import ModelLoadError
from server.engine_client import EngineClient, EngineLoadError
from server.metrics import Metrics
from server.protocol import now

log = logging.getLogger("specserve.server")

# failures that are the configuration's, said in one line; anything else keeps its traceback
CONFIG_ERRORS = (ModelLoadError, EngineLoadError, OSError, ValueError)


@dataclass
class ServerState:
    config: AppConfig
    client: EngineClient | None = None
    tokenizer: object = None
    model_name: str = ""
    load_error: str | None = None
    draining: bool = False
    metrics: Metrics = field(default_factory=Metrics)
    created: int = field(default_factory=now)

    @property
    def ready(self) -> bool:
        return self.client is not None and self.client.alive and not self.draining

    @property
    def dead(self) -> str | None:
        """Why this server can never serve (the model did not load, the engine stopped), or
        None."""
        if self.load_error:
            return self.load_error
        return None if self.client is None else self.client.failure

    def load(self, engine: LLMEngine | None = None) -> None:
        """Build the engine (unless given) and start its client; runs off the event loop."""
        try:
            engine_config: EngineConfig = self.config.engine_config()
            if engine is None and self.config.server.engine_process:
                client, self.tokenizer = self._engine_process(engine_config)
            else:
                engine = engine or LLMEngine(engine_config)
                client, self.tokenizer = EngineClient.in_thread(engine), engine.tokenizer
            self.model_name = (self.config.server.served_model_name
                               or _model_name(engine_config.model))
            self.metrics.set_info(model=self.model_name, **client.info.labels())
            client.step_listeners.append(self.metrics.observe_step)
            client.start()
            self.client = client
            log.info("engine ready: %s (%d KV blocks, context %d%s)", self.model_name,
                     client.info.num_blocks, client.info.max_model_len,
                     ", in its own process" if self.config.server.engine_process else "")
        except CONFIG_ERRORS as exc:  # reported by /ready and /health; the server exits
            log.debug("engine load failed", exc_info=exc)
            self.load_error = str(exc) or type(exc).__name__
            log.error("cannot load the engine: %s", self.load_error)
        except Exception as exc:
            log.exception("failed to load the engine")
            self.load_error = f"{type(exc).__name__}: {exc}"

    @staticmethod
    def _engine_process(engine_config: EngineConfig) -> tuple[EngineClient, object]:
        """The engine in a process of its own, and this process's tokenizer."""
        from engine.models.loader import load_tokenizer

        tokenizer = load_tokenizer(engine_config.model, engine_config.gguf_file,
                                   engine_config.tokenizer, engine_config.model_cache_dir)
        return EngineClient.in_process(engine_config, tokenizer), tokenizer


def _model_name(model: str) -> str:
    from engine.models.loader import model_label

    return model_label(model)
