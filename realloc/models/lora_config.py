"""LoRA settings and where its adapters live under tensor parallelism (torch-free: the graph, planner and
estimator read it).

LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models", §4.1): a frozen weight
``W0 [out, in]`` gets a trained low-rank update, ``h = W0 x + (alpha / r) B A x`` with ``A [r, in]`` and
``B [out, r]``; ``A`` starts random and ``B`` at zero, so training starts from the base model exactly. Only
``A`` and ``B`` (and a critic's fresh scalar head) are trained: gradients and optimizer state exist for them
alone, and the base with the adapters switched off is the untouched model, the reference of a LoRA actor.

Tensor parallelism, derived from the base layer's split (``param_layout``):

- column-parallel ``W0`` (q/k/v, gate/up; split on the output dim): ``y_r = W0_r x`` on rank r. With ``A``
  replicated and ``B`` split like ``W0`` on its output dim, ``y_r += s B_r (A x)``: every rank computes the
  same r-wide ``u = A x`` and its own output columns. ``dL/du = sum_r B_r^T dy_r`` is a sum over the tp
  ranks, so ``u`` passes through an identity whose backward all-reduces (megatron's
  ``copy_to_tensor_model_parallel_region``), which makes ``dA`` and ``A``'s share of ``dx`` whole on every rank;
- row-parallel ``W0`` (o, down; split on the input dim): ``y = sum_r W0_r x_r``. With ``A`` split like ``W0``
  on its input dim and ``B`` replicated, ``y += s B (sum_r A_r x_r)``: the r-wide partial sums are
  all-reduced (``reduce_from_tensor_model_parallel_region``) before ``B``, whose gradient is then the same on
  every rank.

Under sequence parallelism the same two reductions become an all-gather / reduce-scatter pair over the
tokens of the r-wide tensors, and the replicated halves (column ``A``, row ``B``) get partial gradients that
``grads.sync_sequence_parallel`` sums over tp like the norms'. So each adapter moves only r-wide activations
over tp, never h-wide ones.

Names follow the base weight's: ``model.layers.3.self_attn.q_proj.lora_A.weight`` and ``...lora_B.weight``,
PEFT's names without its ``base_model.model.`` prefix (``runtime/persist/peft_export.py`` adds it).
"""

from __future__ import annotations

import dataclasses
import math

COLUMN_MODULES = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_MODULES = ("o_proj", "down_proj")
ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
ADAPTER_MARKERS = (".lora_A.", ".lora_B.")
# PEFT's names of Phi-3's fused projections (models/fused_names.py): the model holds their parts apart
FUSED_HINTS = {n: f" (Phi-3's fused {n} is held as {' '.join(parts)}: name those; each part gets its own adapter, not "
                  f"one over the fused rows as PEFT's)"
               for n, parts in (("qkv_proj", ("q_proj", "k_proj", "v_proj")),
                                ("gate_up_proj", ("gate_proj", "up_proj")))}


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters for the models named in ``models`` (an experiment's ``lora`` field).

    ``rank`` r and ``alpha`` give the update's scale ``alpha / r`` (``rslora``: ``alpha / sqrt(r)``, Kalajdzievski
    2023); ``dropout`` is applied to each adapted layer's input on the adapter path only, in training;
    ``target_modules`` are the projections that get adapters (names of the LLaMA block's linears).
    """

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ALL_MODULES
    models: tuple[str, ...] = ("actor",)
    rslora: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.target_modules, str):
            object.__setattr__(self, "target_modules", (self.target_modules,))
        if isinstance(self.models, str):
            object.__setattr__(self, "models", (self.models,))
        object.__setattr__(self, "target_modules", tuple(self.target_modules))
        object.__setattr__(self, "models", tuple(self.models))
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
            raise ValueError(f"LoRAConfig.rank must be a positive integer, got {self.rank!r}")
        if not isinstance(self.alpha, (int, float)) or isinstance(self.alpha, bool) or not self.alpha > 0:
            raise ValueError(f"LoRAConfig.alpha must be a positive number, got {self.alpha!r}")
        object.__setattr__(self, "alpha", float(self.alpha))
        if not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRAConfig.dropout must be in [0, 1), got {self.dropout!r}")
        object.__setattr__(self, "dropout", float(self.dropout))
        if not self.target_modules:
            raise ValueError(f"LoRAConfig.target_modules is empty; name some of {', '.join(ALL_MODULES)}")
        bad = [m for m in self.target_modules if m not in ALL_MODULES]
        if bad:
            fused = FUSED_HINTS.get(bad[0], "")
            raise ValueError(f"LoRAConfig.target_modules: unknown module {bad[0]!r}; the LLaMA block's linears are "
                             f"{', '.join(ALL_MODULES)}{fused}")
        if len(set(self.target_modules)) != len(self.target_modules):
            raise ValueError(f"LoRAConfig.target_modules names a module twice: {list(self.target_modules)}")
        # one spelling of each setting (equality, digests): the block's order
        object.__setattr__(self, "target_modules", tuple(m for m in ALL_MODULES if m in self.target_modules))
        if not self.models or not all(isinstance(m, str) and m for m in self.models):
            raise ValueError(f"LoRAConfig.models must name the models that get adapters (e.g. ('actor',)), got "
                             f"{self.models!r}")

    @property
    def scaling(self) -> float:
        """The factor of ``B A x``: alpha / r (alpha / sqrt(r) with rslora)."""
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


def module_prefix(layer: int, module: str) -> str:
    """``model.layers.<i>.self_attn.q_proj``: the HF name of one adapted linear."""
    return f"model.layers.{layer}.{_PARENT[module]}.{module}"


def is_adapter(name: str) -> bool:
    return any(m in name for m in ADAPTER_MARKERS)


def base_name(adapter_name: str) -> str:
    """The base weight an adapter belongs to: ``...q_proj.lora_A.weight`` -> ``...q_proj.weight``."""
    for m in ADAPTER_MARKERS:
        if m in adapter_name:
            return adapter_name.split(m)[0] + ".weight"
    raise ValueError(f"{adapter_name!r} is not a LoRA adapter name")
