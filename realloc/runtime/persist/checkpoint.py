"""Checkpoints: trained models' parameters and optimizer state, RNG states, iteration and data position.

Layout of one checkpoint directory ``<run>/checkpoints/iter_00000012/`` (the state after iteration 12,
counting from 1 as the console and metrics.jsonl do)::

    meta.json                        iteration, data position, seed, plan digest, per-model layouts
    plan.json                        the plan the run used (``--resume`` reuses it)
    models/<model>/tp{t}_pp{p}.safetensors   one file per (tp, pp) shard of the model's home layout:
                                     param/<hf name>, optim/<hf name>/<state> (AdamW), JSON metadata
    rng/rank{r}.safetensors          every worker's torch RNG state

Atomicity: the master creates ``.tmp-iter_...`` next to the final name, the workers write and fsync
their files into it, then the master writes meta.json, fsyncs, renames the directory to its final
name and fsyncs the parent. A run killed at any point leaves either a complete ``iter_*`` directory
or a ``.tmp-*`` one that ``--resume`` never reads (and the next save removes). A save over an existing
``iter_N`` renames it to ``.replaced-iter_N`` before the new one takes the name, and removes it after; a kill
in between leaves it there, and the next save or ``--resume`` puts it back (``restore_replaced``).

Integrity: a worker records the SHA-256 of every file it writes in a ``<file>.sha256`` note; the
master folds the notes into meta.json (``files``: path -> sha256 and size). ``--resume`` checks that
every file is there with its size before launching, and each worker checks the digest of every file
it reads, so flipped bytes or a missing RNG file are one error naming the file rather than a silent
resume on corrupted state. ``verify=False`` (``realloc run --skip-checkpoint-checks``) skips both.

Shards are saved per (tp, pp) coordinate of the model's home layout (dp replicas are identical;
dp rank 0 writes), so resuming needs a home layout with the same tp and pp for every trained model;
another one is refused with a clear error rather than silently mis-sliced. The dp and the devices
may change (a plan searched again): with dp > 1 the optimizer state is sharded over dp
(``models/zero.py``), saving gathers each tensor's whole state to the writing rank, one tensor at
a time, and loading keeps each rank's own chunk, so the file is the same at every dp and resuming
re-shards the state. They are the engine's shards as they are, vocabulary padding rows included (``ModelConfig.padded_vocab_size``; zeros, with zero
optimizer state): resuming copies them back unchanged, so it is exact; ``export.py`` drops the rows.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Collection, Iterator, Mapping

from safetensors import SafetensorError, safe_open

from realloc.atomic_file import safetensors_os_errors
from realloc.runtime.persist.ckpt_lock import being_read, claimed

# torch only in the functions that read and write tensors (the workers'): the master's begin, commit and prune are
# file operations, and the master runs without torch (docs/speed.md).
if TYPE_CHECKING:
    import torch

CHECKPOINT_FORMAT = 1
META = "meta.json"
DIGEST_NOTE = ".sha256"  # suffix of a worker's note of a file's digest, folded into meta.json at commit
SKIP_HINT = "resume from another checkpoint, or pass --skip-checkpoint-checks to load it unverified"
SMALL_FILE = 1 << 20  # check_files verifies the SHA-256 of files up to this size before launch (plan, RNG states)
_NAME = re.compile(r"iter_\d{8}")  # a committed checkpoint's directory

log = logging.getLogger("realloc.checkpoint")


def checkpoint_name(iterations_done: int) -> str:
    return f"iter_{iterations_done:08d}"


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_durably(path: Path, data: bytes) -> None:
    from realloc.atomic_file import naming  # (here: main's import block changed beside this one, a merge conflict)

    tmp = path.with_name(path.name + ".part")
    with naming(path), open(tmp, "wb") as f:  # a full disk's failed write names no file by itself
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


# -- master side --------------------------------------------------------------------------------------------
def begin(root: Path, iteration: int) -> Path:
    """Create the temporary directory the workers write an iteration's checkpoint into."""
    root.mkdir(parents=True, exist_ok=True)
    restore_replaced(root)
    for stale in root.glob(".tmp-*"):  # left by a killed run; never complete
        shutil.rmtree(stale, ignore_errors=True)
    tmp = root / f".tmp-{checkpoint_name(iteration)}-{secrets.token_hex(4)}"
    tmp.mkdir()
    return tmp


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def commit(tmp: Path, root: Path, iteration: int, meta: Mapping[str, Any], plan_json: str) -> Path:
    """Make the checkpoint in ``tmp`` visible under its final name, atomically."""
    write_file_durably(tmp / "plan.json", plan_json.encode())
    files = {}
    for f in sorted(p for p in tmp.rglob("*") if p.is_file() and not p.name.endswith((DIGEST_NOTE, ".part"))):
        note = f.with_name(f.name + DIGEST_NOTE)
        digest = note.read_text().strip() if note.is_file() else sha256_of(f)  # the master's own small files
        files[f.relative_to(tmp).as_posix()] = {"sha256": digest, "bytes": f.stat().st_size}
        note.unlink(missing_ok=True)
    body = {"format": CHECKPOINT_FORMAT, "iteration": iteration, **meta, "files": files}
    write_file_durably(tmp / META, json.dumps(body, indent=2, sort_keys=True).encode())
    for d in [tmp, *(p for p in tmp.rglob("*") if p.is_dir())]:
        _fsync_path(d)
    final = root / checkpoint_name(iteration)
    restore_replaced(root)
    old = root / (REPLACED + final.name)
    if final.exists():  # a re-run over the same iteration replaces it: set aside first (a kill now keeps it)
        final.rename(old)
        _fsync_path(root)
    tmp.rename(final)
    _fsync_path(root)
    shutil.rmtree(old, ignore_errors=True)
    return final


