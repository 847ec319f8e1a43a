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

Refused with one line: other PEFT types, DoRA, `modules_to_save`, LoRA on embeddings.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lora_merge.errors import MergeError
from lora_merge.readers.checkpoint import TensorRef
from lora_merge.readers.hf_model import _tensors
from lora_merge.safe_load import load_pt
from lora_merge.small_files import read_json

CONFIG = "adapter_config.json"
PREFIX = "base_model.model."
KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")


def is_peft_adapter_dir(path: Path) -> bool:
    return (Path(path) / CONFIG).is_file()


@dataclass(frozen=True)
class Factors:
    b: TensorRef
    a: TensorRef
    scale: float
    r: int


@dataclass
class PeftAdapter:
    path: Path
    config: dict
    factors: dict[str, Factors] = field(default_factory=dict)  # by the HF weight they adapt ("….q_proj.weight")
    biases: dict[str, TensorRef] = field(default_factory=dict)  # trained biases, by HF name
    sources: list = field(default_factory=list)
    format: str = "PEFT"

    def describe(self) -> str:
        return (f"PEFT adapter {self.path} ({len(self.factors)} LoRA modules, r={self.config.get('r')}, "
                f"lora_alpha={self.config.get('lora_alpha')}{', rsLoRA' if self.config.get('use_rslora') else ''})")


def read_peft_adapter(path: Path, arch=None, shape=None) -> PeftAdapter:
    """The adapter's factors by HF tensor name; `arch` and `shape` (the model's architecture and shape) are
    needed to place LoRA on parameters (`target_parameters`)."""
    path = Path(path)
    config = _config(path / CONFIG)
    weights = path / "adapter_model.safetensors"
    if weights.is_file():
        tensors = _tensors(weights)
    elif (path / "adapter_model.bin").is_file():
        weights = path / "adapter_model.bin"
        state = load_pt(weights)
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise MergeError(f"{weights}: expected a dict of tensors")
        tensors = {k: TensorRef.of(f"{weights}[{k}]", v, mapped=False) for k, v in state.items()}
    else:
        raise MergeError(f"{path}: no adapter_model.safetensors or adapter_model.bin next to {CONFIG}")
    adapter = PeftAdapter(path=path, config=config, sources=[path / CONFIG, weights])
    pairs: dict[str, dict[str, TensorRef]] = {}
    for key, ref in tensors.items():
        if not key.startswith(PREFIX):
            raise MergeError(f"{weights}: key {key!r} does not start with {PREFIX!r}; not a PEFT adapter's state")
        name = key[len(PREFIX):]
        for marker, what in ((".lora_embedding_", "LoRA on embeddings"), (".lora_magnitude_vector", "DoRA"),
                             (".modules_to_save.", "modules_to_save")):
            if marker in name:
                raise MergeError(f"{weights}: {key}: {what} is not supported; only plain LoRA on Linear layers")
        if m := KEY.match(name):
            pairs.setdefault(m.group("module"), {})[m.group("ab")] = ref
        elif name.endswith(".bias") and config.get("bias") in ("all", "lora_only"):
            adapter.biases[name.replace(".base_layer.", ".")] = ref  # an adapted layer's own bias
        else:
            raise MergeError(f"{weights}: {key} is neither a LoRA factor nor a trained bias; cannot merge it")
    if config.get("target_parameters") and (arch is None or shape is None):
        raise MergeError(f"{path / CONFIG}: target_parameters={config['target_parameters']!r}: LoRA on parameters "
                         "needs the model's config to place it")
    if arch is not None and shape is not None:
        for name, factors in parameter_factors(pairs, config, arch, shape, weights).items():
            adapter.factors[name] = factors
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            have = "lora_A" if "A" in ab else "lora_B"
            raise MergeError(f"{weights}: {module} has {have} but not the other factor")
        r, alpha = _pattern(config, "rank_pattern", module, config["r"]), _pattern(config, "alpha_pattern", module,
                                                                                   config["lora_alpha"])
        a, b = ab["A"], ab["B"]
        if len(a.shape) != 2 or len(b.shape) != 2 or a.shape[0] != r or b.shape[1] != r:
            raise MergeError(f"{weights}: {module} has lora_A {list(a.shape)} and lora_B {list(b.shape)}, but its r is "
                             f"{r} (adapter_config.json)")
        adapter.factors[f"{module}.weight"] = Factors(b=b, a=a, scale=_scale(config, r, alpha), r=r)
    if not adapter.factors:
        raise MergeError(f"{weights}: no LoRA factors")
    return adapter


