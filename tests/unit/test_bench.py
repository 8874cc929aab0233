"""Benchmark tooling without a model: argument parsing, prompt loading, report writing."""
from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from specserve.bench import cli, prompts, report, serving, speculative
from specserve.bench.plain import parse_dtypes
from specserve.kernels import int_codes


# ---- argument parsing ---------------------------------------------------------------------------

def test_every_subcommand_parses_with_defaults():
    for name in cli.SUBCOMMANDS:
        args = cli.parse_args([name])
        assert args.command == name
        assert args.out == "bench_results"
        assert args.model_path is None


def test_plain_defaults_and_flags():
    args = cli.parse_args(["plain", "--num-prompts", "2", "--max-new-tokens", "32", "--out", "x"])
    assert (args.num_prompts, args.max_new_tokens, args.out) == (2, 32, "x")
    assert parse_dtypes(cli.parse_args(["plain"]).dtypes) == ["bfloat16", "float32"]
    with pytest.raises(ValueError):
        parse_dtypes("int8")


def test_serving_flags_and_modes():
    args = cli.parse_args(["serving", "--concurrency", "8,4", "--speculative-algorithm", "ngram",
                           "--speculative-num-draft-tokens", "4", "--compare-plain", "--no-ignore-eos"])
    assert serving.concurrency_levels(args.concurrency) == [1, 4, 8]
    assert args.ignore_eos is False
    modes = serving.modes_to_run(args)
    assert [label for label, _ in modes] == ["plain", "NGRAM"]
    assert modes[1][1] == {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 4}
    assert serving.modes_to_run(cli.parse_args(["serving"])) == [("plain", {})]
    with pytest.raises(ValueError):
        serving.parse_int_list("0,2")


def test_serving_passes_quantization_and_policy_to_its_engines(monkeypatch):
    """--quantization reaches every engine, --speculative-policy the speculative ones."""
    args = cli.parse_args(["serving", "--concurrency", "1", "--speculative-algorithm", "ngram", "--compare-plain",
                           "--quantization", "gguf", "--speculative-policy", "always"])
    built = []

    class Built(Exception):
        pass

    def make_engine(kwargs):
        built.append(kwargs)
        raise Built

    monkeypatch.setattr(serving, "make_engine", make_engine)
    monkeypatch.setattr(serving, "tokenize_prompts", lambda *a, **k: [[1, 2, 3]])
    for label, spec in serving.modes_to_run(args):
        with pytest.raises(Built):
            serving._run_mode(args, label, spec, [], [1])
    assert [k.get("quantization") for k in built] == ["gguf", "gguf"]
    assert [k.get("speculative_policy") for k in built] == [None, "always"]


def test_speculative_grid_parsing():
    grid = speculative.parse_grid("3,1,4;5,4,8", "EAGLE")
    assert grid == [speculative.SpecConfig(3, 1, 4), speculative.SpecConfig(5, 4, 8)]
    assert grid[0].label == "s3 k1 d4"
    ngram = speculative.parse_grid("3,1,4;5,4,4; 8 ;,,16", "NGRAM")   # only draft tokens matter
    assert [c.num_draft_tokens for c in ngram] == [4, 8, 16]
    assert ngram[0].label == "d4"
    with pytest.raises(ValueError):
        speculative.parse_grid("1,2", "EAGLE")
    with pytest.raises(ValueError):
        speculative.parse_grid("-1,1,4", "EAGLE")
    with pytest.raises(ValueError):
        speculative.parse_grid("a,1,4", "EAGLE")
    assert speculative.parse_grid("0,0,8;0,0,12", "ngram") == [speculative.SpecConfig(None, None, 8),
                                                               speculative.SpecConfig(None, None, 12)]


