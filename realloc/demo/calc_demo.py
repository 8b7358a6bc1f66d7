"""The tool demo: multiply a three-digit number by a two-digit one, with a calculator tool and without.

    python -m realloc.demo.calc_demo [--run-dir runs/calc_demo] [--iterations N]

1. **SFT**, twice, from random weights on the same 1,000 problems (``experiments/calc_sft.py``, stopped at
   iteration 150 of its 300): on tool-use traces (``<c>123*45</c>`` EOS ``<r>5535</r>5535``), and on direct
   answers (``5535``).
2. **GRPO**, twice: with the tool (``experiments/calc_grpo_tool.py``: multi-turn rollouts, the calculator in
   the sandbox) from the tool SFT model, and without it (``experiments/calc_grpo_direct.py``: single-turn, the
   same exact-match reward) from the direct SFT model.
3. **Accuracy** of each of the four checkpoints on 200 held-out problems, greedy, decoded by a loop over
   transformers' forward pass (not realloc's generation); the tool arm's calls are answered by the same
   calculator in this process.

``make demo`` (the arithmetic demo) is unchanged; this is a second demo with its own command.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Sequence

from realloc.demo.arith_demo import REPO, _realloc
from realloc.demo.calc_task import EVAL_FILE, RESULT_FORMAT, SFT_DIRECT_FILE, TOKENIZER_DIR, TOOL

EXPERIMENTS = REPO / "experiments"
DATA = EXPERIMENTS / "data"
TURN_TOKENS = 16
# The SFT stage stops at iteration 150 of calc_sft.py's 300: the tool format is learned and the copying of the
# operands and the result is right about a third of the time (all 300: ~95%, little left for GRPO to show).
SFT_ITERATIONS = 150


@dataclasses.dataclass(frozen=True)
class Score:
    n: int
    correct: int
    tool_calls: int
    examples: tuple[str, ...]

    @property
    def accuracy(self) -> float:
        return self.correct / self.n


def tool_accuracy(checkpoint: Path, use_tool: bool, limit: int | None = None) -> Score:
    """Held-out exact match, greedy: a turn with ``<c>...</c>`` gets the calculator's answer and one more turn."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from realloc.algorithms.rewards.text_rules import exact_number_match
    from realloc.data.tokenizer import Tokenizer
    from realloc.tools.builtin import calculate

    hf_logging.disable_progress_bar()
    tok = Tokenizer.load(DATA / TOKENIZER_DIR)
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint)).eval()
    records = [json.loads(line) for line in (DATA / EVAL_FILE).read_text().splitlines()][:limit]
    call = re.compile(rf"<{TOOL}>(.*?)</{TOOL}>", re.DOTALL)
    rows = [tok.encode(rec["prompt"]) for rec in records]
    starts = [len(r) for r in rows]
    final = [""] * len(rows)
    calls = 0
    pending = list(range(len(rows)))  # rows whose conversation goes on
    for turn in range(2 if use_tool else 1):
        said = _greedy(model, [rows[i] for i in pending], tok.vocab_size, set(tok.eos_token_ids), torch)
        nxt = []
        for i, new in zip(pending, said):
            rows[i] += new
            text = tok.decode(new)
            m = call.search(text) if use_tool and turn == 0 else None
            if m is None:
                final[i] = text
                continue
            calls += 1
            try:
                answer = calculate(m.group(1))
            except (ValueError, ArithmeticError) as e:
                answer = f"error: {type(e).__name__}: {e}"
            rows[i] += tok.encode(RESULT_FORMAT.format(answer), add_special_tokens=False)
            nxt.append(i)
        pending = nxt
    correct = sum(int(exact_number_match("", f, rec["answer"])) for f, rec in zip(final, records))
    examples = tuple(rec["prompt"] + tok.decode(r[s:], skip_special_tokens=False)
                     for rec, r, s in list(zip(records, rows, starts))[:3])
    return Score(len(records), correct, calls, examples)


def _greedy(model, rows: list[list[int]], vocab: int, eos: set[int], torch) -> list[list[int]]:
    """One greedy turn of every row at once (left-padded, positions from each row's own tokens)."""
    out: list[list[int]] = [[] for _ in rows]
    done = [False] * len(rows)
    if not rows:
        return out
    with torch.no_grad():
        for _ in range(TURN_TOKENS):
            seqs = [r + o for r, o in zip(rows, out)]
            width = max(len(x) for x in seqs)
            ids = torch.zeros(len(seqs), width, dtype=torch.long)
            mask = torch.zeros(len(seqs), width, dtype=torch.long)
            for b, x in enumerate(seqs):
                ids[b, width - len(x):] = torch.tensor(x)
                mask[b, width - len(x):] = 1
            pos = (mask.cumsum(-1) - 1).clamp(min=0)
            logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -1, :vocab]
            for b, t in enumerate(logits.argmax(-1).tolist()):
                if not done[b]:
                    out[b].append(t)
                    done[b] = t in eos
            if all(done):
                break
    return out


