"""Test-session set-up: 8 fake CPU devices (for the mesh tests), hypothesis profiles, and the
Qwen2.5 tokenizer of tests/assets unpacked once per session."""

import lzma
import os
import shutil
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

QWEN_TOKENIZER_ASSET = Path(__file__).resolve().parent / "assets" / "qwen2.5-tokenizer"


def unpack_qwen_tokenizer(dest: Path) -> Path:
  """Writes the Qwen2.5 tokenizer files of tests/assets into `dest` (tokenizer.json unpacked
  from its .xz); returns `dest`."""
  dest.mkdir(parents=True, exist_ok=True)
  with lzma.open(QWEN_TOKENIZER_ASSET / "tokenizer.json.xz") as src, \
      open(dest / "tokenizer.json", "wb") as out:
    shutil.copyfileobj(src, out)
  shutil.copyfile(QWEN_TOKENIZER_ASSET / "tokenizer_config.json", dest / "tokenizer_config.json")
  return dest


@pytest.fixture(scope="session")
def qwen_tokenizer_dir(tmp_path_factory) -> Path:
  """A folder with the real Qwen2.5(-Instruct) tokenizer.json and tokenizer_config.json."""
  return unpack_qwen_tokenizer(tmp_path_factory.mktemp("qwen2.5-tokenizer"))
