"""The guarantees a merge tool owes a user who hands it the only copy of weeks of training, one class each:
inputs are never written, publishing is honest, two runs never share an output, killed runs leave
nothing, hostile files cannot blow up memory, damaged data is caught, options say what they do.

Every failing case checks the message, the exit code, that no input changed (sha256 of every file under
the inputs) and that no output, staging dir or side file was left behind.
"""

import hashlib
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch

from helpers import FIXTURES, copied_args, copy_fixture, merge_args, rank_files, rewrite, run_failing, set_value
from lora_merge.cli import main

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from synthetic_checkpoint import write_checkpoint  # noqa: E402


def tree_hashes(*roots: Path) -> dict:
    """sha256 of every file under the roots (through symlinks), and where every symlink points."""
    found = {}
    for root in roots:
        for path in sorted(Path(root).rglob("*")):
            if path.is_symlink():
                found[f"{path} ->"] = os.readlink(path)
            if path.is_file():
                found[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def leftovers(parent: Path, name: str) -> list:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(f".{name}."))


def assert_clean(out: Path) -> None:
    assert not os.path.lexists(out), f"{out} was written"
    assert leftovers(out.parent, out.name) == []


# --- 1. no input is ever written, replaced or deleted ------------------------------------------------

@pytest.fixture
def linked(tmp_path):
    """A LoRA checkpoint whose iteration dir is a symlink into another tree and whose rank files are
    symlinks into a blob store, as copies made with `cp -s` or an object-store mount look."""
    root = copy_fixture("tp2_fp32_filtered", tmp_path)
    real, blobs = tmp_path / "real", tmp_path / "blobs"
    real.mkdir()
    blobs.mkdir()
    it = root / "lora" / "iter_0000010"
    for i, rank_file in enumerate(sorted(it.glob("mp_rank_*/model_optim_rng.pt"))):
        blob = blobs / f"blob{i}"
        rank_file.rename(blob)
        rank_file.symlink_to(blob)
    it.rename(real / "iter_0000010")
    it.symlink_to(real / "iter_0000010")
    return root, real, blobs


def test_writes_never_touch_inputs_reached_through_symlinks(linked, tmp_path, capsys):
    root, real, blobs = linked
    (tmp_path / "out_link").symlink_to(root / "lora")
    before = tree_hashes(root, real, blobs)
    args = ["--base", str(root / "base"), "--lora", str(root / "lora"), "--hf-ref", str(root / "hf_ref"),
            "--force", "--no-progress"]
    cases = [
        (["--out", str(real)], "contains the input"),  # where the iteration dir really is
        (["--out", str(blobs)], "contains the input"),  # where the rank files really are
        (["--out", str(real / "iter_0000010")], "is the input"),
        (["--out", str(tmp_path / "out_link")], "is the input"),  # --out itself a symlink to an input
        (["--out", str(root / "hf_ref" / "merged")], "inside the input directory"),
        (["--out", str(tmp_path / "ok"), "--report", str(blobs / "blob0")], "report file"),
        (["--out", str(tmp_path / "ok"), "--report",
          str(root / "lora" / "iter_0000010" / "mp_rank_00" / "model_optim_rng.pt")], "the input"),
        (["--out", str(tmp_path / "ok"), "--report", str(root / "hf_ref" / "config.json")], "the input"),
    ]
    for extra, expected in cases:
        run_failing(args + extra, capsys, expected, "--force never overrides")
        for command in (["export-adapter"], []):
            if command and "--report" not in extra:
                run_failing(command + [a for a in args if a != "--no-progress"] + extra, capsys, expected)
    assert tree_hashes(root, real, blobs) == before
    assert_clean(tmp_path / "ok")


