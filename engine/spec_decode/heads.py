"""Draft heads served from a speculator folder: an EAGLE head (eagle.py) or Medusa heads
(medusa.py), told apart by their config's format, checked and loaded at start-up.

Must not run, schedule or verify: it reads a folder, checks that its kind is the one the method
serves (eagle, medusa; hybrid takes either) and that it was trained for the served target, and
quantizes the loaded module as `speculator_quantization` says.
"""

from __future__ import annotations

from torch import nn

from engine.config import EngineConfig
from engine.models.quantize import quantize_model
from engine.spec_decode import eagle, medusa
from engine.spec_decode.eagle import EagleHead, HeadConfig, HeadFileError
from engine.spec_decode.medusa import MedusaConfig, MedusaHeads

OPTION = "speculative.speculator"


def read_speculator(path: str, option: str = OPTION) -> HeadConfig | MedusaConfig:
    """The config of the speculator in folder `path`, by its format."""
    data, where = eagle.read_json(path, option)
    if data.get("format") == medusa.FORMAT:
        return medusa.config_from(data, where, option)
    if data.get("format") == eagle.FORMAT:
        return eagle.config_from(data, where, option)
    raise HeadFileError(f"invalid {option}: {where} is not a speculator config (format "
                        f"{data.get('format')!r}, expected {eagle.FORMAT!r} or "
                        f"{medusa.FORMAT!r})")


def kind_of(config: HeadConfig | MedusaConfig) -> str:
    """eagle or medusa: the method a speculator's config serves."""
    return "eagle" if isinstance(config, HeadConfig) else "medusa"


def load(path: str, kind: str, model: nn.Module, dtype, device, option: str = OPTION,
         config: HeadConfig | MedusaConfig | None = None) -> EagleHead | MedusaHeads:
    """The speculator in folder `path` (its config when already read), which must be of
    `kind`, checked against `model`."""
    config = config or read_speculator(path, option)
    if kind_of(config) != kind:
        raise HeadFileError(f"invalid {option}: {path} holds {kind_of(config)} heads; method "
                            f"{kind} needs {kind} heads (train them with `specserve "
                            f"speculator train --kind {kind}`)")
    if kind == "medusa":
        return medusa.load_heads(config, path, model, dtype, device, option)
    return eagle.head_from(config, path, model, dtype, device, option)


def load_speculator(config: EngineConfig, target: nn.Module) -> EagleHead | MedusaHeads | None:
    """The draft head(s) `speculative.speculator` names, of the kind the method serves
    (eagle, medusa; hybrid: the folder's), checked against the target (a clear error naming
    the option when missing, corrupt, of the wrong kind or for another target) and quantized
    as `speculator_quantization` says; None where the config serves none."""
    spec = config.speculative
    if not spec.uses_head:
        return None
    weight = target.get_input_embeddings().weight
    head_config = read_speculator(spec.speculator)
    kind = kind_of(head_config) if spec.method == "hybrid" else spec.method
    head = load(spec.speculator, kind, target, weight.dtype, weight.device,
                config=head_config)
    mode = spec.speculator_quantization
    if mode == "auto":
        mode = "int4" if weight.device.type == "cpu" else "none"
    quantize_model(head, mode, int4_kernel=config.int4_kernel, dtype=weight.dtype)
    return head
