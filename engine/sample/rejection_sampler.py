"""The verifier: exact speculative sampling over flattened tensors. A pure function.

Terms, defined once:
- draft tokens: the k_i tokens proposed for sequence i (k_i may be 0), flattened over the batch
  with `num_draft_tokens` giving each sequence's count.
- p: the target's processed distribution at a position; q: the draft's (None = one-hot on the
  draft token, as for n-gram drafts). Both come from `sampler.process_logits` with the same
  settings, so exactness holds for every sampling setting.
- pick: the token the target itself emits at a position without speculation: argmax p_j for a
  greedy sequence, the position-keyed exponential race argmax(p_j / E(seed, t)) for a seeded
  sequence under coupled verification. Such sequences are verified by pick.
- accepted: draft token x at position j is kept with probability min(1, p_j(x) / q_j(x));
  verified by pick: iff x == pick_j. Sequence i keeps the longest accepted prefix.
- recovered token: at the first rejected position j, a token drawn from
  normalize(max(p_j - q_j, 0)); verified by pick: pick_j.
- bonus token: when all k_i drafts are accepted, a token drawn from p at position k_i (the row
  after the last draft); verified by pick: pick_{k_i}.
Every sequence therefore emits (accepted drafts) + 1 tokens, and each emitted token has exactly
the target's distribution (Leviathan et al. 2023; Chen et al. 2023); a sequence verified by pick
emits exactly the tokens it would emit without speculation, whatever the drafts were.

Randomness: uniforms for acceptance and exponential noise for the final draw (the exponential
race argmax(r / E) samples from normalize(r)). A seeded sequence draws them from position-keyed
streams (`keys.noise_key`), so its tokens do not depend on the rest of the batch.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from engine.batch import tree_paths
from engine.device_io import to_device
from engine.sample.keys import ACCEPT, restream
from engine.sample.sampler import exponential_noise, keyed_uniforms

PLACEHOLDER = -1
NO_KEY = -1  # a row without a noise key (unseeded, or verified by pick)


def rejection_sample(
    draft_token_ids: torch.Tensor,  # [num_draft_tokens] long
    num_draft_tokens: list[int],  # [B]
    target_probs: torch.Tensor,  # [num_draft_tokens + B, V]: k_i + 1 rows per sequence. Rows
    #                              of sequences verified by pick are never read.
    by_pick: np.ndarray,  # [B] bool: verified by pick (greedy, or coupled seeded sampling)
    draft_probs: torch.Tensor | None = None,  # [num_draft_tokens, V] q; None: every draft
    #                                           one-hot (n-gram)
    has_q: np.ndarray | None = None,  # [B] bool: the sequence's rows of draft_probs hold its
    #                                   q; False: one-hot on its drafts (rows never read)
    noise_keys: np.ndarray | None = None,  # [num_draft_tokens + B] int64 per target row: the
    #                     noise key of a seeded sequence verified by rejection, NO_KEY elsewhere
    default_generator: torch.Generator | None = None,
    picks: torch.Tensor | None = None,  # [num_draft_tokens + B] long; None: argmax of
    #                                     target_probs (greedy)
) -> torch.Tensor:  # [B, max_k + 1] long: emitted tokens, padded with PLACEHOLDER
    """Verify every sequence's drafts at once (terms in the module docstring): acceptance,
    then the final token, then the output, over the same index grid."""
    grid = _Grid.of(draft_token_ids, num_draft_tokens, by_pick, target_probs)
    picks = target_probs.argmax(dim=-1) if picks is None else picks  # [num rows]
    q = _DraftProbs(draft_probs, has_q, grid)
    keys = _Keys.of(noise_keys, num_draft_tokens, by_pick)
    num_accepted = _num_accepted(grid, target_probs, q, picks, keys, default_generator)
    # -- the final token: recovered at the first rejection, else bonus ------------------------
    final_rows = grid.target_start + num_accepted  # [B]
    final = picks[final_rows]  # by pick: the target's own token, recovered or bonus
    if not by_pick.all():
        dist = target_probs[final_rows]  # [B, V]
        at = num_accepted.clamp(max=max(grid.max_k - 1, 0))[:, None]  # [B, 1] first rejection
        rejected_draft = grid.drafts.gather(1, at) if grid.max_k else at  # [B, 1]
        dist = _recovered_or_bonus(dist.float(), num_accepted < grid.k, rejected_draft,
                                   q.row(at))
        noise = _final_noise(tuple(dist.shape), keys, num_accepted, default_generator)
        final = torch.where(grid.is_pick, final, (dist / noise).argmax(dim=-1))
    return _emitted(grid, num_accepted, final)


class _Grid(NamedTuple):
    """The [B, K] grid of draft positions (K = max k_i) and where each sequence's rows are."""

    device: torch.device
    batch: int
    max_k: int
    k: torch.Tensor  # [B] drafts per sequence
    is_pick: torch.Tensor  # [B] bool: verified by pick
    target_start: torch.Tensor  # [B] each sequence's first target row
    pos: torch.Tensor  # [1, K] draft positions
    d_idx: torch.Tensor  # [B, K] the index of each draft in the flat drafts (clamped)
    drafts: torch.Tensor  # [B, K] the draft tokens (past k_i: another sequence's, never read)
    t_rows: torch.Tensor  # [B, K] the target row of each draft

    @classmethod
    def of(cls, draft_token_ids: torch.Tensor, num_draft_tokens: list[int],
           by_pick: np.ndarray, target_probs: torch.Tensor) -> "_Grid":
        device = target_probs.device
        batch, max_k = len(num_draft_tokens), max(num_draft_tokens, default=0)
        per_seq = to_device([num_draft_tokens, by_pick.tolist()], torch.long, device)
        k, is_pick = per_seq[0], per_seq[1].bool()  # [B] each
        draft_start = torch.cumsum(k, 0) - k  # [B] offset of each sequence's drafts
        target_start = draft_start + torch.arange(batch, device=device)  # [B]
        pos = torch.arange(max_k, device=device)[None, :]  # [1, K]
        d_idx = (draft_start[:, None] + pos).clamp(max=max(draft_token_ids.numel() - 1, 0))
        drafts = draft_token_ids[d_idx] if max_k else torch.zeros((batch, 0), dtype=torch.long,
                                                                   device=device)  # [B, K]
        t_rows = (target_start[:, None] + pos).clamp(max=target_probs.shape[0] - 1)  # [B, K]
        return cls(device, batch, max_k, k, is_pick, target_start, pos, d_idx, drafts, t_rows)


