"""Run settings an experiment's config object may carry, read the same way by the master and workers.

The ``@auto`` dataclass may define (all optional):

- ``seed: int`` (default 1): model initialization, prompt order, sampling;
- ``dataset: str``: prompt file (realloc/data/prompts.py), relative to the experiment file (required when a call reads
  a dataset key such as ``prompts``; ``--set dataset=PATH`` gives it per run, best as an absolute path);
- ``tokenizer: str``: an HF tokenizer directory for text prompts, EOS and decoded samples (default: the
  generating model's checkpoint directory when it holds tokenizer files; without generation, the trained
  model's, then any model's);
- ``data: DataConfig``: prompt columns, truncation, chat template (``realloc.data.config``);
- ``models: dict``: model name -> HF checkpoint directory or ``HFModel`` (read by ``api.py``);
- ``iterations: int``: default for ``realloc run --iterations``;
- ``sample_every: int`` (default 10): every N iterations, write a few decoded samples (prompt, response,
  reward) to ``samples.jsonl`` in the run directory; 0 turns it off; ``log_samples`` of them (default 4).
  (Not ``n_samples``: that is a GENERATE call's responses per prompt, and on the experiment an error.);
- ``eval: EvalConfig``: an eval prompt set run every N iterations (``realloc.runtime.inputs.evaluation``);
- ``balance_tokens: bool`` (default False): deal the batch to the dp ranks of every call after generation by
  tokens, not by rows (``realloc.graph.row_balance``; docs/long-tail.md); results change only by float
  summation order;
- the settings of the interfaces its calls run, e.g. ``ppo: PPOConfig`` or ``grpo: GRPOConfig``
  (``registry.Interface.config``; the type's defaults when absent).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from realloc.api import ExperimentSpec, InterfaceType
from realloc.data.config import DataConfig
from realloc.runtime.inputs.evaluation import EvalConfig, eval_calls

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    seed: int
    dataset: str | None
    iterations: int | None
    tokenizer: str | None = None
    data: DataConfig = DataConfig()
    sample_every: int = 10
    log_samples: int = 4  # sequences of a logged iteration that go to samples.jsonl
    eval: EvalConfig = EvalConfig()
    balance_tokens: bool = False

    @classmethod
    def of(cls, spec: ExperimentSpec, require_dataset: bool = True) -> "RunConfig":
        cfg = spec.config
        seed = getattr(cfg, "seed", 1)
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ValueError(f"experiment {spec.name!r}: seed must be an integer, got {seed!r}")
        data = getattr(cfg, "data", None) or DataConfig()
        if not isinstance(data, DataConfig):
            raise ValueError(f"experiment {spec.name!r}: field data must be a realloc.data.config.DataConfig, got "
                             f"{type(data).__name__}")
        dataset = getattr(cfg, "dataset", None)
        if dataset is not None:
            dataset = str(spec.resolve_path(dataset))
        elif require_dataset and any(k in spec.dataset_keys for r in spec.rpcs for k in r.input_data):
            raise ValueError(f"experiment {spec.name!r} reads prompts (dataset keys {list(spec.dataset_keys)}) but "
                             f"names no prompt file: pass --set dataset=/path/to/prompts.jsonl or set `dataset` in "
                             f"the experiment (.jsonl/.json/.parquet text, chat or token-id prompts; see "
                             f"realloc/data/prompts.py)")
        iterations = getattr(cfg, "iterations", None)
        if iterations is not None and (not isinstance(iterations, int) or iterations < 1):
            raise ValueError(f"experiment {spec.name!r}: iterations must be a positive integer, got {iterations!r}")
        ev = getattr(cfg, "eval", None) or EvalConfig()
        if not isinstance(ev, EvalConfig):
            raise ValueError(f"experiment {spec.name!r}: field eval must be a realloc.runtime.inputs.evaluation.EvalConfig, "
                             f"got {type(ev).__name__}")
        if ev.dataset:
            ev = dataclasses.replace(ev, dataset=str(spec.resolve_path(ev.dataset)))
        if ev.every:
            eval_calls(spec)  # the experiment has what an evaluation needs
        if hasattr(cfg, "n_samples"):  # the old name of log_samples, easily mistaken for group sampling
            raise ValueError(f"experiment {spec.name!r}: field n_samples is ambiguous and no longer read: write "
                             f"log_samples for how many sequences go to samples.jsonl; responses per prompt (group "
                             f"sampling) are the GENERATE call's n_samples, e.g. critic_free_rpcs(..., n_samples=8)")
        for field in ("sample_every", "log_samples"):
            v = getattr(cfg, field, getattr(cls, field))
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"experiment {spec.name!r}: {field} must be a non-negative integer, got {v!r}")
        balance = getattr(cfg, "balance_tokens", False)
        if not isinstance(balance, bool):
            raise ValueError(f"experiment {spec.name!r}: balance_tokens must be True or False, got {balance!r}")
        return cls(seed=seed, dataset=dataset, iterations=iterations, tokenizer=_tokenizer_dir(spec),
                   data=data, sample_every=getattr(cfg, "sample_every", cls.sample_every),
                   log_samples=getattr(cfg, "log_samples", cls.log_samples), eval=ev, balance_tokens=balance)


def _tokenizer_dir(spec: ExperimentSpec) -> str | None:
    """The experiment's ``tokenizer``, else the tokenizer files of a model's checkpoint (the generating model's first)."""
    given = getattr(spec.config, "tokenizer", None)
    if given is not None:
        if not isinstance(given, (str, Path)) or not str(given):
            raise ValueError(f"experiment {spec.name!r}: tokenizer must be a tokenizer directory, got {given!r}")
        path = spec.resolve_path(given)
        if not path.is_dir():
            raise ValueError(f"experiment {spec.name!r}: tokenizer directory {path} does not exist")
        return str(path.resolve())
    # The generating model's checkpoint first; an experiment without generation (SFT, DPO) uses its trained
    # model's checkpoint, then any other.
    order = sorted(spec.rpcs, key=lambda r: (r.interface_type is not InterfaceType.GENERATE, not r.is_train))
    for r in order:
        src = spec.models.get(r.model_name)
        if src is not None and any((Path(src.path) / f).is_file() for f in TOKENIZER_FILES):
            return src.path
    return None


def balance_note(config: RunConfig, graph: Any) -> str | None:
    """The warning of a ``balance_tokens`` that cannot take effect: the master deals row lists by the tokens of the
    graph's one generation call (``master_schedule._balanced_generation``); with none, or with several (ReMax's
    sampled and greedy responses differ in length), every call keeps the even split."""
    if not config.balance_tokens:
        return None
    gens = [c for c in graph.topo_order if graph.call(c).interface_type is InterfaceType.GENERATE]
    if len(gens) == 1:
        return None
    has = "no generation call" if not gens else f"{len(gens)} generation calls ({', '.join(gens)})"
    return (f"warning: balance_tokens has no effect here: it deals the dp ranks by the tokens of a graph's one "
            f"generation call, and this graph has {has}; every call keeps the even split by rows")