# An iter_N that a re-save of iteration N replaces, between commit()'s renames.
REPLACED = ".replaced-"


def restore_replaced(root: Path) -> None:
    """Finish a commit() a kill interrupted between its renames: an ``iter_N`` set aside whose replacement never
    got the name goes back to it (no iteration is lost); one whose replacement did is removed. A folder that
    cannot be changed (read-only, an export) is left as it is."""
    for old in root.glob(REPLACED + "iter_*") if root.is_dir() else ():
        final = root / old.name.removeprefix(REPLACED)
        try:
            if final.exists():
                shutil.rmtree(old)
            else:
                old.rename(final)
                _fsync_path(root)
        except OSError as e:
            log.warning("checkpoint %s could not be restored to %s: %s", old, final.name, e)


def read_meta(ckpt: Path) -> dict[str, Any]:
    """meta.json of a checkpoint, checked for what --resume and the workers rely on: one error naming the
    file and what is wrong, rather than an internal error later."""
    path = ckpt / META
    damaged = "the checkpoint is damaged; resume from another checkpoint (--resume <run>/checkpoints/iter_N)"
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as e:
        raise ValueError(f"checkpoint {ckpt}: cannot read {path} ({e.strerror or e}); it is incomplete or not a "
                         f"checkpoint") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: byte {e.start} is not UTF-8 text; {damaged}") from None
    try:
        meta = json.loads(text)
    except json.JSONDecodeError as e:
        what = "is empty" if not text.strip() else f"is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})"
        raise ValueError(f"{path} {what}; {damaged}") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{path} holds a JSON {type(meta).__name__}, not an object with the checkpoint's "
                         f"fields; {damaged}")
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{path}: format {meta.get('format')!r} is not supported (expected "
                         f"{CHECKPOINT_FORMAT})")
    done = meta.get("next_iteration")
    if type(done) is not int or done < 1:
        got = "has no" if "next_iteration" not in meta else f"has a bad ({done!r})"
        raise ValueError(f"{path} {got} `next_iteration` (the iterations the checkpoint holds, a positive "
                         f"integer); {damaged}")
    files = meta.get("files")
    if files is not None:
        if not isinstance(files, dict):
            raise ValueError(f"{path}: `files` must map file names to their sha256 and bytes, got a JSON "
                             f"{type(files).__name__}; {damaged}")
        for rel, rec in files.items():
            if not isinstance(rec, dict):
                raise ValueError(f"{path}: files[{rel!r}] must be an object with sha256 and bytes, got "
                                 f"{rec!r}; {damaged}")
            if type(rec.get("bytes")) is not int or rec["bytes"] < 0:
                raise ValueError(f"{path}: files[{rel!r}] has no valid `bytes` (the file's size); {damaged}")
            digest = rec.get("sha256")
            if not isinstance(digest, str) or len(digest) != 64:
                raise ValueError(f"{path}: files[{rel!r}] has no valid `sha256` (64 hex digits); {damaged}")
    return meta


