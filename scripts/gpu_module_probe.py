"""The first module whose output for a prompt's last token differs between prefilling the
prompt alone and prefilling it beside other prompts in one step (bf16, CUDA; SDPA backend,
no CUDA graphs): where batched greedy output on CUDA departs from the same request alone.

    python scripts/gpu_module_probe.py   (on a machine with an NVIDIA GPU)
"""

import sys
from pathlib import Path

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from conftest import build_tiny_model, random_prompts  # noqa: E402

from engine import EngineConfig, LLMEngine  # noqa: E402
from engine.config import SpeculativeConfig  # noqa: E402
from engine.batch import RunItem  # noqa: E402


def main() -> None:
    model = build_tiny_model("qwen2", seed=0, dtype=torch.bfloat16, num_layers=3).to(DEVICE)
    eng = LLMEngine(EngineConfig(num_blocks=512, max_num_seqs=16, cuda_graphs="off",
                                 attention_backend="sdpa",
                                 speculative=SpeculativeConfig(method="none")), model=model)
    runner = eng.runner
    runner.lean = False  # the hooks below need transformers' own forward
    prompts = random_prompts([17, 5, 40, 90], seed=3)
    tables, at = [], 1
    for p in prompts:
        n = -(-len(p) // 16)
        tables.append(list(range(at, at + n)))
        at += n
    captured: dict[str, list[torch.Tensor]] = {}
    executed: list[str] = []
    rows = {"now": None}

    def hook(name):
        def fn(module, args, out):
            t = out[0] if isinstance(out, tuple) else out
            if isinstance(t, torch.Tensor) and t.dim() >= 2:
                flat = t.reshape(-1, t.shape[-1]) if t.dim() == 2 else t[0]
                if flat.shape[0] > rows["now"]:
                    captured.setdefault(name, []).append(flat[rows["now"]].float().clone())
                    if len(captured[name]) == 2:
                        executed.append(name)  # in the order the batched pass ran them
        return fn

    inputs: dict[str, list[torch.Tensor]] = {}

    def pre_hook(name):
        def fn(module, args):
            if args and isinstance(args[0], torch.Tensor) and args[0].dim() == 3 \
                    and args[0].shape[1] > rows["now"]:
                inputs.setdefault(name, []).append(args[0][0, rows["now"]].float().clone())
        return fn

    for name, module in runner.model.named_modules():
        if name:
            module.register_forward_hook(hook(name))
            if isinstance(module, torch.nn.Linear):
                module.register_forward_pre_hook(pre_hook(name))
    # prompt 0 alone, then all four in one step (prompt 0 first): its last token's row
    rows["now"] = len(prompts[0]) - 1
    alone = runner.execute([RunItem(prompts[0], 0, tables[0], 1)]).logits[0]
    batched = runner.execute([RunItem(p, 0, t, 1) for p, t in zip(prompts, tables)]).logits[0]
    print("final logits bit-equal:", torch.equal(alone, batched),
          "max diff", (alone - batched).abs().max().item(), flush=True)
    for name in executed:
        a, b = captured[name][:2] if len(captured[name]) >= 2 else (None, None)
        if a is None or a.shape != b.shape:
            continue
        if name in inputs and not torch.equal(*inputs[name][:2]):
            print(f"first differing input: that of {name}", flush=True)
            break
        if not torch.equal(a, b):
            kind = type(dict(runner.model.named_modules())[name]).__name__
            print(f"first differing module: {name} ({kind}), "
                  f"max diff {(a - b).abs().max().item():.3g}", flush=True)
            break
    else:
        print("no module output differs at that row", flush=True)


if __name__ == "__main__":
    main()
