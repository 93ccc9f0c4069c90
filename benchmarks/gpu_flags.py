"""XLA flag sets measured, not guessed (issue 32, item 3): the step's time under each set as a
ratio to the baseline set's, from interleaved runs in one call.

    python benchmarks/gpu_flags.py --out DIR [--sets baseline,latency-hiding,...] [--rounds 2]
        [--steps 5] [--case qlora] [--settings defaults|fastest] [--deadline 420] [--tiny]

XLA reads XLA_FLAGS once, when the backend starts, so each set runs in a process of its own (its
flags appended to the caller's XLA_FLAGS), in the order A B C ... A B C ... for `--rounds`
rounds; the run stops starting processes when fewer than `--reserve` seconds of `--deadline`
are left. Each process sets up the case as `gpu_profile.py` does (default `qlora`: Llama-3.1-8B
QLoRA b2 x 2048 bf16 at its defaults; random weights), compiles the step once, runs 2 steps,
then times `--steps` more and records their median, the compile time and the first loss (a flag
that changes numerics shows there). DIR gets `flags.jsonl` (one record per process, as it ends),
`flags-<set>-<round>.log`, `flags.json` and `flags.md`: per set, the median of its processes'
medians and its ratio to the baseline, each round's ratio taken within the round (neighbours in
time), and their median.

The GPU sets (`GPU_SETS`) are the ones JAX's GPU performance tips and XLA's flag list name for
one GPU's code generation and scheduling; an unknown flag makes XLA abort at start, which the
set's record shows as its error. `--tiny`: TINY's shapes on CPU with XLA:CPU's sets
(`CPU_SETS`), end to end in CI (tests/test_gpu_flags.py): no measure of a GPU. Not run on a GPU
yet.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from gpu_check_cases import CASE_NAMES
from results_file import emit

GPU_SETS = {
    "baseline": "",
    # schedules async work (copies to and from the host, collectives) to overlap compute
    "latency-hiding": "--xla_gpu_enable_latency_hiding_scheduler=true",
    # cuBLAS for every GEMM instead of Triton's fusions (which can fuse NF4 dequantization)
    "no-triton-gemm": "--xla_gpu_enable_triton_gemm=false",
    # Triton's GEMM emitter for any GEMM it supports (JAX's GPU performance tips)
    "triton-gemm-any": "--xla_gpu_triton_gemm_any=true",
    # no CUDA graphs (command buffers): launch overhead against graph capture, not a default
    "no-command-buffer": "--xla_gpu_enable_command_buffer=",
}
GPU_DEFAULT = ("baseline", "latency-hiding", "no-triton-gemm", "triton-gemm-any")
CPU_SETS = {
    "baseline": "",
    "no-xnnpack": "--xla_cpu_use_xnnpack=false",
    "single-thread-eigen": "--xla_cpu_multi_thread_eigen=false",
}
CPU_DEFAULT = ("baseline", "no-xnnpack")
WARMUP = 2


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tiny", action="store_true", help="TINY shapes on CPU (CI)")
    parser.add_argument("--sets", help="comma-separated names; the first is the baseline")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per process")
    parser.add_argument("--case", default="qlora", choices=CASE_NAMES)
    parser.add_argument("--settings", default="defaults", choices=("defaults", "fastest"))
    parser.add_argument("--deadline", type=float, default=420.0, help="seconds for all processes")
    parser.add_argument("--reserve", type=float, default=60.0, help="least left to start one")
    parser.add_argument("--set", help=argparse.SUPPRESS)  # the child
    args = parser.parse_args(argv)
    known = CPU_SETS if args.tiny else GPU_SETS
    names = args.sets.split(",") if args.sets else list(CPU_DEFAULT if args.tiny else GPU_DEFAULT)
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        parser.error(f"--sets {args.sets!r}: unknown {unknown}; use names from {sorted(known)}")
    if args.rounds < 1 or args.steps < 1:
        parser.error(f"--rounds {args.rounds} and --steps {args.steps} must be at least 1")
    args.names = names
    args.flag_sets = {name: known[name] for name in names}
    return args


def schedule(names: list[str], rounds: int) -> list[tuple[int, str]]:
    """(round, set) in the order run: every set once per round, rounds one after another."""
    return [(round_index, name) for round_index in range(rounds) for name in names]


def child_main(args: argparse.Namespace) -> dict[str, Any]:
    """The child process: set up, compile, warm up and time the step under this XLA_FLAGS."""
    import jax
    from gpu_check_cases import settings_text
    from gpu_profile import compiled_case

    scale, case, config, compiled, arguments, compile_s = compiled_case(
        args.case, args.settings, args.tiny
    )
    trainable, opt_state, frozen, batch, key = arguments
    keys = [jax.random.fold_in(key, index) for index in range(WARMUP + args.steps)]
    step_s, losses = [], []
    for index, step_key in enumerate(keys):
        began = time.perf_counter()
        trainable, opt_state, metrics = compiled(trainable, opt_state, frozen, batch, step_key)
        jax.block_until_ready((trainable, opt_state, metrics))
        if index >= WARMUP:
            step_s.append(time.perf_counter() - began)
        losses.append(float(metrics["loss"]))
    return {
        "set": args.set,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "device": jax.devices()[0].device_kind,
        "platform": jax.default_backend(),
        "jax": jax.__version__,
        "model": scale.model_names[case.model],
        "batch": [scale.batch, scale.seq],
        "settings": f"{args.settings}: {settings_text(config)}",
        "compile_s": compile_s,
        "step_s": step_s,
        "median_step_s": statistics.median(step_s),
        "first_loss": losses[0],
    }


def _child_command(args: argparse.Namespace, name: str) -> list[str]:
    command = [sys.executable, __file__, "--out", str(args.out), "--set", name]
    command += ["--steps", str(args.steps), "--case", args.case, "--settings", args.settings]
    command += ["--sets", ",".join(args.names)] + (["--tiny"] if args.tiny else [])
    return command


def run_sets(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Each (round, set) of `schedule` in its own process, within the deadline: the records."""
    started, records = time.monotonic(), []
    results = args.out / "flags.jsonl"
    results.unlink(missing_ok=True)
    for round_index, name in schedule(args.names, args.rounds):
        record = {"set": name, "round": round_index, "flags": args.flag_sets[name]}
        left = args.deadline - (time.monotonic() - started)
        if left < args.reserve:
            records.append({**record, "error": "not run: the deadline came first"})
            continue
        env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
        env["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {args.flag_sets[name]}".strip()
        if args.tiny:
            env["JAX_PLATFORMS"] = "cpu"
        print(f"[gpu_flags] round {round_index + 1}: {name} ({env['XLA_FLAGS']})", flush=True)
        try:
            done = subprocess.run(
                _child_command(args, name), capture_output=True, text=True, env=env, timeout=left
            )
            log = args.out / f"flags-{name}-{round_index + 1}.log"
            log.write_text(done.stdout + done.stderr)
            lines = [line for line in done.stdout.splitlines() if line.startswith('{"set"')]
            tail = " | ".join(done.stderr.strip().splitlines()[-3:])
            record |= json.loads(lines[-1]) if lines else {"error": tail}
        except subprocess.TimeoutExpired:
            record["error"] = f"timed out after {left:.0f} s"
        records.append(record)
        with open(results, "a") as file:
            file.write(json.dumps(record) + "\n")
    return records


def summarize(records: list[dict[str, Any]], names: list[str]) -> dict[str, dict[str, Any]]:
    """Per set: its processes' median step times, their median, each round's ratio to the
    baseline (`names[0]`) of the same round, and the median ratio; None where nothing ran."""
    baseline = names[0]
    timed = [r for r in records if "median_step_s" in r]
    base_of_round = {r["round"]: r["median_step_s"] for r in timed if r["set"] == baseline}
    summary = {}
    for name in names:
        mine = [r for r in timed if r["set"] == name]
        ratios = [
            r["median_step_s"] / base_of_round[r["round"]]
            for r in mine
            if r["round"] in base_of_round
        ]
        errors = [r["error"] for r in records if r["set"] == name and "error" in r]
        summary[name] = {
            "medians_s": [r["median_step_s"] for r in mine],
            "median_s": statistics.median(r["median_step_s"] for r in mine) if mine else None,
            "ratios": ratios,
            "ratio": statistics.median(ratios) if ratios else None,
            "compile_s": [r["compile_s"] for r in mine],
            "first_losses": [r["first_loss"] for r in mine],
            "errors": errors,
        }
    return summary


def table_lines(records: list[dict[str, Any]], summary: dict[str, dict], args) -> list[str]:
    """The result as markdown, labelled with the device, jax and date it was measured on."""
    some = next((r for r in records if "device" in r), {})
    where = f"measured on {some.get('device', 'no device')} ({some.get('platform', '?')}), jax "
    where += f"{some.get('jax', '?')}, {time.strftime('%Y-%m-%d', time.gmtime())}"
    where += " (--tiny: XLA:CPU, no measure of a GPU)" if args.tiny else ""

    def cell(value, form):
        return "" if value is None else format(value, form)

    return [
        f"# XLA flag sets: `{args.case}`, {some.get('model', '?')}, batch "
        f"{some.get('batch', '?')}, {some.get('settings', '?')}",
        "",
        f"All numbers {where}, by `python benchmarks/gpu_flags.py`: one process per set and "
        f"round, interleaved ({args.rounds} rounds), median of {args.steps} steps after "
        f"{WARMUP}; ratio = step time / the baseline's in the same round (median over rounds).",
        "",
        "| set | XLA_FLAGS | median step | ratio to baseline | per round | compile | first loss "
        "| errors |",
        "| --- | --- | ---: | ---: | --- | --- | --- | --- |",
        *(
            f"| {name} | `{args.flag_sets[name]}` | {cell(row['median_s'], '.4f')} s | "
            f"{cell(row['ratio'], '.3f')} | {', '.join(f'{r:.3f}' for r in row['ratios'])} | "
            f"{', '.join(f'{s:.0f} s' for s in row['compile_s'])} | "
            f"{', '.join(f'{loss:.6f}' for loss in row['first_losses'])} | "
            f"{'; '.join(row['errors'])[:300]} |"
            for name, row in summary.items()
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.set:
        try:
            print(json.dumps(child_main(args)), flush=True)
        except Exception:  # the parent records the last lines of stderr as the set's error
            traceback.print_exc()
            return 1
        return 0
    records = run_sets(args)
    summary = summarize(records, args.names)
    (args.out / "flags.json").write_text(json.dumps({"records": records, "summary": summary}))
    emit(table_lines(records, summary, args), str(args.out / "flags.md"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
