"""The experiment API of realhf.txt Figure 5 / realhf-appendix.txt section B.

An experiment is a dataclass decorated with ``@auto(...)`` whose ``rpcs``
property lists ``ModelFunctionCallDef`` nodes of the dataflow graph.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import sys
import traceback
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from realloc import user_code
from realloc.algorithms.registry import resolve_minibatches
# Re-exported: experiments import the graph's node types from here.
from realloc.calls import GENERATE, INFERENCE, TRAIN_STEP, InterfaceType, ModelFunctionCallDef  # noqa: F401
from realloc.algorithms.lora_graph import reference_from_base  # noqa: F401
from realloc.models.lora_config import LoRAConfig  # noqa: F401
from realloc.cluster import ClusterSpec, Pool  # noqa: F401 (Pool: experiments import it from here)
from realloc.lengths import ResponseLengths  # noqa: F401  (experiments declare their lengths with it)

AUTO_ATTR = "__realloc_auto__"


@dataclasses.dataclass(frozen=True)
class HFModel:
    """A model whose shape and weights come from a HuggingFace checkpoint directory.

    The directory holds ``config.json`` and safetensors weights (one file or sharded), as
    ``save_pretrained`` writes them. An experiment maps model names to checkpoints with a ``models``
    field or property; a plain string is the same as ``HFModel(path)``::

        models = {"actor": "ckpt/sft", "ref": "ckpt/sft",
                  "critic": HFModel("ckpt/sft", new_value_head=True),  # critic from the SFT model
                  "reward": "ckpt/reward"}                              # a *ForSequenceClassification

    A relative path is relative to the experiment file. ``new_value_head`` turns a causal-LM
    checkpoint into a critic: its trunk is loaded and a scalar head is initialized from the run's
    seed. A sequence-classification checkpoint already has its scalar head. ``build_hint`` says how to
    make a checkpoint that the repository builds rather than ships (the error when it is missing).
    """

    path: str
    new_value_head: bool = False
    build_hint: str = ""  # e.g. "build it with `python -m realloc.demo.arith_demo sft`"

    def __post_init__(self) -> None:
        if not isinstance(self.path, (str, Path)) or not str(self.path):
            raise ValueError(f"HFModel.path must be a checkpoint directory, got {self.path!r}")
        object.__setattr__(self, "path", str(self.path))
        if not isinstance(self.new_value_head, bool):
            raise ValueError(f"HFModel.new_value_head must be True or False, got {self.new_value_head!r}")


@dataclasses.dataclass(frozen=True)
class AutoConfig:
    """What ``@auto`` records: the cluster and the workload shape."""

    nodelist: str | None
    batch_size: int
    n_devices_per_node: int | None = None
    device: str = "cpu"
    prompt_len: int = 1024
    gen_len: int = 1024
    dataset_keys: tuple[str, ...] = ("prompts",)
    cluster_overrides: Mapping[str, float] = dataclasses.field(default_factory=dict)
    max_staleness: int = 0
    response_lengths: ResponseLengths = ResponseLengths()
    # A heterogeneous cluster instead of nodelist/device (docs/heterogeneous.md): pools of device kinds.
    pools: tuple[Pool | Mapping[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.response_lengths, ResponseLengths):
            raise ValueError(f"@auto: response_lengths must be a ResponseLengths (ResponseLengths.lognormal(median, "
                             f"p99), ...), got {type(self.response_lengths).__name__}")
        if (self.nodelist is None) == (not self.pools):
            raise ValueError("@auto: give either nodelist (one device kind) or pools (a list of Pool(nodelist, "
                             "device, ...)), not both" if self.pools else "@auto: nodelist is required (or pools)")
        if self.pools and (self.n_devices_per_node is not None or self.device != "cpu"):
            raise ValueError("@auto: with pools, set n_devices_per_node and device on each Pool, not in @auto")
        for field in ("batch_size", "prompt_len", "gen_len"):
            v = getattr(self, field)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"@auto: {field} must be a positive integer, got {v!r}")
        v = self.max_staleness
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"@auto: max_staleness must be an integer >= 0 (0: synchronous RL), got {v!r}")
        self.response_lengths.check(self.gen_len)


def auto(nodelist: str | None = None, batch_size: int = 0, n_devices_per_node: int | None = None,
         device: str = "cpu", prompt_len: int = 1024, gen_len: int = 1024, dataset_keys: Sequence[str] = ("prompts",),
         max_staleness: int = 0, response_lengths: ResponseLengths | None = None,
         pools: Sequence[Pool | Mapping[str, Any]] = (),
         **cluster_overrides: float) -> Callable[[type], type]:
    """Mark a dataclass as a realloc experiment (realhf.txt Figure 5).

    ``prompt_len`` and ``gen_len`` give the workload shape the planner costs:
    generation extends each prompt by up to ``gen_len`` tokens, and every later
    call sees ``prompt_len + gen_len`` tokens per sequence. ``max_staleness`` bounds
    asynchronous RL: a plan may let generation run that many train steps ahead of
    training (the search chooses how far, 0 to the bound; docs/async-rl.md). ``response_lengths``
    says how long responses are (``realloc.lengths``; default: every one ``gen_len`` tokens), which the
    planner prices (docs/long-tail.md). ``pools`` replaces ``nodelist``/``device`` with pools of several
    device kinds; then ``cluster_overrides`` may set only ``pool_link_bandwidth`` and ``pool_link_latency``
    (docs/heterogeneous.md).
    """
    cfg = AutoConfig(nodelist, batch_size, n_devices_per_node, device, prompt_len, gen_len, tuple(dataset_keys),
                     dict(cluster_overrides), max_staleness,
                     ResponseLengths() if response_lengths is None else response_lengths, tuple(pools))

    def wrap(cls: type) -> type:
        if not dataclasses.is_dataclass(cls):
            raise ValueError(f"@auto must decorate a dataclass; put @dataclasses.dataclass under @auto on {cls.__name__}")
        if not isinstance(getattr(cls, "rpcs", None), property):
            raise ValueError(f"experiment {cls.__name__} needs an `rpcs` property returning ModelFunctionCallDefs")
        setattr(cls, AUTO_ATTR, cfg)
        return cls

    return wrap


@dataclasses.dataclass(frozen=True)
class ExperimentSpec:
    """A loaded experiment: its calls, cluster and workload, plus the user's config object."""

    name: str
    rpcs: tuple[ModelFunctionCallDef, ...]
    cluster: ClusterSpec
    batch_size: int
    prompt_len: int
    gen_len: int
    dataset_keys: tuple[str, ...]
    config: Any = None
    source: str = ""
    # model name -> checkpoint, paths resolved against the experiment file (the ``models`` field).
    models: Mapping[str, HFModel] = dataclasses.field(default_factory=dict)
    # How many train steps generation may run ahead of training (a plan's ``staleness`` is at most this).
    max_staleness: int = 0
    # How long responses are (realloc.lengths): what the estimator prices; fixed = gen_len each.
    response_lengths: ResponseLengths = ResponseLengths()

    def resolve_path(self, path: str | Path) -> Path:
        """A user path: absolute, or relative to the experiment file (to the working directory for a module)."""
        p = Path(path).expanduser()
        src = self.source.rsplit(":", 1)[0]
        if not p.is_absolute() and src.endswith(".py"):
            p = Path(src).parent / p
        return p

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.gen_len

    def call(self, name: str) -> ModelFunctionCallDef:
        for rpc in self.rpcs:
            if rpc.name == name:
                return rpc
        raise ValueError(f"experiment {self.name!r} has no call {name!r}; calls: {', '.join(self.call_names)}")

    @property
    def call_names(self) -> tuple[str, ...]:
        return tuple(r.name for r in self.rpcs)

    @property
    def group_size(self) -> int:
        """Responses per prompt (the GENERATE calls' ``n_samples``); sequences come in groups of this size."""
        return max((r.n_samples for r in self.rpcs), default=1)

    def describe_batch(self) -> str:
        """The batch as ``show`` and ``search`` print it: ``8 prompts x 4 responses = 32 sequences`` with group
        sampling, else its size."""
        if self.group_size == 1:
            return str(self.batch_size)
        n = self.batch_size * self.group_size
        return f"{self.batch_size} prompts x {self.group_size} responses = {n} sequences"

    def n_seqs(self, rpc: ModelFunctionCallDef) -> int:
        """Sequences a call processes: ``batch_size`` prompts times the group size, unless ``n_seqs`` says."""
        return rpc.n_seqs if rpc.n_seqs is not None else self.batch_size * self.group_size


