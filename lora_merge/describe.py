"""`lora-merge inspect DIR`: what a checkpoint is, before anyone tries to merge it."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from lora_merge.readers.checkpoint import Checkpoint

ARCH_ARGS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
             "ffn_hidden_size", "padded_vocab_size", "add_qkv_bias", "qk_layernorm", "swiglu",
             "untie_embeddings_and_output_weights", "normalization", "position_embedding_type", "noop_layers",
             "num_layer_list", "num_experts", "moe_ffn_hidden_size", "moe_router_topk", "moe_router_pre_softmax",
             "moe_layer_freq", "moe_shared_expert_intermediate_size", "moe_grouped_gemm")


def _gb(n: int) -> str:
    return f"{n / 1e9:.3f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def describe(ckpt: Checkpoint) -> list[str]:
    args = ckpt.args
    lines = [f"{ckpt.path}: {ckpt.format} Megatron checkpoint, iteration {ckpt.iteration}"]
    others = sorted(p.name for p in Path(ckpt.path).glob("iter_*") if p.is_dir() and not p.name.endswith(
        f"{int(ckpt.iteration):07d}" if ckpt.iteration.isdigit() else ckpt.iteration))
    if others:
        lines.append(f"  other iterations present (not used; the tracker file names the one above): {', '.join(others)}")
    layout = ckpt.note or f"TP={ckpt.tp} PP={ckpt.pp} VPP={ckpt.vpp}"
    if ckpt.numbering is not None:
        counts = ckpt.numbering.counts
        layout += "; layers per " + ("stage: " + ",".join(map(str, counts[0])) if len(counts) == 1 else
                                     "chunk x stage: " + " | ".join(",".join(map(str, row)) for row in counts))
    lines.append(f"  parallel: {layout}")
    if ckpt.experts is not None:
        from lora_merge.moe_shape import megatron_moe_layers
        moe_layers = sorted(megatron_moe_layers(args, int(getattr(args, "num_layers", 0) or 0), str(ckpt.path)))
        lines.append(f"  experts: {ckpt.experts}; MoE layers {moe_layers}")
    arch = [f"{k}={getattr(args, k)}" for k in ARCH_ARGS if getattr(args, k, None) not in (None, [], "")]
    lines.append(f"  architecture (args): {', '.join(arch)}")
    dtype = getattr(args, "params_dtype", None)
    lines.append(f"  training dtype (args): {dtype}, bf16={getattr(args, 'bf16', None)}, fp16={getattr(args, 'fp16', None)}")

    dtypes = Counter(str(refs[0].dtype).removeprefix("torch.") for refs in ckpt.params.values())
    size = sum(r.nbytes for refs in ckpt.params.values() for r in refs)
    lines.append(f"  base parameters: {len(ckpt.params)} ({', '.join(f'{n} {d}' for d, n in dtypes.items()) or 'none'}),"
                 f" {_gb(size)} over all ranks")
    if ckpt.lora:
        targets = Counter(module.rsplit(".", 1)[-1] for module in ckpt.lora)
        ranks = sorted({m.a[0].shape[0] for m in ckpt.lora.values()})
        lines.append(f"  LoRA: {len(ckpt.lora)} modules ({', '.join(f'{t} x{n}' for t, n in sorted(targets.items()))}),"
                     f" adapter '{ckpt.adapter_name}', rank in the tensors {ranks}; args: lora_r={getattr(args, 'lora_r', None)}"
                     f" lora_alpha={getattr(args, 'lora_alpha', None)}"
                     f" lora_target_modules={getattr(args, 'lora_target_modules', None)}")
    else:
        lines.append("  LoRA: none")
    skipped = ", ".join(f"{n} {reason}" for reason, n in sorted(ckpt.skipped.items()))
    if skipped:
        lines.append(f"  not weights (skipped by a merge): {skipped}")
    total = sum(b for _, _, b in ckpt.files)
    lines.append(f"  files: {len(ckpt.files)}, {_gb(total)} of tensors")
    for file, count, nbytes in ckpt.files:
        lines.append(f"    {file}: {count} tensors, {_gb(nbytes)}")
    return lines
