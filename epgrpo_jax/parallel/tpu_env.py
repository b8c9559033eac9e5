"""Keeps an installed libtpu quiet on a machine without TPU chips (standard library only: the
package imports this before JAX loads).

With libtpu installed (the `tpu` extra, for `tools/compile_check.py`), JAX tries the TPU
backend at start-up on every machine; where there is no TPU, libtpu cannot work out the
accelerator type and worker hostnames and prints warnings and an error before JAX falls back
to the CPU. Where no TPU chip is attached, `quiet_absent_tpu` names a placeholder for both
(they describe no real device: the backend still finds none and JAX goes on to the CPU, as
without libtpu; compiling for a named topology does not read them). Where a chip is attached
or either variable is set, nothing changes.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path

_GOOGLE_PCI_VENDOR = "0x1ae0"  # TPU chips are Google PCI devices
PLACEHOLDER = {"TPU_ACCELERATOR_TYPE": "v5litepod-1", "TPU_WORKER_HOSTNAMES": "localhost"}


def tpu_attached() -> bool:
  """Whether a TPU chip is visible: a Google PCI device or an accelerator device node."""
  if glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"):
    return True
  for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
    try:
      if Path(vendor).read_text().strip() == _GOOGLE_PCI_VENDOR:
        return True
    except OSError:
      continue
  return False


def quiet_absent_tpu(environ=os.environ) -> bool:
  """Sets libtpu's two variables to placeholders where no TPU is attached and neither is set;
  returns whether it did."""
  if any(k in environ for k in PLACEHOLDER) or tpu_attached():
    return False
  environ.update(PLACEHOLDER)
  return True
