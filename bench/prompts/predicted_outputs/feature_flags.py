"""Feature flags with percentage rollouts, allow lists and per-environment overrides."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Flag:
    name: str
    enabled: bool = False
    rollout_percent: float = 0.0
    allow_users: set[str] = field(default_factory=set)
    deny_users: set[str] = field(default_factory=set)
    environments: dict[str, bool] = field(default_factory=dict)


def bucket_of(flag_name: str, user_id: str) -> float:
    digest = hashlib.sha256(f"{flag_name}:{user_id}".encode()).digest()
    return int.from_bytes(digest[:4], "big") / 2**32 * 100


def flag_from_dict(name: str, data: dict) -> Flag:
    percent = float(data.get("rollout_percent", 0))
    if not 0 <= percent <= 100:
        raise ValueError(f"{name}: rollout_percent must be within 0..100")
    return Flag(name=name,
                enabled=bool(data.get("enabled", False)),
                rollout_percent=percent,
                allow_users=set(data.get("allow_users", [])),
                deny_users=set(data.get("deny_users", [])),
                environments={str(k): bool(v) for k, v in data.get("environments", {}).items()})


class FlagStore:
    def __init__(self, flags: dict[str, Flag] | None = None, environment: str = "prod") -> None:
        self.flags = dict(flags or {})
        self.environment = environment

    @classmethod
    def from_file(cls, path: str | Path, environment: str = "prod") -> FlagStore:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
        flags = {name: flag_from_dict(name, data) for name, data in raw.items()}
        return cls(flags, environment)

    def is_enabled(self, name: str, user_id: str | None = None) -> bool:
        flag = self.flags.get(name)
        if flag is None:
            return False
        if self.environment in flag.environments:
            return flag.environments[self.environment]
        if not flag.enabled:
            return False
        if user_id is None:
            return flag.rollout_percent >= 100
        if user_id in flag.deny_users:
            return False
        if user_id in flag.allow_users:
            return True
        return bucket_of(name, user_id) < flag.rollout_percent

    def enabled_for(self, user_id: str) -> list[str]:
        return sorted(name for name in self.flags if self.is_enabled(name, user_id))

    def set_rollout(self, name: str, percent: float) -> None:
        if not 0 <= percent <= 100:
            raise ValueError("percent must be within 0..100")
        self.flags.setdefault(name, Flag(name=name, enabled=True)).rollout_percent = percent

    def to_dict(self) -> dict:
        return {name: {"enabled": f.enabled,
                       "rollout_percent": f.rollout_percent,
                       "allow_users": sorted(f.allow_users),
                       "deny_users": sorted(f.deny_users),
                       "environments": dict(f.environments)}
                for name, f in sorted(self.flags.items())}
