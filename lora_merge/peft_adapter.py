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

The adapter is planned from the LoRA's headers (every tensor's name, shape and dtype, what is missing, which
experts fuse) before any factor is read, then streamed into one safetensors file a layer at a time: memory
holds one layer's factors (all of a DeepSeek-V3 layer's 256 experts at r=8: ~110 MB), not the adapter (6.6 GB).
The file's tensors are in the order `safetensors.save_file` gives them (dtype, widest first, then name), so
the bytes are those a PEFT `save_pretrained` of the same tensors writes.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator

import torch

from lora_merge.errors import MergeError, UnsupportedInput
from lora_merge.integrity import check_finite, check_records
from lora_merge.lora import DoraDelta, ExpertLoras, LoraSettings, check_factor_shapes, megatron_factors
from lora_merge.model.architectures import Architecture, iter_rules
from lora_merge.model.layout import ExpertSlab, GatedColumn, RowParallel, Rule
from lora_merge.model.model_shape import ModelShape
from lora_merge.readers.checkpoint import Checkpoint, LoraModule
from lora_merge.writers.safetensors_stream import PlannedTensor

PEFT_PREFIX = "base_model.model."
VLLM_DEFAULT_MAX_LORA_RANK = 16
EXPERT_FORMATS = ("per-expert", "fused")
ADAPTER_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
# safetensors.save_file orders a file's tensors by dtype (widest float first), then by name
_FILE_DTYPE_ORDER = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class _Module:
    """One adapted Megatron module; its HF lora_A/lora_B tensors are made together."""

    rule: Rule
    name: str  # Megatron module name
    hf_prefix: str  # "model.layers.{i}." or ""
    factors: LoraModule


@dataclass(frozen=True)
class _FusedExperts:
    """One layer's fused expert parameter: for each expert in order, the per-expert modules whose factors it
    stacks (gate and up, which share A; or down)."""

    owner: str  # key prefix of its lora_A/lora_B
    layer: int
    fused: str
    experts: tuple[tuple[str, ...], ...]


@dataclass(frozen=True)
class _StackedLora:
    """One layer's stacked experts parameter (layout.ExpertSlab: gpt-oss's gate_up_proj, down_proj) as PEFT's
    target_parameters LoRA of it: every expert's Megatron LoRA, lora_A [E·r, in] expert-major and lora_B [out, r·E]
    rank-major, B's rows in the stacked tensor's column order (gate and up interleaved); an expert without LoRA zero
    (--allow-partial-lora)."""

    owner: str  # key prefix of its lora_A/lora_B
    loras: ExpertLoras


