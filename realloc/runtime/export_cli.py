"""``realloc export``: write a trained model of a run's checkpoint as a HuggingFace directory (``persist/export.py``)."""

from __future__ import annotations

import argparse

from realloc.runtime.persist import checkpoint
from realloc.runtime.persist.export import export_checkpoint, find_checkpoint


def main(args: argparse.Namespace) -> int:
    ckpt = find_checkpoint(args.run_dir, args.iteration, args.skip_checkpoint_checks)
    done = checkpoint.read_meta(ckpt).get("next_iteration")  # before: the run may set it aside once it is read
    out = export_checkpoint(ckpt, args.model, args.out, dtype=args.dtype, verify=not args.skip_checkpoint_checks,
                            fmt=args.format)
    print(f"exported {args.model} after iteration {done} from {ckpt} to {out}")
    return 0
