"""An NGRAM corpus from the target's own answers (``--speculative-ngram-corpus``).

    specserve train-draft --stage regenerate --work-dir W --num-prompts 4000   # the answers
    python -m specserve.train.ngram_corpus --answers W/answers.jsonl --out DIR
    python -m specserve.train.ngram_corpus --extend DIR --answers W2/answers.jsonl --out DIR2   # grown

Keeps each answer's output tokens (the prompts add nothing measurable: answers are where a
chat model repeats itself), in the regenerated-answer format's order, after an ``--extend``
corpus's documents, up to ``--max-tokens`` in all.
"""
from __future__ import annotations

import argparse
import sys

from tqdm import tqdm

from specserve.loading.default_model import DEFAULT_MODEL_NAME
from specserve.speculative.ngram_corpus import read_corpus_documents, write_corpus
from specserve.train.capture import answer_files, read_records


def read_answers(answers: str, max_tokens: int | None) -> list[list[int]]:
    """The answers' output tokens, in file order, up to ``max_tokens`` in all."""
    documents, total = [], 0
    for record in tqdm(read_records(answers), desc="read answers", unit="answer"):
        ids = record["output_ids"]
        if max_tokens is not None and total + len(ids) > max_tokens:
            break
        documents.append(ids)
        total += len(ids)
    return documents


def _documents(p: argparse.ArgumentParser, args: argparse.Namespace) -> list[list[int]]:
    """The ``--extend`` corpus's documents, then the new answers within ``--max-tokens`` in all."""
    earlier = []
    if args.extend is not None:
        try:        # names a folder that is not a corpus, or one of another format
            earlier = read_corpus_documents(args.extend)[0]
        except (OSError, ValueError) as e:
            p.error(f"--extend: {e}")
    held = sum(map(len, earlier))
    budget = None if args.max_tokens is None else args.max_tokens - held
    if budget is not None and budget <= 0:
        p.error(f"--max-tokens: the --extend corpus holds {held} tokens already")
    new = read_answers(args.answers, budget)
    if not new:
        p.error("--answers: no answers read")
    return earlier + new


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specserve.train.ngram_corpus", description=__doc__.split("\n")[0])
    p.add_argument("--answers", required=True, help="regenerated answers (JSONL), comma-separated")
    p.add_argument("--out", required=True, help="corpus folder to write")
    p.add_argument("--extend", default=None,
                   help="a corpus folder whose documents come first (its answers' files need not be at hand)")
    p.add_argument("--max-tokens", type=int, default=None, help="keep answers up to this many tokens")
    p.add_argument("--target", default=DEFAULT_MODEL_NAME, help="the model that wrote the answers (config.json)")
    p.add_argument("--about", default="the target's greedy answers to training prompts",
                   help="how the answers were made (config.json)")
    args = p.parse_args(argv)
    missing = [str(x) for x in answer_files(args.answers) if not x.is_file()]
    if missing:
        p.error(f"--answers: no such file: {', '.join(missing)}")
    if args.max_tokens is not None and args.max_tokens < 1:
        p.error("--max-tokens must be >= 1")
    documents = _documents(p, args)
    command = (f"--extend {args.extend} " if args.extend else "") + f"--answers {args.answers}" + \
        (f" --max-tokens {args.max_tokens}" if args.max_tokens else "")
    folder = write_corpus(documents, args.out, {"target": args.target, "about": args.about,
                                                "made_by": f"python -m specserve.train.ngram_corpus {command}"})
    print(f"ngram corpus: {len(documents)} answers, {sum(map(len, documents))} tokens in {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
