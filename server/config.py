"""Server configuration: one pydantic model, from defaults < SPECSERVE_* env < YAML < flags."""

from __future__ import annotations

import os
from typing import Any, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field

from engine.config import EngineConfig


class ServerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    api_keys: list[str] = []  # empty: no authentication
    served_model_name: Optional[str] = None  # default: the engine's model name
    cors_allow_origins: list[str] = []
    max_waiting_requests: int = Field(default=256, ge=1)  # beyond it: 429 with Retry-After
    max_n: int = Field(default=8, ge=1)
    max_body_bytes: int = Field(default=4 << 20, ge=1024)  # beyond it: 413
    drain_timeout_s: float = Field(default=30.0, ge=0)  # SIGTERM: finish in-flight for so long
    retry_after_s: int = Field(default=1, ge=1)  # the least Retry-After of a 429 or 503
    log_level: str = "info"
    # the engine in a process of its own (HTTP, tokenization and detokenization then never
    # compete with the step for the GIL); False: in a thread of the server's process
    engine_process: bool = False
    # Tenants: a request without `cache_salt` gets one derived from its API key, so tenants
    # never share prefix-cache blocks (a shared block answers faster: a timing side channel).
    # False: requests without a salt share the cache across keys, on purpose.
    cache_salt_per_api_key: bool = True
    # /metrics on its own port (bind it to an internal interface); None: on the API port,
    # behind the API key when keys are configured
    metrics_port: Optional[int] = Field(default=None, ge=0, le=65535)
    metrics_host: Optional[str] = None  # default: `host`
    # /v1/responses keeps finished responses in memory (previous_response_id, GET, DELETE):
    # at most so many per API key and cache_salt, and in all; the oldest evicted first.
    # 0: none kept (then `store: true` is a 400)
    responses_store_per_key: int = Field(default=256, ge=0)
    responses_store_total: int = Field(default=4096, ge=0)
    # HTTP limits (server/http.py), per request unless said otherwise
    max_header_bytes: int = Field(default=64 << 10, ge=1024)  # request line + headers: 431
    max_request_line_bytes: int = Field(default=8 << 10, ge=256)  # method, target, version: 414
    header_timeout_s: float = Field(default=10.0, gt=0)  # first byte to end of headers: 408
    body_timeout_s: float = Field(default=60.0, gt=0)  # end of headers to end of body: 408
    keep_alive_timeout_s: float = Field(default=5.0, gt=0)  # idle between requests: closed
    max_connections: int = Field(default=1024, ge=1)  # open connections; beyond: 503


class AppConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    server: ServerConfig = ServerConfig()
    engine: dict[str, Any] = {}

    def engine_config(self) -> EngineConfig:
        return EngineConfig.from_dict(self.engine)


# SPECSERVE_<NAME> -> (section, key, parser)
ENV = {
    "HOST": ("server", "host", str), "PORT": ("server", "port", int),
    "API_KEY": ("server", "api_keys", lambda v: [k for k in v.split(",") if k]),
    "SERVED_MODEL_NAME": ("server", "served_model_name", str),
    "MAX_WAITING_REQUESTS": ("server", "max_waiting_requests", int),
    "DRAIN_TIMEOUT_S": ("server", "drain_timeout_s", float),
    "LOG_LEVEL": ("server", "log_level", str),
    "METRICS_PORT": ("server", "metrics_port", int),
    "MAX_CONNECTIONS": ("server", "max_connections", int),
    "ENGINE_PROCESS": ("server", "engine_process", lambda v: v.lower() in ("1", "true", "yes")),
    "MODEL": ("engine", "model", str), "DEVICE": ("engine", "device", str),
    "DTYPE": ("engine", "dtype", str), "MODEL_CACHE": ("engine", "model_cache_dir", str),
    "KV_CACHE_MEMORY_GB": ("engine", "kv_cache_memory_gb", float),
    "GPU_MEMORY_UTILIZATION": ("engine", "gpu_memory_utilization", float),
}


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def load_config(path: str | None = None, overrides: dict | None = None,
                environ: dict[str, str] | None = None) -> AppConfig:
    environ = os.environ if environ is None else environ
    data: dict = {"server": {}, "engine": {}}
    for name, (section, key, parse) in ENV.items():
        if f"SPECSERVE_{name}" in environ:
            data[section][key] = parse(environ[f"SPECSERVE_{name}"])
    if path:
        with open(path) as f:
            data = _merge(data, yaml.safe_load(f) or {})
    data = _merge(data, overrides or {})
    return AppConfig(**data)
