"""NGRAM's corpus: the trees it drafts against a brute-force count of the continuations, the
native code against the Python reference, the folder format, the builder and the flag."""
from __future__ import annotations

import json
import random
import subprocess
import sys
from collections import Counter
from types import SimpleNamespace

import pytest

from specserve.config import ConfigError, ServerArgs
from specserve.drafts import SHIPPED_NGRAM_CORPUS
from specserve.speculative.ngram_corpus import SAMPLE, NgramCorpus, read_corpus_documents, write_corpus
from specserve.speculative.ngram_native import NativeNgramCorpus, native_available
from specserve.train import ngram_corpus as builder

needs_native = pytest.mark.skipif(not native_available(), reason="CPU kernels not built here (no compiler or CPU "
                                                                "without AVX2, or SPECSERVE_KERNELS=0)")


def _paths(tree) -> list[tuple[int, ...]]:
    """Each node's tokens from below the root down to it."""
    tokens, parents = tree.draft_tokens.tolist(), tree.parents.tolist()
    paths = [()]
    for i in range(1, len(tokens)):
        paths.append(paths[parents[i]] + (tokens[i],))
    return paths


def _brute_force(docs, tail, min_window, max_window, depth):
    """(window, Counter of continuation prefixes) of the longest window with a continuation."""
    for w in range(min(max_window, len(tail)), min_window - 1, -1):
        pattern, counts = tuple(tail[-w:]), Counter()
        for doc in docs:
            for i in range(len(doc) - w + 1):
                if tuple(doc[i:i + w]) == pattern:
                    cont = tuple(doc[i + w:i + w + depth])
                    counts.update(cont[:k] for k in range(1, len(cont) + 1))
        if counts:
            return w, counts
    return None, Counter()


@pytest.mark.parametrize("seed", range(8))
def test_the_tree_keeps_the_most_counted_continuations_of_the_longest_window(seed):
    rng = random.Random(seed)
    vocab = rng.choice([3, 6])
    docs = [[rng.randrange(vocab) for _ in range(rng.randrange(0, 25))] for _ in range(rng.randrange(1, 5))]
    min_window, max_window, branch = rng.choice([1, 2]), rng.choice([3, 5]), rng.choice([2, 4])
    corpus = NgramCorpus(docs, min_window, max_window, branch)
    assert corpus.num_tokens == sum(map(len, docs))
    for _ in range(40):
        tail, cap = [rng.randrange(vocab) for _ in range(rng.randrange(1, 8))], rng.choice([2, 3, 6, 30])
        tree = corpus.match(tail, cap)
        _, counts = _brute_force(docs, tail, min_window, max_window, min(branch, cap - 1))
        assert sum(counts.values()) <= SAMPLE * branch     # few occurrences here: no sampling
        paths = _paths(tree)
        assert tree.draft_tokens[0].item() == tail[-1] and len(paths) == min(cap, len(counts) + 1)
        kept = [counts[p] for p in paths[1:]]
        assert all(c > 0 for c in kept) and kept == sorted(kept, reverse=True)
        left_out = [c for p, c in counts.items() if p not in set(paths)]
        assert not kept or not left_out or max(left_out) <= min(kept)


@pytest.mark.parametrize("seed", range(4))
def test_a_smaller_caps_tree_is_a_prefix_of_a_larger_ones(seed):
    """What the worker relies on when it matches at the full cap and cuts the trees afterwards."""
    from specserve.speculative.tree import truncate_tree

    rng = random.Random(seed)
    docs = [[rng.randrange(4) for _ in range(rng.randrange(0, 60))] for _ in range(8)]
    kinds = [NgramCorpus] + ([NativeNgramCorpus] if native_available() else [])
    for corpus in (kind(docs, 1, 4, rng.choice([3, 18])) for kind in kinds):
        for _ in range(40):
            tail = [rng.randrange(4) for _ in range(rng.randrange(1, 6))]
            full = corpus.match(tail, 16)
            for cap in range(1, 16):
                small, cut = corpus.match(tail, cap), truncate_tree(full, cap)
                assert small.draft_tokens.tolist() == cut.draft_tokens.tolist()
                assert small.parents.tolist() == cut.parents.tolist()


