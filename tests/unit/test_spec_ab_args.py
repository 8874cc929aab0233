"""spec_ab's command line: engine settings as JSON objects, bad ones refused by argparse."""
import sys

import pytest

from specserve.bench import spec_ab


def _parse(monkeypatch, *argv):
    monkeypatch.setattr(sys, "argv", ["spec_ab.py", *argv])
    return spec_ab._args()


def test_base_and_spec_are_engine_args(monkeypatch):
    args = _parse(monkeypatch, "--base", '{"page_size": 1}', "--spec", '{"page_size": 16}')
    assert args.base == {"page_size": 1} and args.spec == {"page_size": 16}
    assert _parse(monkeypatch, "--spec", '{"speculative_algorithm": "NGRAM"}').base == {}


@pytest.mark.parametrize("flag, value, message", [("--spec", "{x", "not JSON"),
                                                  ("--base", "[1]", "must be a JSON object")])
def test_bad_json_is_a_usage_error(monkeypatch, capsys, flag, value, message):
    argv = ["--spec", "{}", flag, value] if flag == "--base" else [flag, value]
    with pytest.raises(SystemExit) as exit_info:
        _parse(monkeypatch, *argv)
    assert exit_info.value.code == 2
    assert f"argument {flag}: {message}" in capsys.readouterr().err
