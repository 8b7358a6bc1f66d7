"""An HF checkpoint's config.json (and generation_config.json) read into a ``ModelConfig``, torch-free.

``graph/dataflow.py`` reads a checkpoint's shape here when it builds an experiment's graph, so that planning a
run (``realloc show``, ``search``, the master of ``realloc run``) imports no torch; the weights themselves are
``hf_io.py``'s, which re-exports these names.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Mapping

from realloc.models.config import ModelConfig
from realloc.models.families import config_from_hf

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"


def read_hf_config(path: str | os.PathLike) -> dict[str, Any]:
    f = Path(path) / CONFIG_FILE
    if not f.is_file():
        raise ValueError(f"HF checkpoint {path}: no {CONFIG_FILE}; expected a directory written by save_pretrained")
    try:
        return json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"HF checkpoint {path}: {CONFIG_FILE} is not valid JSON ({e})") from None


def model_config_from_hf(source: str | os.PathLike | Mapping[str, Any], name: str | None = None,
                         critic: bool | None = None) -> ModelConfig:
    """A ModelConfig from a checkpoint directory or a parsed config.json, by its family (``families``).

    ``critic`` defaults to whether the checkpoint is a sequence-classification model.
    """
    if isinstance(source, Mapping):
        cfg = config_from_hf(source, f"HF config {name or 'dict'}", name, critic)
        return dataclasses.replace(cfg, special_tokens=special_tokens(source))
    hf = read_hf_config(source)
    cfg = config_from_hf(hf, f"HF checkpoint {source}", name, critic)
    gen = Path(source) / GENERATION_CONFIG_FILE
    return dataclasses.replace(cfg, special_tokens=special_tokens(hf, json.loads(gen.read_text()) if gen.is_file()
                                                                   else None))


TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def special_tokens(hf: Mapping[str, Any], generation: Mapping[str, Any] | None = None) -> tuple[tuple[str, Any], ...]:
    """bos/eos/pad ids of a config.json, overridden by its generation_config.json (which names every EOS of
    a chat model); the form ``ModelConfig.special_tokens`` keeps."""
    ids = {k: hf[k] for k in TOKEN_ID_KEYS if hf.get(k) is not None}
    ids.update({k: generation[k] for k in TOKEN_ID_KEYS if generation and generation.get(k) is not None})
    return tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in sorted(ids.items()))