class _Keys(NamedTuple):
    """The seeded sequences verified by rejection (`keyed`, in batch order) and, per such
    sequence, the noise keys of its k + 1 rows."""

    keyed: list[int]
    rows: list[list[int]]
    batch: int

    @classmethod
    def of(cls, noise_keys: np.ndarray | None, num_draft_tokens: list[int],
           by_pick: np.ndarray) -> "_Keys":
        keyed, rows, start = [], [], 0
        for i, (k, pick) in enumerate(zip(num_draft_tokens, by_pick)):
            if noise_keys is not None and not pick and noise_keys[start] != NO_KEY:
                keyed.append(i)
                rows.append(noise_keys[start:start + k + 1].tolist())
            start += k + 1
        return cls(keyed, rows, len(num_draft_tokens))


def _num_accepted(grid: _Grid, target_probs: torch.Tensor, q: "_DraftProbs",
                  picks: torch.Tensor, keys: _Keys,
                  default: torch.Generator | None) -> torch.Tensor:
    """[B] the accepted drafts of each sequence: the longest accepted prefix."""
    if not grid.max_k:
        return torch.zeros(grid.batch, dtype=torch.long, device=grid.device)
    drafts = grid.drafts
    p_x = target_probs[grid.t_rows, drafts]  # [B, K]
    q_x = q.at(drafts, p_x)
    uniform = _uniforms((grid.batch, grid.max_k), keys, default, grid.device)
    # q >= p: accept with probability p/q; q < p: always (uniform < 1 <= p/q)
    sampled_ok = uniform * q_x < p_x
    pick_ok = drafts == picks[grid.t_rows]
    accepted = torch.where(grid.is_pick[:, None], pick_ok, sampled_ok) \
        & (grid.pos < grid.k[:, None])
    return accepted.long().cumprod(dim=1).sum(dim=1)


