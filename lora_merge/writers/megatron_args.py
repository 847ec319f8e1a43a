"""The `args` namespace a written Megatron checkpoint carries: every model and parallel argument that
Megatron's loaders (`check_checkpoint_args`, `--use-checkpoint-args`) and MindSpeed-LLM read, as plain
values (no Megatron classes: the file must load without the training stack's enums).

From a Megatron source, its own args are kept (they record how it was trained) with the layout, the
vocabulary padding and the dtype replaced; from an HF source they are derived from the config. Either way
they are checked against the HF config by the same check every reader applies (`check_against_args`), so
what we write is what we would accept.
"""

from __future__ import annotations

from argparse import Namespace

import torch

from lora_merge.errors import MergeError
from lora_merge.model.megatron_args import DEFAULT_VOCAB_DIVISOR, check_against_args
from lora_merge.model.mla_shape import megatron_mla_args
from lora_merge.model.model_shape import ModelShape
from lora_merge.model.moe_shape import megatron_moe_args
from lora_merge.model.rope import megatron_rope_args
from lora_merge.model.parallel_layout import ParallelLayout
from lora_merge.value_checks import is_int, shown_value

# Arguments that describe the source run's layout or its training state, not the model: replaced or dropped.
_RUN_STATE = ("consumed_train_samples", "consumed_valid_samples", "iteration", "load", "save", "lora_load",
              "lora_r", "lora_alpha", "lora_target_modules", "lora_ckpt_filter", "lora_fusion", "noop_layers",
              "num_layer_list", "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage",
              "pipeline_model_parallel_layout", "rank", "world_size", "data_parallel_size", "expert_tensor_parallel_size",
              "moe_grouped_gemm")


# Bounds on the vocabulary padding asked for: far above any real divisor (64-1024) and any vocabulary (~260k),
# and within int32 token ids; beyond them a typo would plan terabytes of zero rows.
MAX_VOCAB_DIVISOR = 1 << 20
MAX_PADDED_VOCAB = (1 << 31) - 1