@dataclass
class AdapterPlan:
    """The adapter file's tensors, planned from headers (in file order), and how to make them a unit (one
    layer, or the modules outside layers) at a time."""

    tensors: list[PlannedTensor]
    target_modules: list[str]
    target_parameters: list[str]
    warnings: list[str]
    units: dict[str, str]  # tensor name -> its unit
    modules: dict[str, list[_Module]]  # unit -> the Megatron modules read for it
    zeros: dict[str, list[PlannedTensor]]  # unit -> zero factors of modules without LoRA (--allow-partial-lora)
    fused: dict[str, list[_FusedExperts]]  # unit -> fused expert parameters
    stacked: dict[str, list[_StackedLora]]  # unit -> stacked experts parameters (an HF release stacks them)
    shape: ModelShape
    dtype: torch.dtype | None
    where: str
    dora: bool = False  # the modules carry DoRA magnitudes (lora_magnitude_vector; use_dora in the config)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def produce(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) in file order; one unit's tensors are held at a time (a unit met again, as with
        factors of several dtypes, is made again)."""
        unit, made = None, {}
        for planned in self.tensors:
            if self.units[planned.name] != unit or planned.name not in made:
                unit = self.units[planned.name]
                made = {}  # released before the next unit is read
                made = self._make(unit)
            yield planned.name, made.pop(planned.name)

    def _make(self, unit: str) -> dict[str, torch.Tensor]:
        tensors = {}
        for module in self.modules.get(unit, ()):
            check_records(module.factors.refs)
            # (the scale only matters to a merge: the adapter keeps the factors and PEFT its own alpha / r)
            for hf_name, f in megatron_factors(module.rule, module.factors, self.shape, module.name, 1.0).items():
                key = PEFT_PREFIX + module.hf_prefix + hf_name.removesuffix(".weight")
                (b, a), m = ((f.low_rank.b, f.low_rank.a), f.magnitude) if isinstance(f, DoraDelta) else (f, None)
                for name, factor in ((f"{key}.lora_A.weight", a), (f"{key}.lora_B.weight", b),
                                     *(((f"{key}.lora_magnitude_vector", m),) if m is not None else ())):
                    # q/k/v share A: one copy each; grouped experts are transposed views, saved row-major
                    dtype = self.dtype or factor.dtype
                    tensors[name] = factor.to(dtype).clone(memory_format=torch.contiguous_format)
                    check_finite(tensors[name], name, "non-finite values (NaN or Inf) in the LoRA factor"
                                 + ("" if dtype == factor.dtype else f" as {str(dtype).removeprefix('torch.')}"))
        for planned in self.zeros.get(unit, ()):
            tensors[planned.name] = torch.zeros(planned.shape, dtype=planned.dtype)
        for group in self.fused.get(unit, ()):
            tensors.update(_fuse(group, tensors, self.where))
        for group in self.stacked.get(unit, ()):
            check_records(group.loras.refs)
            a_name, b_name = f"{group.owner}.lora_A.weight", f"{group.owner}.lora_B.weight"
            if len(group.loras):
                b, a = group.loras.stacked_factors()
            else:
                planned = {t.name: t for t in self.tensors}
                b, a = (torch.zeros(planned[n].shape, dtype=planned[n].dtype) for n in (b_name, a_name))
            for name, factor in ((a_name, a), (b_name, b)):
                dtype = self.dtype or factor.dtype
                tensors[name] = factor.to(dtype).contiguous()
                check_finite(tensors[name], name, "non-finite values (NaN or Inf) in the LoRA factor")
        return tensors


def plan_adapter(lora: Checkpoint, shape: ModelShape, arch: Architecture, settings: LoraSettings,
                 dtype: torch.dtype | None, expert_format: str = "per-expert", allow_partial: bool = False) -> AdapterPlan:
    where = str(lora.path)
    planned, units, modules, slabs = _plan_factors(lora, shape, arch, settings, dtype)
    zeros, warnings = complete_targets(planned, units, lora, shape, arch, settings.r, allow_partial)
    if any(m.rank is not None for m in lora.lora.values()):
        raise UnsupportedInput(f"{where}: modules trained at ranks of their own (Megatron-Bridge's normalize_moe_lora) "
                               "are not exported yet (PEFT would need rank and alpha patterns per expert); merge it "
                               "instead")
    dora = any(m.magnitude is not None for m in lora.lora.values())
    if dora and (zeros or any(isinstance(r, ExpertSlab) for ms in modules.values() for r in (x.rule for x in ms))
                 or slabs or expert_keys(planned, arch)):
        raise UnsupportedInput(f"{where}: exporting a DoRA whose modules are not all adapted, or on routed experts: "
                               "PEFT's DoRA needs each module's magnitude (a module without LoRA has the norm of its "
                               "base weight, which an export does not read), and transformers holds experts as fused "
                               "parameters, on which PEFT has no DoRA; merge it instead")
    experts = expert_keys(planned, arch)
    fused: dict[str, list[_FusedExperts]] = {}
    modules_targeted, parameters = target_modules(planned), []
    if experts and expert_format == "fused":
        fused, modules_targeted, parameters = plan_fused_experts(planned, units, experts, arch, shape, where)
    elif experts:
        peft = arch.config.peft  # what PEFT does with this model type's adapters (its architecture module says)
        if peft.drops_per_expert:
            warnings.append(f"PEFT (0.20 and later) does not convert per-expert {arch.name} adapters onto transformers 5's "
                            "fused experts and drops them without an error; load this adapter with vLLM, or export "
                            "with --expert-format fused for PEFT")
        if peft.remaps_every_mlp_target:
            warnings += unconverted_mlp_warning(planned, experts, arch)
    stacked, stacked_params = _plan_stacked(slabs, planned, units, arch, shape, settings.r, dtype, where)
    order = sorted(planned.values(), key=lambda t: (_FILE_DTYPE_ORDER.index(t.dtype), t.name))
    return AdapterPlan(order, modules_targeted, parameters + stacked_params, warnings, units, modules, zeros, fused,
                       stacked, shape, dtype, where, dora)


def _plan_factors(lora: Checkpoint, shape: ModelShape, arch: Architecture, settings: LoraSettings,
                  dtype: torch.dtype | None):
    """PEFT-named lora_A [r, in] and lora_B [out, r] of every adapted HF projection, in HF layout (experts
    per expert), from the factors' headers; their units; the modules by unit."""
    planned: dict[str, PlannedTensor] = {}
    units: dict[str, str] = {}
    modules: dict[str, list[_Module]] = {}
    remaining = dict(lora.lora)
    slabs: dict[tuple[str, str], dict[int, tuple]] = {}  # (layer prefix, stacked HF name) -> expert -> (rule, LoRA)
    for rule, names, prefix in iter_rules(arch, shape, lora.has):
        module = names[0].removesuffix(".weight")
        if isinstance(rule, ExpertSlab) and names[0].endswith(".weight"):
            factors = remaining.pop(module, None)
            if factors is not None:
                check_factor_shapes(rule, factors, shape, settings.r, module)
            slabs.setdefault((prefix, rule.hf), {})[rule.index] = (replace(rule, megatron=names[0]), factors)
            continue
        if not names[0].endswith(".weight") or module not in remaining:
            continue
        factors = remaining.pop(module)
        check_factor_shapes(rule, factors, shape, settings.r, module)
        if factors.blocks > 1 and len(rule.hf_shapes(shape)) == 1:
            raise UnsupportedInput(f"{lora.path}: {module}: several adapters (Megatron-Bridge's CanonicalLoRA) on what "
                                   f"is one HF tensor in {shape.model_type}: a PEFT adapter has one LoRA per tensor; "
                                   "merge it instead")
        for refs, which in ((factors.a, "lora_A"), (factors.b, "lora_B")):
            if dtype is None and len({ref.dtype for ref in refs}) > 1:  # the file is planned in one dtype each
                raise MergeError(f"{refs[0].where}: the TP shards of {module}.{which} differ in dtype "
                                 f"({', '.join(sorted({str(r.dtype).removeprefix('torch.') for r in refs}))}); "
                                 "expected one (or give --dtype)")
        modules.setdefault(prefix, []).append(_Module(rule, module, prefix, factors))
        for hf_name, (out_dim, in_dim) in rule.hf_shapes(shape).items():
            key = PEFT_PREFIX + prefix + hf_name.removesuffix(".weight")
            for name, dims, ref in ((f"{key}.lora_A.weight", (settings.r, in_dim), factors.a[0]),
                                    (f"{key}.lora_B.weight", (out_dim, settings.r), factors.b[0])):
                planned[name] = PlannedTensor(name, dims, dtype or ref.dtype)
                units[name] = prefix
            if factors.magnitude is not None:  # DoRA: PEFT's magnitude vector of the projection, one per output row
                name = f"{key}.lora_magnitude_vector"
                planned[name] = PlannedTensor(name, (out_dim,), dtype or factors.magnitude.dtype)
                units[name] = prefix
    if remaining:
        raise MergeError(f"{lora.path}: LoRA weights for modules that have no HF counterpart: "
                         f"{', '.join(sorted(remaining)[:3])}")
    return planned, units, modules, slabs


