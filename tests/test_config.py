from pathlib import Path

import pytest

from engine.config import EngineConfig
from server.config import load_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@pytest.mark.parametrize("name", ["default.yaml", "smollm2.yaml"])
def test_shipped_configs_load(name):
    cfg = load_config(str(CONFIGS / name), environ={}).engine_config()
    assert cfg.model and cfg.block_size == 16


def test_overrides_and_unknown_keys(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("engine:\n  model: x\n  max_num_seqs: 4\n")
    cfg = load_config(str(path), {"engine": {"max_num_seqs": 8}}, environ={}).engine_config()
    assert (cfg.model, cfg.max_num_seqs, cfg.dtype) == ("x", 8, "float32")
    path.write_text("engine:\n  modle: x\n")
    with pytest.raises(ValueError, match="modle"):
        load_config(str(path), environ={}).engine_config()


def test_invalid_values_raise():
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig(block_size=0)
