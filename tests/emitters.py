"""XLA:CPU's fusion emitters in the tests: the legacy ones by default, XLA's default (the new
emitters) for the tests marked `default_emitters`.

XLA:CPU compiles a fusion with its new emitters unless `--xla_cpu_use_fusion_emitters=false`
routes it to the legacy ones. With the legacy emitters the suite's programs compile in about half
the time (this 2-core machine, jax 0.10.2, LLVM at level 0, 2026-11-29): nine tiny training steps
6.1-8.6 s against 11.9-16.3 (one process each, five and three runs); four step-test files 137 s
against 262 (one run each, one after the other); a fresh-clone `.ci/run` 1,651 s of pytest
against 2,109 an hour before (not interleaved). Buffer assignment moves by a few bytes a program,
so the memory the tests compare plans with is the compiled program's, as before.

Floating point is not the same: the two emitters fuse differently, so two programs that XLA's
defaults compute bit for bit alike (the base on the host and on the device, the optimizer state on
the host and on the device) or within a tight tolerance (the streamed step and `jax.grad`'s,
full fine-tuning with AdamW: 1.2e-4 against the test's 2e-5) drift apart in the last bits. Those
tests, and the calibration's check that its stored measurements are today's compiler, carry
`@pytest.mark.default_emitters`: each compiles, and runs its commands, with XLA's defaults.

How: jax has no switch per compile for a flag set in XLA_FLAGS, but every compile's options pass
through `jax._src.compiler.get_compile_options`, whose `env_option_overrides` XLA applies over the
flags. While a marked test runs (its fixtures' setup included), that function is wrapped to add
the default, and XLA_FLAGS loses the flag for the commands the test starts. jax's in-memory caches
are cleared when a marked test follows an unmarked one, so no program compiled with the legacy
emitters is reused; a compiled executable a module fixture keeps is not a cache, so every test of
a fixture like that carries the mark. Where the installed XLA does not know the flag, or jax has no
such function, nothing changes: every test compiles with XLA's defaults.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

FLAG_NAME = "xla_cpu_use_fusion_emitters"
FAST_EMITTERS_FLAG = f"--{FLAG_NAME}=false"


def xla_accepts(flags: str) -> bool:
    """Whether a jax process starts with XLA_FLAGS=`flags` (XLA aborts on a flag it does not
    know, so the flag is tried in a process of its own)."""
    probe = "import jax; jax.devices()"
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True)
    return done.returncode == 0


def with_fast_emitters(flags: str) -> str:
    """`flags` with the legacy emitters, unless they name the emitters already or this jax cannot
    switch them back per test."""
    if FLAG_NAME in flags or not _switchable():
        return flags
    fast = f"{flags} {FAST_EMITTERS_FLAG}".strip()
    return fast if xla_accepts(fast) else flags


def _switchable() -> bool:
    from jax._src import compiler

    return callable(getattr(compiler, "get_compile_options", None))


class _Emitters:
    """Which emitters this process compiles with now: the legacy ones (`FAST_EMITTERS_FLAG` in
    XLA_FLAGS) until a marked test asks for the defaults (`use_defaults`)."""

    def __init__(self):
        self.restore = None  # undoes the defaults; None while the legacy emitters are in use

    def use_defaults(self, defaults: bool) -> None:
        if defaults and self.restore is None:
            self.restore = self._defaults()
        elif not defaults and self.restore is not None:
            self.restore, restore = None, self.restore
            restore()

    @staticmethod
    def _defaults():
        """Wrap `get_compile_options` to add the default, drop the flag from XLA_FLAGS, and clear
        jax's caches of programs compiled with the legacy emitters; returns the undo."""
        import jax
        from jax._src import compiler

        original, flags = compiler.get_compile_options, os.environ.get("XLA_FLAGS", "")

        def get_compile_options(*args, **kwargs):
            options = original(*args, **kwargs)
            options.env_option_overrides = [*options.env_option_overrides, (FLAG_NAME, True)]
            return options

        compiler.get_compile_options = get_compile_options
        os.environ["XLA_FLAGS"] = " ".join(flags.replace(FAST_EMITTERS_FLAG, "").split())
        jax.clear_caches()

        def restore():
            compiler.get_compile_options = original
            os.environ["XLA_FLAGS"] = flags

        return restore


_EMITTERS = _Emitters()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A marked test (setup, call and teardown) with XLA's default emitters, the others with the
    legacy ones; the switch happens only between a marked test and an unmarked one."""
    if FAST_EMITTERS_FLAG in os.environ.get("XLA_FLAGS", "") or _EMITTERS.restore is not None:
        _EMITTERS.use_defaults(item.get_closest_marker("default_emitters") is not None)
    yield
