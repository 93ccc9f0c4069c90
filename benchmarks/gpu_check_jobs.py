"""What the GPU check's extra row sets (`gpu_check_attention.py`, `gpu_check_speed.py`) share:
their command line, each job run in a process of its own (`peak_bytes_in_use` is a process's
high-water mark) within one deadline, and the table written under the device's name."""

from __future__ import annotations

import argparse
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


def run_child(job_main: Callable[[str, bool], Record], args: argparse.Namespace) -> int:
    """The child's whole work: its job's record as one JSON line (what `run_jobs` reads), or
    the traceback on stderr (the parent records its last lines as the job's error)."""
    try:
        print(json.dumps(job_main(args.job, args.tiny)), flush=True)
    except Exception:
        traceback.print_exc()
        return 1
    return 0


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
    """Each job of `script` (those `--jobs` names) in its own process (`script --job NAME`), in
    order, within `args.deadline` seconds: {name: the JSON line it printed, or its error}; each record is also
    appended to `out/<kind>.jsonl` and each job's output kept in `out/<kind>-<name>.log`. A job
    for which `stop(name, record)` holds ends the run."""
    started, records = time.monotonic(), {}
    names = chosen(list(names), args)
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    if args.tiny:
        env["JAX_PLATFORMS"] = "cpu"
    results = args.out / f"{kind}.jsonl"
    results.unlink(missing_ok=True)
    for name in names:
        left = args.deadline - (time.monotonic() - started)
        if left < 20:
            records[name] = {"job": name, "error": "not run: the deadline came first"}
            continue
        command = [sys.executable, script, "--job", name, "--out", str(args.out)]
        command += ["--tiny"] if args.tiny else []
        print(f"[gpu_check_{kind}] {name}", flush=True)
        try:
            done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=left)
            (args.out / f"{kind}-{name}.log").write_text(done.stdout + done.stderr)
        except subprocess.TimeoutExpired:
            records[name] = {"job": name, "error": f"timed out after {left:.0f} s"}
            continue
        lines = [line for line in done.stdout.splitlines() if line.startswith('{"job"')]
        tail = " | ".join(done.stderr.strip().splitlines()[-3:])
        records[name] = json.loads(lines[-1]) if lines else {"job": name, "error": tail}
        with open(results, "a") as file:
            file.write(json.dumps(records[name]) + "\n")
        if stop(name, records[name]):
            break
    return records


def write_table(kind: str, records: dict[str, Record], lines: list[str], args) -> None:
    """Print the table and write it to `table-dir/gpu_check_<kind>_<device>.md` (`cpu_tiny` for
    --tiny)."""
    device = next((r["device"] for r in records.values() if "device" in r), "none")
    name = "cpu_tiny" if args.tiny else device.lower().replace(" ", "-")
    table = args.table_dir / f"gpu_check_{kind}_{name}.md"
    table.parent.mkdir(parents=True, exist_ok=True)
    emit(lines, str(table))
