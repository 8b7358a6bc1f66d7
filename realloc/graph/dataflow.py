"""The dataflow graph of one RLHF iteration and its unrolling over iterations.

Edges (realhf.txt section 4, Figure 4):
- data: the producer of a key precedes every call that reads it;
- parameter version: a model's train step waits for every call that reads the
  version it is about to replace, and in the next iteration those calls wait
  for that train step ("carry" edges, which cross an iteration boundary).

Bounded staleness eta (asynchronous RL, issue 25; AReaL, Fu et al. 2025): the generation calls of a
trained model (``stale_calls``) may use parameters up to eta train steps old. In the unrolled graph a
stale call of iteration t waits for the train step of iteration t - 1 - eta instead of t - 1, and the
train step of iteration t - eta waits for it (it must not replace the version the call reads). eta = 0
is the synchronous graph.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
from functools import cached_property
from pathlib import Path
from types import MappingProxyType
from typing import Mapping

import networkx as nx

from realloc.algorithms.lora_graph import adapters_off, apply_lora, lora_digest, lora_setting
from realloc.algorithms.registry import Interface, Table, interfaces_of, resolve_minibatches
from realloc.api import ExperimentSpec, HFModel, ModelFunctionCallDef
from realloc.graph.contracts import check_contracts
from realloc.graph.partial_check import partial_rollout_error
from realloc.models.config import RULE_MODEL_TYPE, ModelConfig, get_model_config, is_known_model_type, known_model_types

DATA, PARAM = "data", "param"


@dataclasses.dataclass(frozen=True)
class DataflowGraph:
    spec: ExperimentSpec
    graph: nx.DiGraph  # nodes: call names; edge attrs: kind (data|param), keys
    model_types: Mapping[str, str]  # model_name -> model_type ("hf:<dir>" for a checkpoint)
    carry_edges: tuple[tuple[str, str], ...]  # (src at t, dst at t+1)
    model_configs: Mapping[str, ModelConfig | None] = dataclasses.field(default_factory=dict)  # None: a rule
    interfaces: Mapping[str, Interface] = dataclasses.field(default_factory=dict)  # call -> what it runs

    @property
    def calls(self) -> tuple[ModelFunctionCallDef, ...]:
        return self.spec.rpcs

    def call(self, name: str) -> ModelFunctionCallDef:
        return self.spec.call(name)

    def model_type(self, call: str | ModelFunctionCallDef) -> str:
        rpc = self.call(call) if isinstance(call, str) else call
        return self.model_types[rpc.model_name]

    def model_config(self, call: str | ModelFunctionCallDef) -> ModelConfig | None:
        """The call's model shape, or None for a parameter-free rule function."""
        rpc = self.call(call) if isinstance(call, str) else call
        return self.model_configs[rpc.model_name]

    def steps_n_seqs(self, call: str | ModelFunctionCallDef) -> int:
        """Sequences processed per forward/optimizer step: a PPO mini-batch for training."""
        rpc = self.call(call) if isinstance(call, str) else call
        return self.spec.n_seqs(rpc) // rpc.n_minibatches

    @cached_property
    def topo_order(self) -> tuple[str, ...]:
        # Ties broken by declaration order so the order is stable run to run.
        index = {n: i for i, n in enumerate(self.spec.call_names)}
        return tuple(nx.lexicographical_topological_sort(self.graph, key=lambda n: index[n]))

    @cached_property
    def headline_calls(self) -> frozenset[str]:
        """Calls whose reward and generation stats are the run's headline: the producers of what the train steps
        read as ``rewards`` and ``seq`` (ReMax's greedy baseline is not the policy's reward). All calls when
        nothing trains."""
        producers = {k: r.name for r in self.calls for k in r.output_data}
        out = {producers[key] for r in self.calls if r.is_train
               for slot, key in zip(self.interfaces[r.name].in_slots, r.input_data)
               if slot.role in ("rewards", "seq") and key in producers}
        return frozenset(out) if out else frozenset(self.spec.call_names)

    @cached_property
    def unread_keys(self) -> tuple[tuple[str, str], ...]:
        """(key, producing call) of every key a call writes and no call reads."""
        read = {k for r in self.calls for k in r.input_data}
        return tuple((k, r.name) for r in self.calls for k in r.output_data if k not in read)

    def warnings(self) -> tuple[str, ...]:
        """What ``realloc show`` warns about: a key written and never read that looks like a key some call reads
        (a misspelling: ``reward`` written, ``rewards`` read), or a call none of whose keys is read (its work is
        dropped). Other unread keys are outputs an interface must declare (ReMax's greedy log-probs)."""
        read = sorted({k for r in self.calls for k in r.input_data})
        unread = dict.fromkeys(self.unread_keys)
        out = []
        for key, call in unread:
            close = difflib.get_close_matches(key, read, n=1, cutoff=0.8)
            if close:
                out.append(f"warning: call {call!r} writes key {key!r}, which no call reads; did you mean "
                           f"{close[0]!r}, which {', '.join(repr(r.name) for r in self.calls if close[0] in r.input_data)} "
                           f"read(s)?")
            elif all((k, call) in unread for k in self.call(call).output_data):
                out.append(f"warning: call {call!r} writes key {key!r}, which no call reads, so its work is dropped; "
                           f"read it in some call's input_data, or remove the call")
        return tuple(out)

    def dp_error(self, dp: int) -> str | None:
        """Why ``dp`` ranks cannot share this graph's sequences: with groups of responses (``n_samples``) each
        rank must hold whole groups, so dp must divide the number of prompts. None if it can."""
        g, b = self.spec.group_size, self.spec.batch_size
        if g > 1 and b % dp:
            return (f"dp={dp} must divide the batch of {b} prompts: each dp rank holds whole groups of the {g} "
                    f"responses to a prompt")
        return None

    @cached_property
    def dataset_kind(self) -> str:
        """What the calls read from the dataset (``prompts``, ``seq``, ``pairs``): the kind of their slots."""
        kinds = {slot.kind for r in self.calls for slot, key in zip(self.interfaces[r.name].in_slots, r.input_data)
                 if key in self.spec.dataset_keys}
        assert len(kinds) <= 1, kinds  # check_contracts makes every reader of a dataset key agree
        return kinds.pop() if kinds else "prompts"

    def calls_of_model(self, model_name: str) -> tuple[str, ...]:
        return tuple(r.name for r in self.calls if r.model_name == model_name)

    @cached_property
    def digest(self) -> str:
        """Hash of everything a plan depends on except the cluster, and of what each call runs: the interface
        (as resolved, so a call without ``interface_impl`` and one naming its default agree), so that a plan or a
        checkpoint of a GRPO graph is refused by the RLOO graph of the same shape."""
        body: dict = {
            "batch_size": self.spec.batch_size, "prompt_len": self.spec.prompt_len, "gen_len": self.spec.gen_len,
            "calls": [[r.name, r.model_name, self.model_types[r.model_name], r.interface_type.value,
                       self.interfaces[r.name].name, list(r.input_data), list(r.output_data), self.spec.n_seqs(r),
                       r.n_minibatches] + ([r.n_samples] if r.n_samples > 1 else []) for r in self.calls],
        }
        # A checkpoint is named by its shape, not its path, so a plan made on a laptop runs on the cluster.
        shapes = {m: _shape_key(self.model_configs[m]) for m in self.spec.models}
        if shapes:
            body["checkpoint_shapes"] = shapes
        lora = lora_digest(self.model_configs)  # adapters change the parameters a checkpoint holds
        if lora:
            body["lora"] = lora
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]

    @cached_property
    def stale_calls(self) -> frozenset[str]:
        """The calls that may read an old parameter version under bounded staleness: the GENERATE calls of
        trained models (the responses the train steps learn from)."""
        trained = {r.model_name for r in self.calls if r.is_train}
        return frozenset(r.name for r in self.calls if r.interface_type.value == "generate" and r.model_name in trained)

    def first_train(self, model: str) -> str:
        """The model's first TRAIN_STEP call in an iteration: what replaces the version its readers read."""
        return next(c for c in self.topo_order if self.call(c).model_name == model and self.call(c).is_train)

    def staleness_error(self, staleness: int) -> str | None:
        """Why this graph cannot run with generation ``staleness`` train steps ahead; None if it can.

        A stale call must come before every other call of its model in an iteration: the others read the
        current version, and the stale call's snapshot of the parameters is taken before they change it.
        Partial rollouts need max_staleness above it (``partial_check.py``)."""
        partial = partial_rollout_error(self, staleness)
        if partial or staleness == 0:
            return partial
        if not self.stale_calls:
            return (f"staleness {staleness} needs a GENERATE call of a trained model (generation running ahead "
                    f"of training), and experiment {self.spec.name!r} has none; use staleness 0")
        order = {c: i for i, c in enumerate(self.topo_order)}
        for c in sorted(self.stale_calls, key=order.__getitem__):
            model = self.call(c).model_name
            fresh = [x for x in self.calls_of_model(model) if x not in self.stale_calls]
            early = [x for x in fresh if order[x] < order[c]]
            if early:
                return (f"staleness {staleness}: call {early[0]!r} reads model {model!r} before its generation "
                        f"call {c!r} in an iteration; generation must come first among a model's calls to run "
                        f"ahead (make {early[0]!r} read {c!r}'s output, or use staleness 0)")
        return None

    def unroll(self, n_iterations: int, staleness: int = 0) -> nx.DiGraph:
        """The concatenated graph of ``n_iterations`` iterations; nodes are (call, iteration). With
        ``staleness`` eta > 0 a stale call of iteration t waits for the train step of t - 1 - eta, and that
        model's first train step of iteration t - eta waits for it (the module docstring)."""
        if n_iterations < 1:
            raise ValueError(f"n_iterations must be at least 1, got {n_iterations}")
        why = self.staleness_error(staleness)
        if why:
            raise ValueError(why)
        g = nx.DiGraph()
        for t in range(n_iterations):
            for n, attrs in self.graph.nodes(data=True):
                g.add_node((n, t), **attrs)
            for u, v, attrs in self.graph.edges(data=True):
                if not (staleness and u in self.stale_calls and attrs["kind"] == PARAM):
                    g.add_edge((u, t), (v, t), **attrs)
            if staleness and t - staleness >= 0:  # the write-after-read edge moves back eta iterations
                for u in self.stale_calls:
                    g.add_edge((u, t), (self.first_train(self.call(u).model_name), t - staleness), kind=PARAM,
                               keys=())
            for u, v in self.carry_edges:
                lag = 1 + staleness if v in self.stale_calls else 1
                if t - lag >= 0:
                    g.add_edge((u, t - lag), (v, t), kind=PARAM, keys=())
        return g

    def describe(self) -> str:
        lines = []
        for name in self.topo_order:
            r = self.call(name)
            parents = sorted(self.graph.predecessors(name))
            impl = self.interfaces[name].name if name in self.interfaces else r.interface_impl
            group = f" x{r.n_samples}" if r.n_samples > 1 else ""
            cfg = self.model_configs.get(r.model_name)
            lora = "" if cfg is None or cfg.lora is None else (
                " base (LoRA adapters off)" if adapters_off(r) else f" + LoRA r={cfg.lora.rank}")
            lines.append(f"{name:<16} {r.interface_type.name:<10} {impl}{group} on {r.model_name}"
                         f"({self.model_types[r.model_name]}){lora} in={list(r.input_data)} out={list(r.output_data)} "
                         f"after={parents}")
        if self.carry_edges:
            lines.append("next iteration: " + ", ".join(f"{u} -> {v}" for u, v in self.carry_edges))
        return "\n".join(lines)