def experiment_spec(experiment: Any, source: str = "", auto_config: AutoConfig | None = None) -> ExperimentSpec:
    """Build the spec of an ``@auto`` experiment class or instance (``auto_config`` replaces its ``@auto``)."""
    cls = experiment if isinstance(experiment, type) else type(experiment)
    cfg: AutoConfig | None = auto_config or getattr(cls, AUTO_ATTR, None)
    if cfg is None:
        raise ValueError(f"{cls.__name__} is not a realloc experiment: decorate it with @auto(...)")
    instance = experiment() if isinstance(experiment, type) else experiment
    rpcs = instance.rpcs
    if not isinstance(rpcs, (list, tuple)) or not rpcs:
        raise ValueError(f"experiment {cls.__name__}: rpcs must be a non-empty list of ModelFunctionCallDef")
    for i, r in enumerate(rpcs):
        if not isinstance(r, ModelFunctionCallDef):
            raise ValueError(f"experiment {cls.__name__}: rpcs[{i}] is a {type(r).__name__}, not a ModelFunctionCallDef")
    names = [r.name for r in rpcs]
    groups = {r.n_samples for r in rpcs if r.interface_type is InterfaceType.GENERATE}
    if len(groups) > 1:
        raise ValueError(f"experiment {cls.__name__}: GENERATE calls sample different n_samples {sorted(groups)}; "
                         f"every generation of one experiment must produce the same group size")
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup:
        raise ValueError(f"experiment {cls.__name__}: two calls are named {dup!r}; call names must be unique")
    cluster = _cluster(cfg)
    spec = ExperimentSpec(name=cls.__name__, rpcs=tuple(rpcs), cluster=cluster, batch_size=cfg.batch_size,
                          prompt_len=cfg.prompt_len, gen_len=cfg.gen_len, dataset_keys=cfg.dataset_keys,
                          config=instance, source=source, max_staleness=cfg.max_staleness,
                          response_lengths=cfg.response_lengths)

    return dataclasses.replace(spec, rpcs=resolve_minibatches(spec),
                               models=_checkpoint_models(spec, getattr(instance, "models", None)))


