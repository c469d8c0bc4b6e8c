"""Draft-model proposer: a second, smaller transformers model with the target's tokenizer.

Must not schedule or verify. It owns the draft model and its own KV tensors over the SAME block
ids as the target (one block table per sequence); its lookahead slots are reserved through the
block manager before it writes. Per sequence, `seq.num_draft_computed` counts the tokens whose
draft KV is valid (the scheduler rolls it back with the target's rejected tokens).

One `propose` call = k batched draft forwards: the first catches every sequence's draft cache
up on its newly committed tokens (a whole prompt for a new sequence, the accepted tokens plus
the bonus token otherwise) and drafts token 1; each further forward drafts one more token for
the sequences that want it. Draft tokens are sampled from q = the draft's processed
distribution (the same `process_logits` settings the verifier applies to the target). A
sequence stops drafting early when q gave the token it just drafted less than
`stop_confidence`: such a token is likely rejected, and drafting past it is likely wasted. The
draft length then depends on the draft alone, so the verifier stays exact.

Reads (`defer_reads`, on by default on CUDA): the k forwards are chained on the device (each
forward's input is the previous one's sampled tokens, never read by the host) and the drafts
stay there (`Proposal.device`): the next step feeds them to the target and the verifier on the
device and reads the accepted ones with its results, so a speculative step reads the device
once. With the confidence stop on, the drafts are read in ONE transfer at the end of the
proposal instead, and the stop is applied to them after the fact (same drafts, but every
sequence runs its k forwards; the verifier needs the cut lengths before the step). Rows under
a grammar or with penalties need each draft on the host, so a call with such rows reads every
forward's tokens, as the CPU does by default (a read is free there, and stopping early skips
forwards).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine import device_io
from engine.block_manager import BlockManager
from engine.device_io import Marks, to_device
from engine.batch import Drafts, ModelShape, RunItem
from engine.models.draft import restrict_vocabulary
from engine.sample import sampler
from engine.runner_plan import RunnerPlan
from engine.sample.row_spec import by_pick, draft_stream, row_spec
from engine.sequence import Sequence
from engine.spec_decode import tree_draft
from engine.spec_decode.proposer import Proposal, Proposer


def check_vocab(draft_vocab: int, target_vocab: int, tokenizer_size: int | None) -> None:
    """Refuse a draft whose vocabulary is not the target's (padding-only differences are fine)."""
    if draft_vocab == target_vocab:
        return
    if tokenizer_size is not None and tokenizer_size <= min(draft_vocab, target_vocab):
        return  # the sizes differ only in padding rows beyond the tokenizer's vocabulary
    raise ValueError(
        f"draft model vocabulary ({draft_vocab} tokens) differs from the target's "
        f"({target_vocab} tokens); speculative decoding needs the same tokenizer")