def _shape_key(cfg: ModelConfig | None) -> dict:
    # explicit_head_dim, qk_norm and sliding_window only when set, so that the digests of models without them stay
    # what they were
    return {} if cfg is None else {k: v for k, v in dataclasses.asdict(cfg).items()
                                   if k not in ("name", "special_tokens", "lora")
                                   and not (k == "explicit_head_dim" and v is None)
                                   and not (k in ("qk_norm", "sliding_window", "full_attention_layers", "rotary_dim",
                                                  "norm_plus_one", "embed_scale", "sandwich_norms",
                                                  "query_pre_attn_scalar", "local_rope_theta",
                                                  "attn_logit_softcapping", "final_logit_softcapping") and not v)
                                   and not (k == "hidden_act" and v == "silu")}


def _resolve_model_types(spec: ExperimentSpec, table: Table) -> tuple[dict[str, str], dict[str, ModelConfig | None]]:
    """model_name -> (type name, config) from the calls' model_type or the experiment's checkpoints."""
    rpcs = spec.rpcs
    declared: dict[str, tuple[str, str]] = {}  # model_name -> (type, declaring call)
    for r in rpcs:
        if r.model_type is None:
            continue
        if r.model_name in spec.models:
            raise ValueError(f"model {r.model_name!r} comes from checkpoint {spec.models[r.model_name].path} (the "
                             f"experiment's `models`) but call {r.name!r} also sets model_type={r.model_type!r}; "
                             f"drop one of them")
        if not is_known_model_type(r.model_type):
            raise ValueError(f"call {r.name!r}: unknown model_type {r.model_type!r}; known types: "
                             f"{', '.join(known_model_types())}, or a HuggingFace checkpoint in the experiment's "
                             f"`models` mapping")
        prev = declared.get(r.model_name)
        if prev and prev[0] != r.model_type:
            raise ValueError(f"model {r.model_name!r} is declared as {prev[0]!r} in call {prev[1]!r} and as "
                             f"{r.model_type!r} in call {r.name!r}; one model_name must have one model_type")
        declared.setdefault(r.model_name, (r.model_type, r.name))
    for r in rpcs:
        if r.model_name not in declared and r.model_name not in spec.models:
            raise ValueError(f"call {r.name!r}: model {r.model_name!r} has no model_type; set model_type on one of "
                             f"its calls, or map {r.model_name!r} to a checkpoint in the experiment's `models`")
    types = {m: t for m, (t, _) in declared.items()}
    configs: dict[str, ModelConfig | None] = {m: None if t == RULE_MODEL_TYPE else get_model_config(t)
                                              for m, t in types.items()}
    for m, src in spec.models.items():
        types[m] = f"hf:{Path(src.path).name}" + ("+value-head" if src.new_value_head else "")
        configs[m] = _checkpoint_config(spec, m, src, table)
    order = list(dict.fromkeys(r.model_name for r in rpcs))
    return {m: types[m] for m in order}, {m: configs[m] for m in order}


