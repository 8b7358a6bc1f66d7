"""What `realloc show` and `realloc run` check before any worker starts, beyond the graph.

``build_graph`` reads only config.json (``realloc search`` plans a checkpoint from its shape alone, e.g. on
a laptop without the weights). Before anything runs, :func:`preflight` also reads the safetensors headers
of every checkpoint (names, shapes, dtypes; no tensor data), the tokenizer, the EOS ids generation stops
at, and the prompt dataset as the workers will, so that a bad input is one error here rather than one in
every worker::

    pre = preflight(spec, config, graph)
    for line in pre.lines:
        print(line)
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

from realloc.api import ExperimentSpec, InterfaceType
from realloc.envs.prompt_check import prompt_tool_lines, truncated_tools_line
from realloc.runtime.inputs.run_config import balance_note
from realloc.runtime.records.text_io import SpecialTokens, generating_checkpoints

if TYPE_CHECKING:
    from realloc.data.records import LoadStats
    from realloc.data.tokenizer import Tokenizer
    from realloc.graph.dataflow import DataflowGraph


@dataclasses.dataclass(frozen=True)
class Preflight:
    lines: tuple[str, ...]  # to print: the dataset summary and warnings
    data: "LoadStats | None"  # what loading the dataset kept and cut (None: the experiment reads none)


def check_checkpoint_weights(graph: "DataflowGraph") -> None:
    """Every checkpoint holds the tensors its model loads, with the shapes config.json implies."""
    from realloc.models.hf_check import check_hf_weights

    for model, src in graph.spec.models.items():
        cfg = graph.model_configs[model]
        assert cfg is not None  # a checkpoint model always has a config
        check_hf_weights(cfg, src.path, new_value_head=src.new_value_head, where=f"model {model!r}: ")


def model_vocab_sizes(graph: "DataflowGraph") -> dict[str, int]:
    """Each checkpoint or registry model's vocabulary (the real one, as its token ids run)."""
    return {m: cfg.vocab_size for m, cfg in graph.model_configs.items() if cfg is not None}


def vocab_warnings(vocab_sizes: dict[str, int], tokenizer: "Tokenizer | None") -> list[str]:
    """A warning when the models' vocabularies differ (an actor and a critic or reward model from different
    families, say): they all read the same token ids, which mean different tokens to models of different
    tokenizers; only ids below the smallest vocabulary are generated, so nothing fails, it just learns nothing."""
    if len(set(vocab_sizes.values())) < 2:
        return []
    sizes = ", ".join(f"{m} {v}" for m, v in sorted(vocab_sizes.items(), key=lambda kv: (kv[1], kv[0])))
    limit = vocab_limit(tokenizer, min(vocab_sizes.values()))
    return [f"warning: the models' vocabularies differ ({sizes} tokens); they all read the same token ids, so they "
            f"must share one tokenizer (a padded vocabulary of the same tokenizer is fine); generation emits ids below "
            f"{limit}"]


def vocab_limit(tokenizer: "Tokenizer | None", model_vocab: int | None) -> int | None:
    """How many token ids generation may emit: the tokenizer's length (added tokens included), else the
    smallest vocabulary of the models (they all read the generated ids). A checkpoint's vocabulary is often
    padded past its tokenizer's (Qwen2.5-7B: 152064 rows, 151665 tokens); sampling a padding row would give
    an id other models embed differently (or not at all)."""
    sizes = [v for v in (tokenizer.vocab_size if tokenizer else None, model_vocab) if v is not None]
    return min(sizes) if sizes else None


def special_tokens(spec: ExperimentSpec, graph: "DataflowGraph",
                   tokenizer: "Tokenizer | None") -> tuple[SpecialTokens, list[str]]:
    """The ids generation uses, checked against the models; and a warning when nothing can stop it early."""
    tokens = SpecialTokens.of(spec, tokenizer)
    generates = any(r.interface_type is InterfaceType.GENERATE for r in spec.rpcs)
    vocabs = model_vocab_sizes(graph)
    if generates and vocabs:
        small = min(vocabs, key=lambda m: vocabs[m])
        for t in tokens.eos_token_ids:
            if not 0 <= t < vocabs[small]:  # the tokenizer checks its own ids: this one is a checkpoint's
                raise ValueError(f"checkpoint {', '.join(generating_checkpoints(spec))}: EOS token id {t} "
                                 f"(eos_token_id of generation_config.json or config.json) is outside the "
                                 f"vocabulary of {vocabs[small]} of model {small!r}; fix eos_token_id there")
    warnings = []
    hf_path = tokenizer is not None or generating_checkpoints(spec)
    if generates and hf_path and not tokens.eos_token_ids:
        where = [f"tokenizer {tokenizer.path}"] if tokenizer else []
        where += [f"checkpoint {p}" for p in generating_checkpoints(spec)]
        warnings.append(f"warning: no EOS token id in {' or '.join(where)} (eos_token_id of tokenizer_config.json, "
                        f"generation_config.json or config.json): every response runs to gen_len={spec.gen_len}")
    return tokens, warnings


