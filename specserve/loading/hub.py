"""Hugging Face Hub ids for ``--model-path``, ``--speculative-draft-model-path``,
``--tokenizer-path`` and ``--speculative-token-map``, resolved to local paths.

An existing local path is used as it is. Otherwise ``org/name`` is a Hub repository (a
snapshot of its config, tokenizer and weight files in the HF cache, ``$HF_HOME``) and
``org/name/sub/file.pt`` a file in one. ``huggingface_hub`` reads ``HF_TOKEN`` and
``HF_HUB_OFFLINE`` itself. Every failure is a ``ConfigError`` whose one line names the flag,
the id and what to do (pass a local path, set HF_TOKEN, check the revision).
"""
from __future__ import annotations

import logging
import re
from pathlib import Path

from specserve.config import ConfigError

logger = logging.getLogger(__name__)

REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]*[A-Za-z0-9]$")
REPO_FILE = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)/(?P<file>[^/].*)$")
SNAPSHOT_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.jinja", "*.txt", "*.tiktoken"]
BIN_FILES = ["pytorch_model*.bin"]      # the original EAGLE releases ship no safetensors
LOCAL_HINT = "pass a local path instead, or download it first with `hf download {id}`"


def is_hub_id(text: str) -> bool:
    return bool(REPO_ID.match(text)) and not text.startswith((".", "~"))


def resolve_checkpoint(path_or_id: str, flag: str, revision: str | None = None) -> str:
    """A local checkpoint path for ``path_or_id`` (a path, or a Hub id downloaded to the cache)."""
    local = Path(path_or_id).expanduser()
    if local.exists():
        if revision is not None:
            logger.info("%s %s is a local path: its revision flag (%s) does not apply", flag, path_or_id, revision)
        return str(local)
    if not is_hub_id(path_or_id):
        raise ConfigError(f"{flag} {path_or_id}: no such file or directory; pass an HF model directory "
                          f"(config.json + *.safetensors), a .gguf file or a Hub id such as org/name")
    return _download(path_or_id, flag, revision, None)


def resolve_file(path_or_id: str, flag: str, revision: str | None = None) -> str:
    """A local file for ``path_or_id``: a path, or ``org/name/file`` on the Hub."""
    local = Path(path_or_id).expanduser()
    if local.exists():
        return str(local)
    match = REPO_FILE.match(path_or_id)
    if match is None:
        raise ConfigError(f"{flag} {path_or_id}: no such file; pass a local file or a Hub file as "
                          f"org/name/path/in/repo")
    return _download(match["repo"], flag, revision, match["file"])


def _download(repo_id: str, flag: str, revision: str | None, filename: str | None) -> str:
    import huggingface_hub

    what = f"{repo_id}/{filename}" if filename else repo_id
    logger.info("%s %s: resolving through the Hugging Face Hub (revision %s)", flag, what, revision or "main")
    try:
        if filename is not None:        # a snapshot of one file: fails fast offline, as below
            path = Path(huggingface_hub.snapshot_download(repo_id, revision=revision, allow_patterns=[filename]))
            if not (path / filename).is_file():
                raise ConfigError(f"{flag} {what}: no such file in the Hub repository {repo_id}")
            return str(path / filename)
        path = huggingface_hub.snapshot_download(repo_id, revision=revision, allow_patterns=SNAPSHOT_FILES)
        if not list(Path(path).glob("*.safetensors")):
            path = huggingface_hub.snapshot_download(repo_id, revision=revision,
                                                     allow_patterns=SNAPSHOT_FILES + BIN_FILES)
        return path
    except ConfigError:
        raise
    except Exception as exc:        # huggingface_hub raises many kinds; each becomes one line
        raise ConfigError(explain_hub_error(exc, flag, what, revision)) from None


def explain_hub_error(exc: Exception, flag: str, what: str, revision: str | None) -> str:
    """One line for a failed Hub download: which id, why, what to do."""
    from huggingface_hub import errors

    repo_id = what if what.count("/") < 2 else "/".join(what.split("/")[:2])
    hint = LOCAL_HINT.format(id=repo_id)
    if isinstance(exc, errors.GatedRepoError):
        return f"{flag} {what}: gated on the Hugging Face Hub; accept its terms on huggingface.co and set HF_TOKEN"
    if isinstance(exc, errors.RepositoryNotFoundError):
        return (f"{flag} {what}: no such repository on the Hugging Face Hub (or it is private: set HF_TOKEN); "
                f"{hint}")
    if isinstance(exc, errors.RevisionNotFoundError):
        return f"{flag} {what}: revision {revision!r} not found on the Hugging Face Hub"
    if isinstance(exc, (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled)):   # before its base
        return (f"{flag} {what}: not a local path, and not in the Hugging Face cache with the Hub unreachable "
                f"(offline); {hint}")
    if isinstance(exc, errors.EntryNotFoundError):
        return f"{flag} {what}: no such file in the Hub repository {repo_id}"
    reason = " ".join(str(exc).split())[:200] or type(exc).__name__
    return f"{flag} {what}: could not download from the Hugging Face Hub ({reason}); {hint}"
