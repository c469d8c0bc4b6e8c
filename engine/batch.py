"""The step's data: what one forward runs and what it returns. The engine's floor.

Must not import anything of the engine but `device_io` (a leaf): the runner, the static steps,
the memory plan, the tensor-parallel workers, the verifier and the proposers all read these
types, so they sit below every one of them.

A forward packs sequences without padding (`RunItem` each): each item's new tokens are its
`token_ids`, then its drafts of the step's `Drafts`. `input_ids` builds the forward's ids from
both; `StepLogits` is what the runner returns; `StepMeta` is what rank 0 sends the other
tensor-parallel ranks of each forward.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from engine.device_io import to_device

UNKNOWN = -1  # a draft's id in `Drafts.host` where only the device holds it


@dataclass
class ModelShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int

    @classmethod
    def of(cls, model: torch.nn.Module) -> "ModelShape":
        cfg = model.config.get_text_config()
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        head = model.get_output_embeddings()
        vocab = getattr(head, "out_features", None) or head.weight.shape[0]
        return cls(cfg.num_hidden_layers, kv_heads, head_dim, vocab)


@dataclass
class RunItem:
    """One sequence's part of a forward: new tokens at positions start, start + 1, ...: its
    `token_ids`, then its drafts of the forward's `Drafts`."""

    token_ids: list[int]
    start: int
    block_table: list[int]  # covers every position up to start + its new tokens
    num_rows: int  # logits wanted at the last num_rows new tokens
    # positions from here on hold generated tokens (the sequence's prompt length): their rows
    # may run on the CPU row kernel (engine/attention/paged.py); None: every row is a prompt's
    prompt_len: int | None = None


class Drafts:
    """The draft tokens of one forward, flat over its sequences (vLLM's spec-decode metadata).

    Sequence i has `num_draft_tokens[i]` drafts (0: none) at `offsets[i]:offsets[i + 1]`:
    - `token_ids` [num_tokens] long, on the forward's device: every draft (where a draft model
      sampled them on the device, they never left it);
    - `host` [num_tokens] the same ids on the host, UNKNOWN where only the device holds them
      (`host_of` answers per sequence);
    - `draft_probs` [num_tokens, V] q, or None when no sequence's drafts need it; `has_q[i]`:
      sequence i's rows hold its q. False marks drafts whose q is never read: one-hot drafts
      (prompt lookup, suffix: q(x) = 1 at the draft) and drafts verified by the target's pick
      (greedy, coupled seeded sampling); their rows are allocated but left unset (a step
      mixing both pays for them: at most the size of its target probabilities).
    Each draft follows the one before it in its sequence (a chain). A token tree fits the same
    object: a parents tensor ([num_tokens], -1 for the last committed token) where a chain's
    parents are i - 1, with the same offsets, ids and q rows per node.
    """

    def __init__(self, num_draft_tokens: list[int], token_ids: torch.Tensor,
                 host: list[int] | None = None, draft_probs: torch.Tensor | None = None,
                 has_q: list[bool] | None = None) -> None:
        self.num_draft_tokens = list(num_draft_tokens)
        self.offsets = [0, *itertools.accumulate(self.num_draft_tokens)]
        self.token_ids = token_ids
        self.host = host if host is not None else [UNKNOWN] * self.num_tokens
        self.draft_probs = draft_probs
        self.has_q = has_q if has_q is not None else [False] * len(self.num_draft_tokens)

    @classmethod
    def gather(cls, per_seq: list[tuple[list[int] | torch.Tensor, torch.Tensor | None]],
               device: torch.device) -> "Drafts":
        """Drafts from each sequence's (ids, q): ids on the host (a list) or on the device
        ([k] long); q [k, V] where it is read, else None."""
        num = [len(ids) for ids, _ in per_seq]
        host = [t for ids, _ in per_seq
                for t in (ids if isinstance(ids, list) else [UNKNOWN] * len(ids))]
        drafts = cls(num, to_device(host, torch.long, device), host,
                     has_q=[q is not None and k > 0 for (_, q), k in zip(per_seq, num)])
        held = [(i, ids) for i, (ids, _) in enumerate(per_seq)
                if isinstance(ids, torch.Tensor) and len(ids)]
        if held:  # the ids only the device holds, into their places
            rows = [r for i, _ in held for r in range(drafts.offsets[i], drafts.offsets[i + 1])]
            drafts.token_ids.index_copy_(0, to_device(rows, torch.long, device),
                                         torch.cat([ids for _, ids in held]))
        qs = [(i, q) for i, (_, q) in enumerate(per_seq) if drafts.has_q[i]]
        if qs:  # rows of sequences without q stay unset (never read)
            q0 = qs[0][1]
            drafts.draft_probs = q0.new_empty((drafts.num_tokens, q0.shape[1]))
            for i, q in qs:
                drafts.draft_probs[drafts.offsets[i]:drafts.offsets[i + 1]] = q
        return drafts

    @property
    def num_tokens(self) -> int:
        return self.offsets[-1]

    def host_of(self, i: int) -> list[int] | None:
        """Sequence i's drafts on the host, or None where only the device holds them."""
        ids = self.host[self.offsets[i]:self.offsets[i + 1]]
        return None if UNKNOWN in ids else ids