class DraftModelProposer(Proposer):
    trees = True
    sampled_trees = True
    method = "draft_model"

    def __init__(self, model: torch.nn.Module, plan: RunnerPlan, block_manager: BlockManager,
                 target_vocab_size: int, max_model_len: int, *,
                 tokenizer_size: int | None = None, seed: int = 0,
                 stop_confidence: float = 0.0, coupled: bool = True,
                 vocabulary: torch.Tensor | None = None, defer_reads: bool | None = None) -> None:
        """plan: the runner plan the target's runner follows too (engine/runner_plan.py);
        vocabulary: the token ids the draft scores ([n] long, ascending; None: all of them;
        engine/models/draft.py `draft_vocabulary`): its output projection is cut to those rows,
        and a token outside them is never drafted (q = 0 there, which the verifier handles
        exactly). defer_reads: chain the k draft forwards on the device and read their tokens
        once at the end (None: on CUDA, where each read waits for the device; on the CPU a
        read costs nothing and reading each token lets the confidence stop skip forwards)."""
        draft_vocab = ModelShape.of(model).vocab_size
        check_vocab(draft_vocab, target_vocab_size, tokenizer_size)
        if vocabulary is not None:
            restrict_vocabulary(model, vocabulary)
        self.runner = plan.runner(model, block_manager.num_blocks, block_manager.block_size,
                                  target=False)
        plan.enable_static_steps(self.runner, max_model_len)
        self.block_manager = block_manager
        self.target_vocab_size = target_vocab_size
        self.valid_vocab = min(draft_vocab, target_vocab_size, tokenizer_size or draft_vocab)
        self.device = self.runner.device
        self.vocabulary = None if vocabulary is None else vocabulary.to(self.device)
        self.stop_confidence = stop_confidence
        self.defer_reads = self.device.type == "cuda" if defer_reads is None else defer_reads
        self.sampler = DraftSampler(target_vocab_size, self.device, seed, coupled,
                                    stop_confidence)

    def _reserve(self, seq: Sequence, k: int) -> int:
        """Reserve the slots the draft writes (positions up to num_tokens + k - 2); shrink k
        if the pool is short."""
        while k > 0 and not self.block_manager.allocate(seq, seq.num_tokens + k - 1):
            k -= 1
        return k

    def _to_target_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        # [n, V_draft] -> [n, V_target]; ids past the tokenizer's vocabulary, and outside a
        # vocabulary subset, are never drafted
        if self.vocabulary is None and logits.shape[1] == self.valid_vocab \
                == self.target_vocab_size:
            return logits
        out = torch.full((logits.shape[0], self.target_vocab_size), float("-inf"),
                         dtype=logits.dtype, device=logits.device)
        if self.vocabulary is not None:
            out[:, self.vocabulary] = logits
        else:
            out[:, :self.valid_vocab] = logits[:, :self.valid_vocab]
        return out

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int]) -> Proposal:
        ks = [self._reserve(s, k) for s, k in zip(seqs, ks)]
        active = [i for i, k in enumerate(ks) if k > 0]
        specs = [self.sampler.row(seqs[i], 0) for i in active]
        # rows under a grammar or with penalties need each draft on the host before the next
        defer = self.defer_reads and not any(r.grammar is not None or r.params.has_penalties
                                             for r in specs)
        known: list[list[int]] = [[] for _ in seqs]  # drafts read so far (not deferred)
        marks = Marks(self.device)
        forwards: list[_Forward] = []
        # first forward: catch up on committed tokens, then one new token per step
        items = [RunItem(seqs[i].token_ids[seqs[i].num_draft_computed:],
                         seqs[i].num_draft_computed, seqs[i].block_table, 1,
                         seqs[i].num_prompt_tokens) for i in active]
        ids = None  # the previous forward's tokens, on the device (deferred)
        while active:
            step = len(forwards)
            if step:
                specs = [self.sampler.row(seqs[i], step, None if defer else known[i])
                         for i in active]
            start = marks.mark()
            logits = self._to_target_vocab(self.runner.execute(
                items, None if ids is None else Drafts([1] * len(items), ids)).logits)
            sampled, q, confident = self.sampler.draft_token(
                logits, specs, any(ks[i] > step + 1 for i in active))
            forward = _Forward(active, sampled, q, confident,
                               sum(len(item.token_ids) for item in items), start, marks.mark())
            forwards.append(forward)
            step += 1
            if defer:  # the stop is applied after the fact: every sequence drafts its k
                go_on = [j for j, i in enumerate(active) if ks[i] > step]
                ids = sampled if len(go_on) == len(active) else sampled[
                    to_device(go_on, torch.long, self.device)]
            else:
                tokens, sure = forward.host = device_io.lists(sampled, confident)
                for j, i in enumerate(active):
                    known[i].append(tokens[j])
                go_on = [j for j, i in enumerate(active)
                         if ks[i] > step and (sure is None or sure[j])]
            active = [active[j] for j in go_on]
            items = [RunItem([known[i][-1]] if not defer else [],
                             seqs[i].num_tokens + step - 1, seqs[i].block_table, 1,
                             seqs[i].num_prompt_tokens) for i in active]
        if defer and self.stop_confidence <= 0.0:
            return self._on_device(seqs, ks, forwards, marks)
        return self._proposal(seqs, forwards, marks)

    @torch.inference_mode()
    def propose_tree(self, seqs: list[Sequence], depths: list[int], max_nodes: list[int],
                     width: int, min_prob: float, min_level: float = 0.0) -> Proposal:
        """EAGLE-2's dynamic token trees (tree_draft.py) from the draft model, at most
        depths[i] levels and max_nodes[i] nodes: it branches where its most probable token
        leaves room for others. The draft KV is then valid up to the committed tokens only
        (the accepted path is recomputed by the next catch-up, as a head's is)."""
        depths = tree_draft.reserve_depths(self._reserve, seqs, depths, max_nodes, width)
        proposal = tree_draft.grow(self, self.sampler, seqs, depths, max_nodes, width,
                                   min_prob, min_level)
        for seq, d in zip(seqs, depths):
            if d:
                seq.num_draft_computed = seq.num_tokens
        return proposal

    @torch.inference_mode()
    def propose_sampled_tree(self, seqs: list[Sequence], shapes: list[list[int]],
                             acceptance: list[float]) -> Proposal:
        """Sampled token trees of the given shapes (tree_draft.py `grow_sampled`), for
        requests verified by rejection sampling; the draft KV then as after `propose_tree`."""
        shapes = tree_draft.reserve_shapes(self._reserve, seqs, shapes)
        proposal = tree_draft.grow_sampled(self, self.sampler, seqs, shapes, acceptance)
        for seq, shape in zip(seqs, shapes):
            if shape:
                seq.num_draft_computed = seq.num_tokens
        return proposal

    def first_forward(self, seqs: list[Sequence]) -> tuple[torch.Tensor, list, int]:
        items = [RunItem(s.token_ids[s.num_draft_computed:], s.num_draft_computed,
                         s.block_table, 1, s.num_prompt_tokens) for s in seqs]
        logits = self._to_target_vocab(self.runner.execute(items).logits)
        return logits, [None] * len(seqs), sum(len(it.token_ids) for it in items)

    def node_forward(self, rows: list[tuple[Sequence, tree_draft.Node]]
                     ) -> tuple[torch.Tensor, list]:
        items = [RunItem([n.token], s.num_tokens - 1 + n.depth, s.block_table, 1,
                         s.num_prompt_tokens, tree_keys=n.keys()) for s, n in rows]
        return self._to_target_vocab(self.runner.execute(items).logits), [None] * len(rows)

    def _on_device(self, seqs: list[Sequence], ks: list[int], forwards: list["_Forward"],
                   marks: Marks) -> Proposal:
        """The drafts of `forwards` left on the device ([sequences, max k]); each sequence
        drafted its k (no stop), and its draft KV covers its committed tokens and every draft
        but the last."""
        device = None
        if forwards:
            device = torch.zeros((len(seqs), max(ks)), dtype=torch.long, device=self.device)
            for step, f in enumerate(forwards):
                device[:, step].index_copy_(0, to_device(f.active, torch.long, self.device),
                                            f.sampled)
        rows = [{i: j for j, i in enumerate(f.active)} for f in forwards]
        probs: list[torch.Tensor | None] = [None] * len(seqs)
        for i, k in enumerate(ks):
            if k:
                seqs[i].num_draft_computed = seqs[i].num_tokens + k - 1
                if all(f.q is not None for f in forwards[:k]):
                    probs[i] = torch.stack([f.q[r[i]] for f, r in zip(forwards[:k], rows)])
        return Proposal(None, probs, self._timings(forwards), marks, device, list(ks))

    @staticmethod
    def _timings(forwards: list["_Forward"]) -> list[tuple[int, int, object, object]]:
        return [(f.num_tokens, len(f.active), f.start, f.end) for f in forwards]

    def _proposal(self, seqs: list[Sequence], forwards: list["_Forward"],
                  marks: Marks) -> Proposal:
        """The drafts of `forwards` read in ONE transfer, each cut after its first token the
        draft was unsure of (that token is kept); each sequence's draft KV then covers its
        committed tokens and every kept draft but the last."""
        pending = [f for f in forwards if f.host is None]
        fetched = iter(device_io.lists(*(t for f in pending for t in (f.sampled, f.confident)))
                       if pending else ())
        for f in pending:
            f.host = next(fetched), next(fetched)
        drafts: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        stopped = [False] * len(seqs)
        for f in forwards:
            tokens, sure = f.host
            for j, i in enumerate(f.active):
                if stopped[i]:
                    continue
                drafts[i].append(tokens[j])
                if f.q is not None:
                    probs[i].append(f.q[j])
                stopped[i] = sure is not None and not sure[j]
        for seq, d in zip(seqs, drafts):
            if d:
                seq.num_draft_computed = seq.num_tokens + len(d) - 1
        return Proposal(drafts, [torch.stack(p) if len(p) == len(d) and p else None
                                 for p, d in zip(probs, drafts)], self._timings(forwards), marks)


