"""Memory of the engine per layout: measured now, estimated, and measured on an earlier revision, in one run.

    .venv/bin/python benchmarks/bench_memory.py                 # against --baseline b178bc7 (before issue 21)
    .venv/bin/python benchmarks/bench_memory.py --baseline REV

Two gloo processes (one thread each) run the ``small`` model (8 layers, hidden 256, vocabulary 256) in
bf16, the GPUs' precision, on each layout of the 2 local devices: dp 2, tp 2 and pp 2, training with and
without activation recomputation, training on rows of 16..128 tokens (1-8x) padded to each micro-batch's longest row and packed (a revision
without packing has the padded row only; the estimate prices the padded micro-batches' width, and for packed
rows the tokens that exist: the largest micro-batch's), inference, and
pipelined generation of 8 micro-batches at pp 2; at dp 2
also training with bf16 gradient buffers (``TrainConfig.grad_dtype="bf16"``; a revision without the setting
has no such row).
Per device (the larger of the two):

- steady: every tensor alive between two train steps (parameters and optimizer state), counted by
  ``LiveTensorMeter`` from the model's creation on; the engine's gradient buffers exist only inside a step;
- state: training state per local parameter, steady plus the gradient buffers a step allocates: 2 + 4 + 12/dp
  bytes with the distributed optimizer and fp32 gradient buffers, 2 + 2 + 12/dp with bf16 ones (18 before);
- peak: steady plus the peak of every tensor one more train step (or forward, or generate) creates,
  temporaries included (``LiveTensorMeter``);
- est.: ``estimator.memory.stage_call_memory`` of the same call (parameters and optimizer state for steady,
  the total for peak);
- base: the same measurement on ``--baseline`` (``git archive`` of that revision into a temporary folder, run
  by the same script), and new/base.

The engine's allocations are deterministic, so one run of each is enough.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODEL = "small"
TRAIN = dict(n_mbs=2, rows=4, seq=128)
GEN = dict(n_mbs=8, rows=4, prompt_len=16, gen_len=48)
# (name, dp, tp, pp)
LAYOUTS = (("dp 2", 2, 1, 1), ("tp 2", 1, 2, 1), ("pp 2", 1, 1, 2))


def _loss(out, mb):
    mask = out.token_mask
    return -(out.logprobs() * mask).sum() / mask.sum(), {}


def _measure(rank: int, store: str, results) -> None:
    """One gloo process: every layout's steady and peak bytes on this rank, by the code under sys.path[0]."""
    import inspect

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    from realloc.models.activations import LiveTensorMeter
    from realloc.models.config import get_model_config
    from realloc.models.engine import ParallelModel
    from realloc.models.groups import ModelLayout, ProcessGroupCache
    from realloc.models.sampling import GenerationConfig
    from realloc.strategy import ParallelStrategy

    cfg = get_model_config(MODEL)
    cache = ProcessGroupCache()
    layouts = {name: ModelLayout.for_model(cfg, (0, 1), ParallelStrategy(dp, tp, pp)) for name, dp, tp, pp in LAYOUTS}
    cache.ensure_layouts(list(layouts.values()))
    g = torch.Generator().manual_seed(0)
    out = {}
    for name, dp, tp, pp in LAYOUTS:
        groups = cache.model_groups(layouts[name])
        mbs = [{"input_ids": torch.randint(0, cfg.vocab_size, (TRAIN["rows"], TRAIN["seq"]), generator=g),
                "lengths": torch.full((TRAIN["rows"],), TRAIN["seq"])} for _ in range(TRAIN["n_mbs"])]
        # rows of 16..128 tokens (1-8x), padded to the longest of their micro-batch, or packed
        lens = [torch.randint(TRAIN["seq"] // 8, TRAIN["seq"] + 1, (TRAIN["rows"],), generator=g)
                for _ in range(TRAIN["n_mbs"])]
        skewed = [{"input_ids": (mb["input_ids"] * (torch.arange(TRAIN["seq"])[None] < n[:, None]))[:, :int(n.max())],
                   "lengths": n} for mb, n in zip(mbs, lens)]  # each micro-batch as wide as its longest row
        packs = "pack_sequences" in inspect.signature(ParallelModel).parameters
        runs = [(False, False, None), (True, False, None), (False, False, "padded")]
        if packs:
            runs.append((False, False, "packed"))
        if dp > 1 and "grad_dtype" in inspect.signature(ParallelModel.make_optimizer).parameters:
            runs.append((False, True, None))
        for recompute, bf16_grads, skew in runs:
            extra = {"grad_dtype": torch.bfloat16} if bf16_grads else {}
            batches = skewed if skew else mbs
            with LiveTensorMeter() as steady:
                model = ParallelModel(cfg, groups, dtype=torch.bfloat16, seed=1)
                if packs:
                    model.pack_sequences = skew == "packed"
                opt = model.make_optimizer(lr=1e-6, **extra)
                model.train_step(batches, _loss, opt, recompute=recompute)
                torch.empty(0)  # the meter notices frees at the next operator: the step's gradient buffers
            n_params = sum(p.numel() for p in model.params().values())
            grad_bytes = 2 if bf16_grads else 4
            with LiveTensorMeter() as step:
                model.train_step(batches, _loss, opt, recompute=recompute)
            key = (f"{name} train{' recompute' if recompute else ''}{' bf16 grads' if bf16_grads else ''}"
                   f"{f' 1-8x {skew}' if skew else ''}")
            out[key] = dict(stage=groups.pp_rank, steady=steady.current, peak=steady.current + step.peak,
                            params=n_params, state=steady.current + grad_bytes * n_params,
                            # the row length the estimate prices: the widest padded micro-batch, or the tokens of
                            # the largest packed one spread over its rows
                            seq=(max(int(n.max()) for n in lens) if skew == "padded" else
                                 -(-max(int(n.sum()) for n in lens) // TRAIN["rows"]) if skew == "packed" else
                                 TRAIN["seq"]))
            del model, opt
        with LiveTensorMeter() as steady:
            model = ParallelModel(cfg, groups, dtype=torch.bfloat16, seed=1)
        whole = {k: torch.cat([mb[k] for mb in mbs]) for k in mbs[0]}
        with LiveTensorMeter() as fwd:
            model.forward(whole, n_mbs=TRAIN["n_mbs"])
        out[f"{name} inference"] = dict(stage=groups.pp_rank, steady=steady.current, peak=steady.current + fwd.peak,
                                        params=sum(p.numel() for p in model.params().values()))
        if pp == 2:
            prompts = torch.randint(1, cfg.vocab_size, (GEN["rows"] * GEN["n_mbs"] // dp, GEN["prompt_len"]),
                                    generator=g).tolist()
            gcfg = GenerationConfig(max_new_tokens=GEN["gen_len"], seed=3, eos_token_ids=())
            with LiveTensorMeter() as gen:
                model.generate(prompts, gcfg, n_mbs=GEN["n_mbs"])
            out[f"{name} generate"] = dict(stage=groups.pp_rank, steady=steady.current,
                                           peak=steady.current + gen.peak, params=out[f"{name} inference"]["params"])
        del model
    results.put((rank, out))
    dist.destroy_process_group()


def measure_here() -> dict:
    """Both ranks' measurements by the ``realloc`` of sys.path[0], as {config: [rank 0's, rank 1's]}."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_measure, args=(r, os.path.join(tmp, "store"), results)) for r in range(2)]
        for p in procs:
            p.start()
        got = dict(results.get() for _ in procs)
        for p in procs:
            p.join()
    return {k: [got[0][k], got[1][k]] for k in got[0]}


def measure_tree(root: Path) -> dict:
    """Run this script's measurement on the source tree at ``root`` in a fresh interpreter."""
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1")
    code = (f"import sys, json; sys.path.insert(0, {str(root)!r}); sys.path.insert(1, {str(REPO / 'benchmarks')!r});"
            f"import bench_memory; print('JSON' + json.dumps(bench_memory.measure_here()))")
    run = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True)
    line = next((x for x in run.stdout.splitlines() if x.startswith("JSON")), None)
    if run.returncode != 0 or line is None:
        raise SystemExit(f"measuring {root} failed:\n{run.stderr[-4000:]}")
    return json.loads(line[4:])


def estimate(config: str, stage: int, seq: int = TRAIN["seq"]) -> tuple[int, int]:
    """(static, total) bytes of the estimator for one config's call on a device of pipeline stage ``stage``, its
    train rows ``seq`` tokens long."""
    from realloc.calls import InterfaceType
    from realloc.estimator.hardware import Precision
    from realloc.estimator.memory import Workload, stage_call_memory
    from realloc.models.config import get_model_config
    from realloc.strategy import ParallelStrategy

    words = config.split()  # e.g. "pp 2 train recompute", "dp 2 train bf16 grads"
    name, what = " ".join(words[:2]), words[2]
    dp, tp, pp = next((d, t, p) for n, d, t, p in LAYOUTS if n == name)
    cfg, s, bf16 = get_model_config(MODEL), ParallelStrategy(dp, tp, pp), Precision.for_dtype("bf16")
    if "bf16 grads" in config:
        bf16 = bf16.with_grads("bf16")
    if what == "generate":
        work = Workload(InterfaceType.GENERATE, n_seqs=GEN["rows"] * GEN["n_mbs"], n_steps=1,
                        prompt_len=GEN["prompt_len"], gen_len=GEN["gen_len"])
        m = stage_call_memory(cfg, work, s, GEN["n_mbs"], stage, bf16)
    else:
        kind = InterfaceType.TRAIN_STEP if what == "train" else InterfaceType.INFERENCE
        work = Workload(kind, n_seqs=TRAIN["rows"] * TRAIN["n_mbs"] * dp, n_steps=1, prompt_len=seq // 2,
                        gen_len=seq - seq // 2)
        m = stage_call_memory(cfg, work, s, TRAIN["n_mbs"], stage, bf16, recompute="recompute" in config)
    return m.params + m.optimizer, m.total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", default="b178bc7", help="git revision to compare with (default: before issue 21)")
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    with tempfile.TemporaryDirectory() as tmp:
        base_root = Path(tmp) / "base"
        base_root.mkdir()
        archive = subprocess.run(["git", "-C", str(REPO), "archive", args.baseline, "realloc"], capture_output=True,
                                 check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(base_root)], input=archive, check=True)
        base = measure_tree(base_root)
    now = measure_tree(REPO)
    mib = 2 ** 20
    print(f"== memory per device, {MODEL} in bf16 on 2 gloo processes; MiB (the larger rank); base = {args.baseline}")
    head = (f"{'config':<26}{'steady':>9}{'est.':>9}{'base':>9}{'new/base':>9}{'state B/p':>10}{'base':>7}"
            f"{'peak':>9}{'est.':>9}{'base':>9}{'new/base':>9}")
    print(head)
    print("-" * len(head))
    for config, ranks in now.items():
        r = max(range(2), key=lambda i: ranks[i]["peak"])
        cur, old = ranks[r], base.get(config, [None, None])[r]
        static, total = estimate(config, cur["stage"], cur.get("seq", TRAIN["seq"]))
        row = f"{config:<26}{cur['steady'] / mib:>9.2f}{static / mib:>9.2f}"
        row += (f"{old['steady'] / mib:>9.2f}{cur['steady'] / old['steady']:>9.2f}" if old else f"{'-':>9}{'-':>9}")
        if "state" in cur:
            row += f"{cur['state'] / cur['params']:>10.2f}"
            row += f"{old['state'] / old['params']:>7.2f}" if old else f"{'-':>7}"
        else:
            row += f"{'':>10}{'':>7}"
        row += f"{cur['peak'] / mib:>9.2f}{total / mib:>9.2f}"
        row += (f"{old['peak'] / mib:>9.2f}{cur['peak'] / old['peak']:>9.2f}" if old else f"{'-':>9}{'-':>9}")
        print(row)
    print("steady: parameters and optimizer state between steps; state B/p: training state per parameter with the "
          "step's gradient buffers; peak: steady plus everything the call creates")


if __name__ == "__main__":
    main()
