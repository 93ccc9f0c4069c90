"""A profile's ops attributed to the compiled step's HLO (`gpu_profile.py`): pure functions over a
trace's planes and the compiled program's text, unit-tested on synthetic events and HLO
(tests/test_gpu_profile.py), so the logic is checked where no GPU trace exists.

A trace (`jax.profiler.ProfileData`: planes -> lines -> events with name, start_ns, duration_ns,
stats) holds the step's ops on a GPU in the device plane "/device:GPU:0": the "XLA Ops" line
(events named by HLO instruction) where the profiler derived it, else the kernels on its
"Stream #..." lines, each with an `hlo_op` stat naming its instruction (memcpys without one).
XLA:CPU has no device plane: its thunks run on the host's "tf_XLA..." threads, each event named
by its instruction (nested: a while loop's event holds its body's). Each event's time counts once,
less the events nested inside it on its line (self time).

Each instruction is read from `compiled.as_text()`: opcode, fusion kind, custom-call target
(cuBLAS, cuDNN), whether it is (or fuses) a matmul, whether it moves host memory (`S(5)`), and
its op_name metadata, whose innermost featherweight scope (`jax.named_scope` in the step:
`SCOPES`) names featherweight's own work. `category` sorts every op into one of `CATEGORIES`.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter, defaultdict
from collections.abc import Iterable
from typing import Any

from featherweight.dev.hlo_cost import _COMPUTATION, _INSTRUCTION, _shape_and_opcode

# the step's named scopes (featherweight/models/llama.py, quant/nf4.py, step/loss.py,
# step/layer_loop.py, parallel/memory_kinds.py; tests/step/test_named_scopes.py)
SCOPES = (
    "nf4_dequantize", "rms_norm", "rotary", "lora", "attention", "mlp", "loss_chunk",
    "layer_update", "layer_fetch", "layer_store",
)  # fmt: skip
CATEGORIES = (
    "host transfers",
    "attention kernels",
    "nf4_dequantize",
    "lora",
    "GEMMs",
    "rms_norm/rotary",
    "loss_chunk",
    "layer_update",
    "layer slicing/stacking (copy, transpose, dynamic-(update-)slice)",
    "other",
    "not in the step's HLO",
)
MOVES = ("copy", "transpose", "dynamic-slice", "dynamic-update-slice", "copy-start", "copy-done")
# what a fusion that only moves data may hold besides `MOVES`
_MOVE_LIKE = {*MOVES, "parameter", "bitcast", "reshape", "slice", "concatenate", "broadcast",
              "tuple", "get-tuple-element", "constant", "pad"}  # fmt: skip
MATMULS = ("dot", "convolution")
_SCOPE = re.compile(r"(?:^|(?<=[/(]))(" + "|".join(SCOPES) + r")(?=[/)]|$)")
_KIND = re.compile(r"\bkind=(k\w+)")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_CALLS = re.compile(r"\bcalls=%?([\w.\-]+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_BACKEND_KIND = re.compile(r'"kind":"(__[\w$]+)"')
_MEMCPY = re.compile(r"memcpy", re.IGNORECASE)
_GEMM_TARGET = re.compile(r"gemm|matmul|cublas", re.IGNORECASE)
_ATTENTION_TARGET = re.compile(r"fmha|flash|attention", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One HLO instruction of the compiled step, as a profile needs it."""

    name: str
    opcode: str
    computation: str
    op_name: str = ""
    fusion_kind: str = ""  # kLoop, kInput, kOutput, kCustom; "" outside fusions
    target: str = ""  # custom-call target or a fusion's backend kind (__triton_gemm, __cudnn$fmha)
    matmul: bool = False  # a dot, a fusion holding one, or a GEMM custom call
    host: bool = False  # a result or operand in host memory (S(5))
    root: str = ""  # a fusion's root opcode
    moves: bool = False  # only moves data: a copy, transpose, dynamic (update) slice, or a fusion
    # of nothing else (and reshapes, bitcasts, broadcasts)
    fused_scopes: tuple[str, ...] = ()  # the scopes of a fusion's instructions, innermost each

    @property
    def scope(self) -> str:
        """The innermost featherweight scope of its op_name; for a fusion without one, the most
        frequent among its fused instructions; "" where none."""
        own = innermost_scope(self.op_name)
        if own or not self.fused_scopes:
            return own
        return Counter(self.fused_scopes).most_common(1)[0][0]


