"""What the output side says when it cannot write: the file a full disk stopped (not "I/O: No space left on
device"), a mount point refused before anything is written (not EBUSY at the end), an input path that is a
device or a file named as such (not "no such checkpoint directory")."""

import errno
import os
from pathlib import Path

import pytest

from helpers import FIXTURES, merge_args, run_failing
from lora_merge.cli import main

FIXTURE = FIXTURES / "tp2_fp32_filtered"
NO_SPACE = os.strerror(errno.ENOSPC)


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def _fd_path(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


@pytest.fixture
def disk_full_for(monkeypatch):
    """Make os.write fail with ENOSPC, as the kernel does (no file name), for files whose path contains a
    text (the O_DIRECT shard writer and the report writer both write with os.write)."""
    def install(part: str):
        real_write = os.write

        def write(fd, data):
            if part in _fd_path(fd):
                raise OSError(errno.ENOSPC, NO_SPACE)
            return real_write(fd, data)

        monkeypatch.setattr(os, "write", write)
    return install


def test_a_full_disk_names_the_shard_it_stopped(tmp_path, capsys, disk_full_for):
    disk_full_for(".safetensors")
    out = tmp_path / "out"
    line = run_failing(merge_args("tp2_fp32_filtered", out), capsys,
                       f"{out / 'model.safetensors'}: {NO_SPACE}; no output was written")
    assert "I/O" not in line and ".partial-" not in line  # the output's file, not the staging path
    assert not out.exists() and leftovers(tmp_path) == []


@pytest.mark.parametrize("command", ["merge", "verify"])
def test_a_full_disk_names_the_report_it_stopped(command, tmp_path, capsys, disk_full_for):
    out, report = tmp_path / "out", tmp_path / "report.json"
    if command == "verify":
        assert main(merge_args("tp2_fp32_filtered", out)) == 0
        args = ["verify", str(out), "--lora", str(FIXTURE / "lora"), "--base", str(FIXTURE / "base")]
    else:
        args = merge_args("tp2_fp32_filtered", out)
    disk_full_for("report.json.partial-")  # the report is written beside its place, then moved there
    line = run_failing(args + ["--report", str(report)], capsys, f"{report}: {NO_SPACE}", "no output was written")
    assert ".partial-" not in line
    assert not report.exists()
    assert [name for name in leftovers(tmp_path) if "report" in name] == []
    if command == "merge":
        assert not out.exists() and leftovers(tmp_path) == []


def test_a_full_disk_while_copying_names_the_output(tmp_path, capsys, monkeypatch):
    from lora_merge.runs import to_hf

    def copy_on_a_full_disk(*args):
        raise OSError(errno.ENOSPC, NO_SPACE)  # as os.sendfile raises it inside shutil.copyfile: no file name

    monkeypatch.setattr(to_hf, "copy_reference_files", copy_on_a_full_disk)
    out = tmp_path / "out"
    run_failing(merge_args("tp2_fp32_filtered", out), capsys, f"{out} (while writing it): {NO_SPACE}",
                "no output was written")
    assert not out.exists() and leftovers(tmp_path) == []


def test_the_dry_run_plan_names_the_margin(tmp_path, capsys):
    assert main(merge_args("tp2_fp32_filtered", tmp_path / "out") + ["--dry-run"]) == 0
    disk = [line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("disk:")]
    assert len(disk) == 1 and "623.9 kB of tensors" in disk[0] and "64.0 MB margin" in disk[0], disk


def test_a_mount_point_as_out_is_refused_before_anything_is_written(tmp_path, capsys, monkeypatch):
    from lora_merge.runs import stream

    # A real one: /proc is a mount point wherever this runs.
    for command in (merge_args("tp2_fp32_filtered", Path("/proc")),
                    ["export-adapter", "--lora", str(FIXTURE / "lora"), "--hf-ref", str(FIXTURE / "hf_ref"),
                     "--out", "/proc"]):
        for force in ([], ["--force"]):
            run_failing(command + force, capsys, "/proc: is a mount point", "name a directory inside it")
    # An earlier output of ours that is a mount point: refused before a byte is merged, not EBUSY at the end.
    out = tmp_path / "out"
    assert main(merge_args("tp2_fp32_filtered", out)) == 0
    real_ismount = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda p: os.fspath(p) == str(out) or real_ismount(p))
    monkeypatch.setattr(stream, "execute", lambda *a, **k: pytest.fail("merged although the output is a mount point"))
    run_failing(merge_args("tp2_fp32_filtered", out) + ["--force"], capsys, f"{out}: is a mount point")
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("option", ["inspect", "--lora", "--base", "--hf-ref", "verify"])
def test_an_input_dir_that_is_a_device_or_a_file_says_so(option, tmp_path, capsys):
    a_file = tmp_path / "weights.bin"
    a_file.write_bytes(b"x")
    link = tmp_path / "link"
    link.symlink_to("/dev/null")
    for path, what in ((Path("/dev/null"), "is a character device"), (a_file, "is a regular file"),
                       (link, "is a character device (a symlink to /dev/null)")):
        if option == "inspect":
            args = ["inspect", str(path)]
        elif option == "verify":
            args = ["verify", str(path)]
        else:
            args = merge_args("tp2_fp32_filtered", tmp_path / "out")
            args[args.index(option) + 1] = str(path)
        run_failing(args, capsys, f"{path}: {what}, not a directory")
    assert not (tmp_path / "out").exists()


def test_an_fp8_output_is_described_as_fp8_in_the_plan_the_summary_and_the_card(tmp_path, capsys):
    """`--dtype fp8` said "wrote 41 tensors … as bfloat16": the quantized weights are float8_e4m3fn with block
    scales, the rest bfloat16, and every description says so."""
    from lora_merge.cli import main

    root = Path(__file__).parent / "fixtures_deepseek/deepseek_v3_ep2"
    args = ["--base", str(root / "base"), "--lora", str(root / "lora"), "--hf-ref", str(root / "hf_ref"),
            "--out", str(tmp_path / "fp8"), "--dtype", "fp8", "--no-progress"]
    described = "block-FP8 (float8_e4m3fn, 128x128 scales) and bfloat16"
    assert main(args + ["--dry-run"]) == 0
    assert f"GB as {described} in about" in capsys.readouterr().out
    assert main(args) == 0
    summary = capsys.readouterr().out
    assert f"GB as {described} in 1 shard(s)" in summary and "as bfloat16" not in summary, summary
    card = (tmp_path / "fp8/README.md").read_text()
    assert f"| output dtype | {described} |" in card