def _recorded(ckpt: Path) -> dict[str, dict[str, Any]]:
    files = read_meta(ckpt).get("files")
    if files is None:
        raise ValueError(f"checkpoint {ckpt} records no checksums in {ckpt / META} (written before realloc "
                         f"recorded them); {SKIP_HINT}")
    return files


def check_files(ckpt: Path) -> None:
    """Every file meta.json records is there with its recorded size, and the small ones (plan.json, the
    RNG states) with their SHA-256: cheap, so run before launching; the workers check the shards' digests."""
    for rel, want in _recorded(ckpt).items():
        path = ckpt / rel
        if not path.is_file():
            raise ValueError(f"checkpoint file {path} is missing; {SKIP_HINT}")
        if path.stat().st_size != want["bytes"]:
            raise ValueError(f"checkpoint file {path} has {path.stat().st_size} bytes, but {want['bytes']} were "
                             f"saved: it is truncated or was replaced; {SKIP_HINT}")
        if want["bytes"] <= SMALL_FILE:
            _check_digest(path, want["sha256"])


def _check_digest(path: Path, want: str) -> None:
    got = sha256_of(path)
    if got != want:
        raise ValueError(f"checkpoint file {path} is corrupted: its SHA-256 is {got[:16]}..., the one recorded when "
                         f"it was saved is {want[:16]}...; {SKIP_HINT}")


def verify_file(ckpt: Path, path: Path) -> None:
    """``path`` has the SHA-256 recorded when the checkpoint was saved."""
    rel = path.relative_to(ckpt).as_posix()
    want = _recorded(ckpt).get(rel)
    if want is None:
        raise ValueError(f"checkpoint {ckpt} records no file {rel}; it was saved by another plan or is incomplete")
    if not path.is_file():
        raise ValueError(f"checkpoint file {path} is missing; {SKIP_HINT}")
    _check_digest(path, want["sha256"])


def latest(root: Path, skip_checks: bool = False, use: str = "--resume") -> Path | None:
    """The newest checkpoint under ``root`` (a checkpoints directory), or None.

    commit() writes meta.json before the directory gets its ``iter_*`` name, so a named directory
    without one is damaged, not in progress: the newest being so is an error (a silent fall-back
    would resume from older state than the user expects) unless ``skip_checks``, which warns and
    takes the newest one that has its meta.json. ``use`` is how the command picks another checkpoint
    (``--resume`` takes its path, ``realloc export`` an ``--iteration``), for the error's advice.
    """
    if not root.is_dir():
        return None
    restore_replaced(root)
    named = sorted(p for p in root.glob("iter_*") if p.is_dir() and _NAME.fullmatch(p.name))
    for i, ckpt in enumerate(reversed(named)):
        if (ckpt / META).is_file():
            return ckpt
        older = next((p for p in reversed(named[:len(named) - 1 - i]) if (p / META).is_file()), None)
        if not skip_checks:
            pick = f"--resume {older}" if use == "--resume" else f"{use} {iterations_of(older)}" if older else ""
            fix = (f"use the one before it ({pick}) or pass --skip-checkpoint-checks to fall back to it" if older
                   else "no older checkpoint has one either")
            raise ValueError(f"checkpoint {ckpt} has no {META}: it is damaged (a committed checkpoint always has "
                             f"one); {fix}")
        log.warning("checkpoint %s has no %s (damaged): skipped", ckpt, META)
    return None


