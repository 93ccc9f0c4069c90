"""Checkpoints with orbax: trainable parameters, optimizer state, step, data position and RNG.

Orbax writes each checkpoint into a temporary directory and renames it into place when complete,
so a kill at any moment leaves the previous checkpoints loadable and no partial checkpoint under a
final name. The last `keep` are kept; an older one is first renamed into `.deleting/` and only then
removed, so a kill during the removal leaves no half-deleted checkpoint under its name either.
Saves are synchronous: the next (donating) step cannot start while a save still reads the buffers.
A save that fails for lack of space or permission removes its partial temporary and raises a typed
error naming the checkpoint that is intact.

The array state is stored as a flat list of leaves; the structure comes back from the abstract
state the run builds anyway (any optax state, NF4 or not, restores without registration). Each
leaf is restored into the memory its target names and never passes through another: a device
leaf is read onto the device; a host-resident leaf (optimizer state, embedding on the host) is
read into a NumPy array and placed in pinned host memory from there. (Orbax restoring straight
into a `pinned_host` sharding gives XLA:CPU arrays that abort the next step.)
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from featherweight.errors import CorruptCheckpointError
from featherweight.io.atomic import write_failure

DELETING_DIR = ".deleting"  # old checkpoints are renamed here, then removed
# orbax warns on every read-only open (export, generate RUN_DIR) about its own option changes
logging.getLogger("absl").addFilter(
    lambda note: "read only" not in note.getMessage().replace("_", " ")
)


class Checkpointer:
    """Save and restore a run's `(arrays pytree, metadata dict)` under `directory`."""

    def __init__(self, directory: str | Path, keep: int, read_only: bool = False) -> None:
        self.directory = Path(directory).expanduser().resolve()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            enable_async_checkpointing=False,
            create=not read_only,
            read_only=read_only,
            cleanup_tmp_directories=not read_only,
            todelete_subdir=None if read_only else DELETING_DIR,
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options)
        if not read_only:
            self._remove_deleted()

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def save(self, step: int, arrays: Any, metadata: dict[str, Any]) -> None:
        """Write checkpoint `step` (atomically) and drop the oldest beyond `keep`."""
        leaves = {f"{index:05d}": leaf for index, leaf in enumerate(jax.tree.leaves(arrays))}
        try:
            self.manager.save(
                step,
                args=ocp.args.Composite(
                    arrays=ocp.args.StandardSave(leaves), metadata=ocp.args.JsonSave(metadata)
                ),
                force=True,
            )
            self.manager.wait_until_finished()
        except Exception as error:
            for partial in self.directory.glob(f"{step}.orbax-checkpoint-tmp*"):
                shutil.rmtree(partial, ignore_errors=True)  # frees the space a full disk needs
            typed = write_failure(error, f"checkpoint {step} in {self.directory}", self._kept())
            if typed is None:
                raise
            raise typed from None
        self._remove_deleted()

    def _kept(self) -> str:
        self.manager.reload()
        latest = self.manager.latest_step()
        if latest is None:
            return "the partial checkpoint was removed; no earlier checkpoint exists yet"
        return (
            f"the partial checkpoint was removed; the previous checkpoint (step {latest}) is "
            "intact and the run resumes from it"
        )

    def _remove_deleted(self) -> None:
        shutil.rmtree(self.directory / DELETING_DIR, ignore_errors=True)

    def restore(self, step: int, abstract_arrays: Any) -> tuple[Any, dict[str, Any]]:
        """Checkpoint `step` with the structure (and shardings) of `abstract_arrays`."""
        abstract_leaves, treedef = jax.tree.flatten(abstract_arrays)
        target = {
            f"{index:05d}": _restore_target(leaf) for index, leaf in enumerate(abstract_leaves)
        }
        try:
            restored = self.manager.restore(
                step,
                args=ocp.args.Composite(
                    arrays=ocp.args.StandardRestore(target), metadata=ocp.args.JsonRestore()
                ),
            )
        except Exception as error:  # orbax raises many types for damaged or mismatched files
            raise CorruptCheckpointError(
                f"checkpoint {self.directory / str(step)} cannot be restored "
                f"({type(error).__name__}: {str(error)[:300]}); delete it to resume from an "
                "earlier one, or start a new run"
            ) from None
        leaves = [restored["arrays"][key] for key in sorted(restored["arrays"])]
        if len(leaves) != len(abstract_leaves):
            raise CorruptCheckpointError(
                f"checkpoint {self.directory / str(step)} holds {len(leaves)} arrays, this run "
                f"expects {len(abstract_leaves)}; it belongs to another configuration"
            )
        leaves = [_place_on_host(value, leaf) for value, leaf in zip(leaves, abstract_leaves)]
        return jax.tree.unflatten(treedef, leaves), dict(restored["metadata"])

    def close(self) -> None:
        self.manager.close()


def _on_host(leaf: Any) -> bool:
    return getattr(getattr(leaf, "sharding", None), "memory_kind", None) not in (None, "device")


def _restore_target(leaf: Any) -> Any:
    """A restore target for one leaf: a host-resident leaf as a NumPy array (an untouched
    `np.empty`: no pages are written until the restore fills them), any other as its shape, dtype
    and sharding (single-device default without one)."""
    if _on_host(leaf):
        return np.empty(np.shape(leaf), leaf.dtype)
    sharding = getattr(leaf, "sharding", None) or jax.sharding.SingleDeviceSharding(
        jax.devices()[0]
    )
    return jax.ShapeDtypeStruct(np.shape(leaf), leaf.dtype, sharding=sharding)


def _place_on_host(restored: Any, leaf: Any) -> Any:
    """A host-resident leaf's restored NumPy array put in the host memory `leaf` names."""
    return jax.device_put(restored, leaf.sharding) if _on_host(leaf) else restored
