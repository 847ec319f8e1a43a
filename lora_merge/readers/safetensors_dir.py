"""An HF model directory's safetensors weights, sharded or not: the index and every shard's header checked
(file names inside the directory, headers as safetensors checks them, index and headers agreeing), tensors
read by name a row range at a time. The one reader of HF weight dirs: an HF base, a reference's weights and an
output being verified all go through it."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from lora_merge.errors import MergeError
from lora_merge.fp8 import SCALE_SUFFIX, check_scales, dequantize_rows, scale_shape
from lora_merge.model.multimodal import Multimodal, Renamed
from lora_merge.readers import safetensors_file
from lora_merge.readers.safetensors_file import Damaged, shown_name

INDEX = "model.safetensors.index.json"
# The index of a 671B model is well under 10 MB; a bigger file is not one, and is not read whole.
MAX_INDEX_BYTES = 64 << 20
class SafetensorsDir:
    """The tensors of an HF model directory (sharded or not), read by name and row range.

    Damage is collected in `problems`, not raised: in an output being verified it is a finding to report,
    in the reference an error in the user's input; the caller decides. Only the index and the shards'
    headers are read here; tensor data is mapped later, a row range at a time. Block-FP8 scales are checked
    when first read: finite and at least 2^-126 (what a quantizer writes), and for an input (`output`
    False) at most fp8.SCALE_MAX too.
    """

    def __init__(self, directory: Path, output: bool = False, multimodal: Multimodal | None = None):
        """`multimodal`: the directory holds such a release; its language model's tensors are read by our names
        (model/multimodal.py), the towers' by their own (`carried`)."""
        self.directory = directory
        self.output = output
        self._scales: dict[str, torch.Tensor] = {}
        self._fp8 = None  # the directory's Fp8Format, once read
        self.problems: list[str] = []
        self.file_of: dict[str, str] = {}  # every tensor listed (by the index, or found in a shard's header)
        self.headers: dict[str, dict[str, tuple[tuple[int, ...], str]]] = {}  # file -> its sound header
        self.checked: dict[str, safetensors_file.Header] = {}  # file -> its header with offsets
        index = directory / INDEX
        listed = self._index(index) if os.path.lexists(index) else None
        found = sorted(p.name for p in directory.glob("*.safetensors"))
        files = found if listed is None else sorted(set(listed.values()))
        for name in files:
            header = self._header(directory / name)
            if header is not None:
                self.checked[name] = header
                self.headers[name] = header.tensors()
        if listed is None:
            self._take_headers(files)
        else:
            self.file_of = listed
            self._compare_with_headers()
        # Only a finding in an output: a reference may hold other weight files (Mistral's consolidated.safetensors).
        self.unlisted = [name for name in found if name not in files]
        self._stored: dict[str, str] = {}  # our name -> the file's, where they differ
        self.carried: set[str] = set()
        if multimodal is not None:
            self._rename(multimodal)

    def _rename(self, kind: Multimodal) -> None:
        renamed, file_of = Renamed(kind), {}
        for name, file in self.file_of.items():
            try:
                mine = renamed.ours(name, str(self.directory / file))
            except MergeError as exc:
                self.problems.append(str(exc))
                continue
            if mine in file_of:
                self.problems.append(f"{self.directory}: holds {mine} twice (once as {name})")
                continue
            file_of[mine] = file
            self._stored[mine] = name
        mine_of = {name: mine for mine, name in self._stored.items()}
        self.file_of, self.carried = file_of, renamed.carried
        self.headers = {file: {mine_of[t]: meta for t, meta in header.items() if t in mine_of}
                        for file, header in self.headers.items()}

    def __bool__(self) -> bool:
        return bool(self.file_of)

    def _index(self, index: Path) -> dict[str, str] | None:
        try:
            return read_index(index)
        except Damaged as exc:
            # The shards are still checked on their own, so one bad index is one problem, not one per tensor.
            self.problems.append(f"{index}: {exc}")
            return None

    def _header(self, path: Path):
        if not os.path.lexists(path):  # only the index names files without seeing them
            self.problems.append(f"{path}: missing (listed in the index)")
            return None
        try:
            return safetensors_file.read_header(path)
        except Damaged as exc:
            self.problems.append(f"{path}: {exc}")
            return None

    def _take_headers(self, files: list[str]) -> None:
        for name in files:
            for tensor in self.headers.get(name, {}):
                if tensor in self.file_of:
                    self.problems.append(f"{_name(tensor)}: in both {self.file_of[tensor]} and {name}")
                self.file_of[tensor] = name

    def _compare_with_headers(self) -> None:
        for tensor, name in self.file_of.items():
            if name in self.headers and tensor not in self.headers[name]:
                self.problems.append(f"{_name(tensor)}: the index puts it in {name}, which does not hold it")
        for name, header in self.headers.items():
            unlisted = sorted(t for t in header if self.file_of.get(t) != name)
            if unlisted:
                shown = ", ".join(map(_name, unlisted[:3])) + (", ..." if len(unlisted) > 3 else "")
                self.problems.append(f"{self.directory / name}: holds {len(unlisted)} tensor(s) the index does "
                                     f"not put there ({shown})")

    def readable(self, name: str) -> bool:
        """Whether `name` is listed and its file and header are sound (a damaged file's tensors are not)."""
        return name in self.headers.get(self.file_of.get(name), {})

    def meta(self, name: str) -> tuple[tuple[int, ...], str]:
        return self.headers[self.file_of[name]][name]

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows of a tensor as stored; of a block-FP8 weight (float8 with a weight_scale_inv beside it),
        dequantized to float32."""
        # Read with the offsets of the header checked when the directory was opened (a read per call:
        # no mapping is kept, so pages read so far do not stay resident).
        rows = safetensors_file.read_rows(self.checked[self.file_of[name]], self._stored.get(name, name), start, stop)
        if self.scales_of(name) is None:
            return rows
        return dequantize_rows(rows, self.scales(name), start, self.fp8_block(name))

    def scales_of(self, name: str) -> str | None:
        """The weight_scale_inv of a float8 weight, if it is one."""
        scales = name + SCALE_SUFFIX
        if self.readable(name) and self.meta(name)[1] == "F8_E4M3" and self.readable(scales):
            return scales
        return None

    def scales(self, name: str) -> torch.Tensor:
        scales = self.scales_of(name)
        if scales not in self._scales:
            header = self.checked[self.file_of[scales]]
            values = safetensors_file.read_rows(header, self._stored.get(scales, scales), 0, self.meta(scales)[0][0]).float()
            check_scales(values, f"{header.path}[{shown_name(scales)}]", bounded=not self.output,
                         pow2=self._fp8_format().pow2)
            self._scales[scales] = values
        return self._scales[scales]

    def _fp8_format(self):
        """The FP8 format the directory's config.json gives (DeepSeek's 128x128 float scales where it gives none)."""
        if self._fp8 is None:
            from lora_merge.fp8 import Fp8Format, read_fp8_config
            from lora_merge.files.small_files import read_json

            config = read_json(self.directory / "config.json") if (self.directory / "config.json").is_file() else {}
            q = config.get("quantization_config") if isinstance(config, dict) else None
            self._fp8 = read_fp8_config(q, self.directory / "config.json") if q is not None else \
                Fp8Format((128, 128), {})
        return self._fp8

    def fp8_block(self, name: str) -> tuple[int, int]:
        """The block size the directory's config.json gives; the scales' shape must fit it."""
        block = self._fp8_format().block
        shape, scale = self.meta(name)[0], self.meta(name + SCALE_SUFFIX)[0]
        if len(shape) != 2 or tuple(scale) != scale_shape(shape, block):
            raise MergeError(f"{self.directory}: {shown_name(name)}: scales of shape {list(scale)} for a weight {list(shape)} in "
                          f"{block[0]}x{block[1]} blocks")
        return block



def read_index(index: Path) -> dict[str, str]:
    """The index's weight_map, each file name checked to stay inside the directory."""
    data = _json(read_bounded(index, MAX_INDEX_BYTES), "")
    if not isinstance(data, dict):
        raise Damaged("not a JSON object; expected one with a weight_map {tensor: file}")
    weight_map = data.get("weight_map")
    if not isinstance(weight_map, dict):
        raise Damaged("no weight_map; expected an object {tensor: file} under that key" if weight_map is None else
                      f"weight_map is a {type(weight_map).__name__}; expected an object {{tensor: file}}")
    for tensor, name in weight_map.items():
        if not isinstance(name, str) or not plain_file_name(name):
            raise Damaged(f"weight_map puts {_name(tensor)} in {_shown(name)}; expected the name of a file in "
                          "this directory")
    return dict(weight_map)


def plain_file_name(name: str) -> bool:
    # Anything else would make verify read outside the directory it was given.
    return (name not in ("", ".", "..") and "/" not in name and "\\" not in name and "\0" not in name
            and not os.path.isabs(name))


_require_file = safetensors_file.require_file


def read_bounded(path: Path, limit: int) -> bytes:
    _require_file(path)
    try:
        with path.open("rb") as f:
            raw = f.read(limit + 1)
    except OSError as exc:
        raise Damaged(f"cannot be read ({exc.strerror or exc})") from exc
    if len(raw) > limit:
        raise Damaged(f"larger than {limit} bytes; not an index")
    return raw


_json = safetensors_file.parse_json
_shown = safetensors_file.shown
_name = safetensors_file.shown_name
