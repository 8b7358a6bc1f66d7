"""HuggingFace checkpoints (config.json + safetensors) of the supported families in and out of any layout.

config.json is mapped by the checkpoint's family (``realloc.models.families``: LLaMA, Qwen2, Qwen3, Mistral, Phi-3).
A family that fuses projections in its files (Phi-3's qkv_proj, gate_up_proj) is read by slicing each part's rows
out of the fused tensor and written by concatenating them (``fused_names.py``, :func:`fuse_for_hf`).

Loading: every rank opens only the safetensors files that hold its parameters
and reads only its tp slice of each (``safe_open(...).get_slice``), so a rank
never materializes more than its shard. Single-file and sharded checkpoints
(``model.safetensors.index.json``) are both read. The vocabulary padding rows of the embedding and
LM head (``ModelConfig.padded_vocab_size``) are not in HF files: loading fills them with zeros,
saving leaves them out, so HF shapes are the real vocabulary's both ways.

Saving: within dp replica 0, the tp group of each pipeline stage gathers its
shards to its tp rank 0, which writes that stage's files. The split of
parameters into files is a pure function of the model config and pp
(:func:`shard_file_plan`), so every writer knows the whole index without
talking to the others; stage 0's writer writes ``config.json`` and the index.
The result loads with ``transformers`` ``from_pretrained`` and back into any
layout. Critics are written as the family's sequence classifier (``LlamaForSequenceClassification``,
``Qwen2ForSequenceClassification``, ...) with one label. A KV head replicated over tp ranks
(tp > KV heads) is read by each rank that holds it and written once.

    cfg = model_config_from_hf("/ckpt/llama")                        # any process
    model = ParallelModel(cfg, groups, init="empty")
    load_hf_checkpoint(model, "/ckpt/llama")                         # every rank of the mesh
    save_hf_checkpoint(model, "/out/llama")                          # every rank of the mesh
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from realloc.atomic_file import safetensors_os_errors
from realloc.models.config import ModelConfig
from realloc.models.families import hf_from_config
# the check of a checkpoint before any worker starts reads headers only, without torch
from realloc.models.hf_check import FLOAT_DTYPES, INDEX_FILE, SINGLE_FILE, check_hf_weights  # noqa: F401
# config.json in and out (torch-free, in hf_config.py so that planning a run imports no torch)
from realloc.models.hf_config import (CONFIG_FILE, GENERATION_CONFIG_FILE, TOKEN_ID_KEYS, model_config_from_hf,
                                      read_hf_config, special_tokens)  # noqa: F401
from realloc.models.fused_names import hf_locations, hf_shapes, hf_units
from realloc.models.lora_config import is_adapter
from realloc.models.param_layout import ParamSpec, param_specs, stage_of_layer
from realloc.models.weights import init_shard

if TYPE_CHECKING:
    from realloc.models.engine import ParallelModel
    from realloc.models.groups import ModelParallelGroups

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


# -- config ----------------------------------------------------------------------------------------


def token_id_json(cfg: ModelConfig) -> dict[str, Any]:
    """``cfg.special_tokens`` as config.json writes them (lists for several EOS ids)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in cfg.special_tokens}