def test_report_must_not_replace_a_file_without_force(tmp_path, capsys):
    out, report = tmp_path / "out", tmp_path / "notes.txt"
    report.write_text("my notes")
    for force in ([], ["--force"]):  # someone's own file: not even with --force
        run_failing(merge_args("tp2_fp32_filtered", out) + ["--report", str(report), *force], capsys,
                    "already exists and is a file that is not a report of lora-merge",
                    "--force replaces only an earlier report of lora-merge")
    assert report.read_text() == "my notes"
    assert_clean(out)
    run_failing(merge_args("tp2_fp32_filtered", out) + ["--report", str(tmp_path)], capsys, "is a directory")
    for inside in (out, out / "sub" / "r.json"):
        run_failing(merge_args("tp2_fp32_filtered", out) + ["--report", str(inside)], capsys, "output directory")
    ours = tmp_path / "report.json"
    assert main(merge_args("tp2_fp32_filtered", out) + ["--report", str(ours)]) == 0
    run_failing(merge_args("tp2_fp32_filtered", tmp_path / "out2") + ["--report", str(ours)], capsys,
                "already exists: an earlier report of lora-merge (pass --force to replace it)")
    assert main(merge_args("tp2_fp32_filtered", tmp_path / "out2") + ["--report", str(ours), "--force"]) == 0
    assert json.loads(ours.read_text())["files"]


def test_force_never_replaces_a_directory_that_is_not_an_output(tmp_path, capsys):
    mine = tmp_path / "project"
    mine.mkdir()
    (mine / "thesis.tex").write_text("weeks of work")
    run_failing(merge_args("tp2_fp32_filtered", mine) + ["--force"], capsys,
                "is not an earlier merged model written by lora-merge", "not replacing it even with --force")
    assert (mine / "thesis.tex").read_text() == "weeks of work"
    # A config.json does not make a project folder an output.
    (mine / "config.json").write_text("{}")
    (mine / "src").mkdir()
    run_failing(merge_args("tp2_fp32_filtered", mine) + ["--force"], capsys, "no README.md model card of lora-merge")
    assert (mine / "thesis.tex").is_file() and (mine / "src").is_dir()


def test_cleanup_of_killed_runs_never_removes_an_input(tmp_path, capsys):
    # An input whose name looks like an abandoned staging dir of a dead process must survive.
    root = copy_fixture("tp2_fp32_filtered", tmp_path)
    dead = _dead_pid()
    disguised = tmp_path / f".out.partial-{socket.gethostname().replace('-', '_')}-{dead}-abc"
    (root / "hf_ref").rename(disguised)
    before = tree_hashes(disguised)
    out = tmp_path / "out"
    assert main(["--base", str(root / "base"), "--lora", str(root / "lora"), "--hf-ref", str(disguised),
                 "--out", str(out), "--no-progress"]) == 0
    assert tree_hashes(disguised) == before


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


# --- 2. publishing is honest ------------------------------------------------------------------------

def test_failing_verify_publishes_nothing_and_lists_every_problem(tmp_path, capsys, monkeypatch):
    from lora_merge.runs import to_hf

    real_copy = to_hf.copy_reference_files

    def copy_then_damage(hf_dir, staging, config, dtype):
        shard = staging / "model.safetensors"  # flip a bit in two tensors' data, as a bad disk would
        data = bytearray(shard.read_bytes())
        header_len = struct.unpack_from("<Q", data)[0]
        header = json.loads(data[8: 8 + header_len])
        for name in ("model.norm.weight", "model.layers.0.self_attn.q_proj.weight"):
            data[8 + header_len + header[name]["data_offsets"][0] + 2] ^= 0x10
        shard.write_bytes(bytes(data))
        return real_copy(hf_dir, staging, config, dtype)

    monkeypatch.setattr(to_hf, "copy_reference_files", copy_then_damage)
    for report in (None, tmp_path / "report.json"):
        out = tmp_path / "out"
        extra = ["--verify"] + (["--report", str(report)] if report else [])
        code = main(merge_args("tp2_fp32_filtered", out) + extra)
        captured = capsys.readouterr()
        problems = [line for line in captured.out.splitlines() if line.startswith("  problem: ")]
        assert code == 1
        assert len(problems) == 2, captured.out
        assert captured.err.strip().splitlines() == [
            f"lora-merge: error: {out}: verification failed (2 problem(s)), nothing published"]
        assert_clean(out)
        assert report is None or not report.exists()


