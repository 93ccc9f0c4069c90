"""tests/emitters.py: the suite compiles with XLA:CPU's legacy fusion emitters, and a test marked
`default_emitters` with XLA's defaults, in its process and in the commands it starts."""

import os
import subprocess
import sys

import pytest
from jax._src import compiler

from tests.emitters import FAST_EMITTERS_FLAG, FLAG_NAME, xla_accepts

ACCEPTED = FAST_EMITTERS_FLAG in os.environ["XLA_FLAGS"]


def _overrides() -> list:
    return list(compiler.get_compile_options(1, 1).env_option_overrides)


def _child_flags() -> str:
    probe = "import os; print(os.environ['XLA_FLAGS'])"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout


def test_this_jax_takes_the_flag_and_the_suite_sets_it():
    assert xla_accepts(FAST_EMITTERS_FLAG) == ACCEPTED
    assert not xla_accepts(
        "--xla_cpu_no_such_flag_of_featherweight=1"
    )  # XLA refuses what it does not know
    if ACCEPTED:
        assert (FLAG_NAME, True) not in _overrides()
        assert FAST_EMITTERS_FLAG in _child_flags()


@pytest.mark.default_emitters
def test_a_marked_test_compiles_and_starts_commands_with_the_default_emitters():
    if not ACCEPTED:
        pytest.skip("this XLA does not take the flag: every test compiles with its defaults")
    assert FAST_EMITTERS_FLAG not in os.environ["XLA_FLAGS"]
    assert (FLAG_NAME, True) in _overrides()
    assert FAST_EMITTERS_FLAG not in _child_flags()


def test_an_unmarked_test_after_it_has_the_legacy_emitters_again():
    if ACCEPTED:
        assert (FLAG_NAME, True) not in _overrides()
        assert FAST_EMITTERS_FLAG in os.environ["XLA_FLAGS"]