def innermost_scope(op_name: str) -> str:
    """The last of `SCOPES` that is a component of `op_name` ("jit(step)/mlp/lora/dot_general"
    -> "lora"; "transpose(jvp(rms_norm))/mul" -> "rms_norm"), "" where none is."""
    found = _SCOPE.findall(op_name)
    return found[-1] if found else ""


def _computations(text: str) -> dict[str, list[tuple[str, str, str]]]:
    """{computation: [(instruction name, its right-hand side, the whole line)]}."""
    computations: dict[str, list[tuple[str, str, str]]] = {}
    current = None
    for line in text.splitlines():
        header = _COMPUTATION.match(line)
        if header:
            current = header.group(1)
            computations[current] = []
            continue
        instruction = _INSTRUCTION.match(line) if current else None
        if instruction is not None:
            computations[current].append((instruction.group(1), instruction.group(2), line))
    return computations


def parse_hlo(text: str) -> dict[str, Instruction]:
    """Every instruction of a compiled module's text (`compiled.as_text()`), by name (names are
    unique in a module), with what its called fusion computation holds."""
    computations = _computations(text)
    opcodes = {
        name: [_shape_and_opcode(rest)[1] for _, rest, _ in body]
        for name, body in computations.items()
    }
    scopes = {
        name: tuple(s for s in (innermost_scope(_op_name(line)) for *_, line in body) if s)
        for name, body in computations.items()
    }
    instructions = {}
    for computation, body in computations.items():
        for name, rest, line in body:
            opcode = _shape_and_opcode(rest)[1]
            called = _CALLS.search(line)
            fused = called.group(1) if called and opcode == "fusion" else ""
            target = _TARGET.search(line) or _BACKEND_KIND.search(line)
            target_name = target.group(1) if target else ""
            kind = _KIND.search(line)
            instructions[name] = Instruction(
                name=name,
                opcode=opcode,
                computation=computation,
                op_name=_op_name(line),
                fusion_kind=kind.group(1) if kind and opcode == "fusion" else "",
                target=target_name,
                matmul=opcode in MATMULS
                or any(op in MATMULS for op in opcodes.get(fused, ()))
                or bool(_GEMM_TARGET.search(target_name)),
                host="S(5)" in rest.split(" metadata=")[0],
                root=opcodes[fused][-1] if opcodes.get(fused) else "",
                moves=opcode in MOVES
                or (bool(fused) and set(opcodes.get(fused, ("add",))) <= _MOVE_LIKE),
                fused_scopes=scopes.get(fused, ()),
            )
    return instructions


def _op_name(line: str) -> str:
    match = _OP_NAME.search(line)
    return match.group(1) if match else ""


def module_name(text: str) -> str:
    """The HloModule's name ("jit_step"), as a GPU trace's `hlo_module` stat gives it."""
    match = re.match(r"HloModule\s+([\w.\-]+)", text)
    return match.group(1) if match else ""


def category(instruction: Instruction | None, event_name: str = "") -> str:
    """The one of `CATEGORIES` an op's time goes to; first match wins: host moves, attention
    kernels, ops that only move data (layer slices, stacks, copies: whatever their scope), then
    featherweight's scopes before the GEMMs they hold (NF4 dequantization, LoRA's small matmuls),
    the remaining GEMMs, the rest of featherweight's scopes."""
    if instruction is None:
        return "host transfers" if _MEMCPY.search(event_name) else "not in the step's HLO"
    scope = instruction.scope
    if instruction.host or (instruction.opcode == "custom-call" and "Move" in instruction.target):
        return "host transfers"
    if _ATTENTION_TARGET.search(instruction.target) or scope == "attention":
        return "attention kernels"
    if instruction.moves or scope in ("layer_fetch", "layer_store"):
        return CATEGORIES[8]
    if scope in ("nf4_dequantize", "lora"):
        return scope
    if instruction.matmul:
        return "GEMMs"
    if scope in ("rms_norm", "rotary"):
        return "rms_norm/rotary"
    if scope in ("loss_chunk", "layer_update"):
        return scope
    return "other"


