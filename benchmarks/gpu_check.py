"""The GPU check: every host placement compiled, run and trained on a real GPU, in one command.

    python benchmarks/gpu_check.py --out DIR [--tiny] [--cases a,b] [--deadline SECONDS]
    benchmarks/gpu_check.sh [--tiny] ...      (on the GPU machine: carried wheels, a total limit)

A CPU machine compiles host placements with one memory for host and device, and XLA:CPU never
runs the host-offload pass that refuses them on a GPU (issue 30: error E1200), nor can it show
wrong gradients from offload (openxla/xla#46231). So this runs the trainer's own path --
`build_train_step`, the optimizer-state initialiser, `place` -- on random weights drawn with a
fixed seed, one case per subprocess on a GPU (`peak_bytes_in_use` is a process-lifetime high-water
mark; `--tiny` runs every case in one: `gpu_check_jobs.batches`), each with its own time limit,
and records per case:

- compile seconds (lowering and compiling the step on the real, placed arguments);
- device bytes: `peak_bytes_in_use` (measured on the device; after setting up the arguments and
  after the steps, as `measure.DevicePeak` does), the plan's device bytes (`plan_for_config`,
  planned) and the compiled step's bytes (`memory_analysis`, compiled). XLA:CPU keeps no peak:
  there the compiled bytes stand in, set against the plan's device + host bytes (one memory);
- 7 steps on one batch: the median of steps 3-6 (seconds, and tokens per second), the loss after
  6 updates (the 7th step's loss) and the gradient norm of every step;
- the comparison with the all-device run from the same weights and batch, with the same chunks
  (`gpu_check_cases.reference_chunks`), judged at identical weights: the first step's loss and
  gradient norm, and the loss after 6 updates, each within 1e-2 (relative) in bf16 (1e-4 in
  float32). A wrong gradient from offload (e.g. openxla/xla#46231) shows at step 1 and as another
  loss trend. The later steps' gradient norms are reported (the largest relative difference) but
  not judged, for two reasons measured on an H200 (2026-11-27, bf16, Llama-3.1-8B QLoRA): a GPU's
  step is not bitwise deterministic (likely sources: cuDNN attention's backward, atomic adds) --
  the same config, weights and batch run twice gave the same first loss (12.598352432250977) and
  losses that part from step 2 on (after 6 updates 12.1153 against 12.0322, 6.9e-3 apart); and
  AdamW's first update is about lr x sign(g) per element, so rounding-level differences flip the
  sign of noise-level gradient entries and the trajectories part: the later gradient norms of a
  random-weight QLoRA model swing 10x from step to step even in the reference. At identical
  weights the placements agreed there (step-1 gradient norm within 3.8e-4) while a later norm
  came 8.4 (relative) apart. The learning rate is high (constant 1e-3 for adapters, 1e-4 for full
  fine-tuning) so that 6 updates move the loss:
  the table gives the reference's own loss drop beside the comparison, the check's power.

Cases (in order of importance, so that a time-out loses the least; Llama-3.1-8B shapes, bf16,
b2 x 2048 unless named): QLoRA at defaults (the all-device reference for QLoRA); QLoRA at loss
and MLP chunks 512 all on the device, then with the frozen base on the host at those chunks
(on the H200 on 2026-11-27 the base on the host at those chunks was 13% off the step-1 gradient
norm of the reference at 256 / 1024, and equal at the reference's chunks: open); QLoRA at the
settings `fit_budget` picks for 5.5 GiB (issue 30: it must peak within 5.5 GiB); QLoRA with each
argument placement alone (embed, optimizer_state, base: the ones E1200 refused); full fine-tuning
of Llama-3.2-1B all on the device and with its AdamW state on the host; QLoRA at the smallest
settings, after its own all-device reference (the smallest settings change numerics: NF4 head,
8-bit AdamW; that reference keeps them and puts every host placement back on the device); QLoRA
with the residual stream on the host (it already ran on an H200); LoRA at defaults.

"Smallest settings": every change the budget search makes for a budget nothing fits
(`budget.smallest_settings`, as `benchmarks/memory_8b_h100.py` and docs/long-context.md define the row), with
the batch kept at 2 (the search's last resort halves it; the row is b2 x 2048).

Results: a JSON line per case in DIR/results.jsonl, flushed as each case ends (a time-out keeps
what finished), each case's output in DIR/<case>.log, and at the end the table
`benchmarks/results/gpu_check_<gpu>.md` (`--table-dir`), copied to DIR.

`--tiny`: the same cases on CPU at SmolLM2-135M layer shapes (2 layers, a 4096-token
vocabulary; untied for the 8B's cases, tied for the 1B's), float32, b2 x 128, with a budget that
leaves 85% of QLoRA's default plan once the plan's reserve is kept (`budget.fit_budget`): the
script runs in CI (tests/test_gpu_check.py) and cannot rot.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import gpu_check_jobs
from gpu_check_cases import (
    BATCH_SEED,
    CASE_NAMES,
    CASES,
    GPU,
    STEPS,
    TINY,
    WEIGHT_SEED,
    Case,
    Scale,
    run_case,
)
from results_file import emit

from featherweight.memory.report import format_bytes, percent_difference

REPO = Path(__file__).resolve().parent.parent
TABLE_SECONDS = 15  # kept back from the deadline to write the table


def append_record(out: Path, record: dict[str, Any]) -> None:
    """One JSON line in out/results.jsonl, flushed at once (a later time-out keeps it)."""
    record = {**record, "time": datetime.datetime.now().isoformat(timespec="seconds")}
    with open(out / "results.jsonl", "a") as results:
        results.write(json.dumps(record) + "\n")
        results.flush()
        os.fsync(results.fileno())


def case_main(names: list[str], scale: Scale, out: Path) -> int:
    """In the child process: run the cases in turn, each with its output in out/<case>.log,
    and record each (or its error); exit 0 only when every one succeeded."""
    failed = False
    for name in names:
        case = next(case for case in CASES if case.name == name)
        with gpu_check_jobs.output_to(out / f"{name}.log"):
            try:
                record = run_case(case, scale)
            except Exception as error:  # a case that fails is a finding: record it, and go on
                traceback.print_exc()
                append_record(
                    out, {"case": name, "error": f"{type(error).__name__}: {error}"[:4000]}
                )
                failed = True
                continue
            append_record(out, record)
            print(json.dumps(record), flush=True)
    return 1 if failed else 0


# ---------------------------------------------------------------- the driver and the table


def run_all(cases: list[Case], scale: Scale, out: Path, deadline_s: float) -> None:
    """The cases in order, in child processes (`gpu_check_jobs.batches`: one case each on a
    GPU, all in one with --tiny), each child within its cases' time limits and the deadline;
    what a killed or crashed child leaves is recorded for each of its cases without a record."""
    started = time.monotonic()
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    if scale is TINY:
        env["JAX_PLATFORMS"] = "cpu"
    by_name = {case.name: case for case in cases}
    for batch in gpu_check_jobs.batches(list(by_name), scale is TINY):
        left = deadline_s - (time.monotonic() - started) - TABLE_SECONDS
        limit = min(sum(scale.timeout_s[by_name[name].model] for name in batch), left)
        if limit < 20:
            for name in batch:
                append_record(out, {"case": name, "error": "not run: the deadline came first"})
            continue
        for name in batch:
            (out / f"{name}.log").unlink(missing_ok=True)  # a log: the case began in this run
        command = [sys.executable, __file__, "--case", ",".join(batch), "--out", str(out)]
        command += ["--tiny"] if scale is TINY else []
        print(f"[gpu_check] {', '.join(batch)} (limit {limit:.0f} s)", end="", flush=True)
        batch_started = time.monotonic()
        try:
            done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=limit)
            code, why = done.returncode, f"exit code {done.returncode}"
            print(f": {why} after {time.monotonic() - batch_started:.0f} s", flush=True)
        except subprocess.TimeoutExpired:
            code, why = None, f"timed out after {limit:.0f} s"
            print(f": {why}", flush=True)
        if code == 0:
            continue
        recorded = read_records(out)
        for name in (name for name in batch if name not in recorded):
            log = out / f"{name}.log"
            if not log.exists():  # the child ended before this case began
                append_record(out, {"case": name, "error": f"not run: {why} before it"})
                continue
            tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-5:])
            error = f"{why}: {tail}" if code is not None and tail else why
            append_record(out, {"case": name, "error": error[:4000]})


def read_records(out: Path) -> dict[str, dict[str, Any]]:
    """The last record of each case in out/results.jsonl."""
    path = out / "results.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return {record["case"]: record for record in map(json.loads, filter(None, lines))}


def relative(value: float, reference: float) -> float:
    return abs(value - reference) / max(abs(reference), 1e-30)


def comparison(
    record: dict[str, Any], reference: dict[str, Any] | None, tolerance: float
) -> tuple[str, bool | None]:
    """(the cell, whether it matches) for a case against its all-device run; None: no verdict.

    Judged at identical weights: the first step's loss and gradient norm, and the loss after 6
    updates, within `tolerance` (relative). The later gradient norms are reported, not judged
    (the module doc says why)."""
    if reference is None or "error" in reference:
        return "reference did not run", None
    if record["numerics"] != reference["numerics"]:
        return "not comparable: the settings change numerics", None
    first_loss = relative(record["losses"][0], reference["losses"][0])
    first_grad = relative(record["grad_norms"][0], reference["grad_norms"][0])
    final_loss = relative(record["losses"][-1], reference["losses"][-1])
    later = zip(record["grad_norms"][1:], reference["grad_norms"][1:], strict=True)
    later_grad = max((relative(*pair) for pair in later), default=0.0)
    finite = all(map(math.isfinite, record["losses"] + record["grad_norms"]))
    matches = finite and max(first_loss, first_grad, final_loss) <= tolerance
    cell = (
        f"step 1: loss {first_loss:.1e}, grad norm {first_grad:.1e}; after 6 updates: loss "
        f"{final_loss:.1e}; later grad norms (not judged): up to {later_grad:.1e}"
    )
    return cell, matches


COLUMNS = (
    "case", "what", "settings as run", "compile s (measured)",
    "device peak, after steps (after setup) (measured)", "compiled bytes (XLA memory_analysis)",
    "plan (planned)", "plan vs measured", "step s, median of 3-6 (measured)", "tokens/s",
    "loss after 6 updates (drop over them)", "vs the all-device run", "result",
)  # fmt: skip


LATER_STEPS_NOT_JUDGED = (
    "The later steps' gradient norms are shown (the largest relative difference), not judged: "
    "measured on an H200 on 2026-11-27 (Llama-3.1-8B QLoRA, bf16), a GPU's step is not bitwise "
    "deterministic (likely sources: cuDNN attention's backward, atomic adds) -- the same config, "
    "weights and batch run twice gave the same first loss (12.598352432250977) and losses that "
    "part from step 2 on (after 6 updates 12.1153 against 12.0322, 6.9e-3 apart) -- and AdamW's "
    "first update is about lr x sign(g) per element, so rounding-level differences flip the sign "
    "of noise-level gradient entries and the trajectories part: a random-weight QLoRA model's "
    "later gradient norms swing 10x from step to step even in the reference."
)


def table_lines(
    records: dict[str, dict], cases: list[Case], scale: Scale, command: str
) -> list[str]:
    """The Markdown report: what ran where and what each number is, then one row per case."""
    first = next((record for record in records.values() if "error" not in record), {})
    ran_on = first.get("time", datetime.date.today().isoformat())[:10]  # the cases' day
    lines = [
        f"# GPU check: {first.get('device', 'no case ran')}, jax {first.get('jax', '-')}",
        "",
        f"Device memory (`bytes_limit`): {format_bytes(first.get('bytes_limit'))}. "
        f"Each case in its own process, `XLA_PYTHON_CLIENT_PREALLOCATE=false`.",
        "",
        f"`{command}` on {ran_on} (benchmarks/gpu_check.py says "
        f"what each number is). Shapes: {scale.model_names['large']} (QLoRA, LoRA) and "
        f"{scale.model_names['small']} (full), {scale.dtype}, b{scale.batch} x {scale.seq}; "
        f"random weights (seed {WEIGHT_SEED}) and one random batch (seed {BATCH_SEED}) for "
        f"every case of a model; {STEPS} steps of AdamW at a constant learning rate of 1e-3 "
        "(adapters) or 1e-4 (full).",
        "",
        "Measured: by this run, on the device. Planned: `plan_for_config` (the device bytes; on "
        "XLA:CPU, one memory, device + host). Compiled: XLA's `memory_analysis` of the step "
        "(device bytes; on XLA:CPU all). Plan vs measured: (planned - measured) / measured, "
        "against the device peak, or on XLA:CPU, which keeps no peak, against the compiled "
        "bytes.",
        "",
        f"Match: judged at identical weights, the first step's loss and gradient norm, and the "
        f"loss after 6 updates, each within {scale.tolerance:g} (relative) of the all-device run "
        "named, run with the same chunks; the reference's loss drop is the check's power. A "
        "wrong gradient from offload (e.g. openxla/xla#46231) shows at step 1 and as another loss "
        f"trend. {LATER_STEPS_NOT_JUDGED}",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "| --- | --- | --- |" + " ---: |" * 8 + " --- | --- |",
    ]
    return lines + ["| " + " | ".join(_cells(case, records, scale)) + " |" for case in cases]


def _chunks(record: dict[str, Any]) -> list[str]:
    """The chunk settings a record ran with, as its settings text names them."""
    return re.findall(r"\b(?:loss|vocab|mlp)_chunk \d+", record.get("settings", ""))


def _cells(case: Case, records: dict[str, dict], scale: Scale) -> list[str]:
    """One row of `COLUMNS`."""
    record = records.get(case.name)
    if record is None or "error" in record:
        error = "not run" if record is None else record["error"].splitlines()[0][:300]
        failed = [case.name, case.what] + [""] * (len(COLUMNS) - 3)
        return [*failed, "FAILED: " + error.replace("|", "/")]
    peak = record["peak_after_steps"]
    if peak is None:  # XLA:CPU
        measured, shown = record["compiled_total_bytes"], "n/a (XLA:CPU)"
        compiled = record["compiled_total_bytes"]
        planned = record["planned_device_bytes"] + record["planned_host_bytes"]
    else:
        measured = peak
        shown = f"{format_bytes(peak)} ({format_bytes(record['peak_after_setup'])})"
        compiled, planned = record["compiled_device_bytes"], record["planned_device_bytes"]
    settings = record["settings"]
    verdict = "ran"
    if case.reference:
        cell, matches = comparison(record, records.get(case.reference), scale.tolerance)
        cell = f"{case.reference}: {cell}"
        verdict = {True: "match", False: "MISMATCH", None: "not compared"}[matches]
        reference = records.get(case.reference) or {}
        if (
            case.search is None
            and _chunks(record) != _chunks(reference)
            and "error" not in reference
        ):
            verdict += " (ran with other chunks than the reference's)"
    else:
        cell = "-"
    if record["budget_bytes"]:
        settings = f"budget {format_bytes(record['budget_bytes'])}: {settings}"
        if peak is not None:
            verdict += "; peak " + ("within" if peak <= record["budget_bytes"] else "ABOVE")
            verdict += " the budget"
    if peak is not None and peak <= max(record["peak_after_setup"], record["peak_after_compile"]):
        verdict += "; the steps' own peak is hidden (setup or compile peaked higher)"
    losses = record["losses"]
    return [
        case.name,
        case.what,
        settings,
        f"{record['compile_s']:.1f}",
        shown,
        format_bytes(compiled),
        format_bytes(planned),
        f"{percent_difference(planned, measured):+.1f}%",
        f"{record['median_step_s']:.3f}",
        f"{record['tokens_per_s']:,.0f}",
        f"{losses[-1]:.4f} ({losses[0] - losses[-1]:+.3f})",
        cell,
        verdict,
    ]


def table_name(records: dict[str, dict], scale: Scale) -> str:
    """gpu_check_<gpu>.md: the GPU's model number (h100, h200, ...), or cpu_tiny."""
    kinds = [record["device"] for record in records.values() if "device" in record]
    match = re.search(r"\b([a-z]+\d+)\b", kinds[0].lower()) if kinds else None
    gpu = match.group(1) if match else (kinds[0].lower().replace(" ", "-") if kinds else "none")
    return f"gpu_check_{gpu}{'_tiny' if scale is TINY else ''}.md"


