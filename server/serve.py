"""Running the app: uvicorn with the HTTP limits of server.http, /metrics on its own port when
configured, a drain on SIGTERM/SIGINT before exiting 0, and an exit with status 1 when the
engine cannot serve (its model did not load, it stopped, its process died), so that an
orchestrator restarts the server.

Must not touch the routes nor the engine beyond EngineClient's counters and abort.
"""

from __future__ import annotations

import asyncio
import logging
import time

import uvicorn

from engine import LLMEngine
from server.app import create_app, create_metrics_app
from server.config import AppConfig, ServerConfig
from server.http import HttpLimits, uvicorn_options
from server.state import ServerState

log = logging.getLogger("specserve.server")


def serve(config: AppConfig, engine: LLMEngine | None = None) -> int:
    """Serve until SIGTERM/SIGINT, then drain (finish in-flight up to drain_timeout_s) and
    return 0; or until the engine cannot serve, and return 1."""
    logging.basicConfig(level=config.server.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    state = ServerState(config)
    cfg = config.server
    api = _uvicorn_config(create_app(state, engine), cfg, cfg.host, cfg.port, "auto")
    side = []
    if cfg.metrics_port is not None:  # the engine's lifespan belongs to the API app alone
        side.append(uvicorn.Server(_uvicorn_config(
            create_metrics_app(state), cfg, cfg.metrics_host or cfg.host, cfg.metrics_port,
            "off")))
    server = DrainingServer(api, state, side)
    server.run()
    if state.dead:
        log.error("exiting: %s", state.dead)
        return 1
    return 0


def _uvicorn_config(app, cfg: ServerConfig, host: str, port: int,
                    lifespan: str) -> uvicorn.Config:
    return uvicorn.Config(app, host=host, port=port, log_level=cfg.log_level, access_log=False,
                          timeout_graceful_shutdown=5, lifespan=lifespan,
                          **uvicorn_options(HttpLimits.of(cfg)))


class DrainingServer(uvicorn.Server):
    """On the first SIGTERM/SIGINT: stop accepting (503, /ready false), let in-flight requests
    finish for up to drain_timeout_s, abort the rest, then shut down and exit 0.

    It replaces uvicorn's own handler, which would shut down at once (and make sse-starlette
    cancel every open stream). `side` servers (the metrics port) run on the same loop and stop
    after it."""

    def __init__(self, config: uvicorn.Config, state: ServerState,
                 side: list[uvicorn.Server] = ()) -> None:
        super().__init__(config)
        self.state = state
        self.side = list(side)
        self._drain_task: asyncio.Task | None = None

    async def serve(self, sockets=None) -> None:
        side = [asyncio.create_task(server._serve()) for server in self.side]  # no signals
        watch = asyncio.create_task(self._watch_engine())
        try:
            await super().serve(sockets)
        finally:
            watch.cancel()
            for server in self.side:
                server.should_exit = True
            await asyncio.gather(*side, return_exceptions=True)

    async def _watch_engine(self) -> None:
        """Shut down once the engine cannot serve; requests in flight have had their errors
        (EngineClient fails them when the engine stops), and give them a moment to be sent."""
        while not self.state.dead:
            await asyncio.sleep(0.1)
        await asyncio.sleep(1.0)
        self.should_exit = True

    def handle_exit(self, sig, frame) -> None:  # a signal handler, in the main thread
        if self.state.draining:  # a second signal: stop now
            self.should_exit = True
            return
        self.state.draining = True
        log.info("signal %s: draining for up to %.0fs", sig,
                 self.state.config.server.drain_timeout_s)
        self._drain_task = asyncio.get_event_loop().create_task(self._drain())

    async def _drain(self) -> None:
        client = self.state.client
        deadline = time.monotonic() + self.state.config.server.drain_timeout_s
        while client is not None and client.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if client is not None and client.num_in_flight:
            log.warning("drain timeout: aborting %d request(s)", client.num_in_flight)
            client.abort_all()
            for _ in range(100):  # let their responses send the final events
                if not client.num_in_flight:
                    break
                await asyncio.sleep(0.02)
        self.should_exit = True