def _plan_stacked(slabs: dict, planned: dict, units: dict, arch: Architecture, shape: ModelShape, r: int,
                  dtype: torch.dtype | None, where: str) -> tuple[dict[str, list[_StackedLora]], list[str]]:
    """The stacked experts parameters the LoRA adapts, planned into `planned`: one LoRA each in every MoE layer (an
    expert or a layer without LoRA zero: PEFT adapts a parameter of every layer's experts); returns them by unit and
    their target_parameters, in the order the experts module registers them (PEFT nests its wrappers so: all but the
    last under `base_layer`)."""
    adapted = [hf for hf in dict.fromkeys(hf for _, hf in slabs)
               if any(m is not None for (_, h), by in slabs.items() if h == hf for _, m in by.values())]
    if not adapted:
        return {}, []
    groups: dict[str, list[_StackedLora]] = {}
    for (prefix, hf), by_expert in slabs.items():
        if hf not in adapted:
            continue
        module, param = hf.rsplit(".", 1)
        owner = f"{PEFT_PREFIX}{prefix}{module}" + ".base_layer" * (len(adapted) - 1 - adapted.index(hf))
        rules, loras = zip(*(by_expert[e] for e in sorted(by_expert)))
        experts, inputs, outputs = rules[0].hf_shapes(shape)[hf]
        known = [m for m in loras if m is not None]  # (none: a layer without it, --allow-partial-lora: zeros)
        factor_dtype = dtype or (known[0].a[0].dtype if known else
                                 next(m.a[0].dtype for by in slabs.values() for _, m in by.values() if m is not None))
        for name, dims in ((f"{owner}.lora_A.weight", (experts * r, inputs)),
                           (f"{owner}.lora_B.weight", (outputs, r * experts))):
            planned[name] = PlannedTensor(name, dims, factor_dtype)
            units[name] = prefix
        groups.setdefault(prefix, []).append(_StackedLora(owner, ExpertLoras(rules, loras)))
    return groups, [f"{arch.config.fused_experts}.{hf.rsplit('.', 1)[1]}" for hf in adapted]


