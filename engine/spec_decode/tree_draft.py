"""EAGLE-2's dynamic token trees, for a proposer that runs a model level by level (a draft head,
a draft model).

Must not schedule, verify or own a model: the proposer runs each forward (`TreeModel`); this
module chooses which nodes each forward runs and which nodes the tree keeps. The first forward
(the proposer's catch-up rows) scores the root's children; each further one runs the `width`
most probable nodes of the level before as one row each (at the position of the last
committed token plus the node's depth, attending to the committed tokens and its own
ancestors; its K/V in the slot after the committed tokens plus its expansion index) and scores
their `width` best children. A node's score is its path's probability under the proposer's
processed distribution (the product along the path). The tree keeps the most probable nodes,
each at least `min_prob` likely, in order of probability (a parent before its children: the
first k nodes are a tree too); drafts are deterministic (one-hot q). The slots the expanded
nodes wrote lie past the committed tokens: the proposer's next catch-up rewrites them.

A request verified by rejection sampling (sampled, not verified by the target's pick) gets a
SAMPLED tree instead (`grow_sampled`): its shape is fixed before any token is drawn
(`sampled_shape`: the nodes most likely to be accepted under the sequence's acceptance estimate,
by depth and sibling rank), then each node's children are drawn from q WITHOUT replacement
(Gumbel top-k), in order, and q is kept per node: the verifier's recursive rejection sampling
with q (engine/sample/rejection_sampler.py `tree_verify`) needs exactly that, and a tree pruned
by its drawn tokens' probabilities would bias it.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from typing import Protocol

import torch

from engine import device_io
from engine.device_io import Marks
from engine.sample import sampler
from engine.sequence import Sequence
from engine.spec_decode.proposer import Proposal


class Node:
    """A scored node of a tree being drafted."""

    __slots__ = ("token", "logp", "depth", "parent", "state", "index", "slot")

    def __init__(self, token: int, logp: float, depth: int, parent: "Node | None",
                 state: object, index: int) -> None:
        self.token, self.logp, self.depth, self.parent = token, logp, depth, parent
        self.state = state  # what the proposer's row for this node reads (a head: parent's h)
        self.index = index  # among its sequence's scored nodes
        self.slot: int | None = None  # where its K/V sits, once expanded (run as a row)

    def path(self) -> list["Node"]:
        out, n = [], self
        while n is not None:
            out.append(n)
            n = n.parent
        return out[::-1]

    def path_tokens(self) -> list[int]:
        return [n.token for n in self.path()]

    def keys(self) -> tuple[int, ...]:
        """Its row's keys after the committed tokens: its ancestors' slots, then its own (as
        positions of the sequence's block table)."""
        return tuple(n.slot for n in self.path())


class TreeModel(Protocol):
    def first_forward(self, seqs: list[Sequence]) -> tuple[torch.Tensor, list, int]:
        """The catch-up rows of `seqs`: logits after each one's last committed token ([S, V]
        over the target's vocabulary), the state its children's rows read, and the rows the
        forward ran."""

    def node_forward(self, rows: list[tuple[Sequence, Node]]) -> tuple[torch.Tensor, list]:
        """One row per (sequence, node): logits after each node and its children's state."""


def reserve_depths(reserve: Callable[[Sequence, int], int], seqs: list[Sequence],
                   depths: list[int], max_nodes: list[int], width: int) -> list[int]:
    """Per sequence the levels its tree may have once the slots its expanded nodes write are
    reserved (`width` per level below the last, at most max_nodes[i], after the committed
    tokens) through the proposer's `reserve(seq, k)` (a chain's k drafts: shrunk where the pool
    is short, 0 with no row to run): one level where the pool is short, 0 where it has none."""
    out = []
    for seq, depth, cap in zip(seqs, depths, max_nodes):
        expansions = min(width * (depth - 1), cap)
        got = reserve(seq, 1 + expansions)
        out.append(0 if got == 0 else depth if got == 1 + expansions else 1)
    return out


def reserve_shapes(reserve: Callable[[Sequence, int], int], seqs: list[Sequence],
                   shapes: list[list[int]]) -> list[list[int]]:
    """The sampled trees' shapes once the slots their expanded nodes write are reserved
    (`reserve_depths`' way): the root's children alone where the pool is short, none where
    it has no room."""
    out = []
    for seq, shape in zip(seqs, shapes):
        expansions = len({p for p in shape if p >= 0})
        got = reserve(seq, 1 + expansions) if shape else 0
        out.append([] if got == 0 else shape if got == 1 + expansions
                   else [p for p in shape if p < 0])
    return out


def grow(model: TreeModel, draft_sampler, seqs: list[Sequence], depths: list[int],
         max_nodes: list[int], width: int, min_prob: float, min_level: float = 0.0
         ) -> Proposal:
    """Token trees of at most depths[i] levels and max_nodes[i] nodes for `seqs` (0 levels:
    none; the proposer reserved the slots: at most max_nodes[i] nodes expand). A level is
    drafted only where the nodes it expands sum to at least `min_level` (their children's
    chances can sum to no more: what one more draft forward may add)."""
    marks, forwards = Marks(draft_sampler.device), []
    nodes: list[list[Node]] = [[] for _ in seqs]  # per sequence, every scored node
    owners: list[tuple[int, Node | None]] = [(i, None) for i, d in enumerate(depths) if d > 0]
    expanded = [0] * len(seqs)  # nodes run as rows so far (their slots' index)
    level = 0
    while owners:
        start = marks.mark()
        logits, states, rows = _run_level(model, level, [(seqs[i], n) for i, n in owners])
        top, ids = _best_children(draft_sampler, logits, seqs, owners, width)
        forwards.append((rows, len({i for i, _ in owners}), start, marks.mark()))
        level += 1
        fresh: dict[int, list[Node]] = {}
        for j, (i, parent) in enumerate(owners):
            base = 0.0 if parent is None else parent.logp
            for lp, tok in zip(top[j], ids[j]):
                if lp == float("-inf"):
                    break
                node = Node(tok, base + lp, level, parent, states[j], len(nodes[i]))
                nodes[i].append(node)
                fresh.setdefault(i, []).append(node)
        owners = []
        for i, level_nodes in fresh.items():
            if level >= depths[i]:
                continue
            best = sorted(level_nodes, key=lambda n: -n.logp)[:width]
            # (a node's children are no more probable than it; the slots end)
            best = [n for n in best if math.exp(n.logp) >= min_prob]
            best = best[:max_nodes[i] - expanded[i]]
            if sum(math.exp(n.logp) for n in best) < min_level:
                continue
            for n in best:
                n.slot = seqs[i].num_tokens + expanded[i]
                expanded[i] += 1
                owners.append((i, n))
    return _best_trees(nodes, max_nodes, min_prob, forwards, marks)


def _run_level(model: TreeModel, level: int, items: list[tuple[Sequence, Node | None]]
               ) -> tuple[torch.Tensor, list, int]:
    """One level's forward: the catch-up rows (level 0), else a row per node; (logits, the
    states their children read, rows run)."""
    if level == 0:
        return model.first_forward([seq for seq, _ in items])
    logits, states = model.node_forward(items)
    return logits, states, len(items)


def _best_children(draft_sampler, logits: torch.Tensor, seqs: list[Sequence],
                   owners: list[tuple[int, Node | None]], width: int
                   ) -> tuple[list[list[float]], list[list[int]]]:
    """Per row the `width` most probable next tokens under the processed distribution, with
    their log-probs."""
    logp = torch.log_softmax(_processed(draft_sampler, logits, [(seqs[i], n) for i, n in owners]),
                             dim=-1)
    top, ids = logp.topk(min(width, logp.shape[-1]), dim=-1)
    return device_io.lists(top, ids)


def _processed(draft_sampler, logits: torch.Tensor, rows: list[tuple[Sequence, Node | None]]
               ) -> torch.Tensor:
    """[R, V] the processed logits after each row (the settings the verifier applies,
    penalties over the row's path)."""
    specs = [draft_sampler.row(seq, 0 if n is None else n.depth,
                               [] if n is None else n.path_tokens()) for seq, n in rows]
    tensors = sampler.build_sampling_tensors(specs, logits.shape[-1], logits.device,
                                             cache=draft_sampler.settings)
    return sampler.process_logits(logits, tensors)


def _best_trees(nodes: list[list[Node]], max_nodes: list[int], min_prob: float,
                forwards: list, marks: Marks) -> Proposal:
    """Per sequence its most probable nodes (at least `min_prob`, at most max_nodes[i]) as a
    token tree in order of probability (ties: the shallower first, so a parent always precedes
    its children)."""
    ids, parents, confidence = [], [], []
    for scored, cap in zip(nodes, max_nodes):
        kept = sorted(scored, key=lambda n: (-n.logp, n.depth, n.index))[:cap]
        kept = [n for n in kept if math.exp(n.logp) >= min_prob]
        where = {n.index: j for j, n in enumerate(kept)}
        ids.append([n.token for n in kept])
        parents.append([-1 if n.parent is None else where[n.parent.index] for n in kept])
        confidence.append([math.exp(n.logp) for n in kept])
    return Proposal(ids, [None] * len(ids), forwards, marks, parents=parents,
                    confidence=confidence)


def sampled_shape(acceptance: float, width: int, max_nodes: int, depth: int,
                  min_prob: float, min_level: float = 0.0, spine: int = 0) -> list[int]:
    """The parents of a sampled tree's nodes (-1: the root), parents first and each node's
    children in their draw order, likeliest first: the at most `max_nodes` nodes within `depth`
    levels most likely to be accepted, each at least `min_prob`, under acceptance `acceptance`
    per child tried: a node is accepted when its path's ancestors were, the siblings drawn
    before it were rejected and it was not: the product over its path of a * (1 - a)^rank. At
    most `width` children a node; a level below the first only where its nodes' chances sum
    to `min_level` (what its draft forward must add, as `grow`'s). `spine`: the chain of that
    many first children is kept whatever its chances (the k the plan chose for a chain, whose
    costs it weighed); the tree branches beside it. It reads no token, so it cannot bias the
    draws."""
    a = min(max(acceptance, 0.05), 0.95)
    spine = min(spine, depth, max_nodes)
    if max_nodes <= 0 or depth <= 0 or (a < min_prob and not spine):
        return []
    # (off the spine, -chance, tiebreak, parent node, rank, depth), the spine first: a child
    # is offered once its parent is taken, a sibling once the one drawn before it is; chances
    # only shrink along both
    heap = [(spine < 1, -a, 0, -1, 0, 1)]
    # (parent, rank, depth): the spine, then in order of chance; a parent before its children,
    # siblings by rank, so the first nodes are a tree with a prefix of every node's children
    # (the scheduler's budget may cut a tree to its first nodes: the likeliest stay)
    taken: list[tuple[int, int, int]] = []
    while heap and len(taken) < max_nodes:
        off, neg, _, parent, rank, level = heapq.heappop(heap)
        if off and -neg < min_prob:
            break
        node = len(taken)
        taken.append((parent, rank, level))
        if rank + 1 < width:
            heapq.heappush(heap, (True, neg * (1 - a), len(taken) * 2, parent, rank + 1, level))
        if level < depth:
            heapq.heappush(heap, (off or level + 1 > spine, neg * a, len(taken) * 2 + 1, node,
                                  0, level + 1))
    chances = sampled_confidence([parent for parent, _, _ in taken], a)  # (siblings by rank)
    level_sums: dict[int, float] = {}
    for n, (_, _, level) in enumerate(taken):
        level_sums[level] = level_sums.get(level, 0.0) + chances[n]
    last = max(1, spine)
    while last + 1 in level_sums and level_sums[last + 1] >= min_level:
        last += 1
    kept = [n for n in range(len(taken)) if taken[n][2] <= last]  # (whole levels go)
    where = {n: j for j, n in enumerate(kept)}
    return [-1 if taken[n][0] < 0 else where[taken[n][0]] for n in kept]


def sampled_confidence(parents: list[int], acceptance: float) -> list[float]:
    """Each node's chance of acceptance under `sampled_shape`'s model (its prediction)."""
    a = min(max(acceptance, 0.05), 0.95)
    out, seen = [], {}
    for parent in parents:
        rank = seen.get(parent, 0)
        seen[parent] = rank + 1
        out.append((1.0 if parent < 0 else out[parent]) * a * (1 - a) ** rank)
    return out


def grow_sampled(model: TreeModel, draft_sampler, seqs: list[Sequence],
                 shapes: list[list[int]], acceptance: list[float]) -> Proposal:
    """Sampled trees of the given shapes (`sampled_shape`; [] for none; the proposer reserved
    the slots of every node that has children): level by level, the rows of the nodes with
    children run and each one's children are drawn from its q without replacement. The
    proposal's probs: per sequence its q rows [1 + nodes, V] (the root's, then each node's;
    a leaf's row is unset: never read)."""
    marks, forwards = Marks(draft_sampler.device), []
    ids: list[list[int]] = [[0] * len(shape) for shape in shapes]
    probs: list[torch.Tensor | None] = [None] * len(seqs)
    kids: list[dict[int, list[int]]] = []
    for shape in shapes:
        by_parent: dict[int, list[int]] = {}
        for j, parent in enumerate(shape):
            by_parent.setdefault(parent, []).append(j)
        kids.append(by_parent)
    nodes: dict[tuple[int, int], Node] = {}  # (sequence, node) -> the node, once drawn
    expanded = [0] * len(seqs)
    owners: list[tuple[int, int]] = [(i, -1) for i, shape in enumerate(shapes) if shape]
    level = 0
    while owners:
        start = marks.mark()
        items = [(seqs[i], None if j < 0 else nodes[i, j]) for i, j in owners]
        logits, states, rows = _run_level(model, level, items)
        q = torch.softmax(_processed(draft_sampler, logits, items), dim=-1)
        drawn = _draw_without_replacement(q, [len(kids[i][j]) for i, j in owners],
                                          draft_sampler.generator)
        forwards.append((rows, len({i for i, _ in owners}), start, marks.mark()))
        level += 1
        for r, (i, j) in enumerate(owners):
            if probs[i] is None:  # (a leaf's row stays unset: never read)
                probs[i] = q.new_empty((1 + len(shapes[i]), q.shape[1]))
            probs[i][1 + j] = q[r]
            parent = None if j < 0 else nodes[i, j]
            for child, token in zip(kids[i][j], drawn[r]):
                ids[i][child] = token
                nodes[i, child] = Node(token, 0.0, level, parent, states[r], child)
        owners = []
        for i, shape in enumerate(shapes):
            for j in range(len(shape)):
                node = nodes.get((i, j))
                if node is not None and node.depth == level and j in kids[i]:
                    node.slot = seqs[i].num_tokens + expanded[i]
                    expanded[i] += 1
                    owners.append((i, j))
    # a node q could not draw (fewer tokens of nonzero probability than its children: a
    # property of q, not of a draw) goes, with its subtree
    out_ids, out_probs, out_parents = [], [], []
    for i, shape in enumerate(shapes):
        keep = [j for j in range(len(shape)) if (i, j) in nodes]
        where = {j: n for n, j in enumerate(keep)}
        out_ids.append([ids[i][j] for j in keep])
        out_parents.append([-1 if shape[j] < 0 else where[shape[j]] for j in keep])
        out_probs.append(None if probs[i] is None or not keep
                         else probs[i] if len(keep) == len(shape) else probs[i][
            device_io.to_device([0, *(1 + j for j in keep)], torch.long, probs[i].device)])
    return Proposal(out_ids, out_probs, forwards, marks, parents=out_parents,
                    confidence=[sampled_confidence(s, a)
                                for s, a in zip(out_parents, acceptance)])


def _draw_without_replacement(q: torch.Tensor, counts: list[int],
                              generator: torch.Generator) -> list[list[int]]:
    """Per row its first counts[r] draws from q without replacement, in draw order: the
    largest log q + Gumbel noise (Gumbel top-k), never a token of zero probability."""
    k = max(counts, default=0)
    if not k:
        return [[] for _ in counts]
    gumbel = -torch.log(torch.empty_like(q).exponential_(generator=generator))
    keys = torch.where(q > 0, q.log() + gumbel, float("-inf"))
    score, index = keys.topk(min(k, q.shape[1]), dim=-1)
    score, index = device_io.lists(score, index)
    return [[t for s, t in zip(sr[:c], ir[:c]) if s != float("-inf")]
            for sr, ir, c in zip(score, index, counts)]
