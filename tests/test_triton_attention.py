"""The Triton paged-attention kernel against PyTorch SDPA, its batch invariance, and an engine
running on it. On a machine without CUDA the kernel runs in Triton's interpreter (conftest sets
TRITON_INTERPRET=1), the same code a GPU compiles."""

from __future__ import annotations

import pytest
import torch
from conftest import build_tiny_model, clone_model, random_prompts

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.attention.paged import SDPABackend, SeqSpan
from engine.attention.triton_backend import TritonBackend, available

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not available(), reason="triton is not installed")]

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def attention(backend, q, k_cache, v_cache, spans, block_size, prompt_len=None):
    """Run one layer's attention for `spans` ((first position, new tokens, block table) per
    sequence); q holds every new token's query, in order. Rows at positions >= prompt_len are
    generated tokens' (split by a split-KV backend)."""
    seq_spans, slots, start = [], [], 0
    for first, q_len, table in spans:
        seq_spans.append(SeqSpan(start, q_len, first + q_len, table, prompt_len))
        slots += [table[p // block_size] * block_size + p % block_size
                  for p in range(first, first + q_len)]
        start += q_len
    meta = backend.build_metadata(seq_spans, slots, block_size, DEVICE)
    idx = torch.tensor(slots, device=DEVICE)
    query = q.transpose(0, 1)[None]  # [1, heads, T, D]
    return backend.forward(query, k_cache[idx].transpose(0, 1)[None],
                           v_cache[idx].transpose(0, 1)[None], k_cache, v_cache, meta,
                           q.shape[-1] ** -0.5)[0]


def shuffled_tables(num_seqs, blocks_each, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(num_seqs * blocks_each, generator=g).tolist()
    return [ids[i * blocks_each:(i + 1) * blocks_each] for i in range(num_seqs)]


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2),
                                        (torch.float16, 4e-3)])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size",
                         [(4, 2, 64, 16), (4, 1, 128, 32), (2, 2, 64, 16), (6, 2, 128, 64)])