def _config(path: Path) -> dict:
    try:
        config = read_json(path)  # regular file, under adapter_config.json's cap
    except (OSError, ValueError) as exc:
        raise MergeError(f"{path}: unreadable ({exc})") from exc
    if not isinstance(config, dict):
        raise MergeError(f"{path}: not a JSON object")
    kind = config.get("peft_type")
    if kind != "LORA":
        raise MergeError(f"{path}: peft_type {kind!r}; only LORA adapters can be merged")
    if config.get("use_dora"):
        raise MergeError(f"{path}: use_dora=true: DoRA is not supported")
    if config.get("modules_to_save"):
        raise MergeError(f"{path}: modules_to_save={config['modules_to_save']!r}: fully trained module copies are not "
                         "supported")
    targets = config.get("target_parameters")
    if targets is not None and (not isinstance(targets, list) or not all(isinstance(t, str) and t for t in targets)):
        raise MergeError(f"{path}: target_parameters={targets!r}; expected a list of parameter names")
    for key, what in (("layer_replication", "layer replication (layers duplicated in the adapted model)"),
                      ("trainable_token_indices", "trainable tokens (embedding rows trained outside LoRA)")):
        if config.get(key):
            raise MergeError(f"{path}: {key}={config[key]!r}: {what} is not supported")
    if config.get("lora_bias"):
        raise MergeError(f"{path}: lora_bias=true (a bias on lora_B) is not supported")
    for key in ("r", "lora_alpha"):
        value = config.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise MergeError(f"{path}: {key}={value!r}; expected a positive number")
    for key in ("rank_pattern", "alpha_pattern"):
        if not isinstance(config.get(key) or {}, dict):
            raise MergeError(f"{path}: {key} must be an object {{pattern: value}}")
    return config


def _pattern(config: dict, key: str, module: str, default):
    """PEFT's rule: the first pattern that matches the end of the module's name (a full-name regex)."""
    for pattern, value in (config.get(key) or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return default


def _scale(config: dict, r: int, alpha) -> float:
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


# ------------------------------------------------------------------------------------ LoRA on parameters

WRAPPED = ".base_layer"  # one per ParamWrapper around the one whose factors these are


@dataclass(frozen=True)
class ExpertParam:
    """A transformers 5 fused expert parameter [E, out, in]: for each expert, the HF checkpoint tensors it
    stacks as (name, first row, end row) of that expert's [out, in] slice."""

    shape: tuple[int, int, int]
    parts: tuple[tuple[tuple[str, int, int], ...], ...]


@dataclass(frozen=True)
class MatrixParam:
    """A 2-D parameter [out, in], one HF checkpoint tensor."""

    shape: tuple[int, int]
    name: str


def model_parameters(arch, shape) -> dict[str, list[tuple[str, ExpertParam | MatrixParam]]]:
    """The parameters PEFT can wrap, by transformers 5 module name, each module's in registration order (the
    order PEFT nests its wrappers in): every MoE layer's fused experts (gate_up_proj, then down_proj) and
    every 2-D weight that is not a routed expert's."""
    from lora_merge.architectures.base import HF_LAYER, iter_rules
    from lora_merge.layout import GatedColumn, RowParallel

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
    for rule, _, prefix in iter_rules(arch, shape):
        for name, dims in rule.hf_shapes(shape).items():
            full = prefix + name
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
                      weights: Path) -> dict[str, Factors]:
    """Take the factors of LoRA on parameters out of `pairs` (by saved module name) and return them as
    factors by HF checkpoint tensor; refuse factors of a parameter target_parameters does not select."""
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
        r, alpha = _pattern(config, "rank_pattern", key, config["r"]), _pattern(config, "alpha_pattern", key,
                                                                                config["lora_alpha"])
        if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
            raise MergeError(f"{weights.parent / CONFIG}: rank {r!r} for {key} (r / rank_pattern); expected a positive "
                             "integer")
        a, b = ab["A"], ab["B"]
        experts = what.shape[0] if isinstance(what, ExpertParam) else 1
        out_dim, in_dim = what.shape[-2:]
        if tuple(a.shape) != (experts * r, in_dim) or tuple(b.shape) != (out_dim, r * experts):
            raise MergeError(f"{weights}: {key} {list(what.shape)} has lora_A {list(a.shape)} and lora_B "
                             f"{list(b.shape)}; with r={r} (adapter_config.json) PEFT's are [{experts * r}, {in_dim}] "
                             f"and [{out_dim}, {r * experts}]")
        scale = _scale(config, r, alpha)
        if isinstance(what, MatrixParam):
            factors[what.name] = Factors(b=b, a=a, scale=scale, r=r)
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
                     records=ref.records)
