"""Inputs at a URL are read through sparse local shadow files; each range is handed back (punched out) once every
read of it the run planned is done, so the local disk holds about the read-ahead distance, not the model: the
counting of reads, the punching, a range read again after it, and whole runs from a real S3-protocol server."""

import os
import threading
import zipfile
from functools import partial
from pathlib import Path

import pytest
import torch

import lora_merge
from helpers import FIXTURES, files, out_dir, quiet, random_hf_model, upload
from lora_merge import integrity, merge_pipeline
from lora_merge.files import handback, prefetch, remote
from test_prefetch import _File, _Ref  # a file and a tensor reference as the span readers see them

PAGE = remote.PAGE


def test_a_range_is_handed_back_once_its_last_counted_read_is_done(monkeypatch):
    given = []
    monkeypatch.setattr(remote, "is_shadow", lambda p: p != "local")
    monkeypatch.setattr(remote, "hand_back", lambda path, a, b: given.append((path, a, b)))
    f, local = _File("f"), _File("local")
    back = handback.Handback()
    first = back.reads([_Ref((f, 0, PAGE), (f, PAGE, PAGE), (local, 0, 10))])
    second = back.reads([_Ref((f, PAGE, PAGE))])  # the same tensor read by a second task
    crc = back.reads([_Ref((f, 0, 2 * PAGE))])  # and the CRC32 checker over both
    assert back.reads([_Ref((local, 0, 10))]) is None  # a local file is not counted
    first.done()
    first.done()  # at most once
    second.done()
    back.close()
    assert given == []  # the checker still has to read them
    crc.done()  # after close: handed back at once
    assert given == [("f", 0, 2 * PAGE)]


def test_pages_shared_with_neighbours_wait_for_them_and_uncounted_bytes_are_never_handed_back(monkeypatch):
    given = []
    monkeypatch.setattr(remote, "is_shadow", lambda p: True)
    monkeypatch.setattr(remote, "hand_back", lambda path, a, b: given.append((a, b)))
    f, half = _File("f"), PAGE // 2
    back = handback.Handback()
    # a and b share page 1; [3P, 3.5P) is never counted (a zip header, a pickle), and c shares page 3 with it
    a, b, c = (back.reads([_Ref((f, start, end - start))]) for start, end in
               ((0, PAGE + half), (PAGE + half, 3 * PAGE), (3 * PAGE + half, 5 * PAGE)))
    small = back.reads([_Ref((f, 6 * PAGE + 10, 100))])  # a tensor inside one page, alone
    back.close()
    b.done()
    a.done()
    c.done()
    small.done()
    assert given == [(2 * PAGE, 3 * PAGE), (0, 2 * PAGE), (4 * PAGE, 5 * PAGE)]


def _shadow(tmp_path, data: bytes) -> remote._Lazy:
    """A real sparse shadow file of `data` (served by fsspec's local file system), registered as remote does."""
    import fsspec

    source = tmp_path / "object"
    source.write_bytes(data)
    shadow = tmp_path / "shadow"
    with shadow.open("wb") as f:
        f.truncate(len(data))
    lazy = remote._Lazy(fsspec.filesystem("file"), str(source), "s3://b/object", len(data), shadow)
    remote._LAZY[str(shadow)] = lazy
    return lazy


def _allocated(path) -> int:
    return os.stat(path).st_blocks * 512