def test_report_that_cannot_be_written_stops_the_run_before_publishing(tmp_path, capsys, monkeypatch):
    from lora_merge.files import staged_dir

    def full_disk(self, final, text):
        raise OSError(28, "No space left on device", str(final))

    monkeypatch.setattr(staged_dir.StagedOutput, "side_file", full_disk)
    out, report = tmp_path / "out", tmp_path / "report.json"
    run_failing(merge_args("tp2_fp32_filtered", out) + ["--report", str(report)], capsys,
                "No space left on device", "no output was written")
    assert_clean(out)
    assert not report.exists() and leftovers(tmp_path, "report.json") == []
    run_failing(merge_args("tp2_fp32_filtered", out) + ["--report", str(tmp_path / "no" / "r.json")], capsys,
                "does not exist")
    assert_clean(out)


def test_a_report_inside_the_output_is_published_with_it(tmp_path):
    out = tmp_path / "out"
    assert main(merge_args("tp2_fp32_filtered", out) + ["--report", str(out / "merge-report.json")]) == 0
    report = json.loads((out / "merge-report.json").read_text())
    assert "model.safetensors" in report["files"]


def test_no_message_claims_nothing_was_written_after_publishing(tmp_path, capsys, monkeypatch):
    from lora_merge.files import staged_dir

    real_link = os.link

    def failing_link(src, dst):
        if str(dst).endswith("report.json"):
            raise OSError(5, "Input/output error", str(dst))
        return real_link(src, dst)

    monkeypatch.setattr(staged_dir.os, "link", failing_link)
    out, report = tmp_path / "out", tmp_path / "report.json"
    line = run_failing(merge_args("tp2_fp32_filtered", out) + ["--report", str(report)], capsys,
                       "was published", "could not be moved into place")
    assert "no output was written" not in line
    assert (out / "model.safetensors").is_file()


# --- 3. two runs, one output ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    root = tmp_path_factory.mktemp("synthetic")
    write_checkpoint(root, preset="small", layers=4, tp=2, dtype=torch.float32)
    return root


def _merge_cmd(synthetic: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "lora_merge", "--base", str(synthetic / "base"), "--lora", str(synthetic / "lora"),
            "--hf-ref", str(synthetic / "hf_ref"), "--out", str(out), "--max-shard-size", "20MB", "--no-progress",
            *extra]


def test_two_runs_with_the_same_output_publish_exactly_once(synthetic, tmp_path):
    out = tmp_path / "merged"
    before = tree_hashes(synthetic)
    procs = [subprocess.Popen(_merge_cmd(synthetic, out), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = [(p.wait(), p.stderr.read()) for p in procs]
    for p in procs:
        p.stdout.close()
        p.stderr.close()
    codes = sorted(code for code, _ in results)
    assert codes == [0, 2], results
    loser = [line for line in next(err for code, err in results if code == 2).strip().splitlines()
             if not line.startswith("lora-merge: warning: ")]  # the card's warning comes before publishing
    assert len(loser) == 1 and ("appeared while this run was writing" in loser[0] or "already exists" in loser[0])
    assert (out / "model.safetensors.index.json").is_file()
    assert leftovers(tmp_path, "merged") == []
    assert tree_hashes(synthetic) == before


def test_publishing_never_replaces_a_directory_that_appeared(tmp_path):
    from lora_merge.files import staged_dir

    for renameat2 in (staged_dir._renameat2, None):  # the syscall, and the fallback without it
        src, dst = tmp_path / "src", tmp_path / "dst"
        src.mkdir()
        (src / "a").write_text("new")
        dst.mkdir()
        (dst / "b").write_text("theirs")
        saved, staged_dir._renameat2 = staged_dir._renameat2, renameat2
        try:
            with pytest.raises(FileExistsError):
                staged_dir.rename_noreplace(src, dst)
            staged_dir.rename_exchange(src, dst)
        finally:
            staged_dir._renameat2 = saved
        assert (dst / "a").read_text() == "new" and (src / "b").read_text() == "theirs"
        for d in (src, dst):
            for f in d.iterdir():
                f.unlink()
            d.rmdir()


# --- 4. killed runs leave nothing -------------------------------------------------------------------

@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGHUP, 129), (signal.SIGINT, 130)])
def test_signals_remove_the_staging_dir(synthetic, tmp_path, sig, code):
    out = tmp_path / "merged"
    # The child must not inherit an ignored signal (CI started under nohup ignores SIGHUP; the tool respects that).
    proc = subprocess.Popen(_merge_cmd(synthetic, out), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(sig, signal.SIG_DFL))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        if list(tmp_path.glob(".merged.partial-*/model-*.safetensors")):
            proc.send_signal(sig)
            break
        time.sleep(0.002)
    err = proc.communicate()[1]
    assert proc.returncode == code, err
    assert err.strip().splitlines() == [f"lora-merge: interrupted by {sig.name}; no output was written"]
    assert_clean(out)


