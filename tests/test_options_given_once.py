"""An option given twice is never silently dropped: argparse keeps the last value, so `--lora A --lora B`
merged only B (a model off by the whole of A) with exit 0. Every option that takes one value, in every
subcommand, is refused in one line when repeated — whichever way it is spelled."""

import argparse

import pytest

from lora_merge.cli import PARSERS, main


def single_value_options(command: str) -> list[argparse.Action]:
    return [a for a in PARSERS[command]()._actions
            if a.option_strings and a.nargs is None and isinstance(a, argparse._StoreAction)]


def test_every_subcommand_has_single_value_options():
    # the test below must not pass by finding nothing
    assert {c: len(single_value_options(c)) for c in PARSERS} == {"merge": 26, "verify": 6, "inspect": 1,
                                                                  "export-adapter": 11, "finish": 3}


@pytest.mark.parametrize("command", list(PARSERS))
def test_each_single_value_option_given_twice_is_refused_in_one_line(capsys, command):
    for action in single_value_options(command):
        option = action.option_strings[-1]
        value = action.choices[0] if action.choices else "5GB" if option == "--max-shard-size" else \
            "{}" if option == "--storage-options" else "1"
        prefix = [] if command == "merge" else [command]
        positional = ["somewhere"] if command == "verify" else []
        for twice in ([option, value, option, value], [f"{option}={value}", option, value]):
            with pytest.raises(SystemExit) as exit_:
                main(prefix + positional + twice)
            assert exit_.value.code == 2
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and f"{option} given twice" in err, (option, err)


def test_a_second_adapter_is_a_second_adapter_not_a_replacement(capsys, tmp_path):
    """--lora given twice names two adapters merged together (never the last one alone)."""
    from pathlib import Path

    hf = Path(__file__).parent / "fixtures" / "tp2_fp32_filtered" / "hf_ref"
    code = main(["--lora", str(tmp_path / "a1"), "--lora", str(tmp_path / "a2"), "--hf-ref", str(hf),
                 "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and "a1" in err and "given twice" not in err, err
