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
"""

from __future__ import annotations

import time

import torch

from engine.block_manager import BlockManager
from engine.model_runner import ModelRunner, ModelShape, RunItem
from engine.sample import sampler
from engine.sequence import Sequence
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
    def __init__(self, model: torch.nn.Module, *, num_blocks: int, block_size: int,
                 block_manager: BlockManager, target_vocab_size: int,
                 tokenizer_size: int | None = None, seed: int = 0,
                 cpu_matmul_autotune: bool = False, stop_confidence: float = 0.0,
                 attention_backend: str = "auto", coupled: bool = True) -> None:
        draft_vocab = ModelShape.of(model).vocab_size
        check_vocab(draft_vocab, target_vocab_size, tokenizer_size)
        self.runner = ModelRunner(model, num_blocks, block_size,
                                  cpu_matmul_autotune=cpu_matmul_autotune,
                                  attention_backend=attention_backend)
        self.block_manager = block_manager
        self.target_vocab_size = target_vocab_size
        self.valid_vocab = min(draft_vocab, target_vocab_size, tokenizer_size or draft_vocab)
        self.device = self.runner.device
        self.stop_confidence = stop_confidence
        self.coupled = coupled  # seeded requests are verified by the target's keyed pick
        # unseeded requests draft from the engine seed's stream, apart from the verifier's;
        # seeded ones with the noise key their rows carry
        self.generator = torch.Generator(device=self.device).manual_seed(seed + 1)

    def _reserve(self, seq: Sequence, k: int) -> int:
        """Reserve the slots the draft writes (positions up to num_tokens + k - 2); shrink k
        if the pool is short."""
        while k > 0 and not self.block_manager.allocate(seq, seq.num_tokens + k - 1):
            k -= 1
        return k

    def _to_target_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        # [n, V_draft] -> [n, V_target]; ids past the tokenizer's vocabulary are never drafted
        if logits.shape[1] == self.valid_vocab == self.target_vocab_size:
            return logits
        out = torch.full((logits.shape[0], self.target_vocab_size), float("-inf"),
                         dtype=logits.dtype, device=logits.device)
        out[:, :self.valid_vocab] = logits[:, :self.valid_vocab]
        return out

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int], rows) -> Proposal:
        ks = [self._reserve(s, k) for s, k in zip(seqs, ks)]
        drafts: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        forward_seconds: list[tuple[int, int, float]] = []
        active = [i for i, k in enumerate(ks) if k > 0]
        # first forward: catch up on committed tokens, then one new token per step
        items = [RunItem(seqs[i].token_ids[seqs[i].num_draft_computed:],
                         seqs[i].num_draft_computed, seqs[i].block_table, 1) for i in active]
        step = 0
        while active:
            t0 = time.perf_counter()
            row_specs = [rows(i, drafts[i]) for i in active]
            tokens, q, confident = self._draft_token(items, row_specs,
                                                     any(ks[i] > step + 1 for i in active))
            num_tokens = sum(len(item.token_ids) for item in items)
            forward_seconds.append((num_tokens, len(items), time.perf_counter() - t0))
            step += 1
            for j, i in enumerate(active):
                drafts[i].append(tokens[j])
                if q is not None:
                    probs[i].append(q[j])
                seqs[i].num_draft_computed = seqs[i].num_tokens + step - 1
            active = [i for j, i in enumerate(active) if ks[i] > step and confident[j]]
            items = [RunItem([drafts[i][-1]], seqs[i].num_tokens + step - 1, seqs[i].block_table, 1)
                     for i in active]
        return Proposal(drafts, [torch.stack(p) if len(p) == len(d) and p else None
                                 for p, d in zip(probs, drafts)], forward_seconds)

    def _draft_token(self, items: list[RunItem], row_specs: list[sampler.RowSpec],
                     more_wanted: bool) -> tuple[list[int], torch.Tensor | None, list[bool]]:
        """One draft forward: the next draft token per item, q ([n, V], None when every row is
        greedy: greedy verification compares tokens) and whether each row may go on drafting
        (the confidence stop, checked only when `more_wanted`)."""
        logits = self._to_target_vocab(self.runner.execute(items).logits)  # [n, V]
        tensors = sampler.build_sampling_tensors(row_specs, self.target_vocab_size, self.device)
        processed = sampler.process_logits(logits, tensors)
        sampled = sampler.sample(processed, tensors, self.generator)
        # q is read only by rejection sampling: not for greedy rows, nor for seeded rows under
        # coupled verification (verified by the target's own keyed pick)
        need_q = any(not (r.params.greedy or (self.coupled and r.params.seed is not None))
                     for r in row_specs)
        q = torch.softmax(processed, dim=-1) if need_q else None
        confident = [True] * len(items)
        if self.stop_confidence > 0.0 and more_wanted:
            chosen = processed.gather(1, sampled[:, None]).squeeze(1)
            conf = torch.exp(chosen - torch.logsumexp(processed, dim=-1))
            confident = (conf >= self.stop_confidence).tolist()
        return sampled.tolist(), q, confident
