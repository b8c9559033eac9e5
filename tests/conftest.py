"""Test-session set-up: 8 fake CPU devices (for the mesh tests) and hypothesis profiles."""

import os
from pathlib import Path

# Must happen before anything imports jax.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Compiled programs persist across tests and subprocesses (many tests compile the same tiny
# programs); a fresh machine starts with an empty cache.
_CACHE = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"epgrpo-test-xla-{os.getuid()}")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _CACHE)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.3")
os.environ.setdefault("EPGRPO_COMPILATION_CACHE", _CACHE)

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

# Property tests take their example count from the profile only (no test pins its own).
settings.register_profile("ci", deadline=None, max_examples=500,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", deadline=None, max_examples=50,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

SHARED_DATA = Path(os.environ.get("EPGRPO_SHARED_DATA",
                                  Path(__file__).resolve().parents[2] / "shared" / "data"))
QWEN_TOKENIZER_DIR = SHARED_DATA / "qwen2.5" / "Qwen2.5-1.5B-Instruct"


@pytest.fixture(scope="session")
def shared_data() -> Path:
  if not SHARED_DATA.exists():
    pytest.fail(f"shared data not found at {SHARED_DATA}; set EPGRPO_SHARED_DATA")
  return SHARED_DATA
