"""Megatron-Bridge checkpoints: a torch_dist save whose configuration is `iter_N/run_config.yaml` (Bridge's
ConfigContainer) instead of Megatron-LM args, and whose LoRA is Bridge's own adapter module.

The tensors are Megatron-Core's (the torch_dist reader reads them); this module answers what differs:
- the args: `model:` holds every TransformerConfig field (a newer builder config nests them under
  `model.transformer:`) plus the GPT provider's. Megatron-LM fills TransformerConfig from its args by field name,
  so a field named like an arg means the same; the Megatron-LM names that differ are derived (`swiglu`,
  `untie_embeddings_and_output_weights`, `norm_epsilon`, `num_experts`, `group_query_attention`,
  `use_rope_scaling`, `rotary_seq_len_interpolation_factor`, `apply_layernorm_1p`, the uneven pipeline's
  `decoder_first/last_pipeline_num_layers`, the vocabulary's padded or unpadded size). `peft:` gives r (`dim`),
  `alpha` and the targets. Callables and dtypes are `{_target_: …, _call_: false}` mappings (or short names).
- the LoRA names: `<linear>.adapter.linear_in.weight` is A [r, in] and `<linear>.adapter.linear_out.weight` is
  B [out, r], global tensors in Megatron's TP=1 layout (fc1's B as [all gate; all up], qkv's interleaved), as the
  base's; they are read as PEFT's lora_A / lora_B. Bridge scales by alpha / dim (no rsLoRA).
- CanonicalLoRA's per-projection adapters (`CanonicalParts`) and DoRA's magnitudes (`DoraMagnitudes`).
- `normalize_moe_lora`: routed experts' adapters of rank dim / moe_router_topk, scaled by alpha over that rank
  (`normalized_expert_ranks`).
Refused by name: VLMLoRA, multi-LoRA, shared-outer expert LoRA and CanonicalLoRA on experts (their saved layout is
not confirmed).
docs/formats.md records the layout and where it was read.
"""

from __future__ import annotations

import re
from argparse import Namespace
from pathlib import Path

import torch

from lora_merge.errors import MergeError, UnsupportedInput
from lora_merge.files.small_files import read_bytes
from lora_merge.shown import shown
from lora_merge.value_checks import positive_int

RUN_CONFIG = "run_config.yaml"
LORA = "megatron.bridge.peft.lora.LoRA"
# Bridge's other PEFT methods, by the class path run_config.yaml names them with
CANONICAL_LORA = "megatron.bridge.peft.canonical_lora.CanonicalLoRA"
DORA = "megatron.bridge.peft.dora.DoRA"
OTHER_PEFT = {"lora.VLMLoRA": "VLMLoRA", "multi_lora": "multi-LoRA"}
ADAPTER_A, ADAPTER_B = ".adapter.linear_in.weight", ".adapter.linear_out.weight"
MAGNITUDE = ".adapter.weight_magnitude"  # DoRA's magnitude [out], read under the name DORA_MAGNITUDE
DORA_MAGNITUDE = ".dora_magnitude"
# CanonicalLoRA: one adapter per HF projection of the fused linear_qkv and linear_fc1
CANONICAL_KEY = re.compile(r"^(.+\.(linear_qkv|linear_fc1))\.adapter\.adapter_(q|k|v|gate|up)\.linear_(in|out)\.weight$")
SLOTS = {"linear_qkv": ("q", "k", "v"), "linear_fc1": ("gate", "up")}
# Experts' adapters, saved under the experts' global axis like their weights whatever the implementation:
# SequentialMLP's one adapter per expert; TEGroupedMLP's one adapter shared by all experts (its grads summed over
# EP) repeated along the axis by Bridge's _apply_expert_axis_factory, or its per-expert GroupedExpertLinearAdapter
# ([E_local, r, in] / [E_local, out, r]); TEGroupedMLP's sharded state dict renames its children to SequentialMLP's
# keys (`mlp.experts.experts.linear_fc1.…`). An older save of the shared one has no expert axis (2-D).
SEQUENTIAL_EXPERT_ADAPTER = re.compile(r"\.mlp\.experts\.experts\.linear_fc[12]\.adapter\."
                                       r"(linear_(in|out)\.weight|weight_magnitude)$")
