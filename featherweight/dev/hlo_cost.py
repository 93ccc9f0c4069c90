"""Matmul FLOPs and operand bytes of a compiled program, read from its optimized HLO.

A development tool: the tests and benchmarks check the planner's shape-based counts
(`memory.step_cost`) against it; a training run never imports it.

`hlo_dot_flops(compiled)`: every `dot` counts 2 x output elements x contracted size, and a dot
inside a loop counts once per iteration (XLA's `known_trip_count`). XLA's own `cost_analysis()`
counts a loop body once, so it cannot see a chunked loss or a layer loop. XLA's GPU compiler
leaves few plain dots: a matmul becomes a Triton gemm fusion (a dot inside the fused computation,
counted through the call) or a cuBLAS custom call (`__cublas$gemm`, `__cublas$lt$matmul`: the
dot's dimension numbers are in its backend config), counted alike. A loop whose trip count XLA
does not know (blockwise attention's causal sweep over the key blocks below the diagonal,
S > 512) counts once; tests compare at S <= 512. `hlo_dot_operand_bytes(compiled)`: every dot's
two operands, loops by trip count (what a matmul streams through, whatever its cache keeps).
"""

from __future__ import annotations

import math
import re
from typing import NamedTuple

_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\((.*)\)\s*->.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"^(?:\{[^}]*\})?\s*([\w\-]+)\(")
_SHAPE = re.compile(r"^[a-z]\w*\[([\d,]*)\]")
_PARAMETER = re.compile(r"([\w.\-]+):\s*([a-z]\w*\[[\d,]*\])")
_CALLED = re.compile(r"(?:calls|body|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def _shape_and_opcode(rest: str) -> tuple[str, str]:
    """The result shape and the opcode of an instruction's right-hand side (a tuple shape is
    skipped as a whole: it holds spaces)."""
    if rest.startswith("("):
        depth = 0
        end = 0
        for end, char in enumerate(rest):  # noqa: B007 (end is read after the loop)
            depth += {"(": 1, ")": -1}.get(char, 0)
            if depth == 0:
                break
        shape, rest = rest[: end + 1], rest[end + 1 :]
    else:
        shape, _, rest = rest.partition(" ")
        shape = shape.split("{")[0]
    opcode = _OPCODE.match(rest.strip())
    return shape, opcode.group(1) if opcode else ""


_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s4": 1, "u4": 1, "bf16": 2, "f16": 2, "s16": 2}
_ITEMSIZE |= {"u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}


class _Array(NamedTuple):
    dims: tuple[int, ...]
    itemsize: int

    @property
    def bytes(self) -> int:
        return math.prod(self.dims) * self.itemsize


def _array(shape: str) -> _Array | None:
    match = _SHAPE.match(shape)
    if match is None:
        return None
    dims = tuple(int(d) for d in match.group(1).split(",") if d)
    return _Array(dims, _ITEMSIZE.get(shape.split("[")[0], 4))


# a matmul the GPU compiler hands to cuBLAS: a custom call whose backend_config carries the dot's
# dimension numbers (`__cublas$gemm`, `__cublas$lt$matmul`, `__cublas$lt$matmul$f8`)
_GEMM_TARGET = re.compile(r'custom_call_target="__cublas\$(?:lt\$matmul|gemm)[^"]*"')
_GEMM_CONTRACTING = re.compile(r'"lhs_contracting_dimensions":\[([^\]]*)\]')


def _matmul_counts(
    line: str, opcode: str, arrays: dict[str, _Array | None], shape: str
) -> tuple[int, int] | None:
    """(FLOPs, operand bytes) of one matmul instruction -- an HLO `dot`, or a cuBLAS gemm custom
    call (its result is a tuple: the product, then cuBLAS's workspace) -- or None for any other
    instruction. 2 x output elements x contracted size, whatever the batch dimensions."""
    if opcode == "dot":
        operands = re.search(r"\bdot\(\s*%?([\w.\-]+),\s*%?([\w.\-]+)", line)
        contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", line)
        output = _array(shape)
    elif opcode == "custom-call" and _GEMM_TARGET.search(line):
        operands = re.search(r"\bcustom-call\(\s*%?([\w.\-]+),\s*%?([\w.\-]+)", line)
        contracting = _GEMM_CONTRACTING.search(line)
        output = _array(shape.lstrip("("))
    else:
        return None
    lhs, rhs = (arrays.get(operands.group(i)) for i in (1, 2)) if operands else (None, None)
    if lhs is None or rhs is None or contracting is None or output is None:
        raise ValueError(f"cannot read the operands of a matmul in the HLO: {line.strip()[:200]}")
    dims = (int(d.strip('" ')) for d in contracting.group(1).split(",") if d.strip('" '))
    contracted = math.prod(lhs.dims[d] for d in dims)
    return 2 * math.prod(output.dims) * contracted, lhs.bytes + rhs.bytes


def _hlo_dot_totals(compiled) -> tuple[int, int]:
    """(matmul FLOPs, bytes of the matmuls' operands) of one run of a compiled program, with
    loops counted by their trip counts and the larger branch of a conditional."""
    own: dict[str, tuple[int, int]] = {}
    calls: dict[str, list[tuple[str, int]]] = {}
    branches: dict[str, list[list[str]]] = {}
    entry, current, arrays = None, None, {}
    for line in compiled.as_text().splitlines():
        header = _COMPUTATION.match(line)
        if header:
            current = header.group(1)
            entry = current if line.startswith("ENTRY") else entry
            own[current], calls[current], branches[current] = (0, 0), [], []
            arrays = {name: _array(shape) for name, shape in _PARAMETER.findall(header.group(2))}
            continue
        instruction = _INSTRUCTION.match(line) if current else None
        if instruction is None:
            continue
        name, rest = instruction.groups()
        shape, opcode = _shape_and_opcode(rest)
        arrays[name] = _array(shape)
        counts = _matmul_counts(line, opcode, arrays, shape)
        if counts is not None:
            own[current] = (own[current][0] + counts[0], own[current][1] + counts[1])
        trips = _TRIP_COUNT.search(line)
        repeat = int(trips.group(1)) if opcode == "while" and trips else 1
        for called in _CALLED.findall(line):
            calls[current].append((called, repeat))
        for group in _BRANCHES.findall(line):
            branches[current].append([b.strip().lstrip("%") for b in group.split(",")])

    def total(computation: str) -> tuple[int, int]:
        flops, moved = own.get(computation, (0, 0))
        for called, count in calls.get(computation, ()):
            inner = total(called)
            flops, moved = flops + count * inner[0], moved + count * inner[1]
        for group in branches.get(computation, ()):
            larger = max((total(b) for b in group), key=lambda counts: counts[0])
            flops, moved = flops + larger[0], moved + larger[1]
        return flops, moved

    return total(entry)


def hlo_dot_flops(compiled) -> int:
    """Matmul FLOPs of one run of a compiled program (`jax.jit(f).lower(...).compile()`), with
    loops counted by their trip counts and the larger branch of a conditional."""
    return _hlo_dot_totals(compiled)[0]


def hlo_dot_operand_bytes(compiled) -> int:
    """Bytes the matmuls of one run of a compiled program read: both operands of every dot, loops
    counted by their trip counts (what a matmul streams through, whatever its cache keeps)."""
    return _hlo_dot_totals(compiled)[1]
