"""What the installed transformers reads from the reference config.json (`AutoConfig.from_pretrained`,
local files only), compared with what `model_shape` read from it.

`model_shape` reads config.json itself: it must refuse keys it does not know and name the line that is
wrong, which a config object cannot tell. transformers is what loads the merged model, though: its
per-type defaults, its v4 (`rope_scaling`, `torch_dtype`) or v5 (`rope_parameters`, `dtype`) fields
and its own validation decide what the model computes. Every value both read must agree, or the merged
model is not the one checked against the Megatron args."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

from lora_merge.errors import MergeError
from lora_merge.model_shape import ModelShape


def transformers_reading(hf_dir: Path):
    """transformers' config object for hf_dir, or None (with the reason) where this transformers cannot
    read that model type."""
    import transformers

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return transformers.AutoConfig.from_pretrained(str(hf_dir), local_files_only=True), None
    except (ValueError, KeyError) as exc:  # an unknown model_type in an older transformers
        return None, f"transformers {transformers.__version__} cannot read it ({str(exc).splitlines()[0][:200]})"
    except Exception as exc:  # its own validation of a value: the model would not load
        raise MergeError(f"{hf_dir / 'config.json'}: transformers {transformers.__version__} refuses it: "
                         f"{str(exc).strip().splitlines()[0][:300]}") from exc


def _first(config, *names):
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return None


def _rope(config) -> dict:
    """rope theta and scaling as either transformers generation keeps them."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    scaling = dict(getattr(config, "rope_scaling", None) or {})
    merged = {**scaling, **params}
    if "rope_theta" not in merged and getattr(config, "rope_theta", None) is not None:
        merged["rope_theta"] = config.rope_theta
    kind = merged.get("rope_type", merged.get("type"))
    merged["rope_type"] = None if kind in (None, "default") else kind
    return merged


def _compared(shape: ModelShape, config) -> list[tuple[str, object, object]]:
    """(field, transformers' value, ours) for every value both read."""
    rope = _rope(config)
    rows = [("num_hidden_layers", config.num_hidden_layers, shape.num_layers),
            ("hidden_size", config.hidden_size, shape.hidden),
            ("num_attention_heads", config.num_attention_heads, shape.heads),
            ("intermediate_size", config.intermediate_size, shape.ffn),
            ("vocab_size", config.vocab_size, shape.vocab),
            ("tie_word_embeddings", bool(_first(config, "tie_word_embeddings")), shape.tied),
            ("rms_norm_eps", _first(config, "rms_norm_eps"), shape.norm_eps),
            ("rope_theta", rope.get("rope_theta"), shape.rope_theta),
            ("rope type", rope["rope_type"], shape.rope_scaling.type if shape.rope_scaling else None),
            ("dtype", _dtype_name(_first(config, "dtype", "torch_dtype")),
             str(shape.dtype).removeprefix("torch.") if shape.dtype else None)]
    if shape.rope_scaling is not None and rope.get("factor") is not None:
        rows.append(("rope factor", rope["factor"], shape.rope_scaling.get("factor")))
    if shape.mla is None:
        rows += [("num_key_value_heads", _first(config, "num_key_value_heads") or config.num_attention_heads,
                  shape.groups),
                 ("head_dim", _first(config, "head_dim") or config.hidden_size // config.num_attention_heads,
                  shape.head_dim)]
    else:
        mla = shape.mla
        rows += [("q_lora_rank", config.q_lora_rank or None, mla.q_lora), ("kv_lora_rank", config.kv_lora_rank, mla.kv_lora),
                 ("qk_nope_head_dim", config.qk_nope_head_dim, mla.nope),
                 ("qk_rope_head_dim", config.qk_rope_head_dim, mla.rope), ("v_head_dim", config.v_head_dim, mla.v)]
    if shape.moe is not None:
        moe = shape.moe
        rows += [("experts", _first(config, "num_experts", "num_local_experts", "n_routed_experts"), moe.num_experts),
                 ("num_experts_per_tok", config.num_experts_per_tok, moe.topk),
                 ("moe_intermediate_size", _first(config, "moe_intermediate_size", "intermediate_size"), moe.ffn)]
        if getattr(config, "shared_expert_intermediate_size", None) is not None:
            rows.append(("shared_expert_intermediate_size", config.shared_expert_intermediate_size, moe.shared_ffn))
        if getattr(config, "routed_scaling_factor", None) is not None:
            rows.append(("routed_scaling_factor", config.routed_scaling_factor, moe.scaling))
    return rows


def _dtype_name(value) -> str | None:
    if value is None or value == "auto":
        return None
    return str(value).removeprefix("torch.")


def _same(theirs, ours) -> bool:
    if isinstance(theirs, float) or isinstance(ours, float):
        return theirs is not None and ours is not None and math.isclose(float(theirs), float(ours), rel_tol=1e-6)
    return theirs == ours


def check_with_transformers(shape: ModelShape, hf_dir: Path, warn) -> None:
    """Refuse a config that transformers reads differently from us; warn where it cannot read it."""
    import transformers

    config, reason = transformers_reading(hf_dir)
    if config is None:
        warn(f"{hf_dir / 'config.json'}: {reason}; read with lora-merge's own table of {shape.model_type} defaults, "
             "which may differ from the transformers that will load the model")
        return
    for field, theirs, ours in _compared(shape, config):
        if not _same(theirs, ours):
            raise MergeError(f"{hf_dir / 'config.json'}: transformers {transformers.__version__} reads {field} as "
                             f"{theirs!r}, lora-merge as {ours!r}; the merged model would not be the one checked "
                             "against the Megatron args")
