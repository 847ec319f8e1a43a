"""The merge itself: plan every output tensor from the layout table (checking every shape before any
data is read), then stream: read shards → un-shard → apply LoRA → HF names → writer."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from lora_merge.architectures import HF_LAYER, MEGATRON_LAYER, Architecture
from lora_merge.errors import MergeError
from lora_merge.layout import Rule, Skip, check_shards
from lora_merge.lora import LoraSettings, check_factor_shapes, hf_factors, merge_weight
from lora_merge.model_shape import ModelShape
from lora_merge.readers.checkpoint import Checkpoint, LoraModule, TensorRef
from lora_merge.writers.safetensors_stream import PlannedTensor


@dataclass
class Task:
    """One Megatron parameter and the HF tensors it becomes."""

    rule: Rule
    megatron: str
    hf_prefix: str
    shards: list[TensorRef]
    outputs: list[PlannedTensor]
    lora: LoraModule | None = None

    @property
    def lora_module(self) -> str:
        return self.megatron.removesuffix(".weight")


@dataclass
class MergePlan:
    shape: ModelShape
    dtype: torch.dtype
    settings: LoraSettings | None
    tasks: list[Task] = field(default_factory=list)
    skipped: Counter = field(default_factory=Counter)

    @property
    def tensors(self) -> list[PlannedTensor]:
        return [t for task in self.tasks for t in task.outputs]

    @property
    def merged_modules(self) -> int:
        return sum(task.lora is not None for task in self.tasks)


def _preview(names) -> str:
    names = sorted(names)
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def iter_rules(arch: Architecture, shape: ModelShape):
    """(rule, full Megatron name, HF name prefix) for every parameter of the model, in output order."""
    for rule in arch.active(arch.before_layers, shape):
        yield rule, rule.megatron, ""
    for i in range(shape.num_layers):
        for rule in arch.active(arch.layer_rules, shape):
            yield rule, MEGATRON_LAYER.format(i=i) + rule.megatron, HF_LAYER.format(i=i)
    for rule in arch.active(arch.after_layers, shape):
        yield rule, rule.megatron, ""


def build_plan(base: Checkpoint, lora: Checkpoint | None, shape: ModelShape, arch: Architecture,
               settings: LoraSettings | None, dtype: torch.dtype) -> MergePlan:
    plan = MergePlan(shape=shape, dtype=dtype, settings=settings)
    plan.skipped.update(base.skipped)
    unclaimed = set(base.params)
    adapters = dict(lora.lora) if lora else {}
    if lora is not None and lora is not base:
        plan.skipped.update(lora.skipped)
        if lora.params:
            plan.skipped["base weights in the LoRA checkpoint (--base is used instead)"] += len(lora.params)

    def add(rule: Rule, megatron: str, hf_prefix: str) -> None:
        if isinstance(rule, Skip):
            if megatron in unclaimed:
                unclaimed.discard(megatron)
                plan.skipped[rule.reason] += 1
            return
        if megatron not in base.params:
            raise MergeError(f"{base.path}: missing {megatron}, which a {shape.model_type} model with this "
                             "config needs")
        unclaimed.discard(megatron)
        shards = base.params[megatron]
        check_shards([s.shape for s in shards], rule.parallel, rule.global_shape(shape, [s.shape for s in shards]),
                     f"{megatron} ({shards[0].where})")
        task = Task(rule=rule, megatron=megatron, hf_prefix=hf_prefix, shards=shards,
                    outputs=[PlannedTensor(hf_prefix + name, dims, dtype) for name, dims in rule.hf_shapes(shape).items()])
        if megatron.endswith(".weight") and task.lora_module in adapters:
            task.lora = adapters.pop(task.lora_module)
            check_factor_shapes(rule, task.lora, shape, settings.r, task.lora_module)
        plan.tasks.append(task)

    for rule, megatron, hf_prefix in iter_rules(arch, shape):
        add(rule, megatron, hf_prefix)

    if unclaimed:
        raise MergeError(f"{base.path}: parameters this {shape.model_type} layout does not know: {_preview(unclaimed)}")
    if adapters:
        raise MergeError(f"{lora.path}: LoRA weights for modules the tool cannot merge: {_preview(adapters)}")
    return plan


def check_lora_targets(lora: Checkpoint) -> None:
    """Every target the training run named must have adapters, or the checkpoint lost some on the way."""
    if not lora.lora:
        raise MergeError(f"{lora.path}: no LoRA weights (no *.lora_A.*/*.lora_B.* keys) in this checkpoint")
    targets = getattr(lora.args, "lora_target_modules", None) or []
    for target in targets:
        if not any(module.endswith("." + target) for module in lora.lora):
            raise MergeError(f"{lora.path}: args.lora_target_modules lists {target!r} but the checkpoint has no "
                             f"LoRA weights for it")


def execute(plan: MergePlan, write, progress=None) -> None:
    """Run the plan, handing each finished HF tensor to `write(name, tensor)` in plan order."""
    shape, dtype = plan.shape, plan.dtype
    for task in plan.tasks:
        where = f"{task.megatron} ({task.shards[0].where})"
        tensors = task.rule.to_hf([ref.load() for ref in task.shards], shape, where)
        if task.lora is not None:
            for name, (b, a) in hf_factors(task.rule, task.lora, shape, task.lora_module).items():
                tensors[name] = merge_weight(tensors[name], b, a, plan.settings.scale, dtype, task.hf_prefix + name)
        for planned in task.outputs:
            tensor = tensors[planned.name[len(task.hf_prefix):]].to(dtype)
            write(planned.name, tensor)
            if progress is not None:
                progress(planned.nbytes)