def expert_keys(tensors, arch: Architecture) -> dict[str, tuple[int, int, str]]:
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


def plan_fused_experts(planned: dict[str, PlannedTensor], units: dict[str, str], experts: dict, arch: Architecture,
                       shape: ModelShape, where: str):
    """The per-expert factors planned as one LoRA per fused expert parameter (see the module docstring):
    `planned` and `units` rewritten in place; returns the fused groups by unit, the target modules and the
    target parameters."""
    by_layer: dict[tuple[int, str], dict[int, dict[str, str]]] = {}
    for key, (layer, expert, role) in experts.items():
        if key.endswith(".lora_A.weight"):
            fused = "down_proj" if role == "down" else "gate_up_proj"
            by_layer.setdefault((layer, fused), {}).setdefault(expert, {})[role] = key.removesuffix(".lora_A.weight")
    path, count = arch.config.fused_experts, shape.moe.num_experts
    present = {fused for _, fused in by_layer}
    nested = present == {"gate_up_proj", "down_proj"}
    layers = {layer for layer, _ in by_layer}
    for fused in sorted(present):
        lacking = sorted(layers - {layer for layer, f in by_layer if f == fused})
        if lacking:  # PEFT would expect this parameter's LoRA in every layer's experts
            raise MergeError(f"{where}: layers {lacking[:5]} have no expert LoRA for {fused}, the other MoE layers "
                             "do; a fused adapter adapts it in every layer (use --expert-format per-expert)")
    groups: dict[str, list[_FusedExperts]] = {}
    others = {k: v for k, v in planned.items() if k not in experts}
    for (layer, fused), by_expert in sorted(by_layer.items()):
        absent = sorted(set(range(count)) - set(by_expert))
        if absent:
            raise MergeError(f"{where}: layer {layer}: experts {absent[:5]} have no LoRA for {fused}; a fused adapter "
                             "needs every expert (use --expert-format per-expert)")
        roles = ("down",) if fused == "down_proj" else ("gate", "up")
        members = tuple(tuple(by_expert[e][r] for r in roles) for e in range(count))
        # PEFT wraps the experts module of every layer once per entry of the global target_parameters,
        # gate_up_proj innermost: with both listed, its LoRA lives under `base_layer` in every layer.
        owner = f"{PEFT_PREFIX}model.layers.{layer}.{path}" + (".base_layer" if fused == "gate_up_proj" and nested else "")
        first_a, first_bs = planned[f"{members[0][0]}.lora_A.weight"], [planned[f"{m}.lora_B.weight"] for m in members[0]]
        dtypes = {planned[f"{m}.lora_{ab}.weight"].dtype for ms in members for m in ms for ab in "AB"}
        if len(dtypes) > 1:  # stacked into one tensor of one dtype
            raise MergeError(f"{where}: layer {layer}: the experts' LoRA factors for {fused} differ in dtype "
                             f"({', '.join(sorted(str(d).removeprefix('torch.') for d in dtypes))}); expected one "
                             "(or give --dtype)")
        r, cols = first_a.shape
        unit = units[f"{members[0][0]}.lora_A.weight"]
        for name, dims, dtype in ((f"{owner}.lora_A.weight", (count * r, cols), first_a.dtype),
                                  (f"{owner}.lora_B.weight", (sum(b.shape[0] for b in first_bs), r * count),
                                   first_bs[0].dtype)):
            others[name] = PlannedTensor(name, dims, dtype)
            units[name] = unit
        groups.setdefault(unit, []).append(_FusedExperts(owner, layer, fused, members))
    targeted = {k: v for k, v in planned.items() if k not in experts}
    planned.clear()
    planned.update(others)
    parameters = [f"{path}.{p}" for p in ("gate_up_proj", "down_proj") if p in present]
    modules = target_modules(targeted)
    if arch.config.peft.converts_expert_targets:
        leaves = {name.removesuffix(".weight").rsplit(".", 1)[-1] for rule in arch.layer_rules if rule.per_expert
                  for name in rule.hf_names()}
        parameters += [f"{leaf}.weight" for leaf in modules if leaf in leaves]  # dense MLPs, shared experts
        modules = [leaf for leaf in modules if leaf not in leaves]
    return groups, modules, parameters


