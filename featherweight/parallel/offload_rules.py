"""The host-offload rules of XLA's GPU compiler, checked on a machine without a GPU.

XLA's `host_offloader` pass (GPU and TPU only) follows every value in pinned host memory -- an
argument laid out there, or the result of a move to host -- and accepts only data movement on
it: a move to the device, a slice or dynamic slice whose result is then moved to the device, a
dynamic-update-slice that writes a value moved to host into a host buffer, reshapes that keep the
bytes, and passing it through calls, loops, conditionals and tuples. Anything else is "device
compute in host memory space", which XLA turns into (very slow, often unsupported) host compute,
and a host value reaching a result not laid out in host memory is error E1200
(`CompileTimeHostOffloadOutputLocationMismatch`). XLA:CPU has one memory and never runs that pass,
so a step that passes every CPU test can still fail to compile on a GPU.

JAX lowers for CUDA on a CPU-only machine (`jitted.trace(*args).lower(lowering_platforms=
("cuda",))`); the StableHLO then carries the `pinned_host` arguments and results and every move
between memories (`annotate_device_placement`). `host_offload_violations` walks it and lists each
operation that breaks the rules, with the host value it came from. Index operands of slices
(on the device) are not host data; a value computed on the device and then moved to the host
starts a new host value.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable
from typing import Any

HOST_KINDS = ("pinned_host", "unpinned_host")
PLACEMENT = "_xla_buffer_placement"
MOVE = "annotate_device_placement"

# operations that pass a host value on unchanged (its bytes, in the same memory)
_PASS_THROUGH = {
    "stablehlo.reshape",
    "stablehlo.bitcast_convert",
    "stablehlo.copy",
    "stablehlo.optimization_barrier",
    "stablehlo.tuple",
    "stablehlo.get_tuple_element",
}
_SLICES = {"stablehlo.slice", "stablehlo.dynamic_slice"}


@dataclasses.dataclass(frozen=True)
class Violation:
    """One operation that breaks the host-offload rules.

    op: the StableHLO operation ("stablehlo.gather", ...).
    reason: what it does wrong, in words.
    origin: the host value it came from: an argument's path (`frozen['embed']`) or the
      source location of a move to host.
    location: where in the user's code the operation comes from (MLIR location).
    """

    op: str
    reason: str
    origin: str
    location: str

    def __str__(self) -> str:
        return f"{self.op}: {self.reason} (host value from {self.origin}; at {self.location})"


def _attribute(op, name: str):
    try:
        return op.attributes[name]
    except (KeyError, IndexError):
        return None


def _placement(op) -> str | None:
    """Where an `annotate_device_placement` custom call moves its operand ("device",
    "pinned_host", ...); None for any other operation."""
    if op.name != "stablehlo.custom_call":
        return None
    target = _attribute(op, "call_target_name")
    if target is None or target.value != MOVE:
        return None
    attributes = _attribute(op, "mhlo.frontend_attributes")
    if attributes is None or PLACEMENT not in attributes:
        return None
    return attributes[PLACEMENT].value


def _host_compute(op) -> bool:
    """An operation (or call) `jax.experimental.compute_on("device_host")` asked to run on the
    host CPU."""
    attributes = _attribute(op, "mhlo.frontend_attributes")
    return (
        attributes is not None
        and "_xla_compute_type" in attributes
        and attributes["_xla_compute_type"].value == "host"
    )


def _element_count(value) -> int:
    count = 1
    for size in value.type.shape:
        count *= size
    return count


def _is_reshape(op) -> bool:
    """A `broadcast_in_dim` that only adds unit dimensions (how `expand_dims` lowers): the same
    bytes in a new shape, a bitcast once XLA has layouts."""
    if op.name != "stablehlo.broadcast_in_dim":
        return False
    return _element_count(op.operands[0]) == _element_count(op.results[0])


def _is_fresh_buffer(value) -> bool:
    """A buffer XLA may allocate in host memory itself: a constant, or one broadcast."""
    owner = getattr(value, "owner", None)
    name = getattr(owner, "name", None)
    if name == "stablehlo.constant":
        return True
    if name == "stablehlo.broadcast_in_dim":
        source = owner.operands[0].owner
        return getattr(source, "name", None) == "stablehlo.constant"
    return False


def _enclosing_function(op):
    while op is not None and op.name != "func.func":
        op = op.parent
    return op


def _walk_ops(region_holder) -> Iterable[Any]:
    for region in region_holder.regions:
        for block in region.blocks:
            for op in block.operations:
                yield op.operation
                yield from _walk_ops(op.operation)


class _Walk:
    """Follows host values through one lowered module, collecting violations."""

    def __init__(self, module) -> None:
        self.functions = {
            op.attributes["sym_name"].value: op.operation
            for op in module.body.operations
            if op.operation.name == "func.func"
        }
        self.main = self.functions["main"]
        self.calls: dict[str, list] = collections.defaultdict(list)
        for function in self.functions.values():
            for op in _walk_ops(function):
                if op.name == "func.call":
                    self.calls[op.attributes["callee"].value].append(op)
        self.host: dict[Any, str] = {}  # host value -> where it came from
        self.queue: list[tuple[Any, str]] = []
        self.violations: list[Violation] = []
        self.host_loop_slots: set[tuple[Any, int]] = set()
        self.host_buffer_writes: list[tuple[Any, str]] = []  # DUS whose buffer is on the host
        self.host_update_writes: list[tuple[Any, str]] = []  # DUS whose update is on the host

    def mark(self, value, origin: str) -> None:
        if value not in self.host:
            self.host[value] = origin
            self.queue.append((value, origin))

    def bad(self, op, reason: str, origin: str) -> None:
        self.violations.append(Violation(op.name, reason, origin, str(op.location)))

    def seed(self) -> None:
        block = self.main.regions[0].blocks[0]
        arg_attrs = _attribute(self.main, "arg_attrs")
        for index, argument in enumerate(block.arguments):
            attrs = arg_attrs[index] if arg_attrs is not None else None
            kind = (
                attrs["mhlo.memory_kind"].value if attrs and "mhlo.memory_kind" in attrs else None
            )
            if kind in HOST_KINDS:
                origin = str(argument.location).removeprefix('loc("').removesuffix('")')
                self.mark(argument, origin)
        for function in self.functions.values():
            for op in _walk_ops(function):
                if _placement(op) in HOST_KINDS:
                    self.mark(op.results[0], f"a move to host at {op.location}")

    def run(self) -> list[Violation]:
        self.seed()
        while self.queue:
            value, origin = self.queue.pop()
            for use in value.uses:
                self.use(use.owner, use.operand_number, origin)
        self.check_writes_and_loops()
        return self.violations

    def use(self, op, operand: int, origin: str) -> None:
        name = op.name
        placement = _placement(op)
        if placement is not None:
            if placement in HOST_KINDS:
                self.mark(op.results[0], origin)
            return  # a move to the device ends the path
        if name in _SLICES:
            if operand == 0:
                self.mark(op.results[0], origin)  # still host bytes: must be moved next
            else:
                self.bad(op, "uses a host value as a slice index", origin)
        elif name == "stablehlo.dynamic_update_slice":
            if operand >= 2:
                self.bad(op, "uses a host value as an update index", origin)
                return
            (self.host_buffer_writes if operand == 0 else self.host_update_writes).append(
                (op, origin)
            )
            self.mark(op.results[0], origin)
        elif name in _PASS_THROUGH or _is_reshape(op):
            index = operand if name == "stablehlo.optimization_barrier" else 0
            self.mark(op.results[index], origin)
        elif _host_compute(op):
            self.bad(op, "host compute (compute_on device_host) on a host value", origin)
        elif name == "func.call":
            callee = self.functions[op.attributes["callee"].value]
            self.mark(callee.regions[0].blocks[0].arguments[operand], origin)
        elif name == "func.return":
            self.returned(op, operand, origin)
        elif name == "stablehlo.while":
            self.host_loop_slots.add((op, operand))
            for region in op.regions:
                self.mark(region.blocks[0].arguments[operand], origin)
            self.mark(op.results[operand], origin)
        elif name == "stablehlo.return":
            self.region_result(op, operand, origin)
        else:
            self.bad(op, "computes on a host value (XLA: device compute in host memory)", origin)

    def returned(self, op, operand: int, origin: str) -> None:
        function = _enclosing_function(op)
        symbol = function.attributes["sym_name"].value
        if symbol == "main":
            res_attrs = _attribute(function, "res_attrs")
            attrs = res_attrs[operand] if res_attrs is not None else None
            kind = (
                attrs["mhlo.memory_kind"].value if attrs and "mhlo.memory_kind" in attrs else None
            )
            if kind not in HOST_KINDS:
                info = (
                    attrs["jax.result_info"].value if attrs and "jax.result_info" in attrs else ""
                )
                self.bad(
                    op,
                    f"returns a host value as device output {info or operand} (XLA E1200)",
                    origin,
                )
            return
        for call in self.calls[symbol]:
            self.mark(call.results[operand], origin)

    def region_result(self, op, operand: int, origin: str) -> None:
        parent = op.parent
        if parent.name == "stablehlo.while":
            self.host_loop_slots.add((parent, operand))
            self.mark(parent.results[operand], origin)
            self.mark(parent.regions[1].blocks[0].arguments[operand], origin)
        elif parent.name in ("stablehlo.case", "stablehlo.if"):
            self.mark(parent.results[operand], origin)
        else:
            self.bad(op, f"a host value leaves a {parent.name} region", origin)

    def check_writes_and_loops(self) -> None:
        """Writes and loop slots that mix memories: only visible once every host value is known."""
        for op, origin in self.host_buffer_writes:
            if op.operands[1] not in self.host:
                self.bad(
                    op, "writes a device value into host memory without a move to host", origin
                )
        for op, origin in self.host_update_writes:
            buffer = op.operands[0]
            if buffer not in self.host and not _is_fresh_buffer(buffer):
                self.bad(op, "writes a host value into a device buffer", origin)
        for loop, slot in self.host_loop_slots:
            body_return = loop.regions[1].blocks[0].operations[-1]
            start = loop.operands[slot]
            origin = self.host.get(loop.results[slot], "a loop")
            if body_return.operands[slot] not in self.host:
                self.bad(
                    loop,
                    f"carries a host value in slot {slot} its body refills on the device",
                    origin,
                )
            if start not in self.host and not _is_fresh_buffer(start):
                self.bad(loop, f"starts host slot {slot} from a device value", origin)


def host_offload_violations(lowered) -> list[Violation]:
    """Every operation of a lowered computation (`jax.stages.Lowered`, lowered for CUDA) that
    breaks XLA's host-offload rules; empty when the step would pass the GPU compiler's
    host-offload pass."""
    return violations_in(lowered.compiler_ir("stablehlo"))


def violations_in(module) -> list[Violation]:
    """`host_offload_violations` of a StableHLO module (an MLIR `ir.Module`)."""
    return _Walk(module).run()


def moves_to_device_of_host_values(module) -> list[Any]:
    """The moves to the device (`annotate_device_placement` custom calls) that take a host value
    off the host, in program order: the places a step's host paths end. Tests remove each one in
    turn and check that the rules then fail (the negative control of `violations_in`)."""
    walk = _Walk(module)
    walk.run()
    return [
        op
        for function in walk.functions.values()
        for op in _walk_ops(function)
        if _placement(op) == "device" and op.operands[0] in walk.host
    ]


def lower_for_gpu(jitted, *arguments):
    """`jitted` traced on `arguments` (arrays or `jax.ShapeDtypeStruct`s, host placements in
    their shardings) and lowered for CUDA on this machine: no GPU or CUDA plugin needed."""
    return jitted.trace(*arguments).lower(lowering_platforms=("cuda",))


def check_host_offload(jitted, *arguments) -> list[Violation]:
    """`host_offload_violations` of `jitted` on `arguments`, lowered for CUDA here."""
    return host_offload_violations(lower_for_gpu(jitted, *arguments))


def summary(violations: Iterable[Violation]) -> collections.Counter:
    """Counter of "op: reason" -> how often, for messages and assertions."""
    return collections.Counter(f"{v.op}: {v.reason}" for v in violations)
