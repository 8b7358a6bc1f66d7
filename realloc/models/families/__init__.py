"""HF architecture families: each maps an HF config.json onto the one parallel model and back.

The parallel model (``realloc.models.llama``) is one LLaMA-style decoder; a family
is a small module (``llama.py``, ``qwen2.py``, ``qwen3.py``, ``mistral.py``, ``phi3.py``,
``gemma.py``, ``gemma2.py``, ``gemma3.py``) that names its HF architectures,
says which of its config.json settings the model cannot run, and adds its own
keys when writing one. The keys every family shares (sizes, heads, RoPE, norm
epsilon, tied embeddings, the critic's single label) are read and written here.

    cfg = config_from_hf(json.load(open("ckpt/config.json")), "HF checkpoint ckpt")
    hf = hf_from_config(cfg, "bfloat16")
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Mapping

from realloc.models.config import ModelConfig
from realloc.models.families import gemma, gemma2, gemma3, llama, mistral, phi3, qwen2, qwen3
from realloc.models.families.base import Family

FAMILIES: Mapping[str, Family] = MappingProxyType({f.model_type: f for f in (
    llama.FAMILY, qwen2.FAMILY, qwen3.FAMILY, mistral.FAMILY, phi3.FAMILY, gemma.FAMILY, gemma2.FAMILY, gemma3.FAMILY)})
SUPPORTED = ("; ".join(f.describe() for f in FAMILIES.values())
             + "; silu MLP (Gemma's gelu_pytorch_tanh), full attention or sliding windows (Mistral's, Phi-3's, "
             "Qwen2/Qwen3's and Gemma 2/3's per layer), RoPE type default or llama3")


def unsupported(where: str, field: str, value: Any, why: str = "") -> ValueError:
    """The one error for a config.json realloc cannot run: names the file, the field and what works."""
    return ValueError(f"{where}: {field}={value!r} is not supported{why}; realloc supports {SUPPORTED}")


def describe_shape(cfg: ModelConfig) -> str:
    """One line of what realloc read from a checkpoint (``realloc show``'s checkpoint lines)."""
    full = cfg.full_attention_layers
    window = f"sliding window {cfg.sliding_window}" + (
        f" in {cfg.n_layers - len(full)} of {cfg.n_layers} layers" if full else "")
    extras = [x for x, on in (("q/k/v bias", cfg.qkv_bias), ("q/k head norms", cfg.qk_norm),
                              ("norms around both sublayers", cfg.sandwich_norms),
                              (f"attention scores capped at {cfg.attn_logit_softcapping:g}" if
                               cfg.attn_logit_softcapping else "", cfg.attn_logit_softcapping),
                              (f"logits capped at {cfg.final_logit_softcapping:g}" if cfg.final_logit_softcapping
                               else "", cfg.final_logit_softcapping),
                              (f"local RoPE base {cfg.local_rope_theta:g}" if cfg.local_rope_theta else "",
                               cfg.local_rope_theta),
                              ("tied embeddings", cfg.tie_embeddings), ("value head", cfg.is_critic),
                              (window, cfg.sliding_window),
                              (f"rotary {cfg.rotary_dim} of {cfg.head_dim} features", cfg.rotary_dim)) if on]
    return (f"{cfg.family}, {cfg.n_layers} layers, hidden {cfg.hidden_size}, {cfg.n_heads} heads ({cfg.n_kv_heads} KV) "
            f"x {cfg.head_dim}, MLP {cfg.intermediate_size}, vocabulary {cfg.vocab_size}"
            + "".join(f", {x}" for x in extras) + f", {cfg.total_params:,} parameters")


def family(name: str, where: str = "model config") -> Family:
    if name not in FAMILIES:
        raise unsupported(where, "model_type", name)
    return FAMILIES[name]


def _rope(hf: Mapping[str, Any], default_theta: float,
          where: str) -> tuple[float, tuple[float, float, float, int] | None]:
    # transformers >= 5 writes rope_parameters; older configs have rope_theta and rope_scaling.
    params = dict(hf.get("rope_parameters") or {})
    theta = float(params.get("rope_theta", hf.get("rope_theta", default_theta)))
    scaling = hf.get("rope_scaling") if not params else params
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type in (None, "default"):
        return theta, None
    if rope_type != "llama3":
        raise unsupported(where, "rope_type", rope_type)
    try:
        return theta, (float(scaling["factor"]), float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"]),
                       int(scaling["original_max_position_embeddings"]))
    except KeyError as e:
        raise ValueError(f"{where}: llama3 rope scaling lacks {e.args[0]!r}") from None


def _is_critic(hf: Mapping[str, Any], fam: Family, critic: bool | None, where: str) -> bool:
    archs = list(hf.get("architectures") or [])
    for a in archs:
        if a not in fam.architectures:
            raise unsupported(where, "architectures", archs, " (a causal LM or a one-label sequence classifier)")
    is_critic = fam.sequence_classification in archs if critic is None else critic
    if is_critic and fam.sequence_classification in archs:
        labels = num_labels(hf)
        if labels != 1:
            named = "" if "id2label" in hf or "num_labels" in hf else (
                "; config.json names neither num_labels nor id2label, which transformers reads as 2 labels")
            raise unsupported(where, "num_labels", labels, f" (a critic or reward model has one scalar output{named})")
    return is_critic


def num_labels(hf: Mapping[str, Any]) -> int:
    """The labels of a sequence classifier as transformers' PretrainedConfig counts them: id2label's length,
    else num_labels, else its default of 2 (transformers >= 5 writes neither key for a 2-label classifier)."""
    if hf.get("id2label") is not None:
        return len(hf["id2label"])
    if hf.get("num_labels") is not None:
        return int(hf["num_labels"])
    return 2


def config_from_hf(hf: Mapping[str, Any], where: str, name: str | None = None,
                   critic: bool | None = None) -> ModelConfig:
    """A ModelConfig from a parsed config.json; ``where`` names it in errors (e.g. the checkpoint path).

    ``critic`` defaults to whether the checkpoint is a sequence-classification model.
    """
    fam = family(str(hf.get("model_type", "llama")), where)
    bad = fam.unsupported(hf)
    if bad is not None:
        raise unsupported(where, *bad)
    quant = hf.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, Mapping) else quant
        raise unsupported(where, "quantization_config", {"quant_method": method},
                          " (quantized weights: use the unquantized checkpoint)")
    act = hf.get("hidden_act", fam.defaults.get("hidden_act", "silu"))
    if act not in fam.activations:
        raise unsupported(where, "hidden_act", act)
    is_critic = _is_critic(hf, fam, critic, where)
    try:
        h, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        # None: hidden_size / num_attention_heads; absent: the family's default (Qwen3's is 128)
        head_dim = hf.get("head_dim", fam.defaults.get("head_dim"))
        if head_dim is not None and (int(head_dim) <= 0 or int(head_dim) % 2):
            raise unsupported(where, "head_dim", head_dim, " (rotary embeddings need a positive even head_dim)")
        theta, scaling = _rope(hf, fam.defaults["rope_theta"], where)
        window, full_layers = fam.windows(hf) if fam.windows is not None else (None, ())
        own = fam.config_fields(hf) if fam.config_fields is not None else {}
        return ModelConfig(**{**dict(
            name=name or str(hf.get("_name_or_path") or f"hf-{fam.model_type}"),
            vocab_size=int(hf["vocab_size"]), hidden_size=h, intermediate_size=int(hf["intermediate_size"]),
            n_layers=int(hf["num_hidden_layers"]), n_heads=heads,
            n_kv_heads=int(hf.get("num_key_value_heads") or fam.defaults.get("num_key_value_heads") or heads),
            max_position_embeddings=int(hf.get("max_position_embeddings", fam.defaults["max_position_embeddings"])),
            rope_theta=theta, norm_eps=float(hf.get("rms_norm_eps", fam.defaults["rms_norm_eps"])),
            tie_embeddings=bool(hf.get("tie_word_embeddings", fam.defaults.get("tie_word_embeddings", False)))
            and not is_critic,
            is_critic=is_critic, rope_scaling=scaling, family=fam.model_type, qkv_bias=fam.qkv_bias,
            qk_norm=fam.qk_norm, hidden_act=fam.activations[act], norm_plus_one=fam.norm_plus_one,
            embed_scale=fam.embed_scale,
            sliding_window=window, full_attention_layers=full_layers,
            explicit_head_dim=None if head_dim is None else int(head_dim),
            rotary_dim=_rotary_dim(hf, fam, h // heads if head_dim is None else int(head_dim)),
            sandwich_norms=fam.sandwich_norms,
        ), **own})
    except KeyError as e:
        raise ValueError(f"{where}: missing key {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:  # a value of the wrong type, or a shape ModelConfig refuses
        if str(e).startswith(where):
            raise
        msg = str(e).split(": ", 1)[1] if str(e).startswith("model config ") else str(e)
        for ours, theirs in _HF_KEYS.items():
            msg = msg.replace(ours, theirs)
        raise ValueError(f"{where}: {msg}; fix config.json or point the model at another checkpoint") from None


def _rotary_dim(hf: Mapping[str, Any], fam: Family, head_dim: int) -> int | None:
    """The rotated features of a head: ``int(head_dim * partial_rotary_factor)`` where the family reads the factor
    (Phi-3: ``rope_parameters`` first, then the top-level key), else all of them."""
    if not fam.partial_rotary:
        return None
    params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    factor = float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    if not 0.0 < factor <= 1.0:
        raise ValueError(f"partial_rotary_factor must be in (0, 1], got {factor}")
    return int(head_dim * factor)


# ModelConfig's field names as config.json spells them, for errors about a checkpoint's config.
_HF_KEYS = {"n_kv_heads": "num_key_value_heads", "n_heads": "num_attention_heads", "n_layers": "num_hidden_layers",
            "rotary_dim": "int(head_dim * partial_rotary_factor)"}


def hf_from_config(cfg: ModelConfig, dtype_name: str = "float32") -> dict[str, Any]:
    """config.json of ``cfg`` for ``transformers``: its family's causal LM, or sequence classifier for critics."""
    fam = family(cfg.family, f"model config {cfg.name!r}")
    if cfg.hidden_act not in fam.activations.values():
        raise ValueError(f"model config {cfg.name!r}: hidden_act={cfg.hidden_act!r} cannot be written as a "
                         f"{fam.model_type} checkpoint; set family to one that runs it")
    if not fam.can_write(cfg):
        what = ("its layers have no window" if fam.windows is None else
                f"it windows every layer or none, not all but layers {list(cfg.full_attention_layers)}")
        raise ValueError(f"model config {cfg.name!r}: sliding_window={cfg.sliding_window} cannot be written as a "
                         f"{fam.model_type} checkpoint ({what}); set family to mistral, qwen2, qwen3, gemma2 or "
                         "gemma3_text")
    for field in ("qkv_bias", "qk_norm", "norm_plus_one", "embed_scale", "sandwich_norms"):
        if getattr(cfg, field) != getattr(fam, field):
            raise ValueError(f"model config {cfg.name!r}: {field}={getattr(cfg, field)} cannot be written as a "
                             f"{fam.model_type} checkpoint (its {field} is {getattr(fam, field)}); set family to one "
                             f"that matches")
    # which families' config.json can say each of Gemma 2/3's settings (the others would be dropped silently)
    for field, families in (("query_pre_attn_scalar", ("gemma2", "gemma3_text")),
                            ("local_rope_theta", ("gemma3_text",)), ("attn_logit_softcapping", ("gemma2",)),
                            ("final_logit_softcapping", ("gemma2",))):
        if getattr(cfg, field) is not None and fam.model_type not in families:
            raise ValueError(f"model config {cfg.name!r}: {field}={getattr(cfg, field)} cannot be written as a "
                             f"{fam.model_type} checkpoint; set family to {' or '.join(families)}")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        f, lo, hi, ctx = cfg.rope_scaling
        rope = {"rope_type": "llama3", "rope_theta": cfg.rope_theta, "factor": f, "low_freq_factor": lo,
                "high_freq_factor": hi, "original_max_position_embeddings": ctx}
    out: dict[str, Any] = {
        "architectures": [fam.sequence_classification if cfg.is_critic else fam.causal_lm],
        "model_type": fam.model_type, "hidden_act": cfg.hidden_act,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta, "rope_parameters": rope,
        "rope_scaling": None if cfg.rope_scaling is None else rope,
        "tie_word_embeddings": cfg.tie_embeddings, "torch_dtype": dtype_name, "dtype": dtype_name,
        **fam.hf_fields(cfg),
    }
    if cfg.is_critic:
        out.update({"num_labels": 1, "id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}})
    return out
