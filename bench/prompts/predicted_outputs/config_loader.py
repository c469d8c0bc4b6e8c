"""Load an application's settings from an INI file, the environment and defaults."""

from __future__ import annotations

import configparser
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

ENV_PREFIX = "APP_"


@dataclass
class Settings:
    host: str = "127.0.0.1"
    port: int = 8080
    debug: bool = False
    workers: int = 2
    database_url: str = "sqlite:///app.db"
    log_level: str = "info"
    allowed_origins: tuple[str, ...] = ()


class ConfigError(ValueError):
    pass


def parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"not a boolean: {text!r}")


def coerce(name: str, value: Any, kind: type) -> Any:
    if kind is bool:
        return value if isinstance(value, bool) else parse_bool(str(value))
    if kind is int:
        try:
            return int(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{name}: not an integer: {value!r}") from None
    if kind is tuple:
        if isinstance(value, str):
            return tuple(part.strip() for part in value.split(",") if part.strip())
        return tuple(value)
    return str(value)


def field_types() -> dict[str, type]:
    kinds = {}
    for f in fields(Settings):
        text = str(f.type)
        kinds[f.name] = (bool if text == "bool" else int if text == "int"
                         else tuple if text.startswith("tuple") else str)
    return kinds


def read_file(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    parser = configparser.ConfigParser()
    parser.read(path, encoding="utf-8")
    if not parser.has_section("app"):
        raise ConfigError(f"{path}: no [app] section")
    return dict(parser["app"])


def read_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    environ = os.environ if environ is None else environ
    found = {}
    for key, value in environ.items():
        if key.startswith(ENV_PREFIX):
            found[key[len(ENV_PREFIX):].lower()] = value
    return found


def load(path: str | Path = "app.ini", environ: dict[str, str] | None = None) -> Settings:
    kinds = field_types()
    merged: dict[str, Any] = {}
    for source in (read_file(Path(path)), read_env(environ)):
        for name, value in source.items():
            if name not in kinds:
                raise ConfigError(f"unknown setting: {name}")
            merged[name] = coerce(name, value, kinds[name])
    settings = Settings(**merged)
    if not 0 < settings.port < 65536:
        raise ConfigError(f"port out of range: {settings.port}")
    if settings.workers < 1:
        raise ConfigError("workers must be at least 1")
    return settings
