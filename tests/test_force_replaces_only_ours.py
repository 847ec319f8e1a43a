"""--force replaces only what lora-merge wrote: a report of ours (recognised by its marker key, or an older
report by its first keys) or an earlier output of the same kind (recognised by our model card). Anything else
at --report or --out — a FIFO, a device, a symlink, a socket, someone's file, someone's HF model, the other
kind of output — is refused in one line naming the path and what it is, in merge, verify and export-adapter,
and nothing is written or left behind."""

import json
import os
import socket
import stat
from pathlib import Path

import pytest

from helpers import FIXTURES, merge_args, run_failing
from lora_merge.cli import main

FIXTURE = FIXTURES / "tp2_fp32_filtered"


def export_args(out: Path) -> list[str]:
    return ["export-adapter", "--lora", str(FIXTURE / "lora"), "--hf-ref", str(FIXTURE / "hf_ref"), "--out", str(out)]


def verify_args(merged: Path) -> list[str]:
    return ["verify", str(merged), "--lora", str(FIXTURE / "lora"), "--base", str(FIXTURE / "base")]


def hidden_leftovers(directory: Path) -> list[str]:
    """Staging dirs and report temp files (`.NAME.partial-…`, `.NAME.new-…`) of any run."""
    return sorted(p.name for p in directory.iterdir() if p.name.startswith(".") and
                  (".partial-" in p.name or ".new-" in p.name))


def snapshot(path: Path):
    """What is at `path`, to compare after a refused run: its kind, link target and content."""
    info = os.lstat(path)
    content = path.read_bytes() if stat.S_ISREG(info.st_mode) else None
    link = os.readlink(path) if stat.S_ISLNK(info.st_mode) else None
    return stat.S_IFMT(info.st_mode), info.st_ino, link, content


def not_ours(tmp_path: Path) -> list[tuple[str, Path]]:
    """(what the message says it is, path) for everything a --report must not replace."""
    d = tmp_path / "targets"
    d.mkdir()
    cases = []
    os.mkfifo(d / "fifo.json")
    cases.append(("a FIFO", d / "fifo.json"))
    (d / "notes.json").write_text('{"tool": "my own script", "inputs": {}}\n')
    cases.append(("a file that is not a report of lora-merge", d / "notes.json"))
    (d / "mine.txt").write_text("weeks of notes")
    (d / "link.json").symlink_to(d / "mine.txt")
    cases.append(("a symlink to", d / "link.json"))
    (d / "dangling.json").symlink_to(d / "nowhere")
    cases.append(("a symlink to", d / "dangling.json"))
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(d / "sock.json"))
    sock.close()  # the socket file stays
    cases.append(("a socket", d / "sock.json"))
    if os.geteuid() == 0:  # as root, a device node of our own (never /dev/null itself: a bug would replace it)
        os.mknod(d / "null.json", stat.S_IFCHR | 0o666, os.makedev(1, 3))
        cases.append(("a character device", d / "null.json"))
    return cases


@pytest.fixture
def merged(merged_fixture):
    return merged_fixture("tp2_fp32_filtered")


@pytest.mark.parametrize("command", ["merge", "verify", "export-adapter"])
def test_report_force_never_replaces_what_is_not_our_report(command, tmp_path, capsys, merged):
    for what, target in not_ours(tmp_path):
        before = snapshot(target)
        out = tmp_path / "out"
        args = command_args(command, out, merged)
        for force in ([], ["--force"]):
            run_failing(args + ["--report", str(target), *force], capsys, str(target), f"already exists and is {what}",
                        "--force replaces only an earlier report of lora-merge")
        assert snapshot(target) == before, what
        assert not os.path.lexists(out)
        assert hidden_leftovers(tmp_path) == [] and hidden_leftovers(target.parent) == []


def command_args(command: str, out: Path, merged: Path) -> list[str]:
    return {"merge": merge_args("tp2_fp32_filtered", out), "verify": verify_args(merged),
            "export-adapter": export_args(out)}[command]


@pytest.mark.parametrize("command", ["merge", "verify", "export-adapter"])
def test_report_force_replaces_an_earlier_report_of_ours(command, tmp_path, capsys, merged):
    report = tmp_path / "report.json"
    assert main(command_args(command, tmp_path / "out", merged) + ["--report", str(report)]) == 0
    first = json.loads(report.read_text())
    assert list(first)[:2] == ["lora_merge_report", "tool"]  # the marker leads, as ownership.py expects
    again = command_args(command, tmp_path / "out2", merged) + ["--report", str(report)]
    run_failing(again, capsys, str(report), "already exists: an earlier report of lora-merge (pass --force to replace it)")
    assert main(again + ["--force"]) == 0
    assert json.loads(report.read_text())["files"]
    assert hidden_leftovers(tmp_path) == []


def test_a_report_written_before_the_marker_is_still_recognised(tmp_path, capsys):
    report = tmp_path / "old-report.json"
    old = {"tool": "lora-merge 0.9.0", "inputs": {"base": None, "lora": None, "hf_ref": ""}, "files": {}}
    report.write_text(json.dumps(old, indent=2) + "\n")
    assert main(merge_args("tp2_fp32_filtered", tmp_path / "out") + ["--report", str(report), "--force"]) == 0
    assert json.loads(report.read_text())["lora_merge_report"] == 1
    # The same keys from another tool, or a report cut short, are not ours.
    for text in ('{"tool": "other-tool 1.0", "inputs": {}}\n', json.dumps(old, indent=2)[:-20]):
        report.write_text(text)
        run_failing(merge_args("tp2_fp32_filtered", tmp_path / "out3") + ["--report", str(report), "--force"],
                    capsys, "a file that is not a report of lora-merge")
        assert report.read_text() == text


