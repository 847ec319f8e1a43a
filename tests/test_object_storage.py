"""Inputs and outputs on object storage, against a real S3-protocol server on localhost (moto's server mode, the
AWS variables set as a user would set them): every input kind read from s3:// and every output kind published to
s3:// gives the bytes a local run gives; data files are read by ranges (what a run does not read is never
transferred); a failed upload leaves nothing; what cannot be done with a URL is refused by name."""

import json
import os
import shutil
import zipfile
from pathlib import Path

import pytest

import lora_merge
from helpers import FIXTURES, downloaded, files, out_dir, quiet, run_failing, upload
from lora_merge.cli import main
from lora_merge.files import remote

TESTS = Path(__file__).parent


def test_a_megatron_base_and_lora_on_s3_merge_to_s3_as_they_merge_locally(s3, tmp_path):
    fixture = FIXTURES / "tp2_fp32_filtered"
    url = upload(s3, fixture, "tp2")
    local = out_dir(tmp_path, "local", "merged")
    lora_merge.merge(base=fixture / "base", lora=fixture / "lora", hf_ref=fixture / "hf_ref", out=local, warn=quiet)
    result = lora_merge.merge(base=f"{url}/base", lora=f"{url}/lora", hf_ref=f"{url}/hf_ref",
                              out="s3://models/out/merged", warn=quiet)
    assert result.out == "s3://models/out/merged"
    assert downloaded(s3, result.out, tmp_path / "got") == files(local)  # the card names the output the same
    # verify reads the output (its card's sha256 of every file, every tensor) from s3:// too
    report = lora_merge.verify(result.out, lora=f"{url}/lora", base=f"{url}/base", hf_ref=f"{url}/hf_ref", warn=quiet)
    assert report.ok and report.statuses, report.problems


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_megatron_output_to_s3_and_a_torch_dist_base_from_s3_are_the_local_bytes(s3, tmp_path, fmt):
    fixture = FIXTURES / "dist_tp2pp2_fp32"
    url = upload(s3, fixture, f"dist-{fmt}")
    local = out_dir(tmp_path, "local", "mg")
    layout = dict(tp=2) if fmt == "torch" else {}
    lora_merge.to_megatron(base=fixture / "base", lora=fixture / "lora", hf_ref=fixture / "hf_ref", out=local,
                           ckpt_format=fmt, warn=quiet, **layout)
    out = f"s3://models/mg-{fmt}/mg"
    lora_merge.to_megatron(base=f"{url}/base", lora=f"{url}/lora", hf_ref=f"{url}/hf_ref", out=out, ckpt_format=fmt,
                           warn=quiet, **layout)
    assert downloaded(s3, out, tmp_path / "got") == files(local)


def test_an_hf_base_and_a_peft_adapter_on_s3_and_the_adapter_exported_to_s3(s3, tmp_path, base_model):
    fixture = FIXTURES / "tp2_fp32_filtered"
    hf_base = base_model("tp2_fp32_filtered")
    adapter = tmp_path / "adapter"
    lora_merge.export_adapter(lora=fixture / "lora", hf_ref=fixture / "hf_ref", out=adapter, warn=quiet)
    lora_merge.export_adapter(lora=upload(s3, fixture / "lora", "exp/lora"), hf_ref=fixture / "hf_ref",
                              out="s3://models/exp/adapter", warn=quiet)
    assert downloaded(s3, "s3://models/exp/adapter", tmp_path / "exported") == files(adapter)

    local = out_dir(tmp_path, "local", "merged")
    lora_merge.merge(base=hf_base, lora=adapter, hf_ref=hf_base, out=local, warn=quiet)
    base_url, adapter_url = upload(s3, hf_base, f"hf/{hf_base.name}"), "s3://models/exp/adapter"
    got = out_dir(tmp_path, "got", "merged")
    lora_merge.merge(base=base_url, lora=adapter_url, hf_ref=base_url, out=got, warn=quiet)
    assert files(got) == files(local)
    report = lora_merge.verify(got, lora=adapter_url, base=base_url, hf_ref=base_url, warn=quiet)
    assert report.ok, report.problems


