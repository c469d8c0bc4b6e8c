"""The verifier: from one target forward's logits to the tokens each sequence emits.

Must not schedule, propose or commit: it reads the step's sequences, their logits rows and the
step's `Drafts`, and returns tokens (and logprobs) for the scheduler to commit.

A sequence that verifies k drafts owns k + 1 logits rows (k = 0 is plain sampling): the row of
its last committed token, then one per draft. Each row is processed by `sampler.process_logits`
(grammar mask, penalties, temperature, top-k/p, min-p); then per sequence either its drafts are
verified by pick (`row_spec.by_pick`: greedy, or coupled seeded sampling) or by rejection
sampling against q (engine/sample/rejection_sampler.py, terms defined there). A sequence whose
drafts are a token tree owns a row per node (after its last committed token's); a node's row is
processed as the position after its path (its depth, its path's tokens as history), and the
tree is verified by `tree_verify`: the accepted path's tokens, and its end node for the engine
to move the path's K/V into place. Everything runs on
the device; the host reads the step's tokens and logprobs in ONE transfer (engine/device_io.py).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

import numpy as np
import torch

from engine import device_io
from engine.batch import Drafts, is_chain
from engine.sample import rejection_sampler, sampler
from engine.sample.rejection_sampler import TreeOwners
from engine.sample.row_spec import by_pick, row_spec
from engine.sequence import Sequence


class GrammarMasks(NamedTuple):
    rows: list[int]  # the step's constrained rows
    allowed: Future  # -> [len(rows), V] bool


class Verified(NamedTuple):
    """Per sequence of the step: its emitted tokens (accepted drafts + one sampled token; []
    for a prompt chunk that samples nothing), their logprobs (None unless asked for), and the
    device mark of the step's end (None on CUDA when nothing was sampled: no read); per
    sequence that verified a token tree, its accepted path's nodes (root first; [] for none),
    None for the others."""

    tokens: list[list[int]]
    logprobs: list[list | None]
    ended: object
    paths: list[list[int] | None] | None = None
    # per sequence with lookahead rows: the target's argmax at each (read with the tokens:
    # the windows' next level, Speculator.verified); None without any
    window: list[list[int] | None] | None = None


def _per_owner(owners: list["_Owner"], picks: list[int], seqs: list[Sequence]
               ) -> list[list[int] | None]:
    """The lookahead rows' picks (in the owners' order) split per sequence."""
    out: list[list[int] | None] = [None for _ in seqs]
    at = 0
    for o in owners:
        n = o.k - o.kv
        if n:
            out[o.index], at = picks[at:at + n], at + n
    return out


class _Owner(NamedTuple):
    """A sequence that owns logits rows: `k` drafts, rows first_row .. + k, of which the first
    `kv` are verified (the rest: lookahead rows, `Drafts.num_lookahead`)."""

    index: int  # in the step's sequences
    seq: Sequence
    first_row: int
    k: int
    kv: int

    def tree(self, drafts: Drafts) -> list[int] | None:
        """Its verified drafts' token tree, None for a chain (or none)."""
        parents = drafts.parents_of(self.index) if self.kv else None
        return None if parents is None or is_chain(parents[:self.kv]) else parents[:self.kv]


