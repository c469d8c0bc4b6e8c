"""EAGLE proposer: drafts with a head (engine/spec_decode/eagle.py) from the target's hidden states.

Must not schedule or verify. It owns the head, its paged KV (one layer, over the SAME block ids
as the target, like the draft model's) and the target features not yet consumed. The target's
runner returns the captured layers' outputs at every token it computed (`StepLogits.hidden`);
the speculator hands them over after the target pass (`keep_features`), and the rows whose KV
the target keeps after verification (positions below `num_computed_tokens`) are the head's
input. The head's row for the token at position q reads that token and the target's feature
at q - 1 (a zero one for q = 0), and sits at position q (its K/V in q's slot). `seq.num_draft_computed`
counts the positions whose head rows are computed from the target's features: after a
proposal num_tokens (the chained rows drafted on the head's own output are rewritten next step).

One `propose` call = k head forwards: the first runs each sequence's new rows (its prompt, or
the tokens the last verification accepted plus the bonus token) and drafts token 1 from the
last of them; each further forward drafts one more token from the previous row's output h and
the token it drafted. Rows are sampled from q = the head's processed distribution over the
target's vocabulary (-inf outside the draft vocabulary, so q = 0 there and the rejection
sampler stays exact), as the draft model's are.

A prefix-cache hit: the target computes no feature for the cached positions, and their blocks
are shared, so the head keeps the rows those blocks hold and never writes there; its first row
after the hit lacks the feature before it and is computed from its token with a zero feature
(`rows_without_features` counts such rows). The output stays exact whatever the head's rows
hold. Sequences that do not draft run no head row: their rows wait, like a draft model's
catch-up, until the guard drafts for them again (it prices the catch-up,
engine/spec_decode/guard.py). Their features wait with them: a prompt's until its first
proposal (PROMPT_WAIT_ROWS at most), then at most WAIT_ROWS per sequence (the newest): a row
whose feature was dropped is computed from its token with a zero feature, as after a
prefix-cache hit (`rows_without_features`). So the head rows a cached block holds are those of
the request that cached it only where that request drafted up to there (a block it filled while
left plain holds whatever the head last wrote into it): a prefix-cache hit on such a block gives
the head a poorer context, and fewer accepted drafts, never a different output.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from engine import device_io
from engine.attention import paged
from engine.block_manager import BlockManager
from engine.device_io import Marks, to_device
from engine.batch import RunItem, StepLogits
from engine.sequence import Sequence
from engine.spec_decode import tree_draft
from engine.spec_decode.draft_model import DraftSampler
from engine.spec_decode.eagle import EagleHead
from engine.spec_decode.proposer import Proposal, Proposer

# a sequence not drafting keeps the features of its newest this many rows (the 1.5B target's
# three captured layers: 9 KiB a row in bf16, 2.3 MiB a sequence); its head rows wait with them
WAIT_ROWS = 256
# a prompt's rows wait for its first proposal up to this many (36 MiB for the 1.5B target):
# a longer prompt's oldest rows are computed with zero features, as after a prefix-cache hit
PROMPT_WAIT_ROWS = 4096


def _compact(rows: torch.Tensor) -> torch.Tensor:
    """`rows` (a view of kept features), copied once it holds less than half of a storage of
    more than WAIT_ROWS rows: a long prompt's chunk trimmed to its newest rows must not keep
    the whole alive (a copy at each halving), while a decode step's few rows, trimmed after
    most verifications, are left as they are (their storage is small)."""
    storage = rows.untyped_storage().nbytes()
    if storage > max(2 * rows.nbytes, WAIT_ROWS * rows.shape[-1] * rows.element_size()):
        return rows.clone()
    return rows


class EagleProposer(Proposer):
    trees = True
    sampled_trees = True
    method = "eagle"

    def __init__(self, head: EagleHead, target: torch.nn.Module, block_manager: BlockManager,
                 target_vocab_size: int, attention_backend: str = "sdpa", *, seed: int = 0,
                 coupled: bool = True, stop_confidence: float = 0.0) -> None:
        self.head = head
        self.embed = target.get_input_embeddings()
        self.device = next(head.parameters()).device
        self.dtype = next(head.parameters()).dtype
        c = head.config
        self.kv = paged.PagedKVCache(1, block_manager.num_blocks, block_manager.block_size,
                                     c.num_kv_heads, c.head_dim, self.dtype, self.device,
                                     _backend(attention_backend, self.device, self.dtype,
                                              c.head_dim))
        self.block_manager = block_manager
        self.target_vocab_size = target_vocab_size
        self.sampler = DraftSampler(target_vocab_size, self.device, seed, coupled,
                                    stop_confidence)
        # request id -> [(first position, [rows, features])], contiguous, ascending
        self._features: dict[str, list[tuple[int, torch.Tensor]]] = {}
        # request id -> the first position the target computed a feature at (after a
        # prefix-cache hit: the first uncached one; rows before it are the shared blocks')
        self._start: dict[str, int] = {}
        # request id -> (position, g) of its last head row (to run it again: see _catch_up_rows)
        self._last: dict[str, tuple[int, torch.Tensor]] = {}
        self.rows_without_features = 0

    # -- features ---------------------------------------------------------------------------
    def keep_features(self, entries: list[tuple[Sequence, int, int]],
                      hidden: torch.Tensor) -> None:
        """entries: per item of the target's forward, (sequence, first position, new tokens),
        in the order of `hidden`'s rows ([tokens, features])."""
        offset = 0
        for seq, start, n in entries:
            if seq.params.speculative:
                rid = seq.request_id
                chunks = self._features.setdefault(rid, [])
                self._start.setdefault(rid, start)
                # what a verification rejected (at start and after) is replaced
                while chunks and chunks[-1][0] >= start:
                    chunks.pop()
                if chunks and chunks[-1][0] + len(chunks[-1][1]) > start:
                    p, t = chunks[-1]
                    chunks[-1] = (p, _compact(t[:start - p]))
                # a copy: a view would keep the whole step's tensor alive
                chunks.append((start, hidden[offset:offset + n].clone()))
                # (a prompt's rows wait for its first proposal, PROMPT_WAIT_ROWS at most; a
                # decoding sequence the guard leaves plain keeps its newest WAIT_ROWS)
                excess = self.waiting_rows(seq) - (
                    WAIT_ROWS if start >= seq.num_prompt_tokens else PROMPT_WAIT_ROWS)
                while excess > 0:  # the oldest go (their rows get zero features)
                    p, t = chunks[0]
                    if len(t) <= excess:
                        chunks.pop(0)
                        excess -= len(t)
                    else:
                        chunks[0] = (p + excess, _compact(t[excess:]))
                        excess = 0
            offset += n

    def _take_features(self, seq: Sequence, lo: int, hi: int) -> torch.Tensor:
        """[hi - lo, features]: the target's features at positions lo..hi - 1 (zero where it
        computed none), and forget those before hi."""
        out = torch.zeros((hi - lo, self.head.config.feature_size), dtype=self.dtype,
                          device=self.device)
        missing = hi - max(lo, 0)  # (position -1: the first token's row has none, by design)
        kept = []
        for p, t in self._features.get(seq.request_id, []):
            a, b = max(p, lo), min(p + len(t), hi, seq.num_computed_tokens)
            if a < b:
                out[a - lo:b - lo] = t[a - p:b - p]
                missing -= b - a
            if p + len(t) > hi:
                kept.append((max(p, hi), _compact(t[max(hi - p, 0):])))
        self._features[seq.request_id] = kept
        self.rows_without_features += missing
        return out

    def _first_row(self, seq: Sequence) -> int:
        """The first position whose head row is due: after the computed ones, and never before
        the first position the target computed features for (a prefix-cache hit's shared
        blocks keep their rows)."""
        # (the token at 0 has no feature before it: a zero one)
        return max(seq.num_draft_computed, self._start.get(seq.request_id, 0))

    def waiting_rows(self, seq: Sequence) -> int:
        """Rows of features kept for the sequence (its chunks are contiguous)."""
        chunks = self._features.get(seq.request_id)
        if not chunks:
            return 0
        return chunks[-1][0] + len(chunks[-1][1]) - chunks[0][0]

    def backlog(self, seq: Sequence) -> int:
        return seq.num_tokens - self._first_row(seq)

    def forget(self, seq: Sequence) -> None:
        self._features.pop(seq.request_id, None)
        self._start.pop(seq.request_id, None)
        self._last.pop(seq.request_id, None)

    # -- head forwards ------------------------------------------------------------------------
    def _forward(self, rows: list["_Rows"], keep_last: bool
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One head forward; returns h at each item's last row [S, H] and, with keep_last,
        the logits there over the target's vocabulary [S, V]."""
        bs = self.block_manager.block_size
        tokens, positions, slots, spans, g, last = [], [], [], [], [], []
        for table, prompt_len, ids, start, gs, tree_keys in rows:
            n = len(ids)
            # a tree node's K/V sits in the slot of its own key (its last), not its position's
            at = range(start, start + n) if tree_keys is None else tree_keys[-1:]
            spans.append(paged.SeqSpan(len(tokens), n, start + n, table, prompt_len,
                                       tree_keys=tree_keys))
            tokens += ids
            positions += range(start, start + n)
            slots += [table[p // bs] * bs + p % bs for p in at]
            g.append(gs)
            last.append(len(tokens) - 1)
        dev = self.device
        pos = to_device(positions, torch.long, dev)
        meta = self.kv.backend.build_metadata(spans, slots, bs, dev)
        embeddings = self.embed(to_device(tokens, torch.long, dev)).to(self.dtype)
        with self.kv.step(meta):
            h = self.head.paged(embeddings, torch.cat(g) if len(g) > 1 else g[0], pos)
        h_last = h[to_device(last, torch.long, dev)]
        if not keep_last:
            return h_last, None
        scores = self.head.logits(h_last).float()
        out = torch.full((len(rows), self.target_vocab_size), float("-inf"),
                         dtype=scores.dtype, device=dev)
        out[:, self.head.vocab] = scores
        return h_last, out

    def _catch_up_rows(self, seq: Sequence, hi: int) -> "_Rows":
        """The sequence's head rows from `_first_row` to position hi - 1 (then computed); with
        none due, its last row again (a sequence the step's budget left out drafts again)."""
        lo = self._first_row(seq)
        if lo >= hi:
            at, g = self._last[seq.request_id]
            return _Rows(seq.block_table, seq.num_prompt_tokens, seq.token_ids[at:at + 1], at,
                         g)
        g = self.head.fc(self._take_features(seq, lo - 1, hi - 1))
        seq.num_draft_computed = hi
        self._last[seq.request_id] = (hi - 1, g[-1:])
        return _Rows(seq.block_table, seq.num_prompt_tokens, seq.token_ids[lo:hi], lo, g)

    @torch.inference_mode()
    def execute(self, items: list[RunItem]) -> StepLogits:
        """A head forward over `items` with zero features, timed by start-up calibration like
        a runner's forward (a head step's cost does not depend on its inputs)."""
        zeros = [torch.zeros((len(it.token_ids), self.head.config.hidden_size),
                             dtype=self.dtype, device=self.device) for it in items]
        _, logits = self._forward([_Rows(it.block_table, it.prompt_len, it.token_ids, it.start,
                                         g) for it, g in zip(items, zeros)], keep_last=True)
        return StepLogits(logits, list(range(len(items) + 1)))

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int]) -> Proposal:
        ks = [self._reserve(s, k) for s, k in zip(seqs, ks)]
        active = [i for i, k in enumerate(ks) if k > 0]
        drafts: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        marks, forwards = Marks(self.device), []
        rows = [self._catch_up_rows(seqs[i], seqs[i].num_tokens) for i in active]
        step = 0
        while active:
            start = marks.mark()
            h, logits = self._forward(rows, keep_last=True)
            specs = [self.sampler.row(seqs[i], len(drafts[i]), drafts[i]) for i in active]
            sampled, q, confident = self.sampler.draft_token(
                logits, specs, any(ks[i] > step + 1 for i in active))
            forwards.append((sum(len(r.token_ids) for r in rows), len(rows), start,
                             marks.mark()))
            tokens, sure = device_io.lists(sampled, confident)
            step += 1
            go_on = []
            for j, i in enumerate(active):
                drafts[i].append(tokens[j])
                if q is not None:
                    probs[i].append(q[j])
                if ks[i] > step and (sure is None or sure[j]):
                    go_on.append(j)
            rows = [_Rows(seqs[active[j]].block_table, seqs[active[j]].num_prompt_tokens,
                          [tokens[j]], seqs[active[j]].num_tokens - 1 + step, h[j:j + 1])
                    for j in go_on]
            active = [active[j] for j in go_on]
        return Proposal(drafts, [torch.stack(p) if p and len(p) == len(d) else None
                                 for p, d in zip(probs, drafts)], forwards, marks)

    @torch.inference_mode()
    def propose_tree(self, seqs: list[Sequence], depths: list[int], max_nodes: list[int],
                     width: int, min_prob: float, min_level: float = 0.0) -> Proposal:
        """EAGLE-2's dynamic token trees (tree_draft.py), at most depths[i] levels and
        max_nodes[i] nodes: a node's row reads its token and its parent's h."""
        depths = tree_draft.reserve_depths(self._reserve, seqs, depths, max_nodes, width)
        return tree_draft.grow(self, self.sampler, seqs, depths, max_nodes, width, min_prob,
                               min_level)

    @torch.inference_mode()
    def propose_sampled_tree(self, seqs: list[Sequence], shapes: list[list[int]],
                             acceptance: list[float]) -> Proposal:
        """Sampled token trees of the given shapes (tree_draft.py `grow_sampled`), for
        requests verified by rejection sampling."""
        shapes = tree_draft.reserve_shapes(self._reserve, seqs, shapes)
        return tree_draft.grow_sampled(self, self.sampler, seqs, shapes, acceptance)

    def first_forward(self, seqs: list[Sequence]) -> tuple[torch.Tensor, list, int]:
        rows = [self._catch_up_rows(s, s.num_tokens) for s in seqs]
        h, logits = self._forward(rows, keep_last=True)
        return logits, list(h.split(1)), sum(len(r.token_ids) for r in rows)

    def node_forward(self, rows: list[tuple[Sequence, tree_draft.Node]]
                     ) -> tuple[torch.Tensor, list]:
        h, logits = self._forward([_Rows(s.block_table, s.num_prompt_tokens, [n.token],
                                         s.num_tokens - 1 + n.depth, n.state, n.keys())
                                   for s, n in rows], keep_last=True)
        return logits, list(h.split(1))

    def _reserve(self, seq: Sequence, k: int) -> int:
        """Reserve the slots the head writes (positions up to num_tokens + k - 2); shrink k if
        the pool is short; 0 for a sequence with no head row to run."""
        last = self._last.get(seq.request_id)
        if seq.num_tokens <= self._first_row(seq) and (
                last is None or last[0] != seq.num_tokens - 1):
            return 0
        while k > 0 and not self.block_manager.allocate(seq, seq.num_tokens + k - 1):
            k -= 1
        return k


class _Rows(NamedTuple):
    """One sequence's rows of a head forward."""

    block_table: list[int]
    prompt_len: int | None
    token_ids: list[int]  # the tokens at the rows' positions
    start: int  # the first row's position
    g: torch.Tensor  # [rows, hidden] fused target features (or the previous row's h)
    # a token tree's node (one row): the slots of its keys after the committed tokens' (its
    # ancestors', then its own), as positions of the sequence's block table
    tree_keys: tuple[int, ...] | None = None


def _backend(name: str, device: torch.device, dtype: torch.dtype, head_dim: int
             ) -> paged.AttentionBackend:
    if name == "triton":
        from engine.attention.triton_backend import TritonBackend

        return TritonBackend(0)
    row_kernel = (device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
                  and head_dim % 16 == 0 and head_dim <= 256)
    return paged.SDPABackend(row_kernel=row_kernel)