SILU = ("torch.nn.functional.silu", "silu")  # the callable's path, or the builder config's short name
# sizes this tool computes with (layouts, the swiglu factory's order): checked to be sizes before anything uses them
SIZES = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
         "tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
         "expert_model_parallel_size", "expert_tensor_parallel_size", "num_moe_experts", "moe_ffn_hidden_size",
         "moe_router_topk")
DTYPES = {"torch.float32": "float32", "torch.bfloat16": "bfloat16", "torch.float16": "float16"}


def is_bridge_iteration(it_dir: Path) -> bool:
    # any entry of that name (a directory, a FIFO, a broken link too): reading it says what is wrong with it
    return (it_dir / RUN_CONFIG).exists() or (it_dir / RUN_CONFIG).is_symlink()


def read_run_config(it_dir: Path) -> dict:
    import yaml

    path = it_dir / RUN_CONFIG
    text = read_bytes(path, RUN_CONFIG, expected="Megatron-Bridge's run configuration (YAML)")
    try:
        config = yaml.safe_load(text)  # Bridge writes it with yaml.safe_dump: plain mappings, no tags
    except yaml.YAMLError as exc:
        raise MergeError(f"{path}: unreadable YAML ({type(exc).__name__}: {str(exc).splitlines()[0]})") from None
    except RecursionError:
        raise MergeError(f"{path}: YAML nested too deeply to be a run configuration") from None
    if not isinstance(config, dict) or not isinstance(config.get("model"), dict):
        raise MergeError(f"{path}: no 'model' mapping; expected Megatron-Bridge's run configuration "
                         "(ConfigContainer with model:, peft:, checkpoint:)")
    return config


def bridge_args(it_dir: Path) -> Namespace:
    """The Megatron-LM args a Bridge run's configuration amounts to (see the module's docstring)."""
    config = read_run_config(it_dir)
    where = str(it_dir / RUN_CONFIG)
    model = dict(config["model"])
    nested = model.pop("transformer", None)
    if isinstance(nested, dict):  # the builder-backed GPT config keeps TransformerConfig's fields apart
        model = {**nested, **model}
    for name in REQUIRED:
        if model.get(name) is None:
            raise MergeError(f"{where}: no model.{name}; expected Megatron-Bridge's model configuration")
    for name in SIZES:
        if model.get(name) is not None:
            model[name] = positive_int(model[name], f"model.{name}", where)
    args = {k: v for k, v in model.items() if _plain(v) and not k.startswith("_")}
    activation = _target(model.get("activation_func"))
    if model.get("gated_linear_unit") is not None:
        args["swiglu"] = bool(model["gated_linear_unit"]) and activation in SILU
    for ours, theirs in RENAMED:
        if model.get(theirs) is not None:
            args[ours] = model[theirs]
    if model.get("share_embeddings_and_output_weights") is not None:
        args["untie_embeddings_and_output_weights"] = not model["share_embeddings_and_output_weights"]
    args["group_query_attention"] = model.get("num_query_groups") is not None
    dtype = DTYPES.get(_target(model.get("params_dtype")))
    if dtype is not None:
        args["params_dtype"] = getattr(torch, dtype)
        if "bf16" not in args and "fp16" not in args:
            args["bf16"], args["fp16"] = dtype == "bfloat16", dtype == "float16"
    # the provider pads vocab_size itself where should_pad_vocab says so; else it is the embedding's rows
    vocab = args.pop("vocab_size", None)
    if vocab is not None:
        args["vocab_size" if model.get("should_pad_vocab") else "padded_vocab_size"] = vocab
    args.update(_lora_args(config.get("peft"), where))
    args["bridge_run_config"] = where
    # the HF model the run was imported from (the provider's field, or the builder config's checkpoint metadata)
    metadata = model.get("extra_checkpoint_metadata")
    recorded = model.get("hf_model_id") or (metadata.get("hf_model_id") if isinstance(metadata, dict) else None)
    args["hf_model_id"] = recorded if isinstance(recorded, str) else None
    return Namespace(**args)


REQUIRED = ("num_layers", "hidden_size", "num_attention_heads")
# (Megatron-LM's arg, the TransformerConfig / GPT provider field it is filled from)
RENAMED = (("norm_epsilon", "layernorm_epsilon"), ("num_experts", "num_moe_experts"),
           ("use_rope_scaling", "rope_scaling"), ("rotary_seq_len_interpolation_factor", "seq_len_interpolation_factor"),
           ("apply_layernorm_1p", "layernorm_zero_centered_gamma"),
           ("decoder_first_pipeline_num_layers", "num_layers_in_first_pipeline_stage"),
           ("decoder_last_pipeline_num_layers", "num_layers_in_last_pipeline_stage"))


