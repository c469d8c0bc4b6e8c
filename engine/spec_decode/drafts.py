"""The draft tokens of one forward, as one object (vLLM's `SpecDecodeMetadata`).

Must not decide anything: the speculator fills it (which drafts each scheduled sequence runs),
the model runner places the drafts after each sequence's committed tokens in the forward's
input ids, and the verifier reads the same flat ids (and q) to accept or reject them.

Drafts are flat over the forward's sequences in their order: sequence i has
`num_draft_tokens[i]` of them (0 for none) at `offsets[i]:offsets[i + 1]`. A draft model that
sampled them on the device leaves them there (`device`); the host then never holds those ids.
"""

from __future__ import annotations

import itertools

import torch

from engine.device_io import to_device


class Drafts:
    def __init__(self, host: list[list[int] | None],
                 device: list[torch.Tensor | None] | None = None,
                 q: list[torch.Tensor | None] | None = None,
                 num_draft_tokens: list[int] | None = None) -> None:
        """host[i]: sequence i's drafts as host ids, or None where `device[i]` ([k_i] long)
        holds them; q[i]: their draft probabilities ([k_i, V]), None for drafts whose q is
        not needed (one-hot drafts, or verified by pick)."""
        self.host = host
        self.q = q if q is not None else [None] * len(host)
        self.num_draft_tokens = num_draft_tokens or [
            len(h) if h is not None else len(d) for h, d in zip(host, device or host)]
        self.offsets = [0, *itertools.accumulate(self.num_draft_tokens)]
        self._parts = device  # per sequence its device-held drafts, or None
        self._flat: torch.Tensor | None = None

    @classmethod
    def on_device(cls, ids: torch.Tensor) -> "Drafts":
        """One device-held draft per sequence ([n] long): a draft model's chained forward."""
        drafts = cls([None] * ids.shape[0], num_draft_tokens=[1] * ids.shape[0])
        drafts._flat = ids
        return drafts

    @property
    def num_tokens(self) -> int:
        return self.offsets[-1]

    @property
    def held_by_device(self) -> bool:
        """Some drafts are on the device only: the forward takes them from `ids`."""
        return any(h is None for h, k in zip(self.host, self.num_draft_tokens) if k)

    def of(self, i: int) -> list[int]:
        """Sequence i's drafts on the host (only where `held_by_device` is False for it)."""
        host = self.host[i]
        assert host is not None, "these drafts are on the device only"
        return host

    def ids(self, device: torch.device) -> torch.Tensor:
        """[num_tokens] long on `device`: every draft, flat (made once per step)."""
        if self._flat is None:
            flat = to_device([t for h, k in zip(self.host, self.num_draft_tokens)
                              for t in (h if h is not None else [0] * k)], torch.long, device)
            index, values = [], []
            for i, part in enumerate(self._parts or []):
                if part is not None and self.num_draft_tokens[i]:
                    index += range(self.offsets[i], self.offsets[i + 1])
                    values.append(part)
            if values:
                flat.index_copy_(0, to_device(index, torch.long, device), torch.cat(values))
            self._flat = flat
        return self._flat
