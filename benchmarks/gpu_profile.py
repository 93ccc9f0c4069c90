"""Where the step's time goes (issue 32, item 3): N steps of a GPU-check case under
`jax.profiler.trace`, each op attributed to the compiled step's HLO and featherweight's scopes.

    python benchmarks/gpu_profile.py --out DIR [--case qlora] [--settings defaults|fastest]
        [--steps 3] [--warmup 2] [--tiny]
    python benchmarks/gpu_profile.py --out DIR --analyze   (again from DIR's trace, no device)

The case (`gpu_check_cases.CASES`; default `qlora`: Llama-3.1-8B QLoRA b2 x 2048 bf16 at its
defaults on the GPU) is set up as the trainer sets it up (`gpu_check_cases.set_up`, random
weights made on the device); `--settings fastest` first fits its settings to the device's usable
memory as the speed rows do (`budget.fit_budget` at `capacity.of_device`). The step is compiled
once, run `--warmup` times, then `--steps` times inside the trace (the keys made before, so only
the step runs there). DIR gets `trace/` (the `.xplane.pb`), `step_hlo.txt` (the compiled
program), `run.json` (what ran, on what, the step times), then `profile.json` and `profile.md`:
step time (median wall clock of the traced steps), device-busy time, the top ops by self time
(share of the step, runs, opcode / fusion kind / custom-call target, featherweight scope) and the
time by category (`profile_ops.CATEGORIES`) and by scope. `--analyze` redoes the last two from
DIR alone, so a parser fixed later reads a trace brought back from a GPU.

`--tiny`: TINY's shapes on CPU (SmolLM2-135M layers x 2, float32, b2 x 128), end to end in CI
(tests/test_gpu_profile.py); XLA:CPU's per-op events are its thunks on host threads, so its
times are no measure of a GPU. Not run on a GPU yet: the device-plane reading
(`profile_ops.step_events`) is written from the profiler's documented layout and tested on
synthetic planes only.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import jax
from gpu_check_cases import CASE_NAMES, CASES, GPU, TINY, case_config, set_up, settings_text
from jax.profiler import ProfileData
from profile_ops import CATEGORIES, module_name, parse_hlo, step_events, summarize, trace_layout
from results_file import emit

from featherweight.memory import budget, capacity


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--case", default="qlora", choices=CASE_NAMES)
    parser.add_argument("--settings", default="defaults", choices=("defaults", "fastest"))
    parser.add_argument("--steps", type=int, default=3, help="steps inside the trace")
    parser.add_argument("--warmup", type=int, default=2, help="steps before it")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--tiny", action="store_true", help="TINY shapes on CPU (CI)")
    parser.add_argument("--analyze", action="store_true", help="only re-read DIR's trace")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 1:
        parser.error(f"--steps {args.steps} and --warmup {args.warmup} must be at least 1")
    return args


def case_setup(case_name: str, settings: str, tiny: bool):
    """(scale, case, model config, the case's train config): at its defaults, or at the fastest
    settings within the device's usable memory, as the speed rows choose them."""
    scale = TINY if tiny else GPU
    case = next(case for case in CASES if case.name == case_name)
    model = scale.models[case.model]()
    config, _ = case_config(case, scale, model)
    if settings == "fastest":
        config, _ = budget.fit_budget(config, model, capacity.of_device().limit_bytes)
    return scale, case, model, config


def compiled_case(case_name: str, settings: str, tiny: bool):
    """(scale, case, config, the compiled step, its arguments, seconds to compile): the case set
    up as the trainer sets it up (`gpu_check_cases.set_up`) and compiled ahead of its steps."""
    scale, case, model, config = case_setup(case_name, settings, tiny)
    step, arguments = set_up(config, model, scale)
    start = time.perf_counter()
    compiled = step.lower(*arguments).compile()
    return scale, case, config, compiled, arguments, time.perf_counter() - start


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Set up, compile, warm up and trace the step; write trace/, step_hlo.txt and run.json."""
    scale, case, config, compiled, arguments, compile_s = compiled_case(
        args.case, args.settings, args.tiny
    )
    trainable, opt_state, frozen, batch, key = arguments
    (args.out / "step_hlo.txt").write_text(compiled.as_text())
    keys = [jax.random.fold_in(key, index) for index in range(args.warmup + args.steps)]
    jax.block_until_ready(keys)

    def run(index):
        nonlocal trainable, opt_state
        began = time.perf_counter()
        trainable, opt_state, metrics = compiled(trainable, opt_state, frozen, batch, keys[index])
        jax.block_until_ready((trainable, opt_state, metrics))
        return time.perf_counter() - began

    warmup_s = [run(index) for index in range(args.warmup)]
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0  # the op events only: a smaller trace to bring back
    with jax.profiler.trace(str(args.out / "trace"), profiler_options=options):
        step_s = [run(args.warmup + index) for index in range(args.steps)]
    device = jax.devices()[0]
    record = {
        "case": case.name,
        "what": case.what,
        "model": scale.model_names[case.model],
        "batch": [scale.batch, scale.seq],
        "settings": f"{args.settings}: {settings_text(config)}",
        "device": device.device_kind,
        "platform": jax.default_backend(),
        "jax": jax.__version__,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "compile_s": compile_s,
        "warmup_s": warmup_s,
        "step_s": step_s,
        "tiny": args.tiny,
    }
    (args.out / "run.json").write_text(json.dumps(record, indent=1))
    return record


def analyze(out: Path, top: int) -> dict[str, Any]:
    """profile.json and profile.md from DIR's run.json, step_hlo.txt and trace/."""
    record = json.loads((out / "run.json").read_text())
    traces = sorted((out / "trace").rglob("*.xplane.pb"), key=lambda path: path.stat().st_mtime)
    if not traces:
        raise SystemExit(f"no .xplane.pb under {out / 'trace'}: run without --analyze first")
    text = (out / "step_hlo.txt").read_text()
    instructions = parse_hlo(text)
    planes = ProfileData.from_file(str(traces[-1])).planes
    events, where = step_events(planes, instructions, module_name(text))
    steps = len(record["step_s"])
    step_s = statistics.median(record["step_s"])
    summary = summarize(events, instructions, steps, step_s, top)
    profile = {**record, "median_step_s": step_s, "events_from": where, **summary}
    profile["trace_layout"] = trace_layout(planes)
    (out / "profile.json").write_text(json.dumps(profile, indent=1))
    emit(table_lines(profile), str(out / "profile.md"))
    return profile


def _seconds(value: float) -> str:
    return f"{value * 1e3:,.2f} ms"


def _share(value: float | None) -> str:
    return "" if value is None else f"{value:.1%}"


def table_lines(profile: dict[str, Any]) -> list[str]:
    """The profile as markdown, every number labelled with where it was measured."""
    where = f"measured on {profile['device']} ({profile['platform']}), jax {profile['jax']}, "
    where += profile["date"] + (
        " (--tiny: XLA:CPU, no measure of a GPU)" if profile["tiny"] else ""
    )
    step_s = profile["median_step_s"]
    lines = [
        f"# Profile of `{profile['case']}`: {profile['model']}, b{profile['batch'][0]} x "
        f"{profile['batch'][1]}, {profile['settings']}",
        "",
        f"All numbers {where}, by `python benchmarks/gpu_profile.py`; per step, over "
        f"{len(profile['step_s'])} traced steps.",
        "",
        f"- step time (median wall clock of the traced steps): {_seconds(step_s)}; compile "
        f"{profile['compile_s']:.1f} s",
        f"- device-busy time (union of the op events): {_seconds(profile['busy_s_per_step'])} "
        f"({_share(profile['busy_s_per_step'] / step_s)} of the step); op self times summed: "
        f"{_seconds(profile['op_s_per_step'])} over {profile['ops']} ops",
        f"- events from: {profile['events_from'] or 'none found'}",
        "",
        "## Time by category",
        "",
        "| category | time / step | share of the step |",
        "| --- | ---: | ---: |",
        *(
            f"| {name} | {_seconds(profile['by_category'][name])} | "
            f"{_share(profile['by_category'][name] / step_s)} |"
            for name in CATEGORIES
        ),
        "",
        "## Time by featherweight scope (innermost)",
        "",
        "| scope | time / step | share of the step |",
        "| --- | ---: | ---: |",
        *(
            f"| {scope} | {_seconds(seconds)} | {_share(seconds / step_s)} |"
            for scope, seconds in profile["by_scope"].items()
        ),
        "",
        f"## Top {len(profile['top_ops'])} ops by self time",
        "",
        "| op | time / step | share | runs / step | what | scope (fused) | category |",
        "| --- | ---: | ---: | ---: | --- | --- | --- |",
        *(
            f"| `{row['op']}` | {_seconds(row['seconds_per_step'])} | "
            f"{_share(row['share_of_step'])} | {row['runs_per_step']:g} | {row['what']} | "
            f"{row['scope']} ({', '.join(row['fused_scopes'])}) | {row['category']} |"
            for row in profile["top_ops"]
        ),
        "",
        "## The trace's lines (what the attribution read from)",
        "",
        "| plane | line | events | first names | stats |",
        "| --- | --- | ---: | --- | --- |",
        *(
            f"| {row['plane']} | {row['line']} | {row['events']} | "
            f"{', '.join(f'`{name[:60]}`' for name in row['names'])} | {', '.join(row['stats'])} |"
            for row in profile.get("trace_layout", [])
        ),
    ]
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.analyze:
        measure(args)
    analyze(args.out, args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
