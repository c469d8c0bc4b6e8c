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
    retry_after_s: int = Field(default=1, ge=1)
    log_level: str = "info"


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
    "MODEL": ("engine", "model", str), "DEVICE": ("engine", "device", str),
    "DTYPE": ("engine", "dtype", str), "MODEL_CACHE": ("engine", "model_cache_dir", str),
    "KV_CACHE_MEMORY_GB": ("engine", "kv_cache_memory_gb", float),
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