def test_leftovers_of_killed_runs_are_removed_before_the_space_check(tmp_path, monkeypatch):
    import collections

    from lora_merge.files import staged_dir

    out = tmp_path / "out"
    stale = tmp_path / f".out.partial-{staged_dir._host()}-{_dead_pid()}-xyz"
    stale.mkdir()
    (stale / staged_dir.STAGING_LOCK).touch()  # as a killed run leaves it: there, and held by nobody
    (stale / "model-00001-of-00002.safetensors").write_bytes(b"\0" * 1000)
    usage = collections.namedtuple("usage", "total used free")
    # The disk is nearly full while the killed run's files are still there.
    monkeypatch.setattr(staged_dir.shutil, "disk_usage",
                        lambda path: usage(10**12, 0, 10 if stale.exists() else 10**12))
    assert main(merge_args("tp2_fp32_filtered", out)) == 0
    assert not stale.exists() and (out / "model.safetensors").is_file()


# --- 5. bounded memory on hostile files -------------------------------------------------------------

def _rezip(path: Path, compression) -> None:
    with zipfile.ZipFile(path) as src:
        members = [(info, src.read(info)) for info in src.infolist()]
    with zipfile.ZipFile(path, "w", compression=compression) as dst:
        for info, data in members:
            dst.writestr(info.filename, data)


def _patch_declared_size(path: Path, member_suffix: str, size: int) -> None:
    """Make the central directory claim `size` bytes for a member (as a crafted file would)."""
    data = bytearray(path.read_bytes())
    pos = 0
    while (pos := data.find(b"PK\x01\x02", pos + 1)) != -1:
        name_len = struct.unpack_from("<H", data, pos + 28)[0]
        if bytes(data[pos + 46: pos + 46 + name_len]).decode().endswith(member_suffix):
            struct.pack_into("<II", data, pos + 20, size, size)
            path.write_bytes(bytes(data))
            return
    raise AssertionError(member_suffix)


def test_compressed_or_oversized_records_are_refused_without_allocating(tmp_path, capsys):
    root = copy_fixture("tp2_fp32_filtered", tmp_path)
    victim = rank_files(root / "base")[1]
    before_others = tree_hashes(root / "lora", root / "hf_ref")
    out = tmp_path / "out"
    _rezip(victim, zipfile.ZIP_DEFLATED)
    run_failing(copied_args(root, out), capsys, str(victim), "compressed")
    _rezip(victim, zipfile.ZIP_STORED)
    _patch_declared_size(victim, "data/0", 3 << 30)  # "3 GB" in a file of a few hundred KB
    run_failing(copied_args(root, out), capsys, str(victim), "data/0")
    assert_clean(out)
    assert tree_hashes(root / "lora", root / "hf_ref") == before_others
    # In a fresh process, the refusal costs no more memory than a normal start. Its own peak (VmHWM): ru_maxrss
    # of a process started by one that has grown (this test run) reports the parent's peak, kept across exec.
    probe = ("import sys; from lora_merge.cli import main; code = main(sys.argv[1:]); "
             "print(next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM:')) // 1024); "
             "sys.exit(code)")
    proc = subprocess.run([sys.executable, "-c", probe, *copied_args(root, out)], capture_output=True, text=True)
    assert proc.returncode == 2 and int(proc.stdout.strip()) < 1024, proc


