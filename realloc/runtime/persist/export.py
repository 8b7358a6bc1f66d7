"""Export a trained model from a run's checkpoint as a standard HuggingFace checkpoint directory.

    realloc export runs/a --model actor --out hf/actor [--iteration 30] [--dtype bfloat16]

A run checkpoint holds one safetensors file per (tp, pp) shard of each trained model's home
layout (``checkpoint.py``) and, in ``meta.json``, each model's shape and where it came from. The
export rebuilds every full tensor from its tp shards (``ParamSpec.shard_slices`` says where each
shard sits, so replicated shards simply land on the same place twice), drops the vocabulary padding
rows the engine holds (``ModelConfig.padded_vocab_size``; HF has the real vocabulary) and writes the files of
``hf_io.shard_file_plan`` one at a time, so memory holds at most one output file. The directory
gets ``config.json`` (its family's causal LM, or sequence classification for critics),
``generation_config.json`` with the bos/eos/pad ids, and the run's tokenizer files; it loads
with ``transformers``' ``from_pretrained`` and back into realloc in any layout.

Frozen models are not in run checkpoints: their weights are the checkpoint they were loaded from.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors import safe_open

from realloc.models.config import ModelConfig
from realloc.models.fused_names import hf_locations
from realloc.models.lora_config import LoRAConfig
from realloc.models.param_layout import param_specs, stage_of_layer
from realloc.runtime.persist import checkpoint, lora_export
from realloc.runtime.persist.ckpt_lock import reading
from realloc.runtime.persist.export_parts import part_name, remove_dead_parts
from realloc.runtime.records.run_claim import remove_empty_folders
from realloc.runtime.persist.run_settings import model_record  # noqa: F401 (torch-free: the master's)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _model_config(record: Mapping[str, Any]) -> ModelConfig:
    fields = {f.name for f in dataclasses.fields(ModelConfig)} - {"special_tokens"}  # the record's token_ids rule
    raw = {k: v for k, v in record["config"].items() if k in fields}
    if raw.get("rope_scaling") is not None:
        raw["rope_scaling"] = tuple(raw["rope_scaling"])
    if raw.get("lora") is not None:
        raw["lora"] = LoRAConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw["lora"].items()})
    return ModelConfig(**raw)


def _full_tensors(ckpt: Path, model: str, cfg: ModelConfig, tp: int, pp: int, names: list[str],
                  dtype: torch.dtype | None, verified: set[Path] | None) -> dict[str, torch.Tensor]:
    specs = {s.name: s for s in param_specs(cfg)}
    out: dict[str, torch.Tensor] = {}
    by_stage: dict[int, list[str]] = {}
    for n in names:
        by_stage.setdefault(stage_of_layer(cfg.n_layers, pp, specs[n].layer), []).append(n)
    for stage, stage_names in sorted(by_stage.items()):
        for tp_rank in range(tp):
            path = checkpoint.shard_file(ckpt, model, tp_rank, stage)
            if not path.is_file():
                raise ValueError(f"checkpoint {ckpt}: shard {path.relative_to(ckpt)} of model {model!r} is missing")
            if verified is not None and path not in verified:
                checkpoint.verify_file(ckpt, path)  # the SHA-256 recorded at save time
                verified.add(path)
            with safe_open(str(path), framework="pt") as f:
                keys = set(f.keys())
                for n in stage_names:
                    if f"param/{n}" not in keys:
                        raise ValueError(f"checkpoint {path}: parameter {n!r} is missing")
                    shard = f.get_tensor(f"param/{n}")
                    spec = specs[n]
                    if n not in out:
                        out[n] = torch.empty(spec.shape, dtype=dtype or shard.dtype)
                    if f"master/{n}" in keys:  # trained in bf16 or fp16: the fp32 masters round to the same
                        shard = f.get_tensor(f"master/{n}")  # parameters, and are exact for a wider --dtype
                    out[n][spec.shard_slices(tp, tp_rank)] = shard.to(out[n].dtype)
    return {n: specs[n].unpad(t).contiguous() for n, t in out.items()}  # HF files lack the vocabulary padding


def export_checkpoint(ckpt: str | Path, model: str, out: str | Path, *, dtype: str | None = None,
                      max_file_bytes: int = 4 << 30, verify: bool = True, fmt: str = "hf") -> Path:
    """Write ``model`` of checkpoint ``ckpt`` as a HF directory ``out``; returns ``out``.

    A LoRA model is written with its adapters merged into the base (``fmt="hf"``), or as a PEFT adapter
    directory (``fmt="peft"``: ``lora_export.py``). Every shard is checked against the SHA-256 recorded when
    it was saved (``verify=False`` skips that). The checkpoint is held for reading meanwhile (``ckpt_lock``),
    so the run that owns it neither prunes it nor sets it aside under the export."""
    with reading(Path(ckpt) / checkpoint.META):
        return _export(Path(ckpt), model, Path(out), dtype, max_file_bytes, verify, fmt)


def _export(ckpt: Path, model: str, out: Path, dtype: str | None, max_file_bytes: int, verify: bool,
            fmt: str) -> Path:
    from realloc.models.hf_io import (CONFIG_FILE, GENERATION_CONFIG_FILE, INDEX_FILE, fuse_for_hf,
                                      hf_config_from_model_config, hf_weight_map, save_weights, shard_file_plan,
                                      write_generation_config)

    ckpt, out = Path(ckpt), Path(out)
    meta = checkpoint.read_meta(ckpt)
    records = meta.get("models") or {}
    if model not in records:
        trained = ", ".join(sorted(records)) or "none"
        raise ValueError(f"checkpoint {ckpt} has no trained model {model!r} (trained models: {trained}); a frozen "
                         f"model's weights are the checkpoint it was loaded from")
    if dtype is not None and dtype not in _DTYPES:
        raise ValueError(f"--dtype {dtype!r}: use one of {', '.join(_DTYPES)}")
    if fmt not in ("hf", "peft"):
        raise ValueError(f"--format {fmt!r}: use hf (a full checkpoint, LoRA adapters merged) or peft")
    rec = records[model]
    cfg = _model_config(rec)
    if fmt == "peft" and cfg.lora is None:
        raise ValueError(f"--format peft: model {model!r} of checkpoint {ckpt} was trained without LoRA, so it has "
                         f"no adapters to write; export it with --format hf")
    if fmt == "peft" and hf_locations(cfg):  # Phi-3: PEFT's modules are the checkpoint's fused qkv_proj, gate_up_proj
        raise ValueError(f"--format peft: model {model!r} ({cfg.family}) has its LoRA adapters on q/k/v and gate/up "
                         f"apart, which its checkpoint fuses (qkv_proj, gate_up_proj) and PEFT cannot hold; export "
                         f"it merged with --format hf")
    base = dataclasses.replace(cfg, lora=None)  # what HF files hold
    tp, pp = int(rec["tp"]), int(rec["pp"])
    torch_dtype = _DTYPES[dtype] if dtype else None
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"export directory {out} is not empty; choose a new --out")
    # A name of its own: a peer exporting to the same --out at once must not write into (or delete) this one.
    remove_dead_parts(out.parent, out.name)
    tmp = part_name(out)
    created = next((a for a in reversed(out.parents) if not a.exists()), None)  # removed again on failure
    try:
        tmp.mkdir(parents=True)
    except OSError as e:
        raise ValueError(f"export directory {out}: cannot create it ({e.strerror}); choose another --out") from None
    try:
        written_dtype = None
        verified: set[Path] | None = set() if verify else None
        if fmt == "peft":
            tensors = _full_tensors(ckpt, model, cfg, tp, pp, lora_export.trained_names(cfg), torch_dtype, verified)
            lora_export.write_peft(tmp, cfg, tensors, rec.get("source"))
            plan = []
        else:
            plan = shard_file_plan(base, pp, torch_dtype or torch.float32, max_file_bytes)
        for _, fname, names in plan:
            if cfg.lora is None:
                tensors = _full_tensors(ckpt, model, cfg, tp, pp, names, torch_dtype, verified)
            else:  # merge in the checkpoint's dtype, or for a --dtype in fp32 (a bf16 model's adapters from their
                # fp32 masters), then cast
                names = names + lora_export.adapter_names(cfg, names)
                read = torch.float32 if torch_dtype is not None else None
                tensors = lora_export.merge(cfg, _full_tensors(ckpt, model, cfg, tp, pp, names, read, verified))
                tensors = {n: t.to(torch_dtype or t.dtype) for n, t in tensors.items()}
            written_dtype = next(iter(tensors.values())).dtype
            save_weights(fuse_for_hf(base, tensors), tmp / fname)  # Phi-3: q/k/v and gate/up as its fused tensors
            del tensors
        if len(plan) > 1:
            elem = torch.tensor([], dtype=written_dtype).element_size()
            index = {"metadata": {"total_size": sum(s.hf_numel for s in param_specs(base)) * elem},
                     "weight_map": hf_weight_map(base, plan)}
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2))
        ids = {k: v for k, v in (rec.get("token_ids") or {}).items() if v is not None}
        hf = hf_config_from_model_config(base, written_dtype or torch.float32, ids)
        if fmt == "hf":
            (tmp / CONFIG_FILE).write_text(json.dumps(hf, indent=2))
        source_gen = Path(rec["source"]) / GENERATION_CONFIG_FILE if rec.get("source") else None
        write_generation_config(tmp, ids, json.loads(source_gen.read_text()) if source_gen and source_gen.is_file()
                                else None)
        _copy_tokenizer(tmp, rec.get("tokenizer"))
        (tmp / "realloc_export.json").write_text(json.dumps(
            {"checkpoint": str(ckpt.resolve()), "iteration": meta.get("iteration"), "model": model,
             "experiment": meta.get("experiment"), "layout": {"tp": tp, "pp": pp}, "format": fmt,
             **({"lora": dataclasses.asdict(cfg.lora), "merged": fmt == "hf"} if cfg.lora else {})}, indent=2))
        try:
            os.rename(tmp, out)  # atomic; replaces an empty folder, never a filled one
        except OSError as e:
            if out.is_dir() and any(out.iterdir()):
                raise ValueError(f"export directory {out} was filled while exporting (another export to it?); "
                                 f"choose a new --out") from None
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a failed export leaves nothing behind
        if created is not None:  # empty folders only: a peer's export may have landed in one
            remove_empty_folders(out.parent, created)
        raise
    return out


def _copy_tokenizer(out: Path, tokenizer: str | None) -> None:
    if not tokenizer:
        return
    from realloc.data.tokenizer import Tokenizer

    for f in Tokenizer.load(tokenizer).files():
        shutil.copyfile(f, out / f.name)  # a new file of this umask, like the rest (copy2 keeps the source's mode)


def find_checkpoint(run_dir: str | Path, iteration: int | None, skip_checks: bool = False) -> Path:
    """The checkpoint written after ``iteration`` completed iterations (the newest when None)."""
    root = Path(run_dir)
    if iteration is None:
        found = checkpoint.find_newest(root, skip_checks, "--iteration")
        if found is None:
            if not root.exists():
                raise ValueError(f"{root} does not exist; give the run directory of a `realloc run`")
            raise ValueError(f"{root}: no checkpoint to export from (looked for iter_*/{checkpoint.META} in {root} and "
                             f"{root / 'checkpoints'}); a run saves its final state there unless it ran with "
                             f"--no-final-checkpoint or stopped before its first save: give a run directory, its "
                             f"checkpoints/ or one checkpoint directory")
        return found
    if iteration < 1:
        raise ValueError(f"--iteration must be a positive number of completed iterations, got {iteration}")
    found = []
    for base in (root / "checkpoints", root):
        for cand in sorted(base.glob("iter_*")) if base.is_dir() else []:
            try:
                meta = checkpoint.read_meta(cand)
            except ValueError:
                continue
            found.append(int(meta.get("next_iteration", -1)))
            if found[-1] == iteration:
                return cand
    raise ValueError(f"{root}: no checkpoint after iteration {iteration}; checkpoints exist after iterations "
                     f"{sorted(set(found)) or 'none'}")
