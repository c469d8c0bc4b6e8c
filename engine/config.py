"""Engine configuration (plain dataclass; the server wraps it in its pydantic config)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

SPEC_METHODS = ("none", "draft_model", "eagle", "medusa", "ngram", "suffix", "lookahead",
                "hybrid")
MAX_LOOKAHEAD_ROWS = 64  # (window + max_candidates) x (ngram - 1): a token tree's limit
QUANTIZATION_MODES = ("none", "int8", "int4", "auto")
INT4_KERNELS = ("auto", "vnni", "torch")  # engine/kernels/quant_linear.py


@dataclass
class RecordConfig:
    """`speculative.record`: finished requests' token ids kept for training draft heads
    (engine/spec_decode/traffic.py says what, where, and how tenants stay apart)."""

    dir: str = ""
    max_gb: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.dir, str) or not self.dir:
            raise ValueError("invalid speculative config record.dir: a folder to record "
                             "finished requests' token ids in is required")
        if (not isinstance(self.max_gb, (int, float)) or isinstance(self.max_gb, bool)
                or not self.max_gb > 0):
            raise ValueError(f"invalid speculative config record.max_gb: {self.max_gb!r}, "
                             f"must be > 0")


@dataclass
class LookaheadConfig:
    """`speculative.lookahead`: lookahead decoding (engine/spec_decode/lookahead.py). Each step
    runs `window` future positions x (`ngram` - 1) past Jacobi iterations as lookahead rows
    (where the guard measures that they pay) beside up to `max_candidates` n-grams of `ngram`
    tokens from the pool, verified; (window + max_candidates) x (ngram - 1) <= 64."""

    window: int = 5
    ngram: int = 4
    max_candidates: int = 5

    def __post_init__(self) -> None:
        for name, low, high in (("window", 0, 32), ("ngram", 2, 16), ("max_candidates", 1, 32)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
                raise ValueError(f"invalid speculative config lookahead.{name}: {value!r}, "
                                 f"must be in {low}..{high}")
        rows = (self.window + self.max_candidates) * (self.ngram - 1)
        if rows > MAX_LOOKAHEAD_ROWS:
            raise ValueError(f"invalid speculative config lookahead.window: (window "
                             f"{self.window} + max_candidates {self.max_candidates}) x (ngram "
                             f"{self.ngram} - 1) = {rows} rows per step, more than a token "
                             f"tree's {MAX_LOOKAHEAD_ROWS}")


@dataclass
class SpeculativeConfig:
    # hybrid: per sequence per step, a suffix match or the model source (the draft model, or
    # the draft head `speculator` when set), whichever the cost model predicts pays most |
    # suffix | draft_model | eagle (a draft head trained from the target: `speculator`) |
    # medusa (Medusa heads trained from the target: `speculator`) | ngram (prompt lookup) |
    # lookahead (no draft: Jacobi lookahead rows and an n-gram pool, `lookahead`) | none
    method: str = "none"
    draft_model: str | None = None  # recipe name, folder or hub id (draft_model, hybrid)
    # eagle, medusa (and hybrid): the folder of a head (or Medusa heads) trained for the
    # served target (`specserve speculator train [--kind medusa]`)
    speculator: str | None = None
    # the head's linears: none | int8 | int4 | auto (int4 on the CPU, where a bf16 head would
    # cost a fifth of an int4 target's step; none on CUDA); exactness does not need it
    speculator_quantization: str = "auto"
    draft_dtype: str | None = None  # defaults to the target's dtype; exactness does not need it
    draft_gguf_file: str | None = None
    # none | int8 | int4 | auto, as engine.quantization (engine/models/quantize.py); the
    # draft's numerics never change what is emitted, only how often its drafts are accepted
    draft_quantization: str = "none"
    # draft model: score only this many tokens (added tokens, then the most frequent), not
    # the whole vocabulary: its output projection shrinks that much; a token outside is never
    # drafted, and the verifier keeps the output exact (0: the whole vocabulary)
    draft_vocab_size: int = 0
    k_max: int = 4  # most draft tokens per sequence per step (0..16)
    adaptive: bool = True  # choose k per step from measured costs; False: always k_max
    calibrate: bool = True  # time a few forward sizes at start-up to seed the cost model
    # draft model: stop drafting a sequence once the draft's own probability of the token it
    # just drafted falls below this (0: off); the verifier keeps the output exact either way.
    # Off by default: on the packaged Qwen pair it saved as much draft time as it lost tokens.
    draft_stop_confidence: float = 0.0
    ngram_min_n: int = 1
    ngram_max_n: int = 4
    # suffix (and hybrid): drafts from the longest match in the sequence's own text and in a
    # cache of earlier requests' prompts and outputs, partitioned by cache_salt (the tenant)
    suffix_cache_tokens: int = 262_144  # budget of finished requests' tokens kept (LRU)
    suffix_cross_request: bool = True  # False: each sequence matches only its own text
    suffix_max_spec_tokens: int = 32  # most drafts of one suffix proposal
    suffix_spec_factor: float = 1.0  # at most this x the match length
    suffix_min_token_prob: float = 0.1  # stop where the continuation's frequency falls below
    # token trees: a suffix proposal may branch where its earlier occurrences continue
    # differently, a draft head and the draft model draft EAGLE-2 dynamic trees (several
    # continuations verified in one forward, the most likely first); at most this many nodes
    # per sequence and step (0: chains only, the default; at most 64; docs/speculation.md).
    # Medusa prunes its stored tree to it. Lookahead's proposals are trees by construction,
    # sized by `lookahead` (max_candidates n-grams of ngram - 1 tokens, and the window's rows),
    # whatever this is. With `adaptive`, the guard drafts chains in the steps where trees
    # realized less than chains at that batch size.
    tree_max_nodes: int = 0
    # with trees on, unseeded sampled requests (verified by rejection sampling) get the head's
    # or draft model's SAMPLED trees too (children drawn from q without replacement, verified
    # with q; docs/speculation.md); off: they draft chains. Off by default: on the CPU pair
    # (int4 and bf16 targets) the draft model's sampled trees measured 0.97-0.99x its chains
    # with the guard choosing the shape per step (1.00x plain against 1.14x without it).
    sampled_trees: bool = False
    # how a seeded sampled request's drafts are verified: "coupled" accepts a draft iff the
    # target's own position-keyed race picks it, so the output is exactly the output without
    # speculation; "rejection" uses rejection sampling for them too (higher acceptance, output
    # depends on k). Unseeded sampled requests always use rejection sampling; greedy, the argmax.
    verification: str = "coupled"
    # {dir, max_gb}: keep finished requests' token ids to train a head on (off when None)
    record: RecordConfig | None = None
    # {window, ngram, max_candidates}: lookahead decoding's (method lookahead: the defaults
    # when unset); with method hybrid, set it to add the n-gram pool (and its lookahead rows)
    # as a draftless source beside suffix matches
    lookahead: LookaheadConfig | None = None

    def __post_init__(self) -> None:
        self._check_lookahead()
        if isinstance(self.record, dict):
            self.record = RecordConfig(**_known_options(RecordConfig, self.record,
                                                        "speculative.record"))
        elif self.record is not None and not isinstance(self.record, RecordConfig):
            raise ValueError(f"invalid speculative config record: {self.record!r}; use "
                             f"{{dir: FOLDER, max_gb: 1.0}}")
        if self.method not in SPEC_METHODS:
            raise ValueError(f"invalid speculative config method: {self.method!r}; "
                             f"use one of {SPEC_METHODS}")
        if not isinstance(self.k_max, int) or not 0 <= self.k_max <= 16:
            raise ValueError(f"invalid speculative config k_max: {self.k_max!r}, must be in 0..16")
        if not 0.0 <= self.draft_stop_confidence < 1.0:
            raise ValueError(f"invalid speculative config draft_stop_confidence: "
                             f"{self.draft_stop_confidence!r}, must be in [0, 1)")
        if self.verification not in ("coupled", "rejection"):
            raise ValueError(f"invalid speculative config verification: "
                             f"{self.verification!r}; use coupled or rejection")
        if self.draft_quantization not in QUANTIZATION_MODES:
            raise ValueError(f"invalid speculative config draft_quantization: "
                             f"{self.draft_quantization!r}; use one of {QUANTIZATION_MODES}")
        if self.speculator_quantization not in QUANTIZATION_MODES:
            raise ValueError(f"invalid speculative config speculator_quantization: "
                             f"{self.speculator_quantization!r}; use one of "
                             f"{QUANTIZATION_MODES}")
        if not isinstance(self.draft_vocab_size, int) or self.draft_vocab_size < 0:
            raise ValueError(f"invalid speculative config draft_vocab_size: "
                             f"{self.draft_vocab_size!r}, must be >= 0 (0: the whole "
                             f"vocabulary)")
        if self.method == "draft_model" and not self.draft_model:
            raise ValueError("invalid speculative config draft_model: method draft_model "
                             "needs a draft model")
        if self.method == "hybrid" and not (self.draft_model or self.speculator):
            raise ValueError("invalid speculative config draft_model: method hybrid needs a "
                             "draft model or a speculator (a draft head) besides suffix "
                             "matches")
        if self.method == "hybrid" and self.draft_model and self.speculator:
            raise ValueError("invalid speculative config speculator: method hybrid combines "
                             "suffix matches with one model source, a draft model or a "
                             "speculator; set one of draft_model and speculator")
        if self.method in ("eagle", "medusa") and not self.speculator:
            raise ValueError(f"invalid speculative config speculator: method {self.method} "
                             f"needs a speculator folder (train one with `specserve "
                             f"speculator train --kind {self.method}`)")
        if not isinstance(self.suffix_cache_tokens, int) or self.suffix_cache_tokens < 0:
            raise ValueError("invalid speculative config suffix_cache_tokens: must be >= 0")
        if not isinstance(self.suffix_max_spec_tokens, int) \
                or not 1 <= self.suffix_max_spec_tokens <= 256:
            raise ValueError("invalid speculative config suffix_max_spec_tokens: must be in "
                             "1..256")
        if not self.suffix_spec_factor > 0:
            raise ValueError("invalid speculative config suffix_spec_factor: must be > 0")
        self._check_trees()
        if not 0.0 <= self.suffix_min_token_prob <= 1.0:
            raise ValueError("invalid speculative config suffix_min_token_prob: must be in "
                             "[0, 1]")

    def _check_trees(self) -> None:
        if not isinstance(self.tree_max_nodes, int) or not 0 <= self.tree_max_nodes <= 64:
            raise ValueError(f"invalid speculative config tree_max_nodes: "
                             f"{self.tree_max_nodes!r}, must be in 0..64 (0: chains only)")
        if not isinstance(self.sampled_trees, bool):
            raise ValueError(f"invalid speculative config sampled_trees: "
                             f"{self.sampled_trees!r}, must be true or false")

    def _check_lookahead(self) -> None:
        if isinstance(self.lookahead, dict):
            self.lookahead = LookaheadConfig(**_known_options(LookaheadConfig, self.lookahead,
                                                              "speculative.lookahead"))
        elif self.lookahead is not None and not isinstance(self.lookahead, LookaheadConfig):
            raise ValueError(f"invalid speculative config lookahead: {self.lookahead!r}; use "
                             f"{{window: 5, ngram: 4, max_candidates: 5}}")
        if self.method == "lookahead" and self.lookahead is None:
            self.lookahead = LookaheadConfig()
        if self.lookahead is not None and self.method not in ("lookahead", "hybrid"):
            raise ValueError(f"invalid speculative config lookahead: method {self.method} does "
                             f"not use it (lookahead or hybrid do)")

    @property
    def enabled(self) -> bool:
        """k_max bounds the draft model's and prompt lookup's drafts; suffix proposals have
        their own bound."""
        return self.method in ("suffix", "lookahead") or (self.method != "none"
                                                          and self.k_max > 0)

    @property
    def max_tree_nodes(self) -> int:
        """The most nodes of one sequence's token tree in a step (0: its drafts are chains):
        tree_max_nodes, or lookahead's rows where it runs."""
        if not self.enabled:
            return 0
        return max(self.tree_max_nodes, MAX_LOOKAHEAD_ROWS if self.lookahead is not None else 0)

    @property
    def uses_draft_model(self) -> bool:
        return self.enabled and (self.method == "draft_model"
                                 or (self.method == "hybrid" and not self.speculator))

    @property
    def uses_head(self) -> bool:
        """Draft heads reading the target's hidden states (engine/spec_decode/eagle.py,
        medusa.py): eagle, medusa, or hybrid with a speculator."""
        return self.enabled and (self.method in ("eagle", "medusa")
                                 or (self.method == "hybrid" and bool(self.speculator)))


