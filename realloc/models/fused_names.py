"""Tensors an HF family stores fused that the parallel model holds apart (Phi-3's ``qkv_proj`` and ``gate_up_proj``).

The parallel model keeps q/k/v and gate/up as separate tp-split projections under LLaMA's names
(``param_layout``); a family whose checkpoints concatenate them along the output rows (``Family.fused``) is read by
slicing each part's rows out of the fused tensor and written by concatenating them back, in the family's order.
Everything here is torch-free name and row arithmetic (``hf_check`` reads headers with it before any worker starts).

    loc = hf_locations(cfg)           # {"model.layers.0.self_attn.q_proj.weight": ("...qkv_proj.weight", 0), ...}
    units = hf_units(cfg)             # [("model.embed_tokens.weight", ["model.embed_tokens.weight"]), ...]
"""

from __future__ import annotations

from typing import Any, Mapping

from realloc.models.config import ModelConfig
from realloc.models.families import family
from realloc.models.param_layout import ParamSpec, param_specs


def _fused_parts(cfg: ModelConfig) -> dict[str, tuple[str, tuple[str, ...]]]:
    """our name -> (its fused HF name, the fused tensor's parts in order), for fused parts only."""
    fused = family(cfg.family, f"model config {cfg.name!r}").fused
    out: dict[str, tuple[str, tuple[str, ...]]] = {}
    if not fused:
        return out
    for layer in range(cfg.n_layers):
        pre = f"model.layers.{layer}."
        for hf_suffix, parts in fused:
            names = tuple(pre + p for p in parts)
            for n in names:
                out[n] = (pre + hf_suffix, names)
    return out


def hf_locations(cfg: ModelConfig) -> dict[str, tuple[str, int]]:
    """our name -> (the HF tensor holding it, its first row there), for the parts of fused tensors only."""
    rows = {s.name: s.hf_shape[0] for s in param_specs(cfg)}
    out: dict[str, tuple[str, int]] = {}
    for name, (hf_name, parts) in _fused_parts(cfg).items():
        out[name] = (hf_name, sum(rows[p] for p in parts[:parts.index(name)]))
    return out


def hf_units(cfg: ModelConfig, specs: list[ParamSpec] | None = None) -> list[tuple[str, list[str]]]:
    """(HF tensor name, our names it is made of) in ``param_specs`` order: one name each, the parts of a fused one."""
    fused = _fused_parts(cfg)
    out: list[tuple[str, list[str]]] = []
    seen: set[str] = set()
    for s in specs if specs is not None else param_specs(cfg):
        hf_name, parts = fused.get(s.name, (s.name, (s.name,)))
        if hf_name not in seen:
            seen.add(hf_name)
            out.append((hf_name, list(parts)))
    return out


def hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Each HF tensor's shape (the parts' rows summed for a fused one), in ``param_specs`` order."""
    specs = {s.name: s for s in param_specs(cfg)}
    return {hf_name: (sum(specs[p].hf_shape[0] for p in parts),) + specs[parts[0]].hf_shape[1:]
            for hf_name, parts in hf_units(cfg)}


def split_hf_state(cfg: ModelConfig, state: Mapping[str, Any]) -> dict[str, Any]:
    """An HF state dict under our names: each fused tensor's rows sliced into its parts (views, no copy)."""
    loc = hf_locations(cfg)
    out = {k: v for k, v in state.items() if k not in {h for h, _ in loc.values()}}
    rows = {s.name: s.hf_shape[0] for s in param_specs(cfg)}
    for name, (hf_name, row0) in loc.items():
        if hf_name in state:
            out[name] = state[hf_name][row0:row0 + rows[name]]
    return out
