"""The CPU row kernel for generated tokens' attention (engine/kernels/csrc/paged_attention.cpp)
and how the SDPA backend routes rows to it."""

import pytest
import torch
import torch.nn.functional as F

from engine.attention.paged import InvariantLayout, SDPABackend, SeqSpan
from engine.kernels import cpu_ext

EXT = cpu_ext.load("paged_attention")
pytestmark = pytest.mark.skipif(isinstance(EXT, str), reason=f"no row kernel: {EXT}")
BS = 16


def _cache(kv_heads, head_dim, dtype, blocks=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (blocks * BS, kv_heads, head_dim)
    return (torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype))


def _reference(q, k_cache, v_cache, table, pos, scale):
    slots = (torch.tensor(table)[:, None] * BS + torch.arange(BS)).flatten()[:pos + 1]
    k = k_cache[slots].double().transpose(0, 1)
    v = v_cache[slots].double().transpose(0, 1)
    return F.scaled_dot_product_attention(q.double()[:, None], k, v, enable_gqa=True,
                                          scale=scale)[:, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 64), (4, 2, 128), (12, 2, 64),
                                                     (16, 1, 32)])
def test_row_kernel_equals_attention_and_a_row_never_depends_on_the_others(
        dtype, heads, kv_heads, head_dim):
    k_cache, v_cache = _cache(kv_heads, head_dim, dtype)
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(1)).tolist()
    tables = [perm[:20], perm[20:40], perm[:20], perm[40:60], perm[40:60]]
    pos = [0, 100, 15, 16, 301]  # one key; many; the end of a block; the next block's first
    q = torch.randn(5, heads, head_dim).to(dtype)
    scale = head_dim ** -0.5
    out = torch.zeros_like(q)
    rows = torch.tensor([4, 0, 1, 3, 2])
    EXT.paged_attention_rows(out, q, k_cache, v_cache, rows, torch.tensor(pos),
                             torch.tensor(tables), torch.tensor(pos) + 1,
                             torch.zeros(5, 0, dtype=torch.long), BS, scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for r in range(5):
        ref = _reference(q[rows[r]], k_cache, v_cache, tables[r], pos[r], scale)
        torch.testing.assert_close(out[rows[r]].double(), ref, atol=tol, rtol=0)
        alone = torch.zeros(1, heads, head_dim, dtype=dtype)
        EXT.paged_attention_rows(alone, q[rows[r]][None].contiguous(), k_cache, v_cache,
                                 torch.tensor([0]), torch.tensor([pos[r]]),
                                 torch.tensor([tables[r]]), torch.tensor([pos[r] + 1]),
                                 torch.zeros(1, 0, dtype=torch.long), BS, scale)
        assert torch.equal(alone[0], out[rows[r]])


def _run(backend, spans, q, k_cache, v_cache):
    meta = backend.build_metadata(spans, list(range(q.shape[0])), BS, "cpu")
    query = q.transpose(0, 1)[None]  # [1, heads, T, head_dim]
    return backend.forward(query, None, None, k_cache, v_cache, meta, q.shape[-1] ** -0.5)[0]


def test_generated_rows_take_the_kernel_whatever_the_step_and_prompt_rows_take_sdpa():
    """A span mixing a prompt's last tokens and generated tokens (a preempted sequence's
    recomputation) gives the generated rows exactly the bits of a decode step of each, and
    the prompt rows exactly what SDPA alone gives them; both agree with plain SDPA."""
    torch.manual_seed(0)
    k_cache, v_cache = _cache(2, 64, torch.bfloat16)
    table = list(range(10, 40))
    q = torch.randn(40, 4, 64).to(torch.bfloat16)
    layout = InvariantLayout(q_multiple=4, kv_multiple=512)
    kernel, sdpa = SDPABackend(layout, row_kernel=True), SDPABackend(layout)
    assert kernel.rows_ext is not None
    # rows 0..39 are positions 200..239; the prompt ends at position 220
    mixed = _run(kernel, [SeqSpan(0, 40, 240, table, prompt_len=220)], q, k_cache, v_cache)
    plain = _run(sdpa, [SeqSpan(0, 40, 240, table)], q, k_cache, v_cache)
    torch.testing.assert_close(mixed.float(), plain.float(), atol=2e-2, rtol=0)
    prompt_only = _run(sdpa, [SeqSpan(0, 20, 220, table)], q[:20].contiguous(), k_cache,
                       v_cache)
    assert torch.equal(mixed[:20], prompt_only)
    for i in (20, 27, 39):  # decode steps of single generated tokens, beside another sequence
        other = SeqSpan(1, 1, 50, list(range(40, 44)), prompt_len=30)
        step = _run(kernel, [SeqSpan(0, 1, 201 + i, table, prompt_len=220), other],
                    torch.stack([q[i], q[0]]), k_cache, v_cache)
        assert torch.equal(step[0], mixed[i])


def test_a_lock_left_by_a_killed_build_does_not_hang_the_next_start(tmp_path):
    """torch's builder leaves its lock file in the build folder when the process compiling
    is killed (a container restarted during its first start); the next load must not wait for
    it forever. A copy of the built folder with such a lock, loaded in a fresh process."""
    import os
    import shutil
    import subprocess
    import sys

    built = cpu_ext._where(*cpu_ext.KERNELS["paged_attention"])
    home = tmp_path / "home"
    folder = home / ".cache" / "specserve" / "kernels" / built.name
    shutil.copytree(built, folder)
    (folder / "lock").touch()
    code = ("from engine.kernels import cpu_ext; "
            "print(type(cpu_ext.load('paged_attention')).__name__)")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "HOME": str(home)},
                         cwd=os.getcwd(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "module", out.stderr[-2000:]