def _fuse(group: _FusedExperts, tensors: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    """One layer's per-expert factors (taken out of `tensors`) as the fused parameter's lora_A [E·r, in],
    expert-major, and lora_B [out, r·E], rank-major."""
    a_list, b_list = [], []
    for expert, members in enumerate(group.experts):
        a = tensors.pop(f"{members[0]}.lora_A.weight")
        bs = []
        for member in members:
            if member != members[0] and not torch.equal(tensors.pop(f"{member}.lora_A.weight"), a):
                # Megatron's fc1 LoRA shares one A
                raise MergeError(f"{where}: layer {group.layer} expert {expert}: gate and up LoRA have different A "
                                 "factors; they cannot be one fused LoRA (use --expert-format per-expert)")
            bs.append(tensors.pop(f"{member}.lora_B.weight"))
        a_list.append(a)
        b_list.append(torch.cat(bs, dim=0))  # gate_up_proj holds [gate; up] rows
    a_stack, b_stack = torch.stack(a_list), torch.stack(b_list)  # [E, r, in], [E, out, r]
    return {f"{group.owner}.lora_A.weight": a_stack.reshape(-1, a_stack.shape[-1]).contiguous(),
            f"{group.owner}.lora_B.weight": b_stack.permute(1, 2, 0).reshape(b_stack.shape[1], -1).contiguous()}


def unconverted_mlp_warning(tensors: dict, experts: dict, arch: Architecture) -> list[str]:
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


def target_modules(tensors: dict) -> list[str]:
    """The leaf module names of the lora_A keys of `tensors` (planned or made)."""
    return sorted({key.removesuffix(".lora_A.weight").rsplit(".", 1)[-1] for key in tensors if key.endswith(".lora_A.weight")})


def complete_targets(planned: dict[str, PlannedTensor], units: dict[str, str], lora: Checkpoint, shape: ModelShape,
                     arch: Architecture, r: int, allow_partial: bool) -> tuple[dict[str, list[PlannedTensor]], list[str]]:
    """PEFT adapts every module whose name ends with a target (a shared expert's down_proj makes every
    routed expert's and every dense MLP's down_proj one too), and vLLM packs each expert's three
    projections together; a module without factors loads with fresh ones or not at all. So every such
    module of the model must be in the adapter: missing ones are refused, or with `allow_partial` planned as
    zero factors (added to `planned`), which leave it unchanged exactly as a merge with --allow-partial-lora
    does. Returns the zero factors by unit and the warnings to show."""
    targets = set(target_modules(planned))
    expected, missing = 0, {}
    for rule, _, prefix in iter_rules(arch, shape, lora.has):
        for hf_name in rule.hf_names():
            module = hf_name.removesuffix(".weight")
            if module == hf_name or module.rsplit(".", 1)[-1] not in targets:
                continue
            expected += 1
            key = PEFT_PREFIX + prefix + module
            if f"{key}.lora_A.weight" not in planned:
                missing[key] = (prefix, rule.hf_shapes(shape)[hf_name])
    if not missing:
        return {}, []
    where = str(lora.path)
    shown = ", ".join(_module_label(k) for k in list(missing)[:4]) + (" …" if len(missing) > 4 else "")
    if not allow_partial:
        raise MergeError(f"{where}: no LoRA for {len(missing)} of the {expected} modules the adapter targets "
                         f"({shown}); PEFT and vLLM would load them with missing factors (pass "
                         "--allow-partial-lora to write zero factors for them, which leave them unchanged)")
    zeros: dict[str, list[PlannedTensor]] = {}
    for key, (prefix, (out_dim, in_dim)) in missing.items():
        like = next(t for k, t in planned.items() if k.endswith(f".{key.rsplit('.', 1)[-1]}.lora_A.weight"))
        for name, dims in ((f"{key}.lora_A.weight", (r, in_dim)), (f"{key}.lora_B.weight", (out_dim, r))):
            planned[name] = PlannedTensor(name, dims, like.dtype)
            units[name] = prefix
            zeros.setdefault(prefix, []).append(planned[name])
    return zeros, [f"{where}: {len(missing)} of the {expected} modules the adapter targets have no LoRA in the checkpoint "
                   f"({shown}); written with zero factors, so they stay unchanged as in a merge with --allow-partial-lora "
                   "and PEFT and vLLM find every module they expect"]


def _module_label(key: str) -> str:
    m = re.match(r"^model\.layers\.(\d+)\.(.+)$", key.removeprefix(PEFT_PREFIX))
    return f"layer {m.group(1)} {m.group(2)}" if m else key.removeprefix(PEFT_PREFIX)


def adapter_config(settings: LoraSettings, adapter: AdapterPlan, base_model: str | None) -> dict:
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
        "use_rslora": settings.rslora,
        "use_dora": adapter.dora,
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


def write_config(out_dir: Path, config: dict) -> str:
    with (out_dir / CONFIG_FILE).open("x") as f:
        f.write(json.dumps(config, indent=2) + "\n")
    return CONFIG_FILE