def test_only_the_bytes_a_run_reads_are_transferred(s3, tmp_path, monkeypatch):
    """A checkpoint's optimizer state beside the model (here 64 MB) is listed but never fetched."""
    root = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "tp2_fp32_filtered", root)
    rank = next((root / "base").glob("iter_*/mp_rank_00"))
    (rank / "distrib_optim.pt").write_bytes(os.urandom(64 << 20))
    url = upload(s3, root, "with-optimizer")
    fetched = []
    original = remote._Lazy._fetch
    monkeypatch.setattr(remote._Lazy, "_fetch", lambda self, piece: (fetched.append((self.url, piece)),
                                                                     original(self, piece))[1])
    lora_merge.merge(base=f"{url}/base", lora=f"{url}/lora", hf_ref=f"{url}/hf_ref", out=tmp_path / "out", warn=quiet)
    assert fetched and not [f for f in fetched if "distrib_optim" in f[0]]
    data = sum(p.stat().st_size for p in (root / "base").rglob("model_optim_rng.pt"))
    assert sum(b - a for _, (a, b) in fetched if "/base/" in _) <= data


def test_optimizer_state_inside_a_legacy_rank_file_is_never_fetched(s3, tmp_path, monkeypatch):
    """Without the distributed optimizer, Megatron saves the optimizer state in model_optim_rng.pt itself (here 48 MB
    per rank beside a few KB of weights): only the members of the tensors merged are fetched, and only once."""
    import torch

    root = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "tp2_fp32_filtered", root)
    model_bytes = 0
    for rank_file in (root / "base").rglob("model_optim_rng.pt"):
        state = torch.load(rank_file, weights_only=False)
        model_bytes += sum(t.nbytes for t in state["model"].values() if isinstance(t, torch.Tensor))
        state["optimizer"] = {"optimizer": {"state": {i: {"exp_avg": torch.randn(1 << 20), "exp_avg_sq": torch.randn(1 << 20)}
                                                      for i in range(6)}}}
        torch.save(state, rank_file)
    url = upload(s3, root, "optimizer-inside")
    fetched = []
    original = remote._Lazy._fetch
    monkeypatch.setattr(remote._Lazy, "_fetch", lambda self, piece: (fetched.append((self.url, piece)),
                                                                     original(self, piece))[1])
    got = out_dir(tmp_path, "got", "merged")
    lora_merge.merge(base=f"{url}/base", lora=f"{url}/lora", hf_ref=f"{url}/hf_ref", out=got, warn=quiet)
    local = out_dir(tmp_path, "local", "merged")
    lora_merge.merge(base=root / "base", lora=root / "lora", hf_ref=root / "hf_ref", out=local, warn=quiet)
    assert files(got) == files(local)
    base = [(name, piece) for name, piece in fetched if "/base/" in name]
    assert len(base) == len(set(base))  # nothing fetched twice
    for rank_file in (root / "base").rglob("model_optim_rng.pt"):
        # each 4 MB optimizer member: at most the pages at its ends, and the file's last 64 KB (where zip readers
        # look for the central directory's end)
        with zipfile.ZipFile(rank_file) as archive:
            for info in archive.infolist():
                if info.file_size >= 1 << 20:
                    start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)
                    ranges = [piece for name, piece in base if name.endswith(str(rank_file.relative_to(root)))]
                    overlap = sum(max(0, min(b, start + info.file_size) - max(a, start)) for a, b in ranges)
                    assert overlap <= 2 * remote.PAGE + (64 << 10), (rank_file, info.filename, overlap)
    assert sum(b - a for _, (a, b) in base) < model_bytes + (1 << 20)


