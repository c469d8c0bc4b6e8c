"""Where greedy output on CUDA starts to depend on how a step is run: a small bf16 model's
greedy tokens alone vs batched under each engine mode, the Triton kernel against an SDPA
reference, and a linear layer's row bits against the call's row count.

    python scripts/gpu_exactness_probe.py   (on a machine with an NVIDIA GPU)
"""

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from conftest import build_tiny_model, random_prompts  # noqa: E402

from engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from engine.config import SpeculativeConfig  # noqa: E402


def engine(method="none", **kw):
    target = build_tiny_model("qwen2", seed=0, dtype=torch.bfloat16, num_layers=3).cuda()
    draft = (build_tiny_model("qwen2", seed=0, dtype=torch.bfloat16, num_layers=3).cuda()
             if method == "draft_model" else None)
    spec = SpeculativeConfig(method=method, draft_model="in-memory" if draft else None,
                             k_max=4, adaptive=False, calibrate=False)
    return LLMEngine(EngineConfig(num_blocks=512, max_num_seqs=16, speculative=spec, **kw),
                     model=target, draft_model=draft)


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def main() -> None:
    engines()
    for part in (linears, attention):
        try:
            part()
        except Exception as exc:  # noqa: BLE001 - report, go on with the next part
            print(f"{part.__name__}: {type(exc).__name__}: {exc}", flush=True)


def engines() -> None:
    prompts = random_prompts([5, 40, 17, 90], seed=3)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    reference = None
    for method, kw in [("none", dict(cuda_graphs="off")), ("none", dict(cuda_graphs="static")),
                       ("none", dict(cuda_graphs="auto")),
                       ("none", dict(cuda_graphs="off", attention_backend="sdpa")),
                       ("none", dict(cuda_graphs="off", batch_invariant=False)),
                       ("ngram", dict(cuda_graphs="off")),
                       ("draft_model", dict(cuda_graphs="off"))]:
        try:
            eng = engine(method, **kw)
            alone = [eng.generate([p], params)[0].output_token_ids for p in prompts]
            batched = [o.output_token_ids for o in eng.generate(prompts, params)]
            inv = eng.runner.invariance
            reference = reference or alone
            st = eng.speculator.stats
            print(f"{method:11s} {kw}: invariant={inv.invariant if inv else None} "
                  f"alone==batched {[a == b for a, b in zip(alone, batched)]} "
                  f"alone==reference {[a == b for a, b in zip(alone, reference)]} "
                  f"first divergence {[first_difference(a, b) for a, b in zip(alone, batched)]}"
                  + (f" acceptance {st.acceptance_rate:.3f}" if st else ""), flush=True)
        except Exception as exc:  # noqa: BLE001
            print(f"{method} {kw}: {type(exc).__name__}: {exc}", flush=True)



def linears() -> None:
    """A linear's row bits against the row count of the call."""
    torch.manual_seed(0)
    for k, n in ((64, 64), (896, 4864), (1536, 8960)):
        w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda")
        x = torch.randn(256, k, dtype=torch.bfloat16, device="cuda")
        one = F.linear(x[:1], w)
        same = [m for m in (1, 2, 3, 4, 5, 8, 16, 32, 64, 128, 256)
                if torch.equal(F.linear(x[:m], w)[:1], one)]
        print(f"F.linear {k}->{n}: row 0 bit-equal to M=1 at M in {same}", flush=True)



def attention() -> None:
    """The Triton kernel against SDPA on one decode row, unused cache slots 0 or NaN."""
    from engine.attention.paged import SDPABackend, SeqSpan
    from engine.attention.triton_backend import TritonBackend

    heads, kv_heads, d, bs, ctx = 4, 2, 64, 16, 37
    table = [3, 1, 2]
    slots = 4 * bs
    k_cache = torch.randn(slots, kv_heads, d, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.randn_like(k_cache)
    for garbage in (0.0, float("nan")):
        k_cache[table[-1] * bs + ctx % bs:], v_cache[table[-1] * bs + ctx % bs:] = garbage, garbage
        q = torch.randn(1, heads, 1, d, dtype=torch.bfloat16, device="cuda")
        outs = []
        for backend in (SDPABackend(), TritonBackend()):
            meta = backend.build_metadata([SeqSpan(0, 1, ctx, table)],
                                          [table[(ctx - 1) // bs] * bs + (ctx - 1) % bs], bs,
                                          torch.device("cuda"))
            pos = table[(ctx - 1) // bs] * bs + (ctx - 1) % bs
            kv = k_cache[pos].transpose(0, 1)[None, :, None]
            vv = v_cache[pos].transpose(0, 1)[None, :, None]
            outs.append(backend.forward(q, kv, vv, k_cache, v_cache, meta, d ** -0.5).float())
        print(f"attention, unused slots {garbage}: triton vs sdpa max abs diff "
              f"{(outs[0] - outs[1]).abs().max().item():.3g}", flush=True)


if __name__ == "__main__":
    main()
