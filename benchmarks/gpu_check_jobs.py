"""What the GPU check's extra row sets (`gpu_check_attention.py`, `gpu_check_speed.py`,
`gpu_check_families.py`) share: their command line, the jobs run in child processes within one
deadline, and the table written under the device's name.

On a GPU each job has a process of its own: `peak_bytes_in_use` is a process's high-water mark.
With `--tiny` (CPU, no device peak to keep apart) one child runs every job in turn: a child's
start (imports, the backend, the eager operations that draw the weights) was most of a tiny
job's time: the check's 13 tiny cases ran in 56 s in one process against 140 s one process each
(measured on the 2-core CPU machine of the tests, 2026-11-29). Either way the child writes each job's
output to its own log, and a job that fails is recorded and the next one runs."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from results_file import emit

Record = dict[str, Any]


def parse_args(doc: str, repo: Path, argv: list[str] | None) -> argparse.Namespace:
    """The row set's options: --out, --tiny, --deadline, --table-dir, --jobs (a subset, in the
    order given) and the child's --job."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tiny", action="store_true", help="SmolLM2 shapes on CPU (CI)")
    parser.add_argument("--deadline", type=float, default=1500.0, help="seconds for all jobs")
    parser.add_argument("--table-dir", type=Path, default=repo / "benchmarks" / "results")
    parser.add_argument("--jobs", help="a subset of the jobs, comma-separated, run in this order")
    parser.add_argument("--job", help=argparse.SUPPRESS)  # the child
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    return args


def batches(names: list[str], tiny: bool) -> list[list[str]]:
    """The jobs of each child process: one job each on a GPU, all of them in one with --tiny."""
    return [names] if tiny and names else [[name] for name in names]


@contextlib.contextmanager
def output_to(log: Path):
    """This process's output goes to `log` for the duration: Python's `sys.stdout` and
    `sys.stderr`, and file descriptors 1 and 2 (what XLA's C++ logging writes)."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(log, "w", buffering=1) as file:
        os.dup2(file.fileno(), 1)
        os.dup2(file.fileno(), 2)
        try:
            with contextlib.redirect_stdout(file), contextlib.redirect_stderr(file):
                yield
        finally:
            file.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def run_child(
    job_main: Callable[[str, bool], Record],
    args: argparse.Namespace,
    kind: str,
    stop: Callable[[str, Record], bool] = lambda name, record: False,
) -> int:
    """The child's whole work: each job `--job` names (comma-separated), in order, with its
    output in `out/<kind>-<name>.log`, ending in its record as one JSON line (what `run_jobs`
    reads) or its traceback (whose last lines the parent records as the job's error). A job for
    which `stop(name, record)` holds ends the child's jobs."""
    failed = False
    for name in args.job.split(","):
        with output_to(args.out / f"{kind}-{name}.log"):
            try:
                record = job_main(name, args.tiny)
                print(json.dumps(record), flush=True)
            except Exception:
                traceback.print_exc()
                failed, record = True, {"error": "failed"}
        if stop(name, record):
            break
    return 1 if failed else 0


def read_job_log(name: str, log: Path) -> Record | None:
    """The record a job's log ends in; its error (the log's last lines) when it has none; None
    when the job left no log (it never started)."""
    if not log.exists():
        return None
    text = log.read_text(errors="replace")
    lines = [line for line in text.splitlines() if line.startswith('{"job"')]
    if lines:
        return json.loads(lines[-1])
    tail = " | ".join(text.strip().splitlines()[-3:])
    return {"job": name, "error": tail or "no output"}


def title(what: str, records: dict[str, Record], tiny: bool) -> str:
    """A row set's table heading: what it is, on which device, by which jax."""
    some = next((r for r in records.values() if "device" in r), {})
    return f"# GPU check, {what}: {some.get('device', 'no device')}, jax {some.get('jax', '?')}" + (
        " (--tiny, CPU: no measure of a GPU)" if tiny else ""
    )


def chosen(names: list[str], args: argparse.Namespace) -> list[str]:
    """The jobs `--jobs` names, in its order (all of `names` without it); an unknown name is an
    error naming the known ones."""
    if not args.jobs:
        return names
    wanted = [name for name in args.jobs.split(",") if name]
    unknown = [name for name in wanted if name not in names]
    if unknown:
        raise SystemExit(f"unknown job(s) {', '.join(unknown)}; known: {', '.join(names)}")
    return wanted


def run_jobs(
    script: str,
    kind: str,
    names: Iterable[str],
    args: argparse.Namespace,
    stop: Callable[[str, Record], bool] = lambda name, record: False,
) -> dict[str, Record]:
    """The jobs of `script` (those `--jobs` names), in order, in child processes (`script --job
    NAMES`, `batches`), within `args.deadline` seconds: {name: its record, or its error}; each
    record is also appended to `out/<kind>.jsonl`, and each job's output is in
    `out/<kind>-<name>.log`. A job for which `stop(name, record)` holds ends the run."""
    started, records = time.monotonic(), {}
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    if args.tiny:
        env["JAX_PLATFORMS"] = "cpu"
    results = args.out / f"{kind}.jsonl"
    results.unlink(missing_ok=True)
    for batch in batches(chosen(list(names), args), args.tiny):
        left = args.deadline - (time.monotonic() - started)
        if left < 20:
            not_run = {"error": "not run: the deadline came first"}
            records.update({name: {"job": name, **not_run} for name in batch})
            continue
        for name in batch:
            (args.out / f"{kind}-{name}.log").unlink(missing_ok=True)
        command = [sys.executable, script, "--job", ",".join(batch), "--out", str(args.out)]
        command += ["--tiny"] if args.tiny else []
        print(f"[gpu_check_{kind}] {', '.join(batch)}", flush=True)
        timed_out = False
        try:
            done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=left)
            outside = (done.stdout + done.stderr).strip().splitlines()[-3:]
        except subprocess.TimeoutExpired:
            timed_out, outside = True, []
        why = f"timed out after {left:.0f} s" if timed_out else f"exit code {done.returncode}"
        for name in batch:
            record = read_job_log(name, args.out / f"{kind}-{name}.log")
            if record is None:  # the child ended before this job began: why, and its last words
                record = {"job": name, "error": " | ".join([f"not run: {why} before it", *outside])}
            elif timed_out and "error" in record:
                record = {"job": name, "error": why}
            records[name] = record
            with open(results, "a") as file:
                file.write(json.dumps(record) + "\n")
            if stop(name, record):
                return records
    return records


def write_table(kind: str, records: dict[str, Record], lines: list[str], args) -> None:
    """Print the table and write it to `table-dir/gpu_check_<kind>_<device>.md` (`cpu_tiny` for
    --tiny)."""
    device = next((r["device"] for r in records.values() if "device" in r), "none")
    name = "cpu_tiny" if args.tiny else device.lower().replace(" ", "-")
    table = args.table_dir / f"gpu_check_{kind}_{name}.md"
    table.parent.mkdir(parents=True, exist_ok=True)
    emit(lines, str(table))