def check_resume_layouts(ckpt: Path, saved: Mapping[str, str], wanted: Mapping[str, tuple[int, int]]) -> None:
    """Refuse a plan that keeps a trained model at another (tp, pp) than the checkpoint saved it in (its shards
    are tp x pp files; dp and the devices may change): one ValueError naming the model and both layouts."""
    for model, (tp, pp) in sorted(wanted.items()):
        m = re.search(r"tp(\d+)\D+pp(\d+)", str(saved.get(model, "")))
        if m is not None and (int(m.group(1)), int(m.group(2))) != (tp, pp):
            raise ValueError(f"--resume {ckpt}: model {model!r} was saved at tp={m.group(1)}, pp={m.group(2)} "
                             f"({saved[model]}), but this plan trains it at tp={tp}, pp={pp}; resume with the "
                             f"checkpoint's plan (omit --plan) or a plan that keeps the model's tp and pp (its dp "
                             f"and devices may change)")


def iterations_of(ckpt: Path) -> int:
    """The iterations a committed checkpoint holds, from its name (``iter_00000012``: 12)."""
    return int(ckpt.name.removeprefix("iter_"))


def set_aside_later(root: Path, start: int) -> str | None:
    """A run that resumes at iteration ``start`` in its run directory replaces the history after it (its metrics
    lines go too): the committed checkpoints after ``start`` move into ``root/replaced-<time>/``, kept but out of
    the way of ``--resume RUN`` and ``realloc export RUN``, which take the newest ``iter_*`` in ``root`` for this
    run's own. The same for ``root`` = the run's ``exports/`` (``--export-every``), which this run writes again.
    A fresh run (``start`` 0) in a used run directory replaces all of them. Returns the line that says so, or
    None when there are none."""
    later = sorted(p for p in root.glob("iter_*") if p.is_dir() and _NAME.fullmatch(p.name)
                   and iterations_of(p) > start) if root.is_dir() else []
    if not later:
        return None
    aside = root / f"replaced-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
    aside.mkdir()
    for p in later:
        if being_read(p / META):  # a `realloc export` reads it: moved under it, its next shard would be missing
            log.warning("waiting for the `realloc export` reading %s to finish before setting it aside", p)
        with claimed(p / META, wait=True):
            p.rename(aside / p.name)
    _fsync_path(root)
    which = f"after iteration {start}" if start else "of an earlier run in this run directory"
    return (f"{root.name} {which} ({', '.join(p.name for p in later)}) hold the history this run replaces: moved "
            f"to {aside}")


def resolve_resume(path: str | Path, skip_checks: bool = False) -> Path:
    """``--resume`` accepts a checkpoint directory, a checkpoints directory, or a run directory."""
    found = find_newest(path, skip_checks, "--resume")
    if found is None:
        raise ValueError(f"--resume {path}: no complete checkpoint found (looked for iter_*/{META} in {path} and "
                         f"{Path(path) / 'checkpoints'})")
    return found


def find_newest(path: str | Path, skip_checks: bool = False, use: str = "--resume") -> Path | None:
    """The checkpoint ``path`` names: itself, or the newest in it or in its ``checkpoints/``; None if none."""
    p = Path(path)
    if _NAME.fullmatch(p.name):
        restore_replaced(p.parent)
    if (p / META).is_file():
        return p
    if _NAME.fullmatch(p.name) and p.is_dir():
        raise ValueError(f"{p}: {p / META} is missing: the checkpoint is damaged (a committed checkpoint always "
                         f"has one); use another checkpoint")
    for root in (p / "checkpoints", p):
        found = latest(root, skip_checks, use)
        if found is not None:
            return found
    return None