def test_a_url_given_twice_is_one_input(tmp_path, monkeypatch, base_model):
    """An adapter given twice as the same URL is refused as a local one is (each URL had a shadow of its own, so
    the adapter was merged twice); --base and --hf-ref at one URL are listed and fetched once."""
    from lora_merge.errors import UsageError

    fixture = FIXTURES / "tp2_fp32_filtered"
    hf, adapter = base_model("tp2_fp32_filtered"), tmp_path / "adapter"
    lora_merge.export_adapter(lora=fixture / "lora", hf_ref=fixture / "hf_ref", out=adapter, warn=quiet)
    with pytest.raises(UsageError, match="an adapter given twice"):
        lora_merge.merge(base=f"file://{hf}", lora=[f"file://{adapter}", f"file://{adapter}/"], hf_ref=f"file://{hf}",
                         out=tmp_path / "twice", warn=quiet)
    listed = []
    original = remote._objects
    monkeypatch.setattr(remote, "_objects", lambda fs, rpath, url: (listed.append(url), original(fs, rpath, url))[1])
    lora_merge.merge(base=f"file://{hf}", lora=f"file://{adapter}", hf_ref=f"file://{hf}", out=tmp_path / "once",
                     warn=quiet)
    # each listed when its shadow is made and again before publishing (check_inputs_unchanged): two inputs, not three
    assert sorted(listed) == sorted([f"file://{hf}", f"file://{adapter}"] * 2)


def test_a_failed_upload_leaves_no_object_and_says_so(s3, tmp_path, monkeypatch):
    fixture = FIXTURES / "tp2_fp32_filtered"
    import s3fs.core

    upload_chunk = s3fs.core.S3File._upload_chunk

    def failing(self, *args, **kwargs):
        if self.path.endswith("README.md"):  # the last object: everything else is up by then
            raise OSError("connection reset")
        return upload_chunk(self, *args, **kwargs)

    monkeypatch.setattr(s3fs.core.S3File, "_upload_chunk", failing)
    with pytest.raises(lora_merge.MergeError, match=r"s3://models/failed/merged: upload failed .*connection reset.*"
                                                    r"the objects uploaded were removed"):
        lora_merge.merge(base=fixture / "base", lora=fixture / "lora", hf_ref=fixture / "hf_ref",
                         out="s3://models/failed/merged", warn=quiet)
    assert not s3.find("models/failed")


def test_the_command_line_takes_urls_and_storage_options(s3, tmp_path, capsys, monkeypatch):
    fixture = FIXTURES / "tp2_fp32_filtered"
    url = upload(s3, fixture, "cli")
    endpoint = os.environ["AWS_ENDPOINT_URL"]
    monkeypatch.delenv("AWS_ENDPOINT_URL")  # given as a storage option instead
    options = json.dumps({"endpoint_url": endpoint})
    assert main(["--base", f"{url}/base", "--lora", f"{url}/lora", "--hf-ref", f"{url}/hf_ref", "--out",
                 "s3://models/cli-out/merged", "--storage-options", options, "--no-progress"]) == 0
    assert s3.exists("models/cli-out/merged/model.safetensors")
    assert main(["inspect", f"{url}/lora", "--storage-options", options]) == 0
    assert "LoRA" in capsys.readouterr().out
    # an output that already holds objects, named by its URL
    run_failing(["--base", f"{url}/base", "--lora", f"{url}/lora", "--hf-ref", f"{url}/hf_ref", "--out",
                 "s3://models/cli-out/merged", "--storage-options", options, "--no-progress"], capsys,
                "s3://models/cli-out/merged: already holds objects")
    # a damaged input is named by its URL, not by a local shadow
    run_failing(["--base", f"{url}/base", "--lora", f"{url}/nothing-here", "--hf-ref", f"{url}/hf_ref", "--out",
                 str(tmp_path / "o"), "--storage-options", options, "--no-progress"], capsys,
                f"{url}/nothing-here: no objects under it")
    run_failing(["--base", str(fixture / "base"), "--hf-ref", str(fixture / "hf_ref"), "--out", "s3://models/p/merged",
                 "--force", "--storage-options", options, "--no-progress"], capsys,
                "--force with --out s3://models/p/merged: an output at a URL is never written over")
    assert not s3.exists("models/p")