def _run(experiment: str, run_dir: Path, out: Path, sets: list[str], iterations: int | None = None) -> float:
    """``realloc run`` then ``realloc export`` of the actor into ``out``; the run's seconds."""
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    its = ["--iterations", str(iterations)] if iterations else []
    t0 = time.time()
    _realloc(["run", str(EXPERIMENTS / experiment), "--search-time", "5", "--run-dir", str(run_dir), "--quiet",
              *its, *(x for s in sets for x in ("--set", s))], log=run_dir / "run.log")
    seconds = time.time() - t0
    shutil.rmtree(out, ignore_errors=True)
    _realloc(["export", str(run_dir), "--model", "actor", "--out", str(out)], log=run_dir / "export.log")
    return seconds


def demo(root: Path, iterations: int | None = None, sft_iterations: int = SFT_ITERATIONS,
         seed: int | None = None) -> dict[str, Score]:
    t0 = time.time()
    seeded = [] if seed is None else [f"seed={seed}"]
    seconds = {
        "sft_tool": _run("calc_sft.py", root / "run_sft_tool", root / "sft_tool", seeded, sft_iterations),
        "sft_direct": _run("calc_sft.py", root / "run_sft_direct", root / "sft_direct",
                           [f"dataset=data/{SFT_DIRECT_FILE}", *seeded], sft_iterations),
    }
    scores = {"sft_tool": tool_accuracy(root / "sft_tool", True),
              "sft_direct": tool_accuracy(root / "sft_direct", False)}
    print(f"after SFT: with the tool {_line(scores['sft_tool'])}; without {_line(scores['sft_direct'])}", flush=True)
    seconds["grpo_tool"] = _run("calc_grpo_tool.py", root / "run_grpo_tool", root / "grpo_tool",
                                [f"init={root / 'sft_tool'}", *seeded], iterations)
    seconds["grpo_direct"] = _run("calc_grpo_direct.py", root / "run_grpo_direct", root / "grpo_direct",
                                  [f"init={root / 'sft_direct'}", *seeded], iterations)
    scores["grpo_tool"] = tool_accuracy(root / "grpo_tool", True)
    scores["grpo_direct"] = tool_accuracy(root / "grpo_direct", False)
    print(f"after GRPO: with the tool {_line(scores['grpo_tool'])}; without {_line(scores['grpo_direct'])}")
    print("in the GRPO run with the tool, evaluated by realloc (its generation, the ToolEnv in the loop, "
          "greedy, 192 of the held-out problems): " + in_run_eval(root / "run_grpo_tool"))
    print("held-out exact match (200 problems, greedy)   after SFT   after GRPO")
    for arm in ("tool", "direct"):
        print(f"  {'with the calculator tool' if arm == 'tool' else 'without a tool':<44}"
              f"{scores['sft_' + arm].accuracy:>9.1%}   {scores['grpo_' + arm].accuracy:>10.1%}")
    print("seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in seconds.items()) + f"; {time.time() - t0:.0f} s in all "
          f"(runs and checkpoints in {root})")
    for e in scores["grpo_tool"].examples:
        print(f"  e.g. {e}")
    return scores


def in_run_eval(run_dir: Path) -> str:
    """The run's own evaluations (``eval`` in metrics.jsonl): exact match by iteration."""
    evals = [(m["iteration"], m["eval"]["reward"]) for m in map(json.loads, (run_dir / "metrics.jsonl").open())
             if m.get("eval")]
    return ", ".join(f"{r:.1%} at iteration {t}" for t, r in evals) or "none"


def _line(s: Score) -> str:
    return f"{s.correct}/{s.n} = {s.accuracy:.1%}" + (f" ({s.tool_calls} tool calls)" if s.tool_calls else "")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m realloc.demo.calc_demo", description=__doc__.split("\n")[0])
    p.add_argument("--run-dir", default=str(REPO / "runs" / "calc_demo"))
    p.add_argument("--iterations", type=int, default=None, help="GRPO iterations (default: the experiments')")
    p.add_argument("--sft-iterations", type=int, default=SFT_ITERATIONS,
                   help=f"SFT iterations, of calc_sft.py's schedule of 300 (default {SFT_ITERATIONS})")
    p.add_argument("--seed", type=int, default=None, help="every stage's seed (default: the experiments', 1)")
    args = p.parse_args(argv)
    try:
        demo(Path(args.run_dir).resolve(), args.iterations, args.sft_iterations, args.seed)
    except (ValueError, RuntimeError) as e:
        print(f"calc_demo: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