def _cluster(cfg: AutoConfig) -> ClusterSpec:
    if not cfg.pools:
        return ClusterSpec.from_nodelist(cfg.nodelist, cfg.n_devices_per_node, cfg.device, **cfg.cluster_overrides)
    link = dict(cfg.cluster_overrides)
    unknown = sorted(set(link) - {"pool_link_bandwidth", "pool_link_latency"})
    if unknown:
        raise ValueError(f"@auto: {unknown[0]!r} is a setting of one pool; with pools, set it on the Pool (the "
                         f"cluster takes only pool_link_bandwidth and pool_link_latency)")
    return ClusterSpec.from_pools(cfg.pools, link.get("pool_link_bandwidth"), link.get("pool_link_latency"))


def _checkpoint_models(spec: ExperimentSpec, models: Any) -> dict[str, HFModel]:
    """The experiment's ``models`` mapping, validated, with absolute paths."""
    if models is None:
        return {}
    if not isinstance(models, Mapping):
        raise ValueError(f"experiment {spec.name}: `models` must map model names to checkpoint directories "
                         f"(a str or HFModel), got {type(models).__name__}")
    used = {r.model_name for r in spec.rpcs}
    out = {}
    for name, value in models.items():
        if name not in used:
            raise ValueError(f"experiment {spec.name}: `models` names {name!r}, which no call uses "
                             f"(model names of the calls: {', '.join(sorted(used))})")
        if isinstance(value, (str, Path)):
            value = HFModel(str(value))
        if not isinstance(value, HFModel):
            raise ValueError(f"experiment {spec.name}: models[{name!r}] must be a checkpoint directory (str) or "
                             f"HFModel(path, new_value_head=...), got {type(value).__name__}")
        out[name] = dataclasses.replace(value, path=str(spec.resolve_path(value.path).resolve()))
    return out