class Verifier:
    def __init__(self, vocab_size: int, device: torch.device, seed: int, coupled: bool,
                 marks: device_io.Marks) -> None:
        """coupled: seeded sampled requests are verified by the target's keyed pick (their
        output is then exactly plain sampling's); otherwise by rejection sampling."""
        self.vocab_size, self.device, self.coupled = vocab_size, device, coupled
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.marks = marks
        self.settings = sampler.SettingsCache()
        self._mask_thread: ThreadPoolExecutor | None = None

    def grammar_masks(self, seqs: list[Sequence], num_rows: list[int],
                      drafts: Drafts | None) -> GrammarMasks | None:
        """Start computing the grammar masks of the step's constrained rows (the last committed
        token and each draft of a sequence with a grammar; a token tree's node after its path)
        in a thread: llguidance releases the GIL, so they overlap the target's forward.
        num_rows: per sequence its rows."""
        rows, index, row = [], [], 0
        for i, (seq, n) in enumerate(zip(seqs, num_rows)):
            if n and seq.matcher is not None:
                pending = drafts.host_of(i) if drafts is not None else []
                tree = drafts.paths_of(i) if drafts is not None and n > 1 else None
                if tree is None:
                    rows += [(seq.matcher, pending[:j]) for j in range(n)]
                else:  # a token tree's node: the grammar after its path
                    rows.append((seq.matcher, []))
                    rows += [(seq.matcher, [pending[a] for a in path]) for path in tree]
                index += range(row, row + n)
            row += n
        if not rows:
            return None
        if self._mask_thread is None:
            self._mask_thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        grammars = next(s.grammars for s in seqs if s.matcher is not None)
        return GrammarMasks(index, self._mask_thread.submit(grammars.allowed, rows, self.device))

    def verify(self, seqs: list[Sequence], logits: torch.Tensor, row_offsets: list[int],
               drafts: Drafts | None, masks: GrammarMasks | None = None) -> Verified:
        """logits: [R, V] raw; sequence i owns rows row_offsets[i] : row_offsets[i + 1]."""
        owners = [_Owner(i, seq, lo, hi - lo - 1,
                         hi - lo - 1 - (drafts.num_lookahead[i] if drafts is not None else 0))
                  for i, (seq, lo, hi) in enumerate(zip(seqs, row_offsets, row_offsets[1:]))
                  if hi > lo]
        tokens: list[list[int]] = [[] for _ in seqs]
        logprobs: list[list | None] = [None for _ in seqs]
        if not owners:  # nothing to read: the host clock knows the end, CUDA's does not
            return Verified(tokens, logprobs, None if self.marks.cuda else self.marks.mark())
        rows: list[sampler.RowSpec] = []  # each owner's k + 1 rows
        for o in owners:
            host = drafts.host_of(o.index) if o.k else None
            tree = drafts.paths_of(o.index) if o.k else None
            if tree is None:
                rows += [row_spec(o.seq, j, host) for j in range(o.k + 1)]
            else:  # a node's row follows its path: its position, its history
                assert host is not None, "a token tree's drafts are on the host"
                rows.append(row_spec(o.seq, 0, host))
                rows += [row_spec(o.seq, len(path), [host[a] for a in path]) for path in tree]
        emitted, nodes = self._emitted(owners, rows, logits, drafts, masks)
        lp = self._logprob_tensors(owners, emitted, logits, drafts)
        window_rows = [] if drafts is None else [
            r for o in owners for r in range(o.first_row + 1 + o.kv, o.first_row + 1 + o.k)]
        window = (logits.index_select(0, device_io.to_device(window_rows, torch.long,
                                                             self.device)).argmax(dim=-1)
                  if window_rows else None)
        ended = self.marks.mark()
        host = device_io.lists(emitted, nodes, window, *(lp or (None, None, None)))
        emitted_lists = rejection_sampler.to_lists(host[0])
        paths: list[list[int] | None] | None = None if nodes is None else [None for _ in seqs]
        if paths is not None:  # (a verified chain's accepted nodes are its first ones)
            for o, node, toks in zip(owners, host[1], emitted_lists):
                tree = drafts.paths_of(o.index) if o.k else None
                if tree is not None:
                    paths[o.index] = tree[node] if node >= 0 else list(range(len(toks) - 1))
        for o, toks, lps in zip(owners, emitted_lists,
                                self._logprobs(owners, emitted_lists, host[3:], paths)):
            tokens[o.index], logprobs[o.index] = toks, lps
        return Verified(tokens, logprobs, ended, paths,
                        None if window is None else _per_owner(owners, host[2], seqs))

    def _emitted(self, owners: list[_Owner], rows: list[sampler.RowSpec], logits: torch.Tensor,
                 drafts: Drafts | None, masks: GrammarMasks | None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """On the device: [B, max k + 1] per owner its emitted tokens, padded with
        PLACEHOLDER; and, where some owners verify token trees, [B] each one's accepted path's
        last node (-1: none; chains' entries unused), else None."""
        allowed = None if masks is None else (masks.rows, masks.allowed.result())
        tensors = sampler.build_sampling_tensors(rows, self.vocab_size, self.device, allowed,
                                                 self.settings)
        processed = sampler.process_logits(logits, tensors)
        if not any(o.k for o in owners):  # no speculation this step: one vectorized draw
            return sampler.sample(processed, tensors, self.generator)[:, None], None

        picked = np.array([by_pick(o.seq.params, self.coupled) for o in owners])
        per_row = np.repeat(np.arange(len(owners)), [o.k + 1 for o in owners])  # its owner
        # the target's own pick at every row verified by pick: a keyed race for coupled
        # sampled rows, the argmax for the rest (never read for rows verified by rejection)
        greedy = np.array([o.seq.params.greedy for o in owners])
        picks = sampler.sample(processed, tensors, race=(picked & ~greedy)[per_row].tolist())
        verified = [o.tree(drafts) for o in owners]
        tree = np.array([t is not None for t in verified])
        if not tree.any() and not any(drafts.num_lookahead):
            return self._chains(owners, rows, processed, picks, drafts, picked), None
        chain, trees = np.nonzero(~tree)[0], np.nonzero(tree)[0]
        starts = np.cumsum([0] + [o.k + 1 for o in owners])  # each owner's first spec row
        keyed = [owners[i].seq.params.seed is not None and not picked[i] for i in trees]
        parts = []
        if len(trees):
            tree_out, nodes = rejection_sampler.tree_verify(
                drafts.token_ids, picks,
                None if picked[trees].all() else torch.softmax(processed, dim=-1),
                TreeOwners([owners[i].first_row for i in trees],
                           [drafts.offsets[owners[i].index] for i in trees],
                           [verified[i] for i in trees], picked[trees].tolist(),
                           [[r.noise_key for r in rows[starts[i]:starts[i] + owners[i].kv + 1]]
                            if kd else None for i, kd in zip(trees, keyed)],
                           [None if drafts.tree_q[owners[i].index] is None
                            else drafts.tree_q[owners[i].index][:owners[i].kv + 1]
                            for i in trees]),
                self.generator)
            parts.append((trees, tree_out))
        if len(chain):
            parts.append((chain, self._chain_part([owners[i] for i in chain], rows, processed,
                                                  picks, drafts, picked[chain])))
        out = torch.full((len(owners), max(t.shape[1] for _, t in parts)),
                         rejection_sampler.PLACEHOLDER, dtype=torch.long, device=self.device)
        for which, t in parts:
            out[device_io.to_device(which, torch.long, self.device), :t.shape[1]] = t
        node = torch.full((len(owners),), -1, dtype=torch.long, device=self.device)
        if len(trees):
            node[device_io.to_device(trees, torch.long, self.device)] = nodes
        return out, node

    def _chain_part(self, owners: list[_Owner], rows: list[sampler.RowSpec],
                    processed: torch.Tensor, picks: torch.Tensor, drafts: Drafts,
                    picked: np.ndarray) -> torch.Tensor:
        """The chains of a step that also verifies trees or holds lookahead rows: their
        verified rows and drafts gathered as one smaller step of chains."""
        sub = [o._replace(k=o.kv) for o in owners]
        row_idx = np.concatenate([o.first_row + np.arange(o.k + 1) for o in sub])
        draft_idx = np.concatenate([drafts.offsets[o.index] + np.arange(o.k)
                                    for o in sub]).astype(np.int64)
        index = device_io.to_device(np.concatenate([row_idx, draft_idx]), torch.long,
                                    self.device)
        row_t, draft_t = index[:len(row_idx)], index[len(row_idx):]
        part = Drafts([o.k for o in sub], drafts.token_ids[draft_t],
                      draft_probs=None if drafts.draft_probs is None
                      else drafts.draft_probs[draft_t],
                      has_q=[drafts.has_q[o.index] for o in sub])
        return self._chains([o._replace(index=i) for i, o in enumerate(sub)],
                            [rows[r] for r in row_idx], processed[row_t], picks[row_t], part,
                            picked)

    def _chains(self, owners: list[_Owner], rows: list[sampler.RowSpec],
                processed: torch.Tensor, picks: torch.Tensor, drafts: Drafts,
                picked: np.ndarray) -> torch.Tensor:
        """Chains verified by pick or rejection sampling: [B, max k + 1] emitted tokens."""
        per_row = np.repeat(np.arange(len(owners)), [o.k + 1 for o in owners])
        # rows verified by pick only need their picks, which the processed logits already gave
        target = processed if picked.all() else torch.softmax(processed, dim=-1)
        # seeded sequences verified by rejection: their rows' noise keys (none: no keys)
        keyed = np.array([o.seq.params.seed is not None for o in owners]) & ~picked
        noise_keys = np.array([r.noise_key if keyed[o] else rejection_sampler.NO_KEY
                               for r, o in zip(rows, per_row)], dtype=np.int64) \
            if keyed.any() else None
        has_q = np.array([drafts.has_q[o.index] for o in owners]) & ~picked
        return rejection_sampler.rejection_sample(
            drafts.token_ids, [o.k for o in owners], target, picked,
            draft_probs=drafts.draft_probs, has_q=has_q, noise_keys=noise_keys,
            default_generator=self.generator, picks=picks)

    def _logprob_tensors(self, owners: list[_Owner], emitted: torch.Tensor,
                         logits: torch.Tensor, drafts: Drafts | None
                         ) -> tuple[torch.Tensor, ...] | None:
        """On the device, the logprobs at every row of the owners that asked for them, of the
        token emitted there (rows after the last emitted token are computed and dropped). A
        token tree's node row is read with the token emitted at its depth: right where the
        node is on the accepted path, and dropped where it is not (`_logprobs`)."""
        rows, at_owner, at_index, top = [], [], [], 0
        for b, o in enumerate(owners):
            if o.seq.params.logprobs is not None:  # (its verified drafts' rows)
                rows += range(o.first_row, o.first_row + o.kv + 1)
                at_owner += [b] * (o.kv + 1)
                tree = drafts.paths_of(o.index) if o.tree(drafts) is not None else None
                at_index += range(o.kv + 1) if tree is None else [0, *map(len, tree[:o.kv])]
                top = max(top, o.seq.params.logprobs)
        if not rows:
            return None
        index = device_io.to_device([rows, at_owner, at_index], torch.long, self.device)
        tokens = emitted[index[1], index[2]].clamp(min=0)  # PLACEHOLDER rows: dropped later
        return sampler.logprob_tensors(logits[index[0]], tokens, top)

    @staticmethod
    def _logprobs(owners: list[_Owner], emitted: list[list[int]], host: list,
                  paths: list[list[int] | None] | None) -> list[list | None]:
        """Per owner, the logprobs of its emitted tokens (None unless it asked for them), from
        the host lists of `_logprob_tensors` (a token tree's: its root's row, then its
        accepted path's nodes' rows)."""
        if host[0] is None:
            return [None] * len(owners)
        chosen, vals, ids = host
        result: list[list | None] = []
        at = 0  # the owner's first row in the host lists
        for o, toks in zip(owners, emitted):
            n = o.seq.params.logprobs
            if n is None:
                result.append(None)
                continue
            m = len(toks)
            path = paths[o.index] if paths is not None else None
            pick = range(at, at + m) if path is None else [at, *(at + 1 + a for a in path)]
            result.append(sampler.logprob_entries([chosen[r] for r in pick],
                                                  [vals[r] for r in pick],
                                                  [ids[r] for r in pick], [n] * m))
            at += o.kv + 1
        return result
