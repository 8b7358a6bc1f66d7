"""Evaluation on a held-out prompt set every N iterations (torch-free: experiment files import ``EvalConfig``).

    eval: EvalConfig = EvalConfig(dataset="data/eval_prompts.jsonl", every=10)     # in the experiment
    realloc run EXP --set eval.every=10 --set eval.greedy=false                     # or per run

After iteration t (counted from 1) with t % every == 0, the actor as trained so far (the parameters in
its home layout, where its train step left them, i.e. exactly what checkpoint ``iter_t`` holds)
generates responses to ``batches`` batches of ``batch_size`` eval prompts, greedily or sampled like
training, and the experiment's reward call scores them (a multi-turn GENERATE call scores its own
conversations: the environment runs in the loop and gives the reward). metrics.jsonl then carries
``"eval": {"reward": mean score, "n": prompts}`` for that iteration, and each scoring worker writes
the scored sequences to ``RUN/eval/iter_<t>.rank<r>.jsonl``.

A graph without generation whose train step's interface has an INFERENCE namesake (the reward model's
``rm``) evaluates by running that interface in the train step's layout on ``batches`` batches of the eval
set, which holds records of the training data's kind (held-out preference pairs): metrics.jsonl then
carries ``"eval": {"rm_loss", "rm_accuracy", "rm_margin", "rm_chosen", "rm_rejected", "n": pairs}``.

The eval batches are read from the set in a fixed seeded order (the same prompts at every evaluation),
and their data lives under keys ``eval<j>/<key>`` so it never mixes with the training batch. The eval
passes are nodes of the master's graph anchored to the actor's train step and the reward call: every
node that waits for those calls also waits for the evaluation, so parameters do not move while it runs.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Sequence

from realloc.algorithms.registry import interfaces_of
from realloc.api import ExperimentSpec, InterfaceType, ModelFunctionCallDef
from realloc.runtime.records.run_paths import naming

EVAL_SEED = 0x5EED  # eval prompt order: fixed, independent of the run's seed


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    dataset: str | None = None  # eval prompts (same formats as `dataset`), relative to the experiment file
    every: int = 0  # evaluate after every N iterations; 0: never
    greedy: bool = True  # greedy decoding; False samples with PPOConfig's temperature, top_k, top_p
    batches: int = 1  # batch_size prompts each

    def __post_init__(self) -> None:
        for name in ("every", "batches"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < (0 if name == "every" else 1):
                raise ValueError(f"EvalConfig.{name} must be an integer >= {0 if name == 'every' else 1}, got {v!r}")
        if self.every and not self.dataset:
            raise ValueError("EvalConfig.every > 0 needs EvalConfig.dataset, the eval prompts "
                             "(e.g. --set eval.dataset=/path/eval.jsonl)")

    def due(self, t: int) -> bool:
        """Whether iteration ``t`` (0-based internally) ends with an evaluation."""
        return self.every > 0 and (t + 1) % self.every == 0


def eval_key(batch: int, key: str) -> str:
    return f"eval{batch}/{key}"


@dataclasses.dataclass(frozen=True)
class EvalCalls:
    """The calls an evaluation reuses: generation (its interface), the actor's train step (where the
    trained parameters are) and the reward call.

    Without generation (a reward model trained on preference pairs), ``scorer`` names the INFERENCE interface
    that scores the eval records in the train step's layout (the train interface's namesake, e.g. ``rm``);
    ``generate`` and ``reward`` are then the train call too, and the eval set has the training data's kind.

    A GENERATE call that scores its own rollouts (a multi-turn rollout, whose environment gives the reward:
    ``algorithms/critic_free/multiturn.py``) is its own ``reward``: the evaluation runs the whole conversation,
    the environment in the loop, and its scores are the generation's (``self_scored``)."""

    generate: str
    train: str
    reward: str
    reward_key: str  # the reward call's output key that holds the scores
    scorer: str = ""

    @property
    def self_scored(self) -> bool:
        return self.reward == self.generate and not self.scorer


