"""The architecture of the model being merged, read from the HF reference config and checked against
the Megatron args, so that a mismatch stops the merge instead of producing a wrong model."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from lora_merge.errors import MergeError
from lora_merge.layer_numbering import noop_layers

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelShape:
    model_type: str
    num_layers: int
    hidden: int
    heads: int
    groups: int  # key/value heads (Megatron's query groups)
    head_dim: int
    ffn: int
    vocab: int
    tied: bool
    qkv_bias: bool
    qk_norm: bool
    dtype: torch.dtype | None  # the reference's dtype, if it names one
    rope_theta: float | None = None
    norm_eps: float | None = None

    @property
    def features(self) -> frozenset[str]:
        """Optional parts of the architecture that some rules depend on."""
        return frozenset(name for name, on in (("qkv_bias", self.qkv_bias), ("qk_norm", self.qk_norm),
                                               ("untied", not self.tied), ("tied", self.tied)) if on)


def read_hf_config(hf_dir: Path) -> tuple[ModelShape, dict]:
    path = hf_dir / "config.json"
    if not path.is_file():
        raise MergeError(f"{hf_dir}: no config.json (the --hf-ref directory must hold the HF model's config)")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise MergeError(f"{path}: not valid JSON ({exc})") from exc
    if "text_config" in cfg and "num_hidden_layers" not in cfg:
        raise MergeError(f"{path}: multimodal configs are not supported")
    model_type = cfg.get("model_type", "")

    def need(key):
        if not isinstance(cfg.get(key), int) or cfg[key] <= 0:
            raise MergeError(f"{path}: {key!r} must be a positive integer, found {cfg.get(key)!r}")
        return cfg[key]

    if model_type != "qwen2" and cfg.get("attention_bias"):
        # In HF Llama/Mistral/Qwen3 attention_bias also gives o_proj a bias, which Megatron's
        # add_qkv_bias does not have: writing one would be inventing weights.
        raise MergeError(f"{path}: attention_bias=true for {model_type} (q/k/v *and* o_proj biases) is not supported")
    if cfg.get("mlp_bias"):
        raise MergeError(f"{path}: mlp_bias=true is not supported")
    rope = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}

    heads = need("num_attention_heads")
    hidden = need("hidden_size")
    dtype_name = cfg.get("dtype") or cfg.get("torch_dtype")
    shape = ModelShape(
        model_type=model_type,
        num_layers=need("num_hidden_layers"),
        hidden=hidden,
        heads=heads,
        groups=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        ffn=need("intermediate_size"),
        vocab=need("vocab_size"),
        tied=bool(cfg.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases; Llama-family configs say so with attention_bias.
        qkv_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
        qk_norm=model_type == "qwen3",
        dtype=DTYPES.get(str(dtype_name)) if dtype_name else None,
        rope_theta=_float(cfg.get("rope_theta", rope.get("rope_theta"))),
        norm_eps=_float(cfg.get("rms_norm_eps")),
    )
    if shape.heads % shape.groups:
        raise MergeError(f"{path}: num_attention_heads={heads} is not a multiple of num_key_value_heads={shape.groups}")
    return shape, cfg


def check_against_args(shape: ModelShape, args, where: str) -> None:
    """Every architecture fact that the Megatron args also record must agree with the HF config."""
    def arg(name, default=None):
        value = getattr(args, name, default)
        return default if value is None else value

    gqa = bool(arg("group_query_attention", False))
    groups = int(arg("num_query_groups", shape.heads)) if gqa else int(arg("num_attention_heads", shape.heads))
    heads = int(arg("num_attention_heads", shape.heads))
    checks = [
        ("num_layers", arg("num_layers"), shape.num_layers + _noop_count(args), "num_hidden_layers"),
        ("hidden_size", arg("hidden_size"), shape.hidden, "hidden_size"),
        ("num_attention_heads", heads, shape.heads, "num_attention_heads"),
        ("num_query_groups", groups, shape.groups, "num_key_value_heads"),
        ("kv_channels", arg("kv_channels", shape.hidden // heads if heads else None), shape.head_dim, "head_dim"),
        ("ffn_hidden_size", arg("ffn_hidden_size"), shape.ffn, "intermediate_size"),
    ]
    for arg_name, theirs, ours, hf_name in checks:
        if theirs is not None and int(theirs) != ours:
            raise MergeError(f"{where}: args.{arg_name}={theirs} but the HF config's {hf_name} implies {ours}")
    untie = arg("untie_embeddings_and_output_weights")
    if untie is not None and bool(untie) == shape.tied:
        raise MergeError(f"{where}: args.untie_embeddings_and_output_weights={untie} but the HF config has "
                         f"tie_word_embeddings={shape.tied}")
    qkv_bias = arg("add_qkv_bias")
    if qkv_bias is None and arg("add_bias_linear") is not None:
        qkv_bias = arg("add_bias_linear")
    if qkv_bias is not None and bool(qkv_bias) != shape.qkv_bias:
        raise MergeError(f"{where}: args.add_qkv_bias={qkv_bias} but the HF config ({shape.model_type}) "
                         f"{'has' if shape.qkv_bias else 'has no'} q/k/v biases")
    qk_norm = arg("qk_layernorm")
    if qk_norm is not None and bool(qk_norm) != shape.qk_norm:
        raise MergeError(f"{where}: args.qk_layernorm={qk_norm} but the HF config ({shape.model_type}) "
                         f"{'has' if shape.qk_norm else 'has no'} q/k norms")
    _check_function_args(shape, arg, where)
    padded = arg("padded_vocab_size")
    if padded is not None and int(padded) < shape.vocab:
        raise MergeError(f"{where}: args.padded_vocab_size={padded} is smaller than the HF vocab_size={shape.vocab}")
    if arg("swiglu") is False:
        raise MergeError(f"{where}: args.swiglu=False, but the {shape.model_type} MLP is gated (swiglu)")


def _check_function_args(shape: ModelShape, arg, where: str) -> None:
    """Args that change what the trained model computes without changing any tensor shape: the HF config
    must describe the same function, or the merged model is not the trained one."""
    fixed = [("rotary_interleaved", False), ("apply_layernorm_1p", False), ("add_bias_linear", False),
             ("position_embedding_type", "rope"), ("normalization", "RMSNorm"), ("rotary_percent", 1.0)]
    for name, expected in fixed:
        value = arg(name)
        if value is not None and value != expected:
            raise MergeError(f"{where}: args.{name}={value!r}; only {expected!r} maps onto a HF {shape.model_type} model")
    for name, theirs, ours, hf_name in (("rotary_base", arg("rotary_base"), shape.rope_theta, "rope_theta"),
                                        ("norm_epsilon", arg("norm_epsilon"), shape.norm_eps, "rms_norm_eps")):
        if theirs is not None and ours is not None and not math.isclose(float(theirs), ours, rel_tol=1e-6):
            raise MergeError(f"{where}: args.{name}={theirs} but the HF config's {hf_name} is {ours}: the merged "
                             "model would not compute what was trained")


def _float(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) else None


def _noop_count(args) -> int:
    return len(noop_layers(args))