def preflight(spec: ExperimentSpec, config: Any, graph: "DataflowGraph", cache_dir: Path | None = None,
              probe_rewards: bool = False) -> Preflight:
    """Checkpoint weights, tokenizer, EOS ids and dataset, loaded as the workers will (``config``: a
    ``RunConfig``). ``cache_dir``: tokenize the prompts once there for the workers. ``probe_rewards``: also call
    each reward function or service the user brings on the first prompt (``reward_probe.py``; `realloc show`)."""
    from realloc.data.tokenizer import Tokenizer
    from realloc.models.collective_wait import spin_seconds
    from realloc.runtime.inputs.datasets import dataset_table

    spin_seconds()  # a bad REALLOC_COLLECTIVE_SPIN_MS is one line here, not every worker's error mid-iteration
    check_checkpoint_weights(graph)
    tokenizer = Tokenizer.load(config.tokenizer) if config.tokenizer else None
    vocab_sizes = model_vocab_sizes(graph)
    if tokenizer is not None:
        for m, v in vocab_sizes.items():
            tokenizer.check_model_vocab(v, f"model {m!r}")  # every model reads the tokenizer's ids
    _, lines = special_tokens(spec, graph, tokenizer)
    lines += vocab_warnings(vocab_sizes, tokenizer)
    lines += [n for n in [balance_note(config, graph)] if n]
    lines += prompt_tool_lines(spec.rpcs, config.data.tools, config.data.use_chat_template)  # DataConfig.tools
    plain = config.data.add_special_tokens and not config.data.use_chat_template
    bos = tokenizer.bos_missing() if tokenizer is not None and plain else None
    if bos is not None:
        lines.append(f"warning: tokenizer {tokenizer.path} defines a BOS token ({bos!r}, id {tokenizer.bos_token_id}) "
                     f"but does not add it when encoding text (its post-processor adds none): plain-text prompts and "
                     f"responses start without it, as with transformers' tokenizer(text); if your model expects it, "
                     f"put it at the start of the text or use a chat template (DataConfig(use_chat_template=True))")
    if config.dataset is None:
        return Preflight(tuple(lines), None)
    # Token ids must fit every model: they all read the same sequences.
    # The table only: the master reads, tokenizes and caches it without torch (docs/speed.md).
    data = dataset_table(graph.dataset_kind, config.dataset, spec, config, tokenizer,
                         min(vocab_sizes.values()) if vocab_sizes else None, cache_dir)
    check_env_fields(graph, data)
    _check_eval_set(spec, config, graph, tokenizer, min(vocab_sizes.values()) if vocab_sizes else None)
    if probe_rewards and graph.dataset_kind == "prompts":
        from realloc.data.prompts import PromptDataset
        from realloc.runtime.inputs.reward_probe import probe_rewards as probe

        lines += probe(spec, PromptDataset(data, spec.prompt_len), tokenizer)
    cut = truncated_tools_line(config.data.tools, data.stats.n_truncated, config.data.truncation_side, spec.prompt_len)
    lines += [cut] if cut else []
    where = f"tokenizer {config.tokenizer}" if tokenizer is not None else "token ids"
    return Preflight((f"{data.stats.describe()} ({where})", *lines), data.stats)


def _check_eval_set(spec: ExperimentSpec, config: Any, graph: "DataflowGraph", tokenizer: Any,
                    vocab_size: int | None) -> None:
    """The eval set loads as the workers will load it (prompts, or the training data's kind when the evaluation
    scores records without generating, e.g. held-out preference pairs), so a wrong file fails here, not mid-run."""
    from realloc.runtime.inputs.datasets import dataset_table
    from realloc.runtime.inputs.evaluation import eval_calls

    ev = getattr(config, "eval", None)
    if ev is None or not ev.every:
        return
    kind = graph.dataset_kind if eval_calls(spec).scorer else "prompts"
    check_env_fields(graph, dataset_table(kind, ev.dataset, spec, config, tokenizer, vocab_size, None))


def check_env_fields(graph: "DataflowGraph", table: Any) -> None:
    """Every record has the field each built-in tool environment scores against (``env_args["field"]``): a
    record without it stopped the run when its prompt came up, at any iteration or only at an evaluation."""
    from realloc.envs.rollout_args import is_multiturn, rollout_args

    for c in graph.topo_order:
        if not is_multiturn(graph.interfaces.get(c)):
            continue
        args = rollout_args(c, graph.call(c).interface_args)
        if args.env != "tools":
            continue
        field = args.env_args.get("field", "answer")
        column = table.fields.get(field, [])
        missing = len(table.columns["prompt"]) - sum(v is not None for v in column)
        if missing:
            raise ValueError(f"dataset {table.path}: {missing} of {len(table.columns['prompt'])} records have no "
                             f"field {field!r}, which call {c!r}'s tools environment scores the answer against "
                             f"(env_args['field']); fields: {', '.join(map(repr, table.fields)) or 'none'}")
