"""Multi-host start-up: every process of a run joins one JAX runtime through `jax.distributed`.

One process runs per host (it drives all of that host's accelerators). They find each other from
the environment, before JAX touches a device:

- explicitly: `JAX_COORDINATOR_ADDRESS` (host:port of process 0), `JAX_NUM_PROCESSES` and
  `JAX_PROCESS_ID` (0 .. n-1) -- set all three, on every host;
- or from a launcher JAX recognizes: SLURM (`srun`, with more than one task) or Open MPI
  (`mpirun`), whose own variables give the same three values.

Without any of these the run is single-process, and nothing is initialized. On CPU the processes
exchange data with gloo collectives (how the multi-process tests run on one machine).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import jax
import numpy as np
from jax.experimental import multihost_utils

from featherweight.errors import ConfigError

COORDINATOR, NUM_PROCESSES, PROCESS_ID = (
    "JAX_COORDINATOR_ADDRESS",
    "JAX_NUM_PROCESSES",
    "JAX_PROCESS_ID",
)
# launchers whose variables jax.distributed.initialize() reads by itself: {task count variable}
LAUNCHER_TASK_COUNTS = ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE")


def _integer(environ: Mapping[str, str], name: str) -> int:
    value = environ[name]
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} must be an integer") from None


def distributed_arguments(environ: Mapping[str, str]) -> dict | None:
    """`jax.distributed.initialize` keyword arguments from `environ`: the explicit three, `{}` for
    a multi-task launcher (JAX detects it), or None for a single-process run."""
    explicit = [name for name in (COORDINATOR, NUM_PROCESSES, PROCESS_ID) if environ.get(name)]
    if explicit:
        missing = [n for n in (COORDINATOR, NUM_PROCESSES, PROCESS_ID) if n not in explicit]
        if missing:
            raise ConfigError(
                f"multi-host settings are incomplete: {', '.join(explicit)} set but "
                f"{', '.join(missing)} missing; set all of {COORDINATOR} (host:port of process 0), "
                f"{NUM_PROCESSES} and {PROCESS_ID} on every host, or none of them"
            )
        count, index = _integer(environ, NUM_PROCESSES), _integer(environ, PROCESS_ID)
        if count < 1 or not 0 <= index < count:
            raise ConfigError(
                f"{PROCESS_ID}={index} must be in [0, {NUM_PROCESSES}={count}); number the "
                f"processes 0 .. {max(count - 1, 0)}"
            )
        return {
            "coordinator_address": environ[COORDINATOR],
            "num_processes": count,
            "process_id": index,
        }
    if any(int(environ.get(name, "1") or "1") > 1 for name in LAUNCHER_TASK_COUNTS):
        return {}
    return None


def initialize_from_env(environ: Mapping[str, str] | None = None) -> bool:
    """Join the multi-host run the environment describes; False (and nothing done) when it
    describes none. Must run before anything touches a device; safe to call twice."""
    if jax.distributed.is_initialized():
        return True
    arguments = distributed_arguments(os.environ if environ is None else environ)
    if arguments is None:
        return False
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(**arguments)
    return True


def is_primary() -> bool:
    """Whether this process writes the run's files (metrics, plots, run files): process 0."""
    return jax.process_index() == 0


def sync_processes(name: str) -> None:
    """Wait until every process reaches this point (no-op for a single process)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def any_process(flag: bool) -> bool:
    """Whether `flag` is set on any process: every process takes the same branch (a stop signal
    caught by one host must stop all of them at the same step, or the others wait forever)."""
    if jax.process_count() == 1:
        return flag
    return bool(np.max(multihost_utils.process_allgather(np.int32(flag))))