def num_new_tokens(items: list[RunItem], drafts: Drafts | None) -> list[int]:
    """Per item, its new tokens in the forward: its token ids and then its drafts."""
    if drafts is None:
        return [len(it.token_ids) for it in items]
    return [len(it.token_ids) + k for it, k in zip(items, drafts.num_draft_tokens)]


def input_ids(items: list[RunItem], drafts: Drafts | None, device: torch.device,
              first_row: Callable[[int], int] | None = None, rows: int | None = None
              ) -> torch.Tensor:
    """[1, rows] the forward's token ids on `device`: each item's token ids, then its drafts
    (copied from `drafts.token_ids` on the device). first_row(i): the row of item i's first
    new token (default: packed in item order); rows: the forward's rows (default: the new
    tokens)."""
    lengths = num_new_tokens(items, drafts)
    starts = [0, *itertools.accumulate(lengths)][:-1]
    first_row = first_row or starts.__getitem__
    ids = np.zeros(rows if rows is not None else sum(lengths), dtype=np.int64)
    draft_rows: list[int] = []  # in draft order
    for i, (it, n) in enumerate(zip(items, lengths)):
        at = first_row(i)
        ids[at:at + len(it.token_ids)] = it.token_ids
        draft_rows += range(at + len(it.token_ids), at + n)
    if not draft_rows:
        return to_device(ids[None], torch.long, device)
    if len(draft_rows) == len(ids):  # every row is a draft (a draft model's chained forward)
        return drafts.token_ids[None]
    packed = to_device(np.concatenate([ids, np.asarray(draft_rows, dtype=np.int64)]),
                       torch.long, device)  # one transfer: the ids, then the draft rows
    out = packed[:len(ids)]
    out.index_copy_(0, packed[len(ids):], drafts.token_ids)
    return out[None]


@dataclass
class StepLogits:
    logits: torch.Tensor  # [num_rows, vocab_size] float32, raw model logits
    row_offsets: list[int]  # items[i] owns rows row_offsets[i] : row_offsets[i + 1]
    # with `ModelRunner.capture`: [new tokens, features] the captured layers' outputs at every
    # new token, in item order (item i's token ids, then its drafts)
    hidden: torch.Tensor | None = None


@dataclass
class StepMeta:
    """One forward as a tensor-parallel worker needs it: what `ModelRunner.execute` packed on
    rank 0 (the input ids follow by broadcast)."""

    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64
    spans: list  # [SeqSpan] (engine/attention/paged.py), block tables cut to each context