def _emitted(grid: _Grid, num_accepted: torch.Tensor, final: torch.Tensor) -> torch.Tensor:
    """[B, K + 1]: each sequence's accepted drafts, then its final token, then PLACEHOLDER."""
    out = torch.full((grid.batch, grid.max_k + 1), PLACEHOLDER, dtype=torch.long,
                     device=grid.device)
    if grid.max_k:
        keep = grid.pos < num_accepted[:, None]
        out[:, :grid.max_k] = torch.where(keep, grid.drafts, out[:, :grid.max_k])
    out.scatter_(1, num_accepted[:, None], final[:, None])
    return out


class _DraftProbs:
    """The sequences' q over the [B, K] draft grid; a sequence without q is one-hot on its
    drafts (q(x) = 1 at the draft, 0 elsewhere)."""

    def __init__(self, draft_probs: torch.Tensor | None, has_q: np.ndarray | None,
                 grid: _Grid) -> None:
        self.flat = draft_probs if has_q is not None and has_q.any() else None
        if self.flat is not None:
            self.has = to_device(has_q, torch.bool, grid.device)  # [B]
            self.index = grid.d_idx  # [B, K] each draft's row of q

    def at(self, drafts: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """[B, K] q of each draft token."""
        if self.flat is None:
            return torch.ones_like(like)
        return torch.where(self.has[:, None], self.flat[self.index, drafts], 1.0)

    def row(self, at: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """([B, V] q at each sequence's draft `at` ([B, 1]), [B] whether it has q), or None
        when no sequence has q."""
        if self.flat is None:
            return None
        return self.flat[self.index.gather(1, at)[:, 0]], self.has


def _recovered_or_bonus(p: torch.Tensor, rejected: torch.Tensor, rejected_draft: torch.Tensor,
                        q: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """[B, V] the distribution of each sequence's final token: normalize(max(p - q, 0)) where
    a draft was `rejected` ([B] bool), p itself (the bonus token) where all were accepted.

    p: [B, V] target probabilities at the final row; rejected_draft: [B, 1] the rejected draft
    token; q: ([B, V] its draft probabilities, [B] bool: the sequence has q; one-hot where it
    has not), or None when every sequence's drafts are one-hot.
    """
    residual = p.scatter(1, rejected_draft, 0.0)  # q one-hot on the draft
    if q is not None:
        residual = torch.where(q[1][:, None], (p - q[0]).clamp_min(0.0), residual)
    # a zero residual happens only when p == q numerically (rejection has prob. 0)
    usable = rejected & (residual.sum(dim=-1) > 0)
    return torch.where(usable[:, None], residual, p)


def _uniforms(shape: tuple[int, int], keys: _Keys, default: torch.Generator | None,
              device: torch.device) -> torch.Tensor:
    """[B, K] U(0, 1); a seeded sequence's uniform at each draft position is keyed by it."""
    uniform = torch.rand(shape, generator=default, device=device)
    rows, cols, keyed = [], [], []
    for i, row_keys in zip(keys.keyed, keys.rows):
        k = len(row_keys) - 1
        rows += [i] * k
        cols += range(k)
        keyed += [restream(key, ACCEPT) for key in row_keys[:k]]
    if keyed:
        index = to_device([rows, cols], torch.long, device)
        uniform[index[0], index[1]] = keyed_uniforms(keyed, 1, device)[:, 0]
    return uniform


def _final_noise(shape: tuple[int, int], keys: _Keys, num_accepted: torch.Tensor,
                 default: torch.Generator | None) -> torch.Tensor:
    """[B, V] the exponential noise of each sequence's final draw. A seeded sequence's is keyed
    by the position it lands on, which depends on how many drafts were accepted: the noise of
    each of its k + 1 candidate positions is drawn and the accepted count picks one on the
    device (the host never reads the count)."""
    device = num_accepted.device
    noise = torch.empty(shape, dtype=torch.float32, device=device)
    if len(keys.keyed) < keys.batch:
        noise.exponential_(generator=default)
    if keys.keyed:
        candidates = [key for row_keys in keys.rows for key in row_keys]
        drawn = exponential_noise((len(candidates), shape[1]), candidates, device, None)
        first = np.cumsum([0] + [len(r) for r in keys.rows[:-1]])
        index = to_device([keys.keyed, first], torch.long, device)
        noise[index[0]] = drawn[index[1] + num_accepted[index[0]]]
    return noise


class TreeOwners(NamedTuple):
    """The step's sequences whose drafts are token trees, all verified by pick: per sequence
    its first target row (its last committed token's; node j's row follows at + 1 + j), its
    drafts' offset in the flat draft ids, and its parents (engine/batch.py `Drafts.parents`)."""

    first_rows: list[int]
    draft_offsets: list[int]
    parents: list[list[int]]


def tree_pick(draft_token_ids: torch.Tensor, picks: torch.Tensor,
              trees: TreeOwners) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify token trees by pick: from the root, follow the child whose token is the target's
    own pick at its parent's row; the deepest node so reached (the earliest of equals) is the
    accepted path's end. Emits the path's tokens and then the pick at its end's row: exactly
    the tokens plain decoding emits, whatever the tree.

    Returns ([T, D + 1] emitted tokens padded with PLACEHOLDER, D the deepest tree's depth;
    [T] the accepted path's last node per tree, -1 for none), on the device."""
    device = picks.device
    paths = [tree_paths(p) for p in trees.parents]
    depth = max(len(path) for ps in paths for path in ps)
    width = 1 + max(len(p) for p in trees.parents)  # candidates: the root, then each node
    n_nodes = sum(len(p) for p in trees.parents)
    sentinel = n_nodes  # an index past the nodes: matches, and has no token
    # host-built indices: per node its parent's row; per (tree, candidate) its row, its path's
    # nodes (sentinel-padded), its depth and its rank (deeper first, then earlier)
    parent_rows, node_of = np.zeros(n_nodes, np.int64), np.full((len(paths), width), -1)
    cand_rows = np.zeros((len(paths), width), np.int64)
    cand_path = np.full((len(paths), width, depth), sentinel, np.int64)
    cand_depth = np.zeros((len(paths), width), np.int64)
    at = 0
    for t, (first, parents, ps) in enumerate(zip(trees.first_rows, trees.parents, paths)):
        cand_rows[t, :] = first
        for j, (parent, path) in enumerate(zip(parents, ps)):
            parent_rows[at + j] = first if parent < 0 else first + 1 + parent
            node_of[t, 1 + j] = at + j
            cand_rows[t, 1 + j] = first + 1 + j
            cand_path[t, 1 + j, :len(path)] = [at + a for a in path]
            cand_depth[t, 1 + j] = len(path)
        at += len(parents)
    rank = cand_depth * width + (width - np.arange(width))[None, :]  # deeper, then earlier
    rank[node_of < 0] = -1  # padding: never chosen
    rank[:, 0] = 0  # the root: chosen when no node is accepted
    flat_ids = to_device(np.concatenate([_draft_rows(trees), parent_rows]),
                         torch.long, device)
    ids = draft_token_ids[flat_ids[:n_nodes]]  # [n_nodes] in tree order
    matched = torch.cat([ids == picks[flat_ids[n_nodes:]],
                         torch.ones(1, dtype=torch.bool, device=device)])  # + sentinel
    grids = to_device(np.stack([cand_rows, rank, cand_depth]), torch.long, device)
    path_idx = to_device(cand_path, torch.long, device)  # [T, width, depth]
    accepted = matched[path_idx].all(dim=-1)  # [T, width]: the whole path matched
    score = torch.where(accepted, grids[1], torch.full_like(grids[1], -1))
    best = score.argmax(dim=1)  # [T]
    rows = torch.arange(len(paths), device=device)
    chosen = path_idx[rows, best]  # [T, depth] the path's nodes (sentinel-padded)
    tokens = torch.cat([ids, torch.full((1,), PLACEHOLDER, dtype=torch.long, device=device)])
    out = torch.full((len(paths), depth + 1), PLACEHOLDER, dtype=torch.long, device=device)
    out[:, :depth] = tokens[chosen]
    final = picks[grids[0][rows, best]]
    out.scatter_(1, grids[2][rows, best][:, None], final[:, None])
    return out, best - 1


def _draft_rows(trees: TreeOwners) -> np.ndarray:
    """The flat draft index of every tree node, in tree order."""
    return np.concatenate([off + np.arange(len(p), dtype=np.int64)
                           for off, p in zip(trees.draft_offsets, trees.parents)])


def to_lists(emitted: torch.Tensor | list[list[int]]) -> list[list[int]]:
    """[B, max_k + 1] padded (a host tensor or its rows) -> emitted tokens per sequence."""
    rows = emitted.tolist() if isinstance(emitted, torch.Tensor) else emitted
    return [[t for t in row if t != PLACEHOLDER] for row in rows]