def test_any_fsspec_url_is_an_input(tmp_path):
    """Not only S3: fsspec's in-memory filesystem, as any other backend would be used."""
    import fsspec

    fixture = FIXTURES / "tp2_fp32_filtered"
    mem = fsspec.filesystem("memory")
    mem.put(str(fixture), "/fx", recursive=True)
    local = out_dir(tmp_path, "a", "merged")
    lora_merge.merge(base=fixture / "base", lora=fixture / "lora", hf_ref=fixture / "hf_ref", out=local, warn=quiet)
    got = out_dir(tmp_path, "b", "merged")
    lora_merge.merge(base="memory://fx/base", lora="memory://fx/lora", hf_ref="memory://fx/hf_ref", out=got,
                     warn=quiet)
    assert files(got) == files(local)
    with pytest.raises(lora_merge.MergeError, match="storage_options"):
        lora_merge.merge(base="memory://fx/base", hf_ref=fixture / "hf_ref", out=tmp_path / "c", warn=quiet,
                         storage_options=["not", "a", "dict"])
    with pytest.raises(lora_merge.MergeError, match="the report is written to a local file"):
        lora_merge.merge(base=fixture / "base", hf_ref=fixture / "hf_ref", out=tmp_path / "d", warn=quiet,
                         report="memory://r.json")


def test_a_file_larger_than_a_part_goes_up_in_parts_and_a_failed_one_is_never_committed(s3, tmp_path, monkeypatch):
    import s3fs.core

    monkeypatch.setattr(remote, "UPLOAD_PART_BYTES", 5 << 20)  # S3's smallest part
    data = os.urandom((12 << 20) + 123)
    (tmp_path / "big").write_bytes(data)
    parts = []
    upload_chunk = s3fs.core.S3File._upload_chunk
    monkeypatch.setattr(s3fs.core.S3File, "_upload_chunk",
                        lambda self, *a, **k: (parts.append(self.path), upload_chunk(self, *a, **k))[1])
    remote._upload(s3, tmp_path / "big", "models/parts/big")
    assert s3.cat_file("models/parts/big") == data and len(parts) >= 2  # uploaded as it was read, in parts

    def failing(self, *args, **kwargs):
        if self.offset:  # the second part
            raise OSError("connection reset")
        return upload_chunk(self, *args, **kwargs)

    monkeypatch.setattr(s3fs.core.S3File, "_upload_chunk", failing)
    with pytest.raises(OSError, match="connection reset"):
        remote._upload(s3, tmp_path / "big", "models/parts/failed")
    assert not s3.exists("models/parts/failed")
    assert not s3.list_multipart_uploads("models")  # aborted, not left to cost storage


def test_folder_markers_are_not_files_and_a_url_report_is_refused(s3, tmp_path, capsys):
    """Consoles and tools (AWS, OBS and OSS consoles, rclone, s3a) create zero-byte "folder" keys ending in "/":
    not files of the checkpoint."""
    fixture = FIXTURES / "tp2_fp32_filtered"
    url = upload(s3, fixture, "markers")
    for key in ("markers/lora/", "markers/lora/iter_0000010/", "markers/base/"):
        s3.pipe(f"models/{key}", b"")
    local = out_dir(tmp_path, "local", "merged")
    lora_merge.merge(base=fixture / "base", lora=fixture / "lora", hf_ref=fixture / "hf_ref", out=local, warn=quiet)
    got = out_dir(tmp_path, "got", "merged")
    lora_merge.merge(base=f"{url}/base", lora=f"{url}/lora", hf_ref=f"{url}/hf_ref", out=got, warn=quiet)
    assert files(got) == files(local)
    run_failing(["--base", str(fixture / "base"), "--lora", str(fixture / "lora"), "--hf-ref", str(fixture / "hf_ref"),
                 "--out", str(tmp_path / "r"), "--report", "s3://models/report.json", "--no-progress"], capsys,
                "the report is written to a local file")
    assert not (tmp_path / "r").exists()


