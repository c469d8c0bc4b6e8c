"""ServerState: the one object the routes share (config, engine, client, tokenizer, readiness).

It loads the engine and starts its thread. Must not touch HTTP (no requests, no responses) nor a
`Sequence`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from engine import EngineConfig, LLMEngine
from server.config import AppConfig
from server.engine_client import EngineClient
from server.metrics import Metrics
from server.protocol import now

log = logging.getLogger("specserve.server")


@dataclass
class ServerState:
    config: AppConfig
    engine: LLMEngine | None = None
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

    def load(self, engine: LLMEngine | None = None) -> None:
        """Build the engine (unless given) and start its thread; runs off the event loop."""
        try:
            engine_config: EngineConfig = self.config.engine_config()
            self.engine = engine or LLMEngine(engine_config)
            self.tokenizer = self.engine.tokenizer
            self.model_name = (self.config.server.served_model_name
                               or _model_name(engine_config.model))
            self._describe(engine_config)
            client = EngineClient(self.engine)
            client.step_listeners.append(self.metrics.observe_step)
            client.start()
            self.client = client
            log.info("engine ready: %s (%d KV blocks, context %d)", self.model_name,
                     self.engine.block_manager.num_blocks, self.engine.max_model_len)
        except Exception as exc:  # reported by /ready and /health
            log.exception("failed to load the engine")
            self.load_error = f"{type(exc).__name__}: {exc}"

    def _describe(self, engine_config: EngineConfig) -> None:
        """The model_info metric: what this server runs, for dashboards."""
        spec = engine_config.speculative
        self.metrics.set_info(
            model=self.model_name, engine_model=engine_config.model,
            draft_model=spec.draft_model or "", speculative_method=spec.method,
            k_max=spec.k_max, adaptive=spec.adaptive, dtype=engine_config.dtype,
            device=str(self.engine.device), block_size=engine_config.block_size,
            num_blocks=self.engine.block_manager.num_blocks,
            max_model_len=self.engine.max_model_len,
            batch_invariant=bool(self.engine.runner.invariance
                                 and self.engine.runner.invariance.invariant))


def _model_name(model: str) -> str:
    from engine.models.loader import model_label

    return model_label(model)
