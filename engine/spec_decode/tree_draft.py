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
"""

from __future__ import annotations

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
        if level == 0:
            logits, states, rows = model.first_forward([seqs[i] for i, _ in owners])
        else:
            (logits, states), rows = model.node_forward([(seqs[i], n) for i, n in owners]), \
                len(owners)
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


def _best_children(draft_sampler, logits: torch.Tensor, seqs: list[Sequence],
                   owners: list[tuple[int, Node | None]], width: int
                   ) -> tuple[list[list[float]], list[list[int]]]:
    """Per row the `width` most probable next tokens under the processed distribution (the
    settings the verifier applies, penalties over the row's path), with their log-probs."""
    specs = [draft_sampler.row(seqs[i], 0 if n is None else n.depth,
                               [] if n is None else n.path_tokens()) for i, n in owners]
    tensors = sampler.build_sampling_tensors(specs, logits.shape[-1], logits.device,
                                             cache=draft_sampler.settings)
    logp = torch.log_softmax(sampler.process_logits(logits, tensors), dim=-1)
    top, ids = logp.topk(min(width, logp.shape[-1]), dim=-1)
    return device_io.lists(top, ids)


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