@dataclasses.dataclass(frozen=True)
class OpEvent:
    """One op's run in a trace: its HLO instruction's name and its self time."""

    op: str
    start_ns: float
    duration_ns: float
    self_ns: float
    line: str


def _stats(event: Any) -> dict[str, Any]:
    return {str(key): value for key, value in (event.stats or ())}


def _self_times(events: list[tuple[str, float, float]]) -> list[tuple[str, float, float, float]]:
    """(name, start, duration, self time) of one line's events: each less the events nested
    directly inside it (a while loop's thunk holds its body's)."""
    ordered = sorted(events, key=lambda e: (e[1], -e[2]))
    own = [duration for _, _, duration in ordered]
    stack: list[int] = []
    for index, (_, start, duration) in enumerate(ordered):
        while stack and start >= ordered[stack[-1]][1] + ordered[stack[-1]][2]:
            stack.pop()
        if stack:
            own[stack[-1]] -= duration
        stack.append(index)
    return [(n, s, d, max(o, 0.0)) for (n, s, d), o in zip(ordered, own, strict=True)]


def step_events(
    planes: Iterable[Any], instructions: dict[str, Instruction], module: str
) -> tuple[list[OpEvent], str]:
    """(the step's op events, where they came from) in a trace's planes: a GPU device plane's
    "XLA Ops" line, else its stream lines (an event's `hlo_op` stat naming the instruction;
    memcpys kept by name), else XLA:CPU's thunk events on the host plane (names that are the
    step's instructions). Events of another module (`hlo_module` stat) are left out."""
    planes = list(planes)
    devices = [p for p in planes if p.name.startswith("/device:") and "GPU" in p.name]
    if devices:
        return _device_events(devices, instructions, module)
    host = [p for p in planes if p.name.startswith("/host:CPU")]
    events = []
    for plane in host:
        for line in plane.lines:
            kept = [(e.name, e.start_ns, e.duration_ns) for e in line.events]
            kept = [e for e in kept if e[0] in instructions]
            events += [OpEvent(n, s, d, o, line.name) for n, s, d, o in _self_times(kept)]
    return events, "XLA:CPU thunk events on the host plane (/host:CPU)"


def _device_events(devices, instructions, module) -> tuple[list[OpEvent], str]:
    """The device planes' op events of `module`; should no event name it (the profiler spelling
    the module otherwise), every event, said in the source text: only the step ran traced."""
    events, where = _module_events(devices, instructions, module)
    if any(event.op in instructions for event in events):
        return events, where
    events, where = _module_events(devices, instructions, None)
    return events, f"{where} (no event of module {module!r}: every module's)"


def _module_events(devices, instructions, module: str | None) -> tuple[list[OpEvent], str]:
    events, where = [], []
    for plane in devices:
        lines = [line for line in plane.lines if line.name == "XLA Ops"]
        lines = lines or [line for line in plane.lines if line.name.startswith("Stream")]
        where += [f"{plane.name} {line.name}" for line in lines]
        for line in lines:
            kept = []
            for event in line.events:
                stats = _stats(event)
                if module is not None and _event_module(stats, module) != module:
                    continue
                op = _op_of(event, stats, instructions)
                kept.append((op or f"?{event.name}", event.start_ns, event.duration_ns))
            events += [OpEvent(n, s, d, o, line.name) for n, s, d, o in _self_times(kept)]
    return events, "; ".join(sorted(set(where)))


_ANNOTATIONS = ("hlo_op", "kernel_annotation", "annotation", "level 0", "long_name", "tf_op")
_HLO_MODULE = re.compile(r"hlo_module=([\w.\-]+)")
_TOKEN = re.compile(r"[\w.\-]+")