def prune(root: Path, newest: Path, keep: int, busy: Collection[Path] = ()) -> list[Path]:
    """Delete the committed checkpoints under ``root`` older than the ``keep`` newest up to ``newest`` (the one
    just committed), so that saving often cannot fill the disk; ``keep`` 0 keeps all. Checkpoints after
    ``newest`` (left by a run this one resumed before their iterations) are not this run's to judge and stay,
    as do those in ``busy`` or read by a ``realloc export`` (``ckpt_lock``; the next save prunes them). Returns the
    deleted."""
    if keep <= 0:
        return []
    done = iterations_of(newest)
    named = sorted((p for p in root.glob("iter_*") if p.is_dir() and _NAME.fullmatch(p.name)
                    and iterations_of(p) <= done), key=iterations_of, reverse=True)
    busy = {Path(b).resolve() for b in busy}
    deleted = []
    for old in named[keep:]:
        if old.resolve() in busy:
            continue
        with claimed(old / META, wait=False) as free:  # a peer's `realloc export` reading it: the next save
            if not free:
                continue
            try:
                shutil.rmtree(old)
            except OSError as e:  # a checkpoint we cannot delete costs disk, not the run
                log.warning("could not delete old checkpoint %s (%s); delete it by hand", old, e)
                continue
        log.info("deleted checkpoint %s (keeping the newest %d)", old, keep)
        deleted.append(old)
    return deleted


# -- worker side -------------------------------------------------------------------------------------------------
def shard_file(ckpt: Path, model: str, tp_rank: int, pp_rank: int) -> Path:
    return ckpt / "models" / model / f"tp{tp_rank}_pp{pp_rank}.safetensors"


def rng_file(ckpt: Path, rank: int) -> Path:
    return ckpt / "rng" / f"rank{rank}.safetensors"


def _save(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(path.name + ".part")
    with safetensors_os_errors(part):
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(part), metadata=metadata)
    with open(part, "rb") as f:
        os.fsync(f.fileno())
    digest = sha256_of(part)  # read back from the page cache, so it covers what is on disk
    part.replace(path)
    path.with_name(path.name + DIGEST_NOTE).write_text(digest)


def _optimizer_view(params: Mapping[str, torch.Tensor], optimizer: Any) -> tuple[Mapping[str, torch.Tensor], Any]:
    """(tensors the optimizer steps on, by name; the torch optimizer holding their state).

    A plain torch optimizer steps on the parameters. ``MasterWeightAdamW`` (bf16 models) steps on
    fp32 master copies, which are optimizer state themselves and are saved as such.
    """
    if optimizer is not None and hasattr(optimizer, "masters") and hasattr(optimizer, "inner"):
        return optimizer.masters, optimizer.inner
    return params, optimizer


def _sharded(optimizer: Any) -> bool:
    """A distributed optimizer (``models/zero.py``): its state is sharded over dp."""
    return optimizer is not None and hasattr(optimizer, "gathered_state")