def _scoring_eval(spec: ExperimentSpec) -> EvalCalls | None:
    """A train call that reads the dataset and whose interface has an INFERENCE namesake reading the same."""
    from realloc.algorithms.registry import interfaces_of

    table = interfaces_of(spec)
    for r in spec.rpcs:
        if not r.is_train or not r.interface_impl or not all(k in spec.dataset_keys for k in r.input_data):
            continue
        twin = table.get((r.interface_impl, InterfaceType.INFERENCE))
        train = table.get((r.interface_impl, InterfaceType.TRAIN_STEP))
        if twin is not None and train is not None and twin.inputs == train.inputs:
            return EvalCalls(r.name, r.name, r.name, "", scorer=twin.name)
    return None


def _reward_key(r: ModelFunctionCallDef, table: dict) -> str | None:
    """The key a call writes as its reward (an output slot of kind ``rewards``), or None. A GENERATE call has
    one when it scores its own rollouts (multi-turn: the environment's score)."""
    found = table.get((r.interface_impl or "", r.interface_type))
    if found is None:  # an unknown interface: the graph's check names it; go by the key's name
        return next((k for k in r.output_data if "reward" in k), None)
    return next((k for slot, k in zip(found.out_slots, r.output_data) if slot.kind == "rewards"), None)


def eval_calls(spec: ExperimentSpec) -> EvalCalls:
    gen = next((r for r in spec.rpcs if r.interface_type is InterfaceType.GENERATE
                and any(k in spec.dataset_keys for k in r.input_data)), None)
    if gen is None:
        scoring = _scoring_eval(spec)
        if scoring is not None:
            return scoring
        raise ValueError(f"experiment {spec.name!r}: evaluation needs a GENERATE call that reads the prompts (or a "
                         f"train step on dataset records whose interface scores them, as the reward model's `rm` "
                         f"does)")
    train = next((r for r in spec.rpcs if r.model_name == gen.model_name and r.is_train), None)
    seq = gen.output_data[0] if gen.output_data else None
    table = interfaces_of(spec)
    own = _reward_key(gen, table)
    if own is not None and train is not None:  # a multi-turn rollout: the environment scores it in generation
        return EvalCalls(gen.name, train.name, gen.name, own)
    reward = next((r for r in spec.rpcs if seq in r.input_data and r.interface_type is InterfaceType.INFERENCE
                   and _reward_key(r, table) is not None), None)
    if train is None or reward is None:
        raise ValueError(f"experiment {spec.name!r}: evaluation needs the generating model's train step and a "
                         f"reward call reading {seq!r}")
    key = _reward_key(reward, table)
    assert key is not None
    return EvalCalls(gen.name, train.name, reward.name, key)


def write_eval_samples(run_dir: Path, t: int, rank: int, batch: int, ids: Sequence[int], seq: dict[str, Any],
                       scores: Any, tokenizer: Any = None) -> Path:
    """One JSON line per scored eval sequence: prompt and response token ids (and text, with a tokenizer) and
    the score."""
    path = run_dir / "eval" / f"iter_{t + 1:08d}.rank{rank}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    tokens, plens, score = seq["tokens"].tolist(), seq["prompt_lens"].tolist(), scores.tolist()
    n_resp = seq["gen_mask"].sum(dim=1).tolist()
    lines = []
    for i, row in enumerate(ids):
        prompt, response = tokens[i][:plens[i]], tokens[i][plens[i]:plens[i] + n_resp[i]]
        rec = {"iteration": t + 1, "batch": batch, "row": row, "prompt": prompt, "response": response,
               "score": score[i]}
        if tokenizer is not None:
            rec.update(prompt_text=tokenizer.decode(prompt, skip_special_tokens=False),
                       response_text=tokenizer.decode(response, skip_special_tokens=False))
        lines.append(json.dumps(rec))
    with naming(path), open(path, "a") as f:
        f.write("".join(line + "\n" for line in lines))
    return path