@dataclass
class _Forward:
    """One draft forward of `propose`, its results still on the device."""

    active: list[int]  # the sequences (indices into propose's seqs) it drafted for, in row order
    sampled: torch.Tensor  # [n] the token drafted for each
    q: torch.Tensor | None  # [n, V] their draft probabilities, when needed
    confident: torch.Tensor | None  # [n] bool: the draft may go on after this token
    num_tokens: int  # tokens the forward ran
    start: object  # device_io.Marks of its start and end
    end: object
    host: tuple[list[int], list[bool] | None] | None = None  # (sampled, confident), once read


class DraftSampler:
    """How a proposer samples its drafts: from q = its processed distribution over the
    target's vocabulary (the same `process_logits` settings the verifier applies), with the
    noise `engine/sample/row_spec.py` gives each row; q kept where rejection sampling reads
    it; the confidence stop."""

    def __init__(self, target_vocab_size: int, device: torch.device, seed: int, coupled: bool,
                 stop_confidence: float = 0.0) -> None:
        self.target_vocab_size = target_vocab_size
        self.device = device
        self.coupled = coupled  # seeded requests are verified by the target's keyed pick
        self.stop_confidence = stop_confidence
        # unseeded requests draft from the engine seed's stream, apart from the verifier's;
        # seeded ones with the noise key their rows carry
        self.generator = torch.Generator(device=device).manual_seed(seed + 1)
        self.settings = sampler.SettingsCache()

    def row(self, seq: Sequence, j: int, drafts: list[int] | None = None) -> sampler.RowSpec:
        """The draft's row after the sequence's first j drafts (`drafts`: their ids, None
        where they stay on the device)."""
        return row_spec(seq, j, drafts, draft_stream(self.coupled))

    def draft_token(self, logits: torch.Tensor, row_specs: list[sampler.RowSpec],
                    more_wanted: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """From one draft forward's logits ([n, V]), on the device: the next draft token per
        row, q ([n, V], None when no row needs it) and whether each row may go on drafting (the
        confidence stop; None when off or not `more_wanted`)."""
        tensors = sampler.build_sampling_tensors(row_specs, self.target_vocab_size, self.device,
                                                 cache=self.settings)
        processed = sampler.process_logits(logits, tensors)
        sampled = sampler.sample(processed, tensors, self.generator)
        # q is read only by rejection sampling: not for greedy rows, nor for seeded rows under
        # coupled verification (verified by the target's own keyed pick)
        need_q = any(not by_pick(r.params, self.coupled) for r in row_specs)
        q = torch.softmax(processed, dim=-1) if need_q else None
        confident = None
        if self.stop_confidence > 0.0 and more_wanted:
            chosen = processed.gather(1, sampled[:, None]).squeeze(1)
            conf = torch.exp(chosen - torch.logsumexp(processed, dim=-1))
            confident = conf >= self.stop_confidence
        return sampled, q, confident