def save_model_shard(ckpt: Path, model: str, tp_rank: int, pp_rank: int, layout: str,
                     params: Mapping[str, torch.Tensor], optimizer: Any, write: bool = True,
                     tp_pp: tuple[int, int] | None = None) -> None:
    """Write the shard's file; with a distributed optimizer every dp rank calls it (the state is gathered,
    a collective over dp) and only the one with ``write`` writes. ``tp_pp``, the layout's tp and pp sizes,
    lets a layout that differs only in dp or devices resume from it (``load_model_shard``)."""
    import torch

    tensors = {f"param/{n}": p for n, p in params.items()}
    hyper: list[dict[str, Any]] = []
    stepped, torch_opt = _optimizer_view(params, optimizer)
    if _sharded(optimizer):
        for n, master, state in optimizer.gathered_state():
            if master is not None:
                tensors[f"master/{n}"] = master
            tensors.update({f"optim/{n}/{k}": v for k, v in state.items()})
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    elif torch_opt is not None:
        if stepped is not params:
            tensors.update({f"master/{n}": m for n, m in stepped.items()})
        name_of = {id(p): n for n, p in stepped.items()}
        for p, st in torch_opt.state.items():
            for k, v in st.items():
                tensors[f"optim/{name_of[id(p)]}/{k}"] = v if isinstance(v, torch.Tensor) else torch.tensor(v)
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in torch_opt.param_groups]
    scaler = getattr(optimizer, "loss_scale", None)
    if scaler is not None:  # fp16: the dynamic loss scale resumes where it was (models/loss_scale.py)
        tensors["loss_scale"] = torch.tensor([scaler.scale, float(scaler.good_steps)], dtype=torch.float64)
    if not write:
        return
    _save(shard_file(ckpt, model, tp_rank, pp_rank), tensors,
          {"format": str(CHECKPOINT_FORMAT), "model": model, "layout": layout, "tp_pp": json.dumps(tp_pp),
           "optimizer_groups": json.dumps(hyper)})


def _no_grad(fn: Any) -> Any:
    """``torch.no_grad()`` as a decorator that imports torch when the function runs, not when this module loads."""
    @functools.wraps(fn)
    def inner(*args: Any, **kwargs: Any) -> Any:
        import torch

        with torch.no_grad():
            return fn(*args, **kwargs)

    return inner


@_no_grad
def load_model_shard(ckpt: Path, model: str, tp_rank: int, pp_rank: int, layout: str,
                     params: Mapping[str, torch.Tensor], optimizer: Any, verify: bool = True,
                     tp_pp: tuple[int, int] | None = None) -> None:
    """Load this rank's shard. A shard saved in another layout loads if both record the same (tp, pp) sizes
    (``tp_pp``): the parameters are the same shards, and the optimizer state is whole in the file."""
    from realloc.runtime.persist.frozen_base import resumed_value  # torch: the workers' side only
    path = shard_file(ckpt, model, tp_rank, pp_rank)
    if not path.is_file():
        raise ValueError(f"checkpoint {ckpt} has no shard {path.name} of model {model!r}; was it saved with "
                         f"another layout?")
    if verify:
        verify_file(ckpt, path)
    with _open_shard(path) as f:
        meta = f.metadata() or {}
        same_shards = tp_pp is not None and json.loads(meta.get("tp_pp", "null")) == list(tp_pp)
        if meta.get("layout") != layout and not same_shards:
            raise ValueError(f"checkpoint {ckpt}: model {model!r} was saved in layout {meta.get('layout')}, but this "
                             f"plan keeps it in {layout}; resume with the checkpoint's plan (omit --plan) or a plan "
                             f"that keeps the model's tp and pp (its dp and devices may change)")
        # Sorted, never a set: a set's order follows the process's string-hash seed, and the distributed
        # optimizer's state must be built (and later gathered, ``zero.gathered_state``) alike on every dp rank.
        keys = sorted(f.keys())
        for n, p in params.items():
            if f"param/{n}" not in keys:
                raise ValueError(f"checkpoint {path}: parameter {n!r} is missing")
            saved = f.get_slice(f"param/{n}").get_shape()
            if tuple(saved) != tuple(p.shape):
                raise ValueError(f"checkpoint {path}: parameter {n!r} has shape {tuple(saved)}, this model's shard "
                                 f"is {tuple(p.shape)}; the checkpoint was saved for another model shape (or "
                                 f"another realloc version's vocabulary padding): resume from a matching checkpoint")
            # A model trained in bf16 or fp16 saved its fp32 masters too: a trainer that keeps its parameters in
            # fp32 (the model moved to a pool of another dtype) resumes from them, not from their rounding.
            # Without one (a LoRA model's frozen base): the straight run's value on this pool (frozen_base.py).
            p.copy_(f.get_tensor(f"master/{n}") if f"master/{n}" in keys else
                    resumed_value(p, f.get_tensor(f"param/{n}")))
        scaler = getattr(optimizer, "loss_scale", None)
        if scaler is not None and "loss_scale" in keys:
            scaler.scale, good = f.get_tensor("loss_scale").tolist()
            scaler.good_steps = int(good)
        if _sharded(optimizer):
            _load_sharded(f, path, keys, meta, optimizer)
            return
        stepped, torch_opt = _optimizer_view(params, optimizer)
        if torch_opt is None:
            return
        if stepped is not params:
            for n, m in stepped.items():
                m.copy_(_master(f, keys, n, path))
        _load_hyper(meta, torch_opt.param_groups)
        for n, p in stepped.items():
            prefix = f"optim/{n}/"
            state = {k[len(prefix):]: f.get_tensor(k).to(p.device) for k in keys if k.startswith(prefix)}
            if state:
                torch_opt.state[p] = state