def test_a_handed_back_range_frees_its_disk_and_is_fetched_again_when_read_again(tmp_path, monkeypatch):
    data = os.urandom(64 * PAGE + 100)
    lazy = _shadow(tmp_path, data)
    try:
        remote.ensure(lazy.path, 0, len(data))
        assert _allocated(lazy.path) >= len(data) - PAGE
        with open(lazy.path, "rb") as f:  # a mapping of the file, as the readers keep, sees the hole then the bytes
            mapped = torch.from_file(str(lazy.path), shared=False, size=len(data), dtype=torch.uint8)
        remote.hand_back(lazy.path, 10, 40 * PAGE + 5)  # whole pages only: [1, 40)
        assert lazy.gone == [[PAGE, 40 * PAGE]]
        assert _allocated(lazy.path) <= len(data) - 38 * PAGE
        assert bytes(mapped[PAGE:2 * PAGE].numpy()) == bytes(PAGE)  # punched
        fetched = []
        original = lazy._fetch
        monkeypatch.setattr(lazy, "_fetch", lambda piece: (fetched.append(piece), original(piece))[1])
        remote.ensure(lazy.path, 0, 50 * PAGE, ahead=True)  # reading ahead: a range handed back stays so
        assert fetched == []
        remote.ensure(lazy.path, 5 * PAGE, 3)  # read again (a verification after the merge): fetched again
        assert fetched == [(5 * PAGE, 6 * PAGE)]
        assert bytes(mapped[5 * PAGE: 6 * PAGE].numpy()) == data[5 * PAGE: 6 * PAGE]
        with open(lazy.path, "rb") as f:
            f.seek(5 * PAGE)
            assert f.read(PAGE) == data[5 * PAGE: 6 * PAGE]
        remote.hand_back(lazy.path, 60 * PAGE, len(data))  # to the end: the last partial page too
        assert lazy.gone[-1] == [60 * PAGE, len(data)]
    finally:
        remote._LAZY.pop(str(lazy.path), None)


def test_what_planning_fetched_that_the_merge_will_not_read_is_handed_back_before_it_starts(tmp_path):
    """A copy compared with its original while planning (a tied embedding's last-stage copy, an unfiltered LoRA
    checkpoint's own base), headers and pickles: fetched, never counted, handed back before the merge starts; the
    counted ranges stay for their reads, and a shadow file the merge reads nothing of is not touched."""
    data = os.urandom(40 * PAGE)
    lazy = _shadow(tmp_path, data)
    try:
        remote.ensure(lazy.path, 0, len(data))  # all of it read while planning
        back = handback.Handback()
        f = _File(str(lazy.path))
        reads = back.reads([_Ref((f, 10 * PAGE + 100, 10 * PAGE))])  # the one tensor the merge reads
        back.release_unread()
        # whole pages outside it: [0, 10P) and [21P, 40P); its own pages and the two it shares stay
        assert lazy.gone == [[0, 10 * PAGE], [21 * PAGE, 40 * PAGE]]
        assert lazy.have == [[10 * PAGE, 21 * PAGE]]
        reads.done()
        back.close()
        assert lazy.gone == [[0, 40 * PAGE]] and lazy.have == []
    finally:
        remote._LAZY.pop(str(lazy.path), None)


def test_a_file_system_without_holes_keeps_the_bytes(tmp_path, monkeypatch):
    data = os.urandom(8 * PAGE)
    lazy = _shadow(tmp_path, data)
    try:
        remote.ensure(lazy.path, 0, len(data))
        monkeypatch.setattr(remote, "_punch_hole", lambda *a: False)
        remote.hand_back(lazy.path, 0, len(data))
        assert not lazy.punches and lazy.gone == [] and lazy.have == [[0, len(data)]]
        assert Path(lazy.path).read_bytes() == data
    finally:
        remote._LAZY.pop(str(lazy.path), None)


def _watched(monkeypatch):
    """The peak and final disk use of the shadow files of URL inputs: sampled after every fetch, and when the
    run's shadow is removed; and what was fetched."""
    seen = {"peak": 0, "end": None, "fetched": 0}
    lock = threading.Lock()

    def used():
        return sum(_allocated(lazy.path) for lazy in list(remote._LAZY.values()) if os.path.exists(lazy.path))

    fetch = remote._Lazy._fetch

    def watched_fetch(self, piece):
        fetch(self, piece)
        with lock:
            seen["fetched"] += piece[1] - piece[0]
            seen["peak"] = max(seen["peak"], used())
    close = remote.RemoteRun.close

    def watched_close(self):
        if seen["end"] is None:
            seen["end"] = used()
            seen["have"] = {Path(lazy.path).relative_to(self.root).as_posix().split("/", 1)[1]: lazy.have
                            for lazy in remote._LAZY.values() if Path(lazy.path).is_relative_to(self.root)}
        close(self)
    monkeypatch.setattr(remote._Lazy, "_fetch", watched_fetch)
    monkeypatch.setattr(remote.RemoteRun, "close", watched_close)
    return seen