def _event_module(stats: dict[str, Any], module: str) -> str:
    """The module an event belongs to: its `hlo_module` stat, or `hlo_module=` inside a kernel
    annotation ("XlaModule:#hlo_module=jit_step,program_id=7#"); `module` where neither says."""
    if "hlo_module" in stats:
        return str(stats["hlo_module"])
    for key in ("kernel_annotation", "annotation"):
        found = _HLO_MODULE.search(str(stats.get(key, "")))
        if found:
            return found.group(1)
    return module


def _op_of(event: Any, stats: dict[str, Any], instructions: dict) -> str:
    """The step instruction a device event ran, "" where none: the `hlo_op` stat (the
    profiler's own), an annotation or the event's name that is, or ends in, an instruction's
    name ("...::fusion.3:#...#" -> fusion.3); a memcpy keeps its name."""
    for text in [str(stats[key]) for key in _ANNOTATIONS if key in stats] + [event.name]:
        if text in instructions:
            return text
        tokens = [token for token in _TOKEN.findall(text) if token in instructions]
        if tokens:
            return tokens[-1]
    return event.name if _MEMCPY.search(event.name) else ""


def trace_layout(planes: Iterable[Any], examples: int = 3) -> list[dict[str, Any]]:
    """Each plane's lines: event count, the first few event names and the stat keys seen, so a
    trace whose layout the attribution does not read can be read by a person."""
    layout = []
    for plane in planes:
        for line in plane.lines:
            events = list(line.events)
            keys = sorted({key for event in events[:50] for key in _stats(event)})
            names = [event.name for event in events[:examples]]
            layout.append({"plane": plane.name, "line": line.name, "events": len(events),
                           "names": names, "stats": keys})  # fmt: skip
    return layout


def busy_ns(events: Iterable[OpEvent]) -> float:
    """The time some op ran (the union of the events' intervals, over all lines)."""
    total, end = 0.0, float("-inf")
    for event in sorted(events, key=lambda e: e.start_ns):
        stop = event.start_ns + event.duration_ns
        if event.start_ns > end:
            total += event.duration_ns
        elif stop > end:
            total += stop - end
        end = max(end, stop)
    return total


def summarize(
    events: list[OpEvent], instructions: dict[str, Instruction], steps: int, step_s: float, top=25
) -> dict[str, Any]:
    """Per step: device-busy seconds, the `top` ops by self time (share of the step, runs,
    opcode / fusion kind / target, scope, category), and seconds by category and by scope."""
    per_op: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in events:
        per_op[event.op][0] += event.self_ns
        per_op[event.op][1] += 1
    by_category: dict[str, float] = dict.fromkeys(CATEGORIES, 0.0)
    by_scope: dict[str, float] = defaultdict(float)
    rows = []
    for op, (self_ns, count) in per_op.items():
        instruction = instructions.get(op)
        seconds = self_ns / 1e9 / steps
        kind = category(instruction, op)
        by_category[kind] += seconds
        by_scope[(instruction.scope if instruction else "") or "(none)"] += seconds
        rows.append(_op_row(op, instruction, seconds, count / steps, step_s, kind))
    rows.sort(key=lambda row: -row["seconds_per_step"])
    return {
        "busy_s_per_step": busy_ns(events) / 1e9 / steps,
        "op_s_per_step": sum(row["seconds_per_step"] for row in rows),
        "top_ops": rows[:top],
        "ops": len(rows),
        "by_category": by_category,
        "by_scope": dict(sorted(by_scope.items(), key=lambda item: -item[1])),
    }


def _op_row(op, instruction, seconds, runs, step_s, kind) -> dict[str, Any]:
    what = ""
    if instruction is not None:
        what = instruction.opcode + (
            f" {instruction.fusion_kind}" if instruction.fusion_kind else ""
        )
        what += f" {instruction.target}" if instruction.target else ""
        what += f" (root {instruction.root})" if instruction.root else ""
    fused = sorted(set(instruction.fused_scopes)) if instruction else []
    return {
        "op": op,
        "seconds_per_step": seconds,
        "share_of_step": seconds / step_s if step_s else None,
        "runs_per_step": runs,
        "what": what,
        "scope": instruction.scope if instruction else "",
        "fused_scopes": fused,
        "category": kind,
    }
