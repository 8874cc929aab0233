"""Import layering the design asks for: the draft head base module imports no head format, and
no proposer imports another."""
from __future__ import annotations

import ast
from pathlib import Path

import specserve

MODELS = Path(specserve.__file__).parent / "models"
FORMATS = {"specserve.models.eagle", "specserve.models.eagle3", "specserve.models.mtp",
           "specserve.models.draft_heads"}


def _imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, at top level or inside functions."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_draft_head_imports_no_head_format():
    assert not _imported_modules(MODELS / "draft_head.py") & FORMATS


def test_head_formats_import_the_base_not_the_registry():
    for name in ("eagle.py", "eagle3.py", "mtp.py"):
        imported = _imported_modules(MODELS / name)
        assert "specserve.models.draft_head" in imported
        assert not imported & FORMATS, name


def test_the_registry_knows_every_format_the_reader_finds():
    from specserve.models.draft_heads import HEAD_CLASSES

    assert set(HEAD_CLASSES) == {"eagle", "eagle3", "nextn_deepseek", "nextn_mimo"}


def test_no_proposer_imports_another():
    """Proposers share only speculative/base, tree, verify (and the draft models' mirrored_draft);
    the registry in base.py builds them, the NGRAM assist's two included."""
    from specserve.speculative.base import ASSISTED_PROPOSER, PROPOSERS

    proposers = {module for module, _ in PROPOSERS.values()} | {ASSISTED_PROPOSER[0]}
    for module in proposers:
        path = Path(specserve.__file__).parent / "speculative" / (module.rsplit(".", 1)[1] + ".py")
        assert not _imported_modules(path) & (proposers - {module}), module
