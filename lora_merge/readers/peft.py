"""A PEFT LoRA adapter directory as `--lora` (`adapter_config.json` + `adapter_model.safetensors`, or
`adapter_model.bin` read weights-only): factors by the HF tensor they adapt, each with its own scale.

Honoured as PEFT computes them: `r` and `lora_alpha`, `rank_pattern`/`alpha_pattern` (PEFT's own key
matching), `use_rslora` (alpha/sqrt(r)), biases trained with `bias: "all"`/`"lora_only"` (they replace the
base's), `layers_to_transform`/`target_modules` (the saved keys say which modules were adapted).
`fan_in_fan_out` only applies to Conv1D layers; PEFT turns it off for Linear, as every layer here is.

LoRA on parameters (`target_parameters`, PEFT's `lora.ParamWrapper`), as PEFT writes MoE adapters for
transformers 5, which keeps a layer's routed experts as two 3-D parameters `mlp.experts.gate_up_proj`
[E, 2F, H] (rows [gate; up]) and `mlp.experts.down_proj` [E, H, F]. PEFT gives such a parameter
lora_A [E·r, in] (expert-major: rows e·r…e·r+r-1 are expert e's A) and lora_B [out, r·E] (rank-major:
column j·E + e is expert e's B column j), and merges ΔW[e] = scale·B_e·A_e, scale alpha/r (or alpha/√r)
with r and alpha of the parameter's own name ("model.layers.1.mlp.experts.gate_up_proj", so PEFT's own
conversion of gate_proj/up_proj targets at rank 2r and alpha 2α is honoured). The factors become per-expert
factors of the HF checkpoint's per-expert tensors (gate rows, up rows, down), merged as any other. Several
targeted parameters of one module are nested wrappers, the first registered innermost: with both expert
parameters targeted, gate_up_proj's factors are saved under `mlp.experts.base_layer.` and down_proj's under
`mlp.experts.`. A 2-D parameter (the router's `mlp.gate.weight`) is a plain rank-r LoRA of that matrix.
Every parameter target_parameters selects must have its factors, and every factor a parameter it selects.

DoRA (`use_dora`, a `lora_magnitude_vector` per module) is read beside the factors (lora.DoraDelta merges it).
Several adapters of one base become one source (`combine`): their factors side by side along r, each B scaled
by its adapter's weight and scale.

Refused with one line: other PEFT types, `modules_to_save`, LoRA on embeddings, DoRA on parameters.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lora_merge.model.multimodal import MULTIMODAL, Multimodal, rename
from lora_merge.errors import MergeError, UnsupportedInput
from lora_merge.readers.checkpoint import TensorRef, require_float
from lora_merge.readers.safetensors_file import shown_name, tensor_refs
from lora_merge.files.safe_load import load_pt
from lora_merge.value_checks import MAX_ALPHA, MAX_RANK, finite_number, is_int, lora_scale, positive_int, shown_value
from lora_merge.files.small_files import read_text

CONFIG = "adapter_config.json"
PREFIX = "base_model.model."
KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")
# an embedding layer's whole weight, saved beside its factors (PEFT's save_embedding_layers)
SAVED_EMBEDDING = re.compile(r"^(?:.+\.)?(?:lm_head|embed_tokens)(?:\.base_layer)?\.weight$")
# DoRA's magnitude vector (PEFT ≥ 0.9): saved as MODULE.lora_magnitude_vector (an older form had .weight after it)
MAGNITUDE = re.compile(r"^(?P<module>.+)\.lora_magnitude_vector(?:\.weight)?$")


def is_peft_adapter_dir(path: Path) -> bool:
    return (Path(path) / CONFIG).is_file()


@dataclass(frozen=True)
class Factors:
    b: TensorRef
    a: TensorRef
    scale: float
    r: int
    experts: int = 0  # a stacked experts parameter stored as it is (StackedParam): its E
    in_out: bool = True  # and its slabs' layout: [in, out], or [out, in]
    magnitude: TensorRef | None = None  # DoRA's lora_magnitude_vector [out]

    def delta(self):
        """The change these factors make to their HF tensor (lora.Delta)."""
        from lora_merge.lora import DoraDelta, LowRankDelta, StackedExpertsDelta

        if self.experts:
            return StackedExpertsDelta(self.b.load(), self.a.load(), self.scale, self.experts, self.in_out)
        low_rank = LowRankDelta(self.b.load(), self.a.load(), self.scale)
        return low_rank if self.magnitude is None else DoraDelta(low_rank, self.magnitude.load())


@dataclass
class PeftAdapter:
    path: Path
    config: dict
    factors: dict[str, Factors] = field(default_factory=dict)  # by the HF weight they adapt ("….q_proj.weight")
    # tensors that replace the base's, by HF name: trained biases, and embedding layers saved whole
    biases: dict[str, TensorRef] = field(default_factory=dict)
    sources: list = field(default_factory=list)
    format: str = "PEFT"

    # the Source interface (readers/source.py)
    hf_named = True
    megatron_args = None
    replicas = ()
    weights_dtype = None
    experts = None
    fp8 = None
    skipped: dict = field(default_factory=dict)

    def has(self, megatron_name: str) -> bool:
        """Whether it holds a parameter by that Megatron name (which of two namings a checkpoint uses): never,
        its tensors are named as HF names them."""
        return False

    def describe(self) -> str:
        return (f"PEFT adapter {self.path} ({len(self.factors)} {'DoRA' if self.config.get('use_dora') else 'LoRA'} "
                f"modules, r={self.config.get('r')}, lora_alpha={self.config.get('lora_alpha')}"
                f"{', rsLoRA' if self.config.get('use_rslora') else ''})")


def read_peft_adapter(path: Path, arch=None, shape=None) -> PeftAdapter:
    """The adapter's factors by HF tensor name; `arch` and `shape` (the model's architecture and shape) are
    needed to place LoRA on parameters (`target_parameters`)."""
    path = Path(path)
    config = _config(path / CONFIG)
    weights = path / "adapter_model.safetensors"
    if weights.is_file():
        tensors = tensor_refs(weights, "a PEFT adapter's weights")
    elif (path / ".metadata").is_file():  # a PEFT model's torch distributed checkpoint (FSDP training)
        from lora_merge.readers.dcp_hf import peft_dcp_tensors

        weights = path / ".metadata"
        tensors, skipped, dcp_files = peft_dcp_tensors(path)
        for ref in tensors.values():
            require_float(ref.where, ref.dtype)
    elif (path / "adapter_model.bin").is_file():
        weights = path / "adapter_model.bin"
        state = load_pt(weights)
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise MergeError(f"{weights}: expected a dict of tensors")
        tensors = {k: TensorRef.of(f"{weights}[{shown_name(k)}]", v, mapped=False) for k, v in state.items()}
        for ref in tensors.values():  # tensor_refs checks a safetensors file's the same way
            require_float(ref.where, ref.dtype)
    else:
        raise MergeError(f"{path}: no adapter_model.safetensors, adapter_model.bin or a PEFT model's torch "
                         f"distributed checkpoint (.metadata) next to {CONFIG}")
    adapter = PeftAdapter(path=path, config=config, sources=[path / CONFIG, weights])
    if weights.name == ".metadata":
        adapter.format, adapter.skipped = "PEFT (torch distributed checkpoint)", dict(skipped)
        adapter.sources += dcp_files
    pairs: dict[str, dict[str, TensorRef]] = {}
    for key, ref in tensors.items():
        if not key.startswith(PREFIX):
            raise MergeError(f"{weights}: key {key!r} does not start with {PREFIX!r}; not a PEFT adapter's state")
        name = key[len(PREFIX):]
        for marker, what in ((".lora_embedding_", "LoRA on embeddings"), (".modules_to_save.", "modules_to_save")):
            if marker in name:
                raise UnsupportedInput(f"{weights}: {key}: {what} is not supported; only plain LoRA and DoRA on "
                                       "Linear layers")
        if m := KEY.match(name):
            pairs.setdefault(m.group("module"), {})[m.group("ab")] = ref
        elif m := MAGNITUDE.match(name):
            if not config.get("use_dora"):
                raise MergeError(f"{weights}: {key} is DoRA's magnitude vector, but {CONFIG} does not say use_dora")
            pairs.setdefault(m.group("module"), {})["m"] = ref
        elif name.endswith(".bias") and config.get("bias") in ("all", "lora_only"):
            adapter.biases[name.replace(".base_layer.", ".")] = ref  # an adapted layer's own bias
        elif SAVED_EMBEDDING.match(name):
            # PEFT's save_embedding_layers (on by default when lm_head or embed_tokens is a target): the layer's
            # whole weight as the adapter was trained with it, which PEFT loads over the base's
            adapter.biases[name.replace(".base_layer.", ".")] = ref
        else:
            raise MergeError(f"{weights}: {key} is neither a LoRA factor nor a trained bias; cannot merge it")
    kind = MULTIMODAL.get(shape.multimodal) if shape is not None and shape.multimodal else None
    if kind is not None:  # a multimodal model's: by our names, the language model's and the towers' (carried)
        pairs, _ = rename(pairs, kind, str(weights))
        adapter.biases, _ = rename(adapter.biases, kind, str(weights))
    # PEFT matches rank/alpha patterns against the module names transformers gives them in memory
    named = kind.memory_name if kind is not None else (lambda module: module)
    if config.get("target_parameters") and (arch is None or shape is None):
        raise MergeError(f"{path / CONFIG}: target_parameters={config['target_parameters']!r}: LoRA on parameters "
                         "needs the model's config to place it")
    if arch is not None and shape is not None:
        for name, factors in parameter_factors(pairs, config, arch, shape, weights, named).items():
            adapter.factors[name] = factors
    check_agreement(pairs, config, weights, arch, shape, kind)
    for module, ab in sorted(pairs.items()):
        if set(ab) - {"m"} != {"A", "B"}:
            have = " and ".join(n for k, n in (("A", "lora_A"), ("B", "lora_B"), ("m", "lora_magnitude_vector"))
                                if k in ab)
            raise MergeError(f"{weights}: {module} has {have} but not both LoRA factors")
        if config.get("use_dora") and "m" not in ab:
            raise MergeError(f"{weights}: {module} has no lora_magnitude_vector, but {CONFIG} says use_dora: PEFT would "
                             "start it afresh from the base weight's norms; the weights and the config disagree")
        r, alpha = (_pattern(config, "rank_pattern", named(module), config["r"]),
                    _pattern(config, "alpha_pattern", named(module), config["lora_alpha"]))
        a, b = ab["A"], ab["B"]
        if len(a.shape) != 2 or len(b.shape) != 2 or a.shape[0] != r or b.shape[1] != r:
            raise MergeError(f"{weights}: {module} has lora_A {list(a.shape)} and lora_B {list(b.shape)}, but its r is "
                             f"{r} (adapter_config.json)")
        magnitude = ab.get("m")
        if magnitude is not None and (len(magnitude.shape) != 1 or magnitude.shape[0] != b.shape[0]):
            raise MergeError(f"{weights}: {module}.lora_magnitude_vector has shape {list(magnitude.shape)}; DoRA's is "
                             f"one value per output row, [{b.shape[0]}] as lora_B says")
        adapter.factors[f"{module}.weight"] = Factors(
            b=b, a=a, scale=lora_scale(alpha, r, config.get("use_rslora", False), module, str(path / CONFIG)), r=r,
            magnitude=magnitude)
    if not adapter.factors:
        raise MergeError(f"{weights}: no LoRA factors")
    return adapter


def _config(path: Path) -> dict:
    text = read_text(path, expected="a PEFT adapter config (JSON)")  # a regular file, under its cap
    try:
        config = json.loads(text)
    except RecursionError:  # "[[[[…" nested deeper than the parser goes
        raise MergeError(f"{path}: unreadable (JSON nested too deep to be an adapter config)") from None
    except (OSError, ValueError) as exc:
        raise MergeError(f"{path}: unreadable ({(str(exc).splitlines() or [type(exc).__name__])[0][:200]})") from None
    if not isinstance(config, dict):
        raise MergeError(f"{path}: not a JSON object")
    kind = config.get("peft_type")
    if kind != "LORA":
        raise MergeError(f"{path}: peft_type {kind!r}; only LORA adapters can be merged")
    if config.get("use_dora") and config.get("target_parameters"):
        raise UnsupportedInput(f"{path}: use_dora with target_parameters: PEFT has no DoRA on parameters")
    if config.get("modules_to_save"):
        raise MergeError(f"{path}: modules_to_save={config['modules_to_save']!r}: fully trained module copies are not "
                         "supported")
    targets = config.get("target_parameters")
    if targets is not None and (not isinstance(targets, list) or not all(isinstance(t, str) and t for t in targets)):
        raise MergeError(f"{path}: target_parameters={targets!r}; expected a list of parameter names")
    for key, what in (("layer_replication", "layer replication (layers duplicated in the adapted model)"),
                      ("trainable_token_indices", "trainable tokens (embedding rows trained outside LoRA)")):
        if config.get(key):
            raise UnsupportedInput(f"{path}: {key}={config[key]!r}: {what} is not supported")
    if config.get("lora_bias"):
        raise UnsupportedInput(f"{path}: lora_bias=true (a bias on lora_B) is not supported")
    _check_values(config, path)
    return config


def _pattern(config: dict, key: str, module: str, default):
    """PEFT's rule (utils/other.py get_pattern_key): the first pattern, in the file's order, that matches
    the end of the module's name after a dot (a regex; each was compiled when the config was read)."""
    for pattern, value in (config.get(key) or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return default


# ------------------------------------------------------------------------ the config's fields, checked

def _check_values(config: dict, path: Path) -> None:
    """Every field that decides which modules are adapted, or by how much, has a type and range PEFT would
    use; one line naming the field otherwise (a NaN alpha would merge as no scale at all)."""
    where = str(path)
    positive_int(config.get("r"), "r", where, MAX_RANK)
    finite_number(config.get("lora_alpha"), "lora_alpha", where, 0, MAX_ALPHA, low_open=True)
    if not isinstance(config.get("use_dora", False), bool):
        raise MergeError(f"{path}: use_dora={shown_value(config['use_dora'])}; expected true or false")
    if not isinstance(config.get("use_rslora", False), bool):
        raise MergeError(f"{path}: use_rslora={shown_value(config['use_rslora'])}; expected true or false")
    for key, check in (("rank_pattern", lambda v, f: positive_int(v, f, where, MAX_RANK)),
                       ("alpha_pattern", lambda v, f: finite_number(v, f, where, 0, MAX_ALPHA, low_open=True))):
        patterns = config.get(key)
        if patterns is None:
            continue
        if not isinstance(patterns, dict):
            raise MergeError(f"{path}: {key}={shown_value(patterns)}; expected an object {{pattern: value}}")
        for pattern, value in patterns.items():
            _regex(rf"(.*\.)?({pattern})$", f"{key} key {shown_value(pattern)}", path)
            check(value, f"{key}[{shown_value(pattern)}]")
    targets = config.get("target_modules")
    if targets is None and not config.get("target_parameters"):
        raise MergeError(f"{path}: target_modules is missing; expected the list (or regex) of modules the adapter "
                         "was trained on, as PEFT saves it")
    for key in ("target_modules", "exclude_modules"):
        value = config.get(key)
        if isinstance(value, str):
            if value.lower() != ALL_LINEAR or key != "target_modules":
                _regex(value, key, path)
        elif value is not None and not (isinstance(value, list) and all(isinstance(t, str) for t in value)):
            raise MergeError(f"{path}: {key}={shown_value(value)}; expected a list of module names or a regex")
    layers, pattern = config.get("layers_to_transform"), config.get("layers_pattern")
    if layers is not None and not (is_int(layers) and layers >= 0 or isinstance(layers, list)
                                   and all(is_int(i) and i >= 0 for i in layers)):
        raise MergeError(f"{path}: layers_to_transform={shown_value(layers)}; expected a layer number or a list of them")
    if pattern is not None and not (isinstance(pattern, str) or isinstance(pattern, list)
                                    and all(isinstance(p, str) for p in pattern)):
        raise MergeError(f"{path}: layers_pattern={shown_value(pattern)}; expected a name or a list of names")
    for p in [pattern] if isinstance(pattern, str) else pattern or []:
        _regex(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.", f"layers_pattern {shown_value(p)}", path)
    # LoraConfig.__post_init__ refuses these; an adapter_config.json edited by hand could still hold them
    if isinstance(targets, str) and (layers is not None or pattern is not None):
        raise MergeError(f"{path}: layers_to_transform/layers_pattern with a regex target_modules; PEFT refuses "
                         "them together")
    if pattern and layers is None:
        raise MergeError(f"{path}: layers_pattern without layers_to_transform; PEFT refuses it")


def _regex(pattern: str, field: str, path: Path) -> None:
    try:
        re.compile(pattern)
    except (re.error, RecursionError, OverflowError) as exc:
        raise MergeError(f"{path}: {field} is not a valid regular expression ({exc})") from None


# ------------------------------------------------------ which modules the config selects, as PEFT decides

ALL_LINEAR = "all-linear"
EXCLUDED = "excluded"


def config_selects(config: dict, key: str, linear: set[str] | None = None) -> bool | str:
    """Whether PEFT adapts module `key` (its name in the transformers model) under this config: PEFT
    0.21's check_target_module_exists, re-implemented: exclude_modules first (a regex fully matching, or a
    name equal or a dotted suffix), then target_modules (a regex fully matching; else a name equal, or a
    dotted suffix restricted by layers_to_transform to the layer number that follows layers_pattern, or the
    first number after two dotted parts). "all-linear" means every Linear but the output layer (`linear`:
    those of this model). EXCLUDED for an excluded module."""
    exclude = config.get("exclude_modules")
    if exclude:
        if isinstance(exclude, str):
            if re.fullmatch(exclude, key):
                return EXCLUDED
        elif key in exclude or any(key.endswith(f".{e}") for e in exclude):
            return EXCLUDED
    targets = config.get("target_modules")
    if targets is None:  # only target_parameters
        return False
    if isinstance(targets, str):
        if targets.lower() == ALL_LINEAR:
            return linear is not None and key in linear
        return re.fullmatch(targets, key) is not None
    if key in targets:
        return True
    found = any(key.endswith(f".{t}") for t in targets)
    layers, pattern = config.get("layers_to_transform"), config.get("layers_pattern")
    if found and layers is not None and (not isinstance(layers, list) or layers):
        match = None
        if not pattern:
            match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", key)
        else:
            for p in [pattern] if isinstance(pattern, str) else pattern:
                match = re.match(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.", key)
                if match is not None:
                    break
        if match is None:
            return False
        index = int(match.group("idx"))
        return index == layers if isinstance(layers, int) else index in layers
    return found


ROUTED_EXPERT = re.compile(r"\.experts\.\d+\.")
ROUTER = re.compile(r"\.(mlp|block_sparse_moe)\.gate$|\.shared_expert_gate$")


def model_modules(arch, shape) -> tuple[set[str], set[str], set[str]]:
    """(every module of the transformers model that holds a weight, with their parents; its Linear modules
    but the output layer, which "all-linear" selects; the ones whose being a Linear depends on the
    transformers version: routers, and routed experts, which transformers 5 fuses into parameters)."""
    from lora_merge.model.architectures.base import iter_rules

    weights = {}
    for rule, _, prefix in iter_rules(arch, shape, stacked=True):
        weights.update({prefix + name: dims for name, dims in rule.hf_shapes(shape).items()})
    modules = {"lm_head"}  # a module of every causal LM, tied or not
    linear, unsure = set(), set()
    for name, dims in weights.items():
        module = name.rsplit(".", 1)[0]
        parts = module.split(".")
        modules |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
        if name.endswith(".weight") and len(dims) == 2 and module not in ("lm_head", "model.embed_tokens"):
            (unsure if ROUTED_EXPERT.search(f"{module}.") or ROUTER.search(module) else linear).add(module)
    return modules, linear, unsure


def check_agreement(pairs: dict, config: dict, weights: Path, arch=None, shape=None,
                    multimodal: Multimodal | None = None) -> None:
    """The adapter's factors are exactly the modules its config selects: PEFT loads a factor only into a
    module it adapts (others are dropped, with a warning), and gives a selected module without saved factors
    fresh ones, so a disagreement means the file is not the adapter PEFT would build from the config.
    Without the model (`inspect`), only the factors' own modules are checked. A multimodal model's modules
    are selected by the names transformers gives them; its towers' are not known here: all-linear is taken
    to select those the adapter has factors for, and none is missed."""
    where = weights.parent / CONFIG
    linear = unsure = modules = None
    if arch is not None and shape is not None:
        modules, linear, unsure = model_modules(arch, shape)
    if multimodal is not None:
        towers = {multimodal.memory_name(m) for m in pairs if not multimodal.is_language(m)}
        pairs = {multimodal.memory_name(m): ab for m, ab in pairs.items()}
        if modules is not None:
            modules, linear, unsure = ({multimodal.memory_name(m) for m in s} for s in (modules, linear, unsure))
            unsure |= towers
    elif isinstance(config.get("target_modules"), str) and config["target_modules"].lower() == ALL_LINEAR:
        return  # which modules are Linear needs the model
    selected = {m: config_selects(config, m, (linear | unsure) if linear is not None else None) for m in pairs}
    stray = sorted(m for m, chosen in selected.items() if chosen is not True)
    if stray:
        excluded = [m for m in stray if selected[m] == EXCLUDED]
        raise MergeError(f"{weights}: LoRA factors for {len(stray)} module(s) that {where.name} does not select "
                         f"({_few(stray)}{'; excluded by exclude_modules' if excluded else ''}; "
                         f"{_selection(config)}); PEFT would not load them: the config and the weights disagree")
    if modules is None:
        return
    chosen = sorted(m for m in modules - unsure if config_selects(config, m, linear) is True)
    missing = [m for m in chosen if m not in pairs]
    if missing:
        raise MergeError(f"{weights}: no LoRA factors for {len(missing)} of the {len(chosen)} module(s) {where.name} "
                         f"selects ({_few(missing)}; {_selection(config)}); PEFT would give them fresh factors: "
                         "the config and the weights disagree")


def _few(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _selection(config: dict) -> str:
    fields = [f"target_modules={shown_value(config.get('target_modules'))}"]
    fields += [f"{k}={shown_value(config[k])}" for k in ("layers_to_transform", "layers_pattern", "exclude_modules")
               if config.get(k) is not None]
    return ", ".join(fields)


# ------------------------------------------------------------------------------------ LoRA on parameters

WRAPPED = ".base_layer"  # one per ParamWrapper around the one whose factors these are


@dataclass(frozen=True)
class ExpertParam:
    """A transformers 5 fused expert parameter [E, out, in]: for each expert, the HF checkpoint tensors it
    stacks as (name, first row, end row) of that expert's [out, in] slice."""

    shape: tuple[int, int, int]
    parts: tuple[tuple[tuple[str, int, int], ...], ...]


@dataclass(frozen=True)
class StackedParam:
    """A transformers 5 experts parameter that the HF checkpoint stores as it is, one tensor: [E, in, out] where
    transformers marks the experts is_transposed (gpt-oss), else [E, out, in] as PEFT reads it (Llama-4)."""

    shape: tuple[int, int, int]
    name: str
    in_out: bool = True


@dataclass(frozen=True)
class MatrixParam:
    """A 2-D parameter [out, in], one HF checkpoint tensor."""

    shape: tuple[int, int]
    name: str


def model_parameters(arch, shape) -> dict[str, list[tuple[str, ExpertParam | MatrixParam]]]:
    """The parameters PEFT can wrap, by transformers 5 module name, each module's in registration order (the
    order PEFT nests its wrappers in): every MoE layer's fused experts (gate_up_proj, then down_proj) and
    every 2-D weight that is not a routed expert's."""
    from lora_merge.model.architectures.base import HF_LAYER, iter_rules
    from lora_merge.model.layout import GatedColumn, RowParallel

    fused = arch.config.fused_experts if arch.config is not None else None
    gated = [r for r in arch.layer_rules if r.per_expert and isinstance(r, GatedColumn)]
    down = [r for r in arch.layer_rules if r.per_expert and isinstance(r, RowParallel)]
    found: dict[str, list] = {}
    per_expert: set[str] = set()
    renamed = None  # (HF checkpoint's MoE block, transformers 5's): Mixtral's block_sparse_moe is mlp in v5
    if fused and shape.moe is not None and len(gated) == 1 and len(down) == 1:
        renamed = (gated[0].gate.split(".experts.")[0], fused.rsplit(".experts", 1)[0])
        count = shape.moe.num_experts
        for i in sorted(shape.moe.layers):
            prefix = HF_LAYER.format(i=i)
            ups, downs = [], []
            for e in range(count):
                g, d = gated[0].bind(expert=e), down[0].bind(expert=e)
                (gate, (ffn, hidden)), (up, _) = g.hf_shapes(shape).items()
                ups.append(((prefix + gate, 0, ffn), (prefix + up, 0, ffn)))
                downs.append(((prefix + d.hf, 0, hidden),))
                per_expert |= {prefix + gate, prefix + up, prefix + d.hf}
            found[prefix + fused] = [("gate_up_proj", ExpertParam((count, 2 * ffn, hidden), tuple(ups))),
                                     ("down_proj", ExpertParam((count, hidden, ffn), tuple(downs)))]
    for rule, _, prefix in iter_rules(arch, shape, stacked=True):
        for name, dims in rule.hf_shapes(shape).items():
            full = prefix + name
            if len(dims) == 3 and fused and name.startswith(fused + ".") and not name.endswith("_bias"):
                module, param = full.rsplit(".", 1)  # stored stacked, as the parameter is
                found.setdefault(module, []).append((param, StackedParam(tuple(dims), full, arch.config.peft.stacked_in_out)))
                continue
            if len(dims) != 2 or not name.endswith(".weight") or full in per_expert:
                continue
            if renamed and renamed[0] != renamed[1] and name.startswith(renamed[0] + "."):
                name = renamed[1] + name[len(renamed[0]):]
            module = prefix + name.removesuffix(".weight")
            found.setdefault(module, []).append(("weight", MatrixParam(tuple(dims), full)))
    return found


def _selects(key: str, target: str) -> bool:
    """PEFT's rule for target_parameters (tuners_utils._inject_parameters): the full name or a dotted suffix."""
    return key == target or key.endswith(f".{target}")


def parameter_factors(pairs: dict[str, dict[str, TensorRef]], config: dict, arch, shape,
                      weights: Path, named=None) -> dict[str, Factors]:
    """Take the factors of LoRA on parameters out of `pairs` (by saved module name) and return them as
    factors by HF checkpoint tensor; refuse factors of a parameter target_parameters does not select."""
    named = named or (lambda module: module)  # (multimodal: the in-memory names PEFT matches patterns on)
    targets = config.get("target_parameters") or []
    params = model_parameters(arch, shape)
    expected: dict[str, tuple[str, ExpertParam | MatrixParam]] = {}  # saved module name -> (parameter, what)
    used = set()
    for module, candidates in params.items():
        chosen = []
        for name, what in candidates:
            hits = {t for t in targets if _selects(f"{module}.{name}", t)}
            if hits:
                used |= hits
                chosen.append((f"{module}.{name}", what))
        for depth, item in enumerate(reversed(chosen)):  # the last registered is the outermost wrapper
            expected[module + WRAPPED * depth] = item
    unused = [t for t in targets if t not in used]
    if unused:
        fused = arch.config.fused_experts if arch.config is not None and shape.moe is not None else None
        raise MergeError(f"{weights.parent / CONFIG}: target_parameters entry {unused[0]!r} selects no parameter of "
                         f"this {shape.model_type} model" + (f" (transformers 5 names its routed experts' parameters "
                                                       f"{fused}.gate_up_proj and {fused}.down_proj)" if fused else ""))
    missing = [(module, key) for module, (key, _) in expected.items() if module not in pairs]
    if missing:
        shown = ", ".join(key for _, key in missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise MergeError(f"{weights}: no LoRA factors for {len(missing)} of the {len(expected)} parameters "
                         f"target_parameters selects ({shown}; expected under "
                         f"{PREFIX}{missing[0][0]}.lora_A/lora_B); PEFT would load them with fresh factors")
    wrapped = {m for m, c in params.items() if any(isinstance(w, ExpertParam) for _, w in c)}
    for module in pairs:
        if module in expected:
            continue
        if WRAPPED in module or module in wrapped:
            raise MergeError(f"{weights}: LoRA factors {PREFIX}{module}.lora_A/lora_B belong to no parameter "
                             f"target_parameters={targets!r} selects (PEFT nests one wrapper per selected parameter "
                             "of a module, the first registered innermost); cannot tell which parameter they adapt")
    factors = {}
    for module, (key, what) in expected.items():
        ab = pairs.pop(module)
        if set(ab) != {"A", "B"}:
            raise MergeError(f"{weights}: {key} has {'lora_A' if 'A' in ab else 'lora_B'} but not the other factor")
        r, alpha = (_pattern(config, "rank_pattern", named(key), config["r"]),
                    _pattern(config, "alpha_pattern", named(key), config["lora_alpha"]))
        if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
            raise MergeError(f"{weights.parent / CONFIG}: rank {r!r} for {key} (r / rank_pattern); expected a positive "
                             "integer")
        a, b = ab["A"], ab["B"]
        experts = what.shape[0] if isinstance(what, (ExpertParam, StackedParam)) else 1
        out_dim, in_dim = what.shape[:0:-1] if isinstance(what, StackedParam) and what.in_out else what.shape[-2:]
        if tuple(a.shape) != (experts * r, in_dim) or tuple(b.shape) != (out_dim, r * experts):
            raise MergeError(f"{weights}: {key} {list(what.shape)} has lora_A {list(a.shape)} and lora_B "
                             f"{list(b.shape)}; with r={r} (adapter_config.json) PEFT's are [{experts * r}, {in_dim}] "
                             f"and [{out_dim}, {r * experts}]")
        scale = lora_scale(alpha, r, config.get("use_rslora", False), key, str(weights.parent / CONFIG))
        if isinstance(what, MatrixParam):
            factors[what.name] = Factors(b=b, a=a, scale=scale, r=r)
            continue
        if isinstance(what, StackedParam):
            factors[what.name] = Factors(b=b, a=a, scale=scale, r=r, experts=experts, in_out=what.in_out)
            continue
        for e, parts in enumerate(what.parts):
            a_e = _derived(a, f"expert {e}", (r, in_dim), lambda t, rows=slice(e * r, (e + 1) * r): t[rows])
            start = 0
            for name, first, end in parts:
                rows = slice(start + first, start + end)
                factors[name] = Factors(b=_derived(b, f"expert {e} rows {rows.start}:{rows.stop}", (end - first, r),
                                                   lambda t, e=e, rows=rows, view=(out_dim, r, experts):
                                                   t.reshape(view)[rows, :, e]),
                                        a=a_e, scale=scale, r=r)
                start += end - first
    return factors


def _derived(ref: TensorRef, what: str, shape: tuple[int, ...], take) -> TensorRef:
    """A part of a factor, cut out when loaded."""
    return TensorRef(where=f"{ref.where} ({what})", shape=shape, dtype=ref.dtype, loader=lambda: take(ref.load()),
                     records=ref.records, spans=ref.byte_spans)


# ------------------------------------------------------------------------------------ several adapters at once

@dataclass(frozen=True)
class SummedFactorRef(TensorRef):
    """The factors of several adapters' changes to one tensor side by side (along r), each B scaled by its
    adapter's weight and scale: B·A is then Σ wᵢ·sᵢ·Bᵢ·Aᵢ, merged in one float32 product. Built when loaded;
    releasing it releases the adapters' own."""

    parts: tuple = ()

    def release(self) -> None:
        for ref in self.parts:
            ref.release()

    def byte_spans(self) -> tuple:  # (their reads counted as the adapters', files/handback.py)
        return tuple(span for ref in self.parts for span in ref.byte_spans())


def _summed(name: str, parts: list[tuple[float, Factors]]) -> Factors:
    first = parts[0][1]
    experts, in_out = first.experts, first.in_out
    r = sum(f.r if not f.experts else f.a.shape[0] // f.experts for _, f in parts)

    def b() -> torch.Tensor:
        if experts:  # (out, rᵢ, E) side by side along r
            return torch.cat([(w * f.scale) * f.b.load().float().reshape(f.b.shape[0], -1, experts)
                              for w, f in parts], 1).reshape(first.b.shape[0], -1)
        return torch.cat([(w * f.scale) * f.b.load().float() for w, f in parts], 1)

    def a() -> torch.Tensor:
        if experts:  # (E, rᵢ, in) side by side along r
            return torch.cat([f.a.load().float().reshape(experts, -1, f.a.shape[1]) for _, f in parts],
                             1).reshape(-1, first.a.shape[1])
        return torch.cat([f.a.load().float() for _, f in parts], 0)

    width = r * (experts or 1)
    where = " + ".join(f.a.where for _, f in parts)
    return Factors(
        b=SummedFactorRef(where, (first.b.shape[0], width), torch.float32, b, parts=tuple(f.b for _, f in parts)),
        a=SummedFactorRef(where, (width, first.a.shape[1]), torch.float32, a, parts=tuple(f.a for _, f in parts)),
        scale=1.0, r=r, experts=experts, in_out=in_out)


@dataclass
class WeightedAdapters(PeftAdapter):
    """Several PEFT adapters of one base merged together: W + Σ wᵢ·ΔWᵢ in float32, rounded once, each ΔWᵢ with
    its own r, alpha, rsLoRA and patterns (`combine`)."""

    adapters: list = field(default_factory=list)
    weights: list = field(default_factory=list)

    def describe(self) -> str:
        return f"{len(self.adapters)} PEFT adapters: " + "; ".join(
            f"{a.describe()} × {w:g}" for a, w in zip(self.adapters, self.weights))


def combine(adapters: list[PeftAdapter], weights: list[float]) -> WeightedAdapters:
    """One source holding Σ wᵢ·ΔWᵢ for every tensor any adapter changes. DoRA has no such sum (its change depends
    on the whole merged row, so PEFT's own result depends on the order), nor has a trained bias (each adapter's
    replaces the base's): both refused by name."""
    how = "merged with others" if len(adapters) > 1 else f"weighted {weights[0]:g}"
    for adapter in adapters:
        if adapter.config.get("use_dora"):
            raise MergeError(f"{adapter.path}: a DoRA adapter {how}: DoRA's rescaling of each row is not linear in its "
                             "change, and for a sum of adapters has no single answer (PEFT's result depends on the "
                             "order); merge it alone, at weight 1")
        if adapter.biases:
            raise MergeError(f"{adapter.path}: holds tensors that replace the base's ({next(iter(adapter.biases))}: "
                             f"trained biases, or an embedding layer saved whole); an adapter {how} cannot: merge it "
                             "alone, at weight 1")
    parts: dict[str, list[tuple[float, Factors]]] = {}
    for adapter, w in zip(adapters, weights):
        for name, f in adapter.factors.items():
            parts.setdefault(name, []).append((w, f))
    for name, fs in parts.items():
        first = fs[0][1]
        for _, f in fs[1:]:
            if (f.experts, f.in_out, f.b.shape[0], f.a.shape[1]) != (first.experts, first.in_out, first.b.shape[0],
                                                                     first.a.shape[1]):
                raise MergeError(f"{f.a.where}: changes {name} as a [{f.b.shape[0]}, {f.a.shape[1]}] weight, but "
                                 f"{first.a.where} as [{first.b.shape[0]}, {first.a.shape[1]}]: the adapters are not "
                                 "of one base")
    combined = WeightedAdapters(path=adapters[0].path, config=dict(adapters[0].config),
                                sources=[s for a in adapters for s in a.sources], adapters=list(adapters),
                                weights=list(weights))
    combined.factors = {name: (_summed(name, fs) if len(fs) > 1 or fs[0][0] != 1 else fs[0][1])
                        for name, fs in parts.items()}
    return combined
