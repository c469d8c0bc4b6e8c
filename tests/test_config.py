from pathlib import Path

import pytest

from engine.config import EngineConfig, load_engine_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@pytest.mark.parametrize("name", ["default.yaml", "smollm2.yaml"])
def test_shipped_configs_load(name):
    cfg = load_engine_config(str(CONFIGS / name))
    assert cfg.model and cfg.block_size == 16


def test_overrides_and_unknown_keys(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("engine:\n  model: x\n  max_num_seqs: 4\n")
    cfg = load_engine_config(str(path), max_num_seqs=8, dtype=None)
    assert (cfg.model, cfg.max_num_seqs, cfg.dtype) == ("x", 8, "float32")
    path.write_text("engine:\n  modle: x\n")
    with pytest.raises(ValueError, match="modle"):
        load_engine_config(str(path))


def test_invalid_values_raise():
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig(block_size=0)
