"""The in-place torch.save writer: its archives are torch.save's bytes, and torch, zipfile and our own
reader read them, zip64 records included."""

import os
import zipfile
from argparse import Namespace
from collections import OrderedDict

import pytest
import torch

from lora_merge.files.torch_archive import MappedFile, TorchArchive as ReadArchive
from lora_merge.files import torch_zip
from lora_merge.files.torch_zip import TensorSlot, TorchArchive


def values():
    g = torch.Generator().manual_seed(0)
    return OrderedDict(a=torch.randn(3, 5, generator=g), b=torch.randn(7, generator=g).bfloat16(),
                       empty=torch.zeros(0, 4), ints=torch.arange(10), half=torch.randn(2, 2, 2, generator=g).half())


def write(path, vals, name, base=0):
    slots = OrderedDict((k, TensorSlot(tuple(v.shape), v.dtype)) for k, v in vals.items())
    archive = TorchArchive({"args": Namespace(x=1, dtype=torch.bfloat16), "checkpoint_version": 3.0, "model": slots},
                           name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        archive.write_frame(fd, base)
        for k, v in reversed(vals.items()):  # any order: the spans are reserved
            os.pwrite(fd, v.contiguous().view(torch.uint8).numpy().tobytes(), base + archive.data_offset(slots[k]))
        archive.finish(fd, base)
    finally:
        os.close(fd)
    return archive


def test_the_bytes_are_torch_saves_but_for_the_serialization_id(tmp_path):
    vals = values()
    write(tmp_path / "model_optim_rng.pt", vals, "model_optim_rng")
    os.mkdir(tmp_path / "ref")
    torch.save({"args": Namespace(x=1, dtype=torch.bfloat16), "checkpoint_version": 3.0, "model": vals},
               tmp_path / "ref" / "model_optim_rng.pt")
    mine, theirs = (zipfile.ZipFile(p) for p in (tmp_path / "model_optim_rng.pt", tmp_path / "ref" / "model_optim_rng.pt"))
    serial = "model_optim_rng/.data/serialization_id"
    assert [(i.filename, i.header_offset, i.file_size, i.flag_bits) for i in mine.infolist()] == \
        [(i.filename, i.header_offset, i.file_size, i.flag_bits) for i in theirs.infolist()]
    assert all(a.CRC == b.CRC for a, b in zip(mine.infolist(), theirs.infolist()) if a.filename != serial)
    a, b = (tmp_path / "model_optim_rng.pt").read_bytes(), (tmp_path / "ref" / "model_optim_rng.pt").read_bytes()
    differing = [i for i in range(len(a)) if a[i] != b[i]]
    start = mine.getinfo(serial).header_offset  # the id's own bytes, its CRC in descriptor and directory
    assert len(a) == len(b) and differing and all(i >= start for i in differing)
    assert mine.testzip() is None


@pytest.mark.parametrize("limit", [torch_zip.ZIP64_LIMIT, 100])
def test_torch_zipfile_and_our_reader_read_it(tmp_path, monkeypatch, limit):
    monkeypatch.setattr(torch_zip, "ZIP64_LIMIT", limit)  # 100: every size and offset past it takes zip64 fields
    vals, path = values(), tmp_path / "rank.pt"
    with open(path, "wb") as f:
        f.write(b"x" * 333)  # an archive may start inside a file (torch_dist chunks do)
    archive = write(path, vals, "archive", base=333)
    assert os.path.getsize(path) == 333 + archive.size
    whole = path.read_bytes()[333:]
    (tmp_path / "alone.pt").write_bytes(whole)
    assert zipfile.ZipFile(tmp_path / "alone.pt").testzip() is None
    for mmap in (False, True):
        loaded = torch.load(tmp_path / "alone.pt", weights_only=False, mmap=mmap)
        assert loaded["args"] == Namespace(x=1, dtype=torch.bfloat16)
        for k, v in vals.items():
            assert loaded["model"][k].dtype == v.dtype and torch.equal(loaded["model"][k], v), k
    ours = ReadArchive(MappedFile(path), offset=333, length=archive.size)
    for name in ours.records:
        ours.records[name].check_crc()