@contextlib.contextmanager
def _open_shard(path: Path) -> Iterator[Any]:
    """``safe_open`` whose failures (a truncated or damaged file, read without its digest under
    --skip-checkpoint-checks) are one ValueError naming the file."""
    try:
        with safe_open(str(path), framework="pt") as f:
            yield f
    except (SafetensorError, OSError) as e:  # a bad header, or a tensor past the end of a truncated file
        raise ValueError(f"checkpoint file {path} cannot be read ({e}); it is truncated or damaged (it was not "
                         f"verified: --skip-checkpoint-checks?); resume from another checkpoint") from None


def _load_hyper(meta: Mapping[str, str], param_groups: list[dict[str, Any]]) -> None:
    hyper = json.loads(meta.get("optimizer_groups", "[]"))
    if hyper and len(hyper) == len(param_groups):
        for g, h in zip(param_groups, hyper):
            g.update({k: tuple(v) if isinstance(v, list) else v for k, v in h.items()})


def _load_sharded(f: Any, path: Path, keys: list[str], meta: Mapping[str, str], optimizer: Any) -> None:
    """Each rank reads the whole state of one tensor at a time and keeps its chunk (``DistributedAdamW``)."""
    _load_hyper(meta, optimizer.param_groups)
    for n in optimizer.params:
        master = _master(f, keys, n, path) if optimizer.keeps_masters else None
        prefix = f"optim/{n}/"
        optimizer.load_full_state(n, master, {k[len(prefix):]: f.get_tensor(k) for k in keys if k.startswith(prefix)})


def _master(f: Any, keys: list[str], n: str, path: Path) -> torch.Tensor:
    """The fp32 master weight of ``n`` for a trainer that keeps its parameters in bf16 or fp16: saved as such,
    or the parameter itself where the model was trained in fp32 (it moved to a pool of another dtype), exact."""
    if f"master/{n}" in keys:
        return f.get_tensor(f"master/{n}")
    if f.get_slice(f"param/{n}").get_dtype() == "F32":
        return f.get_tensor(f"param/{n}")
    raise ValueError(f"checkpoint {path}: fp32 master weight {n!r} is missing and its parameter is not fp32 "
                     f"(saved without master weights?)")


def save_rng(ckpt: Path, rank: int) -> None:
    import torch

    _save(rng_file(ckpt, rank), {"torch": torch.get_rng_state()}, {"format": str(CHECKPOINT_FORMAT)})


def load_rng(ckpt: Path, rank: int, verify: bool = True) -> None:
    path = rng_file(ckpt, rank)
    if verify:
        verify_file(ckpt, path)
    elif not path.is_file():
        log.warning("checkpoint file %s is missing: rank %d continues with a fresh RNG state", path, rank)
        return
    import torch

    with _open_shard(path) as f:
        torch.set_rng_state(f.get_tensor("torch"))
