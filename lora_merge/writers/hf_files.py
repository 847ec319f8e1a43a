"""Copy every non-weight file of the reference model (tokenizer of any kind, generation config, chat
templates, remote code, preprocessor configs, LICENSE, NOTICE, ...) into the output, and write the
output's own config.json (the reference's, with the dtype set to the output's).

What is left out, and why (each name is listed in the --report with its reason):
- weight files and their indexes (`WEIGHT_SUFFIXES`): the output's weights are the merged ones; the
  reference's, in any format, would be the unmerged base under another name (pytorch_model.bin beside
  model.safetensors: transformers would pick one of them), and pickled formats are code a loader runs;
- config.json and README.md: the output writes its own (adjusted config, model card);
- adapter_config.json: in a model directory it makes transformers load the directory as a PEFT adapter;
- hidden entries (.git, .gitattributes, .cache/huggingface from `hf download --local-dir`, .DS_Store):
  about the repository or the download, not the model;
- subdirectories, except `additional_chat_templates/` (transformers' tokenizer reads named chat templates
  from it): transformers reads a model, its tokenizer and remote code from the top level only. What sits in
  subdirectories is other formats of the *unmerged* weights (Llama's original/consolidated.*.pth, onnx/,
  openvino/), or pictures and code of the original repository's card and tooling (figures/, inference/).

Only regular files are copied (a symlink counts as what it leads to, as in the HF cache, where every file
is a link into ../../blobs/). A broken symlink, a FIFO, a device or a socket where a file would be copied
stops the run with one line: a file that went missing on the way would make the output tokenize
differently, or not load, without a word.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from lora_merge.files import remote
from lora_merge.errors import MergeError
from lora_merge.files.small_files import read_bytes
from lora_merge.writers.model_card import card_reports

COPY_CHUNK = 1 << 20

# Weight formats HF model repositories hold: safetensors (also Mistral's consolidated.safetensors),
# torch pickles (pytorch_model*.bin, *.pt, *.pth, *.ckpt; training_args.bin too), GGUF/GGML, TensorFlow
# (tf_model.h5, *.keras, *.tflite), Flax (flax_model.msgpack), ONNX (+ external data), rust-bert (*.ot),
# NeMo, PaddlePaddle, torch.distributed checkpoints. An index is NAME.index.json for one of these.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".ggml", ".h5", ".keras", ".tflite",
                   ".msgpack", ".onnx", ".onnx_data", ".ot", ".nemo", ".pdparams", ".distcp")
INDEX_SUFFIX = ".index.json"
# Subdirectories transformers reads from a model directory (tokenization_utils_base: CHAT_TEMPLATE_DIR).
COPIED_SUBDIRS = ("additional_chat_templates",)
WRITTEN_BY_US = {"config.json": "the output's own config.json is written (the reference's, dtype adjusted)",
                 "readme.md": "the output's own model card README.md is written"}
ADAPTER_CONFIG = "adapter_config.json"

REASON_WEIGHTS = "weights: the output holds the merged weights, never the reference's"
REASON_INDEX = "index of the reference's weights"
REASON_ADAPTER = "a PEFT adapter's config: in the merged model it would make transformers load it as an adapter"
REASON_HIDDEN = "hidden: repository or download metadata (.git, .gitattributes, .cache), not the model"
REASON_OLD_REPORT = "the --report of the lora-merge run that wrote the reference (its model card says so)"
REASON_SUBDIR = ("a subdirectory: transformers reads a model, its tokenizer and code from the top level "
                 "(subdirectories hold other formats of the unmerged weights, or the original card's files)")
# Left-out reasons a user would not expect, printed as a note (weights, hidden files and the files the
# output writes itself are left out as every user expects).
NOTED = (REASON_ADAPTER, REASON_SUBDIR, REASON_OLD_REPORT)


@dataclass
class ReferenceFiles:
    """The reference's files as the output will hold them: names relative to `directory` (a file in a
    copied subdirectory as "additional_chat_templates/x.jinja")."""

    directory: Path
    copied: dict[str, int] = field(default_factory=dict)  # name -> size in bytes
    left_out: dict[str, str] = field(default_factory=dict)  # name (a directory with a trailing "/") -> reason

    @property
    def total_bytes(self) -> int:
        return sum(self.copied.values())

    def notes(self) -> list[str]:
        """One line per unexpected reason, naming what it left out."""
        lines = []
        for reason in NOTED:
            names = sorted(name for name, why in self.left_out.items() if why == reason)
            if names:
                shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
                lines.append(f"{self.directory}: not copied to the output: {shown} ({reason})")
        return lines


def weight_file(name: str) -> bool:
    lower = name.lower()
    return lower.endswith(WEIGHT_SUFFIXES) or (lower.endswith(INDEX_SUFFIX)
                                               and lower[: -len(INDEX_SUFFIX)].endswith(WEIGHT_SUFFIXES))


def _left_out_reason(name: str, is_dir: bool) -> str | None:
    """Why a top-level entry is not copied, or None when it is (or is an error to find out later)."""
    if name.startswith("."):
        return REASON_HIDDEN
    if is_dir:
        return None if name in COPIED_SUBDIRS else REASON_SUBDIR
    lower = name.lower()
    if lower in WRITTEN_BY_US:
        return WRITTEN_BY_US[lower]
    if lower.endswith(INDEX_SUFFIX) and weight_file(name):
        return REASON_INDEX
    if weight_file(name):
        return REASON_WEIGHTS
    if lower == ADAPTER_CONFIG:
        return REASON_ADAPTER
    return None


def reference_files(hf_dir: Path) -> ReferenceFiles:
    """What of `hf_dir` the output holds, each file checked to be a readable regular file (opened, so that a
    file that cannot be copied stops the run before any shard is written)."""
    found = ReferenceFiles(Path(hf_dir))
    reports = _earlier_reports(found.directory)
    for name, path in _entries(found.directory):
        if name in reports:
            found.left_out[name] = REASON_OLD_REPORT
            continue
        is_dir = path.is_dir()  # follows a symlink: a link to a directory is a subdirectory
        reason = _left_out_reason(name, is_dir)
        if reason is not None:
            found.left_out[name + "/" if is_dir else name] = reason
        elif is_dir:
            for inner, inner_path in _entries(path):
                relative = f"{name}/{inner}"
                if inner.startswith(".") or inner_path.is_dir():
                    found.left_out[relative + ("/" if inner_path.is_dir() else "")] = (
                        REASON_HIDDEN if inner.startswith(".") else REASON_SUBDIR)
                elif weight_file(inner):
                    found.left_out[relative] = REASON_WEIGHTS
                else:
                    found.copied[relative] = _copied_size(inner_path)
        else:
            found.copied[name] = _copied_size(path)
    return found


def _earlier_reports(directory: Path) -> set[str]:
    """A reference that is itself an output of lora-merge may hold that run's --report: not this model's."""
    card = directory / "README.md"
    if not card.is_file():
        return set()
    try:  # a card that cannot be read names no report: it is copied or refused like any other file
        return card_reports(read_bytes(card, "README.md").decode("utf-8", errors="replace"))
    except MergeError:
        return set()


def _entries(directory: Path) -> list[tuple[str, Path]]:
    try:
        names = sorted(os.listdir(directory))
    except OSError as exc:
        raise MergeError(f"{directory}: cannot be listed ({exc.strerror or exc}); the reference's files are "
                         "copied to the output") from exc
    return [(name, directory / name) for name in names]


def _copied_size(path: Path) -> int:
    """The size of a file to copy, once checked to be a readable regular file with a name a card can list."""
    if not path.name.isprintable():  # also False for the surrogates that stand for non-UTF-8 bytes
        raise MergeError(f"{path.parent}: holds a file whose name is not printable text ({ascii(path.name)}); "
                         "rename or remove it (the output lists every file it copies by name)")
    return _checked_size(path)


def _open_regular(path: Path) -> int:
    """An fd of the regular file `path` leads to. O_NONBLOCK: opening a FIFO must not wait for a writer;
    the type is checked on the open file, so a file swapped meanwhile cannot slip through."""
    if path.is_symlink() and not path.exists():
        raise MergeError(f"{path}: broken symlink (to {os.readlink(path)}); the reference file cannot be copied "
                         "to the output: restore it or remove the link")
    try:
        _require_regular(path, os.stat(path).st_mode)  # a socket cannot even be opened
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise MergeError(f"{path}: cannot be read ({exc.strerror or exc}); the reference file must be readable "
                         "to be copied") from exc
    try:
        _require_regular(path, os.fstat(fd).st_mode)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _require_regular(path: Path, mode: int) -> None:
    if not stat.S_ISREG(mode):
        kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else
                "a socket" if stat.S_ISSOCK(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
                else "of an unknown kind")
        raise MergeError(f"{path}: {kind}, not a regular file; every non-weight file of the reference is copied "
                         "to the output: replace it with the file, or remove it")


def _checked_size(path: Path) -> int:
    fd = _open_regular(path)
    try:
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def copy_reference_files(hf_dir: Path, out_dir: Path, config: dict, dtype) -> list[str]:
    """Write the output's config.json and copy the reference's files (`reference_files`) into `out_dir`;
    returns the names written."""
    config = dict(config)
    keys = [k for k in ("dtype", "torch_dtype") if k in config] or ["torch_dtype"]
    for key in keys:
        config[key] = str(dtype).removeprefix("torch.")  # float32, bfloat16, float16
    for name, sub in config.items():  # a multimodal release's text_config and vision_config say it too
        if isinstance(sub, dict) and any(k in sub for k in ("dtype", "torch_dtype")):
            config[name] = {**sub, **{k: str(dtype).removeprefix("torch.") for k in ("dtype", "torch_dtype") if k in sub}}
    with (out_dir / "config.json").open("x") as f:
        f.write(json.dumps(config, indent=2, sort_keys=True) + "\n")
    written = ["config.json"]
    for name in reference_files(hf_dir).copied:
        if "/" in name:
            (out_dir / name).parent.mkdir(exist_ok=True)
        _copy_content(Path(hf_dir) / name, out_dir / name)
        written.append(name)
    return written


def _copy_content(src: Path, dst: Path) -> None:
    """Copy what `src` leads to as a regular file, streaming (no size cap: nothing is parsed, and every
    byte was counted in the free-space check).

    Read errors name the reference file; write errors stay OSErrors (disk full is about the output).
    """
    fd = _open_regular(src)
    remote.ensure_whole(src)  # (a reference at a URL: fetched first if it is read by ranges)
    with os.fdopen(fd, "rb") as fsrc, dst.open("xb") as fdst:  # "x": never write through something at dst
        while True:
            try:
                chunk = fsrc.read(COPY_CHUNK)
            except OSError as exc:
                raise MergeError(f"{src}: read failed ({exc.strerror or exc}); the reference file must be "
                                 "readable to be copied") from exc
            if not chunk:
                return
            fdst.write(chunk)