@dataclass
class EngineConfig:
    model: str = "smollm2-135m-instruct"  # recipe name, local folder or hub id
    tokenizer: str | None = None  # defaults to the model's
    gguf_file: str | None = None
    dtype: str = "float32"
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    # weight-only quantized linears (engine/models/quantize.py): none | int8 | int4 | auto
    # (auto: int4 on the CPU, the GGUF's own 4-bit blocks kept and its other layers
    # re-quantized to int4; none on CUDA or without a GGUF source). Output is exact for the
    # weights served: greedy with speculation == greedy without; it differs from the
    # unquantized model's as any quantized model's does.
    quantization: str = "none"
    # int4 linears of the target and the draft on the CPU: vnni (our AVX-512 VNNI kernel,
    # activations quantized to int8 per group of 32 as llama.cpp does), torch (torch's
    # weight-only kernel, activations as they are), auto (vnni where the CPU has it)
    int4_kernel: str = "auto"
    model_cache_dir: str | None = None  # where recipes live (default ~/.cache/specserve/models)
    block_size: int = 16
    num_blocks: int | None = None  # None: sized from kv_cache_memory_gb
    kv_cache_memory_gb: float = 2.0
    # CUDA: the engine plans at most this fraction of the device's memory; the KV pool gets
    # kv_cache_memory_gb or what is left after weights, the largest step and the CUDA graphs
    gpu_memory_utilization: float = 0.9
    max_num_batched_tokens: int = 2048  # token budget of one step
    max_num_seqs: int = 64
    max_model_len: int | None = None  # None: the model's, capped by what the pool can hold
    enable_prefix_caching: bool = True
    seed: int = 0  # for requests without a seed of their own
    num_threads: int | None = None  # torch CPU threads; None leaves torch's default
    cpu_matmul_autotune: bool = True  # time matmul forms for few-row linears at start-up (CPU)
    # measure and install the batch-invariance rule on the target at start-up (a row's logits
    # do not depend on the other rows of the call, so greedy and seeded output do not change
    # with speculation or batching; replaces the autotune for the target; see README)
    batch_invariant: bool = True
    # auto: the Triton paged-attention kernel on CUDA (when triton is installed), PyTorch SDPA
    # on CPU | sdpa | triton (on CPU only through Triton's interpreter: slow, for tests)
    attention_backend: str = "auto"
    # triton backend: compute generated tokens' rows in splits of this many keys (split-KV,
    # for long contexts at small batch; a multiple of 32) | 0: one split (the default)
    attention_kv_split: int = 0
    # steps of short sequences (decode, verification of 1 + k, draft steps) in padded static
    # buckets of these batch sizes x (1 + k_max) tokens: auto = captured as CUDA graphs on CUDA
    # with the triton backend, off elsewhere | off | static (the buckets without capture, on
    # any device: how the CPU tests cover them). Longer steps run eagerly.
    cuda_graphs: str = "auto"
    cuda_graph_batch_sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64,
                                                                        128])
    # split the target's attention heads and MLP over this many ranks (one process and one
    # device each: cuda:0..N-1, or the CPU cores; engine/parallel/); rank 0 schedules, samples
    # and runs the draft model or head. kv_cache_memory_gb is per rank.
    tensor_parallel_size: int = 1
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    @classmethod
    def from_dict(cls, data: dict) -> "EngineConfig":
        """The `engine:` section of a config file; an unknown option is an error naming it."""
        return cls(**_known_options(cls, data, "engine"))

    def __post_init__(self) -> None:
        if isinstance(self.speculative, dict):
            self.speculative = SpeculativeConfig(
                **_known_options(SpeculativeConfig, self.speculative, "speculative"))
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"invalid engine config {name}: must be >= 1")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError("invalid engine config num_blocks: must be >= 1")
        if self.kv_cache_memory_gb <= 0:
            raise ValueError("invalid engine config kv_cache_memory_gb: must be > 0")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("invalid engine config gpu_memory_utilization: must be in (0, 1]")
        if self.quantization not in QUANTIZATION_MODES:
            raise ValueError(f"invalid engine config quantization: {self.quantization!r}; "
                             f"use one of {QUANTIZATION_MODES}")
        if self.int4_kernel not in INT4_KERNELS:
            raise ValueError(f"invalid engine config int4_kernel: {self.int4_kernel!r}; "
                             f"use one of {INT4_KERNELS}")
        if self.attention_backend not in ("auto", "sdpa", "triton"):
            raise ValueError(f"invalid engine config attention_backend: "
                             f"{self.attention_backend!r}; use auto, sdpa or triton")
        if (not isinstance(self.attention_kv_split, int) or self.attention_kv_split < 0
                or self.attention_kv_split % 32):
            raise ValueError(f"invalid engine config attention_kv_split: "
                             f"{self.attention_kv_split!r}; use 0 (off) or a positive multiple "
                             f"of 32")
        if self.cuda_graphs not in ("auto", "off", "static"):
            raise ValueError(f"invalid engine config cuda_graphs: {self.cuda_graphs!r}; use "
                             f"auto, off or static")
        if not self.cuda_graph_batch_sizes or any(
                not isinstance(b, int) or b < 1 for b in self.cuda_graph_batch_sizes):
            raise ValueError("invalid engine config cuda_graph_batch_sizes: positive integers")
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"invalid engine config tensor_parallel_size: "
                             f"{self.tensor_parallel_size!r}, must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("invalid engine config max_model_len: must be >= 2")


def _known_options(cls, data: dict, section: str) -> dict:
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"unknown {section} option(s) {unknown}; known: {sorted(known)}")
    return data