def vocab_padding(vocab: int, tp: int, divisible_by: int | None, given: int | None) -> tuple[int, int]:
    """(padded vocabulary, the make_vocab_size_divisible_by the args record).

    Megatron's rule rounds the vocabulary up to a multiple of make_vocab_size_divisible_by × TP. A padded size
    given by hand (at least the vocabulary, divisible by TP) is recorded with divisor `given / TP`, under which
    that same rule computes exactly `given` (⌈vocab / given⌉ · given = given): the args stay self-consistent,
    so Megatron (`--make-vocab-size-divisible-by` that value) and every reader derive the size written."""
    if divisible_by is not None and not (is_int(divisible_by) and 1 <= divisible_by <= MAX_VOCAB_DIVISOR):
        raise MergeError(f"--make-vocab-size-divisible-by {shown_value(divisible_by)}; expected a whole number from 1 "
                         f"to {MAX_VOCAB_DIVISOR}")
    if given is None:
        divisor = DEFAULT_VOCAB_DIVISOR if divisible_by is None else divisible_by
        multiple = divisor * tp
        return -(-vocab // multiple) * multiple, divisor
    if not is_int(given) or not 1 <= given <= MAX_PADDED_VOCAB:
        raise MergeError(f"--padded-vocab-size {shown_value(given)}; expected a whole number of at least the "
                         f"model's vocab_size, divisible by --tp, at most {MAX_PADDED_VOCAB}")
    if given < vocab:
        raise MergeError(f"--padded-vocab-size {given} is smaller than the model's vocab_size {vocab}")
    if given % tp:
        raise MergeError(f"--padded-vocab-size {given} does not split over --tp {tp}")
    if divisible_by is not None:
        ruled = vocab_padding(vocab, tp, divisible_by, None)[0]
        if ruled != given:
            raise MergeError(f"--padded-vocab-size {given} with --make-vocab-size-divisible-by {divisible_by}: "
                             f"Megatron's rule pads vocab_size {vocab} to {ruled} at --tp {tp}; give one of the two")
        return given, divisible_by
    return given, given // tp


def target_args(shape: ModelShape, layout: ParallelLayout, dtype: torch.dtype, padded_vocab: int, divisible_by: int,
                grouped_experts: bool, source=None, ckpt_format: str = "torch",
                transformer_impl: str = "local") -> Namespace:
    args = {k: v for k, v in vars(source).items() if _plain(v)} if source is not None else {}
    for name in _RUN_STATE:
        args.pop(name, None)
    args.update(_model_args(shape) if source is None else {})
    args.update(
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None,
        num_layers_per_virtual_pipeline_stage=None,
        decoder_first_pipeline_num_layers=layout.first_stage_layers,
        decoder_last_pipeline_num_layers=layout.last_stage_layers,
        expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=layout.etp if shape.moe else None,
        context_parallel_size=1, sequence_parallel=False if layout.tp == 1 else args.get("sequence_parallel", False),
        padded_vocab_size=padded_vocab, make_vocab_size_divisible_by=divisible_by,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        ckpt_format=ckpt_format, use_dist_ckpt=ckpt_format != "torch", transformer_impl=transformer_impl,
        no_save_optim=True, no_save_rng=True, use_mcore_models=True,
        use_legacy_models=False, moe_grouped_gemm=grouped_experts if shape.moe else False,
    )
    if "moe_tp_extend_ep" in args:  # megatron-core's own expert layout is written, never MindSpeed's TP-extended one
        args["moe_tp_extend_ep"] = False
    # the MTP layers written, whatever the source's args say (a LoRA trained without them on a base that has them)
    if shape.mtp_in_source or args.get("mtp_num_layers"):
        args["mtp_num_layers"] = shape.mtp_layers if shape.mtp_in_source else None
    if shape.moe is not None and args.get("first_k_dense_replace"):
        # MindSpeed's dense first layers on top of an every-k-th-layer rule: Megatron-LM (and its torch_dist
        # layout) knows only moe_layer_freq, so it is written as Megatron's per-layer list of the same layers
        args["moe_layer_freq"] = [int(i in shape.moe.layers) for i in range(shape.num_layers)]
    result = Namespace(**dict(sorted(args.items())))  # one order whatever the source's: reshards round-trip bytes
    check_against_args(shape, result, "the args written into the Megatron checkpoint")
    return result


def _plain(value, depth: int = 0) -> bool:
    """A value any unpickler can rebuild without the training stack: no Megatron classes (enums such as
    ModelType, AttnBackend are dropped; Megatron sets them from its own arguments at start-up)."""
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype)):
        return True
    if isinstance(value, (list, tuple)) and depth < 4:
        return all(_plain(v, depth + 1) for v in value)
    if isinstance(value, dict) and depth < 4:
        return all(isinstance(k, str) and _plain(v, depth + 1) for k, v in value.items())
    return False


def _model_args(shape: ModelShape) -> dict:
    args = dict(
        num_layers=shape.num_layers, hidden_size=shape.hidden, ffn_hidden_size=shape.ffn,
        num_attention_heads=shape.heads, group_query_attention=shape.groups != shape.heads,
        num_query_groups=shape.groups, kv_channels=shape.head_dim, vocab_size=shape.vocab,
        max_position_embeddings=None, position_embedding_type="rope", use_rotary_position_embeddings=True,
        rotary_base=shape.rope_theta, rotary_percent=shape.rotary_percent, rotary_interleaved=False, normalization="RMSNorm",
        norm_epsilon=shape.norm_eps, apply_layernorm_1p=False, swiglu=True, add_bias_linear=False,
        add_qkv_bias=shape.qkv_bias, qk_layernorm=shape.qk_norm or shape.mla is not None,
        untie_embeddings_and_output_weights=not shape.tied, tokenizer_type="PretrainedFromHF",
        hidden_dropout=0.0, attention_dropout=0.0, mtp_num_layers=shape.mtp_layers if shape.mtp_in_source else None,
    )
    args.update(megatron_rope_args(shape.rope_scaling))
    if shape.moe is not None:
        args.update(megatron_moe_args(shape.moe, shape.num_layers))
    if shape.mla is not None:
        args.update(megatron_mla_args(shape.mla))
    if shape.own_mechanics is not None:
        args.update(shape.own_mechanics.megatron_args(shape.num_layers))
    return args
