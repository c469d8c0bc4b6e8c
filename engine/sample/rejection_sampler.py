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
    """The step's sequences whose drafts are token trees: per sequence its first target row
    (its last committed token's; node j's row follows at + 1 + j), its drafts' offset in the
    flat draft ids, its parents (engine/batch.py `Drafts.parents`), whether it is verified by
    pick, and the noise keys of its rows (root, then each node; a seeded sequence verified by
    rejection) or None; and per tree its q or None. Without q a tree's drafts are one-hot
    (q(x) = 1 at the draft: suffix matches, a head's most probable tokens), and a node's children
    carry distinct tokens (by rejection, a repeated one would be tried again after its
    rejection: every proposer dedupes its siblings). With q ([1 + nodes, V]: the root's row,
    then each node's, like the target's) a node's children were drawn from its row WITHOUT
    replacement, in their order, and how many it has was decided before they were drawn (a
    choice that looked at a child's own token would bias the draw); a leaf's row is never
    read."""

    first_rows: list[int]
    draft_offsets: list[int]
    parents: list[list[int]]
    by_pick: list[bool]
    keys: list[list[int] | None]
    q: list[torch.Tensor | None] | None = None


def tree_verify(draft_token_ids: torch.Tensor, picks: torch.Tensor,
                target_probs: torch.Tensor | None, trees: TreeOwners,
                default_generator: torch.Generator | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify token trees from the root down: at a node, its children are tried in order and
    the first accepted one is followed; where none is, the node ends the accepted path.
    - by pick: a child is accepted iff its token is the target's own pick at the node; the
      final token is the pick at the path's end: exactly plain decoding's tokens;
    - by rejection (recursive rejection sampling over the children, without replacement, as
      SpecInfer's for one-hot drafts): child x is accepted with probability r(x), r the node's
      p with the earlier children's tokens removed and renormalized; the final token is drawn
      from p at the path's end with its children's tokens removed (p itself at a leaf). Each
      emitted token then has the target's distribution: child x_i is emitted with probability
      p(x_i), and the residual draw covers the rest;
    - by rejection with q (children sampled from q without replacement: recursive rejection
      sampling as SpecTr's and RSD's): with r_1 = p and q_1 = q at the node, child x_i is
      accepted with probability min(1, r_i(x_i) / q_i(x_i)); after its rejection
      r_{i+1} = normalize(max(r_i - q_i, 0)) and q_{i+1} = q_i without x_i, renormalized; the
      final token at the path's end is drawn from the residual after all its children (p at a
      leaf). Stage i emits y with probability min(q_i, r_i)(y) and passes on max(r_i - q_i, 0),
      so every stage's output has r_i's distribution, and the node's has p's.
    target_probs: [rows, V] p, read for the trees verified by rejection (None: all by pick).

    Returns ([T, D + 1] emitted tokens padded with PLACEHOLDER, D the deepest tree's depth;
    [T] the accepted path's last node per tree, -1 for none), on the device."""
    device = picks.device
    g = _TreeGrid.of(trees, device)
    ids = draft_token_ids[g.draft_rows]  # [M] in tree order
    pad = torch.zeros(1, dtype=torch.bool, device=device)
    accepted = ids == picks[g.parent_rows]
    if not all(trees.by_pick):
        p_x = target_probs[g.parent_rows, ids]  # [M] p(x) at the node's parent
        earlier = torch.cat([p_x, p_x.new_zeros(1)])[g.earlier].sum(dim=1)  # siblings' p
        uniform = _tree_uniforms(g, trees, default_generator, device)
        accepted = torch.where(g.node_pick, accepted, uniform * (1 - earlier) < p_x)
        residuals = None
        if trees.q is not None and any(q is not None for q in trees.q):
            accepted, residuals = _q_tree_accept(target_probs, g, trees, ids, uniform, accepted)
    accepted = torch.cat([accepted, pad])
    first = accepted[:-1] & ~accepted[g.earlier].any(dim=1)  # the first accepted sibling
    on_path = torch.cat([first, ~pad])[g.cand_path].all(dim=-1)  # [T, C] (sentinel: true)
    depth = torch.where(on_path & g.cand_valid, g.cand_depth, -1)
    best = depth.argmax(dim=1)  # the deepest node on the path (one per depth), or the root
    rows = torch.arange(len(trees.parents), device=device)
    end_rows = g.cand_rows[rows, best]
    final = picks[end_rows]
    if not all(trees.by_pick):
        final = torch.where(g.tree_pick, final,
                            _tree_final(target_probs, end_rows, g, best, trees, ids,
                                        default_generator, residuals))
    tokens = torch.cat([ids, torch.full((1,), PLACEHOLDER, dtype=torch.long, device=device)])
    out = torch.full((len(trees.parents), g.depth + 1), PLACEHOLDER, dtype=torch.long,
                     device=device)
    out[:, :g.depth] = tokens[g.cand_path[rows, best]]
    out.scatter_(1, g.cand_depth[rows, best][:, None], final[:, None])
    return out, best - 1


class _TreeGrid(NamedTuple):
    """The trees' structure as device index tensors, built on the host. M nodes over all trees
    (tree order), index M a sentinel; per tree C = 1 + its most nodes candidates (the root,
    then each node) for the accepted path's end."""

    depth: int  # the deepest tree's
    draft_rows: torch.Tensor  # [M] each node's index in the flat draft ids
    parent_rows: torch.Tensor  # [M] the target row its token is verified at (its parent's)
    earlier: torch.Tensor  # [M, S] its earlier siblings (sentinel-padded)
    sibling: list[int]  # [M] its place among its siblings (host)
    node_pick: torch.Tensor  # [M] bool: its tree is verified by pick
    tree_pick: torch.Tensor  # [T] bool
    cand_rows: torch.Tensor  # [T, C] each candidate's target row
    cand_path: torch.Tensor  # [T, C, D] its path's nodes (sentinel-padded)
    cand_depth: torch.Tensor  # [T, C]
    cand_valid: torch.Tensor  # [T, C] bool: a real candidate (trees differ in size)
    children: torch.Tensor  # [T, C, W] its children's nodes (sentinel-padded)
    tree_of: list[int]  # [M] its tree (host)
    parent_local: list[int]  # [M] its parent in its tree, -1 for the root (host)

    @classmethod
    def of(cls, trees: TreeOwners, device: torch.device) -> "_TreeGrid":
        paths = [tree_paths(p) for p in trees.parents]
        depth = max(len(path) for ps in paths for path in ps)
        n_cand = 1 + max(len(p) for p in trees.parents)
        m = sum(len(p) for p in trees.parents)
        kids: dict[tuple[int, int], list[int]] = {}  # (tree, local parent) -> global nodes
        draft_rows, parent_rows, tree_of, parent_local, sibling = [], [], [], [], []
        at = 0
        for t, (first, off, parents) in enumerate(zip(trees.first_rows, trees.draft_offsets,
                                                      trees.parents)):
            for j, parent in enumerate(parents):
                draft_rows.append(off + j)
                parent_rows.append(first if parent < 0 else first + 1 + parent)
                tree_of.append(t)
                parent_local.append(parent)
                sibling.append(len(kids.setdefault((t, parent), [])))
                kids[(t, parent)].append(at + j)
            at += len(parents)
        width = max(len(v) for v in kids.values())
        earlier = np.full((m, max(width - 1, 1)), m, np.int64)
        for nodes in kids.values():
            for i, node in enumerate(nodes):
                earlier[node, :i] = nodes[:i]
        cand_rows = np.zeros((len(paths), n_cand), np.int64)
        cand_path = np.full((len(paths), n_cand, depth), m, np.int64)
        cand_depth = np.zeros((len(paths), n_cand), np.int64)
        cand_valid = np.zeros((len(paths), n_cand), bool)
        children = np.full((len(paths), n_cand, width), m, np.int64)
        at = 0
        for t, (first, ps) in enumerate(zip(trees.first_rows, paths)):
            cand_rows[t] = first
            cand_valid[t, :1 + len(ps)] = True
            own = kids.get((t, -1), [])
            children[t, 0, :len(own)] = own
            for j, path in enumerate(ps):
                cand_rows[t, 1 + j] = first + 1 + j
                cand_path[t, 1 + j, :len(path)] = [at + a for a in path]
                cand_depth[t, 1 + j] = len(path)
                own = kids.get((t, j), [])
                children[t, 1 + j, :len(own)] = own
            at += len(ps)
        picks = np.asarray(trees.by_pick, bool)
        flat = to_device(np.concatenate([
            np.asarray(draft_rows, np.int64), np.asarray(parent_rows, np.int64),
            earlier.ravel(), picks[tree_of].astype(np.int64), picks.astype(np.int64),
            cand_rows.ravel(), cand_path.ravel(), cand_depth.ravel(),
            cand_valid.ravel().astype(np.int64), children.ravel()]), torch.long, device)
        sizes = [m, m, earlier.size, m, len(picks), cand_rows.size, cand_path.size,
                 cand_depth.size, cand_valid.size, children.size]
        parts = torch.split(flat, sizes)
        return cls(depth, parts[0], parts[1], parts[2].view(earlier.shape), sibling,
                   parts[3].bool(), parts[4].bool(), parts[5].view(cand_rows.shape),
                   parts[6].view(cand_path.shape), parts[7].view(cand_depth.shape),
                   parts[8].view(cand_valid.shape).bool(), parts[9].view(children.shape),
                   tree_of, parent_local)


def _tree_uniforms(g: _TreeGrid, trees: TreeOwners, default: torch.Generator | None,
                   device: torch.device) -> torch.Tensor:
    """[M] U(0, 1) per node; a seeded tree's node i-th among its siblings draws the i-th
    uniform of its parent row's ACCEPT stream (a chain's: the first, as the chain sampler's)."""
    uniform = torch.rand(len(g.tree_of), generator=default, device=device)
    keyed = [node for node, t in enumerate(g.tree_of)
             if trees.keys[t] is not None and not trees.by_pick[t]]
    if keyed:
        row_key = [trees.keys[g.tree_of[n]][1 + g.parent_local[n]] for n in keyed]
        draws = keyed_uniforms([restream(k, ACCEPT) for k in row_key],
                               1 + max(g.sibling[n] for n in keyed), device)
        index = to_device([keyed, [g.sibling[n] for n in keyed]], torch.long, device)
        uniform[index[0]] = draws[torch.arange(len(keyed), device=device), index[1]]
    return uniform


def _q_tree_accept(probs: torch.Tensor, g: _TreeGrid, trees: TreeOwners, ids: torch.Tensor,
                   uniform: torch.Tensor, accepted: torch.Tensor
                   ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """The acceptance of the nodes of the trees with q (`accepted` elsewhere as given) by
    recursive rejection sampling over each node's children, one sibling rank at a time over
    every such node at once; and (residual index [T, C]: each candidate's row of the residuals,
    -1 where none; residuals [N, V]: after all of a node's children were rejected)."""
    device = probs.device
    m = len(g.tree_of)
    owners, q_rows = [], []  # (tree, candidate) of each node with children in a q tree
    for t, q in enumerate(trees.q):
        if q is None or trees.by_pick[t]:
            continue
        for c in sorted({1 + p for p in trees.parents[t]}):  # (the host's: no device read)
            owners.append((t, c))
            q_rows.append(q[c])
    index = torch.full(tuple(g.children.shape[:2]), -1, dtype=torch.long)
    if not owners:
        return accepted, (index.to(device), probs.new_zeros((0, probs.shape[1])))
    at = torch.tensor(owners, dtype=torch.long)
    index[at[:, 0], at[:, 1]] = torch.arange(len(owners))
    at, index = at.to(device), index.to(device)
    r = probs[g.cand_rows[at[:, 0], at[:, 1]]].float()  # [N, V] r_1 = p
    q = torch.stack(q_rows).to(device=device, dtype=torch.float32)  # [N, V] q_1
    kids = g.children[at[:, 0], at[:, 1]]  # [N, W] sentinel-padded
    tokens = torch.cat([ids, ids.new_zeros(1)])[kids]
    u = torch.cat([uniform, uniform.new_ones(1)])[kids]
    out = accepted.clone()
    for i in range(kids.shape[1]):
        real = kids[:, i] < m
        x = tokens[:, i:i + 1]
        r_x, q_x = r.gather(1, x)[:, 0], q.gather(1, x)[:, 0]
        out[kids[real, i]] = (u[:, i] * q_x < r_x)[real]  # (q >= r: r/q; q < r: always)
        rest = (r - q).clamp_min(0.0)
        mass = rest.sum(dim=-1, keepdim=True)
        # (no mass left: rejecting had probability 0; r stays rather than divide by 0)
        r = torch.where(real[:, None] & (mass > 0), rest / mass.clamp_min(1e-30), r)
        q_rest = q.scatter(1, x, 0.0)
        left = q_rest.sum(dim=-1, keepdim=True)
        q = torch.where(real[:, None] & (left > 0), q_rest / left.clamp_min(1e-30), q)
    return out, (index, r)


def _tree_final(probs: torch.Tensor, end_rows: torch.Tensor, g: _TreeGrid, best: torch.Tensor,
                trees: TreeOwners, ids: torch.Tensor, default: torch.Generator | None,
                residuals: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """[T] the final token of each tree verified by rejection: a draw from p at its path's
    end with that node's children's tokens removed (all were rejected there), renormalized;
    for a tree with q, from the residual its children's recursive rejection left
    (`_q_tree_accept`), p at a leaf."""
    device = probs.device
    p = probs[end_rows].float()  # [T, V]
    rows = torch.arange(p.shape[0], device=device)
    kids = g.children[rows, best]  # [T, W] sentinel-padded
    tokens = torch.cat([ids, ids.new_zeros(1)])[kids]  # (the sentinel's: token 0, not a child)
    # a mask summed over the children: a padding entry must never restore a real child's token
    drop = torch.zeros_like(p).scatter_add_(1, tokens, (kids < len(g.tree_of)).to(p.dtype))
    residual = p.masked_fill(drop > 0, 0.0)
    usable = residual.sum(dim=-1) > 0  # zero only where p sat on the children (probability 0)
    dist = torch.where(usable[:, None], residual, p)
    if residuals is not None and len(residuals[1]):
        at = residuals[0][rows, best]  # [T] the end node's residual row, -1: none (a leaf)
        q_tree = torch.tensor([q is not None for q in trees.q], device=device)
        dist = torch.where(q_tree[:, None], p, dist)
        dist = torch.where((at >= 0)[:, None], residuals[1][at.clamp_min(0)], dist)
    noise = torch.empty_like(dist).exponential_(generator=default)
    keyed = [t for t, k in enumerate(trees.keys) if k is not None and not trees.by_pick[t]]
    if keyed:  # a seeded tree's final draw is keyed by the position it lands on: per depth
        cands = [_depth_keys(trees, t) for t in keyed]
        drawn = exponential_noise((sum(len(c) for c in cands), dist.shape[1]),
                                  [k for c in cands for k in c], device, None)
        first = np.cumsum([0] + [len(c) for c in cands[:-1]])
        index = to_device([keyed, first], torch.long, device)
        noise[index[0]] = drawn[index[1] + g.cand_depth[index[0], best[index[0]]]]
    return (dist / noise).argmax(dim=-1)


def _depth_keys(trees: TreeOwners, t: int) -> list[int]:
    """A seeded tree's row keys by depth (every node of a depth shares its position's key)."""
    keys, paths = trees.keys[t], tree_paths(trees.parents[t])
    by_depth = {0: keys[0]}
    for j, path in enumerate(paths):
        by_depth.setdefault(len(path), keys[1 + j])
    return [by_depth[d] for d in range(1 + max(by_depth))]


def to_lists(emitted: torch.Tensor | list[list[int]]) -> list[list[int]]:
    """[B, max_k + 1] padded (a host tensor or its rows) -> emitted tokens per sequence."""
    rows = emitted.tolist() if isinstance(emitted, torch.Tensor) else emitted
    return [[t for t in row if t != PLACEHOLDER] for row in rows]
