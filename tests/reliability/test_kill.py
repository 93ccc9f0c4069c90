"""SIGKILL and SIGTERM at seeded random moments of real `featherweight train` and `featherweight
export` processes: after every signal, nothing is lost (see kill_harness.py for what is checked)."""

import random
import signal
import subprocess
import time

import pytest

from tests.conftest import write_config
from tests.reliability.conftest import short_run
from tests.reliability.kill_harness import (
    ExportChain,
    Reference,
    TrainChain,
    featherweight,
    subprocess_env,
    summary,
)

SEED = 20240601
TRAIN_TRIALS = 16  # signals delivered to train processes (SIGTERM among them)
EXPORT_TRIALS = 5  # SIGKILLs delivered to export processes while they write
KILLS_PER_CHAIN = 4


def _reference(model_dir, data, tmp_path, env) -> Reference:
    """The uninterrupted run, checkpointed at every step, and its merged export."""
    every_step = {"checkpoint.every_steps": 1, "checkpoint.keep": 100}
    settings = short_run(model_dir, data, tmp_path / "reference", **every_step)
    config = write_config(tmp_path / "reference.yaml", settings)
    subprocess.run(featherweight("train", str(config)), env=env, check=True, capture_output=True)
    export_dir = tmp_path / "reference-export"
    export = ["export", str(settings["output_dir"]), "--format", "merged", "--out", str(export_dir)]
    subprocess.run(featherweight(*export), env=env, check=True, capture_output=True)
    return Reference.read(tmp_path / "reference", export_dir)


@pytest.mark.slow
def test_signals_at_random_moments_lose_nothing(tiny_model_dir, demo_data, tmp_path):
    started = time.monotonic()
    cache = tmp_path / "jax-cache"
    reference = _reference(tiny_model_dir, demo_data, tmp_path, subprocess_env(cache, True))
    env = subprocess_env(cache, write_cache=False)
    rng = random.Random(SEED)
    trials, finishes = [], []

    def delivered(command: str) -> int:
        return sum(t.delivered for t in trials if t.command == command)

    chain_number = 0
    while delivered("train") < TRAIN_TRIALS:
        chain_number += 1
        settings = short_run(tiny_model_dir, demo_data, tmp_path / f"chain-{chain_number}")
        config = write_config(tmp_path / f"chain-{chain_number}.yaml", settings)
        chain = TrainChain(tmp_path / f"chain-{chain_number}", config, settings, env, reference)
        for kill in range(KILLS_PER_CHAIN):
            if chain.latest() >= chain.steps:
                break
            sigterm = kill == 1 and chain.latest() <= chain.steps - 3
            number = signal.SIGTERM if sigterm else signal.SIGKILL
            trials.append(chain.trial(rng, len(trials) + 1, number))
            print(trials[-1].row(), flush=True)
        finishes.append((f"train chain {chain_number}", chain.finish()))

    export_chain = ExportChain(tmp_path / "exports" / "merged", env, reference)
    export_chain.out.parent.mkdir()
    while delivered("export") < EXPORT_TRIALS:
        trials.append(export_chain.trial(rng, len(trials) + 1))
        print(trials[-1].row(), flush=True)
    finishes.append(("export chain", export_chain.finish()))

    report = summary(trials, time.monotonic() - started)
    print(report, finishes, sep="\n")
    assert delivered("train") + delivered("export") >= 20
    assert any(t.signal == "SIGTERM" and t.delivered for t in trials)
    lost = [t.row() for t in trials if t.problems]  # a process that ended first is checked too
    assert not lost, report
    assert all(not problems for _, problems in finishes), finishes
