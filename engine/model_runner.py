"""Model runner: packs one step into ONE flattened ragged forward and returns logits.

Must not make scheduling decisions: it receives the scheduled sequences and their token counts,
and owns only the model and its KV tensors (and, split over ranks, its place in their group).

Packing (no padding between sequences): `input_ids`, `positions` and `slot_mapping`
(`block_id * block_size + offset`) over all new tokens of all sequences (a sequence's new tokens
are its item's token ids, then its drafts of the step's `Drafts`: engine/batch.py); per
sequence a span (its rows, context length, block table) for attention. Logits are computed
only at the rows whose next token is wanted (`logits_to_keep`), which also skips the
vocabulary projection for the rest of a prompt chunk. With tensor parallelism
(engine/parallel/) the model is one rank's share: rank 0's runner sends each forward's metadata
and input ids to the other ranks, whose runners run the same forward with it (`follow`).
"""

from __future__ import annotations

import inspect
from dataclasses import replace

import numpy as np
import torch

from engine.attention import paged
from engine.batch import Drafts, ModelShape, RunItem, StepLogits, StepMeta, input_ids
from engine.device_io import to_device
from engine.models import lean_forward


class ModelRunner:
    def __init__(self, model: torch.nn.Module, num_blocks: int, block_size: int,
                 backend: paged.AttentionBackend | None = None,
                 cpu_matmul_autotune: bool = False, batch_invariant: bool = False,
                 attention_backend: str = "sdpa", attention_kv_split: int = 0) -> None:
        """batch_invariant: measure and install the rule of engine/kernels/batch_invariant.py
        (a row's logits never depend on the other rows of the step); it replaces the CPU
        matmul autotune, whose few-row forms change the reduction with the row count.
        attention_backend: sdpa | triton, as `RunnerPlan` resolved it (the one place that
        decides and refuses); ignored when `backend` is given. attention_kv_split: the triton
        backend's split-KV keys per split (0: off)."""
        if getattr(model.config, "is_encoder_decoder", False):
            raise ValueError("only decoder-only causal language models are supported")
        model.set_attn_implementation(paged.register())
        self.model = model.eval()
        self.device = next(model.parameters()).device
        assert backend is not None or attention_backend in ("sdpa", "triton"), \
            "a runner takes the backend its RunnerPlan resolved"
        self.attention_backend = (type(backend).__name__ if backend is not None
                                  else attention_backend)
        self.invariance = None
        if lean_forward.supported(model):  # before the invariance rule measures the layers
            lean_forward.merge_projections(model)
        if batch_invariant:
            from engine.kernels.batch_invariant import make_batch_invariant

            self.invariance = make_batch_invariant(
                model, "triton" if self.attention_backend == "triton" else "sdpa",
                attention_kv_split)
        elif cpu_matmul_autotune:
            from engine.kernels.linear import autotune_linears

            autotune_linears(model)
        self.dtype = model.get_input_embeddings().weight.dtype  # also for quantized linears
        self.shape = ModelShape.of(model)
        self.block_size = block_size
        self.kv = self._kv(num_blocks, backend if backend is not None
                           else self._backend(attention_kv_split))
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        # A prepared 4-D mask makes transformers skip building its own; ours reads block tables.
        self._no_mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=self.device)
        self.static = None  # padded static-buffer steps (and CUDA graphs), when enabled
        self._attention_checked = False
        # the model's forward without transformers' module wrappers (same bits), where known
        self.lean = lean_forward.supported(model)
        self.capture: tuple[int, ...] = ()  # layers whose outputs each forward returns
        # tensor parallelism (engine/parallel/): this rank's group, and on rank 0 the handle
        # on the other ranks, which run every forward of this runner with it
        self.group = None
        self.workers = None

    def join_group(self, group, workers=None) -> None:
        """Run this runner's (split) model with the other ranks of `group`: its row-parallel
        layers' outputs are summed over the group. Rank 0 passes `workers`, which it tells
        about each forward before running it; the others call `follow`."""
        if not self.lean:
            raise ValueError(f"tensor parallelism runs the lean forward of Qwen2 and Llama "
                             f"models, not {type(self.model).__name__}")
        if self.static is not None:
            raise RuntimeError("static steps do not run split over ranks")
        self.group, self.workers = group, workers

    @property
    def kv_bytes(self) -> int:
        """The KV pool's bytes on this runner's device."""
        return sum(t.numel() * t.element_size() for t in (*self.kv.k, *self.kv.v))

    def enable_capture(self, layers: list[int]) -> None:
        """Return the outputs of `layers` at every new token with each step's logits (a draft
        head's features), from the same forward. Before static steps are enabled."""
        if not self.lean:
            raise ValueError(f"a draft head needs the target's hidden states, which this "
                             f"engine reads from Qwen2 and Llama models only (not "
                             f"{type(self.model).__name__})")
        if self.static is not None:
            raise RuntimeError("enable_capture must come before static steps are enabled")
        bad = [i for i in layers if not 0 <= i < self.shape.num_layers]
        if bad:
            raise ValueError(f"layers {bad} are not layers of a {self.shape.num_layers}-layer "
                             f"model")
        self.capture = tuple(layers)

    def _backend(self, attention_kv_split: int) -> paged.AttentionBackend:
        """The attention backend `attention_backend` names: Triton, or SDPA with batch
        invariance's layout and, on the CPU, the row kernel for generated tokens' rows."""
        if self.attention_backend == "triton":
            from engine.attention.triton_backend import TritonBackend

            return TritonBackend(attention_kv_split)
        row_kernel = (self.device.type == "cpu" and self.dtype in (torch.float32, torch.bfloat16)
                      and self.shape.head_dim % 16 == 0 and self.shape.head_dim <= 256)
        return paged.SDPABackend(self.invariance.attention if self.invariance else None,
                                 row_kernel=row_kernel)

    def _kv(self, num_blocks: int, backend: paged.AttentionBackend) -> paged.PagedKVCache:
        return paged.PagedKVCache(self.shape.num_layers, num_blocks, self.block_size,
                                  self.shape.num_kv_heads, self.shape.head_dim, self.dtype,
                                  self.device, backend)

    def resize_kv(self, num_blocks: int) -> None:
        """Replace the KV tensors by a pool of `num_blocks` (before any sequence uses them:
        the engine sizes the pool after measuring a few forwards on a small one)."""
        backend, self.kv = self.kv.backend, None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.kv = self._kv(num_blocks, backend)

    def enable_static_steps(self, batch_sizes: tuple[int, ...], tokens_per_seq: int,
                            max_model_len: int, capture: bool, tree_tokens: int = 0) -> None:
        """Run steps of short sequences in padded static buckets, captured as CUDA graphs when
        `capture` (engine/static_steps.py); token-tree steps of up to `tree_tokens` rows per
        sequence too (0: they run eagerly)."""
        from engine.static_steps import StaticSteps

        self.static = StaticSteps(self, batch_sizes, tokens_per_seq,
                                  -(-max_model_len // self.block_size), capture, tree_tokens)
        if capture:
            with torch.inference_mode():
                self.static.warm_up()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor,
                meta: paged.AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One forward over prepared inputs ([1, T] ids and positions, rows to keep); returns
        the model's logits [1, len(keep), V] (keep None: none, a tensor-parallel worker's)
        and, with `capture`, the captured layers' outputs [T, features] (else None)."""
        calls = self.kv.layer_calls
        hidden = None
        reduce = self.group.reduce if self.group is not None else None
        with self.kv.step(meta):
            if self.capture:
                logits, hidden = lean_forward.forward(self.model, input_ids, positions, keep,
                                                      self.capture, reduce)
            elif self.lean:
                logits = lean_forward.forward(self.model, input_ids, positions, keep,
                                              reduce=reduce)
            else:
                logits = self.model(input_ids=input_ids, position_ids=positions,
                                    attention_mask=self._no_mask, use_cache=False,
                                    logits_to_keep=keep, **{self._cache_kwarg: self.kv}).logits
        if not self._attention_checked:  # once: every layer attended through the paged cache
            made = self.kv.layer_calls - calls
            if made != self.shape.num_layers:
                import transformers

                raise RuntimeError(
                    f"{type(self.model).__name__} made {made} paged attention calls in a "
                    f"forward of {self.shape.num_layers} layers (transformers "
                    f"{transformers.__version__}): its attention does not run through the KV "
                    "cache, and its outputs would be wrong")
            self._attention_checked = True
        return logits, hidden

    @torch.inference_mode()
    def execute(self, items: list[RunItem], drafts: Drafts | None = None) -> StepLogits:
        """drafts: the draft tokens that follow each item's token ids (None: none)."""
        if self.static is not None and self.static.fits(items, drafts):
            return StepLogits(*self.static.execute(items, drafts))
        bs = self.block_size
        positions, slot_mapping, spans, keep, row_offsets = paged.pack(items, drafts, bs)
        dev, long = self.device, torch.long
        ids = input_ids(items, drafts, dev)
        if self.workers is not None:
            self._tell_workers(ids, positions, slot_mapping, spans)
        try:
            logits, hidden = self.forward(
                ids, to_device([positions], long, dev), to_device(keep, long, dev),
                self.kv.backend.build_metadata(spans, slot_mapping, bs, dev))
        except BaseException as exc:
            if self.workers is not None:  # they are inside this forward: out of step for good
                self.workers.fail(f"a forward failed on rank 0 ({type(exc).__name__}: {exc})")
            raise
        return StepLogits(logits[0].float(), row_offsets, hidden)

    @torch.inference_mode()
    def compact(self, moves: list[tuple[list[int], int, int]]) -> None:
        """After a token tree's verification: each (block table, from, to) copies the K/V at
        position `from` of that sequence to position `to` in every layer (the accepted path's
        nodes to the positions after the committed tokens; a node never moves over one still
        to be moved: a path's nodes only move towards the root). Rank 0 of a split model tells
        the other ranks to move theirs."""
        if self.workers is not None:
            self.workers.compact(moves)
        bs = self.block_size
        slots = to_device([[t[p // bs] * bs + p % bs for t, p, _ in moves],
                           [t[p // bs] * bs + p % bs for t, _, p in moves]], torch.long,
                          self.device)
        for layer in range(self.shape.num_layers):
            for flat in self.kv.flat(layer):
                flat[slots[1]] = flat[slots[0]]

    def _tell_workers(self, ids: torch.Tensor, positions: list[int], slot_mapping: list[int],
                      spans: list[paged.SeqSpan]) -> None:
        """Rank 0 of a split model: the workers get the forward's metadata and its input ids,
        then run it with rank 0 (engine/parallel/workers.py)."""
        bs = self.block_size
        self.workers.step(StepMeta(
            np.asarray(positions, dtype=np.int64), np.asarray(slot_mapping, dtype=np.int64),
            [replace(s, block_table=s.block_table[:s.num_blocks(bs)])
             for s in spans]))  # what the workers' attention reads, no more
        try:
            self.group.broadcast(ids)
        except BaseException as exc:
            self.workers.fail(f"the input ids did not reach the workers ({exc})")
            raise

    @torch.inference_mode()
    def follow(self, meta) -> None:
        """A worker's share of the forward rank 0 runs (`StepMeta`): its input ids come from
        rank 0; no logits."""
        dev, long = self.device, torch.long
        ids = self.group.broadcast(torch.empty((1, len(meta.positions)), dtype=long,
                                               device=dev))
        self.forward(ids, to_device(meta.positions[None], long, dev), None,
                     self.kv.backend.build_metadata(meta.spans, meta.slot_mapping.tolist(),
                                                    self.block_size, dev))