def hf_config_from_model_config(cfg: ModelConfig, dtype: torch.dtype = torch.float32,
                                extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A config.json for ``transformers``: the family's causal LM, or its sequence classifier for critics."""
    out = hf_from_config(cfg, _DTYPE_NAMES.get(dtype, "float32"))
    out.update({k: v for k, v in token_id_json(cfg).items() if k not in out})
    if extra:
        out.update({k: v for k, v in extra.items() if k not in out or k in TOKEN_ID_KEYS})
    return out


def write_generation_config(path: Path, ids: Mapping[str, Any], base: Mapping[str, Any] | None = None) -> None:
    """generation_config.json: ``base`` (a source checkpoint's sampling defaults) with the bos/eos/pad ``ids``."""
    body = dict(base or {})
    body.update({k: v for k, v in ids.items() if k in TOKEN_ID_KEYS and v is not None})
    if body:
        (Path(path) / GENERATION_CONFIG_FILE).write_text(json.dumps(body, indent=2))


# -- loading ---------------------------------------------------------------------------------------


def _weight_map(path: Path) -> dict[str, str]:
    index = path / INDEX_FILE
    if index.is_file():
        return dict(json.loads(index.read_text())["weight_map"])
    single = path / SINGLE_FILE
    if single.is_file():
        with safe_open(str(single), framework="pt") as f:
            return {k: SINGLE_FILE for k in f.keys()}
    raise ValueError(f"HF checkpoint {path}: neither {INDEX_FILE} nor {SINGLE_FILE} found (only safetensors "
                     f"checkpoints are supported)")


@torch.no_grad()
def load_hf_checkpoint(model: "ParallelModel", path: str | os.PathLike, *, score_init_seed: int | None = None,
                       adapter_init_seed: int = 0) -> None:
    """Fill ``model``'s local shards from a HF checkpoint; each rank reads only its slices.

    Loading a critic from a causal-LM checkpoint (no ``score.weight``) needs
    ``score_init_seed`` to initialize the new value head deterministically. A LoRA model's adapters are not in
    an HF checkpoint: they start from ``weights.init_shard`` with ``adapter_init_seed`` (B = 0, so the model
    starts as the checkpoint).
    """
    path = Path(path)
    model._require("ready", "load_hf_checkpoint")
    wmap = _weight_map(path)
    g = model.groups
    fused = hf_locations(model.cfg)  # Phi-3: q/k/v and gate/up are row ranges of one tensor in the file
    by_file: dict[str, list[str]] = defaultdict(list)
    for name in model.params():
        if fused.get(name, (name,))[0] in wmap:
            by_file[wmap[fused.get(name, (name,))[0]]].append(name)
        elif (name == "score.weight" and score_init_seed is not None) or is_adapter(name):
            continue
        else:
            hint = " (pass score_init_seed= to initialize a new value head)" if name == "score.weight" else ""
            raise ValueError(f"HF checkpoint {path}: parameter {name!r} not found{hint}")
    params = model.params()
    shapes = hf_shapes(model.cfg) if fused else {}
    for fname, names in sorted(by_file.items()):
        with safe_open(str(path / fname), framework="pt", device="cpu") as f:
            for name in names:
                spec = model.specs[name]
                hf_name, row0 = fused.get(name, (name, 0))
                sl = f.get_slice(hf_name)
                shape = tuple(sl.get_shape())
                want = shapes[hf_name] if hf_name != name else spec.hf_shape
                if shape != want:
                    raise ValueError(f"HF checkpoint {path}: {hf_name} has shape {shape}, the model expects "
                                     f"{want}; does config.json match the weights?")
                _read_shard(params[name], sl, spec, g.tp, g.tp_rank, row0)
    for name in params:
        if is_adapter(name) and name not in wmap:
            params[name].copy_(init_shard(model.specs[name], adapter_init_seed, g.tp, g.tp_rank, model.dtype))
    if "score.weight" in params and "score.weight" not in wmap:
        spec = model.specs["score.weight"]
        params["score.weight"].copy_(init_shard(spec, score_init_seed, g.tp, g.tp_rank, model.dtype))


def _read_shard(dst: torch.Tensor, sl: Any, spec: ParamSpec, tp: int, tp_rank: int, row0: int = 0) -> None:
    """Copy tp rank ``tp_rank``'s shard of ``spec`` from the file slice ``sl``: the rows the file has, zeros for
    the vocabulary padding after them. ``row0``: where ``spec``'s rows start in a fused tensor (Phi-3's qkv_proj)."""
    index = spec.shard_slices(tp, tp_rank)
    if row0:
        rows = index[0]
        lo, hi = (rows.start or 0), (spec.shape[0] if rows.stop is None else rows.stop)
        index = (slice(row0 + lo, row0 + hi),) + tuple(index[1:])
    if not spec.pad_rows:
        dst.copy_(sl[index])
        return
    n = spec.real_rows(tp, tp_rank)
    dst[n:].zero_()
    if n:
        lo = index[0].start or 0
        dst[:n].copy_(sl[(slice(lo, lo + n),) + index[1:]])


# -- saving ----------------------------------------------------------------------------------------


def _saved_units(cfg: ModelConfig, pp: int, stage: int) -> list[list[str]]:
    """What stage ``stage`` writes, as the parameter names of each HF tensor (several for a fused one): its own
    parameters, not the tied embedding replica of the last stage."""
    mine = [s for s in param_specs(cfg) if stage_of_layer(cfg.n_layers, pp, s.layer) == stage]
    return [parts for _, parts in hf_units(cfg, mine)]


def shard_file_plan(cfg: ModelConfig, pp: int, dtype: torch.dtype,
                    max_file_bytes: int = 4 << 30) -> list[tuple[int, str, list[str]]]:
    """(writing stage, file name, parameter names) for every file; each stage's params split at ``max_file_bytes``,
    never inside a fused HF tensor (``fuse_for_hf`` makes the file's tensors of the names)."""
    elem = torch.tensor([], dtype=dtype).element_size()
    sizes = {s.name: s.hf_numel * elem for s in param_specs(cfg)}
    chunks: list[tuple[int, list[str]]] = []
    for stage in range(pp):
        cur: list[str] = []
        size = 0
        for unit in _saved_units(cfg, pp, stage):
            unit_size = sum(sizes[n] for n in unit)
            if cur and size + unit_size > max_file_bytes:
                chunks.append((stage, cur))
                cur, size = [], 0
            cur.extend(unit)
            size += unit_size
        if cur:
            chunks.append((stage, cur))
    if len(chunks) == 1:
        return [(chunks[0][0], SINGLE_FILE, chunks[0][1])]
    n = len(chunks)
    return [(stage, f"model-{i + 1:05d}-of-{n:05d}.safetensors", names) for i, (stage, names) in enumerate(chunks)]


def fuse_for_hf(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A file's tensors under the checkpoint's names: the parts of each fused HF tensor (Phi-3's q/k/v, gate/up)
    concatenated along their rows in the family's order; everything else as it is."""
    out: dict[str, torch.Tensor] = {}
    for hf_name, parts in hf_units(cfg):
        if parts[0] in tensors:
            out[hf_name] = tensors[parts[0]] if len(parts) == 1 else torch.cat([tensors[p] for p in parts])
    out.update({n: t for n, t in tensors.items() if n not in out and n not in hf_locations(cfg)})
    return out


def hf_weight_map(cfg: ModelConfig, plan: list[tuple[int, str, list[str]]]) -> dict[str, str]:
    """The index's weight_map of a ``shard_file_plan``: each HF tensor's file."""
    fused = hf_locations(cfg)
    return {fused.get(n, (n,))[0]: fname for _, fname, names in plan for n in names}


def _gather_full(t: torch.Tensor, spec: ParamSpec, g: "ModelParallelGroups") -> torch.Tensor | None:
    """Full HF tensor (without vocabulary padding) on tp rank 0 of the group (None elsewhere)."""
    if g.tp == 1 or spec.tp_dim is None:
        return spec.unpad(t.detach()) if g.tp_rank == 0 else None
    src = t.detach().contiguous()
    parts = [torch.empty_like(src) for _ in range(g.tp)] if g.tp_rank == 0 else None
    dist.gather(src, gather_list=parts, dst=g.tp_ranks[0], group=g.tp_group)
    return spec.unpad(spec.merge_shards(parts)) if parts is not None else None


def _umask() -> int:
    """This process's umask, read without changing it where Linux shows it (``os.umask`` sets it to read it)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def save_weights(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """``safetensors.save_file`` with the mode any file written here gets (0644 under the usual umask):
    safetensors creates its files 0600, so an export's weights were private beside a world-readable config."""
    with safetensors_os_errors(path):
        save_file(tensors, str(path), metadata={"format": "pt"})
    os.chmod(path, 0o666 & ~_umask())


@torch.no_grad()
def save_hf_checkpoint(model: "ParallelModel", path: str | os.PathLike, *, dtype: torch.dtype | None = None,
                       hf_extra: Mapping[str, Any] | None = None, max_file_bytes: int = 4 << 30) -> None:
    """Write ``model`` as a HF checkpoint; collective over the model's mesh, returns when all files exist.

    ``hf_extra`` adds keys to config.json (e.g. ``bos_token_id``, ``eos_token_id``).
    """
    model._require("ready", "save_hf_checkpoint")
    if model.cfg.lora is not None:
        raise ValueError(f"save_hf_checkpoint: model {model.cfg.name!r} has LoRA adapters, which an HF checkpoint "
                         f"has no place for; write a run checkpoint and `realloc export` it (merged, or --format "
                         f"peft for the adapters alone)")
    path = Path(path)
    g, cfg = model.groups, model.cfg
    dtype = dtype or model.dtype
    plan = shard_file_plan(cfg, g.pp, dtype, max_file_bytes)
    writer = g.dp_rank == 0 and g.tp_rank == 0
    if g.dp_rank == 0:
        params = model.params()
        for stage, fname, names in plan:
            if stage != g.pp_rank:
                continue
            tensors = {}
            for name in names:
                full = _gather_full(params[name], model.specs[name], g)
                if full is not None:
                    tensors[name] = full.to(device="cpu", dtype=dtype).contiguous()
            if writer:
                path.mkdir(parents=True, exist_ok=True)
                save_weights(fuse_for_hf(cfg, tensors), path / fname)
        if writer and g.pp_rank == 0:
            path.mkdir(parents=True, exist_ok=True)
            hf = hf_config_from_model_config(cfg, dtype, hf_extra)
            (path / CONFIG_FILE).write_text(json.dumps(hf, indent=2))
            write_generation_config(path, hf)
            if len(plan) > 1:
                elem = torch.tensor([], dtype=dtype).element_size()
                index = {"metadata": {"total_size": sum(s.hf_numel for s in param_specs(cfg)) * elem},
                         "weight_map": hf_weight_map(cfg, plan)}
                (path / INDEX_FILE).write_text(json.dumps(index, indent=2))
    dist.barrier(group=g.mesh_group)