# --- 6. damaged data is caught ----------------------------------------------------------------------

def _flip_in_member(path: Path, member: str, offset: int = 7) -> None:
    with zipfile.ZipFile(path) as archive:
        info = archive.getinfo(member)
    with open(path, "r+b") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = struct.unpack("<HH", f.read(4))
        f.seek(info.header_offset + 30 + name_len + extra_len + offset)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x04]))


def _largest_weight_member(path: Path) -> str:
    """The largest member holding a model tensor (rng and optimizer state are not read by a merge)."""
    from lora_merge.files.torch_archive import MappedFile, TorchArchive
    from lora_merge.files.safe_load import load_archive

    archive = TorchArchive(MappedFile(path))
    model = load_archive(archive)["model"]
    return max((archive.record_of(t) for t in model.values() if isinstance(t, torch.Tensor) and t.numel()),
               key=lambda r: r.size).name


@pytest.mark.parametrize("crc", ["default", "zlib"])
@pytest.mark.parametrize("which", ["base", "lora"])
def test_a_flipped_bit_in_tensor_data_fails_the_run_naming_file_and_record(tmp_path, capsys, monkeypatch, which, crc):
    """With ISA-L's CRC32 (the default where it installs) and with zlib's, the fallback elsewhere."""
    if crc == "zlib":
        import zlib

        from lora_merge.files import torch_archive
        monkeypatch.setattr(torch_archive, "crc32", zlib.crc32)
    root = copy_fixture("tp2_fp32_filtered", tmp_path)
    victim = rank_files(root / which)[1]
    member = _largest_weight_member(victim)
    _flip_in_member(victim, member)
    before = tree_hashes(root)
    out = tmp_path / "out"
    run_failing(copied_args(root, out), capsys, str(victim), member, "CRC32")
    assert_clean(out)
    assert tree_hashes(root) == before


def test_a_flipped_bit_in_a_pickle_fails_the_run(tmp_path, capsys):
    root = copy_fixture("tp2_fp32_filtered", tmp_path)
    victim = rank_files(root / "lora")[0]
    _flip_in_member(victim, "model_optim_rng/data.pkl", offset=200)
    out = tmp_path / "out"
    run_failing(copied_args(root, out), capsys, str(victim), "data.pkl", "CRC32")
    assert_clean(out)


