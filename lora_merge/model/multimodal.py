"""Multimodal releases whose language model is one of ours (Gemma 3 4B-27B, Llama 4 Scout/Maverick): the language
model is read, merged and written under our names; every other tensor (vision tower, projector) is carried as
stored, merged where a PEFT adapter adapts one of its linears.

Three namings meet here:
- the file's, as the releases and transformers' save_pretrained write them: `language_model.model.X`,
  `language_model.lm_head.X`, and the towers at the top level (`vision_tower.*`, `vision_model.*`,
  `multi_modal_projector.*`);
- the module names transformers builds in memory, which PEFT adapters are saved with (Gemma 3:
  `model.language_model.X`, `lm_head`, `model.vision_tower.*`, `model.multi_modal_projector.*`; Llama 4's are the
  file's). A base saved with them is read too;
- ours, the text model's: `model.X`, `lm_head.X`.

Every name is first brought to the file's naming, then the language model's to ours. Output is written in the
file's naming, as the releases store it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lora_merge.errors import MergeError

# file naming -> ours, for the language model's tensors
LANGUAGE = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."))


def _swap(name: str, prefixes) -> str | None:
    """`name` with the first matching prefix (old, new) replaced; a module named by the prefix itself too."""
    for old, new in prefixes:
        if name.startswith(old):
            return new + name[len(old):]
        if name + "." == old:
            return new[:-1]
    return None


@dataclass(frozen=True)
class Multimodal:
    """A multimodal model type: its text model's type and config key, and transformers' in-memory prefixes
    (-> the file's)."""

    model_type: str
    text_model_type: str
    in_memory: tuple[tuple[str, str], ...] = ()
    text_key: str = "text_config"

    def ours(self, name: str, where: str) -> tuple[str, bool]:
        """(our name, whether it is the language model's) of a tensor or module named either way."""
        stored = _swap(name, self.in_memory) or name
        mine = _swap(stored, LANGUAGE)
        if mine is not None:
            return mine, True
        if stored.startswith(("model.", "lm_head")):
            raise MergeError(f"{where}: {name} is neither the {self.model_type} language model's (language_model.*) "
                             "nor a tower's; a multimodal checkpoint names its text model's tensors language_model.*")
        return stored, False

    def file_name(self, ours: str) -> str:
        """The file's name of our name (a tower's is its own)."""
        return _swap(ours, [(new, old) for old, new in LANGUAGE]) or ours

    def is_language(self, ours: str) -> bool:
        return _swap(ours, [(new, old) for old, new in LANGUAGE]) is not None

    def memory_name(self, ours: str) -> str:
        """The module name transformers gives it in memory (and PEFT adapters are saved with)."""
        stored = self.file_name(ours)
        return _swap(stored, [(new, old) for old, new in self.in_memory]) or stored


MULTIMODAL = {
    "gemma3": Multimodal("gemma3", "gemma3_text", in_memory=(
        ("model.language_model.", "language_model.model."), ("model.vision_tower.", "vision_tower."),
        ("model.multi_modal_projector.", "multi_modal_projector."), ("lm_head.", "language_model.lm_head."))),
    "llama4": Multimodal("llama4", "llama4_text"),
}


@dataclass
class Renamed:
    """A multimodal checkpoint's tensors under our names: `carried` holds the towers' (file names), which no
    architecture rule writes."""

    kind: Multimodal
    carried: set[str] = field(default_factory=set)

    def ours(self, name: str, where: str) -> str:
        mine, language = self.kind.ours(name, where)
        if not language:
            self.carried.add(mine)
        return mine

    def stored(self, name: str) -> str:
        """The file name our name is written under."""
        return name if name in self.carried else self.kind.file_name(name)


def rename(tensors: dict, kind: Multimodal, where: str) -> tuple[dict, Renamed]:
    """`tensors` (by file or in-memory name) keyed by our names; two names for one tensor are refused."""
    renamed, out = Renamed(kind), {}
    for name, value in tensors.items():
        mine = renamed.ours(name, where)
        if mine in out:
            raise MergeError(f"{where}: holds {mine} twice (once as {name})")
        out[mine] = value
    return out, renamed
