"""Merge a Megatron-Core / MindSpeed-LLM LoRA checkpoint into a HuggingFace model on a CPU host.

    import lora_merge
    result = lora_merge.merge(base="mcore/", lora="lora/", hf_ref="hf/", out="merged/")

`merge`, `verify`, `inspect` and `export_adapter` are in `lora_merge.api`; bad input raises `MergeError`.
They are imported on first use, so that `import lora_merge` stays light (the command handles signals
before torch is imported).
"""

from lora_merge.version import __version__  # noqa: F401  (written in lora_merge/version.py only)

_API = {"merge", "to_megatron", "ConvertResult", "verify", "inspect", "export_adapter", "MergeResult", "ExportResult", "VerifyReport",
        "finish", "FinishResult"}
_ERRORS = {"MergeError", "UsageError", "UnsupportedInput", "DamagedInput", "OutputConflict"}
__all__ = sorted(_API | _ERRORS | {"__version__"})


def __getattr__(name: str):
    if name in _API:
        from lora_merge import api
        return getattr(api, name)
    if name in _ERRORS:
        from lora_merge import errors
        return getattr(errors, name)
    raise AttributeError(f"module 'lora_merge' has no attribute {name!r}")
