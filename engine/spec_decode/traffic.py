"""Served traffic kept for training draft heads: `speculative.record` (opt-in, off by default).

What is recorded: per request that finished normally (stop or length; never an aborted or
failed one), one JSON line `{"prompt": [token ids], "output": [token ids]}`. Token ids only:
no text, no features (training recomputes them), no sampling parameters, nothing about the
caller. Where: `dir/shared/` for requests without a cache_salt; a salted request (a tenant:
the server salts each API key's requests by default) goes to `dir/tenant-<first 16 hex digits
of sha256(salt)>/` (the salt itself is not written). A tenant's requests are never written
into another tenant's folder, and `specserve speculator train --from-traffic` reads exactly
one folder, so a head is trained on one tenant's traffic (or the shared traffic) and never
on a mix: serve a tenant's head to that tenant. Files rotate: `traffic-<ms>.jsonl`, a new
one when the current passes a sixteenth of `max_gb` (64 MiB at most); when the folder tree
passes `max_gb`, the oldest files are deleted first. `dir/meta.json` names the target (its
shape and an embedding fingerprint, as a head's config does): a server with another target
refuses the folder at start-up, and training refuses another target's traffic.

Turn it off by removing `speculative.record` (and delete `dir` to forget what was kept). A
write that fails (a full disk) is logged once and recording stops; serving goes on.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path

import torch

from engine.config import RecordConfig

log = logging.getLogger("specserve.engine")

FORMAT = "specserve-traffic-1"
META_FILE = "meta.json"
SHARED = "shared"
MAX_FILE_BYTES = 64 << 20


def folder_of(cache_salt: str | None) -> str:
    """The folder (under `dir`) of a request's traffic."""
    if cache_salt is None:
        return SHARED
    return "tenant-" + hashlib.sha256(cache_salt.encode()).hexdigest()[:16]


def target_meta(model: torch.nn.Module, name: str) -> dict:
    from engine.spec_decode.eagle import fingerprint, target_shape

    return {"format": FORMAT, "target": name, "target_shape": target_shape(model),
            "fingerprint": fingerprint(model)}


def check_meta(meta: dict, model: torch.nn.Module, option: str) -> None:
    """Refuse traffic recorded for another target (the head check's shape and fingerprint)."""
    from engine.spec_decode.eagle import check_same_target

    if meta.get("format") != FORMAT:
        raise ValueError(f"invalid {option}: not recorded traffic (format "
                         f"{meta.get('format')!r}, expected {FORMAT!r})")
    check_same_target(meta.get("target", "?"), meta.get("target_shape"),
                      meta.get("fingerprint"), model, option, "the traffic was recorded")


class TrafficRecorder:
    def __init__(self, config: RecordConfig, model: torch.nn.Module, name: str) -> None:
        self.root = Path(config.dir).expanduser()
        self.max_bytes = int(config.max_gb * (1 << 30))
        self.file_bytes = max(min(self.max_bytes // 16, MAX_FILE_BYTES), 1)
        meta = target_meta(model, name)
        where = self.root / META_FILE
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            if where.exists():
                check_meta(json.loads(where.read_text()), model, "speculative.record.dir")
            else:
                where.write_text(json.dumps(meta))
        except OSError as exc:
            raise ValueError(f"invalid speculative config record.dir: {exc}") from None
        except json.JSONDecodeError:
            raise ValueError(f"invalid speculative config record.dir: {where} is corrupt"
                             ) from None
        self._open: dict[str, list] = {}  # folder -> [file, handle, its bytes]
        self.total = sum(p.stat().st_size for p in self.root.glob("*/traffic-*.jsonl"))
        self.failed = False

    def record(self, prompt: list[int], output: list[int], finish_reason: str | None,
               cache_salt: str | None) -> None:
        """Append a finished request (stop or length; anything else is not kept)."""
        if self.failed or finish_reason not in ("stop", "length") or not output:
            return
        line = json.dumps({"prompt": prompt, "output": output}, separators=(",", ":")) + "\n"
        try:
            folder = folder_of(cache_salt)
            current = self._file(folder)
            current[1].write(line)
            current[1].flush()
            current[2] += len(line)  # (ASCII: characters are bytes)
            self.total += len(line)
            if current[2] >= self.file_bytes:
                current[1].close()
                del self._open[folder]
            if self.total > self.max_bytes:
                self._rotate()
        except OSError as exc:
            self.failed = True
            log.error("speculative.record: writing %s failed (%s); recording stopped",
                      self.root, exc)

    def _file(self, folder: str):
        if folder not in self._open:
            where = self.root / folder
            where.mkdir(exist_ok=True)
            path = where / f"traffic-{time.time_ns() // 1_000_000:013d}.jsonl"
            while path.exists():  # two files in one millisecond
                path = where / f"traffic-{int(path.stem.split('-')[1]) + 1:013d}.jsonl"
            self._open[folder] = [path, open(path, "a"), 0]
        return self._open[folder]

    def _rotate(self) -> None:
        """Delete the oldest files until the tree is within max_bytes (a file being written
        goes last)."""
        current = {entry[0] for entry in self._open.values()}
        files = sorted(self.root.glob("*/traffic-*.jsonl"),
                       key=lambda p: (p in current, p.name))
        for path in files:
            if self.total <= self.max_bytes:
                break
            size = path.stat().st_size
            if path in current:
                handle = self._open.pop(path.parent.name)[1]
                handle.close()
            os.remove(path)
            self.total -= size

    def close(self) -> None:
        for entry in self._open.values():
            entry[1].close()
        self._open.clear()


def read_traffic(folder: str, model: torch.nn.Module, option: str = "--from-traffic"
                 ) -> list[tuple[list[int], list[int]]]:
    """The (prompt, output) token ids recorded in ONE folder (`dir/shared` or a tenant's),
    oldest first; a clear error naming `option` for an empty, corrupt or foreign folder."""
    where = Path(folder).expanduser()
    if not where.is_dir():
        raise ValueError(f"invalid {option}: {folder!r} is not a folder")
    files = sorted(where.glob("traffic-*.jsonl"))
    if not files:
        subs = sorted(p.name for p in where.iterdir() if p.is_dir()
                      and any(p.glob("traffic-*.jsonl")))
        hint = (f": it holds the traffic of {', '.join(subs)}; train on one of them (a head "
                f"per tenant)" if subs else "")
        raise ValueError(f"invalid {option}: no recorded traffic in {folder!r}{hint}")
    meta_path = where.parent / META_FILE
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, json.JSONDecodeError):
        raise ValueError(f"invalid {option}: {meta_path} is missing or corrupt (recorded "
                         f"traffic keeps its target there)") from None
    check_meta(meta, model, option)
    out = []
    for path in files:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            try:
                row = json.loads(line)
                prompt, output = row["prompt"], row["output"]
                if not (isinstance(prompt, list) and isinstance(output, list) and output
                        and all(isinstance(t, int) for t in prompt + output)):
                    raise ValueError
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"invalid {option}: {path}:{n} is not a recorded request"
                                 ) from None
            out.append((prompt, output))
    return out
