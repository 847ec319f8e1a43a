"""Export the LoRA as an unmerged PEFT adapter (`adapter_model.safetensors` + `adapter_config.json`) that
PEFT, vLLM and SGLang load on top of the HF base model.

A fused Megatron LoRA maps onto HF's separate projections exactly: linear_qkv's A is shared by
q_proj/k_proj/v_proj and its B rows are regrouped like the weight's; linear_fc1 likewise becomes
gate_proj/up_proj. No arithmetic is done, so the factors keep their bits.

Routed experts come in one of two namings (`EXPERT_FORMATS`):
- "per-expert": `…mlp.experts.{e}.gate_proj.lora_A.weight` and so on, the HF checkpoint naming. vLLM's
  MoE LoRA loads this; PEFT converts it onto transformers 5's fused experts for qwen3_moe and mixtral,
  and for deepseek_v2/v3 too, where it drops the dense layers' and shared experts' MLP LoRA (we warn).
- "fused": one LoRA per fused 3-D expert parameter of transformers 5 (`mlp.experts.gate_up_proj`
  [E, 2F, H], `mlp.experts.down_proj` [E, H, F]) as PEFT's `target_parameters` stores it: lora_A
  [E·r, in] expert-major, lora_B [out, r·E] rank-major (column j·E + e is expert e's B column j). Each
  expert keeps its own rank-r factors; fc1's shared A makes gate_up one rank-r LoRA per expert.
  PEFT (0.21) on transformers 5 rewrites the target_modules of qwen3_moe, mixtral and deepseek_v2/v3
  adapters when it loads them: every target named like an expert projection (gate_proj, up_proj,
  down_proj; Mixtral's w1/w3/w2) becomes a fused-experts parameter (gate_up_proj at rank 2r), so those
  names can no longer adapt a dense layer's MLP or a shared expert (DeepSeek's), and a rank-r gate_up_proj
  would not load. The fused adapter therefore names no such target_modules: those modules' LoRA is given
  as LoRA on their 2-D weights (`target_parameters` "gate_proj.weight" …, PEFT's ParamWrapper, the same
  keys and the same ΔW = s·B·A), which PEFT leaves as they are.

It walks the table for the LoRA modules alone rather than consuming a merge plan: an adapter needs no base
weights (`--base` is optional), and a plan is made of them. Where a --base is given with an unfiltered LoRA,
the export makes the plan too, for its check that the two bases are one (runs/export.py).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from lora_merge.model.architectures import Architecture, iter_rules
from lora_merge.errors import MergeError
from lora_merge.integrity import check_finite, check_records
from lora_merge.model.layout import GatedColumn, RowParallel
from lora_merge.lora import LoraSettings, check_factor_shapes, hf_factors
from lora_merge.model.model_shape import ModelShape
from lora_merge.readers.checkpoint import Checkpoint
from lora_merge.files.staged_dir import output_file_mode

PEFT_PREFIX = "base_model.model."
VLLM_DEFAULT_MAX_LORA_RANK = 16
EXPERT_FORMATS = ("per-expert", "fused")
@dataclass
class Adapter:
    tensors: dict[str, torch.Tensor]
    target_modules: list[str]
    target_parameters: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def build_adapter(lora: Checkpoint, shape: ModelShape, arch: Architecture, settings: LoraSettings,
                  dtype: torch.dtype | None, expert_format: str = "per-expert", allow_partial: bool = False) -> Adapter:
    tensors = adapter_tensors(lora, shape, arch, settings, dtype)
    warnings = complete_targets(tensors, lora, shape, arch, settings.r, allow_partial)
    experts = expert_keys(tensors, arch)
    if not experts:
        return Adapter(tensors, target_modules(tensors), warnings=warnings)
    if expert_format == "fused":
        adapter = fuse_experts(tensors, experts, arch, shape, str(lora.path))
        adapter.warnings[:0] = warnings
        return adapter
    peft = arch.config.peft  # what PEFT does with this model type's adapters (its architecture module says)
    if peft.drops_per_expert:
        warnings.append(f"PEFT (0.20 and later) does not convert per-expert {arch.name} adapters onto transformers 5's fused "
                        "experts and drops them without an error; load this adapter with vLLM, or export with "
                        "--expert-format fused for PEFT")
    if peft.remaps_every_mlp_target:
        warnings += unconverted_mlp_warning(tensors, experts, arch)
    return Adapter(tensors, target_modules(tensors), warnings=warnings)


def adapter_tensors(lora: Checkpoint, shape: ModelShape, arch: Architecture, settings: LoraSettings,
                    dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """PEFT-named lora_A/lora_B tensors for every adapted HF projection, in HF layout (experts per expert)."""
    tensors = {}
    remaining = dict(lora.lora)
    for rule, names, prefix in iter_rules(arch, shape, lora.has):
        module = names[0].removesuffix(".weight")
        if not names[0].endswith(".weight") or module not in remaining:
            continue
        factors = remaining.pop(module)
        check_factor_shapes(rule, factors, shape, settings.r, module)
        check_records(factors.refs)
        for hf_name, (b, a) in hf_factors(rule, factors, shape, module).items():
            key = PEFT_PREFIX + prefix + hf_name.removesuffix(".weight")
            for name, factor in ((f"{key}.lora_A.weight", a), (f"{key}.lora_B.weight", b)):
                # q/k/v share A: one copy each; grouped experts are transposed views, saved row-major
                tensors[name] = factor.to(dtype or factor.dtype).clone(memory_format=torch.contiguous_format)
                check_finite(tensors[name], name, "non-finite values (NaN or Inf) in the LoRA factor"
                             + ("" if dtype is None or dtype == factor.dtype else
                                f" as {str(dtype).removeprefix('torch.')}"))
    if remaining:
        raise MergeError(f"{lora.path}: LoRA weights for modules that have no HF counterpart: "
                         f"{', '.join(sorted(remaining)[:3])}")
    return tensors


def expert_keys(tensors: dict[str, torch.Tensor], arch: Architecture) -> dict[str, tuple[int, int, str]]:
    """Adapter keys of routed experts: key -> (layer, expert, role), role "gate", "up" or "down"."""
    patterns = []
    for rule in arch.layer_rules:
        if rule.per_expert and isinstance(rule, GatedColumn):
            patterns += [(rule.gate, "gate"), (rule.up, "up")]
        elif rule.per_expert and isinstance(rule, RowParallel):
            patterns.append((rule.hf, "down"))
    compiled = [(re.compile(rf"^{re.escape(PEFT_PREFIX)}model\.layers\.(\d+)\."
                            + re.escape(name.removesuffix(".weight")).replace(re.escape("{expert}"), r"(\d+)")
                            + r"\.lora_[AB]\.weight$"), role) for name, role in patterns]
    found = {}
    for key in tensors:
        for pattern, role in compiled:
            if m := pattern.match(key):
                found[key] = (int(m.group(1)), int(m.group(2)), role)
    return found


def fuse_experts(tensors: dict[str, torch.Tensor], experts: dict, arch: Architecture, shape: ModelShape,
                 where: str) -> Adapter:
    """The per-expert factors as one LoRA per fused expert parameter (see the module docstring)."""
    factors: dict[tuple[int, str], dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]]] = {}
    for key, (layer, expert, role) in experts.items():
        if key.endswith(".lora_A.weight"):
            module = key.removesuffix(".lora_A.weight")
            fused = "down_proj" if role == "down" else "gate_up_proj"
            factors.setdefault((layer, fused), {}).setdefault(expert, {})[role] = (
                tensors[f"{module}.lora_B.weight"], tensors[key])
    out = {k: v for k, v in tensors.items() if k not in experts}
    path, count = arch.config.fused_experts, shape.moe.num_experts
    present = {fused for _, fused in factors}
    nested = present == {"gate_up_proj", "down_proj"}
    layers = {layer for layer, _ in factors}
    for fused in sorted(present):
        lacking = sorted(layers - {layer for layer, f in factors if f == fused})
        if lacking:  # PEFT would expect this parameter's LoRA in every layer's experts
            raise MergeError(f"{where}: layers {lacking[:5]} have no expert LoRA for {fused}, the other MoE layers "
                             "do; a fused adapter adapts it in every layer (use --expert-format per-expert)")
    for (layer, fused), by_expert in sorted(factors.items()):
        absent = sorted(set(range(count)) - set(by_expert))
        if absent:
            raise MergeError(f"{where}: layer {layer}: experts {absent[:5]} have no LoRA for {fused}; a fused adapter "
                             "needs every expert (use --expert-format per-expert)")
        a_list, b_list = [], []
        for expert in range(count):
            roles = by_expert[expert]
            parts = [roles[r] for r in (("down",) if fused == "down_proj" else ("gate", "up"))]
            a = parts[0][1]
            if any(not torch.equal(part[1], a) for part in parts[1:]):  # Megatron's fc1 LoRA shares one A
                raise MergeError(f"{where}: layer {layer} expert {expert}: gate and up LoRA have different A factors; "
                                 "they cannot be one fused LoRA (use --expert-format per-expert)")
            a_list.append(a)
            b_list.append(torch.cat([b for b, _ in parts], dim=0))  # gate_up_proj holds [gate; up] rows
        a_stack, b_stack = torch.stack(a_list), torch.stack(b_list)  # [E, r, in], [E, out, r]
        # PEFT wraps the experts module of every layer once per entry of the global target_parameters,
        # gate_up_proj innermost: with both listed, its LoRA lives under `base_layer` in every layer.
        owner = f"{PEFT_PREFIX}model.layers.{layer}.{path}"
        if fused == "gate_up_proj" and nested:
            owner += ".base_layer"
        out[f"{owner}.lora_A.weight"] = a_stack.reshape(-1, a_stack.shape[-1]).contiguous()
        out[f"{owner}.lora_B.weight"] = b_stack.permute(1, 2, 0).reshape(b_stack.shape[1], -1).contiguous()
    others = {k: v for k, v in tensors.items() if k not in experts}
    parameters = [f"{path}.{p}" for p in ("gate_up_proj", "down_proj") if p in present]
    modules = target_modules(others)
    if arch.config.peft.converts_expert_targets:
        leaves = {name.removesuffix(".weight").rsplit(".", 1)[-1] for rule in arch.layer_rules if rule.per_expert
                  for name in rule.hf_names()}
        parameters += [f"{leaf}.weight" for leaf in modules if leaf in leaves]  # dense MLPs, shared experts
        modules = [leaf for leaf in modules if leaf not in leaves]
    return Adapter(out, modules, parameters)


def unconverted_mlp_warning(tensors: dict[str, torch.Tensor], experts: dict, arch: Architecture) -> list[str]:
    """What PEFT (0.21) on transformers 5 drops of this adapter: the LoRA of every non-expert module named like
    an expert projection (the dense layers' MLP, the shared experts)."""
    expert_leaves = {key.removesuffix(".lora_A.weight").rsplit(".", 1)[-1] for key in experts}
    dropped = sorted(key.removesuffix(".lora_A.weight") for key in tensors
                     if key.endswith(".lora_A.weight") and key not in experts
                     and key.removesuffix(".lora_A.weight").rsplit(".", 1)[-1] in expert_leaves)
    if not dropped:
        return []
    shown = ", ".join(_module_label(k) for k in dropped[:3]) + (" …" if len(dropped) > 3 else "")
    return [f"PEFT (0.20 and later) on transformers 5 turns every {'/'.join(sorted(expert_leaves))} target of a {arch.name} "
            f"model into a routed-expert parameter, so it drops the LoRA of {len(dropped)} dense-MLP and shared-expert "
            f"modules of this adapter without an error ({shown}); vLLM and transformers 4 load them. The merged "
            "model (lora-merge without export-adapter) has them, and --expert-format fused writes them in a form PEFT "
            "loads"]


def target_modules(tensors: dict[str, torch.Tensor]) -> list[str]:
    return sorted({key.removesuffix(".lora_A.weight").rsplit(".", 1)[-1] for key in tensors if key.endswith(".lora_A.weight")})


def complete_targets(tensors: dict[str, torch.Tensor], lora: Checkpoint, shape: ModelShape, arch: Architecture,
                     r: int, allow_partial: bool) -> list[str]:
    """PEFT adapts every module whose name ends with a target (a shared expert's down_proj makes every
    routed expert's and every dense MLP's down_proj one too), and vLLM packs each expert's three
    projections together; a module without factors loads with fresh ones or not at all. So every such
    module of the model must be in the adapter: missing ones are refused, or with `allow_partial` written as
    zero factors, which leave it unchanged exactly as a merge with --allow-partial-lora does. Returns the
    warnings to show."""
    targets = set(target_modules(tensors))
    expected, missing = 0, {}
    for rule, _, prefix in iter_rules(arch, shape, lora.has):
        for hf_name in rule.hf_names():
            module = hf_name.removesuffix(".weight")
            if module == hf_name or module.rsplit(".", 1)[-1] not in targets:
                continue
            expected += 1
            key = PEFT_PREFIX + prefix + module
            if f"{key}.lora_A.weight" not in tensors:
                missing[key] = rule.hf_shapes(shape)[hf_name]
    if not missing:
        return []
    where = str(lora.path)
    shown = ", ".join(_module_label(k) for k in list(missing)[:4]) + (" …" if len(missing) > 4 else "")
    if not allow_partial:
        raise MergeError(f"{where}: no LoRA for {len(missing)} of the {expected} modules the adapter targets "
                         f"({shown}); PEFT and vLLM would load them with missing factors (pass "
                         "--allow-partial-lora to write zero factors for them, which leave them unchanged)")
    for key, (out_dim, in_dim) in missing.items():
        like = next(t for k, t in tensors.items() if k.endswith(f".{key.rsplit('.', 1)[-1]}.lora_A.weight"))
        tensors[f"{key}.lora_A.weight"] = torch.zeros(r, in_dim, dtype=like.dtype)
        tensors[f"{key}.lora_B.weight"] = torch.zeros(out_dim, r, dtype=like.dtype)
    return [f"{where}: {len(missing)} of the {expected} modules the adapter targets have no LoRA in the checkpoint "
            f"({shown}); written with zero factors, so they stay unchanged as in a merge with --allow-partial-lora "
            "and PEFT and vLLM find every module they expect"]


def _module_label(key: str) -> str:
    m = re.match(r"^model\.layers\.(\d+)\.(.+)$", key.removeprefix(PEFT_PREFIX))
    return f"layer {m.group(1)} {m.group(2)}" if m else key.removeprefix(PEFT_PREFIX)


def adapter_config(settings: LoraSettings, adapter: Adapter, base_model: str | None) -> dict:
    """`base_model`: the base model's Hub id, or None: a local path would not exist where the adapter is
    used (and would publish the machine's layout); PEFT loads the adapter onto the model it is given either
    way, only AutoPeftModel needs the id."""
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": settings.r,
        "lora_alpha": settings.alpha,
        "target_modules": adapter.target_modules,
        "lora_dropout": 0.0,
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "layers_to_transform": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "init_lora_weights": True,
        "inference_mode": True,
    }
    if adapter.target_parameters:
        config["target_parameters"] = adapter.target_parameters
    return config


def write_adapter(out_dir: Path, tensors: dict[str, torch.Tensor], config: dict) -> list[str]:
    weights = out_dir / "adapter_model.safetensors"
    save_file(tensors, weights, metadata={"format": "pt"})
    os.chmod(weights, output_file_mode())  # save_file creates 0600; the merged output's files follow the umask
    with (out_dir / "adapter_config.json").open("x") as f:
        f.write(json.dumps(config, indent=2) + "\n")
    return ["adapter_model.safetensors", "adapter_config.json"]
