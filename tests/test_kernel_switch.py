"""`$EPGRPO_CPU_KERNELS=0` turns every C++ CPU kernel off: the attention choice, the model's
attention and SwiGLU, the sampler's and the update's products all take XLA's path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from epgrpo_jax.io.errors import UserError
from epgrpo_jax.kernels import cpu as cpu_kernels

REPO = Path(__file__).resolve().parents[1]

# What each caller decides, in a fresh process (available() is read once per process).
PROBE = """
import jax.numpy as jnp
from epgrpo_jax.kernels import cpu, seam
from epgrpo_jax.models import preset
from epgrpo_jax.rollout.sampling import Sampler, SamplingConfig
kernels = seam.choose(preset("test-tiny"))
print(cpu.available(), seam.resolve("auto", jnp.float32, "cpu") == "cpu",
      kernels.causal_attention is not None, Sampler(SamplingConfig()).uses_cpu_kernels(),
      cpu.packing_for(jnp.float32) is not None, cpu.bf16_unit() is not None)
"""


@pytest.mark.parametrize("value,want", [(None, True), ("", True), ("1", True), ("On", True),
                                        ("yes", True), ("0", False), ("false", False),
                                        ("OFF", False), (" no ", False)])
def test_switch_values(value, want):
  assert cpu_kernels.switched_on(value) is want


def test_a_bad_switch_value_is_a_user_error():
  with pytest.raises(UserError, match=r"\$EPGRPO_CPU_KERNELS: '2' is neither on"):
    cpu_kernels.switched_on("2")


def test_switched_off_nothing_is_built(tmp_path, monkeypatch):
  monkeypatch.setenv("EPGRPO_CPU_KERNELS", "0")
  monkeypatch.setenv("EPGRPO_KERNEL_DIR", str(tmp_path / "kernels"))
  monkeypatch.setenv("CXX", "false")  # were a build attempted, it would fail with a warning
  assert cpu_kernels.available.__wrapped__() is False
  assert not (tmp_path / "kernels").exists()


def _probe(switch: str | None) -> list[str]:
  # One CPU device, as the embedded run has (conftest's XLA_FLAGS make 8; the kernels need one).
  env = {k: v for k, v in os.environ.items() if k not in ("EPGRPO_CPU_KERNELS", "XLA_FLAGS")}
  env |= {"JAX_PLATFORMS": "cpu"} | ({"EPGRPO_CPU_KERNELS": switch} if switch is not None else {})
  done = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env=env, capture_output=True,
                        text=True, timeout=300)
  assert done.returncode == 0, done.stderr
  return done.stdout.split()


def test_every_kernel_choice_follows_the_switch():
  assert _probe("0") == ["False"] * 6
  on = _probe(None)
  if on[0] == "False":
    pytest.skip("the CPU kernels do not build here")
  assert on[:4] == ["True"] * 4  # panels and bf16 products depend on the CPU's instructions


def test_one_device_means_one_thing_for_every_program():
  """A program without a mesh runs on one device however many the process has (conftest gives
  this one 8), for the trainer's and SFT's programs (`seam.choose`) as for the sampler's
  (`seam.sampler_native`); a mesh of several devices is never one."""
  import jax

  from epgrpo_jax.kernels import seam
  from epgrpo_jax.models import preset
  from epgrpo_jax.parallel.sharding import MeshConfig, make_mesh

  assert jax.device_count() > 1
  single, several = make_mesh(devices=jax.devices()[:1]), make_mesh(MeshConfig(data=2), jax.devices()[:2])
  assert seam.one_device(None) and seam.one_device(single) and not seam.one_device(several)
  cfg = preset("test-tiny")
  for mesh in (None, single, several):
    kernels, native = seam.choose(cfg, mesh), seam.sampler_native(mesh, True)
    assert native == (seam.one_device(mesh) and cpu_kernels.available())
    assert (kernels.causal_attention is not None) == native  # float32: the C++ causal kernel
