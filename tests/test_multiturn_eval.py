"""Evaluation (``eval:``) of a multi-turn experiment: the GENERATE call scores its own rollouts, so the
held-out score is the environment's, with the environment in the loop (runtime/inputs/evaluation.py).

End to end on the local 2-device CPU cluster, the actor's train step data-parallel over both devices (so each
replica evaluates its half, its own environments answering): every logged eval conversation is replayed through
a fresh environment (tests/multiturn_cases.py) on the eval set's records, which must give back its observations
and its score; the metric is the mean of those scores; greedy rows of one prompt are one conversation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from multiturn_cases import LengthEnv
from test_multiturn_breadth_e2e import HEAD, _run

REPO = Path(__file__).resolve().parents[1]
EVAL = HEAD + '''
from realloc.runtime.inputs.evaluation import EvalConfig


@auto(nodelist="localhost", n_devices_per_node=2, device="cpu", batch_size=4, prompt_len=8, gen_len=24)
@dataclasses.dataclass
class MultiTurnEval:
    seed: int = 1
    dataset: str = DATA + "/calc_train.jsonl"
    tokenizer: str = DATA + "/calc_tokenizer"
    grpo: GRPOConfig = GRPOConfig(n_minibatches=2, lr=1e-2, kl_coef=0.01)
    eval: EvalConfig = EvalConfig(dataset=DATA + "/calc_eval.jsonl", every=1, batches=2)

    @property
    def rpcs(self):
        return multiturn_rpcs("grpo", env=ENV, actor="tiny", n_samples=4)
'''


def test_the_calc_demo_evaluates_with_its_generation_as_the_scorer():
    from realloc.overrides import load_with_overrides
    from realloc.runtime.inputs.evaluation import eval_calls

    ec = eval_calls(load_with_overrides(str(REPO / "experiments" / "calc_grpo_tool.py"), []))
    assert (ec.generate, ec.train, ec.reward, ec.reward_key) == ("actor_gen", "actor_train", "actor_gen", "rewards")
    assert ec.self_scored


def _replay(tok, prompt_text: str, response: list[int], answer: str) -> float | None:
    """The score a fresh environment gives the conversation, or None if the logged observations are not its own:
    first observation, a policy turn (the split found by trying each), the environment's answer, the last turn."""
    env = LengthEnv(turns=2)
    first = tok.encode(env.reset({"answer": answer}), add_special_tokens=False)
    if response[:len(first)] != first:
        return None
    rest = response[len(first):]
    for k in range(1, min(8, len(rest)) + 1):  # the first turn: at most turn_tokens
        probe = LengthEnv(turns=2)
        probe.reset({"answer": answer})
        obs, r1, _ = probe.step(tok.decode(rest[:k]))
        enc = tok.encode(obs, add_special_tokens=False)
        if rest[k:k + len(enc)] == enc:
            last = rest[k + len(enc):]
            if not last:  # the budget ran out with the observation
                return r1
            _, r2, done = probe.step(tok.decode(last))
            assert done
            return r1 + r2
    return None


def test_multiturn_eval_scores_held_out_prompts_with_the_environment_in_the_loop(tmp_path):
    from realloc.data.tokenizer import Tokenizer

    metrics = _run(tmp_path, "eval", EVAL, {"*": ("localhost", 2, 1, 1, 1), "actor_gen": ("localhost:0", 1, 1, 1, 1)}, 2)
    tok = Tokenizer.load(REPO / "experiments" / "data" / "calc_tokenizer")
    answers = {json.loads(line)["prompt"]: json.loads(line)["answer"]
               for line in (REPO / "experiments" / "data" / "calc_eval.jsonl").read_text().splitlines()}
    for m in metrics:
        t = m["iteration"]
        rows = [json.loads(line) for f in sorted((tmp_path / "eval" / "eval").glob(f"iter_{t:08d}.rank*.jsonl"))
                for line in f.read_text().splitlines()]
        assert len(rows) == 2 * 16 and {r["batch"] for r in rows} == {0, 1}
        for r in rows:
            prompt = r["prompt_text"].replace("<|bos|>", "")
            assert prompt in answers  # a held-out problem, not a training one
            assert _replay(tok, prompt, r["response"], answers[prompt]) == pytest.approx(r["score"]), r
        by_prompt = {}
        for r in rows:  # greedy: the rows of one prompt's group are one conversation
            by_prompt.setdefault((r["batch"], r["row"] // 4), set()).add(tuple(r["response"]))
        assert all(len(v) == 1 for v in by_prompt.values())
        assert m["eval"]["reward"] == pytest.approx(sum(r["score"] for r in rows) / len(rows))
        assert m["eval"]["n"] == 32 and m["eval"]["greedy"]
