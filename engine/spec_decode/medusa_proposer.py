"""Medusa proposer: drafts with Medusa heads (engine/spec_decode/medusa.py) from the target's last
hidden state, in one small forward and no KV of its own.

Must not schedule or verify. It keeps, per request, the target's last-layer outputs of the last
rows the target computed (`keep_features`: the committed tokens' and, for a token tree, the
accepted path's, in position order; a chain's rejected drafts' rows come after and are never
read). A sequence of n tokens drafts from the row at position n - 2 (the one whose logits gave
token n - 1): head j guesses the token at n + j. A chain takes each head's best token; a tree
takes the stored sparse tree's paths of ranks (pruned to the nodes and depth the guard allows,
and to paths at least `min_prob` likely by the heads' measured accuracies). Drafts are
deterministic (one-hot q): the verifier picks (greedy, coupled seeded) or rejection-samples
them (a sampled request: a draft x is accepted with the target's probability of x), so the
output keeps the target's distribution either way. There is nothing to catch up on: a
sequence that did not draft for a while drafts from its latest row.
"""

from __future__ import annotations

import torch

from engine import device_io
from engine.device_io import Marks
from engine.sequence import Sequence
from engine.spec_decode.medusa import MedusaHeads, choose_tree, default_accuracy, path_chance
from engine.spec_decode.proposer import Proposal, Proposer

KEEP_ROWS = 64  # rows of the last target pass kept per request (positions from its end)


class MedusaProposer(Proposer):
    trees = True
    method = "medusa"

    def __init__(self, heads: MedusaHeads) -> None:
        self.heads = heads
        self.device = heads.norm.weight.device
        c = heads.config
        self.accuracy = c.accuracy or default_accuracy(c.num_heads)
        self.tree = c.tree or choose_tree(self.accuracy)
        self.chances = [path_chance(self.accuracy, p) for p in self.tree]
        self.ranks = 1 + max(r for p in self.tree for r in p)
        self._rows: dict[str, tuple[int, torch.Tensor]] = {}  # id -> (first position, rows)

    @property
    def num_heads(self) -> int:
        return self.heads.config.num_heads

    def keep_features(self, entries: list[tuple[Sequence, int, int]],
                      hidden: torch.Tensor) -> None:
        offset = 0
        for seq, start, n in entries:
            if seq.params.speculative:
                keep = min(n, KEEP_ROWS)  # a copy: a view would keep the step's tensor alive
                self._rows[seq.request_id] = (start + n - keep,
                                              hidden[offset + n - keep:offset + n].clone())
            offset += n

    def forget(self, seq: Sequence) -> None:
        self._rows.pop(seq.request_id, None)

    def backlog(self, seq: Sequence) -> int:
        return 0

    def _row(self, seq: Sequence) -> torch.Tensor | None:
        """The target's output at position num_tokens - 2, where the last pass computed it."""
        first, rows = self._rows.get(seq.request_id, (0, None))
        at = seq.num_tokens - 2 - first
        return rows[at] if rows is not None and 0 <= at < len(rows) else None

    def _scores(self, seqs: list[Sequence], ranks: int
                ) -> tuple[list[int], list[list[list[int]]] | None, Marks, list]:
        """The sequences that have their row, and per such sequence per head its `ranks` best
        target ids, from one forward of the heads."""
        have = [i for i, s in enumerate(seqs) if self._row(s) is not None]
        marks = Marks(self.device)
        if not have:
            return have, None, marks, []
        start = marks.mark()
        x = torch.stack([self._row(seqs[i]) for i in have]).to(self.heads.norm.weight.dtype)
        ids = self.heads.vocab[self.heads(x).topk(ranks, dim=-1).indices]  # [S, K, ranks]
        forwards = [(len(have), len(have), start, marks.mark())]
        return have, device_io.lists(ids)[0], marks, forwards

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int]) -> Proposal:
        have, ids, marks, forwards = self._scores(seqs, 1)
        drafts: list[list[int]] = [[] for _ in seqs]
        for j, i in enumerate(have):
            drafts[i] = [ids[j][h][0] for h in range(min(ks[i], self.num_heads))]
        return Proposal(drafts, [None] * len(seqs), forwards, marks)

    @torch.inference_mode()
    def propose_tree(self, seqs: list[Sequence], depths: list[int], max_nodes: list[int],
                     width: int, min_prob: float, min_level: float = 0.0) -> Proposal:
        """The stored tree's first nodes within depths[i] levels, max_nodes[i] nodes and at
        least `min_prob` likely (a node's chance is no more than its parent's, so what is
        kept is a tree); `width` and `min_level` do not apply (one forward drafts every
        level)."""
        have, ids, marks, forwards = self._scores(seqs, self.ranks)
        out_ids: list[list[int]] = [[] for _ in seqs]
        parents: list[list[int]] = [[] for _ in seqs]
        confidence: list[list[float]] = [[] for _ in seqs]
        for j, i in enumerate(have):
            where: dict[tuple[int, ...], int] = {}
            for path, chance in zip(self.tree, self.chances):
                if len(where) >= max_nodes[i]:
                    break
                key = tuple(path)
                if len(path) > depths[i] or chance < min_prob or (
                        len(path) > 1 and key[:-1] not in where):
                    continue
                where[key] = len(out_ids[i])
                out_ids[i].append(ids[j][len(path) - 1][path[-1]])
                parents[i].append(where[key[:-1]] if len(path) > 1 else -1)
                confidence[i].append(chance)
        return Proposal(out_ids, [None] * len(seqs), forwards, marks, parents=parents,
                        confidence=confidence)