def _target(value) -> str | None:
    """What a callable or dtype entry names: `{_target_: name, _call_: false}`, or the name itself; None for
    anything else (never turned into text: a YAML alias bomb would expand)."""
    value = value.get("_target_") if isinstance(value, dict) else value
    return value if isinstance(value, str) else None


def _plain(value) -> bool:
    """A scalar or a list of scalars: a value Megatron-LM's args could hold as it is."""
    if isinstance(value, (list, tuple)):
        return all(v is None or isinstance(v, (bool, int, float, str)) for v in value)
    return value is None or isinstance(value, (bool, int, float, str))


def _lora_args(peft, where: str) -> dict:
    if peft is None:
        return {}
    if not isinstance(peft, dict):
        raise MergeError(f"{where}: peft={shown(peft)}; expected a mapping (Megatron-Bridge's PEFT config)")
    target = _target(peft) or ""
    if target not in (LORA, CANONICAL_LORA, DORA):
        for suffix, what in OTHER_PEFT.items():
            if suffix in target:
                raise UnsupportedInput(f"{where}: peft is Megatron-Bridge's {what}, which is not read yet; only its "
                                       "LoRA, CanonicalLoRA and DoRA are")
        raise UnsupportedInput(f"{where}: peft._target_={shown(target)}: not Megatron-Bridge's LoRA ({LORA})")
    if peft.get("experts_shared_outer_loras"):
        raise UnsupportedInput(f"{where}: peft.experts_shared_outer_loras (A of fc1 and B of fc2 shared by all "
                               "experts) is not read yet")
    targets = peft.get("target_modules") or []
    excluded = peft.get("exclude_modules") or []
    for field, value in (("target_modules", targets), ("exclude_modules", excluded)):
        if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
            raise MergeError(f"{where}: peft.{field}={shown(value)}; expected a list of module names")
    # a wildcard (`*.layers.0.*.linear_qkv`) adapts some layers only: its last part names the module kind;
    # CanonicalLoRA's linear_q/_k/_v and linear_fc1_gate/_up are parts of linear_qkv and linear_fc1
    kinds = sorted({CANONICAL_TARGETS.get(k, k) for k in (t.rsplit(".", 1)[-1] for t in targets)})
    return {"lora_r": peft.get("dim"), "lora_alpha": peft.get("alpha"),
            "lora_target_modules": [] if excluded or any("*" in t for t in targets) else kinds,
            "bridge_lora_patterns": targets or None, "bridge_canonical_lora": target == CANONICAL_LORA,
            "bridge_dora": target == DORA, "bridge_normalize_moe_lora": bool(peft.get("normalize_moe_lora"))}


CANONICAL_TARGETS = {"linear_q": "linear_qkv", "linear_k": "linear_qkv", "linear_v": "linear_qkv",
                     "linear_fc1_gate": "linear_fc1", "linear_fc1_up": "linear_fc1"}


def shared_adapter_experts(args, where: str) -> int:
    """How many experts an older save's shared adapter (2-D, no expert axis) is given to: all of them, where one
    adapter is what was trained. Before Bridge synced it over expert parallelism (cdca256, 2026-06), each EP rank
    trained its own and only EP rank 0's was saved: at EP > 1 the others are lost."""
    experts = getattr(args, "num_experts", None)
    if not experts:
        raise MergeError(f"{where}: an adapter shared by the experts, but run_config.yaml gives no num_moe_experts")
    ep = getattr(args, "expert_model_parallel_size", None) or 1
    if ep > 1:
        raise UnsupportedInput(f"{where}: an older Megatron-Bridge save of the adapter grouped experts share (2-D, no "
                               f"expert axis) at EP={ep}: each expert-parallel rank trained its own and only rank 0's "
                               "was saved; no single model to merge")
    return experts


