"""argparse for ``ServerArgs``: one flag per field, grouped, each with its help, default and
choices (``flags.py``). ``--help`` prints them as SGLang groups its flags."""
from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterable
from typing import Any

from specserve.flags import FLAG_DOCS, GROUPS, FlagDoc, normalize_choice


def add_server_flags(parser: argparse.ArgumentParser, fields: Iterable[dataclasses.Field]) -> None:
    groups = {name: parser.add_argument_group(f"{name} options") for name in GROUPS}
    for f in fields:
        doc = flag_doc(f)
        group = groups.get(doc.group) or groups.setdefault(doc.group, parser.add_argument_group(doc.group))
        _add_flag(group, f, doc)


def flag_doc(f: dataclasses.Field) -> FlagDoc:
    """The field's entry in ``FLAG_DOCS``, else the one in its metadata."""
    if f.name in FLAG_DOCS:
        return FLAG_DOCS[f.name]
    meta = f.metadata
    return FlagDoc(meta.get("group", "runtime and kernels"), meta.get("help", ""),
                   tuple(meta["choices"]) if meta.get("choices") else None, tuple(meta.get("aliases", ())))


def option_strings(f: dataclasses.Field) -> list[str]:
    return ["--" + f.name.replace("_", "-"), *flag_doc(f).aliases]


def _add_flag(group, f: dataclasses.Field, doc: FlagDoc) -> None:
    default = f.default if f.default is not dataclasses.MISSING else None
    names = option_strings(f)
    if f.type in ("bool", bool):
        group.add_argument(*names, dest=f.name, action="store_true", default=default,
                           help=help_text(doc, "off"))
        return
    kwargs: dict[str, Any] = {"dest": f.name, "type": _arg_type(f.type), "default": default,
                              "help": help_text(doc, default)}
    if doc.choices:
        kwargs["choices"], kwargs["type"] = doc.choices, _choice_type(doc.choices)
        kwargs["metavar"] = "{" + ",".join(doc.choices) + "}" if len(doc.choices) <= 8 else "NAME"
    else:
        kwargs["metavar"] = _metavar(f.type)
    group.add_argument(*names, **kwargs)


def help_text(doc: FlagDoc, default: Any) -> str:
    """The sentence, then the default unless the sentence gives it, then long choice lists."""
    text = doc.help
    if "Default" not in text and "(default" not in text:
        text += f" Default: {'unset' if default is None else default}."
    if doc.choices and len(doc.choices) > 8:
        text += f" Choices: {', '.join(doc.choices)}."
    return text.replace("%", "%%")


def _arg_type(type_name: Any):
    text = str(type_name)
    if text.startswith("int"):
        return int
    if text.startswith("float"):
        return float
    return str


def _metavar(type_name: Any) -> str:
    return {int: "N", float: "X"}.get(_arg_type(type_name), "TEXT")


def _choice_type(choices: tuple[str, ...]):
    return lambda value: normalize_choice(value, choices)