def _import_file(path: Path) -> Any:
    mod_name = f"realloc_experiment_{path.stem}"
    spec = importlib.util.spec_from_file_location(mod_name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"cannot import experiment file {path}")
    # Like `python exp.py`: modules next to the experiment (`from my_rewards import ...`) are importable,
    # whichever folder realloc (or a worker) started in.
    folder = str(path.resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module  # dataclasses resolve annotations through sys.modules
    try:
        spec.loader.exec_module(module)
    except BaseException as e:
        sys.modules.pop(mod_name, None)
        if isinstance(e, KeyboardInterrupt):
            raise
        raise ValueError(_import_error(f"experiment file {path}", e, path)) from None
    return module


def _import_error(what: str, e: BaseException, path: Path | None) -> str:
    """The user's own code failed while being imported: say so, naming the file and line."""
    if isinstance(e, SyntaxError):
        if path is not None and e.filename and Path(e.filename).resolve() == path.resolve():
            return f"{what}: syntax error at line {e.lineno}: {e.msg}"
        return f"{what}: importing it failed: syntax error in {e.filename}, line {e.lineno}: {e.msg}"
    def is_own(filename: str) -> bool:
        return path is not None and Path(filename).resolve() == path.resolve()

    frames = [f for f in traceback.extract_tb(e.__traceback__) if not f.filename.startswith("<")]  # not importlib's
    own = [f.lineno for f in frames if is_own(f.filename)]
    where = f", line {own[-1]}" if own else ""
    # Raised deeper, in a module the experiment imports: name the innermost line of the user's own code there
    # (not realloc's or a library's frame that raised on the user's behalf); else the innermost frame.
    user = [f for f in frames if user_code.is_user_file(f.filename)]
    deep = user[-1] if user else frames[-1] if frames else None
    inner = f" (in {deep.filename}, line {deep.lineno})" if deep is not None and not is_own(deep.filename) else ""
    if isinstance(e, SystemExit):
        return (f"{what}{where}: called sys.exit({e.code!r}) while being imported{inner}; an experiment file should "
                f"only define the experiment")
    return f"{what}{where}: importing it raised {type(e).__name__}: {e}{inner}"


def _module_file(name: str) -> Path | None:
    try:
        found = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    return Path(found.origin) if found is not None and found.origin else None


def load_experiment(target: str) -> ExperimentSpec:
    """Load ``path/to/exp.py``, ``path/to/exp.py:ClassName`` or ``package.module[:ClassName]``."""
    where, _, cls_name = target.partition(":")
    path = Path(where)
    if where.endswith(".py"):
        if path.is_dir():
            raise ValueError(f"experiment file {where!r} is a directory; give the experiment's .py file")
        if not path.is_file():
            raise ValueError(f"experiment file {where!r} does not exist")
        module = _import_file(path)
        source = str(path.resolve())
    else:
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as e:
            if e.name is not None and (where == e.name or where.startswith(e.name + ".")):
                raise ValueError(f"experiment {target!r}: no file or module of that name") from None
            raise ValueError(_import_error(f"experiment module {where}", e, _module_file(where))) from None
        except KeyboardInterrupt:
            raise
        except BaseException as e:
            raise ValueError(_import_error(f"experiment module {where}", e, _module_file(where))) from None
        source = where
    found = {n: c for n, c in vars(module).items() if isinstance(c, type) and hasattr(c, AUTO_ATTR)
             and c.__module__ == module.__name__}
    if cls_name:
        if cls_name not in found:
            raise ValueError(f"experiment {target!r}: no @auto class {cls_name!r}; found {', '.join(found) or 'none'}")
        cls = found[cls_name]
    elif len(found) == 1:
        cls = next(iter(found.values()))
    elif not found:
        raise ValueError(f"experiment {target!r} defines no @auto-decorated dataclass")
    else:
        raise ValueError(f"experiment {target!r} defines several experiments ({', '.join(found)}); "
                         f"pick one with {where}:ClassName")
    return experiment_spec(cls, source=f"{source}:{cls.__name__}")