def lora_name(name: str, where: str, canonical: bool = False, dora: bool = False) -> str:
    """A Bridge adapter entry under PEFT's names (lora_A / lora_B of the adapter 'default'); others unchanged (a
    CanonicalLoRA's per-projection entries too, for `CanonicalParts`, where the run's config says CanonicalLoRA)."""
    if CANONICAL_KEY.match(name):
        if ".experts." in name and ".shared_experts." not in name:
            raise UnsupportedInput(f"{where}: Megatron-Bridge CanonicalLoRA on routed experts (separate gate and up "
                                   "adapters per expert) is not read yet")
        if not canonical:
            raise UnsupportedInput(f"{where}: a CanonicalLoRA adapter entry, but run_config.yaml's peft is not "
                                   "CanonicalLoRA: the configuration does not belong to these tensors")
        return name
    if ".adapter." in name and ".experts." in name and ".shared_experts." not in name \
            and not SEQUENTIAL_EXPERT_ADAPTER.search(name):
        raise UnsupportedInput(f"{where}: {shown(name)}: a Megatron-Bridge expert adapter under a name not read (read: "
                               "mlp.experts.experts.linear_fc1/linear_fc2.adapter.linear_in/linear_out.weight with "
                               "the experts' axis, as saved without singleton_local_shards)")
    if name.endswith(MAGNITUDE):
        if not dora:
            raise UnsupportedInput(f"{where}: a DoRA magnitude (adapter.weight_magnitude), but run_config.yaml's peft "
                                   "is not DoRA: the configuration does not belong to these tensors")
        return name[: -len(MAGNITUDE)] + DORA_MAGNITUDE
    if name.endswith(ADAPTER_A):
        return name[: -len(ADAPTER_A)] + ".lora_A.default.weight"
    if name.endswith(ADAPTER_B):
        return name[: -len(ADAPTER_B)] + ".lora_B.default.weight"
    if ".adapter." in name:
        raise UnsupportedInput(f"{where}: {shown(name)}: a Megatron-Bridge adapter entry of no kind this tool reads")
    return name


class AdapterParts:
    """What a Bridge LoRA holds beyond lora_A / lora_B, by the PEFT method run_config.yaml names: CanonicalLoRA's
    per-projection adapters, DoRA's magnitudes, normalize_moe_lora's expert ranks. The torch_dist reader hands it
    every entry (`lora_name`, `take`) and the checkpoint once read (`finish`)."""

    def __init__(self, args, where: str):
        self.args, self.where = args, where
        self.canonical = CanonicalParts(args, where) if getattr(args, "bridge_canonical_lora", False) else None
        self.dora = DoraMagnitudes(args, where) if getattr(args, "bridge_dora", False) else None

    def lora_name(self, name: str, where: str) -> str:
        return lora_name(name, where, self.canonical is not None, self.dora is not None)

    def take(self, name: str, refs: list, dim: int | None) -> bool:
        return any(part.take(name, refs, dim) for part in (self.canonical, self.dora) if part is not None)

    def finish(self, ckpt) -> None:
        for part in (self.canonical, self.dora):
            if part is not None:
                part.finish(ckpt)
        if getattr(self.args, "bridge_normalize_moe_lora", False):
            normalized_expert_ranks(ckpt, self.args, self.where)


