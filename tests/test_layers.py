"""The package's layers (docs/architecture.md) hold: imports only go down or sideways, there is
no import cycle, and no module reaches into another module's private names."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "epgrpo_jax"

# Each package (a directory, or a command module at the top) sits in one layer.
LAYERS = {
    0: ["core", "io", "parallel"],
    1: ["models", "data", "rewards", "estimators"],
    2: ["kernels", "rollout", "supervised"],  # kernels: the backends behind models.Kernels
    3: ["tasks", "evaluation"],
    4: ["training"],
    5: ["train", "evaluate", "sft", "tools", "experiments"],
}
LAYER_OF = {name: layer for layer, names in LAYERS.items() for name in names}


def unit(module: str) -> str | None:
  """The layered unit of `epgrpo_jax.<module>`: its top-level package or command module."""
  top = module.split(".")[0]
  return top if top in LAYER_OF else None


def modules() -> dict[str, Path]:
  out = {}
  for path in sorted(PACKAGE.rglob("*.py")):
    rel = path.relative_to(PACKAGE).with_suffix("")
    name = ".".join(p for p in rel.parts if p != "__init__")
    if name:
      out[name] = path
  return out


def imports(path: Path) -> list[tuple[int, str, list[str]]]:
  """(line, imported epgrpo_jax module, names) of every import, at top level or in a function."""
  found = []
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      found += [(node.lineno, a.name[len("epgrpo_jax."):], []) for a in node.names
                if a.name.startswith("epgrpo_jax.")]
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      if node.module == "epgrpo_jax":  # from epgrpo_jax import cli, configlib
        for a in node.names:
          if importlib.util.find_spec(f"epgrpo_jax.{a.name}") is not None:
            found.append((node.lineno, a.name, []))
      elif node.module.startswith("epgrpo_jax."):
        found.append((node.lineno, node.module[len("epgrpo_jax."):], [a.name for a in node.names]))
  return found


def test_every_module_has_a_layer():
  missing = [m for m in modules() if unit(m) is None]
  assert not missing, f"place these in LAYERS (and docs/architecture.md): {missing}"


def test_no_import_runs_up_a_layer():
  bad = []
  for name, path in modules().items():
    src = unit(name)
    if src is None:
      continue
    for line, target, _ in imports(path):
      dst = unit(target)
      if dst is not None and dst != src and LAYER_OF[dst] > LAYER_OF[src]:
        bad.append(f"{path.name}:{line} {src} (layer {LAYER_OF[src]}) imports {dst} "
                   f"(layer {LAYER_OF[dst]})")
  assert not bad, "\n".join(bad)


def test_no_private_names_across_modules():
  bad = []
  for name, path in modules().items():
    for line, target, names in imports(path):
      own_package = target.rsplit(".", 1)[0] == name.rsplit(".", 1)[0] or target.startswith(
          name.split(".")[0] + "._")
      private = [n for n in names if n.startswith("_")]
      private_module = any(p.startswith("_") for p in target.split("."))
      if (private or private_module) and not own_package:
        bad.append(f"{path.name}:{line} from epgrpo_jax.{target} import {names}")
    for node in ast.walk(ast.parse(path.read_text())):
      if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
          and not node.attr.startswith("__") and isinstance(node.value, ast.Name)
          and unit(node.value.id) is not None and node.value.id != name):
        bad.append(f"{path.name}:{node.lineno} {node.value.id}.{node.attr}")
  assert not bad, "\n".join(bad)


def test_models_import_no_backend_kernels():
  """The model calls the backends only through the `Kernels` its program passes in
  (`kernels.seam`): no module under models/ imports epgrpo_jax.kernels or the platform module,
  nor asks jax for the backend it runs on."""
  bad = []
  for name, path in modules().items():
    if unit(name) != "models":
      continue
    bad += [f"{path.name}:{line} imports {target}" for line, target, _ in imports(path)
            if unit(target) == "kernels" or target.startswith("parallel.platform")]
    bad += [f"{path.name}: calls {call}" for call in ("default_backend", "device_count")
            if call in path.read_text()]
  assert not bad, "\n".join(bad)


def _assert_acyclic(graph: dict[str, set[str]]) -> None:
  state: dict[str, int] = {}

  def visit(node: str, trail: list[str]) -> None:
    state[node] = 1
    for nxt in sorted(graph.get(node, ())):
      assert state.get(nxt) != 1, f"import cycle: {' -> '.join(trail + [node, nxt])}"
      if nxt not in state:
        visit(nxt, trail + [node])
    state[node] = 2

  for node in sorted(graph):
    if node not in state:
      visit(node, [])


def _module_of(target: str, known: dict[str, Path]) -> str | None:
  """The module `target` names, or the package whose attribute it is."""
  while target and target not in known:
    target = target.rpartition(".")[0]
  return target or None


def test_the_import_graph_has_no_cycle():
  """Neither between packages nor between modules (a package's `__init__` aside, which
  re-exports its modules)."""
  known = modules()
  packages = {unit(n): set() for n in known if unit(n)}
  module_graph: dict[str, set[str]] = {n: set() for n in known}
  for name, path in known.items():
    for _, target, _ in imports(path):
      if unit(target) not in (None, unit(name)):
        packages[unit(name)].add(unit(target))
      dst = _module_of(target, known)
      if dst and dst != name and path.name != "__init__.py" and known[dst].name != "__init__.py":
        module_graph[name].add(dst)
  _assert_acyclic(packages)
  _assert_acyclic(module_graph)


# A model family's package (models/<family>/, docs/architecture.md) holds the model's math and
# tables only: no backend kernels, and nothing of the engines or the training above it.
FAMILY_MAY_NOT_IMPORT = ("kernels", "rollout", "supervised", "training")


def family_packages() -> list[str]:
  return sorted(p.name for p in (PACKAGE / "models").iterdir()
                if p.is_dir() and (p / "__init__.py").exists() and not p.name.startswith("_"))


def test_model_families_import_no_kernels_or_engines():
  assert "qwen2" in family_packages()
  bad = []
  for name, path in modules().items():
    parts = name.split(".")
    if len(parts) < 2 or parts[0] != "models" or parts[1] not in family_packages():
      continue
    for line, target, _ in imports(path):
      if target.split(".")[0] in FAMILY_MAY_NOT_IMPORT:
        bad.append(f"{path.relative_to(PACKAGE)}:{line} imports {target}")
  assert not bad, "\n".join(bad)


def test_only_the_models_layer_names_a_family_class():
  """Above `models/`, code holds a model as `models.CausalLM` and builds it through the registry:
  no module imports a family's class (e.g. `Qwen2`)."""
  import importlib

  from epgrpo_jax.models import registry
  classes = {fam.module for fam in registry._FAMILIES.values()}
  bad = []
  for name, path in modules().items():
    if unit(name) == "models":
      continue
    for line, target, names in imports(path):
      if unit(target) != "models":
        continue
      source = importlib.import_module(f"epgrpo_jax.{target}")
      bad += [f"{path.relative_to(PACKAGE)}:{line} imports {n}" for n in names
              if getattr(source, n, None) in classes]
  assert not bad, "\n".join(bad)