def _checkpoint_config(spec: ExperimentSpec, model: str, src: HFModel, table: Table) -> ModelConfig:
    """The shape of a checkpoint model, checked against what its calls need (a vocabulary or a scalar head)."""
    from realloc.models.hf_config import model_config_from_hf, read_hf_config

    if not Path(src.path).is_dir():
        hint = f"; {src.build_hint}" if src.build_hint else ""
        raise ValueError(f"model {model!r}: checkpoint directory {src.path} does not exist{hint}")
    hf = read_hf_config(src.path)
    seq_cls = any("SequenceClassification" in a for a in hf.get("architectures") or [])
    if src.new_value_head and seq_cls:
        raise ValueError(f"model {model!r}: {src.path} is already a sequence-classification model with a scalar "
                         f"head; drop new_value_head=True to use that head")
    cfg = model_config_from_hf(src.path, name=model, critic=seq_cls or src.new_value_head)
    heads = {r.name: table[(r.interface_impl, r.interface_type)].head for r in spec.rpcs
             if r.model_name == model and (r.interface_impl, r.interface_type) in table}
    value_calls = [c for c, h in heads.items() if h == "value"]
    lm_calls = [c for c, h in heads.items() if h == "lm"]
    kind = ", ".join(hf.get("architectures") or ["a causal LM"])
    if value_calls and not cfg.is_critic:
        raise ValueError(f"model {model!r}: call {value_calls[0]!r} needs a scalar value head, but {src.path} is "
                         f"{kind}; use HFModel({src.path!r}, new_value_head=True) to start it from this "
                         f"checkpoint with a fresh head, or a *ForSequenceClassification checkpoint")
    if lm_calls and cfg.is_critic:
        raise ValueError(f"model {model!r}: call {lm_calls[0]!r} needs a vocabulary (language-model) head, but "
                         f"{src.path} has a scalar head ({'new_value_head=True' if src.new_value_head else kind})")
    return dataclasses.replace(cfg, name=f"{model}:{Path(src.path).name}")