class CanonicalParts:
    """CanonicalLoRA's adapters of one fused linear (q, k, v of linear_qkv; gate, up of linear_fc1), each of rank r
    and its own rows, fused into one LoRA module of rank k·r whose B holds each adapter's rows in its own column
    block (zero elsewhere): B·A is the sum of the adapters' changes, laid out as the fused linear's rows
    (Megatron's group-interleaved qkv, fc1's [gate; up]). `LoraModule.row_block` says which adapter owns which row,
    so each HF projection takes back its own adapter's factors (`lora.hf_factors`).

    Saved at TP > 1, a gate or up adapter's B (a column-parallel linear on a gated fc1, which Bridge saves through
    megatron-core's swiglu factory) is in the factory's order: each rank's rows cut in halves, all ranks' first
    halves, then all their second halves; it is put back in row order with the TP of the run."""

    def __init__(self, args, where: str):
        self.args, self.where = args, where
        self.parts: dict[str, dict[str, dict[str, object]]] = {}  # module -> slot -> "in"/"out" -> TensorRef

    def take(self, name: str, refs: list, dim: int | None) -> bool:
        """Take a CanonicalLoRA entry: its saved pieces (`refs`, cut along `dim`), kept apart until `finish`."""
        m = CANONICAL_KEY.match(name)
        if not m:
            return False
        slot = self.parts.setdefault(m.group(1), {}).setdefault(m.group(3), {})
        if m.group(4) in slot:
            raise MergeError(f"{refs[0].where}: {name} stored twice")
        slot[m.group(4)] = (refs, dim)
        return True

    def finish(self, ckpt) -> None:
        from lora_merge.readers.checkpoint import GLOBAL, LoraModule, Pieces, joined_ref

        for module, slots in sorted(self.parts.items()):
            if module in ckpt.lora:
                raise MergeError(f"{self.where}: {module} has both a LoRA adapter and CanonicalLoRA's per-projection "
                                 "adapters")
            kind = module.rsplit(".", 1)[1]
            present = [s for s in SLOTS[kind] if s in slots]
            for s in present:
                if set(slots[s]) != {"in", "out"}:
                    have = next(iter(slots[s]))
                    raise MergeError(f"{self.where}: {module}.adapter.adapter_{s} has linear_{have} but not "
                                     f"linear_{'out' if have == 'in' else 'in'}")
            if kind == "linear_fc1":
                for s in present:
                    self._check_factory_pieces(module, s, *slots[s]["out"])
            a_refs = [joined_ref(*slots[s]["in"]) for s in present]
            b_refs = [joined_ref(*slots[s]["out"]) for s in present]
            self._check_factors(module, present, a_refs, b_refs)
            r = a_refs[0].shape[0]
            row_block, spans = self._layout(kind, present, b_refs, module)
            rows, cols = len(row_block), r * len(present)

            def fill(b_refs=b_refs, spans=spans, rows=rows, cols=cols, r=r, present=present):
                out = torch.zeros(rows, cols, dtype=b_refs[0].dtype)
                for i, ref in enumerate(b_refs):
                    b = ref.load()
                    for dst, src, n in spans[present[i]]:
                        out[dst:dst + n, i * r:(i + 1) * r] = b[src:src + n]
                return out

            a = _ref(f"{a_refs[0].where} (+{len(a_refs) - 1} CanonicalLoRA adapters)", (cols, a_refs[0].shape[1]),
                     a_refs[0].dtype, lambda a_refs=a_refs: torch.cat([x.load() for x in a_refs]), a_refs)
            b = _ref(f"{b_refs[0].where} (+{len(b_refs) - 1} CanonicalLoRA adapters)", (rows, cols), b_refs[0].dtype,
                     fill, b_refs)
            ckpt.lora[module] = LoraModule(a=Pieces((a,), GLOBAL), b=Pieces((b,), GLOBAL), row_block=row_block)

    def _check_factors(self, module: str, present: list[str], a_refs: list, b_refs: list) -> None:
        """One rank, one input size and one dtype for the adapters of a linear: they become one module."""
        r, fan_in, dtype = a_refs[0].shape[0] if len(a_refs[0].shape) == 2 else None, a_refs[0].shape[-1], \
            a_refs[0].dtype
        for s, a, b in zip(present, a_refs, b_refs):
            what = f"{module}.adapter.adapter_{s}"
            if len(a.shape) != 2 or len(b.shape) != 2:
                raise MergeError(f"{a.where}: {what} has linear_in {list(a.shape)} and linear_out {list(b.shape)}; "
                                 "expected matrices")
            if a.shape[0] != r or b.shape[1] != r or a.shape[1] != fan_in:
                raise MergeError(f"{a.where}: {what} has linear_in {list(a.shape)} and linear_out {list(b.shape)}; "
                                 f"the adapters of {module} must share one rank ({r}) and input size ({fan_in})")
            if a.dtype != dtype or b.dtype != dtype:
                raise MergeError(f"{a.where}: {what} is stored in {str(a.dtype).removeprefix('torch.')} / "
                                 f"{str(b.dtype).removeprefix('torch.')}, the other adapters of {module} in "
                                 f"{str(dtype).removeprefix('torch.')}; expected one dtype")

    def _check_factory_pieces(self, module: str, slot: str, refs: list, dim: int | None) -> None:
        """A gate or up adapter's B is saved through the swiglu factory: 2·TP pieces of ffn / (2·TP) rows, which
        the metadata shows whatever run_config.yaml says; the rows are put back with that TP, so the two must agree."""
        tp = getattr(self.args, "tensor_model_parallel_size", None) or 1
        rows = sum(r.shape[0] for r in refs) if dim == 0 else refs[0].shape[0]
        sizes = [r.shape[0] for r in refs] if dim == 0 else [rows]
        if len(sizes) != 2 * tp or len(set(sizes)) != 1:
            raise MergeError(f"{refs[0].where}: {module}.adapter.adapter_{slot}'s B is saved in {len(sizes)} pieces "
                             f"of {sorted(set(sizes))} rows, but run_config.yaml says TP={tp}, whose swiglu factory "
                             f"saves {2 * tp} pieces of {rows // (2 * tp) if rows % (2 * tp) == 0 else '?'}: the "
                             "configuration does not belong to these tensors")

    def _layout(self, kind: str, present: list[str], b_refs: list, module: str):
        """(the adapter each row of the fused linear belongs to, each adapter's (row in the linear, row in its B,
        count) spans)."""
        args, where = self.args, b_refs[0].where
        if kind == "linear_qkv":
            heads = getattr(args, "num_attention_heads", None)
            groups = getattr(args, "num_query_groups", None) or heads
            d = getattr(args, "kv_channels", None) or (args.hidden_size // heads if heads else None)
            if not heads or not d or heads % groups:
                raise MergeError(f"{where}: run_config.yaml gives num_attention_heads={shown(heads)}, "
                                 f"num_query_groups={shown(groups)}, kv_channels={shown(d)}; CanonicalLoRA's q/k/v "
                                 "adapters cannot be laid out without them")
            per = heads // groups
            size = {"q": per * d, "k": d, "v": d}  # rows of each adapter in one query group
            offset = {"q": 0, "k": per * d, "v": (per + 1) * d}
            rows = groups * (per + 2) * d
            spans = {s: [(g * (per + 2) * d + offset[s], g * size[s], size[s]) for g in range(groups)] for s in present}
            expected = {s: groups * size[s] for s in present}
        else:
            ffn = b_refs[0].shape[0]
            rows = 2 * ffn
            tp = getattr(args, "tensor_model_parallel_size", None) or 1
            half = ffn // (2 * tp)
            # the swiglu factory's order: rank t's first half at t·half, its second half at ffn/2 + t·half
            order = [(t * 2 * half + j * half, j * (ffn // 2) + t * half, half) for t in range(tp) for j in (0, 1)]
            spans = {s: [((0 if s == "gate" else ffn) + dst, src, n) for dst, src, n in order] for s in present}
            expected = {s: ffn for s in present}
        for s, ref in zip(present, b_refs):
            if ref.shape[0] != expected[s]:
                raise MergeError(f"{ref.where}: {module}.adapter.adapter_{s}'s B has {ref.shape[0]} rows; the model "
                                 f"(run_config.yaml) gives it {expected[s]}")
        row_block = torch.full((rows,), -1, dtype=torch.int8)
        for i, s in enumerate(present):
            for dst, _, n in spans[s]:
                row_block[dst:dst + n] = i
        return row_block, spans


def _ref(where, shape, dtype, loader, parts):
    from lora_merge.readers.checkpoint import TensorRef

    return TensorRef(where=where, shape=tuple(shape), dtype=dtype, loader=loader,
                     records=lambda: tuple(rec for p in parts for rec in p.records()),
                     spans=lambda: tuple(span for p in parts for span in p.byte_spans()))


class DoraMagnitudes:
    """Megatron-Bridge DoRA's `weight_magnitude` [out] of each adapted linear, put beside its factors
    (`LoraModule.magnitude`): the merge is PEFT's DoRA, m / ‖W + s·B·A‖ · (W + s·B·A), the norm per output row.

    Saved TP-sharded on a column-parallel linear (not through the swiglu factory: fc1's is each rank's gate rows then
    its up rows, rank after rank) and replicated on a row-parallel one. What has no single merged model is refused:
    a row-parallel linear at TP > 1 (each rank normalizes its own columns, and keeps a magnitude of its own that
    only rank 0 saves), an expert's at TP > 1 (Bridge's DoRA adapter on an expert is not an expert-parallel one),
    and linear_qkv with a bias (Bridge scales the bias with the weight: that bias change is not read yet)."""

    COLUMN, ROW = ("linear_qkv", "linear_fc1"), ("linear_proj", "linear_fc2")

    def __init__(self, args, where: str):
        self.args, self.where = args, where
        self.found: dict[str, object] = {}

    def take(self, name: str, refs: list, dim: int | None) -> bool:
        if not name.endswith(DORA_MAGNITUDE):
            return False
        module = name[: -len(DORA_MAGNITUDE)]
        if module in self.found:
            raise MergeError(f"{refs[0].where}: {module}'s DoRA magnitude stored twice")
        self.found[module] = (refs, dim)
        return True

    def finish(self, ckpt) -> None:
        args = self.args
        tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
        for module in ckpt.lora:
            if module not in self.found:
                raise MergeError(f"{self.where}: {module} has LoRA factors but no DoRA magnitude "
                                 "(adapter.weight_magnitude), and run_config.yaml's peft is DoRA")
        from lora_merge.readers.checkpoint import joined_ref

        for module, (refs, dim) in sorted(self.found.items()):
            ref = joined_ref(refs, dim)
            lora = ckpt.lora.get(module)
            if lora is None:
                raise MergeError(f"{ref.where}: a DoRA magnitude for {module}, which has no LoRA factors")
            kind = module.rsplit(".", 1)[1]
            if kind not in self.COLUMN + self.ROW:
                raise UnsupportedInput(f"{ref.where}: Megatron-Bridge DoRA on {kind} is not read (only on linear_qkv, "
                                       "linear_proj, linear_fc1, linear_fc2)")
            if kind in self.ROW and tp > 1:
                raise UnsupportedInput(f"{ref.where}: Megatron-Bridge DoRA on the row-parallel {kind} saved at TP={tp}: "
                                       "each rank normalized its own columns with a magnitude of its own, and only "
                                       "rank 0's was saved; no single model to merge")
            if ".mlp.experts." in module and tp > 1:
                raise UnsupportedInput(f"{ref.where}: Megatron-Bridge DoRA on experts saved at TP={tp} (its adapter on "
                                       "an expert is split over TP, not expert TP); not read")
            if kind == "linear_qkv" and (getattr(args, "add_qkv_bias", False) or getattr(args, "add_bias_linear", False)):
                raise UnsupportedInput(f"{ref.where}: Megatron-Bridge DoRA on linear_qkv with a qkv bias (Bridge scales "
                                       "the bias with the weight's magnitude) is not read yet")
            rows = lora.b[0].shape[0] if len(lora.b) == 1 else sum(r.shape[0] for r in lora.b)
            if tuple(ref.shape) != (rows,):
                raise MergeError(f"{ref.where}: DoRA magnitude of shape {list(ref.shape)}; {module} has {rows} rows")
            # its rank order is read with run_config.yaml's TP: the pieces saved must show the same
            pieces = len(refs) if dim == 0 else 1
            if kind in self.COLUMN and pieces != tp:
                raise MergeError(f"{ref.where}: {module}'s DoRA magnitude is saved in {pieces} piece(s), but "
                                 f"run_config.yaml says TP={tp}, which saves {tp}: the configuration does not belong "
                                 "to these tensors")
            lora.magnitude = ref
            lora.magnitude_tp = tp if kind in self.COLUMN else 1


def normalized_expert_ranks(ckpt, args, where: str) -> None:
    """Bridge's `normalize_moe_lora`: each routed expert's adapter has rank dim // moe_router_topk (fc1's rounded up to
    a multiple of expert TP, which splits its A's rows), the rest dim; each is scaled by alpha over its own rank.
    The expert modules get that rank (`LoraModule.rank`) and their scale's ratio to the run's (`scale_factor`)."""
    dim, topk = getattr(args, "lora_r", None), getattr(args, "moe_router_topk", None)
    etp = getattr(args, "expert_tensor_parallel_size", None) or getattr(args, "tensor_model_parallel_size", 1) or 1
    for module, lora in ckpt.lora.items():
        if ".mlp.experts." not in module:  # (shared experts are not routed: Bridge keeps dim there)
            continue
        if not isinstance(dim, int) or not isinstance(topk, int) or dim % topk:  # Bridge's own check, on experts
            raise MergeError(f"{where}: peft.normalize_moe_lora with dim={shown(dim)} and moe_router_topk="
                             f"{shown(topk)}; Bridge needs dim divisible by moe_router_topk")
        rank = dim // topk
        if module.endswith("linear_fc1") and rank % etp:  # Bridge's align_expert_dim_for_tp
            rank = -(-rank // etp) * etp
        if lora.a[0].shape[0] != rank:
            raise MergeError(f"{lora.a[0].where}: {module} has LoRA rank {lora.a[0].shape[0]}; with normalize_moe_lora "
                             f"(dim {dim}, topk {topk}, expert TP {etp}) Bridge gives it {rank}")
        lora.rank, lora.scale_factor = rank, dim / rank
