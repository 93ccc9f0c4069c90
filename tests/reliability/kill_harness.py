"""Kill a real `featherweight train` or `featherweight export` at seeded moments, then prove that
nothing was lost.

A trial starts the command as a subprocess, waits for a moment of its life -- a time after start
(imports, run setup, restore, compilation), a step's metrics line, a checkpoint's temporary
directory (its write, rename and the removal of the oldest), an export's staging directory -- then
a further seeded random delay, and sends SIGKILL (or SIGTERM). Then it inspects the disk:

- every checkpoint under a final name loads and equals, array for array and bit for bit, the
  uninterrupted reference run's checkpoint of the same step; the latest one never goes backwards;
- nothing partial is visible under a final name: every file of the run parses, every entry is a
  known name or a hidden temporary, an export directory is absent or complete and equal to the
  reference export;
- SIGTERM: exit code 143 and a checkpoint at the last step the metrics record.

Trials run in chains: each trial's next process is its resume (and may itself be killed); the last
process of a chain runs to the end, whose parameters and per-step losses must equal the reference's.

Subprocess start-up dominates the cost, so the reference run fills JAX's persistent compilation
cache and the trials only read it (`JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS` set high: a killed
process never leaves a half-written cache entry behind).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import yaml

from featherweight.train.checkpoint import DELETING_DIR, Checkpointer
from featherweight.train.run_dir import (
    CHECKPOINT_DIR,
    CONFIG_FILE,
    METRICS_FILE,
    RUN_ENTRIES,
    RUN_FILE,
)
from tests.conftest import CLI

ORBAX_TEMP = ".orbax-checkpoint-tmp"
ATOMIC_TEMP = ".fw-tmp-"
PNG_END = b"IEND\xaeB`\x82"
POLL_SECONDS = 0.002
TIMEOUT_SECONDS = 600.0


def featherweight(*args: str) -> list[str]:
    """The `featherweight` command line, run by this interpreter."""
    return [*CLI, *args]


def subprocess_env(cache_dir: Path, write_cache: bool) -> dict[str, str]:
    """The test environment plus JAX's persistent compilation cache (written only when asked)."""
    return {
        **os.environ,
        "JAX_COMPILATION_CACHE_DIR": str(cache_dir),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0" if write_cache else "1e9",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }


# --- reading what is on disk -------------------------------------------------------------------


def metric_records(run_dir: Path) -> list[dict]:
    """Complete records of metrics.jsonl (a line still being written is left out)."""
    path = run_dir / METRICS_FILE
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return []
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def last_logged_step(run_dir: Path) -> int:
    return max((r["step"] for r in metric_records(run_dir) if "loss" in r), default=0)


def final_steps(run_dir: Path) -> list[int]:
    """Steps with a checkpoint directory under its final name."""
    directory = run_dir / CHECKPOINT_DIR
    if not directory.is_dir():
        return []
    return sorted(int(path.name) for path in directory.iterdir() if path.name.isdigit())


def load_checkpoint(run_dir: Path, step: int) -> tuple[dict[str, np.ndarray], dict]:
    """(arrays by leaf index, metadata) of one checkpoint, read without knowing the run's shapes."""
    checkpointer = Checkpointer(run_dir / CHECKPOINT_DIR, keep=1_000_000, read_only=True)
    try:
        restored = checkpointer.manager.restore(step)
    finally:
        checkpointer.close()
    arrays = {key: np.asarray(value) for key, value in restored["arrays"].items()}
    return arrays, dict(restored["metadata"])


def equal_checkpoints(got: tuple[dict, dict], want: tuple[dict, dict]) -> bool:
    (arrays, metadata), (want_arrays, want_metadata) = got, want
    return (
        metadata == want_metadata
        and arrays.keys() == want_arrays.keys()
        and all(np.array_equal(arrays[k], want_arrays[k]) for k in arrays)
    )


def same_files(directory: Path, reference: Path) -> bool:
    """Whether two directories hold the same file names with the same bytes."""
    names = sorted(p.name for p in directory.iterdir())
    if names != sorted(p.name for p in reference.iterdir()):
        return False
    return all((directory / n).read_bytes() == (reference / n).read_bytes() for n in names)


# --- the reference -----------------------------------------------------------------------------


@dataclasses.dataclass
class Reference:
    """An uninterrupted run (a checkpoint at every step) and its merged export."""

    run_dir: Path
    export_dir: Path
    losses: dict[int, float]
    checkpoints: dict[int, tuple[dict, dict]]

    @classmethod
    def read(cls, run_dir: Path, export_dir: Path) -> Reference:
        losses = {r["step"]: r["loss"] for r in metric_records(run_dir) if "loss" in r}
        checkpoints = {step: load_checkpoint(run_dir, step) for step in final_steps(run_dir)}
        return cls(run_dir, export_dir, losses, checkpoints)


# --- one trial ---------------------------------------------------------------------------------


@dataclasses.dataclass
class Trial:
    """One signal sent to one process at one moment, and what the disk showed afterwards."""

    number: int
    command: str  # "train" | "export"
    moment: str  # "startup" | "step N" | "checkpoint N" | "export staging"
    signal: str
    delay: float
    delivered: bool = False  # the process was still alive when the signal was sent
    returncode: int | None = None
    latest_before: int | None = None
    latest_after: int | None = None
    problems: list[str] = dataclasses.field(default_factory=list)

    def row(self) -> str:
        latest = f"{self.latest_before}->{self.latest_after}" if self.command == "train" else "-"
        verdict = "ok" if not self.problems else "LOST: " + "; ".join(self.problems)
        return (
            f"{self.number:>3} {self.command:<6} {self.moment:<15} {self.signal:<7} "
            f"+{self.delay * 1000:5.0f} ms  rc={self.returncode!s:<4} ckpt {latest:<7} {verdict}"
        )


def signal_at(
    command: list[str], env: dict, reached: Callable[[], bool], delay: float, number: int
) -> tuple[bool, int]:
    """Run `command`; once `reached()` holds, wait `delay` s and send `number`.

    Returns (signal delivered to a live process, exit code).
    """
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + TIMEOUT_SECONDS
    while not reached() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(POLL_SECONDS)
    if process.poll() is None:
        time.sleep(delay)
    delivered = process.poll() is None
    if delivered:
        process.send_signal(number)
    _, stderr = process.communicate(timeout=TIMEOUT_SECONDS)
    if not delivered and process.returncode != 0:
        raise AssertionError(f"{command[3:]} failed on its own (rc {process.returncode}): {stderr}")
    return delivered, process.returncode


def inspect_run(run_dir: Path, settings: dict, reference: Reference) -> list[str]:
    """Everything visible in a killed run's directory that is partial, damaged or different."""
    problems = []
    if not run_dir.exists():
        return problems
    allowed = {*RUN_ENTRIES, ".loss.png.tmp.png"}
    for entry in run_dir.iterdir():
        if entry.name not in allowed and not entry.name.startswith(ATOMIC_TEMP):
            problems.append(f"unexpected {entry.name} in the run directory")
    config = run_dir / CONFIG_FILE
    if config.exists() and yaml.safe_load(config.read_text()) != settings_as_saved(settings):
        problems.append("config.yaml is partial or different")
    run_file = run_dir / RUN_FILE
    if run_file.exists():
        try:
            json.loads(run_file.read_text())
        except json.JSONDecodeError:
            problems.append("run.json is partial")
    metrics = run_dir / METRICS_FILE
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                problems.append(f"metrics.jsonl holds a partial line {line!r}")
                continue
            if "loss" in record and record["loss"] != reference.losses.get(record["step"]):
                problems.append(f"metrics loss of step {record['step']} differs")
    plot = run_dir / "loss.png"
    if plot.exists() and not plot.read_bytes().endswith(PNG_END):
        problems.append("loss.png is partial")
    return problems + inspect_checkpoints(run_dir, reference)


def inspect_checkpoints(run_dir: Path, reference: Reference) -> list[str]:
    directory = run_dir / CHECKPOINT_DIR
    if not directory.exists():
        return []
    problems = []
    for entry in directory.iterdir():
        if not (entry.name.isdigit() or ORBAX_TEMP in entry.name or entry.name == DELETING_DIR):
            problems.append(f"unexpected checkpoints/{entry.name}")
    for step in final_steps(run_dir):
        try:
            loaded = load_checkpoint(run_dir, step)
        except Exception as error:  # any failure to load is what this harness looks for
            problems.append(f"checkpoint {step} does not load ({type(error).__name__}: {error})")
            continue
        if not all(np.all(np.isfinite(a)) for a in loaded[0].values() if a.dtype.kind == "f"):
            problems.append(f"checkpoint {step} holds non-finite values")
        if step in reference.checkpoints and not equal_checkpoints(
            loaded, reference.checkpoints[step]
        ):
            problems.append(f"checkpoint {step} differs from the uninterrupted run's")
    return problems


def settings_as_saved(settings: dict) -> dict:
    """A config dict as the trainer writes it to config.yaml (every field, validated, the chunks
    it leaves "auto" chosen from the model's shapes)."""
    from featherweight.memory.defaults import resolve
    from featherweight.recipe.schema import parse_config
    from featherweight.train.run import read_header, resolve_model_path

    config = parse_config(settings)
    model_config, _ = read_header(resolve_model_path(config))
    return resolve(config, model_config).model_dump(mode="json")


# --- chains of trials --------------------------------------------------------------------------


@dataclasses.dataclass
class TrainChain:
    """One run directory, killed again and again while it resumes, then finished."""

    run_dir: Path
    config_path: Path
    settings: dict
    env: dict
    reference: Reference

    @property
    def steps(self) -> int:
        return self.settings["steps"]

    def checkpoint_steps(self) -> list[int]:
        every = self.settings["checkpoint"]["every_steps"]
        return sorted({*range(every, self.steps + 1, every), self.steps})

    def latest(self) -> int:
        steps = final_steps(self.run_dir)
        return steps[-1] if steps else 0

    def choose(self, rng: random.Random, number: int) -> tuple[str, Callable[[], bool], float, int]:
        """(moment, event, delay, signal) for a trial on a run that resumes from `latest()`."""
        latest = self.latest()
        if number == signal.SIGTERM:
            target = rng.randint(latest + 1, self.steps - 2)
            return f"step {target}", self._step_logged(target), rng.uniform(0, 0.05), number
        kind = rng.choice(("startup", "step", "checkpoint"))
        if kind == "startup":
            return "startup", lambda: True, rng.uniform(0.0, 6.0), number
        if kind == "step":
            target = rng.randint(latest + 1, self.steps)
            return f"step {target}", self._step_logged(target), rng.uniform(0, 0.1), number
        target = rng.choice([s for s in self.checkpoint_steps() if s > latest])
        return f"checkpoint {target}", self._checkpoint_started(target), rng.uniform(0, 0.2), number

    def _step_logged(self, step: int) -> Callable[[], bool]:
        """True once *this* process has logged `step`: a killed process may have logged steps
        past its last checkpoint, which the resumed process drops first (MetricsLog) and runs
        again, so the metrics must first have gone back to the checkpoint."""
        resumed_from = self.latest()
        truncated = False

        def logged() -> bool:
            nonlocal truncated
            last = last_logged_step(self.run_dir)
            truncated = truncated or last <= resumed_from
            return truncated and last >= step

        return logged

    def _checkpoint_started(self, step: int) -> Callable[[], bool]:
        directory = self.run_dir / CHECKPOINT_DIR

        def started() -> bool:
            if not directory.is_dir():
                return False
            return (directory / str(step)).exists() or any(directory.glob(f"{step}{ORBAX_TEMP}*"))

        return started

    def trial(self, rng: random.Random, index: int, number: int) -> Trial:
        moment, reached, delay, number = self.choose(rng, number)
        trial = Trial(index, "train", moment, signal.Signals(number).name, delay)
        trial.latest_before = self.latest()
        command = featherweight("train", str(self.config_path))
        trial.delivered, trial.returncode = signal_at(command, self.env, reached, delay, number)
        trial.latest_after = self.latest()
        trial.problems = inspect_run(self.run_dir, self.settings, self.reference)
        if trial.latest_after < trial.latest_before:
            trial.problems.append("the latest checkpoint went backwards")
        if trial.delivered and number == signal.SIGTERM:
            if trial.returncode != 128 + signal.SIGTERM:
                trial.problems.append(f"SIGTERM exit code {trial.returncode}, expected 143")
            if trial.latest_after != last_logged_step(self.run_dir):
                trial.problems.append("SIGTERM did not save the step it stopped at")
        return trial

    def finish(self) -> list[str]:
        """Run to the end; what differs from the uninterrupted run."""
        command = featherweight("train", str(self.config_path))
        done = subprocess.run(command, env=self.env, capture_output=True, text=True)
        if done.returncode != 0:
            return [f"the resumed run failed: {done.stderr[-2000:]}"]
        problems = inspect_run(self.run_dir, self.settings, self.reference)
        losses = {r["step"]: r["loss"] for r in metric_records(self.run_dir) if "loss" in r}
        if losses != self.reference.losses:
            problems.append("the per-step losses differ from the uninterrupted run's")
        if self.latest() != self.steps:
            problems.append(f"the finished run's latest checkpoint is {self.latest()}")
        leftovers = [
            p.name for p in (self.run_dir / CHECKPOINT_DIR).iterdir() if ORBAX_TEMP in p.name
        ]
        if leftovers or (self.run_dir / CHECKPOINT_DIR / DELETING_DIR).exists():
            problems.append(f"temporaries left after a clean finish: {leftovers}")
        return problems


@dataclasses.dataclass
class ExportChain:
    """Exports of the reference run into one --out, killed while staging, then finished."""

    out: Path
    env: dict
    reference: Reference

    def command(self) -> list[str]:
        run = str(self.reference.run_dir)
        return featherweight("export", run, "--format", "merged", "--out", str(self.out))

    def staging(self) -> bool:
        return any(self.out.parent.glob(f"{ATOMIC_TEMP}{self.out.name}-*"))

    def inspect(self) -> list[str]:
        problems = []
        for entry in self.out.parent.iterdir():
            known = entry == self.out or entry.name.startswith(f"{ATOMIC_TEMP}{self.out.name}-")
            if not known:
                problems.append(f"unexpected {entry.name} next to the export")
        if self.out.exists() and not same_files(self.out, self.reference.export_dir):
            problems.append("the export directory is partial or differs from the reference export")
        return problems

    def trial(self, rng: random.Random, index: int) -> Trial:
        delay = rng.uniform(0.0, 0.8)
        trial = Trial(index, "export", "export staging", "SIGKILL", delay)
        trial.delivered, trial.returncode = signal_at(
            self.command(), self.env, self.staging, delay, signal.SIGKILL
        )
        trial.problems = self.inspect()
        if self.out.exists() and not trial.problems:
            shutil.rmtree(self.out)  # it finished before the kill: the next trial exports anew
        return trial

    def finish(self) -> list[str]:
        done = subprocess.run(self.command(), env=self.env, capture_output=True, text=True)
        if done.returncode != 0:
            return [f"the repeated export failed: {done.stderr[-2000:]}"]
        problems = self.inspect()
        if self.staging():
            problems.append("staging directories left after a clean export")
        return problems


def summary(trials: list[Trial], seconds: float) -> str:
    delivered = [t for t in trials if t.delivered]
    lost = [t for t in trials if t.problems]
    lines = [t.row() for t in trials]
    lines.append(
        f"{len(delivered)} trials (signal delivered), {len(lost)} with anything lost, "
        f"{len(trials) - len(delivered)} processes ended before their signal; "
        f"{seconds:.0f} s ({math.ceil(seconds / 60)} min)"
    )
    return "\n".join(lines)
