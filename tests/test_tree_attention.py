"""Token trees in attention: a tree's node attends to the committed tokens and its own ancestors
only, and gets the bits of the same path verified as a chain, on every backend."""

import pytest
import torch

from engine.attention.paged import InvariantLayout, SDPABackend, SeqSpan, expand_trees
from engine.batch import Drafts, check_tree, tree_paths
from engine.kernels import cpu_ext

BS = 16
PARENTS = (-1, -1, 0, 0, 1, 3, 5, 2)  # two roots' children; depths 1 1 2 2 2 3 4 3
# committed tokens before the tree (the last one is the span's first row): 37, the tree within
# one block; 45, across two (a node's own slot then lies in a block past its keys' count)
CONTEXTS = (37, 45)


def _caches(kv_heads, head_dim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (64 * BS, kv_heads, head_dim)
    return torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)


def _run(backend, spans, q, k_cache, v_cache, rows):
    meta = backend.build_metadata(spans, list(range(rows)), BS, "cpu")
    query = q.transpose(0, 1)[None]
    return backend.forward(query, None, None, k_cache, v_cache, meta, q.shape[-1] ** -0.5)[0]


def _tree_vs_chains(backend, dtype, context, heads=4, kv_heads=2, head_dim=64):
    """Each node of PARENTS verified in one tree, and its path verified as a chain (own cache,
    the path's K/V at consecutive positions): the node's row equals the chain's last row."""
    k_tree, v_tree = _caches(kv_heads, head_dim, dtype)
    g = torch.Generator().manual_seed(1)
    node_k = torch.randn(len(PARENTS), kv_heads, head_dim, generator=g).to(dtype)
    node_v = torch.randn(len(PARENTS), kv_heads, head_dim, generator=g).to(dtype)
    q = torch.randn(1 + len(PARENTS), heads, head_dim, generator=g).to(dtype)
    table = torch.randperm(64, generator=g)[:8].tolist()
    slot = lambda p: table[p // BS] * BS + p % BS  # noqa: E731
    first = context  # the tree's first node's slot position
    for j in range(len(PARENTS)):
        k_tree[slot(first + j)], v_tree[slot(first + j)] = node_k[j], node_v[j]
    span = SeqSpan(0, 1 + len(PARENTS), first + len(PARENTS), table, prompt_len=10,
                   parents=PARENTS)
    tree = _run(backend, [span], q, k_tree, v_tree, 1 + len(PARENTS))
    for j, path in enumerate(tree_paths(list(PARENTS))):
        k_chain, v_chain = k_tree.clone(), v_tree.clone()
        for d, node in enumerate(path):
            k_chain[slot(first + d)], v_chain[slot(first + d)] = node_k[node], node_v[node]
        chain_q = torch.cat([q[:1], q[[1 + n for n in path]]])
        chain = _run(backend, [SeqSpan(0, 1 + len(path), first + len(path), table,
                                       prompt_len=10)], chain_q, k_chain, v_chain,
                     1 + len(path))
        assert torch.equal(tree[1 + j], chain[-1]), f"node {j} (path {path})"
        assert torch.equal(tree[0], chain[0])  # the committed token's row


@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_row_kernel_gives_a_node_its_chain_bits(dtype, context):
    backend = SDPABackend(InvariantLayout(q_multiple=4, kv_multiple=512), row_kernel=True)
    if backend.rows_ext is None:
        pytest.skip(f"no row kernel: {cpu_ext.load('paged_attention')}")
    _tree_vs_chains(backend, dtype, context)


@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sdpa_with_the_invariant_layout_gives_a_node_its_chain_bits(dtype, context):
    _tree_vs_chains(SDPABackend(InvariantLayout(q_multiple=4, kv_multiple=512)), dtype,
                    context)


@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("kv_split", [0, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_gives_a_node_its_chain_bits(dtype, kv_split, context):
    """Through Triton's interpreter here (conftest), the code a GPU compiles."""
    from engine.attention.triton_backend import TritonBackend, available

    if not available():
        pytest.skip("triton is not installed")
    _tree_vs_chains(TritonBackend(kv_split), dtype, context)


def test_a_node_attends_to_its_ancestors_only():
    """Against a float64 reference over the committed keys and the node's path."""
    backend = SDPABackend()
    k, v = _caches(2, 32, torch.float32)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1 + len(PARENTS), 4, 32, generator=g)
    table = list(range(8))
    span = SeqSpan(0, 1 + len(PARENTS), CONTEXTS[0] + len(PARENTS), table, parents=PARENTS)
    out = _run(backend, [span], q, k, v, 1 + len(PARENTS))
    for j, path in enumerate(tree_paths(list(PARENTS))):
        keys = list(range(CONTEXTS[0])) + [CONTEXTS[0] + a for a in path]
        kk, vv = k[keys].double().transpose(0, 1), v[keys].double().transpose(0, 1)
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[1 + j].double()[:, None], kk, vv, enable_gqa=True, scale=32 ** -0.5)[:, 0]
        torch.testing.assert_close(out[1 + j].double(), ref, atol=1e-5, rtol=0)


def test_expand_trees_makes_each_node_a_span_over_its_path():
    spans = expand_trees([SeqSpan(3, 3, 12, [0], 5, parents=(-1, -1))])
    assert spans == [SeqSpan(3, 1, 10, [0], 5),
                     SeqSpan(4, 1, 11, [0], 5, tree_keys=(10,)),
                     SeqSpan(5, 1, 11, [0], 5, tree_keys=(11,))]


@pytest.mark.parametrize("parents,error", [
    ([-1, 0, 5], "parent 5"), ([-1, 1], "parent 1"), ([0], "parent 0"), ([-2], "parent -2"),
    (list(range(-1, 64)), "larger than the limit")])
def test_bad_trees_are_refused_where_built(parents, error):
    with pytest.raises(ValueError, match=error):
        check_tree(parents)
    with pytest.raises(ValueError, match=error):
        Drafts.gather([(list(range(len(parents))), None)], torch.device("cpu"), [parents])


def test_chains_given_as_trees_are_chains():
    drafts = Drafts.gather([([5, 6], None), ([7], None)], torch.device("cpu"),
                           [[-1, 0], None])
    assert drafts.parents is None and drafts.parents_of(0) is None
    tree = Drafts.gather([([5, 6], None), ([7], None)], torch.device("cpu"), [[-1, -1], None])
    assert tree.parents_of(0) == [-1, -1] and tree.parents_of(1) is None