def test_an_upload_stopped_by_a_signal_leaves_nothing_and_a_file_url_output_works(tmp_path):
    """The CLI ignores signals once the local output is complete; the upload after it can still be stopped
    (SIGTERM here, as Kubernetes sends it), and what it had uploaded is removed. Other fsspec backends as outputs:
    file:// needs its directories, and has no multipart upload to discard."""
    import signal
    import subprocess
    import sys
    import time

    import tempfile

    fixture = FIXTURES / "tp2_fp32_filtered"
    target = tmp_path / "store"
    shadows = set(Path(tempfile.gettempdir()).glob("lora-merge-remote-*"))
    code = ("import sys, time; from lora_merge.files import remote; upload = remote._upload\n"
            "def slow(*a, **k):\n    time.sleep(0.5); upload(*a, **k)\n"
            "remote._upload = slow\n"
            "from lora_merge.entry import main; sys.exit(main())")
    proc = subprocess.Popen([sys.executable, "-c", code, "--base", str(fixture / "base"), "--lora", str(fixture / "lora"),
                             "--hf-ref", str(fixture / "hf_ref"), "--out", f"file://{target}/merged", "--no-progress"],
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not any(target.rglob("*")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert not list(target.rglob("*")), sorted(target.rglob("*"))  # no file, and no directory made for one
    assert set(Path(tempfile.gettempdir()).glob("lora-merge-remote-*")) == shadows  # its local staging removed
    # the same output, not stopped
    lora_merge.merge(base=fixture / "base", lora=fixture / "lora", hf_ref=fixture / "hf_ref",
                     out=f"file://{target}/merged", warn=quiet)
    local = out_dir(tmp_path, "local", "merged")
    lora_merge.merge(base=fixture / "base", lora=fixture / "lora", hf_ref=fixture / "hf_ref", out=local, warn=quiet)
    assert files(target / "merged") == files(local)


def test_reports_name_url_inputs_by_their_urls(tmp_path):
    """The merge's and verify's reports say where the inputs were: the URLs, never a local shadow."""
    import fsspec

    fixture = FIXTURES / "tp2_fp32_filtered"
    fsspec.filesystem("memory").put(str(fixture), "/reports", recursive=True)
    urls = dict(base="memory://reports/base", lora="memory://reports/lora", hf_ref="memory://reports/hf_ref")
    out = tmp_path / "merged"
    lora_merge.merge(**urls, out=out, report=tmp_path / "merge.json", warn=quiet)
    lora_merge.verify(out, **urls, report=tmp_path / "verify.json", warn=quiet)
    for name in ("merge.json", "verify.json"):
        report = json.loads((tmp_path / name).read_text())
        assert report["inputs"]["base"]["path"] == urls["base"] and report["inputs"]["lora"]["path"] == urls["lora"]
        assert report["inputs"]["hf_ref"] == urls["hf_ref"]
        assert "lora-merge-remote-" not in (tmp_path / name).read_text()


def test_what_the_command_prints_names_url_inputs_by_their_urls(tmp_path, capsys):
    import fsspec

    fixture = FIXTURES / "tp2_fp32_filtered"
    fsspec.filesystem("memory").put(str(fixture), "/printed", recursive=True)
    given = ["--base", "memory://printed/base", "--lora", "memory://printed/lora", "--hf-ref", "memory://printed/hf_ref",
             "--no-progress", "-v"]
    assert main([*given, "--out", str(tmp_path / "o"), "--verify"]) == 0
    assert main([*given, "--out", str(tmp_path / "p"), "--dry-run"]) == 0
    assert main([*given, "--out", str(tmp_path / "q"), "--to", "megatron"]) == 0
    assert main(["verify", str(tmp_path / "o"), *given[:6]]) == 0
    printed = capsys.readouterr()
    assert "memory://printed/base" in printed.out and "lora-merge-remote-" not in printed.out + printed.err


def test_the_input_check_before_publishing_is_the_runs_own(tmp_path):
    """API calls in two threads: an input of one run rewritten stops that run, not a run in another thread."""
    import threading

    import fsspec

    mem = fsspec.filesystem("memory")
    mem.pipe("/own/a/config.json", b"{}")
    outcome = {}
    opened, changed = threading.Event(), threading.Event()

    def other_run():
        with remote.RemoteRun() as run:
            run.input("memory://own/a")
            opened.set()
            changed.wait(10)
            try:
                remote.check_inputs_unchanged()
            except lora_merge.MergeError as exc:
                outcome["other"] = str(exc)

    thread = threading.Thread(target=other_run)
    thread.start()
    opened.wait(10)
    mem.pipe("/own/a/config.json", b'{"changed": 1}')
    with remote.RemoteRun() as mine:
        mine.input("memory://own/a")  # listed after the change: this run read the new object
        remote.check_inputs_unchanged()
    changed.set()
    thread.join()
    assert outcome["other"].startswith("memory://own/a/config.json: was written again")