def write_table(
    lines: list[str], records: dict[str, dict], scale: Scale, args: argparse.Namespace
) -> None:
    """The table in --table-dir, under `table_name`, and a copy in --out."""
    table = args.table_dir / table_name(records, scale)
    table.parent.mkdir(parents=True, exist_ok=True)
    emit(lines, str(table))
    if table.resolve() != (args.out / table.name).resolve():
        shutil.copy(table, args.out / table.name)


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="results.jsonl, logs, the table")
    parser.add_argument("--tiny", action="store_true", help="SmolLM2 shapes on CPU (CI)")
    parser.add_argument("--cases", default=",".join(CASE_NAMES), help="a subset, in this order")
    parser.add_argument("--deadline", type=float, default=510.0, help="seconds for all cases")
    parser.add_argument("--table-dir", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--attention", action="store_true", help="then gpu_check_attention.py")
    parser.add_argument("--speed", action="store_true", help="then gpu_check_speed.py")
    parser.add_argument(
        "--table-only", action="store_true", help="no cases: the table of OUT/results.jsonl"
    )
    parser.add_argument("--case", help=argparse.SUPPRESS)  # the child: cases, comma-separated
    args = parser.parse_args(argv)
    scale = TINY if args.tiny else GPU
    args.out.mkdir(parents=True, exist_ok=True)
    if args.case:
        return case_main(args.case.split(","), scale, args.out)
    command = "python benchmarks/gpu_check.py" + (" --tiny" if args.tiny else "")
    if args.table_only:  # the verdicts of this code on a run's records
        records = read_records(args.out)
        if not records:
            parser.error(f"--table-only: no records in {args.out / 'results.jsonl'}; pass --out")
        ran = [case for case in CASES if case.name in records]
        note = f"{command} (table: --table-only, from its results.jsonl)"
        write_table(table_lines(records, ran, scale, note), records, scale, args)
        return 0
    names = [name for name in args.cases.split(",") if name]
    unknown = sorted(set(names) - set(CASE_NAMES))
    if unknown:
        parser.error(f"unknown cases {unknown}; choose from {', '.join(CASE_NAMES)}")
    cases = [case for case in CASES if case.name in names]
    (args.out / "results.jsonl").unlink(missing_ok=True)  # a new run starts a new record
    run_all(cases, scale, args.out, args.deadline)
    records = read_records(args.out)
    write_table(table_lines(records, cases, scale, command), records, scale, args)
    if args.attention:  # issue 31's rows: packed rows kept apart, long context
        import gpu_check_attention

        tiny = ["--tiny"] if args.tiny else []
        left = str(args.deadline - (time.monotonic() - started))  # what the cases left
        options = ["--out", str(args.out), "--table-dir", str(args.table_dir), "--deadline", left]
        gpu_check_attention.main([*options, *tiny])
    if args.speed:  # issue 32's rows: tokens/s beside torch + peft, defaults and fastest
        import gpu_check_speed

        tiny = ["--tiny"] if args.tiny else []
        left = str(args.deadline - (time.monotonic() - started))  # what the rows before left
        options = ["--out", str(args.out), "--table-dir", str(args.table_dir), "--deadline", left]
        gpu_check_speed.main([*options, *tiny])
    return 0


if __name__ == "__main__":
    sys.exit(main())