def test_a_window_with_many_occurrences_reads_an_even_sample_of_them():
    docs = [[7, 8, i % 5] for i in range(1000)]              # "7 8" 1,000 times, then 0..4 evenly
    tree = NgramCorpus(docs, 2, 2, 1).match([7, 8], 6)
    assert sorted(tree.draft_tokens.tolist()[1:]) == [0, 1, 2, 3, 4]
    assert NgramCorpus(docs, 2, 2, 1).match([9, 9], 6).draft_tokens.tolist() == [9]      # no match: root only


def test_continuations_stop_at_a_document_end():
    corpus = NgramCorpus([[1, 2, 3], [4, 5, 6, 7]], 1, 4, 8)
    assert corpus.match([9, 2], 10).draft_tokens.tolist() == [2, 3]
    assert corpus.match([3], 10).draft_tokens.tolist() == [3]          # the corpus' 3 ends its answer


@needs_native
@pytest.mark.parametrize("seed", range(6))
def test_native_corpus_matches_the_python_reference(seed):
    rng = random.Random(seed)
    vocab = rng.choice([3, 5, 20])
    docs = [[rng.randrange(vocab) for _ in range(rng.randrange(0, 300))] for _ in range(rng.randrange(1, 30))]
    params = (rng.choice([1, 2, 3]), rng.choice([4, 12, 40]), rng.choice([1, 3, 18]))
    ref, native = NgramCorpus(docs, *params), NativeNgramCorpus(docs, *params)
    for _ in range(200):
        tail, cap = [rng.randrange(vocab) for _ in range(rng.randrange(1, 45))], rng.choice([1, 2, 4, 12, 40])
        a, b = ref.match(tail, cap), native.match(tail, cap)
        assert a.draft_tokens.tolist() == b.draft_tokens.tolist() and a.parents.tolist() == b.parents.tolist()


def test_folder_round_trip_and_builder(tmp_path):
    answers = tmp_path / "answers.jsonl"
    records = [{"index": i, "source": "t", "input_ids": [1, 2], "output_ids": list(range(i, i + 5))}
               for i in range(4)]
    answers.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert builder.main(["--answers", str(answers), "--out", str(tmp_path / "c"), "--max-tokens", "12"]) == 0
    docs, config = read_corpus_documents(tmp_path / "c")
    assert docs == [r["output_ids"] for r in records[:2]] and config["tokens"] == 10
    write_corpus([[5, 6], []], tmp_path / "d", {"target": "x"})
    assert read_corpus_documents(tmp_path / "d")[0] == [[5, 6], []]


def test_the_builder_extends_a_corpus_with_new_answers(tmp_path):
    write_corpus([[7, 8, 9], [10]], tmp_path / "old", {"target": "x"})
    answers = tmp_path / "answers.jsonl"
    answers.write_text("".join(json.dumps({"index": i, "source": "t", "input_ids": [1], "output_ids": [i, i + 1]})
                               + "\n" for i in range(3)))
    out = tmp_path / "grown"
    assert builder.main(["--extend", str(tmp_path / "old"), "--answers", str(answers), "--out", str(out),
                         "--max-tokens", "8"]) == 0
    docs, config = read_corpus_documents(out)
    assert docs == [[7, 8, 9], [10], [0, 1], [1, 2]] and config["made_by"].count("--extend") == 1
    bad = subprocess.run([sys.executable, "-m", "specserve.train.ngram_corpus", "--extend", str(tmp_path),
                          "--answers", str(answers), "--out", str(tmp_path / "c")], capture_output=True, text=True)
    assert bad.returncode == 2 and "error: --extend:" in bad.stderr and "Traceback" not in bad.stderr


def test_builder_names_a_missing_answers_file(tmp_path):
    out = subprocess.run([sys.executable, "-m", "specserve.train.ngram_corpus", "--answers", str(tmp_path / "no"),
                          "--out", str(tmp_path / "c")], capture_output=True, text=True)
    assert out.returncode == 2 and "error: --answers: no such file" in out.stderr and "Traceback" not in out.stderr


