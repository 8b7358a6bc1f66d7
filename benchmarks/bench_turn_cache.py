"""A multi-turn GENERATE call with each rollout's KV cache kept across turns against prefilling the whole
conversation again at every turn (``interface_args["kv_cache"]``, realloc/models/turn_cache.py).

    python benchmarks/bench_turn_cache.py [--rounds 5] [--model small] [--rollouts 32] [--turns 4]

One process, one CPU device (gloo world of 1), a random model. The environment is plain Python (no tool process),
so the call's time is the model's: each turn the policy writes up to ``--turn-tokens`` tokens and the environment
answers with ``--obs-chars`` characters. The two settings run interleaved, ``--rounds`` times each; the table
gives the median seconds of the call, the prompt tokens run through the model, and the ratio. Both settings
sample the same tokens (checked here too; tests/test_multiturn_kv_cache.py checks tokens and log-probs).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

OBS_CHARS = 24


class EchoEnv:
    """Answers every turn with a fixed run of digits (``chars`` of them); ends after ``turns`` turns."""

    def __init__(self, turns: int, chars: int) -> None:
        self.turns, self.chars, self.t = turns, chars, 0

    def reset(self, record: dict) -> str:
        return ""

    def step(self, text: str) -> tuple[str | None, float, bool]:
        self.t += 1
        if self.t >= self.turns:
            return None, float(len(text) % 3), True
        return "<r>" + ("1234567890" * self.chars)[:self.chars] + "</r>", 0.0, False


def _call(model, tok, args, kv_cache: bool, seed: int) -> tuple[float, dict, torch.Tensor]:
    from realloc.algorithms.context import CallContext
    from realloc.algorithms.critic_free.grpo import GRPOConfig
    from realloc.algorithms.critic_free.multiturn import multiturn_generate
    from realloc.calls import GENERATE, ModelFunctionCallDef

    env = {"env": lambda **kw: EchoEnv(args.turns, args.obs_chars), "max_turns": args.turns,
           "turn_tokens": args.turn_tokens, "kv_cache": kv_cache}
    n, P = args.rollouts, 8
    T = args.turns * (args.turn_tokens + args.obs_chars + 8)
    call = ModelFunctionCallDef(name="actor_gen", model_name="actor", interface_type=GENERATE,
                                interface_impl="grpo_multiturn", interface_args=env)
    ctx = CallContext(call=call, model=model, optimizer=None, config=GRPOConfig(), prompt_len=P, gen_len=T, seed=seed,
                      iteration=0, ids=range(n), batch_size=n, n_mbs=1, eos_token_ids=tok.eos_token_ids,
                      pad_token_id=tok.pad_token_id, vocab_limit=tok.vocab_size, group_size=1, tokenizer=tok)
    g = torch.Generator().manual_seed(seed)
    prompts = [tok.encode(f"{int(a)}*{int(b)}=") for a, b in zip(torch.randint(100, 999, (n,), generator=g),
                                                                torch.randint(10, 99, (n,), generator=g))]
    tokens = torch.full((n, P), tok.pad_token_id, dtype=torch.long)
    for b, p in enumerate(prompts):
        tokens[b, :len(p)] = torch.tensor(p[:P])
    lengths = torch.tensor([min(len(p), P) for p in prompts])
    t0 = time.perf_counter()
    out = multiturn_generate(ctx, {"prompts": {"tokens": tokens, "lengths": lengths}})
    return time.perf_counter() - t0, out.sums, out.outputs["seq"]["tokens"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--model", default="small", help="a model type of realloc/models/config.py (random weights)")
    p.add_argument("--rollouts", type=int, default=32)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--turn-tokens", type=int, default=16)
    p.add_argument("--obs-chars", type=int, default=OBS_CHARS)
    args = p.parse_args()
    import torch.distributed as dist

    import engine_workers
    from realloc.data.tokenizer import Tokenizer
    from realloc.models.config import get_model_config
    from realloc.models.engine import ParallelModel

    store = Path(tempfile.mkdtemp(prefix="bench_turn_cache_")) / "store"
    device = engine_workers.start(0, 1, str(store), "cpu")
    cfg = get_model_config(args.model)
    cache, layouts = engine_workers.model_layouts(cfg, [(1, 1, 1)], 1)
    model = ParallelModel(cfg, cache.model_groups(layouts[0]), device=device, seed=1)
    tok = Tokenizer.load(REPO / "experiments" / "data" / "calc_tokenizer")
    times: dict[bool, list[float]] = {True: [], False: []}
    sums: dict[bool, dict] = {}
    for r in range(args.rounds + 1):  # round 0 warms up
        seqs = {}
        for kv in ((True, False) if r % 2 else (False, True)):
            s, sums[kv], seqs[kv] = _call(model, tok, args, kv, seed=r)
            if r:
                times[kv].append(s)
        if not torch.equal(seqs[True], seqs[False]):
            print("bench_turn_cache: the two settings sampled different tokens", file=sys.stderr)
            return 1
    load = os.getloadavg()[0]
    print(f"model {args.model}, {args.rollouts} rollouts x {args.turns} turns of <= {args.turn_tokens} tokens, "
          f"observations {args.obs_chars + 7} tokens; {args.rounds} rounds each, interleaved; load {load:.1f}")
    print(f"{'GENERATE call':<32}{'median s':>10}{'prompt tokens prefilled':>26}")
    kept = sums[True]
    prefill_again = kept["prefill_tokens"] + kept["cached_tokens"]  # every turn's whole conversation
    med = {kv: statistics.median(v) for kv, v in times.items()}
    print(f"{'prefill the conversation again':<32}{med[False]:>10.3f}{prefill_again:>26.0f}")
    print(f"{'KV cache kept across turns':<32}{med[True]:>10.3f}{kept['prefill_tokens']:>26.0f}")
    print(f"speed-up {med[False] / med[True]:.2f}x; prefilled tokens {kept['prefill_tokens'] / prefill_again:.2f}x")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