def _check_positions(spec: ExperimentSpec, configs: Mapping[str, ModelConfig | None]) -> None:
    """Every model sees sequences of up to prompt_len + gen_len tokens (the generating model writes them, the
    others read them): each must have that many positions, or a run fails when it first draws a long prompt."""
    n = spec.prompt_len + spec.gen_len
    for model, cfg in configs.items():
        if cfg is not None and n > cfg.max_position_embeddings:
            src = (f"checkpoint {spec.models[model].path}" if model in spec.models
                   else f"model_type {cfg.name!r}")
            raise ValueError(f"model {model!r}: prompt_len + gen_len = {spec.prompt_len} + {spec.gen_len} = {n} "
                             f"exceeds max_position_embeddings={cfg.max_position_embeddings} of its {src}; lower "
                             f"prompt_len or gen_len to at most {cfg.max_position_embeddings} tokens together")


def build_graph(spec: ExperimentSpec) -> DataflowGraph:
    """Validate ``spec`` and build its one-iteration dataflow graph."""
    if any(r.n_minibatches is None for r in spec.rpcs):  # a spec built by hand, not by experiment_spec
        spec = dataclasses.replace(spec, rpcs=resolve_minibatches(spec))
    rpcs = spec.rpcs
    table = interfaces_of(spec)
    model_types, model_configs = _resolve_model_types(spec, table)
    apply_lora(spec.name, rpcs, model_configs, lora_setting(spec.config, spec.name))
    for r in rpcs:
        n = spec.n_seqs(r)
        if n % r.n_minibatches:
            raise ValueError(f"call {r.name!r}: its batch of {n} sequences cannot be split into "
                             f"n_minibatches={r.n_minibatches} equal mini-batches; use a divisor of {n}")

    producers: dict[str, str] = {}
    for r in rpcs:
        for key in r.output_data:
            if key in producers:
                raise ValueError(f"key {key!r} is produced by both call {producers[key]!r} and call {r.name!r}; "
                                 f"rename one of the outputs")
            if key in spec.dataset_keys:
                raise ValueError(f"call {r.name!r} produces key {key!r}, which the dataset already supplies; "
                                 f"rename the output")
            producers[key] = r.name

    g = nx.DiGraph()
    for r in rpcs:
        g.add_node(r.name, model_name=r.model_name, interface=r.interface_type.value)
    for r in rpcs:
        for key in r.input_data:
            src = producers.get(key)
            if src is None:
                if key in spec.dataset_keys:
                    continue
                close = difflib.get_close_matches(key, list(producers) + list(spec.dataset_keys), n=1)
                hint = f"did you mean {close[0]!r}? " if close else ""
                raise ValueError(f"call {r.name!r} reads key {key!r}, which no call produces and the dataset does not "
                                 f"supply (dataset keys: {', '.join(spec.dataset_keys)}; produced: "
                                 f"{', '.join(producers) or 'none'}); {hint}produce it in some call's output_data or "
                                 f"fix the name")
            if src == r.name:
                raise ValueError(f"call {r.name!r} reads key {key!r} that it produces itself")
            if g.has_edge(src, r.name):
                g.edges[src, r.name]["keys"] += (key,)
            else:
                g.add_edge(src, r.name, kind=DATA, keys=(key,))

    carry: list[tuple[str, str]] = []
    for model in dict.fromkeys(r.model_name for r in rpcs):
        calls = [r for r in rpcs if r.model_name == model]
        trains = [r.name for r in calls if r.is_train]
        readers = [r.name for r in calls if not r.is_train]
        if not trains:
            continue
        for reader in readers:
            if not g.has_edge(reader, trains[0]):
                g.add_edge(reader, trains[0], kind=PARAM, keys=())
        for a, b in zip(trains, trains[1:]):
            if not g.has_edge(a, b):
                g.add_edge(a, b, kind=PARAM, keys=())
        carry.extend((trains[-1], dst) for dst in readers + trains[:1])

    try:
        cycle = nx.find_cycle(g)
    except nx.NetworkXNoCycle:
        cycle = None
    if cycle:
        path = " -> ".join([u for u, _ in cycle] + [cycle[0][0]])
        why = "; ".join(f"{u}->{v} via {', '.join(g.edges[u, v]['keys']) or 'parameter version'}" for u, v in cycle)
        raise ValueError(f"the dataflow graph has a cycle: {path} ({why}); a call cannot depend on its own output")
    interfaces = check_contracts(spec, table, model_configs)  # the structure is sound: now what each call runs
    _check_positions(spec, model_configs)

    graph = DataflowGraph(spec=spec, graph=g, model_types=MappingProxyType(model_types), carry_edges=tuple(carry),
                          model_configs=MappingProxyType(model_configs), interfaces=MappingProxyType(interfaces))
    if why := partial_rollout_error(graph, 0):  # no plan can run them (max_staleness 0)
        raise ValueError(why)
    return graph
