"""Where a run may write: never onto, above or inside anything it reads.

Every path compared is resolved through symlinks at every level, so a checkpoint whose iteration dir or
rank files are symlinks into another tree counts as that tree, and an `--out` reached through a symlink
counts as where it leads. `--force` never overrides this: it only allows replacing an earlier output or
report of lora-merge (ownership.py).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from lora_merge.errors import OutputConflict
from lora_merge.files.ownership import report_refusal


class InputPaths:
    """The files and directories a run reads, each with every directory on its way resolved."""

    def __init__(self):
        self._paths: dict[Path, str] = {}  # resolved path -> how the user named it (for messages)

    def add(self, path: Path | str | None, shown: str | None = None) -> "InputPaths":
        if path is not None:
            path = Path(path)
            self._paths.setdefault(_resolve(path), shown or str(path))
        return self

    def add_tree(self, root: Path, paths) -> "InputPaths":
        """`root` and each of `paths` below it, with every directory between them (each may be a symlink)."""
        root = Path(root)
        self.add(root)
        for path in paths:
            path = Path(path)
            self.add(path, str(path))
            for parent in path.parents:
                if parent == root or len(parent.parts) <= len(root.parts):
                    break
                self.add(parent)
        return self

    def conflict(self, target: Path) -> str | None:
        """How writing or replacing `target` would touch an input, or None."""
        t = _resolve(target)
        tests = ((lambda s: t == s, "is the input"), (lambda s: t in s.parents, "contains the input"),
                 (lambda s: s in t.parents and s.is_dir(), "lies inside the input directory"))
        for test, relation in tests:  # the most specific relation names the input best
            for source, shown in self._paths.items():
                if test(source):
                    return f"{relation} {shown}"
        return None

    def check(self, target: Path, what: str) -> None:
        problem = self.conflict(target)
        if problem:
            real = _resolve(target)
            via = f" (resolved: {real})" if str(real) != str(Path(target).absolute()) else ""
            raise OutputConflict(f"{target}: the {what}{via} {problem}; choose a path outside every input "
                             "(--force never overrides this)")


def _resolve(path: Path) -> Path:
    # resolve(strict=False) follows every symlink that exists on the way, including a dangling last one.
    return Path(os.path.realpath(path))


def check_report_path(report: Path | None, force: bool, inputs: InputPaths, out: Path | None = None,
                      early: bool = False) -> None:
    """Fail before any work, not after the output is published, when the report cannot or must not be
    written: it must not be an input, and may replace only an earlier report of lora-merge, with --force.
    `early`: only the paths the user gave are known as inputs yet; what an existing file is waits for the full
    check, so that an input reached through a symlink is named as the input it is."""
    if report is None:
        return
    inputs.check(report, "report file")
    inside_out = out is not None and _resolve(report).parent == _resolve(out)
    if out is not None and not inside_out and (_resolve(report) == _resolve(out) or _resolve(out) in _resolve(report).parents):
        raise OutputConflict(f"{report}: the report would be the output directory or inside a subdirectory of it; "
                         "name a file directly inside --out, or elsewhere")
    if os.path.lexists(report) and not inside_out:  # one inside --out goes with the output it is part of
        if os.path.isdir(report) and not os.path.islink(report):
            raise OutputConflict(f"{report}: the report path is a directory; name a file")
        if early:
            return
        refusal = report_refusal(report)
        if refusal:
            raise OutputConflict(refusal)
        if not force:
            raise OutputConflict(f"{report}: already exists: an earlier report of lora-merge (pass --force to replace it)")
    parent = _resolve(report).parent
    if inside_out:
        if OUTPUT_NAME.match(report.name):
            raise OutputConflict(f"{report}: the output writes a file of that name itself; name the report e.g. "
                             "merge-report.json")
        return  # written into the staging directory, published with the output
    if not parent.is_dir():
        raise OutputConflict(f"{report}: the report's directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputConflict(f"{report}: the report's directory {parent} is not writable")


# Names the output may hold besides a report (shards, index, configs, tokenizer files).
OUTPUT_NAME = re.compile(r"^(model.*\.safetensors(\.index\.json)?|adapter_model\.safetensors|(adapter_)?config\.json|"
                         r"generation_config\.json|tokenizer.*|special_tokens_map\.json|vocab\.json|merges\.txt|"
                         r"added_tokens\.json|chat_template\..*|preprocessor_config\.json|.*\.py|README\.md)$")
