"""Run settings an experiment's config object may carry, read the same way by the master and workers.

The ``@auto`` dataclass may define (all optional):

- ``seed: int`` (default 1): model initialization, prompt order, sampling;
- ``dataset: str``: prompt file (realloc/data/prompts.py), relative to the experiment file (required when a call reads
  a dataset key such as ``prompts``; ``--set dataset=PATH`` gives it per run, best as an absolute path);
- ``iterations: int``: default for ``realloc run --iterations``;
- ``eval: EvalConfig``: an eval prompt set run every N iterations (``realloc.runtime.evaluation``);
- ``ppo: PPOConfig``: PPO hyperparameters (defaults from ``PPOConfig()``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from realloc.algorithms.ppo_config import PPOConfig
from realloc.api import ExperimentSpec
from realloc.runtime.evaluation import EvalConfig, eval_calls


@dataclasses.dataclass(frozen=True)
class RunConfig:
    seed: int
    ppo: PPOConfig
    dataset: str | None
    iterations: int | None
    eval: EvalConfig = EvalConfig()

    @classmethod
    def of(cls, spec: ExperimentSpec) -> "RunConfig":
        cfg = spec.config
        seed = getattr(cfg, "seed", 1)
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ValueError(f"experiment {spec.name!r}: seed must be an integer, got {seed!r}")
        ppo = getattr(cfg, "ppo", None) or PPOConfig()
        if not isinstance(ppo, PPOConfig):
            raise ValueError(f"experiment {spec.name!r}: field ppo must be a PPOConfig, got {type(ppo).__name__}")
        dataset = getattr(cfg, "dataset", None)
        if dataset is not None:
            dataset = _beside_experiment(spec, dataset)
        elif any(k in spec.dataset_keys for r in spec.rpcs for k in r.input_data):
            raise ValueError(f"experiment {spec.name!r} reads prompts (dataset keys {list(spec.dataset_keys)}) but "
                             f"names no prompt file: pass --set dataset=/path/to/prompts.jsonl or set `dataset` in "
                             f"the experiment (.jsonl/.json/.parquet text, chat or token-id prompts; see "
                             f"realloc/data/prompts.py)")
        iterations = getattr(cfg, "iterations", None)
        if iterations is not None and (not isinstance(iterations, int) or iterations < 1):
            raise ValueError(f"experiment {spec.name!r}: iterations must be a positive integer, got {iterations!r}")
        ev = getattr(cfg, "eval", None) or EvalConfig()
        if not isinstance(ev, EvalConfig):
            raise ValueError(f"experiment {spec.name!r}: field eval must be a realloc.runtime.evaluation.EvalConfig, "
                             f"got {type(ev).__name__}")
        if ev.dataset:
            ev = dataclasses.replace(ev, dataset=_beside_experiment(spec, ev.dataset))
        if ev.every:
            eval_calls(spec)  # the experiment has what an evaluation needs
        return cls(seed=seed, ppo=ppo, dataset=dataset, iterations=iterations, eval=ev)


def _beside_experiment(spec: ExperimentSpec, path: str) -> str:
    """A relative path in an experiment file is relative to that file."""
    p = Path(path)
    src = spec.source.rsplit(":", 1)[0]
    if not p.is_absolute() and src.endswith(".py"):
        p = Path(src).parent / p
    return str(p)
