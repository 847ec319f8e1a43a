"""`lora-merge inspect DIR`: what an input is — a Megatron checkpoint, an HF model dir or a PEFT adapter —
before anyone tries to merge it."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

from lora_merge.errors import MergeError
from lora_merge.readers.checkpoint import Checkpoint, TensorRef
from lora_merge.shown import shown
from lora_merge.files.small_files import json_kind, read_json

ARCH_ARGS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
             "ffn_hidden_size", "padded_vocab_size", "add_qkv_bias", "qk_layernorm", "swiglu",
             "untie_embeddings_and_output_weights", "normalization", "position_embedding_type", "noop_layers",
             "num_layer_list", "num_experts", "moe_ffn_hidden_size", "moe_router_topk", "moe_router_pre_softmax",
             "moe_layer_freq", "moe_shared_expert_intermediate_size", "moe_grouped_gemm", "rotary_percent",
             "moe_router_score_function", "moe_router_enable_expert_bias", "moe_router_topk_scaling_factor",
             "mtp_num_layers",
             # gpt-oss's mechanics (model/architectures/gpt_oss.py), where the run has them
             "add_bias_linear", "quick_geglu", "glu_linear_offset", "activation_func_clamp_value", "softmax_type",
             "window_size", "window_attn_skip_freq", "rotary_scaling_factor")


def _gb(n: int) -> str:
    return f"{n / 1e9:.3f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


# The config.json keys that say what an HF model is (those present are shown, in this order).
HF_ARCH_KEYS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size", "vocab_size", "tie_word_embeddings", "attention_bias", "num_experts",
                "num_local_experts", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
                "shared_expert_intermediate_size", "n_shared_experts", "q_lora_rank", "kv_lora_rank",
                "first_k_dense_replace", "use_qk_norm", "partial_rotary_factor", "rope_parameters", "rope_scaling",
                "num_nextn_predict_layers")
# The adapter_config.json keys that decide what a PEFT LoRA computes (those set are shown).
PEFT_KEYS = ("use_rslora", "bias", "rank_pattern", "alpha_pattern", "layers_to_transform", "use_dora",
             "modules_to_save", "target_parameters")
LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def describe_dir(path: Path, verbose: bool = False) -> list[str]:
    """Whichever input `path` is: a PEFT adapter (adapter_config.json), an HF model dir (config.json +
    safetensors) or a Megatron checkpoint; each described by what its own files say."""
    from lora_merge.readers.dcp_hf import read_dcp_hf
    from lora_merge.readers.detect import HF_DCP, HF_DIR, PEFT_DIR, check_input_dir, input_kind, open_checkpoint
    from lora_merge.readers.hf_model import read_hf_model
    from lora_merge.readers.peft import read_peft_adapter


    path = Path(path)
    if not path.exists():
        raise MergeError(f"{path}: does not exist")
    check_input_dir(path, "a Megatron checkpoint, HF model or PEFT adapter dir")
    if input_kind(path) == PEFT_DIR:
        return describe_peft_adapter(read_peft_adapter(path), verbose)
    if input_kind(path) == HF_DIR:
        return describe_hf_model(read_hf_model(path), verbose)
    if input_kind(path) == HF_DCP:
        return describe_dcp_hf(read_dcp_hf(path), verbose)
    if (path / "config.json").is_file():
        raise MergeError(f"{path}: has a config.json but no *.safetensors or model.safetensors.index.json; an HF "
                         "model dir needs its safetensors weights (other weight formats are not read)")
    return describe(open_checkpoint(path), verbose)


def _dtypes(refs) -> str:
    counts = Counter(str(r.dtype).removeprefix("torch.") for r in refs)
    return ", ".join(f"{n} {d}" for d, n in counts.most_common()) or "none"


def _layers(names) -> str:
    found = sorted({int(m.group(1)) for name in names if (m := LAYER.search(name))})
    if not found:
        return "none"
    if found == list(range(found[0], found[-1] + 1)):
        return f"{len(found)} ({found[0]}-{found[-1]})" if len(found) > 1 else f"1 ({found[0]})"
    return f"{len(found)} ({', '.join(map(str, found))})"


def _file_of(ref: TensorRef) -> str:
    return Path(ref.where.split("[", 1)[0]).name  # a reader's `where` is "file[tensor name]"


def _per_file(tensors: dict[str, TensorRef], verbose: bool) -> list[str]:
    files: dict[str, list] = {}
    for name, ref in tensors.items():
        files.setdefault(_file_of(ref), []).append((name, ref))
    lines = [f"  files: {len(files)}, {_gb(sum(r.nbytes for r in tensors.values()))} of tensors"]
    for file, entries in sorted(files.items()):
        lines.append(f"    {file}: {len(entries)} tensors, {_gb(sum(r.nbytes for _, r in entries))}")
        if verbose:
            lines += [f"      {name} {list(ref.shape)} {str(ref.dtype).removeprefix('torch.')}"
                      for name, ref in sorted(entries)]
    return lines


def describe_hf_model(model, verbose: bool = False) -> list[str]:
    from lora_merge.readers.hf_model import Fp8Ref, Mxfp4Ref
    config = read_json(Path(model.path) / "config.json")
    if not isinstance(config, dict):
        raise MergeError(f"{Path(model.path) / 'config.json'}: the top level is a JSON {json_kind(config)}; expected "
                         "an object of config fields")
    archs = ", ".join(config.get("architectures") or []) or "no architectures listed"
    lines = [f"{model.path}: HF model dir, model_type {shown(config.get('model_type'))} ({archs})"]
    arch = [f"{k}={config[k]}" for k in HF_ARCH_KEYS if config.get(k) is not None]
    lines.append(f"  architecture (config.json): {', '.join(arch) or 'none of the usual keys'}")
    lines.append(f"  dtype (config.json): {config.get('dtype') or config.get('torch_dtype')}")
    fp8 = [ref for ref in model.tensors.values() if isinstance(ref, Fp8Ref)]
    mxfp4 = [ref for ref in model.tensors.values() if isinstance(ref, Mxfp4Ref)]
    plain = [ref for ref in model.tensors.values() if not isinstance(ref, (Fp8Ref, Mxfp4Ref))]
    kinds = ", ".join(filter(None, [_dtypes(plain) if plain else "", f"{len(fp8)} block-FP8 e4m3 with "
                                    f"{model.fp8.block[0]}x{model.fp8.block[1]} scales" if fp8 else "",
                                    f"{len(mxfp4)} MXFP4 experts read dequantized" if mxfp4 else ""]))
    lines.append(f"  tensors: {len(model.tensors)} ({kinds}), in layers {_layers(model.tensors)}")
    skipped = ", ".join(f"{n} {reason}" for reason, n in sorted(model.skipped.items()))
    if skipped:
        lines.append(f"  not weights (skipped by a merge): {skipped}")
    lines += _per_file(model.tensors, verbose)
    return lines


def describe_dcp_hf(model, verbose: bool = False) -> list[str]:
    """An HF-named torch distributed checkpoint: its tensors, how they are split, what is not weights."""
    pieced = [ref for ref in model.tensors.values() if getattr(ref, "pieces", ())]
    ranks = max((len(ref.pieces) for ref in pieced), default=1)
    lines = [f"{model.path}: torch distributed checkpoint of HF-named tensors (FSDP), {len(model.sources) - 1} "
             f".distcp file(s); give --hf-ref for its config.json",
             f"  tensors: {len(model.tensors)} ({_dtypes(model.tensors.values())}), in layers {_layers(model.tensors)}; "
             f"{len(pieced)} stored in pieces" + (f" (up to {ranks}, along dim "
                                                   f"{'/'.join(sorted({str(r.dim) for r in pieced}))})" if pieced else "")]
    skipped = ", ".join(f"{n} {reason}" for reason, n in sorted(model.skipped.items()))
    if skipped:
        lines.append(f"  not weights (skipped by a merge): {skipped}")
    if verbose:
        lines += [f"    {name} {list(ref.shape)} {str(ref.dtype).removeprefix('torch.')}"
                  + (f" in {len(ref.pieces)} pieces" if getattr(ref, "pieces", ()) else "")
                  for name, ref in sorted(model.tensors.items())]
    return lines


def describe_peft_adapter(adapter, verbose: bool = False) -> list[str]:
    config = adapter.config
    lines = [f"{adapter.path}: PEFT {config.get('peft_type')} adapter (PEFT {config.get('peft_version', 'version not recorded')}), "
             f"base model {config.get('base_model_name_or_path') or 'not named'}"]
    targets = config.get("target_modules")
    targets = targets if isinstance(targets, str) else sorted(targets or [])
    lines.append(f"  LoRA: r={config.get('r')} lora_alpha={config.get('lora_alpha')}, target_modules={targets}"
                 + "".join(f", {k}={config[k]}" for k in PEFT_KEYS if config.get(k) not in (None, False, "none", {}, [])))
    projections = Counter(name.removesuffix(".weight").rsplit(".", 1)[-1] for name in adapter.factors)
    ranks = sorted({f.r for f in adapter.factors.values()})
    scales = sorted({f.scale for f in adapter.factors.values()})
    lines.append(f"  adapted modules: {len(adapter.factors)} ({', '.join(f'{p} x{n}' for p, n in sorted(projections.items()))})"
                 f" in layers {_layers(adapter.factors)}; rank {ranks}, scale {', '.join(f'{s:g}' for s in scales)}")
    if adapter.biases:
        lines.append(f"  tensors replacing the base's: {len(adapter.biases)} (trained biases, embedding layers saved "
                     "whole)")
    refs = {f"{name} lora_{ab}": ref for name, f in adapter.factors.items() for ab, ref in (("A", f.a), ("B", f.b))}
    refs.update(adapter.biases)
    lines.append(f"  tensors: {len(refs)} ({_dtypes(refs.values())})")
    lines += _per_file(refs, verbose)
    if verbose:
        lines.append("  modules (weight adapted: r, scale):")
        lines += [f"    {name}: r={f.r}, scale {f.scale:g}" for name, f in sorted(adapter.factors.items())]
    return lines


def _bridge_lora(ckpt: Checkpoint) -> list[str]:
    """What a Megatron-Bridge LoRA's run_config.yaml made of the modules: its PEFT method, and where a module's rank
    or scale is its own."""
    args = ckpt.args
    if getattr(args, "bridge_run_config", None) is None:
        return []
    fused = sum(m.row_block is not None for m in ckpt.lora.values())
    dora = sum(m.magnitude is not None for m in ckpt.lora.values())
    method = ("CanonicalLoRA" + (f" ({fused} modules of separate q/k/v or gate/up adapters)" if fused else "")
              if getattr(args, "bridge_canonical_lora", False) else
              f"DoRA (a magnitude on {dora} modules)" if getattr(args, "bridge_dora", False) else "LoRA")
    own = Counter((m.rank, m.scale_factor) for m in ckpt.lora.values() if m.rank is not None)
    scale = "".join(f"; {n} routed-expert modules at rank {r}, scale {f:g}× the run's (normalize_moe_lora)"
                    for (r, f), n in sorted(own.items()))
    return [f"  Megatron-Bridge: {method}{scale}; settings from {args.bridge_run_config}"]


def describe(ckpt: Checkpoint, verbose: bool = False) -> list[str]:
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
        from lora_merge.model.moe_shape import megatron_moe_layers
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
        ranks = sorted({m.a[0].shape[0] // m.blocks for m in ckpt.lora.values()})  # (each fused adapter's)
        lines.append(f"  LoRA: {len(ckpt.lora)} modules ({', '.join(f'{t} x{n}' for t, n in sorted(targets.items()))}),"
                     f" adapter '{ckpt.adapter_name}', rank in the tensors {ranks}; args: lora_r={getattr(args, 'lora_r', None)}"
                     f" lora_alpha={getattr(args, 'lora_alpha', None)}"
                     f" lora_target_modules={getattr(args, 'lora_target_modules', None)}")
        lines += _bridge_lora(ckpt)
    else:
        lines.append("  LoRA: none")
    skipped = ", ".join(f"{n} {reason}" for reason, n in sorted(ckpt.skipped.items()))
    if skipped:
        lines.append(f"  not weights (skipped by a merge): {skipped}")
    total = sum(b for _, _, b in ckpt.files)
    lines.append(f"  files: {len(ckpt.files)}, {_gb(total)} of tensors")
    for file, count, nbytes in ckpt.files:
        lines.append(f"    {file}: {count} tensors, {_gb(nbytes)}")
    if verbose:
        lines.append("  parameters (shape of each piece):")
        lines += [f"    {name} {[list(r.shape) for r in refs]} {str(refs[0].dtype).removeprefix('torch.')}"
                  for name, refs in sorted(ckpt.params.items())]
        lines += [f"    {module} lora_A {[list(r.shape) for r in m.a]} lora_B {[list(r.shape) for r in m.b]}"
                  for module, m in sorted(ckpt.lora.items())]
    return lines