def _short_leads(monkeypatch, lead: int):
    monkeypatch.setattr(integrity, "LEAD_BYTES", lead)
    monkeypatch.setattr(merge_pipeline, "Prefetcher", partial(prefetch.Prefetcher, lead=lead))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A 12 MB bf16 Llama in 3 shards and a PEFT adapter of it."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    root = tmp_path_factory.mktemp("llama")
    config = LlamaConfig(hidden_size=256, intermediate_size=768, num_hidden_layers=6, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=2048, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_pretrained(random_hf_model(config, root / "one-file"), dtype=torch.bfloat16)
    model.save_pretrained(root / "base", max_shard_size="5MB")
    torch.manual_seed(1)
    peft = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"],
                                            init_lora_weights=False))
    peft.save_pretrained(root / "adapter")
    return root


def test_an_hf_base_from_s3_is_handed_back_as_it_is_merged(s3, tmp_path, monkeypatch, llama):
    """With reading ahead cut to 1 MB, the shadow of a 12 MB base never holds more than a third of it and ends
    nearly empty, with the local run's output."""
    url = upload(s3, llama, "handback")
    local = out_dir(tmp_path, "local", "merged")
    lora_merge.merge(base=llama / "base", lora=llama / "adapter", hf_ref=llama / "base", out=local, warn=quiet)
    _short_leads(monkeypatch, 1 << 20)
    seen = _watched(monkeypatch)
    got = out_dir(tmp_path, "got", "merged")
    lora_merge.merge(base=f"{url}/base", lora=f"{url}/adapter", hf_ref=f"{url}/base", out=got, warn=quiet, workers=2)
    assert files(got) == files(local)
    model = sum(p.stat().st_size for p in (llama / "base").glob("*.safetensors"))
    assert model <= seen["fetched"] < model + (1 << 20)  # each tensor once (and the adapter)
    assert seen["peak"] < model / 3, seen
    assert seen["end"] < model / 20, seen


def test_what_is_read_again_after_it_was_handed_back_is_fetched_again(s3, tmp_path, monkeypatch, llama):
    """`verify=True` reads the base again to check the merged model before publishing: what the merge handed back
    is fetched again, and the check passes on the same bytes."""
    url = upload(s3, llama, "handback-verify")
    local = out_dir(tmp_path, "local", "merged")
    lora_merge.merge(base=llama / "base", lora=llama / "adapter", hf_ref=llama / "base", out=local, warn=quiet)
    seen = _watched(monkeypatch)
    given = []
    original = remote.hand_back
    monkeypatch.setattr(remote, "hand_back", lambda *a: (given.append(a), original(*a))[1])
    got = out_dir(tmp_path, "got", "merged")
    lora_merge.merge(base=f"{url}/base", lora=f"{url}/adapter", hf_ref=f"{url}/base", out=got, warn=quiet,
                     verify=True)
    assert given and files(got) == files(local)
    model = sum(p.stat().st_size for p in (llama / "base").glob("*.safetensors"))
    assert seen["fetched"] > 1.5 * model


def _url(path: Path) -> str:
    return f"file://{path}"  # ranged reads through fsspec, the same shadows as s3://, no server


