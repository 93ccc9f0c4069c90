"""With XLA's CUDA plugin installed on a machine without an NVIDIA driver, importing featherweight
prints nothing and a command-line error is still one plain line on stderr."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from featherweight.parallel import backend

ROOT = Path(__file__).resolve().parents[2]


def _run(*arguments: str) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != "JAX_PLATFORMS"}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run(
        [sys.executable, *arguments], capture_output=True, text=True, env=env, timeout=300
    )


@pytest.mark.skipif(
    not backend.plugin_without_driver(),
    reason="needs the CUDA plugin installed and no NVIDIA driver (the noisy case)",
)
def test_importing_featherweight_is_quiet_and_starts_the_cpu():
    result = _run("-c", "import featherweight, jax; print(jax.default_backend())")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "cpu" and result.stderr == ""


def test_a_command_line_error_is_one_line():
    result = _run("-m", "featherweight.cli", "plan", "/no/such/model", "--no-measure")
    assert result.returncode == 2
    assert result.stderr.count("\n") <= 1 and "error: CheckpointNotFoundError" in result.stderr


def test_the_plugin_check_needs_no_jax_import(monkeypatch):
    monkeypatch.setattr(backend, "cuda_plugin_installed", lambda: True)
    monkeypatch.setattr(backend, "nvidia_driver_present", lambda: True)
    assert not backend.plugin_without_driver()  # a GPU machine starts its GPU
