"""The launch_server flags: SGLang's documented flags parse, --help describes every flag, bad
values exit 2 with one ``error:`` line, and flags that cannot apply here say so at startup."""
from __future__ import annotations

import dataclasses
import re
import subprocess
import sys

import pytest

from specserve.cli_args import flag_doc, option_strings
from specserve.config import ConfigError, ServerArgs
from specserve.flag_notes import startup_notes
from specserve.flags import GROUPS
from specserve.launch_server import build_parser, parse_server_args

# Every flag of SGLang's speculative-decoding page and of SGL-JAX's, with a value it documents.
SGLANG_DOC_FLAGS = [
    "--model", "m", "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "d",
    "--speculative-draft-model-revision", "main", "--speculative-draft-load-format", "safetensors",
    "--speculative-num-steps", "3", "--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "16",
    "--speculative-accept-threshold-single", "1.0", "--speculative-accept-threshold-acc", "1.0",
    "--speculative-token-map", "thunlp/LLaMA3-Instruct-8B-FR-Spec/freq_32768.pt",
    "--speculative-attention-mode", "decode", "--speculative-draft-attention-backend", "fa3",
    "--speculative-moe-runner-backend", "triton", "--speculative-moe-a2a-backend", "deepep",
    "--speculative-draft-model-quantization", "fp8", "--enable-multi-layer-eagle",
    "--enable-torch-compile", "--torch-compile-max-bs", "8", "--cuda-graph-max-bs", "8",
    "--mem-fraction-static", "0.7", "--dtype", "float16", "--log-level", "warning", "--trust-remote-code",
    "--max-running-requests", "4", "--disable-overlap-schedule", "--enable-dp-attention", "--dp-size", "2",
    "--quantization", "fp8", "--tp-size", "1", "--attention-backend", "fa", "--page-size", "64",
    "--max-prefill-tokens", "4096", "--decode-log-interval", "1", "--device", "cpu", "--load-format", "auto",
    "--disable-cuda-graph", "--stream-interval", "2", "--revision", "main",
    "--speculative-ngram-min-match-window-size", "1", "--speculative-ngram-max-match-window-size", "12",
    "--speculative-ngram-min-bfs-breadth", "1", "--speculative-ngram-max-bfs-breadth", "10",
    "--speculative-ngram-match-type", "BFS", "--speculative-ngram-max-trie-depth", "18",
    "--speculative-ngram-capacity", "10000000",
]


def test_sglang_documented_flags_parse_with_their_meaning():
    args = parse_server_args(SGLANG_DOC_FLAGS)
    assert args.model_path == "m" and args.speculative_algorithm == "EAGLE3"
    assert (args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens) == (3, 4, 16)
    assert args.cuda_graph_max_bs == 8 and args.torch_compile_max_bs == 8 and args.dp_size == 2
    assert args.speculative_ngram_branch_length == 18          # --speculative-ngram-max-trie-depth
    assert args.speculative_attention_mode == "decode" and args.mem_fraction_static == 0.7


def test_every_inapplicable_flag_given_logs_one_line():
    notes = startup_notes(parse_server_args(SGLANG_DOC_FLAGS))
    for flag in ("--cuda-graph-max-bs", "--enable-torch-compile", "--disable-overlap-schedule", "--dp-size",
                 "--quantization", "--speculative-draft-model-quantization", "--speculative-draft-attention-backend",
                 "--speculative-moe-runner-backend", "--enable-multi-layer-eagle", "--speculative-attention-mode",
                 "--trust-remote-code", "--disable-cuda-graph", "--attention-backend"):
        assert sum(flag + " " in line or line.startswith(flag + ":") for line in notes) >= 1, flag
    assert startup_notes(ServerArgs()) == []                    # defaults say nothing
    # applied here, so nothing to say: gguf runs the integer kernels, unquant keeps the draft exact
    assert startup_notes(ServerArgs(quantization="gguf", speculative_draft_model_quantization="unquant")) == []


def test_sglang_environment_switches_are_reported(monkeypatch):
    monkeypatch.setenv("SGLANG_ENABLE_SPEC_V2", "True")
    monkeypatch.setenv("SGLANG_NGRAM_FORCE_GREEDY_VERIFY", "True")
    notes = startup_notes(ServerArgs())
    assert [line.split("=")[0] for line in notes] == ["SGLANG_ENABLE_SPEC_V2", "SGLANG_NGRAM_FORCE_GREEDY_VERIFY"]


def test_every_help_entry_has_a_description_and_default():
    parser = build_parser()
    text = " ".join(parser.format_help().split())
    actions = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert {a.dest for a in actions} == {f.name for f in dataclasses.fields(ServerArgs)}
    for action in actions:
        sentence = re.sub(r"Default:.*", "", action.help)
        assert len(sentence.split()) >= 4, action.option_strings
        assert "default" in action.help.lower(), action.option_strings
        assert " ".join(action.help.split()[:3]) in text          # shown by --help


def test_help_is_grouped_as_sglang_groups_flags():
    text = build_parser().format_help()
    positions = [text.index(f"{group} options:") for group in GROUPS]
    assert positions == sorted(positions)
    groups = {flag_doc(f).group for f in dataclasses.fields(ServerArgs)}
    assert groups <= set(GROUPS)


@pytest.mark.parametrize("argv, flag", [
    (["--speculative-attention-mode", "bogus"], "--speculative-attention-mode"),
    (["--dtype", "float8"], "--dtype"),
    (["--cuda-graph-max-bs", "x"], "--cuda-graph-max-bs"),
    (["--speculative-algorithm", "MEDUSA"], "--speculative-algorithm"),
])
def test_bad_values_exit_2_naming_the_flag(argv, flag):
    proc = subprocess.run([sys.executable, "-m", "specserve.launch_server", *argv], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert f"error: argument {flag}" in proc.stderr


@pytest.mark.parametrize("kwargs, flag", [
    ({"cuda_graph_max_bs": 0}, "--cuda-graph-max-bs"),
    ({"speculative_attention_mode": "bogus"}, "--speculative-attention-mode"),
    ({"load_format": "nope"}, "--load-format"),
    ({"dp_size": 0}, "--dp-size"),
])
def test_engine_kwargs_are_validated_like_flags(kwargs, flag):
    with pytest.raises(ConfigError, match=flag):
        ServerArgs(**kwargs)


def test_choices_take_sglang_spellings():
    args = ServerArgs(speculative_algorithm="eagle3", dtype="half", speculative_ngram_match_type="prob")
    assert (args.speculative_algorithm, args.dtype, args.speculative_ngram_match_type) == ("EAGLE3", "float16", "PROB")