def test_a_flipped_bit_in_a_torch_dist_chunk_fails_the_run(tmp_path, capsys):
    from lora_merge.files.torch_archive import MappedFile, TorchArchive
    from lora_merge.readers.torch_dist import read_metadata

    root = copy_fixture("dist_tp2pp2_fp32", tmp_path)
    it = root / "base" / "iter_0000001"
    _, storage = read_metadata(it / ".metadata")
    rel, offset, length = max(storage.values(), key=lambda loc: loc[2])  # the largest chunk record
    archive = TorchArchive(MappedFile(it / rel), offset, length)
    record = max((r for r in archive.records.values() if "/data/" in r.name), key=lambda r: r.size)
    with open(it / rel, "r+b") as f:
        f.seek(record.start + record.size // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x01]))
    out = tmp_path / "out"
    run_failing(copied_args(root, out), capsys, str(it / rel), record.name, "CRC32")
    assert_clean(out)


def test_nan_in_a_merged_weight_is_named_as_the_checkpoints(tmp_path, capsys):
    """A merged weight is checked once, after the merge; a NaN that came from the checkpoint is still
    reported as the checkpoint's, with its rows."""
    root = copy_fixture("tp2_fp32_filtered", tmp_path)
    key = "decoder.layers.1.self_attention.linear_proj.weight"

    set_value(rank_files(root / "base")[0], key, (7, 3), float("nan"))
    out = tmp_path / "out"
    run_failing(copied_args(root, out), capsys, "model.layers.1.self_attn.o_proj.weight",
                "non-finite values (NaN or Inf) in the checkpoint, rows 0..")
    assert_clean(out)


@pytest.mark.parametrize("key,shown", [("decoder.layers.2.input_layernorm.weight", "layers.2.input_layernorm.weight"),
                                       ("embedding.word_embeddings.weight", "model.embed_tokens.weight")])
def test_nan_in_an_untouched_tensor_is_an_error_in_merge_and_export(tmp_path, capsys, key, shown):
    root = copy_fixture("tp2_fp32_filtered", tmp_path)

    for f in rank_files(root / "base")[-1:] if "embedding" in key else rank_files(root / "base"):
        set_value(f, key, 5, float("nan"))
    out = tmp_path / "out"
    run_failing(copied_args(root, out), capsys, shown, "NaN or Inf")
    assert_clean(out)

    lora_key = "decoder.layers.1.mlp.linear_fc2.lora_A.default.weight"

    def poison_lora(state):
        state["model"][lora_key] = state["model"][lora_key].clone()
        state["model"][lora_key][0, 0] = float("inf")

    rewrite(rank_files(root / "lora")[0], poison_lora)
    run_failing(["export-adapter", "--lora", str(root / "lora"), "--hf-ref", str(root / "hf_ref"), "--out", str(out)],
                capsys, "model.layers.1.mlp.down_proj.lora_A.weight", "NaN or Inf")
    assert_clean(out)



@pytest.mark.parametrize("change,shown", [("shape", "shape [128, 64]"), ("dtype", "torch.int32")])
def test_a_copy_with_the_same_bytes_as_another_shape_or_dtype_is_compared(tmp_path, capsys, change, shown):
    """Equal stored CRC32s say two members hold the same bytes, not the same tensor: a copy of a dense weight in
    the other expert-parallel file, reshaped or reinterpreted without changing a byte, is refused."""
    import shutil
    root = tmp_path / "qwen3moe_ep2"
    shutil.copytree(Path(__file__).parent / "fixtures_moe" / "qwen3moe_ep2", root)
    key = "decoder.layers.2.self_attention.linear_proj.weight"  # [64, 128] in every EP rank's file

    def same_bytes(state):
        weight = state["model"][key].clone()
        state["model"][key] = weight.reshape(128, 64) if change == "shape" else weight.view(torch.int32)

    rewrite(rank_files(root / "base")[1], same_bytes)
    before = tree_hashes(root)
    out = tmp_path / "out"
    run_failing(copied_args(root, out), capsys, key, shown, "its copy in")
    assert_clean(out)
    assert tree_hashes(root) == before


# --- 7. the config and the base must be what was trained --------------------------------------------

def test_unfiltered_lora_with_a_base_of_other_weights_is_refused(tmp_path, capsys):
    root = copy_fixture("pp2_fp32_unfiltered", tmp_path)
    key = "decoder.layers.1.mlp.linear_fc2.weight"

    def other_base(state):
        if key in state["model"]:
            state["model"][key] = state["model"][key] + 1e-3

    for f in rank_files(root / "base"):
        rewrite(f, other_base)
    out = tmp_path / "out"
    run_failing(copied_args(root, out), capsys, "its own base weights differ from --base", key)
    assert_clean(out)
    # export-adapter takes --base to say what the adapter goes onto: the same pair is refused alike
    adapter = tmp_path / "adapter"
    run_failing(["export-adapter"] + copied_args(root, adapter), capsys, "its own base weights differ from --base", key)
    assert_clean(adapter)
    assert main(["--lora", str(root / "lora"), "--hf-ref", str(root / "hf_ref"), "--out", str(out)]) == 0


# --- 9. options say what they do --------------------------------------------------------------------

def test_overrides_that_change_checkpoint_values_warn(tmp_path, capsys):
    out = tmp_path / "out"
    # --base-model-id: the card's base_model known, so the override is the only thing to warn about
    assert main(merge_args("tp2_fp32_filtered", out) + ["--lora-alpha", "16", "--lora-r", "4",
                                                        "--base-model-id", "org/base"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["lora-merge: warning: --lora-alpha 16.0 overrides args.lora_alpha=12 of the LoRA checkpoint"]


@pytest.mark.parametrize("option,value,expected", [
    ("--lora-alpha", "0", "alpha=0"), ("--lora-alpha", "-8", "alpha=-8"), ("--lora-r", "0", "r=0"),
    ("--max-shard-size", "100KB", "below 1MB"), ("--max-shard-size", "lots", "not a size"),
    ("--max-shard-size", "5XB", "not a size"), ("--dtype", "int8", "invalid choice"),
])
def test_bad_option_values_are_one_line_errors(tmp_path, capsys, option, value, expected):
    out = tmp_path / "out"
    try:
        code = main(merge_args("tp2_fp32_filtered", out) + [option, value])
    except SystemExit as exc:  # argparse's own refusals
        code = exc.code
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1 and err[0].startswith("lora-merge: error: ") and expected in err[0], err
    assert_clean(out)


def test_dry_run_validates_the_output(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    run_failing(merge_args("tp2_fp32_filtered", out) + ["--dry-run"], capsys, "already exists")
    run_failing(merge_args("tp2_fp32_filtered", FIXTURES / "tp2_fp32_filtered" / "hf_ref" / "x") + ["--dry-run"],
                capsys, "inside the input directory")


def test_help_lists_every_subcommand(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    text = capsys.readouterr().out
    assert exc.value.code == 0
    for command in ("merge", "verify", "inspect", "export-adapter"):
        assert f"  {command} " in text


def test_verify_report_never_replaces_a_file_it_reads_through_symlinks(tmp_path, capsys):
    root = copy_fixture("tp2_fp32_filtered", tmp_path)
    out = tmp_path / "out"
    assert main(copied_args(root, out) + ["--no-progress"]) == 0
    real = tmp_path / "real_iter"
    (root / "lora" / "iter_0000010").rename(real)
    (root / "lora" / "iter_0000010").symlink_to(real)
    ext = tmp_path / "ext"
    ext.mkdir()
    (out / "model.safetensors").rename(ext / "m.safetensors")
    (out / "model.safetensors").symlink_to(ext / "m.safetensors")
    before = tree_hashes(root, real, ext)
    for target in (real / "mp_rank_00" / "model_optim_rng.pt", ext / "m.safetensors"):
        for extra in ([], ["--hf-ref", str(root / "hf_ref")]):
            run_failing(["verify", str(out), "--lora", str(root / "lora"), "--base", str(root / "base"),
                         "--report", str(target), "--force", *extra], capsys, "the input")
    assert tree_hashes(root, real, ext) == before


def test_a_report_that_appears_during_the_run_is_not_replaced(tmp_path, capsys, monkeypatch):
    from lora_merge.runs import to_hf

    report = tmp_path / "report.json"
    real_copy = to_hf.copy_reference_files

    def copy_then_someone_writes_the_report(*args):
        report.write_text("precious")
        return real_copy(*args)

    monkeypatch.setattr(to_hf, "copy_reference_files", copy_then_someone_writes_the_report)
    out = tmp_path / "out"
    run_failing(merge_args("tp2_fp32_filtered", out) + ["--report", str(report)], capsys,
                "appeared while this run was writing", "was published")
    assert report.read_text() == "precious"


def test_a_signal_ignored_by_nohup_stays_ignored(synthetic, tmp_path):
    out = tmp_path / "merged"
    proc = subprocess.Popen(_merge_cmd(synthetic, out), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        if list(tmp_path.glob(".merged.partial-*/model-*.safetensors")):
            proc.send_signal(signal.SIGHUP)
            break
        time.sleep(0.002)
    err = proc.communicate()[1]
    assert proc.returncode == 0, err
    assert (out / "model.safetensors.index.json").is_file()


def test_a_signal_while_starting_is_one_line_too(synthetic, tmp_path):
    out = tmp_path / "merged"
    proc = subprocess.Popen(_merge_cmd(synthetic, out), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL))
    time.sleep(0.3)  # importing torch
    proc.send_signal(signal.SIGTERM)
    err = proc.communicate()[1]
    assert proc.returncode == 143
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lora-merge: interrupted by SIGTERM"), err
    assert_clean(out)


def test_a_signal_that_an_import_turned_into_another_error_is_still_one_line(monkeypatch, capsys):
    """A library that catches the interrupt inside an import can fail later with another error (a module
    left half-imported): once a signal was received, that is still reported as the interruption."""
    import lora_merge.entry as entry
    from lora_merge import interrupts

    monkeypatch.setitem(sys.modules, "lora_merge.cli", None)  # importing it now raises ImportError
    monkeypatch.setattr(interrupts, "RECEIVED", [signal.SIGTERM])
    monkeypatch.setattr(entry, "RECEIVED", interrupts.RECEIVED)
    assert entry.main() == 143
    assert capsys.readouterr().err.strip().splitlines() == [
        "lora-merge: interrupted by SIGTERM while starting; no output was written"]
    monkeypatch.setattr(entry, "RECEIVED", [])  # without a signal the error is the error
    with pytest.raises(ImportError):
        entry.main()


def test_a_base_differing_from_the_unfiltered_lora_outside_the_sampled_rows_is_refused(tmp_path, capsys):
    root = copy_fixture("pp2_fp32_unfiltered", tmp_path)
    key = "decoder.layers.0.mlp.linear_fc2.weight"

    def one_row(state):
        if key in state["model"]:
            state["model"][key] = state["model"][key].clone()
            state["model"][key][1] += 0.5  # neither the first, middle nor last row

    for f in rank_files(root / "base"):
        rewrite(f, one_row)
    out = tmp_path / "out"
    run_failing(copied_args(root, out), capsys, "its own base weights differ from --base", key)
    assert_clean(out)


def test_a_report_named_like_an_output_file_is_refused_up_front(tmp_path, capsys):
    out = tmp_path / "out"
    for name in ("config.json", "model.safetensors", "model.safetensors.index.json"):
        run_failing(merge_args("tp2_fp32_filtered", out) + ["--report", str(out / name), "--dry-run"], capsys,
                    "writes a file of that name itself")
    assert_clean(out)


def test_an_archive_listing_absurdly_many_members_is_refused(tmp_path, capsys, monkeypatch):
    from lora_merge.files import torch_archive

    monkeypatch.setattr(torch_archive, "MAX_MEMBERS", 10)  # the real cap is 200000; the fixtures hold ~40
    out = tmp_path / "out"
    run_failing(merge_args("tp2_fp32_filtered", out), capsys, "members", "refusing more than 10")
    assert_clean(out)


def test_a_signal_swallowed_by_an_import_inside_the_run_still_stops_it(monkeypatch, tmp_path, capsys):
    """torch and transformers are imported once the arguments are parsed, inside the run: a signal a library
    swallowed while importing them still stops the run before anything is written."""
    from lora_merge import interrupts
    from lora_merge.cli import main

    monkeypatch.setattr(interrupts, "RECEIVED", [signal.SIGTERM])  # as if an import had caught the exception
    out = tmp_path / "out"
    root = FIXTURES / "tp2_fp32_filtered"
    code = main(["--base", str(root / "base"), "--lora", str(root / "lora"), "--hf-ref", str(root / "hf_ref"),
                 "--out", str(out), "--no-progress"])
    assert code == 143
    assert capsys.readouterr().err.strip().splitlines() == [
        "lora-merge: interrupted by SIGTERM; no output was written"]
    assert not out.exists()