def test_a_report_that_appears_mid_run_is_not_replaced_and_no_temp_file_is_left(tmp_path, capsys, monkeypatch):
    from lora_merge.runs import to_hf

    report = tmp_path / "rep.json"
    real_copy = to_hf.copy_reference_files

    def copy_then_someone_writes_the_report(*args):
        os.mkfifo(report)
        return real_copy(*args)

    monkeypatch.setattr(to_hf, "copy_reference_files", copy_then_someone_writes_the_report)
    for force, expected in (([], "appeared while this run was writing"), (["--force"], "is a FIFO")):
        out = tmp_path / f"out{len(force)}"
        line = run_failing(merge_args("tp2_fp32_filtered", out) + ["--report", str(report), *force], capsys,
                           expected, "this run's report", "discarded", f"the output {out} was published")
        assert "rep.json.partial-" not in line
        assert stat.S_ISFIFO(os.lstat(report).st_mode)
        assert hidden_leftovers(tmp_path) == []  # the temp file is removed, not left for someone to find
        report.unlink()


def _user_hf_model(path: Path, readme: str | None = None) -> None:
    """A model someone saved with save_pretrained: config, weights, tokenizer (and maybe a card of theirs)."""
    path.mkdir()
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        (path / name).write_text("{}")
    (path / "model.safetensors").write_bytes(b"their weights")
    if readme is not None:
        (path / "README.md").write_text(readme)


def _tree(path: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def test_force_never_replaces_someones_hf_model(tmp_path, capsys):
    hub_card = "---\nlibrary_name: transformers\ntags:\n- text-generation\n---\n\n# my fine-tune\n"
    for readme, reason in ((None, "no README.md model card of lora-merge"),
                           (hub_card, "no README.md model card of lora-merge"),
                           ("not even a card", "no README.md model card of lora-merge")):
        theirs = tmp_path / f"theirs{len(list(tmp_path.iterdir()))}"
        _user_hf_model(theirs, readme)
        before = _tree(theirs)
        for args in (merge_args("tp2_fp32_filtered", theirs), export_args(theirs)):
            for force in (["--force"], []):  # without it, too: "pass --force" would be advice that cannot work
                line = run_failing(args + force, capsys, str(theirs), "is not an earlier", "written by lora-merge",
                                   reason, "not replacing it even with --force")
                assert "pass --force" not in line
        assert _tree(theirs) == before
    assert hidden_leftovers(tmp_path) == []


def test_force_replaces_an_earlier_output_only_of_the_same_kind(tmp_path, capsys):
    merged, adapter = tmp_path / "merged", tmp_path / "adapter"
    assert main(merge_args("tp2_fp32_filtered", merged)) == 0
    assert main(export_args(adapter)) == 0
    merged_before, adapter_before = _tree(merged), _tree(adapter)
    run_failing(export_args(merged) + ["--force"], capsys, str(merged), "is not an earlier PEFT adapter",
                "it is a merged model written by lora-merge")
    run_failing(merge_args("tp2_fp32_filtered", adapter) + ["--force"], capsys, str(adapter),
                "is not an earlier merged model", "it is a PEFT adapter written by lora-merge")
    assert _tree(merged) == merged_before and _tree(adapter) == adapter_before
    # Our output with someone's file added is no longer only ours.
    (merged / "my-eval.txt").write_text("results")
    run_failing(merge_args("tp2_fp32_filtered", merged) + ["--force"], capsys, "it also holds my-eval.txt")
    (merged / "my-eval.txt").unlink()
    # The same kind is replaced, as --force promises.
    assert main(merge_args("tp2_fp32_filtered", merged) + ["--force"]) == 0
    assert main(export_args(adapter) + ["--force"]) == 0
    assert (merged / "model.safetensors").is_file() and (adapter / "adapter_model.safetensors").is_file()
    assert hidden_leftovers(tmp_path) == []


def test_an_output_that_stops_being_ours_before_publishing_is_not_replaced(tmp_path, capsys, monkeypatch):
    """Checked again at publishing: a card replaced meanwhile by someone's is refused then, the new output
    discarded."""
    from lora_merge.runs import to_hf

    merged = tmp_path / "merged"
    assert main(merge_args("tp2_fp32_filtered", merged)) == 0
    real_copy = to_hf.copy_reference_files

    def copy_then_someone_replaces_the_card(*args):
        (merged / "README.md").write_text("# my notes on this model\n")
        return real_copy(*args)

    monkeypatch.setattr(to_hf, "copy_reference_files", copy_then_someone_replaces_the_card)
    run_failing(merge_args("tp2_fp32_filtered", merged) + ["--force"], capsys, "no README.md model card of lora-merge")
    assert (merged / "README.md").read_text() == "# my notes on this model\n"
    assert hidden_leftovers(tmp_path) == []
