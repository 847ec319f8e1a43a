"""The merge plan: every output tensor planned from the layout table, every shape checked before any data
is read; `merge_pipeline` then streams it: read pieces → un-shard → apply LoRA → HF names → writer.

A task is one Megatron parameter, from however many pieces (rank files, torch_dist chunks, a singleton
save's weight_w and weight_v), becoming however many HF tensors its rule names."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field, replace

import torch

from lora_merge.model.architectures import Architecture, iter_rules, pick_name
from lora_merge.errors import MergeError
from lora_merge.fp8 import (DEFAULT_CONFIG, SCALE_SUFFIX, not_converted_modules, partial_block_note,
                            quantized_by_default_unless_excluded, scale_shape, skip_patterns)
from lora_merge.model.layout import (AsStored, ExpertSlab, RowBlock, Rule, SharedCopy, Skip, StackedExperts, check_shards,
                                     single)
from lora_merge.lora import ExpertLoras, LoraSettings, check_factor_shapes
from lora_merge.model.model_shape import ModelShape
from lora_merge.model.mtp import args_mtp_layers, in_mtp_layer
from lora_merge.readers.checkpoint import Checkpoint, LoraModule, Pieces, release_pages
from lora_merge.mxfp4 import BLOCK as MXFP4_BLOCK, BLOCKS_SUFFIX, DEFAULT_CONFIG as MXFP4_CONFIG, SCALES_SUFFIX, is_mxfp4_config
from lora_merge.readers.hf_model import Fp8Ref, Mxfp4Ref
from lora_merge.value_checks import shown_value
from lora_merge.readers.source import Source
from lora_merge.writers.safetensors_stream import PlannedTensor
from lora_merge.shown import shown


@dataclass
class Task:
    """One Megatron parameter and the HF tensors it becomes."""

    rule: Rule
    megatron: str
    hf_prefix: str
    pieces: Pieces
    outputs: list[PlannedTensor]
    lora: LoraModule | None = None  # a Megatron LoRA module's factors (brought to HF layout by the rule)
    delta: dict | None = None  # or factors already in HF layout, by HF name (a PEFT adapter's, with their scale)
    # the rows of its one output this task writes, where tasks beside it write the others (layout.ExpertSlab: one
    # expert of a stacked tensor, the tasks of every expert one after another); None: all of them
    rows: tuple[int, int] | None = None

    @property
    def lora_module(self) -> str:
        return self.megatron.removesuffix(".weight")

    @property
    def opens_outputs(self) -> bool:
        """Whether its outputs start here (false for the tasks that write a stacked tensor's later rows)."""
        return self.rows is None or self.rows[0] == 0

    @property
    def closes_outputs(self) -> bool:
        """Whether its outputs are complete once it is done."""
        return self.rows is None or self.rows[1] == self.outputs[0].shape[0]

    @property
    def source(self) -> str:
        """The Megatron parameter(s) it reads, in words (an expert of a stacked tensor: every expert's)."""
        if self.rows is not None:
            e = self.rows[0]
        elif isinstance(getattr(self.rule, "rule", self.rule), StackedExperts):  # an HF base's: every expert's LoRA
            e = 0
        else:
            return self.megatron
        return self.megatron.replace(f".experts.{e}.", f".experts.{{0..{self.outputs[0].shape[0] - 1}}}.")


@dataclass
class MergePlan:
    shape: ModelShape
    dtype: torch.dtype
    settings: LoraSettings | None
    tasks: list[Task] = field(default_factory=list)
    skipped: Counter = field(default_factory=Counter)
    replicas: list = field(default_factory=list)  # (first, other) copies to compare while merging
    config_changes: dict = field(default_factory=dict)  # config.json values the output must say differently
    notes: list = field(default_factory=list)  # what the user should know about the output (warnings)
    quantized: dict = field(default_factory=dict)  # HF name -> FP8 block size, for an FP8 output (--dtype fp8)
    pow2_scales: bool = False  # the FP8 output's scales are powers of two (its quantization_config: scale_fmt ue8m0)
    mxfp4: dict = field(default_factory=dict)  # HF name -> its [E, in, out] shape, written as MXFP4 (--dtype mxfp4)

    @property
    def tensors(self) -> list[PlannedTensor]:
        return planned_outputs(self.tasks)

    @property
    def merged_modules(self) -> int:
        own = [task for task in self.tasks if not isinstance(getattr(task.rule, "rule", task.rule), SharedCopy)]
        return sum(len(task.lora) if isinstance(task.lora, ExpertLoras) else task.lora is not None for task in own) \
            + sum(len(task.delta or ()) for task in own)


def planned_outputs(tasks) -> list[PlannedTensor]:
    """The output tensors of these tasks, each once (a stacked tensor's experts are several tasks)."""
    return [t for task in tasks if task.opens_outputs for t in task.outputs]


def _preview(names) -> str:
    names = sorted(names)
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


HF = "HF"  # the Pieces group of an HF base's tensors: already in HF layout


@dataclass(frozen=True)
class HfTensors:
    """A rule whose HF tensors come from an HF base as they are: nothing to un-shard, but a tensor stored in pieces
    (`split`, as Pieces.split: a DCP's rows per rank) taken piece by piece. Everything else (the LoRA factors
    brought to HF layout, shapes, dtype) is the rule's own."""

    rule: Rule
    split: tuple = ()

    def __getattr__(self, name):
        return getattr(self.rule, name)

    def hf_blocks(self, tensors, shape, where, global_pieces=False):
        out, i = {}, 0
        for n, name in enumerate(self.rule.hf_shapes(shape)):
            count, dim = self.split[n] if self.split else (1, None)
            parts, i = tensors[i:i + count], i + count
            out[name] = single(parts[0]) if count == 1 else \
                [RowBlock((p,)) for p in parts] if dim == 0 else [RowBlock(tuple(parts))]
        return out


def build_plan(base: Source, lora: Source | None, shape: ModelShape, arch: Architecture,
               settings: LoraSettings | None, dtype: torch.dtype) -> MergePlan:
    """The one plan builder, for every pair of inputs: each parameter of the architecture's table, its weights
    from the base (a Megatron checkpoint's shards, un-sharded by the rule; an HF model's tensors as they are),
    merged with the LoRA's change to it (a Megatron LoRA module, brought to HF layout by the rule; a PEFT
    adapter's factors by HF name, each with its own scale, and its trained biases). Every tensor of either
    input is planned, counted as skipped on purpose, or an error."""
    plan = MergePlan(shape=shape, dtype=dtype, settings=settings)
    _account_for_inputs(plan, base, lora, arch, shape)
    megatron_lora = lora if lora is not None and not lora.hf_named else None
    peft = lora if lora is not None and lora.hf_named else None
    unclaimed = set(base.tensors if base.hf_named else base.params)
    adapters = dict(megatron_lora.lora) if megatron_lora is not None else {}
    factors, biases = (dict(peft.factors), dict(peft.biases)) if peft is not None else ({}, {})
    taken: dict[str, LoraModule] = {}  # Megatron LoRA modules merged, for the copies of shared parameters
    # which of two Megatron namings (MindSpeed's fused MLA projections) the parameters have: the base's, or
    # on an HF base the Megatron LoRA's
    namer = megatron_lora if base.hf_named else base
    for rule, names, hf_prefix in iter_rules(arch, shape, namer.has if namer is not None else None):
        expert_loras = None
        if isinstance(rule, ExpertSlab) and base.hf_named:  # the base stores every expert in one tensor: one task
            if rule.index:
                continue
            rule = rule.whole()
            expert_loras = _expert_loras(rule, hf_prefix, names[0], adapters, shape, settings)
        if isinstance(rule, Skip):
            if not base.hf_named:
                _skip(plan, base, rule, names, unclaimed, shape)
            continue
        if isinstance(rule, SharedCopy) and base.hf_named and hf_prefix + rule.hf not in base.tensors:
            continue  # a release whose MTP layer stores no copy of the shared tensor (GLM-4.6): none is written
        if base.hf_named:
            pieces = _hf_pieces(base, rule, hf_prefix, shape, unclaimed, biases)
            megatron, task_rule = names[0], HfTensors(rule, pieces.split)
        else:
            megatron, task_rule = pick_name(names, base.params, base.path), rule
            if megatron is None:
                raise MergeError(f"{base.path}: missing {names[0]}, which a {shape.model_type} model with this "
                                 "config needs")
            unclaimed.discard(megatron)
            pieces = fitted_pieces(base, megatron, rule)
            check_shards(pieces.shapes, rule.parallel, rule.global_shape(shape, pieces.shapes),
                         f"{megatron} ({pieces[0].where})")
        task = Task(rule=task_rule, megatron=megatron, hf_prefix=hf_prefix, pieces=pieces,
                    outputs=[PlannedTensor(hf_prefix + name, dims, rule.keep_dtype or dtype)
                             for name, dims in rule.hf_shapes(shape).items()],
                    rows=(rule.index, rule.index + 1) if isinstance(rule, ExpertSlab) else None)
        if megatron_lora is not None and megatron_lora is not base and megatron_lora.params:
            _check_own_base(plan, rule, names, task, shape, base, megatron_lora)
        if megatron.endswith(".weight") and task.lora_module in adapters:
            task.lora = taken[task.lora_module] = adapters.pop(task.lora_module)
            check_factor_shapes(rule, task.lora, shape, settings.r, task.lora_module)
        task.lora = expert_loras or task.lora
        if isinstance(rule, SharedCopy):  # the shared parameter's merge, made again under the copy's name
            task.lora = taken.get(task.lora_module)
            main = next((t.delta[rule.copy_of] for t in plan.tasks if t.delta and rule.copy_of in t.delta), None)
            task.delta = {rule.hf: main} if main is not None else None
        elif peft is not None:
            task.delta = _peft_delta(rule, hf_prefix, shape, factors) or None
        plan.tasks.append(task)
    if base.hf_named and shape.tied and TIED_HEAD in unclaimed:
        _skip_tied_head(plan, base, unclaimed)
    unclaimed -= keep_mtp_layers(plan, base if base.hf_named else None, unclaimed)
    unclaimed -= carry_towers(plan, base, unclaimed, factors, biases)
    copies = [t for t in plan.tasks if isinstance(t.rule, SharedCopy) or isinstance(getattr(t.rule, "rule", None), SharedCopy)]
    for task in copies:
        if task.lora or task.delta:
            plan.notes.append(f"{task.outputs[0].name}, the multi-token-prediction layer's copy of "
                              f"{getattr(task.rule, 'rule', task.rule).copy_of}, carries the LoRA's change to it (the "
                              "model has one such tensor)")
    if lora is not None and shape.mtp_in_source and not any(
            (t.lora or t.delta) and in_mtp_layer(t.megatron, shape.num_layers) for t in plan.tasks if t not in copies):
        plan.notes.append(f"the LoRA does not adapt the multi-token-prediction layer(s) "
                          f"{shape.mtp_label}: written from the base as they are")
    if unclaimed:
        raise MergeError(f"{base.path}: {'tensors' if base.hf_named else 'parameters'} this {shape.model_type} layout "
                         f"does not know: {_preview(unclaimed)}")
    if adapters:
        raise MergeError(f"{lora.path}: LoRA weights for modules the tool cannot merge: {_preview(adapters)}")
    if factors or biases:
        names = list(dict.fromkeys(list(factors) + list(biases)))
        tied = (" (its lm_head is the embedding: tie_word_embeddings is true, so a change to lm_head alone has no "
                "tensor of its own to go to)" if shape.tied and any(n.startswith("lm_head.") for n in names) else "")
        raise MergeError(f"{lora.path}: adapts tensors this {shape.model_type} model does not have: "
                         f"{_preview(names)}{tied}")
    return plan


def _expert_loras(rule: StackedExperts, hf_prefix: str, name: str, adapters: dict, shape: ModelShape,
                  settings: LoraSettings | None) -> ExpertLoras | None:
    """A Megatron LoRA's modules of every expert of a stacked tensor that an HF base holds whole, or None."""
    layer = name[:len(name) - len(rule.slab.megatron)]  # decoder.layers.{i}.
    rules = tuple(rule.expert_rules(shape.moe.num_experts))
    modules = tuple(adapters.pop(layer + r.megatron.removesuffix(".weight"), None) if r.megatron.endswith(".weight")
                    else None for r in rules)
    for r, m in zip(rules, modules):
        if m is not None:
            check_factor_shapes(r, m, shape, settings.r, layer + r.megatron.removesuffix(".weight"))
    return ExpertLoras(tuple(replace(r, megatron=layer + r.megatron) for r in rules), modules) \
        if any(m is not None for m in modules) else None


TIED_HEAD, TIED_EMBEDDING = "lm_head.weight", "model.embed_tokens.weight"


def _skip_tied_head(plan: MergePlan, base: Source, unclaimed: set) -> None:
    """An HF base of a tied model that saves the output layer too (an FSDP state dict has both names of the one
    parameter): it must be the embedding's copy, and is not written (the config ties them)."""
    head, embedding = base.tensors[TIED_HEAD], base.tensors.get(TIED_EMBEDDING)
    if embedding is None or head.shape != embedding.shape:
        raise MergeError(f"{head.where}: {TIED_HEAD} in a model whose config ties it to {TIED_EMBEDDING}, which the "
                         "base " + ("lacks" if embedding is None else f"has in another shape {list(embedding.shape)}"))
    rows = head.shape[0]
    step = max(1, COMPARE_BYTES // max(1, head.nbytes // max(rows, 1)))
    for start in range(0, rows, step):  # every row (one differing row is another model), a block at a time
        a, b = _ref_rows(head, start, start + step), _ref_rows(embedding, start, start + step)
        common = a.dtype if a.dtype.itemsize >= b.dtype.itemsize else b.dtype
        differ = (a.to(common) != b.to(common)).reshape(a.shape[0], -1).any(dim=1)
        if differ.any():
            raise MergeError(f"{head.where}: {TIED_HEAD} differs from {TIED_EMBEDDING} (row "
                             f"{start + int(differ.nonzero()[0])}), but the config ties them (tie_word_embeddings): the "
                             "model trained them apart; give the config it was trained with")
    unclaimed.discard(TIED_HEAD)
    plan.skipped["copy of the tied embedding"] += 1


COMPARE_BYTES = 8 << 20  # rows of two tensors compared at a time


def _ref_rows(ref, start: int, stop: int) -> torch.Tensor:
    """Rows of a base tensor, a copy; the mapped pages they came from released."""
    rows = getattr(ref, "rows", None)  # a tensor stored in pieces (readers/dcp_hf.PiecedRef): from the pieces
    if rows is not None:
        return rows(start, stop)
    block = single(ref.load())[0]
    out = block.take(start, stop).clone()
    if ref.mapped:
        for part in block.parts:
            release_pages(part[start:stop])
    return out


def _account_for_inputs(plan: MergePlan, base: Source, lora: Source | None, arch: Architecture,
                        shape: ModelShape) -> None:
    """What the inputs skipped on their own, the copies to compare while merging, and a Megatron LoRA
    checkpoint's own base weights (counted as skipped: --base is used; any that are no base weight of this
    model are an error)."""
    plan.skipped.update(base.skipped)
    plan.replicas = list(base.replicas)
    if lora is None or lora is base:
        return
    plan.skipped.update(lora.skipped)
    if lora.hf_named:
        return
    plan.replicas += lora.replicas
    if lora.params:
        known = {name for _, names, _ in iter_rules(arch, shape, lora.has) for name in names}
        strays = set(lora.params) - known
        if strays:
            raise MergeError(f"{lora.path}: holds tensors that are neither LoRA weights nor base weights of this "
                             f"{shape.model_type} model: {_preview(strays)}")
        plan.skipped["base weights in the LoRA checkpoint (--base is used instead)"] += len(lora.params)
    if not base.hf_named and base.lora:
        plan.skipped["LoRA modules in the --base checkpoint (--lora is used instead)"] += len(base.lora)


def _skip(plan: MergePlan, base: Source, rule: Skip, names, unclaimed: set, shape: ModelShape) -> None:
    """A Megatron parameter deliberately not written (a tied copy, checked to be one; rotary buffers)."""
    megatron = pick_name(names, base.params, base.path)
    if megatron is not None:
        # with MTP, Megatron-Core ties the output to the embedding itself and never syncs the last stage's
        # output_layer (shared_embedding_or_output_weight): an unused tensor, not a copy to compare
        if rule.same_as and not shape.mtp_in_source:
            check_copy(base.params[megatron], base.params.get(rule.same_as), megatron, rule.same_as)
        unclaimed.discard(megatron)
        plan.skipped[rule.reason] += 1


def _hf_pieces(base: Source, rule: Rule, hf_prefix: str, shape: ModelShape, unclaimed: set, biases: dict) -> Pieces:
    """The rule's HF tensors from an HF base as they are (a PEFT adapter's trained bias in place of the base's)."""
    refs, split = [], []
    for name, dims in rule.hf_shapes(shape).items():
        full = hf_prefix + name
        ref = biases.pop(full, None) or base.tensors.get(full)
        if ref is None:
            raise MergeError(f"{base.path}: missing {full}, which a {shape.model_type} model with this config has")
        if tuple(ref.shape) != tuple(dims):
            raise MergeError(f"{ref.where}: shape {list(ref.shape)}, the config implies {list(dims)}")
        unclaimed.discard(full)
        pieces = getattr(ref, "pieces", ())
        if pieces and ref.dim in (0, 1):  # stored in pieces (a DCP's rows per rank): taken as they are
            refs += pieces
            split.append((len(pieces), ref.dim))
        else:
            refs.append(ref)
            split.append((1, None))
    return Pieces(tuple(refs), HF, split=tuple(split) if any(n > 1 for n, _ in split) else ())


def _peft_delta(rule: Rule, hf_prefix: str, shape: ModelShape, factors: dict) -> dict:
    """A PEFT adapter's factors of the rule's HF tensors, by name within the rule."""
    delta = {}
    for name, dims in rule.hf_shapes(shape).items():
        full = hf_prefix + name
        if full in factors:
            f = factors.pop(full)
            got = (f.b.shape[0], f.a.shape[1]) if not f.experts else (f.experts, f.a.shape[1], f.b.shape[0]) if \
                f.in_out else (f.experts, f.b.shape[0], f.a.shape[1])
            if got != tuple(dims):
                raise MergeError(f"{f.a.where}: LoRA factors of {full} give [{f.b.shape[0]}, {f.a.shape[1]}], "
                                 f"the weight is {list(dims)}")
            delta[name] = f
    return delta


def _check_own_base(plan: MergePlan, rule: Rule, names, task: Task, shape: ModelShape, base: Source,
                    lora: Source) -> None:
    """An unfiltered Megatron LoRA checkpoint carries the base it was trained on: this base must be it. Split
    alike, every byte is compared while merging (plan.replicas), else sampled rows here."""
    if isinstance(rule, StackedExperts):
        _check_own_stacked_base(rule, names[0], task, shape, base, lora)
        return
    theirs_name = pick_name(names, lora.params, lora.path)
    if theirs_name is None:
        return
    theirs = fitted_pieces(lora, theirs_name, rule)
    check_same_base(rule, theirs_name, task.pieces, theirs, shape, base, lora)
    if not base.hf_named and theirs_name == task.megatron and \
            [(r.shape, r.dtype) for r in task.pieces] == [(r.shape, r.dtype) for r in theirs]:
        plan.replicas += [(mine, copy, f"{lora.path}: its own base weights differ from --base {base.path} "
                           f"({task.megatron}); give the base it was trained on, or omit --base")
                          for mine, copy in zip(task.pieces, theirs)]


def _check_own_stacked_base(rule: StackedExperts, name: str, task: Task, shape: ModelShape, base: Source,
                            lora: Source) -> None:
    """The same for a stacked experts tensor of an HF base: the first, middle and last experts' own base
    parameters of the LoRA checkpoint against their rows of it."""
    layer, experts = name[:len(name) - len(rule.slab.megatron)], shape.moe.num_experts
    stacked = task.rule.hf_blocks([r.load() for r in task.pieces], shape, name)[rule.hf]  # (MXFP4: dequantized)
    for e in sorted({0, experts // 2, experts - 1}):
        expert = rule.slab.for_expert(e)
        theirs_name = layer + expert.megatron
        if theirs_name not in lora.params:
            continue
        theirs = fitted_pieces(lora, theirs_name, expert)
        row = expert.hf_blocks([r.load() for r in theirs], shape, theirs_name, theirs.is_global)[expert.hf][0].take(0, 1)
        mine = _row(stacked, e)
        common = mine.dtype if mine.dtype.itemsize <= row.dtype.itemsize else row.dtype
        if mine.shape != row.shape or not torch.equal(mine.to(common), row.to(common)):
            raise MergeError(f"{lora.path}: its own base weights differ from --base {base.path} ({theirs_name}): the "
                             "LoRA was trained on another base; give the base it was trained on, or omit --base to use "
                             "the LoRA checkpoint's own")
        for ref in theirs.refs:
            ref.release()


def keep_mtp_layers(plan: MergePlan, base: Source | None, names) -> set[str]:
    """The multi-token-prediction layers of an HF base whose layout no rule table carries (a family without
    `mtp_rules`: Qwen3-Next's mtp.*): no LoRA of this tool's inputs adapts them, so they are written as they are
    stored. Where the source has none (here or carried), the output config says so, so that no loader looks for
    weights it lacks."""
    shape = plan.shape
    if shape.mtp_in_source:  # carried by the layout rules
        return set()
    # (a family storing them under a prefix of their own may ship them without counting them: Qwen3-Next)
    prefixes = (shape.mtp_prefix,) if shape.mtp_prefix else shape.mtp_prefixes
    if not prefixes:
        return set()
    kept = {name for name in names if name.startswith(prefixes)} if base is not None else set()
    for name in sorted(kept):
        ref = base.tensors[name]
        rule = AsStored(name, (), hf=name, size=tuple(ref.shape), keep_dtype=ref.dtype)
        plan.tasks.append(Task(rule=HfTensors(rule), megatron=name, hf_prefix="", pieces=Pieces((ref,), HF),
                               outputs=[PlannedTensor(name, tuple(ref.shape), ref.dtype)]))
    if kept:
        plan.notes.append(f"copied the {len(kept)} tensors of the multi-token-prediction layer(s) "
                          f"{shape.mtp_label} from the base as they are (not trained by the LoRA)")
    elif shape.mtp_layers:
        plan.config_changes[shape.mtp_key] = 0
        plan.notes.append(f"the source has no multi-token-prediction layers: the output's config.json says "
                          f"{shape.mtp_key}=0 instead of {shape.mtp_layers} (use an HF base that has them to keep "
                          "them)")
    return kept


def carry_towers(plan: MergePlan, base: Source, names, factors: dict, biases: dict) -> set[str]:
    """A multimodal release's towers (vision encoder, projector: model/multimodal.py), which no architecture rule
    writes: each tensor as stored (in the output's dtype, as the language model), a linear's weight merged with a
    PEFT adapter's change to it (its bias replaced by a trained one)."""
    renamed = getattr(base, "names", None)
    carried = sorted(set(names) & renamed.carried) if renamed is not None else []
    for name in carried:
        ref = biases.pop(name, None) or base.tensors[name]
        rule = AsStored(name, (), hf=name, size=tuple(ref.shape),
                        keep_dtype=None if ref.dtype.is_floating_point else ref.dtype)
        task = Task(rule=HfTensors(rule), megatron=name, hf_prefix="", pieces=Pieces((ref,), HF),
                    outputs=[PlannedTensor(name, tuple(ref.shape), rule.keep_dtype or plan.dtype)])
        task.delta = _peft_delta(rule, "", plan.shape, factors) or None
        plan.tasks.append(task)
    if carried:
        towers = sorted({name.split(".")[0] for name in carried})
        plan.notes.append(f"carried the {len(carried)} tensors of the {renamed.kind.model_type} release's "
                          f"{', '.join(towers)} as they are stored"
                          + (f", {sum(t.delta is not None for t in plan.tasks[-len(carried):])} of them merged with "
                             "the adapter's change" if any(t.delta for t in plan.tasks[-len(carried):]) else ""))
    return set(carried)


def fitted_pieces(ckpt: Checkpoint, name: str, rule: Rule) -> Pieces:
    """The pieces of parameter `name` as `rule` can use them (see `Pieces.fitted`)."""
    return ckpt.params[name].fitted(rule.split_dim)


def check_same_base(rule: Rule, name: str, base_refs: Pieces, lora_refs: Pieces, shape: ModelShape,
                    base: Checkpoint, lora: Checkpoint) -> None:
    """An unfiltered LoRA checkpoint carries the base it was trained on; a --base with other weights would
    give a model nobody trained. The first, middle and last rows of every HF tensor are compared in HF
    layout, so the two may be split over different TP sizes."""
    differ = MergeError(f"{lora.path}: its own base weights differ from --base {base.path} ({name}): the LoRA was "
                        "trained on another base; give the base it was trained on, or omit --base to use the LoRA "
                        "checkpoint's own")
    try:
        check_shards(lora_refs.shapes, rule.parallel, rule.global_shape(shape, lora_refs.shapes),
                     f"{name} ({lora_refs[0].where})")
    except MergeError as exc:
        raise differ from exc
    mine = (HfTensors(rule, base_refs.split) if base_refs.group == HF else rule).hf_blocks(
        [r.load() for r in base_refs], shape, name, base_refs.is_global)
    theirs = rule.hf_blocks([r.load() for r in lora_refs], shape, name, lora_refs.is_global)
    for hf_name, blocks in mine.items():
        rows = sum(b.rows for b in blocks)
        for i in sorted({0, rows // 2, rows - 1}):
            a, b = _row(blocks, i), _row(theirs[hf_name], i)
            common = a.dtype if a.dtype.itemsize <= b.dtype.itemsize else b.dtype
            if a.shape != b.shape or not torch.equal(a.to(common), b.to(common)):
                raise differ
    for ref in base_refs.refs + lora_refs.refs:
        ref.release()


def _row(blocks, i: int) -> torch.Tensor:
    for block in blocks:
        if i < block.rows:
            return block.take(i, i + 1)
        i -= block.rows
    raise IndexError(i)


def check_copy(copy, original, name: str, original_name: str,
               why: str = "the embeddings are not tied as the HF config says") -> None:
    """A tensor skipped as a copy of another must look like one (same shards, same first and last rows)."""
    if original is None or copy.shapes != original.shapes:
        raise MergeError(f"{copy[0].where}: {name} should be a copy of {original_name}, but their shapes differ")
    for mine, theirs in zip(copy, original):
        a, b = mine.load(), theirs.load()
        if not (torch.equal(a[:1], b[:1]) and torch.equal(a[-1:], b[-1:])):
            raise MergeError(f"{mine.where}: {name} differs from {original_name}; {why}")


def check_lora_targets(lora: Checkpoint, arch: Architecture, shape: ModelShape, allow_partial: bool = False) -> None:
    """PEFT adapts every module whose name ends with a target, so every such linear of the table (each
    layer, each routed expert, the shared expert) must have its factors, or the checkpoint lost some on
    the way."""
    if not lora.lora:
        raise MergeError(f"{lora.path}: no LoRA weights (no *.lora_A.*/*.lora_B.* keys) in this checkpoint")
    found = {module.rsplit(".", 1)[-1] for module in lora.lora}
    listed = getattr(lora.args, "lora_target_modules", None) or []
    if not isinstance(listed, (list, tuple)) or not all(isinstance(t, str) for t in listed):
        raise MergeError(f"{lora.path}: args.lora_target_modules={shown_value(listed)}; expected a list of module "
                         "names (linear_qkv, linear_proj, ...)")
    targets = list(listed) or sorted(found)
    for target in targets:
        if not isinstance(target, str):
            raise MergeError(f"{lora.path}: args.lora_target_modules lists {shown(target)}; expected module names")
        if target not in found:
            raise MergeError(f"{lora.path}: args.lora_target_modules lists {shown_value(target)} but the checkpoint has no "
                             f"LoRA weights for it")
    # (the MTP layers of a base that has them are adapted only where the LoRA's run built them)
    trained = replace(shape, mtp_in_source=shape.mtp_in_source and args_mtp_layers(lora.args) > 0)
    modules = (names[0].removesuffix(".weight") for rule, names, _ in iter_rules(arch, trained, lora.has)
               if not isinstance(rule, (Skip, SharedCopy)) and names[0].endswith(".weight"))
    expected = [m for m in modules if m.rsplit(".", 1)[-1] in targets]
    missing = [m for m in expected if m not in lora.lora]
    if missing and not allow_partial:
        listed = ", ".join(_module_label(m) for m in missing[:4]) + (" …" if len(missing) > 4 else "")
        raise MergeError(f"{lora.path}: LoRA weights missing for {len(missing)} of {len(expected)} adapted modules "
                         f"({listed}); the checkpoint looks incomplete (pass --allow-partial-lora if that is intended)")


def _module_label(module: str) -> str:
    m = LAYER_MODULE.match(module)
    return f"layer {m.group(1)} {m.group(2)}" if m else module


LAYER_MODULE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def plan_fp8_output(plan: MergePlan, base, reference_config: dict | None = None) -> dict:
    """Turn the plan into an FP8 release's layout: the weights the FP8 base had quantized (from an unquantized
    base: the attention and MLP/expert linears, as DeepSeek's and Qwen's releases quantize, less the modules the
    reference's modules_to_not_convert excludes, matched as transformers matches it) become float8_e4m3fn, each
    followed by its weight_scale_inv; everything else keeps the plan's dtype. Returns the quantization_config
    the output's config.json carries: the base's, else the reference's, else DeepSeek's, with
    modules_to_not_convert (and ignored_layers, where it had one) naming every module of the output whose 2-D
    weight is not FP8, and lm_head, so that every loader makes FP8 exactly the modules that are. A note
    (plan.notes) names the FP8 weights transformers' CPU loader would refuse or misread (partial blocks)."""
    fp8 = base.fp8
    config = dict(fp8.config) if fp8 is not None else dict(reference_config or DEFAULT_CONFIG)
    block = tuple(config["weight_block_size"])
    plan.pow2_scales = config.get("scale_fmt") == "ue8m0"
    weights = [(t.name, tuple(t.shape)) for t in plan.tensors if len(t.shape) == 2 and t.name.endswith(".weight")]
    if fp8 is not None:  # exactly what the base quantized
        chosen = {name for name, ref in base.tensors.items() if isinstance(ref, Fp8Ref)}
    else:
        chosen = quantized_by_default_unless_excluded(weights, skip_patterns(config))
    config["modules_to_not_convert"] = not_converted_modules(weights, chosen, base.path)
    if "ignored_layers" in config:  # vLLM reads it before modules_to_not_convert
        config["ignored_layers"] = list(config["modules_to_not_convert"])
    for task in plan.tasks:
        outputs = []
        for t in task.outputs:
            if t.name in chosen:
                outputs.append(PlannedTensor(t.name, t.shape, torch.float8_e4m3fn))
                outputs.append(PlannedTensor(t.name + SCALE_SUFFIX, scale_shape(t.shape, block), torch.float32))
                plan.quantized[t.name] = block
            else:
                outputs.append(t)
        task.outputs = outputs
    note = partial_block_note([(name, shape) for name, shape in weights if name in chosen], block)
    if note is not None:
        plan.notes.append(note)
    return config


STACKED_EXPERTS = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)$")


def plan_mxfp4_output(plan: MergePlan, base, base_config: dict | None = None) -> dict:
    """Turn the plan into gpt-oss's MXFP4 release layout: each stacked experts parameter the base stores as MXFP4
    (from an unquantized base: every mlp.experts.gate_up_proj and down_proj, as the release quantizes) becomes
    NAME_blocks and NAME_scales (plan.mxfp4); everything else keeps the plan's dtype. Returns the
    quantization_config the output's config.json carries: the base's, else the release's."""
    if plan.shape.model_type != "gpt_oss":
        raise MergeError(f"--dtype mxfp4 writes gpt-oss's MXFP4 release form; {plan.shape.model_type} has no MXFP4 "
                         "release (write bfloat16, float32, or fp8)")
    stored = {name for name, ref in base.tensors.items() if isinstance(ref, Mxfp4Ref)} \
        if getattr(base, "mxfp4", False) else None
    for task in plan.tasks:
        outputs = []
        for t in task.outputs:
            chosen = t.name in stored if stored is not None else \
                bool(STACKED_EXPERTS.search(t.name)) and len(t.shape) == 3
            if not chosen:
                outputs.append(t)
                continue
            experts, inputs, out = t.shape
            if inputs % MXFP4_BLOCK:
                raise MergeError(f"--dtype mxfp4: {t.name} {list(t.shape)} has {inputs} inputs, not a multiple of "
                                 f"{MXFP4_BLOCK} (MXFP4 scales each {MXFP4_BLOCK} inputs of an output)")
            groups = inputs // MXFP4_BLOCK
            outputs.append(PlannedTensor(t.name + BLOCKS_SUFFIX, (experts, out, groups, MXFP4_BLOCK // 2), torch.uint8))
            outputs.append(PlannedTensor(t.name + SCALES_SUFFIX, (experts, out, groups), torch.uint8))
            plan.mxfp4[t.name] = tuple(t.shape)
        task.outputs = outputs
    return dict(base_config) if is_mxfp4_config(base_config) else dict(MXFP4_CONFIG)
