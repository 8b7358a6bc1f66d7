"""The check of an HF checkpoint's weights before any worker starts, from the safetensors headers (torch-free).

``realloc run``'s master and ``realloc show`` call it; ``hf_io.py`` loads the tensors in the workers.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from safetensors import safe_open

from realloc.models.config import ModelConfig
from realloc.models.lora_config import is_adapter
from realloc.models.fused_names import hf_shapes
from realloc.models.param_layout import ParamSpec, param_specs

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# safetensors dtypes the loader copies into the model's dtype; anything else is quantized or not a weight.
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


def check_hf_weights(cfg: ModelConfig, path: str | os.PathLike, *, new_value_head: bool = False,
                     where: str = "") -> None:
    """Check that the checkpoint holds every tensor ``load_hf_checkpoint`` will read for ``cfg``, with the
    shape and a float dtype, reading only the safetensors headers (no tensor data): a bad checkpoint is one
    error before any worker starts. ``new_value_head``: the critic's ``score.weight`` is made, not read."""
    path = Path(path)
    at = f"{where}HF checkpoint {path}"
    index = path / INDEX_FILE
    if index.is_file():
        try:
            wmap = dict(json.loads(index.read_text())["weight_map"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            raise ValueError(f"{at}: {INDEX_FILE} is not a safetensors index (a JSON object with a weight_map); "
                             f"re-save the checkpoint with save_pretrained") from None
    elif (path / SINGLE_FILE).is_file():
        wmap = {}  # read from the file's header below
    else:
        others = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".gguf", ".ckpt"))
        seen = f" (found {', '.join(others[:3])}{', ...' if len(others) > 3 else ''})" if others else ""
        raise ValueError(f"{at}: neither {INDEX_FILE} nor {SINGLE_FILE} found{seen}; realloc reads only "
                         f"safetensors: load it with transformers and save_pretrained it again (safetensors is "
                         f"the default)")
    files = sorted(set(wmap.values())) if wmap else [SINGLE_FILE]
    missing_files = [f for f in files if not (path / f).is_file()]
    if missing_files:
        raise ValueError(f"{at}: {INDEX_FILE} lists {missing_files[0]}, which does not exist"
                         f"{f' (and {len(missing_files) - 1} more)' if len(missing_files) > 1 else ''}; copy the "
                         f"whole checkpoint directory")
    found: dict[tuple[str, str], tuple[tuple[int, ...], str]] = {}  # (file, name) -> (shape, dtype)
    specs = {s.name: s for s in param_specs(cfg)}
    for fname in files:
        try:
            with safe_open(str(path / fname), framework="numpy") as f:
                for name in f.keys():
                    sl = f.get_slice(name)
                    found[(fname, name)] = (tuple(sl.get_shape()), str(sl.get_dtype()))
        except Exception as e:  # safetensors raises its own error types for a truncated or foreign file
            raise ValueError(f"{at}: {fname} is not a readable safetensors file ({type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else ''})") from None
    shapes = hf_shapes(cfg)  # the checkpoint's tensors: Phi-3's fused q/k/v and gate/up as one each
    for name, hf_shape in shapes.items():
        spec = ParamSpec(name, hf_shape, None, 0) if name not in specs else specs[name]
        if (spec.name == "score.weight" and new_value_head) or is_adapter(spec.name):
            continue  # made, not read (LoRA adapters start from their own init)
        fname = wmap.get(spec.name, SINGLE_FILE)
        if (fname, spec.name) not in found:
            hint = (" (a causal LM: start a critic from it with new_value_head=True)" if spec.name == "score.weight"
                    else "; does config.json match the weights?")
            where_ = f"{INDEX_FILE}'s weight_map" if wmap and spec.name not in wmap else fname
            raise ValueError(f"{at}: tensor {spec.name!r} is missing from {where_}, the model expects it with "
                             f"shape {spec.hf_shape}{hint}")
        shape, dtype = found[(fname, spec.name)]
        if shape != spec.hf_shape:
            why = (f"; it is a {shape[0]}-label classifier, not a scalar reward model or critic"
                   if spec.name == "score.weight" and len(shape) == 2 and shape[1:] == spec.shape[1:] else
                   "; does config.json match the weights?")
            raise ValueError(f"{at}: tensor {spec.name!r} in {fname} has shape {shape}, the model expects "
                             f"{spec.hf_shape} from config.json{why}")
        if dtype not in FLOAT_DTYPES:
            raise ValueError(f"{at}: tensor {spec.name!r} in {fname} is stored as {dtype}; realloc loads "
                             f"{', '.join(FLOAT_DTYPES)} weights (a quantized checkpoint? use the unquantized one)")
