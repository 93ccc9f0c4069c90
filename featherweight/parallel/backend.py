"""Which XLA backend this process starts, decided before `import jax` (so nothing here imports it).

XLA's GPU compiler ships as a plugin (`jax[cuda12-local]`, featherweight's `gpu-plan` extra): it
compiles train steps for an H100 on any machine (`memory.targets`). On a machine without an
NVIDIA driver the same plugin is noisy: importing jax logs "Could not find cuda drivers" from C++
(once per CUDA extension), and starting the backends prints a traceback ("Unable to load CUDA").
Neither says anything the user can act on, and the command line promises one plain line per error.

So, only when the plugin is installed and no NVIDIA driver is present:
- `JAX_PLATFORMS` defaults to "cpu" (the CUDA backend could not start anyway; an explicit setting
  is never changed) -- deviceless GPU compilation does not need the CUDA backend;
- the C++ lines printed while jax and the plugin's CUDA extension first import are dropped (stderr
  is pointed at /dev/null for the duration of those imports only; Python errors still raise).
With a driver present nothing changes: a GPU machine starts its GPU.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import importlib.util
import os
import sys
from collections.abc import Iterator

CUDA_PLUGIN = "jax_plugins.xla_cuda12"
PLUGIN_EXTENSION = "jax_cuda12_plugin.cuda_plugin_extension"


def cuda_plugin_installed() -> bool:
    """Whether XLA's CUDA plugin (the GPU compiler) is installed."""
    try:
        return importlib.util.find_spec(CUDA_PLUGIN) is not None
    except ModuleNotFoundError:  # no jax_plugins namespace at all
        return False


def nvidia_driver_present() -> bool:
    """Whether this machine has an NVIDIA driver (its kernel module or libcuda)."""
    return (
        os.path.exists("/proc/driver/nvidia/version")
        or ctypes.util.find_library("cuda") is not None
    )


def plugin_without_driver() -> bool:
    """The noisy case: the CUDA plugin installed on a machine that cannot run it."""
    return cuda_plugin_installed() and not nvidia_driver_present()


@contextlib.contextmanager
def native_stderr_silenced() -> Iterator[None]:
    """File descriptor 2 pointed at /dev/null: XLA's C++ logging writes there, not to
    `sys.stderr`; Python exceptions still propagate."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def quiet_cuda_plugin() -> None:
    """Call before the first `import jax`: in the plugin-without-driver case, default
    JAX_PLATFORMS to "cpu" and import jax with its C++ start-up lines dropped."""
    if "jax" in sys.modules or not plugin_without_driver():
        return
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    with native_stderr_silenced():
        import jax  # noqa: F401

        # what the plugin loads when the backends start (its extension and its PJRT library):
        # loaded, and logged, now; the later loads find them loaded
        with contextlib.suppress(ImportError):
            import jax_cuda12_plugin.cuda_plugin_extension  # noqa: F401  (PLUGIN_EXTENSION)
        spec = importlib.util.find_spec(CUDA_PLUGIN)
        library = os.path.join(os.path.dirname(spec.origin), "xla_cuda_plugin.so")
        with contextlib.suppress(OSError):
            ctypes.CDLL(library)
