"""TRL's side of ``bench_vs_trl.py``: TRL's ``GRPOTrainer`` on the demo's GRPO stage, with the demo's settings.

Runs in TRL's own environment (``bench_vs_trl.py --trl-python``), so it imports neither realloc nor its pins:

    .venv-trl/bin/python benchmarks/trl_grpo_arith.py --checkpoint experiments/data/arith_sft \\
        --train experiments/data/arith_train.jsonl --out /tmp/trl --iterations 40 --threads 2 --report r.json

The settings are ``experiments/arith_grpo.py``'s: per iteration 32 prompts x 8 samples of at most 4 new tokens
(temperature 1, no top-k or nucleus filter), the exact-match reward (the response's first number written exactly
as the answer: realloc's ``verifiable.exact_number_match``), group-normalized advantages, a k3 KL term of
weight 0.01 to the frozen start, the clipped surrogate (0.2), two optimizer steps per iteration (128 samples each,
the loss normalized by each step's tokens: TRL's ``bnpo``, realloc's ``token``), AdamW lr 5e-4 with betas
(0.9, 0.95), eps 1e-5 and a linear warm-up over the first 10% of the steps, gradient clipping at 1, fp32.

The report (JSON) holds when the process started, when the first generation began (the "first call") and the
end of every optimizer step; the trained model is saved in ``OUT/final`` for the held-out check.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from pathlib import Path

NUMBER = re.compile(r"-?\d+")
PROMPTS_PER_ITERATION = 32
SAMPLES_PER_PROMPT = 8
MAX_NEW_TOKENS = 4
STEPS_PER_ITERATION = 2


def process_start_time() -> float:
    """When this process started (Linux's /proc), else now."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        btime = next(int(x.split()[1]) for x in Path("/proc/stat").read_text().splitlines() if x.startswith("btime "))
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


def exact_match(completions: list[str], answer: list[str], **_: object) -> list[float]:
    """1 when the completion's first number is the answer as written ("7", not "007")."""
    out = []
    for text, ans in zip(completions, answer):
        m = NUMBER.search(text)
        out.append(float(m is not None and m.group(0) == str(ans).strip()))
    return out


def main() -> None:
    launched = process_start_time()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--train", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--report", required=True)
    p.add_argument("--iterations", type=int, default=40)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    rows = [json.loads(x) for x in Path(args.train).read_text().splitlines() if x.strip()]
    data = Dataset.from_list([{"prompt": r["prompt"], "answer": str(r["answer"])} for r in rows])
    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint, torch_dtype=torch.float32)
    steps = args.iterations * STEPS_PER_ITERATION
    config = GRPOConfig(
        output_dir=args.out, use_cpu=True, bf16=False, fp16=False, seed=args.seed, report_to="none",
        save_strategy="no", logging_steps=STEPS_PER_ITERATION, disable_tqdm=True, max_steps=steps,
        per_device_train_batch_size=PROMPTS_PER_ITERATION * SAMPLES_PER_PROMPT // STEPS_PER_ITERATION,
        gradient_accumulation_steps=1, steps_per_generation=STEPS_PER_ITERATION, num_generations=SAMPLES_PER_PROMPT,
        max_completion_length=MAX_NEW_TOKENS, temperature=1.0, top_p=1.0, top_k=0, num_iterations=1,
        beta=0.01, epsilon=0.2, loss_type="bnpo", scale_rewards="group",
        learning_rate=5e-4, lr_scheduler_type="constant_with_warmup", warmup_steps=round(0.1 * steps),
        adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-5, weight_decay=0.0, max_grad_norm=1.0,
        dataloader_num_workers=0)
    first_call: list[float] = []
    step_ends: list[float] = []

    class Timed(GRPOTrainer):
        def _generate(self, prompts: list):  # the first generation starts: the run's "first call"
            if not first_call:
                first_call.append(time.time())
            return super()._generate(prompts)

    class StepEnds(TrainerCallback):
        def on_step_end(self, *a: object, **k: object) -> None:
            step_ends.append(time.time())

    trainer = Timed(model=model, reward_funcs=exact_match, args=config, train_dataset=data,
                    processing_class=tokenizer, callbacks=[StepEnds()])
    trainer.train()
    final = Path(args.out) / "final"
    trainer.save_model(str(final))
    tokenizer.save_pretrained(str(final))
    Path(args.report).write_text(json.dumps({"launched": launched, "first_call": first_call[0] if first_call else None,
                                             "step_ends": step_ends, "checkpoint": str(final),
                                             "trl": __import__("trl").__version__, "threads": args.threads}))


if __name__ == "__main__":
    main()
