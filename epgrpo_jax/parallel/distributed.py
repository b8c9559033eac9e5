"""Multi-process runs: `jax.distributed` start-up and host <-> global-array helpers.

Every process runs the same SPMD programs (sampler, scoring passes, advantage,
update) on global arrays laid out over one mesh of all devices. The host side
of a step is kept simple and identical everywhere:

- each process reads its slice of every global batch of prompt indices from
  the Grain pipeline; the slices are all-gathered (a few integers), so every
  process knows the whole batch, in the order a single process would read it;
- host values that feed a program (prompts, completions, rewards) are the same
  on every process and become global arrays with `put`;
- program outputs the host needs (completions, per-token arrays for metrics)
  come back whole with `to_host` (an all-gather across processes);
- decoding and reward checks run on all rows in every process (duplicated, not
  split: no strings cross processes), and the rewards that feed the advantage
  are process 0's (`broadcast_from_main`), so a check that times out on one
  host only cannot make the processes disagree;
- only process 0 prints and writes logs and metrics; checkpoints and the
  exported policy are collective (every process calls, Orbax / process 0 write).

With one process every helper is the identity or a plain device transfer.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Mapping

import jax
import numpy as np
from jax._src import xla_bridge
from jax.experimental import multihost_utils

from epgrpo_jax.io.errors import UserError

log = logging.getLogger("epgrpo_jax.parallel.distributed")

ENV_COORDINATOR = "EPGRPO_COORDINATOR"  # host:port of process 0
ENV_NUM_PROCESSES = "EPGRPO_NUM_PROCESSES"
ENV_PROCESS_ID = "EPGRPO_PROCESS_ID"


def _env_int(environ: Mapping[str, str], name: str, default: int) -> int:
  value = environ.get(name, "").strip()
  if not value:
    return default
  try:
    return int(value)
  except ValueError:
    raise UserError(f"{name}: must be an integer, got {value!r}") from None


def initialize(cfg=None, environ: Mapping[str, str] | None = None) -> bool:
  """Starts `jax.distributed` if the config or environment asks for it; True if it did.

  Settings, config first (`distributed.*`), then `EPGRPO_COORDINATOR`,
  `EPGRPO_NUM_PROCESSES`, `EPGRPO_PROCESS_ID`. A coordinator address or more
  than one process turns it on; `distributed.initialize=true` with nothing else
  lets JAX detect the cluster (SLURM, Open MPI, Kubernetes, Cloud TPU). Must run
  before any JAX computation; CPU processes use gloo collectives.
  """
  environ = os.environ if environ is None else environ
  coordinator = (getattr(cfg, "coordinator_address", "") or environ.get(ENV_COORDINATOR, "")).strip()
  num_processes = getattr(cfg, "num_processes", 0) or _env_int(environ, ENV_NUM_PROCESSES, 0)
  process_id = getattr(cfg, "process_id", -1)
  if process_id < 0:
    process_id = _env_int(environ, ENV_PROCESS_ID, -1)
  if not (getattr(cfg, "initialize", False) or coordinator or num_processes > 1):
    return False
  if jax.distributed.is_initialized():
    return True
  if xla_bridge.backends_are_initialized():
    raise RuntimeError("distributed: jax.distributed.initialize must run before any JAX "
                       "computation; call epgrpo_jax.parallel.distributed.initialize first")
  if num_processes and not -1 <= process_id < num_processes:
    raise UserError(f"distributed.process_id: must be in [0, {num_processes}), got {process_id}")
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=coordinator or None,
                             num_processes=num_processes or None,
                             process_id=process_id if process_id >= 0 else None)
  log.info("jax.distributed: process %d of %d, %d local / %d global devices",
           jax.process_index(), jax.process_count(), jax.local_device_count(), jax.device_count())
  return True


def is_main() -> bool:
  return jax.process_index() == 0


def put(x: Any, sharding: jax.sharding.Sharding) -> jax.Array:
  """A global array with `sharding` from a host value (the same on every process) or an array.

  Already placed arrays are returned as they are; others are resharded.
  """
  if isinstance(x, jax.Array):
    if x.sharding.is_equivalent_to(sharding, x.ndim):
      return x
    if sharding.is_fully_addressable or not x.is_fully_addressable:
      return jax.device_put(x, sharding)
    # A process-local array holding the same value on every process -> one global array.
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      data = put(np.asarray(jax.random.key_data(x)), sharding)
      return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
  x = np.asarray(x)
  if sharding.is_fully_addressable:
    return jax.device_put(x, sharding)
  return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def place(tree: Any, shardings: Any) -> Any:
  """`put` over a pytree and a matching tree (or prefix) of shardings; None stays None."""
  if tree is None:
    return None
  if isinstance(shardings, jax.sharding.Sharding):
    return jax.tree.map(lambda x: put(x, shardings), tree)
  return jax.tree.map(put, tree, shardings)


def to_host(tree: Any) -> Any:
  """Every jax.Array leaf of `tree` as a numpy array holding its whole (global) value.

  With several processes, sharded leaves are all-gathered: every process must call.
  """
  def one(x):
    if not isinstance(x, jax.Array):
      return x
    if x.is_fully_addressable or x.is_fully_replicated:
      return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return jax.tree.map(one, tree)


def allgather_rows(local: np.ndarray) -> np.ndarray:
  """The processes' row blocks concatenated in process order (the identity for one process)."""
  if jax.process_count() == 1:
    return np.asarray(local)
  return np.asarray(multihost_utils.process_allgather(np.asarray(local), tiled=True))


def broadcast_from_main(x: np.ndarray) -> np.ndarray:
  """Process 0's value of `x` on every process (the identity for one process)."""
  if jax.process_count() == 1:
    return np.asarray(x)
  return np.asarray(multihost_utils.broadcast_one_to_all(np.asarray(x)))


def any_process(flag: bool) -> bool:
  """True on every process if `flag` is true on any (e.g. a stop signal seen by one host)."""
  if jax.process_count() == 1:
    return bool(flag)
  return bool(allgather_rows(np.asarray([flag], np.int32)).any())
