"""``specserve serve | generate | bench | train-draft``.

``serve`` takes the same flags as ``python -m specserve.launch_server``;
``generate`` runs the offline Engine on one prompt and prints the text;
``bench`` and ``train-draft`` hand their arguments to ``specserve.bench.cli``
and ``specserve.train.cli`` (imported only when asked for).
"""
from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import Any

from specserve.config import ConfigError, ServerArgs

USAGE = """usage: specserve <command> [args]

commands:
  serve          run the OpenAI-compatible HTTP server (same flags as python -m specserve.launch_server)
  generate       generate text for one prompt with the offline Engine and print it
  bench          benchmarks (specserve.bench.cli)
  train-draft    train draft heads / FR-Spec maps (specserve.train.cli)
"""
LAZY_SUBCOMMANDS = {"bench": "specserve.bench.cli", "train-draft": "specserve.train.cli"}
SAMPLING_FLAGS = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos")


def build_generate_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve generate",
                                     usage="%(prog)s [PROMPT] [--chat] [sampling options] [server options]",
                                     description="Generate text for one prompt with the offline Engine and "
                                                 "print it. Server options are launch_server's flags.")
    sampling = parser.add_argument_group("prompt and sampling options")
    sampling.add_argument("prompt", nargs="?", help="prompt text; read from stdin when omitted")
    sampling.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    sampling.add_argument("--max-new-tokens", type=int, default=128, metavar="N",
                          help="most tokens to generate (default: 128)")
    sampling.add_argument("--temperature", type=float, default=0.0, metavar="X",
                          help="sampling temperature; 0 is greedy (default: 0)")
    sampling.add_argument("--top-p", type=float, default=1.0, metavar="X",
                          help="nucleus sampling: keep the smallest set of tokens with this much probability "
                               "(default: 1.0, off)")
    sampling.add_argument("--top-k", type=int, default=-1, metavar="N",
                          help="sample among the N most likely tokens; -1 keeps all (default: -1)")
    sampling.add_argument("--seed", type=int, default=None, metavar="N",
                          help="seed of this request's sampling (default: unset)")
    sampling.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    sampling.add_argument("--show-meta", action="store_true",
                          help="print meta_info (token counts, speculative accept length) as JSON on stderr")
    ServerArgs.add_cli_args(parser)
    return parser


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def run_serve(argv: Sequence[str]) -> int:
    from specserve import launch_server

    launch_server.main(list(argv))
    return 0


def _engine_kwargs(namespace: argparse.Namespace) -> dict[str, Any]:
    """Only the server flags that differ from their defaults (Engine(**kwargs) validates them)."""
    defaults = ServerArgs()
    return {name: value for name, value in vars(namespace).items()
            if hasattr(defaults, name) and name not in SAMPLING_FLAGS and value != getattr(defaults, name)}


def _prompt_text(namespace: argparse.Namespace, engine: Any) -> str:
    prompt = namespace.prompt if namespace.prompt is not None else sys.stdin.read()
    if not namespace.chat:
        return prompt
    tokenizer = getattr(engine, "tokenizer", None)
    if tokenizer is None:
        raise ConfigError("--chat needs Engine.tokenizer")
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)


def run_generate(argv: Sequence[str]) -> int:
    import json

    namespace = build_generate_parser().parse_args(list(argv))
    from specserve.engine import Engine

    try:
        engine = Engine(**_engine_kwargs(namespace))
    except ConfigError as exc:
        return _fail(str(exc))
    try:
        sampling_params = {name: getattr(namespace, name) for name in SAMPLING_FLAGS}
        result = engine.generate(prompt=_prompt_text(namespace, engine), sampling_params=sampling_params)
        result = result[0] if isinstance(result, list) else result
        print(result["text"])
        if namespace.show_meta:
            print(json.dumps(result.get("meta_info", {}), default=str), file=sys.stderr)
    except (ConfigError, ValueError) as exc:
        return _fail(str(exc))
    finally:
        engine.shutdown()
    return 0


def run_lazy(command: str, argv: Sequence[str]) -> int:
    module_name = LAZY_SUBCOMMANDS[command]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            return _fail(f"'specserve {command}' is not available yet ({module_name} is missing)")
        raise
    result = module.main(list(argv))
    return int(result or 0)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "serve":
        return run_serve(rest)
    if command == "generate":
        return run_generate(rest)
    if command in LAZY_SUBCOMMANDS:
        return run_lazy(command, rest)
    return _fail(f"unknown command {command!r}\n{USAGE}")


if __name__ == "__main__":
    sys.exit(main())
