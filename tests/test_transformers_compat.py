"""The engine on the oldest transformers we support (5.17, the version on the GPU machines),
in a subprocess: its attention layers call the cache differently from newer versions (no
kwargs to `Cache.update`), and once that silently bypassed the paged cache there (greedy
output then ignored the KV cache and mixed batched sequences)."""

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

OLDEST = "5.17.0"
REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("SPECSERVE_HOME", Path.home() / ".cache" / "specserve"))

SCRIPT = r"""
import sys, torch, transformers
assert transformers.__version__ == sys.argv[1], transformers.__version__
from conftest import build_tiny_model, random_prompts
from engine import EngineConfig, LLMEngine, SamplingParams
from engine.config import SpeculativeConfig

prompts = random_prompts([17, 5, 40, 90], seed=3)
params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
for arch in ("qwen2", "llama"):
    ref = build_tiny_model(arch, seed=0)
    want = [ref.generate(torch.tensor([p]), do_sample=False, max_new_tokens=12,
                         min_new_tokens=12, eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
            for p in prompts]
    for method in ("none", "ngram"):
        for lean in (True, False):  # our lean forward, and transformers' own
            eng = LLMEngine(EngineConfig(num_blocks=64, max_num_seqs=8,
                                         speculative=SpeculativeConfig(method=method)),
                            model=build_tiny_model(arch, seed=0))
            eng.runner.lean = lean
            got = [o.output_token_ids for o in eng.generate(prompts, params)]
            assert got == want, (arch, method, lean, got, want)
print("compatible")
"""


def _oldest_transformers() -> Path:
    """transformers OLDEST and the huggingface-hub it needs, unpacked once into the cache."""
    target = CACHE / "compat" / f"transformers-{OLDEST}"
    if (target / "transformers").is_dir():
        return target
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp,
                        f"transformers=={OLDEST}", "huggingface-hub>=1.5,<2"], check=True)
        staging = Path(tmp) / "site"
        for wheel in Path(tmp).glob("*.whl"):
            zipfile.ZipFile(wheel).extractall(staging)
        target.parent.mkdir(parents=True, exist_ok=True)
        staging.rename(target)
    return target


def test_greedy_output_on_the_oldest_supported_transformers_equals_generate():
    site = _oldest_transformers()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(REPO), str(REPO / "tests")]))
    run = subprocess.run([sys.executable, "-c", SCRIPT, OLDEST], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "compatible" in run.stdout, run.stdout + run.stderr[-3000:]


def test_the_declared_lower_bound_is_the_tested_version():
    major, minor, _ = OLDEST.split(".")
    assert f'"transformers>={major}.{minor},' in (REPO / "pyproject.toml").read_text()