def _no_whole_page_of_a_tensor_left(root: Path, have: dict, which=("base/", "lora/")) -> int:
    """No whole page of a tensor's bytes is left in the shadows of the files under `which`: legacy members (but those
    in the last 64 KB, where zip readers look for the directory), `.distcp` chunks (at most the pages at the file's
    ends). Returns how many tensors were looked at."""
    checked = 0
    for name, ranges in have.items():
        path = root / name
        if not name.startswith(which):
            continue
        if path.suffix == ".distcp":
            assert sum(b - a for a, b in ranges) <= 2 * PAGE, (name, ranges)
            checked += 1
        elif path.suffix == ".pt" and zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as archive:
                for info in archive.infolist():
                    start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)
                    first, last = -(-start // PAGE) * PAGE, (start + info.file_size) // PAGE * PAGE
                    if "/data/" in info.filename and last - first >= PAGE and last <= path.stat().st_size - (64 << 10):
                        assert not any(a < last and first < b for a, b in ranges), (name, info.filename, ranges)
                        checked += 1
    return checked


@pytest.mark.parametrize("fixture", ["tp2_fp32_filtered", "dist_tp2pp2_fp32", "tied_pp2_llama_fp32",
                                     "tp2pp2_bf16_unfiltered"])
def test_megatron_checkpoints_from_urls_are_handed_back(s3, tmp_path, monkeypatch, fixture):
    """Legacy rank files (a member per tensor) and torch_dist chunks: by the end of the merge, nothing of them is
    left on the local disk, with the local bytes written. That includes what planning read and the merge does not:
    the last pipeline stage's copy of a tied embedding (compared with the first's), an unfiltered LoRA checkpoint's
    own base weights (compared with --base), pickles, zip directories."""
    root = FIXTURES / fixture
    url = upload(s3, root, f"handback-{fixture}")
    local = out_dir(tmp_path, "local", "merged")
    lora_merge.merge(base=root / "base", lora=root / "lora", hf_ref=root / "hf_ref", out=local, warn=quiet)
    seen = _watched(monkeypatch)
    got = out_dir(tmp_path, "got", "merged")
    lora_merge.merge(base=f"{url}/base", lora=f"{url}/lora", hf_ref=f"{url}/hf_ref", out=got, warn=quiet)
    assert files(got) == files(local)
    assert _no_whole_page_of_a_tensor_left(root, seen["have"]) >= 4
    # nor any other byte of a file the merge reads: the pickles, headers and zip directories read while planning
    # were handed back before it started, and the pages they share with tensors with those (common.pt, read while
    # planning only, stays)
    left = {name: ranges for name, ranges in seen["have"].items() if ranges and not name.endswith("common.pt")}
    assert not left, left


@pytest.mark.parametrize("fixture", ["dist_tp2pp2_fp32", "dist_singleton_tp2_fp32", "bridge_tp2_fp32"])
def test_torch_dist_chunks_handed_back_are_fetched_again_when_verified(tmp_path, monkeypatch, fixture):
    """`verify=True` reads a torch_dist base again after the merge handed its chunks back: a chunk opened once is
    made readable again on every load (it read the hole's zeros, and verification failed, before)."""
    root = FIXTURES / fixture
    local = out_dir(tmp_path, "local", "merged")
    lora_merge.merge(base=root / "base", lora=root / "lora", hf_ref=root / "hf_ref", out=local, warn=quiet)
    _short_leads(monkeypatch, 0)
    given = []
    original = remote.hand_back
    monkeypatch.setattr(remote, "hand_back", lambda *a: (given.append(a), original(*a))[1])
    got = out_dir(tmp_path, "got", "merged")
    lora_merge.merge(base=_url(root / "base"), lora=_url(root / "lora"), hf_ref=_url(root / "hf_ref"), out=got,
                     warn=quiet, verify=True)
    assert any(".distcp" in str(a[0]) for a in given)
    assert files(got).keys() == files(local).keys()
    assert all(files(got)[k] == v for k, v in files(local).items() if k != "README.md")  # (the card names the URLs)


def test_several_adapters_from_urls_are_counted_and_handed_back(tmp_path, monkeypatch, llama):
    """Several PEFT adapters summed into one change per tensor: their factors' reads are counted as theirs."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    second = tmp_path / "second"
    torch.manual_seed(2)
    model = AutoModelForCausalLM.from_pretrained(llama / "base", dtype=torch.bfloat16)
    get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"], init_lora_weights=False)
                   ).save_pretrained(second)
    args = dict(lora_weights=[0.7, 0.3], warn=quiet)
    local = out_dir(tmp_path, "local", "merged")
    lora_merge.merge(base=llama / "base", lora=[llama / "adapter", second], hf_ref=llama / "base", out=local, **args)
    seen = _watched(monkeypatch)
    got = out_dir(tmp_path, "got", "merged")
    lora_merge.merge(base=_url(llama / "base"), lora=[_url(llama / "adapter"), _url(second)],
                     hf_ref=_url(llama / "base"), out=got, **args)
    assert {k: v for k, v in files(got).items() if k != "README.md"} == \
        {k: v for k, v in files(local).items() if k != "README.md"}
    adapters = {name: ranges for name, ranges in seen["have"].items() if name.endswith("adapter_model.safetensors")}
    assert len(adapters) == 2
    for name, ranges in adapters.items():
        header = 8 + int.from_bytes((llama / "adapter" / "adapter_model.safetensors").read_bytes()[:8], "little") \
            if "second" not in name else 8 + int.from_bytes((second / "adapter_model.safetensors").read_bytes()[:8],
                                                            "little")
        assert sum(b - a for a, b in ranges) <= header + 4 * PAGE, (name, ranges)