def test_kernel_matches_sdpa_on_a_ragged_batch(dtype, atol, heads, kv_heads, head_dim,
                                               block_size):
    g = torch.Generator().manual_seed(1)
    # (first position, new tokens): decodes, a verification of 1 + 4, a prompt chunk with a
    # past, a whole prompt, a long decode
    shape = [(37, 1), (20, 5), (16, 40), (0, 23), (90, 1), (3, 1)]
    max_ctx = max(f + n for f, n in shape)
    blocks_each = -(-max_ctx // block_size)
    tables = shuffled_tables(len(shape), blocks_each)
    spans = [(f, n, t) for (f, n), t in zip(shape, tables)]
    num_slots = len(shape) * blocks_each * block_size
    k_cache = torch.randn(num_slots, kv_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    v_cache = torch.randn(num_slots, kv_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    q = torch.randn(sum(n for _, n in shape), heads, head_dim, generator=g).to(dtype).to(DEVICE)
    got = attention(TritonBackend(), q, k_cache, v_cache, spans, block_size)
    want = attention(SDPABackend(), q, k_cache, v_cache, spans, block_size)
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=0)


@pytest.mark.parametrize("kv_split,prompt_len", [(0, None), (32, 30), (64, 0)])
def test_kernel_rows_do_not_depend_on_the_batch(kv_split, prompt_len):
    """Every token's output has the same bits computed in a whole prompt, as decodes, inside
    verifications, in prompt chunks with a past, and beside other sequences; with split-KV too
    (its generated rows split at fixed boundaries, its prompt rows whole)."""
    g = torch.Generator().manual_seed(2)
    n, block_size, heads, kv_heads, d = 90, 16, 4, 2, 64
    table = shuffled_tables(1, -(-n // block_size))[0]
    for dtype in (torch.bfloat16, torch.float32):
        k_cache = torch.randn(len(table) * block_size, kv_heads, d, generator=g).to(dtype)
        v_cache = torch.randn(len(table) * block_size, kv_heads, d, generator=g).to(dtype)
        q = torch.randn(n, heads, d, generator=g).to(dtype)
        backend = TritonBackend(kv_split)

        def run(layout, backend=backend, q=q, k_cache=k_cache, v_cache=v_cache):
            positions = [p for first, q_len in layout for p in range(first, first + q_len)]
            out = attention(backend, q[positions].to(DEVICE), k_cache.to(DEVICE),
                            v_cache.to(DEVICE), [(f, m, table) for f, m in layout], block_size,
                            prompt_len)
            return positions, out

        _, whole = run([(0, n)])
        for layout in ([(p, 1) for p in range(5, n, 7)],
                       [(p, 5) for p in range(2, n - 5, 11)],
                       [(0, 17), (17, 40), (57, 33)],
                       [(n - 20, 20), (4, 1), (30, 3), (61, 9)]):
            positions, out = run(layout)
            assert torch.equal(out, whole[positions]), (dtype, layout)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("kv_split", [32, 64])
def test_split_kv_matches_sdpa_and_one_split_keeps_the_bits(dtype, atol, kv_split):
    """Split-KV over contexts of up to 4 splits equals SDPA; prompt rows, and generated rows
    whose keys fit in one split, have exactly the bits of the kernel without splits."""
    g = torch.Generator().manual_seed(3)
    heads, kv_heads, head_dim, block_size, prompt_len = 6, 2, 64, 16, 20
    shape = [(37, 1), (20, 5), (16, 40), (0, 23), (120, 1), (3, 1), (60, 3)]
    max_ctx = max(f + n for f, n in shape)
    blocks_each = -(-max_ctx // block_size)
    tables = shuffled_tables(len(shape), blocks_each, seed=1)
    spans = [(f, n, t) for (f, n), t in zip(shape, tables)]
    num_slots = len(shape) * blocks_each * block_size
    k_cache = torch.randn(num_slots, kv_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    v_cache = torch.randn(num_slots, kv_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    q = torch.randn(sum(n for _, n in shape), heads, head_dim, generator=g).to(dtype).to(DEVICE)
    split = attention(TritonBackend(kv_split), q, k_cache, v_cache, spans, block_size,
                      prompt_len)
    want = attention(SDPABackend(), q, k_cache, v_cache, spans, block_size)
    torch.testing.assert_close(split.float(), want.float(), atol=atol, rtol=0)
    one = attention(TritonBackend(), q, k_cache, v_cache, spans, block_size)
    positions = torch.tensor([p for f, n in shape for p in range(f, f + n)])
    same = (positions < prompt_len) | (positions < kv_split)
    assert torch.equal(split[same.to(DEVICE)], one[same.to(DEVICE)])
    if dtype == torch.float32:  # rows over several splits reduce differently (in bf16 the
        assert not torch.equal(split, one)  # difference may round away)


def test_split_kv_must_be_a_multiple_of_the_key_tile():
    with pytest.raises(ValueError, match="attention_kv_split"):
        TritonBackend(48)


def test_engine_on_the_triton_backend_matches_sdpa_and_speculates_exactly():
    target = build_tiny_model("qwen2")
    prompts = random_prompts([3, 20, 9, 33], seed=4)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def engine(backend, method="none"):
        from engine.config import SpeculativeConfig

        spec = SpeculativeConfig(method=method, k_max=3, adaptive=False, calibrate=False)
        return LLMEngine(EngineConfig(num_blocks=64, attention_backend=backend,
                                      batch_invariant=False, cpu_matmul_autotune=False,
                                      speculative=spec),
                         model=clone_model(target).to(DEVICE))

    sdpa = [o.output_token_ids for o in engine("sdpa").generate(prompts, params)]
    eng = engine("triton")
    assert type(eng.runner.kv.backend).__name__ == "TritonBackend"
    assert [o.output_token_ids for o in eng.generate(prompts, params)] == sdpa
    spec = engine("triton", "ngram")
    assert [o.output_token_ids for o in spec.generate(prompts, params)] == sdpa
    assert spec.block_manager.num_free_blocks == spec.block_manager.num_blocks


def test_unknown_attention_backend_is_a_config_error():
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(attention_backend="flash")


def _static_engine(target, backend, graphs, method="none", draft=None, num_blocks=64, **spec):
    """An engine on a copy of `target` (and `draft`) with `backend` attention and
    `cuda_graphs` `graphs` (buckets of 1..8 sequences), speculating with `method` (k_max 3,
    not adaptive; `spec`: further SpeculativeConfig fields)."""
    from engine.config import SpeculativeConfig

    config = SpeculativeConfig(method=method, k_max=3, adaptive=False, calibrate=False,
                               draft_model="in-memory" if draft is not None else None, **spec)
    return LLMEngine(EngineConfig(num_blocks=num_blocks, attention_backend=backend,
                                  cuda_graphs=graphs, cuda_graph_batch_sizes=[1, 2, 4, 8],
                                  batch_invariant=False, cpu_matmul_autotune=False,
                                  speculative=config),
                     model=clone_model(target),
                     draft_model=clone_model(draft) if draft is not None else None)


@pytest.mark.parametrize("method", ["none", "draft_model", "suffix"])
def test_static_padded_steps_give_the_eager_engine_s_tokens(method):
    """cuda_graphs: static runs decode and verification steps in padded static buckets (the
    CUDA-graph path without the capture); greedy output equals the eager SDPA engine's."""
    target = build_tiny_model("qwen2").to(DEVICE)
    draft = build_tiny_model("qwen2", seed=1).to(DEVICE) if method == "draft_model" else None
    prompts = random_prompts([3, 20, 9, 33, 14], seed=5)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)

    want = [o.output_token_ids for o in
            _static_engine(target, "sdpa", "off").generate(prompts, params)]
    eng = _static_engine(target, "triton", "static", method, draft)
    got = eng.generate(prompts + prompts[:2], params)
    assert [o.output_token_ids for o in got] == want + want[:2]
    assert eng.runner.static.num_static > 0 and eng.runner.static.num_replays == 0
    if draft is not None:
        assert eng.speculator.proposer.runner.static.num_static > 0
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


@pytest.mark.parametrize("method", ["draft_model", "lookahead"])
def test_static_token_tree_steps_give_the_eager_engine_s_tokens(method):
    """Token trees in static buckets (each row a span of its own; CUDA graphs replay them):
    the draft model's dynamic trees (its node forwards in its own runner's tree buckets too),
    lookahead's pool and window; greedy and coupled seeded requests arriving one after
    another: the eager SDPA engine's tokens without speculation."""
    from conftest import staggered

    target = build_tiny_model("qwen2").to(DEVICE)
    draft = build_tiny_model("qwen2", seed=1).to(DEVICE) if method == "draft_model" else None
    base = random_prompts([14, 9, 20, 6], seed=21)
    prompts = [b * 2 for b in base][:2]
    if draft is None:  # texts that repeat with variations: the n-gram pool's trees
        prompts += [b[:len(b) // 2] + [(t * 3) % 300 + 5 for t in b[len(b) // 2:]] + b
                    for b in base[:2]]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True) if i % 2 else
              SamplingParams(temperature=0.8, seed=i, max_tokens=12, ignore_eos=True)
              for i in range(len(prompts))]

    want = [o.output_token_ids for o in
            staggered(_static_engine(target, "sdpa", "off"), prompts, params)]
    eng = _static_engine(target, "triton", "static", method, draft, num_blocks=96,
                         tree_max_nodes=8, lookahead={"window": 2, "ngram": 3,
                                                     "max_candidates": 2}
                         if method == "lookahead" else None)
    got = staggered(eng, prompts, params)
    assert [o.output_token_ids for o in got] == want
    assert eng.speculator.stats.num_tree_verifications > 0
    static = eng.runner.static
    assert any(key[2] for key in static._buckets)  # trees ran in tree buckets
    assert static.num_replays == 0
    if draft is not None:  # the draft model's tree-node forwards in its tree buckets
        assert any(key[2] for key in eng.speculator.proposer.runner.static._buckets)
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


@pytest.mark.parametrize("kv_split", [0, 32])
def test_a_static_tree_bucket_gives_every_row_the_eager_bits(kv_split):
    """A verification of a token tree (across a block boundary) beside a chain, then a
    proposer's tree-node rows: every row's logits in the static tree bucket are the eager
    forward's (the rows off the accepted path too)."""
    from engine.batch import Drafts, RunItem
    from engine.model_runner import ModelRunner

    model = build_tiny_model("qwen2").to(DEVICE)

    def runner(static):
        r = ModelRunner(clone_model(model), 32, 8, attention_backend="triton",
                        attention_kv_split=kv_split)
        if static:
            r.enable_static_steps((1, 2, 4), 8, 128, capture=False, tree_tokens=9)
        return r

    prompts = random_prompts([13, 21], seed=3)
    tables = [[0, 1, 2, 3, 4, 5], [8, 9, 10, 11, 12, 13]]
    steps = [  # (items, drafts)
        ([RunItem(p, 0, t, 1, len(p)) for p, t in zip(prompts, tables)], None),
        ([RunItem([5], 13, tables[0], 9, 13), RunItem([6], 21, tables[1], 4, 21)],
         Drafts.gather([([11, 12, 13, 14, 15, 16, 17, 18], None), ([21, 22, 23], None)],
                       DEVICE, [[-1, -1, 0, 0, 1, 3, 5, 2], None])),
        # nodes of depth 1 and 2 (ancestors' slots, then their own) beside a chain row
        ([RunItem([30], 14, tables[0], 1, 13, tree_keys=(19,)),
          RunItem([31], 15, tables[0], 1, 13, tree_keys=(19, 23)),
          RunItem([32], 25, tables[1], 1, 21)], None),
    ]
    eager, static = runner(False), runner(True)
    for items, drafts in steps:
        want = eager.execute(items, drafts)
        got = static.execute(items, drafts)
        # (the linears of this runner are not batch-invariant: a bucket's padded rows may
        # move a row's last bits; a wrong key moves them by far more)
        torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=0)
        assert got.row_offsets == want.row_offsets
    assert {key for key in static.static._buckets if key[2]} == {(2, 16, True), (4, 1, True)}


def test_static_steps_need_the_triton_backend():
    with pytest.raises(ValueError, match="cuda_graphs"):
        LLMEngine(EngineConfig(num_blocks=16, attention_backend="sdpa", cuda_graphs="static"),
                  model=build_tiny_model("qwen2"))


@pytest.mark.parametrize("defer_reads", [False, True])
def test_static_steps_equal_eager_seeded_at_bucket_edges_while_the_batch_shrinks(defer_reads):
    """Seeded sampling with the draft model (coupled verification: the tokens plain decoding
    gives), 5 sequences that finish one after another, so steps cross the buckets 8 -> 4 -> 2
    -> 1 and run 1 + 3 tokens (the widest bucket) as well as fewer; the draft's chained
    forwards (defer_reads) feed the static buckets from the device."""
    from engine.config import SpeculativeConfig

    target = build_tiny_model("qwen2").to(DEVICE)
    draft = build_tiny_model("qwen2", seed=1).to(DEVICE)
    prompts = random_prompts([3, 20, 9, 33, 14], seed=6)
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=10 + i, max_tokens=n,
                             ignore_eos=True) for i, n in enumerate([3, 7, 12, 16, 21])]

    def engine(graphs, method):
        spec = SpeculativeConfig(method=method, k_max=3, adaptive=False, calibrate=False,
                                 draft_model="in-memory" if method != "none" else None)
        eng = LLMEngine(EngineConfig(num_blocks=64, attention_backend="triton",
                                     cuda_graphs=graphs, cuda_graph_batch_sizes=[1, 2, 4, 8],
                                     batch_invariant=False, cpu_matmul_autotune=False,
                                     speculative=spec),
                        model=clone_model(target),
                        draft_model=clone_model(draft) if method != "none" else None)
        if method != "none":
            eng.speculator.proposer.defer_reads = defer_reads
        return eng

    want = [o.output_token_ids for o in engine("off", "none").generate(prompts, params)]
    eng = engine("static", "draft_model")
    assert [o.output_token_ids for o in eng.generate(prompts, params)] == want
    static = eng.runner.static
    assert static.num_static > 0
    assert {key[0] for key in static._buckets} >= {1, 2, 4, 8}
    assert eng.speculator.stats.num_draft_tokens > 0
    assert eng.speculator.proposer.runner.static.num_static > 0
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_split_kv_engine_output_does_not_change_with_speculation_batching_or_buckets():
    """attention_kv_split 32 on contexts of up to 2 splits: greedy output is the same plain
    and eager, with prompt lookup (eager verifications), with a draft model in static buckets,
    and batched beside repeats of its prompts; a preempted sequence's recompute (a prompt
    chunk holding generated rows) splits them as its decodes did."""
    from engine.config import SpeculativeConfig

    target = build_tiny_model("qwen2").to(DEVICE)
    draft = build_tiny_model("qwen2", seed=1).to(DEVICE)
    prompts = random_prompts([3, 33, 24], seed=7)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def engine(graphs, method, **kw):
        spec = SpeculativeConfig(method=method, k_max=3, adaptive=False, calibrate=False,
                                 draft_model="in-memory" if method == "draft_model" else None)
        cfg = dict(num_blocks=64, attention_backend="triton", attention_kv_split=32,
                   max_model_len=64, cuda_graphs=graphs, cuda_graph_batch_sizes=[1, 2, 8],
                   batch_invariant=False, cpu_matmul_autotune=False,
                   speculative=spec)
        cfg.update(kw)
        return LLMEngine(EngineConfig(**cfg), model=clone_model(target),
                         draft_model=clone_model(draft) if method == "draft_model" else None)

    plain = engine("off", "none")
    assert plain.runner.kv.backend.kv_split == 32
    want = [o.output_token_ids for o in plain.generate(prompts, params)]
    ngram = engine("off", "ngram")
    assert [o.output_token_ids for o in ngram.generate(prompts, params)] == want
    static = engine("static", "draft_model")
    got = static.generate(prompts + prompts[:2], params)
    assert [o.output_token_ids for o in got] == want + want[:2]
    assert static.runner.static.num_static > 0
    tight = engine("off", "none", num_blocks=7, block_size=8)  # 56 slots: preemptions
    assert [o.output_token_ids for o in tight.generate(prompts, params)] == want
    assert tight.scheduler.stats.num_preemptions > 0


def test_split_kv_needs_the_triton_backend():
    with pytest.raises(ValueError, match="attention_kv_split"):
        LLMEngine(EngineConfig(num_blocks=16, attention_backend="sdpa", attention_kv_split=32),
                  model=build_tiny_model("qwen2"))
    with pytest.raises(ValueError, match="attention_kv_split"):
        EngineConfig(attention_kv_split=40)


def test_the_triton_backend_on_a_cpu_model_needs_the_interpreter(monkeypatch):
    """Compiled Triton launches only on CUDA tensors: a CPU model with attention_backend triton
    is a config error at start, not a failed first step."""
    from engine.attention import triton_backend

    monkeypatch.setattr(triton_backend, "INTERPRETED", False)
    with pytest.raises(ValueError, match="attention_backend triton needs a CUDA model"):
        LLMEngine(EngineConfig(num_blocks=16, attention_backend="triton"),
                  model=build_tiny_model("qwen2"))