def test_a_folder_that_is_not_a_corpus_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_corpus_documents(tmp_path)
    (tmp_path / "config.json").write_text('{"format": "other"}')
    (tmp_path / "corpus.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="format"):
        read_corpus_documents(tmp_path)


def test_the_corpus_flag_is_for_ngram_and_its_assist_only():
    with pytest.raises(ConfigError, match="--speculative-ngram-corpus"):
        ServerArgs(speculative_algorithm="EAGLE3", speculative_ngram_corpus="none")
    assert ServerArgs(speculative_algorithm="NGRAM", speculative_ngram_corpus="none").speculative_ngram_corpus == "none"
    args = ServerArgs(speculative_algorithm="EAGLE3", speculative_ngram_assist=4, speculative_ngram_corpus="none")
    assert args.speculative_ngram_corpus == "none"


def test_the_shipped_corpus_is_the_default_models_answers():
    docs, config = read_corpus_documents(SHIPPED_NGRAM_CORPUS)
    assert config["target"] == "SmolLM2-135M-Instruct" and len(docs) == config["documents"]
    assert max(max(d) for d in docs if d) < 49152 and sum(map(len, docs)) == config["tokens"]


def _proposer(tmp_path, documents, pending=False):
    """An NGRAM proposer over these documents; ``pending``: its corpus read and indexed on a thread
    begun before (``start_corpus_load``, as the engine does while the target loads)."""
    from specserve.speculative.ngram import NgramProposer, start_corpus_load

    folder = write_corpus(documents, tmp_path / "corpus", {"target": "test"})
    args = ServerArgs(speculative_algorithm="NGRAM", speculative_ngram_corpus=str(folder))
    ctx = SimpleNamespace(server_args=args, params=None, target_config=SimpleNamespace(vocab_size=100),
                          pending_ngram_corpus=start_corpus_load(args) if pending else None)
    return NgramProposer(ctx)


def _running(num_running, prompt):
    reqs = [SimpleNamespace(rid=f"r{i}", spec_state=None, input_ids=list(prompt), output_ids=[],
                            seq_len=len(prompt)) for i in range(num_running)]
    return SimpleNamespace(scheduler=SimpleNamespace(running=reqs)), [SimpleNamespace(req=r) for r in reqs]


@pytest.mark.parametrize("pending", [False, True])
def test_the_proposer_drafts_from_its_corpus_only_on_a_quiet_server(tmp_path, pending):
    from specserve.speculative.ngram import CORPUS_MAX_RUNNING

    proposer = _proposer(tmp_path, [[5, 6, 7, 8, 9, 10]], pending)
    engine, items = _running(CORPUS_MAX_RUNNING, [1, 6, 7, 8])      # "6 7 8" is in the corpus only
    trees = proposer.propose(engine, items, [4] * len(items))
    assert [t.draft_tokens.tolist() for t in trees] == [[8, 9, 10]] * len(items)
    engine, items = _running(CORPUS_MAX_RUNNING + 1, [1, 6, 7, 8])
    assert all(t.is_root_only for t in proposer.propose(engine, items, [4] * len(items)))


@pytest.mark.parametrize("pending", [False, True])
def test_a_corpus_beyond_the_targets_vocabulary_is_refused(tmp_path, pending):
    with pytest.raises(ValueError, match="vocabulary"):
        _proposer(tmp_path, [[5, 6, 100]], pending)


def test_no_corpus_load_begins_without_a_corpus(tmp_path):
    from specserve.speculative.ngram import start_corpus_load

    for corpus in (None, "none", "None"):
        assert start_corpus_load(ServerArgs(speculative_algorithm="NGRAM", speculative_ngram_corpus=corpus)) is None


def test_a_corpus_that_fails_to_load_fails_the_proposer_as_before(tmp_path):
    """A folder gone between the flag's check and the read: the thread's error reaches the proposer
    (the engine then falls back to plain decoding, as for any draft that cannot load)."""
    from specserve.speculative.ngram import NgramProposer, start_corpus_load

    args = ServerArgs(speculative_algorithm="NGRAM", speculative_ngram_corpus=str(tmp_path / "gone"))
    ctx = SimpleNamespace(server_args=args, params=None, target_config=SimpleNamespace(vocab_size=100),
                          pending_ngram_corpus=start_corpus_load(args))
    with pytest.raises(OSError):
        NgramProposer(ctx)
