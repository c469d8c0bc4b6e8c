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
ROOT = -1  # a draft's parent in a token tree: the sequence's last committed token
MAX_TREE_NODES = 64  # drafts of one sequence's tree (`tree_max_nodes` is bounded by it)


def check_tree(parents: list[int], limit: int = MAX_TREE_NODES) -> None:
    """Refuse what is not a token tree of at most `limit` nodes in parent-first order: each
    parent ROOT or an earlier node (which also rules out cycles). ValueError, where the tree is
    built: a step never sees a bad one."""
    if len(parents) > limit:
        raise ValueError(f"a token tree of {len(parents)} nodes is larger than the limit of "
                         f"{limit}")
    for i, p in enumerate(parents):
        if not (p == ROOT or 0 <= p < i):
            raise ValueError(f"node {i} of a token tree has parent {p}: a parent must be "
                             f"{ROOT} (the last committed token) or an earlier node")


def tree_paths(parents: list[int]) -> list[list[int]]:
    """Per node its path from the root: its ancestors' indices, then its own (a chain's node i:
    [0, 1, ..., i]). Its depth is the path's length; its position the last committed token's
    plus its depth."""
    paths: list[list[int]] = []
    for i, p in enumerate(parents):
        paths.append([i] if p == ROOT else [*paths[p], i])
    return paths


def is_chain(parents: list[int]) -> bool:
    return all(p == i - 1 for i, p in enumerate(parents))


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
    # one node of a token tree a proposer drafts level by level (engine/spec_decode/
    # tree_draft.py): its single token sits at position `start` (the last committed token's
    # plus its depth) and reads, after the committed tokens, the keys at these positions of
    # the block table (its ancestors', then its own, where its K/V is written)
    tree_keys: tuple[int, ...] | None = None


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
    - `parents` [num_tokens] on the host, per draft its parent in its sequence's token tree:
      ROOT (-1, the last committed token) or the index of an earlier draft of the same
      sequence; None: every sequence's drafts are a chain (draft j's parent is j - 1). A draft
      sits at the position of its last committed token plus its depth (its rotary position)
      and attends to the committed tokens and its own ancestors only; its K/V is written at
      the slot of that position plus its index, and the accepted path's K/V move to their
      positions after verification (`ModelRunner.compact`).
    - `tree_q[i]`: sequence i's q where its drafts are a SAMPLED token tree (children drawn
      from q without replacement, verified by recursive rejection sampling with q): [1 + k, V],
      the root's row, then each node's; None elsewhere.
    - `num_lookahead[i]`: sequence i's last drafts that are lookahead rows (lookahead
      decoding's window, engine/spec_decode/lookahead.py): nodes of its tree that the target
      computes like any draft but the verifier never accepts (their logits feed the proposer).
    """

    def __init__(self, num_draft_tokens: list[int], token_ids: torch.Tensor,
                 host: list[int] | None = None, draft_probs: torch.Tensor | None = None,
                 has_q: list[bool] | None = None, parents: list[int] | None = None,
                 num_lookahead: list[int] | None = None) -> None:
        self.num_draft_tokens = list(num_draft_tokens)
        self.num_lookahead = num_lookahead or [0] * len(self.num_draft_tokens)
        self.offsets = [0, *itertools.accumulate(self.num_draft_tokens)]
        self.token_ids = token_ids
        self.host = host if host is not None else [UNKNOWN] * self.num_tokens
        self.draft_probs = draft_probs
        self.has_q = has_q if has_q is not None else [False] * len(self.num_draft_tokens)
        # per sequence a sampled tree's q ([1 + k, V], `gather`), None: none
        self.tree_q: list[torch.Tensor | None] = [None] * len(self.num_draft_tokens)
        # per sequence its tree and the tree's paths (None: a chain), derived once
        self._trees: list[tuple[list[int], list[list[int]]] | None] = \
            [None] * len(self.num_draft_tokens)
        if parents is not None:
            assert len(parents) == self.num_tokens, "a parent per draft"
            for i, (a, b) in enumerate(zip(self.offsets, self.offsets[1:])):
                check_tree(parents[a:b])  # built checked: a bad tree here is a bug
                if not is_chain(parents[a:b]):
                    self._trees[i] = (parents[a:b], tree_paths(parents[a:b]))
            if not any(self._trees):
                parents = None  # chains only: the plain layout
        self.parents = parents

    @classmethod
    def gather(cls, per_seq: list[tuple[list[int] | torch.Tensor, torch.Tensor | None]],
               device: torch.device, trees: list[list[int] | None] | None = None,
               num_lookahead: list[int] | None = None,
               tree_q: list[torch.Tensor | None] | None = None) -> "Drafts":
        """Drafts from each sequence's (ids, q): ids on the host (a list) or on the device
        ([k] long); q [k, V] where it is read, else None. trees: per sequence its drafts'
        parents, None for a chain (all None: chains); num_lookahead: per sequence its last
        drafts that are lookahead rows (None: none); tree_q: per sequence a sampled tree's q
        ([1 + k, V]: the root's row, then each node's; None: one-hot or verified by pick)."""
        num = [len(ids) for ids, _ in per_seq]
        host = [t for ids, _ in per_seq
                for t in (ids if isinstance(ids, list) else [UNKNOWN] * len(ids))]
        parents = None
        if trees is not None and any(t is not None for t in trees):
            parents = [p for tree, k in zip(trees, num)
                       for p in (tree if tree is not None else range(-1, k - 1))]
        drafts = cls(num, to_device(host, torch.long, device), host,
                     has_q=[q is not None and k > 0 for (_, q), k in zip(per_seq, num)],
                     parents=parents, num_lookahead=num_lookahead)
        held = [(i, ids) for i, (ids, _) in enumerate(per_seq)
                if isinstance(ids, torch.Tensor) and len(ids)]
        if held:  # the ids only the device holds, into their places
            rows = [r for i, _ in held for r in range(drafts.offsets[i], drafts.offsets[i + 1])]
            drafts.token_ids.index_copy_(0, to_device(rows, torch.long, device),
                                         torch.cat([ids for _, ids in held]))
        drafts.tree_q = tree_q or [None] * len(per_seq)
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

    def parents_of(self, i: int) -> list[int] | None:
        """Sequence i's token tree (its drafts' parents), or None where its drafts are a
        chain."""
        tree = self._trees[i]
        return None if tree is None else tree[0]

    def paths_of(self, i: int) -> list[list[int]] | None:
        """Sequence i's tree's paths (`tree_paths`), or None for a chain."""
        tree = self._trees[i]
        return None if tree is None else tree[1]

    def num_verified(self, i: int) -> int:
        """Sequence i's drafts that are verified (its lookahead rows are not)."""
        return self.num_draft_tokens[i] - self.num_lookahead[i]

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
