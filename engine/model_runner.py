"""Model runner: packs one step into ONE flattened ragged forward and returns logits.

Must not make scheduling decisions: it receives the scheduled sequences and their token counts,
and owns only the model and its KV tensors.

Packing (no padding between sequences): `input_ids`, `positions` and `slot_mapping`
(`block_id * block_size + offset`) over all new tokens of all sequences; per sequence a span
(its rows, context length, block table) for attention. Logits are computed only at the rows
whose next token is wanted (`logits_to_keep`), which also skips the vocabulary projection for
the rest of a prompt chunk.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from engine.attention import paged
from engine.scheduler import ScheduledSeq


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
        vocab = model.get_output_embeddings().weight.shape[0]
        return cls(cfg.num_hidden_layers, kv_heads, head_dim, vocab)


@dataclass
class StepLogits:
    logits: torch.Tensor  # [num_rows, vocab_size] float32, raw model logits
    row_offsets: list[int]  # scheduled[i] owns rows row_offsets[i] : row_offsets[i + 1]


class ModelRunner:
    def __init__(self, model: torch.nn.Module, num_blocks: int, block_size: int,
                 backend: paged.AttentionBackend | None = None) -> None:
        if getattr(model.config, "is_encoder_decoder", False):
            raise ValueError("only decoder-only causal language models are supported")
        model.set_attn_implementation(paged.register())
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.shape = ModelShape.of(model)
        self.block_size = block_size
        self.kv = paged.PagedKVCache(self.shape.num_layers, num_blocks, block_size,
                                     self.shape.num_kv_heads, self.shape.head_dim, self.dtype,
                                     self.device, backend)
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        # A prepared 4-D mask makes transformers skip building its own; ours reads block tables.
        self._no_mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=self.device)

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq]) -> StepLogits:
        input_ids, positions, slot_mapping, keep, row_offsets = [], [], [], [], [0]
        spans = []
        bs = self.block_size
        for s in scheduled:
            seq, start, end = s.seq, s.start, s.end
            tokens = seq.token_ids[start:end]
            if end > seq.num_tokens:  # draft tokens to verify follow the committed ones
                tokens += seq.draft_token_ids[max(start - seq.num_tokens, 0):end - seq.num_tokens]
            q_start = len(input_ids)
            input_ids += tokens
            positions += range(start, end)
            table = seq.block_table
            slot_mapping += [table[p // bs] * bs + p % bs for p in range(start, end)]
            spans.append(paged.SeqSpan(q_start, end - start, end, table))
            n = s.num_sample_rows
            keep += range(q_start + end - start - n, q_start + end - start)
            row_offsets.append(row_offsets[-1] + n)
        dev = self.device
        self.kv.meta = self.kv.backend.build_metadata(spans, slot_mapping, bs, dev)
        try:
            out = self.model(
                input_ids=torch.tensor([input_ids], device=dev),
                position_ids=torch.tensor([positions], device=dev),
                attention_mask=self._no_mask,
                use_cache=False,
                logits_to_keep=torch.tensor(keep, dtype=torch.long, device=dev),
                **{self._cache_kwarg: self.kv},
            )
        finally:
            self.kv.meta = None
        return StepLogits(out.logits[0].float(), row_offsets)