def test_speculative_algorithm_and_engine_kwargs():
    assert speculative.normalize_algorithm("none") is None
    assert speculative.normalize_algorithm("eagle3") == "EAGLE3"
    with pytest.raises(ValueError):
        speculative.normalize_algorithm("MEDUSA")
    assert serving.spec_kwargs(None) == {}
    assert serving.spec_kwargs("standalone", "/d", 3, 1, 4) == {
        "speculative_algorithm": "STANDALONE", "speculative_draft_model_path": "/d",
        "speculative_num_steps": 3, "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4}
    args = cli.parse_args(["speculative", "--model-path", "m.gguf", "--max-total-tokens", "999"])
    kwargs = serving.engine_kwargs(args, "float32", max_total_tokens=5, speculative_num_steps=None)
    assert kwargs == {"model_path": "m.gguf", "dtype": "float32", "device": "auto", "context_length": 2048,
                      "max_total_tokens": 999, "disable_radix_cache": False}


def test_speculative_runs_per_ngram_corpus_and_assist_value():
    """--ngram-corpus values apply to NGRAM, --ngram-assist values to the draft models: one run each."""
    args = cli.parse_args(["speculative", "--algorithm", "NGRAM,EAGLE3", "--grid", "NGRAM:,,12;EAGLE3:1,1,2",
                           "--ngram-corpus", "default,none", "--ngram-assist", "0,4"])
    runs = speculative.plan_runs(args)
    assert [label for label, _ in runs] == ["plain", "NGRAM d12 corpus=default", "NGRAM d12 corpus=none",
                                            "EAGLE3 s1 k1 d2", "EAGLE3 s1 k1 d2 assist=4"]
    assert runs[2][1]["speculative_ngram_corpus"] == "none" and "speculative_ngram_corpus" not in runs[1][1]
    assert "speculative_ngram_assist" not in runs[3][1] and runs[4][1]["speculative_ngram_assist"] == 4
    for bad in ("1", "x", "-2"):
        with pytest.raises(ValueError, match="--ngram-assist"):
            speculative.plan_runs(cli.parse_args(["speculative", "--algorithm", "EAGLE3", "--ngram-assist", bad]))


def test_kv_tokens_needed_covers_concurrency_and_context():
    args = SimpleNamespace(context_length=256)
    assert serving.kv_tokens_needed(args, [[1] * 100, [1] * 10], 8, 32, slack_per_request=4) == 8 * 136
    assert serving.kv_tokens_needed(args, [[1] * 10], 1, 8, slack_per_request=4) == 260


def test_bench_hook_reports_errors_cleanly(capsys):
    from specserve.cli import main as specserve_main

    with pytest.raises(SystemExit):
        specserve_main(["bench", "--help"])
    assert "verify-cost" in capsys.readouterr().out


# ---- prompt loading -------------------------------------------------------------------------------

def _write_jsonl(path, records):
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n\n", encoding="utf-8")
    return path


def test_load_prompt_file_uses_first_turn_and_file_stem(tmp_path):
    path = _write_jsonl(tmp_path / "my_set.jsonl", [
        {"question_id": 7, "category": "writing", "turns": ["first?", "second?"]},
        {"question_id": 8, "category": "math", "turns": ["2+2?"], "reference": ["4"]},
        {"question_id": 9, "category": "math", "turns": ["3+3?"]},
    ])
    loaded = prompts.load_prompt_file(path, limit=2)
    assert [(p.category, p.question_id, p.text) for p in loaded] == [("my_set", 7, "first?"), ("my_set", 8, "2+2?")]
    assert len(prompts.load_prompt_file(path)) == 3


def test_load_prompt_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        prompts.load_prompt_file(tmp_path / "missing.jsonl")
    bad = _write_jsonl(tmp_path / "bad.jsonl", [{"question_id": 1, "turns": []}])
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        prompts.load_prompt_file(bad)


def test_mixed_and_grouped_prompts(tmp_path):
    a = _write_jsonl(tmp_path / "a.jsonl", [{"turns": [f"a{i}"]} for i in range(4)])
    b = _write_jsonl(tmp_path / "b.jsonl", [{"turns": [f"b{i}"]} for i in range(4)])
    assert [p.text for p in prompts.load_mixed_prompts(3, [a, b])] == ["a0", "b0", "a1"]
    grouped = prompts.load_prompts([a, b], 2)
    assert [p.text for p in grouped] == ["a0", "a1", "b0", "b1"]
    assert prompts.categories(grouped) == ["a", "b"]
    assert prompts.resolve_prompt_files(f"{a}, {b}") == [a, b]


def test_default_eval_files(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECSERVE_EVAL_DIR", str(tmp_path))
    assert [p.name for p in prompts.default_prompt_files()] == list(prompts.DEFAULT_EVAL_FILES)
    _write_jsonl(tmp_path / "eagle_gsm8k.jsonl", [{"turns": ["q"]}])
    assert prompts.resolve_prompt_files("eagle_gsm8k.jsonl") == [tmp_path / "eagle_gsm8k.jsonl"]


def test_real_eval_files_load():
    """The vendored records of the eval sets (tests/data/eval) in the format the benchmarks read."""
    files = sorted((Path(__file__).resolve().parents[1] / "data" / "eval").glob("*.jsonl"))
    assert len(files) == 4
    loaded = prompts.load_prompts(files, 2)
    assert prompts.categories(loaded) == [f.stem for f in files]
    assert all(p.text for p in loaded)


class _FakeTokenizer:
    def apply_chat_template(self, messages, add_generation_prompt=True):
        return "<user>" + messages[0]["content"] + "<assistant>"

    def encode(self, text):
        return [ord(c) for c in text]


def test_chat_ids_templates_and_shortens():
    tok = _FakeTokenizer()
    assert prompts.chat_ids(tok, "hi") == [ord(c) for c in "<user>hi<assistant>"]
    long_text = " ".join(f"word{i}" for i in range(200))
    ids = prompts.chat_ids(tok, long_text, max_len=100)
    assert len(ids) <= 100
    assert ids[:len("<user>word0")] == [ord(c) for c in "<user>word0"]


# ---- reports -----------------------------------------------------------------------------------

def test_stats_helpers():
    assert report.median([3.0, 1.0, float("nan"), 2.0]) == 2.0
    assert math.isnan(report.median([]))
    assert report.ratio(6, 3) == 2
    assert math.isnan(report.ratio(1, 0))
    assert report.weighted_mean([2.0, 4.0], [1, 3]) == 3.5
    assert report.common_prefix_len([1, 2, 3], [1, 2, 4, 5]) == 2


def test_format_table_aligns_and_formats():
    text = report.format_table(["name", "value"], [["a", 1.23456], ["bbb", float("nan")], ["c", None]],
                               title="T")
    lines = text.splitlines()
    assert lines[0] == "T"
    assert lines[1].startswith("name")
    assert "1.23" in lines[3] and "1.2345" not in lines[3]
    assert lines[4].rstrip().endswith("-")
    assert len({len(line) for line in lines[1:]}) == 1


def test_write_json_is_strict_json(tmp_path):
    path = report.write_json(report.result_path(tmp_path / "out", "plain", stamp="20250101-000000"),
                             {"x": float("nan"), "y": [1.5, float("inf")], "p": tmp_path})
    assert path.name == "plain-20250101-000000.json"
    data = json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    assert data["x"] is None and data["y"] == [1.5, None] and data["p"] == str(tmp_path)
    assert "torch" in data["environment"] and "created" in data


def _fake_speculative_result():
    def stats(tok_s, speedup, accept):
        return {"tokens": 100, "tok_s": tok_s, "speedup": speedup, "accept_length": accept,
                "identical_to_plain": 2, "compared": 2, "num_requests": 2, "wall_s": 1.0, "verify_ct": 10}

    plain = {"label": "plain", "is_plain": True, "per_category": {"a": stats(10, 1, 1), "b": stats(12, 1, 1)},
             "overall": stats(11, 1, 1), "histogram": {}, "error": None}
    spec = {"label": "d4", "is_plain": False, "per_category": {"a": stats(15, 1.5, 2.1), "b": stats(18, 1.5, 2.4)},
            "overall": stats(16.5, 1.5, 2.25), "histogram": {"overall": {"1": 3, "3": 2}}, "error": None}
    return {"benchmark": "speculative", "algorithm": "NGRAM", "model_path": "m.gguf", "dtype": "float32",
            "max_new_tokens": 32, "batch_size": 1, "num_prompts": 4, "configs": [plain, spec]}


def test_plots_write_png(tmp_path):
    pytest.importorskip("matplotlib")
    png = report.plot_speculative(_fake_speculative_result(), tmp_path / "spec.png")
    assert png.read_bytes()[:4] == b"\x89PNG"
    curves = {"float32": [{"width": w, "median_ms": 10.0 * w ** 0.5, "ratio_vs_w1": w ** 0.5} for w in (1, 2, 4)]}
    assert report.plot_verify_cost({"curves": curves, "context": 256}, tmp_path / "vc.png").is_file()
    modes = {"plain": [{"concurrency": 1, "throughput": 10.0}, {"concurrency": 8, "throughput": 50.0}]}
    assert report.plot_serving({"modes": modes}, tmp_path / "serving.png").is_file()
    assert report.plot_speculative({"configs": []}, tmp_path / "none.png") is None


def test_speculative_table_and_histograms(capsys):
    speculative._print(_fake_speculative_result())
    out = capsys.readouterr().out
    assert "overall" in out and "1.50" in out and "2/2" in out
    assert "accept histogram [d4]" in out and "1:3 3:2" in out
    assert speculative.histogram_delta({1: 2, 2: 1}, {1: 5, 2: 1, 3: 4}) == {1: 3, 3: 4}
    assert speculative.histogram_delta([1, 2], [3, 2, 5]) == [2, 0, 5]


def test_cli_save_writes_json_and_plot(tmp_path):
    args = cli.parse_args(["speculative", "--out", str(tmp_path), "--tag", "t"])
    paths = cli.save(args, _fake_speculative_result())
    assert paths[0].endswith(".json") and "speculative-t-" in paths[0]
    assert json.loads(open(paths[0]).read())["args"]["grid"] == speculative.DEFAULT_GRID
    if len(paths) > 1:
        assert paths[1].endswith(".png")


def test_mismatches_and_records():
    a = serving.RequestRecord(0, 5, t_add=0.0, t_first=0.5, t_end=1.5, output_ids=[1, 2, 3], text="x")
    assert a.ttft == 0.5 and a.decode_rate == 2.0
    b = serving.RequestRecord(0, 5, output_ids=[1, 2, 4], text="y")
    assert serving.mismatches([a], [a]) == []
    assert serving.mismatches([b], [a]) == [{"index": 0, "first_diff_token": 2, "len": 3, "ref_len": 3}]


def test_copy_heavy_is_a_builtin_prompt_set(tmp_path):
    a = _write_jsonl(tmp_path / "a.jsonl", [{"turns": ["a0"]}])
    files = prompts.resolve_prompt_files(f"copy_heavy,{a}")
    loaded = prompts.load_prompts(files, 2)
    assert [p.category for p in loaded] == ["copy_heavy", "copy_heavy", "a"]
    assert loaded[0].text.startswith("Repeat the following paragraph")
    assert len(prompts.load_prompts(files[:1], None)) == len(prompts.COPY_HEAVY)


def test_best_shape_is_the_fastest_lossless_one_per_algorithm():
    from specserve.bench.shapes import best_shapes

    def entry(algorithm, shape, speedup, identical=4, error=None):
        spec = dict(zip(("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens"), shape))
        return {"spec_kwargs": dict(spec, speculative_algorithm=algorithm), "error": error,
                "overall": {"speedup": speedup, "verify_ct": 10, "accept_length": 2.0, "identical_to_plain": identical,
                            "compared": 4}}

    configs = [{"spec_kwargs": {}, "error": None, "overall": {"speedup": 1.0}},         # plain
               entry("EAGLE3", (3, 1, 4), 1.1), entry("EAGLE3", (5, 4, 8), 1.3),
               entry("EAGLE3", (6, 8, 16), 1.5, identical=3),                           # an output differs
               entry("EAGLE", (3, 1, 4), 2.0, error="boom"), entry("EAGLE", (4, 4, 8), 0.9)]
    winners = {w["algorithm"]: w["shape"] for w in best_shapes(configs)}
    assert winners == {"EAGLE3": [5, 4, 8], "EAGLE": [4, 4, 8]}


# ---- llama.cpp beside the speculative bench ---------------------------------------------------------

class _FakeLlama:
    """llama-cpp-python's generate: an endless greedy stream (here a fixed one, then EOS, then more)."""

    def __init__(self, stream):
        self.stream, self.calls = stream, []

    def token_eos(self):
        return 2

    def generate(self, ids, **sampling):
        self.calls.append((list(ids), sampling))
        yield from self.stream


def test_llama_peer_generate_stops_at_eos_only_when_asked():
    from specserve.bench import llama_peer

    llm = _FakeLlama([5, 6, 2, 7, 8, 9])
    assert llama_peer.generate(llm, [1, 4], 10, stop_at_eos=True) == [5, 6]
    assert llama_peer.generate(llm, [1, 4], 4) == [5, 6, 2, 7]
    ids, sampling = llm.calls[0]
    assert ids == [1, 4] and sampling["temp"] == 0.0 and sampling["top_k"] == 1 and sampling["reset"] is True


def test_llama_cpp_flag_is_refused_where_it_cannot_run(monkeypatch):
    from specserve.bench import llama_peer

    args = cli.parse_args(["speculative", "--llama-cpp", "--model-path", "model.safetensors"])
    with pytest.raises(ValueError, match="--llama-cpp"):
        speculative._load_peers(args)
    monkeypatch.setattr(llama_peer, "skip_reason", lambda path: None)
    args = cli.parse_args(["speculative", "--llama-cpp", "--batch-size", "4", "--model-path", "m.gguf"])
    with pytest.raises(ValueError, match="batch 1"):
        speculative._load_peers(args)
    assert speculative._load_peers(cli.parse_args(["speculative"])) == []


def test_llama_cpp_beside_verify_cost_is_refused_where_it_cannot_run_and_times_one_eval(monkeypatch):
    """``bench verify-cost --llama-cpp``: an error naming the flag where llama.cpp cannot run;
    each timed forward evaluates the W tokens on top of the context (``eval`` from n_tokens)."""
    from specserve.bench import llama_peer, verify_cost

    with pytest.raises(ValueError, match="--llama-cpp"):
        verify_cost._check_llama_cpp(cli.parse_args(["verify-cost", "--llama-cpp", "--model-path", "m.safetensors"]))

    class Llm:
        n_tokens, evaluated = 40, []

        def eval(self, tokens):
            self.evaluated.append((self.n_tokens, list(tokens)))

    llm = Llm()
    assert llama_peer.time_forward(llm, 10, [7, 8, 9]) >= 0.0
    assert llm.evaluated == [(10, [7, 8, 9])]


def test_verify_cost_prints_llama_cpp_time_over_ours(capsys):
    from specserve.bench import verify_cost

    curve = lambda ms: [{"width": w, "median_ms": m, "ratio_vs_w1": m / ms[0]} for w, m in zip((1, 8), ms)]
    result = {"widths": [1, 8], "context": 256, "repeats": 3, "mask": "causal", "quantization": "gguf",
              "kernel_variant": "avx2", "clock": "wall",
              "curves": {"float32": curve([3.0, 6.0]), verify_cost.LLAMA_CPP: curve([9.0, 30.0])}}
    verify_cost._print(result)
    line = next(row for row in capsys.readouterr().out.splitlines() if row.startswith("llama.cpp / float32"))
    assert line.split()[-2:] == ["3.00", "5.00"]


def test_llama_cpp_rows_count_tokens_and_compare_with_their_own_plain():
    args = SimpleNamespace(max_new_tokens=3, ignore_eos=False)
    entries = [speculative._new_entry(label, {}, peer=True) for label in ("llama.cpp", "llama.cpp lookup 10")]
    outputs = [[None, None], [None, None]]
    ids = [[1, 2], [3]]
    bar = SimpleNamespace(update=lambda n: None)
    for entry, out, stream in zip(entries, outputs, ([5, 2], [5, 6, 7, 8])):
        speculative._run_peer_chunk(_FakeLlama(stream), args, entry, "chat", [0, 1], ids, out, bar)
    assert outputs == [[[5], [5]], [[5, 6, 7], [5, 6, 7]]]
    plain_entry = speculative._new_entry("plain", {})
    plain_entry["per_category"]["chat"] = {"tok_s": 1.0}
    plain_entry["overall"] = {"tok_s": 1.0}
    for entry, out in zip(entries, outputs):
        speculative._finish_entry(entry)
        speculative._compare(entry, out, outputs[0], [SimpleNamespace(category="chat")] * 2, plain_entry)
    assert entries[0]["overall"]["tokens"] == 2 and entries[1]["overall"]["tokens"] == 6
    assert entries[1]["overall"]["accept_length"] is None and "warning" not in entries[1]
    assert entries[0]["overall"]["identical_to_plain"] == 2 and entries[1]["overall"]["identical_to_plain"] == 0


def test_the_step_profile_names_where_the_final_norm_ran():
    """``bench plain --profile``: a final norm the torch module ran gets its own row; one that ran
    inside the native call (never timed) is named in the rest of the forward, whose time is the
    forward minus the layers' ops, the norm and the LM head."""
    from specserve.bench.step_profile import _breakdown

    ops = {"qkv": 2.0, "attention": 1.0, "input quantization": 0.5}
    timed = _breakdown({"forward": 10.0, "step": 12.0, "final norm": 1.0, "compute_logits": 4.0}, dict(ops), 2)
    assert timed["ms_per_step"]["final norm"] == 500.0
    assert timed["ms_per_step"]["rest of forward (embedding, metadata, Python)"] == 1000.0
    native = _breakdown({"forward": 10.0, "step": 12.0, "compute_logits": 4.0}, dict(ops), 2)
    assert "final norm" not in native["ms_per_step"]
    assert native["ms_per_step"]["rest of forward (embedding and final norm natively, metadata, Python)"] == 1500.0
    assert native["of_which_input_quantization_ms"] == 250.0


def test_verify_cost_splits_a_forward_into_linears_attention_lm_head_and_the_rest():
    """``bench verify-cost --profile``: the layers' four matmuls (their input quantization is
    inside their clocks, so not added again) and attention from the native op clocks, the LM head
    as timed, the rest what remains of the forward."""
    from specserve.bench.verify_cost import split_forward

    ops = {"norms + adds": 0.1, "qkv": 1.0, "rotary + kv write": 0.2, "attention": 3.0, "o_proj": 0.5,
           "gate_up": 2.0, "silu": 0.1, "down": 1.5, "input quantization": 0.4}
    parts = split_forward(10.0, ops, 1.2)
    assert parts["linears"] == pytest.approx(5.0) and parts["attention"] == 3.0 and parts["lm_head"] == 1.2
    assert parts["rest"] == pytest.approx(10.0 - 5.0 - 3.0 - 1.2)


def test_verify_cost_profile_times_each_part_of_a_native_forward(tmp_path):
    """On a tiny model whose layers run natively (w8a8_int8), every width gets its parts, with time
    in the linears, attention and LM head, within the forward's own time; no slot is left taken."""
    from specserve.bench import verify_cost
    from specserve.engine import Engine
    from specserve.kernels import int_codes
    from tests.model.tiny_llama import random_weights, tiny_config, write_tiny_model

    if not int_codes.is_available():
        pytest.skip("CPU kernels not built here")
    model = write_tiny_model(tmp_path / "tiny", random_weights(tiny_config(), seed=5))
    engine = Engine(model_path=str(model), quantization="w8a8_int8", dtype="float32", max_total_tokens=512,
                    context_length=256, disable_radix_cache=True)
    args = SimpleNamespace(profile=True, warmup=1, repeats=3, mask="causal", clock="wall")
    free = engine.engine.pool.num_free_tokens
    rows = verify_cost._measure(engine.engine, list(range(1, 30)), [1, 4], args, lambda: None)
    assert engine.engine.pool.num_free_tokens == free                  # the context's and widths' slots back
    assert [row["width"] for row in rows] == [1, 4]
    for row in rows:
        parts = row["parts_ms"]
        assert set(parts) == set(verify_cost.PARTS)
        assert parts["linears"] > 0 and parts["attention"] > 0 and parts["lm_head"] > 0
        assert parts["rest"] >= 0                  # the parts' clocks run inside the forward's


def test_verify_cost_profile_refuses_the_cpu_clock(capsys, tmp_path):
    """The parts are wall-clock times: with --clock cpu they would not add up to the forward's."""
    from specserve.bench.cli import main as bench_main

    assert bench_main(["verify-cost", "--profile", "--clock", "cpu", "--widths", "1",
                       "--model-path", str(tmp_path)]) == 2
    assert "error: --profile splits wall-clock time" in capsys.readouterr().err


# ---- vLLM beside bench http ---------------------------------------------------------------------

def test_vllm_peer_is_skipped_with_a_reason_and_launched_on_the_bench_threads(tmp_path):
    """No ``--vllm-python``, or one that is missing: skipped, saying why. Given one, vLLM's server
    answers to the bench's model name on loopback, its CPU worker bound to cores 0..threads-1
    with none held back, the venv's Intel OpenMP preloaded where it has one."""
    from specserve.bench import vllm_peer

    assert "--vllm-python" in vllm_peer.skip_reason(None)
    assert "no such file" in vllm_peer.skip_reason(str(tmp_path / "missing"))
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("")
    assert vllm_peer.skip_reason(str(python)) is None
    cmd = vllm_peer.command(str(python), tmp_path / "hf", 4321, 2048, "bfloat16", ["--no-enable-prefix-caching"])
    assert cmd[:3] == [str(python), "-m", vllm_peer.SERVER_MODULE]
    flags = dict(zip(cmd[3::2], cmd[4::2]))
    assert flags["--served-model-name"] == "default" and flags["--port"] == "4321"
    assert flags["--host"] == "127.0.0.1" and flags["--dtype"] == "bfloat16" and flags["--max-model-len"] == "2048"
    assert cmd[-1] == "--no-enable-prefix-caching"
    env = vllm_peer.environment(str(python), 2, base={"PATH": "/bin"})
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert env["PATH"] == "/bin" and "LD_PRELOAD" not in env
    (tmp_path / "venv" / "lib").mkdir()
    (tmp_path / "venv" / "lib" / "libiomp5.so").write_text("")
    env = vllm_peer.environment(str(python), 1, base={"LD_PRELOAD": "/x.so"})
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-0"
    assert env["LD_PRELOAD"] == f"{tmp_path / 'venv' / 'lib' / 'libiomp5.so'} /x.so"


def test_vllm_peer_exports_the_model_once(tmp_path, monkeypatch):
    from specserve.bench import vllm_peer
    from specserve.loading import export

    written = []

    def fake_export(model_path, out_dir, dtype):
        written.append((model_path, dtype))
        Path(out_dir).mkdir(parents=True)
        (Path(out_dir) / "model.safetensors").write_text("")

    monkeypatch.setattr(export, "export_hf_dir", fake_export)
    first = vllm_peer.exported_model("/models/m.Q4_1.gguf", "bfloat16", tmp_path)
    assert vllm_peer.exported_model("/models/m.Q4_1.gguf", "bfloat16", tmp_path) == first
    assert first == tmp_path / "m.Q4_1.gguf-hf-bfloat16"
    import torch
    assert written == [("/models/m.Q4_1.gguf", torch.bfloat16)]


def test_bench_http_sets_ours_over_vllms_per_level():
    """Batch 1 by tokens/s per request, above it by output tokens/s; levels only one side ran are left out."""
    from specserve.bench import http, vllm_peer

    def level(clients, per_request, total):
        return {"concurrency": clients, "stream": True, "request_tokens_per_s_median": per_request,
                "output_tokens_per_s": total, "itl_p99_s": 2.0, "itl_median_s": 1.0}

    result = {"http": [level(1, 200.0, 190.0), level(16, 30.0, 600.0), level(32, 20.0, 640.0)],
              "vllm": {"http": [level(1, 50.0, 48.0), level(16, 10.0, 150.0), level(64, 5.0, 300.0)]}}
    summary = http.summarize(result)
    assert summary["http_stream_vs_vllm"] == 4.0 and summary["throughput_c16_vs_vllm"] == 4.0
    assert "throughput_c32_vs_vllm" not in summary and "throughput_c64_vs_vllm" not in summary
    args = cli.parse_args(["http"])
    assert args.vllm_python is None and args.vllm_dtype == "bfloat16"
    assert http.vllm_run(args, [[1, 2]], [3]) == {"skipped": vllm_peer.skip_reason(None)}


def test_startup_times_each_launch_until_health_answers(monkeypatch, tmp_path, capsys):
    """``bench startup`` times every launch up to the moment its server answers (here a stand-in
    that takes ~50 ms), none of the stopping, and refuses --runs below 1."""
    import contextlib
    import time

    from specserve.bench import startup

    stopping = []

    @contextlib.contextmanager
    def fake_server(server_args, threads, log_path):
        time.sleep(0.05)
        yield "http://127.0.0.1:1"
        stopping.append(server_args)
        time.sleep(0.2)

    monkeypatch.setattr(startup.hc, "server_process", fake_server)
    args = cli.parse_args(["startup", "--runs", "2", "--out", str(tmp_path)])
    args.model_path = "model.gguf"
    result = startup.run(args)
    assert len(result["seconds"]) == 2 and len(stopping) == 2
    assert all(0.05 <= s < 0.2 for s in result["seconds"])
    assert result["server_args"][-2:] == ["--model-path", "model.gguf"]
    assert "median" in capsys.readouterr().out
    args.runs = 0
    with pytest.raises(ValueError, match="--runs"):
        startup.run(args)


@pytest.mark.skipif(not int_codes.is_available(), reason="CPU kernels not built here")
def test_load_memory_loads_a_synthetic_gguf_as_blocks_and_decodes(tmp_path, capsys):
    """``bench load-memory``: a random-block GGUF of the given shape loads with its layers as
    blocks only and decodes, each variant in a process of its own; unknown variants are refused."""
    from specserve.bench import load_memory
    from specserve.bench.synthetic_gguf import Shape, write_random_gguf
    from specserve.loading.loader import read_checkpoint

    shape = Shape(layers=2, hidden=128, ffn=256, heads=4, kv_heads=2, vocab=300)
    path = write_random_gguf(tmp_path / "tiny.gguf", shape)
    cfg, _ = read_checkpoint(path)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size) == (2, 128, 256, 300)
    args = cli.parse_args(["load-memory", "--variants", "lean,dense", "--decode-steps", "2", "--out", str(tmp_path)])
    args.model_path = str(path)
    result = load_memory.run(args)
    assert [r["variant"] for r in result["runs"]] == ["lean", "dense"]
    assert all("error" not in r and r["step_ms"] > 0 and r["peak_mib"] >= r["rss_mib"] > 0 for r in result["runs"])
    assert "lean: load" in capsys.readouterr().out
    args.variants = "lean,sparse"
    with pytest.raises(ValueError, match="--variants"):
        load_memory.run(args)


@pytest.mark.skipif(not int_codes.is_available(), reason="CPU kernels not built here (no AVX2 or no C compiler)")
def test_int_linears_times_each_build_and_refuses_unknown_ones(monkeypatch, capsys):
    import torch

    from specserve.bench import int_linears

    monkeypatch.setattr("sys.argv", ["int_linears", "--variants", "avx2,avx2", "--rows", "1,3", "--layers", "1",
                                     "--repeats", "2", "--threads", "1"])
    int_linears.main()
    lines = [line for line in capsys.readouterr().out.splitlines() if "rows " in line]
    assert [line.split()[0] for line in lines] == ["1", "3"] and all("avx2" in line for line in lines)
    monkeypatch.setattr("sys.argv", ["int_linears", "--variants", "no-such-build"])
    with pytest.raises(SystemExit) as exit_info:
        int_linears.main()
    assert exit_info.value.code == 2
    codes = int_linears.random_q4_1(16, 64, torch.Generator().manual_seed(1))
    assert int_codes.int_format(codes) == int_codes.INT_Q4_1
