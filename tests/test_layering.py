"""The packages' dependencies stay one-way: no import cycle among hetshard's modules, not
even through an import inside a function, and no private name imported across
packages (issue 27)."""

import ast
import pathlib

import hetshard

ROOT = pathlib.Path(hetshard.__file__).parent


def _modules(root: pathlib.Path = ROOT) -> dict[str, pathlib.Path]:
    out = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(name: str, path: pathlib.Path, known: dict):
    """(imported hetshard module, imported names) per import statement of the module,
    those inside functions included, those under ``if TYPE_CHECKING`` left out (they
    never run)."""
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in known:
                    yield a.name, []
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            names = [a.name for a in node.names]
            if module in known:
                yield module, names
            for n in names:  # ``from hetshard.solver import inter_op``
                if f"{module}.{n}" in known:
                    yield f"{module}.{n}", []


def _graph(root: pathlib.Path = ROOT):
    known = _modules(root)
    top = root.name
    edges = {name: set() for name in known}
    for name, path in known.items():
        for module, _ in _imports(name, path, known):
            if module not in (name, top):
                edges[name].add(module)
    return edges


def _cycles(edges) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles_even_through_imports_inside_functions():
    assert _cycles(_graph()) == []
    assert _cycles(_graph(ROOT.parent / "models")) == []  # the zoo too


def test_the_packages_are_layered_no_arrow_runs_back_up():
    """Between hetshard's top-level packages and modules (ir, cost, sim, solver,
    rewrite, runtime, data, ...) the imports form no cycle either: a module of ``ir``
    importing ``rewrite`` while ``rewrite`` imports ``ir`` (as ``ir/program.py`` once
    imported ``rewrite/unroll.py``) is an arrow back up even where the modules
    themselves form no cycle."""
    def top(module: str) -> str:
        return ".".join(module.split(".")[:2])
    packages: dict[str, set] = {}
    for a, targets in _graph().items():
        packages.setdefault(top(a), set())
        for b in targets:
            if top(a) != top(b):
                packages[top(a)].add(top(b))
                packages.setdefault(top(b), set())
    assert _cycles(packages) == []
    assert "hetshard.rewrite" not in packages["hetshard.ir"]


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_private_name_is_imported_across_packages():
    known = _modules()
    offenders = []
    for name, path in known.items():
        for module, names in _imports(name, path, known):
            home = module.split(".")[:2]
            for n in names:
                if n.startswith("_") and not n.startswith("__") and name.split(".")[:2] != home:
                    offenders.append(f"{name} imports {module}.{n}")
    assert offenders == []


def test_every_exported_name_resolves_and_what_a_planner_user_needs_is_exported():
    """Each name in ``hetshard.__all__`` loads; the planner's options, its refusal and
    its time-limit warning are among them (a user configures, catches and filters
    them), the refusal a ``HetshardError``."""
    from hetshard.solver import options
    for name in hetshard.__all__:
        assert getattr(hetshard, name) is not None, name
    assert hetshard.PlannerOptions is options.PlannerOptions
    assert issubclass(hetshard.NoFeasiblePlanError, hetshard.HetshardError)
    assert issubclass(hetshard.PlannerTimeLimitWarning, UserWarning)


def test_the_architecture_page_names_every_module():
    """docs/architecture.md lists each module of the package (a new module gets its
    line there)."""
    page = (ROOT.parent / "docs" / "architecture.md").read_text()
    missing = [str(p.relative_to(ROOT)) for p in sorted(ROOT.rglob("*.py"))
               if p.name != "__init__.py" and p.name not in page]
    assert missing == []


def test_the_docs_give_the_plan_schema_the_code_writes():
    import re

    from hetshard._plan import SCHEMA_VERSION
    docs = ROOT.parent / "docs"
    assert re.findall(r"schema (\d+):", (docs / "architecture.md").read_text()) == \
        [str(SCHEMA_VERSION)]
    page = (docs / "plan-format.md").read_text()
    assert page.startswith(f"# Plan format (schema version {SCHEMA_VERSION})")
    assert f'{{"version": {SCHEMA_VERSION}, ' in page


def test_no_module_reads_a_name_from_the_package_itself():
    """No arrow back up: a module imports the package's submodules, never a name the
    package's ``__init__`` defines (``from hetshard import __version__`` would run the
    package's face from inside it)."""
    known = _modules()
    up = []
    for name, path in known.items():
        if path.name == "__init__.py" and name == "hetshard":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "hetshard" and \
                    not node.level:
                up += [f"{name}: {a.name}" for a in node.names
                       if f"hetshard.{a.name}" not in known]
    assert up == []


def test_every_error_and_warning_is_defined_in_errors_and_exported():
    """All errors and warnings live in hetshard/errors.py (control-flow exceptions that
    never leave their module aside), and each one a user can meet is exported from
    ``hetshard``; the modules that raise them import them from there."""
    import hetshard.errors as errors
    elsewhere = []
    for path in ROOT.rglob("*.py"):
        if path.name == "errors.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_") and any(
                    ast.unparse(b).endswith(("Error", "Warning", "Exception"))
                    for b in node.bases):
                elsewhere.append(f"{path.relative_to(ROOT)}: {node.name}")
    # (autodiff.Recorded stops a trace at the loss call, caught inside hetshard)
    assert elsewhere == ["autodiff.py: Recorded"]
    defined = [name for name, obj in vars(errors).items() if isinstance(obj, type)
               and issubclass(obj, (errors.HetshardError, Warning))]
    internal = {"CouplingError"}  # (caught inside the runtime: a PipelineSetupError out)
    assert sorted(set(defined) - internal - set(hetshard.__all__)) == []
    assert all(getattr(hetshard, n) is getattr(errors, n) for n in defined if n not in internal)


def test_no_submodule_shares_a_name_with_an_export():
    """The core's modules are private (``hetshard._jit``, ``hetshard._plan``): importing
    every module leaves ``hetshard.jit`` and ``hetshard.plan`` the functions, with no
    module-class swap on the package (a submodule named like an export would be bound
    over it by the import system)."""
    import importlib
    import types
    top = {name.split(".")[1] for name in _modules() if name.count(".") >= 1}
    submodule_exports = {"nn", "data", "checkpoint"}  # (exported as the modules)
    assert sorted((top & set(hetshard.__all__)) - submodule_exports) == []
    for name in ("hetshard._jit", "hetshard._plan", "hetshard.cli"):
        importlib.import_module(name)
    assert type(hetshard) is types.ModuleType
    assert isinstance(hetshard.jit, types.FunctionType)
    assert isinstance(hetshard.plan, types.FunctionType)
    assert hetshard.Plan.__name__ == "Plan"


def test_the_zoo_uses_the_public_api_only():
    """``models/`` is a client: it imports names ``hetshard`` exports and the exported
    submodules (nn, data, checkpoint), never an internal module."""
    public_modules = {"hetshard", "hetshard.nn", "hetshard.data", "hetshard.checkpoint"}
    internal = []
    for path in sorted((ROOT.parent / "models").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hetshard"):
                if node.module not in public_modules:
                    internal.append(f"{path.name}: {node.module}")
                elif node.module == "hetshard":
                    internal += [f"{path.name}: hetshard.{a.name}" for a in node.names
                                 if a.name not in hetshard.__all__]
            elif isinstance(node, ast.Import):
                internal += [f"{path.name}: {a.name}" for a in node.names
                             if a.name.startswith("hetshard") and a.name not in public_modules]
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                    node.value.id == "hetshard" and node.attr not in hetshard.__all__:
                internal.append(f"{path.name}: hetshard.{node.attr}")
    assert internal == []


def test_the_per_batch_doors_live_in_the_runtime_not_on_the_decorator():
    """``hetshard.data``'s runners reach a step's pieces through its ``micro_steps`` (a
    ``runtime.micro_steps.MicroSteps``), not through methods of ``HetshardJit``; a
    runner given anything else refuses it by name."""
    from hetshard._jit import HetshardJit
    from hetshard.data.runner import micro_steps
    from hetshard.errors import SpecError
    from hetshard.runtime.micro_steps import MicroSteps
    for door in ("grads_under", "apply_grads", "run_passes", "program_for"):
        assert not hasattr(HetshardJit, door) and hasattr(MicroSteps, door)
    step = hetshard.jit(lambda m, b: b, cluster="a100-v100", quiet=True)
    assert isinstance(step.micro_steps, MicroSteps) and micro_steps(step) is step.micro_steps
    try:
        micro_steps(lambda m, b: b)
    except SpecError as e:
        assert "step" in str(e) and "hetshard.jit" in str(e)
    else:
        raise AssertionError("a plain function was taken for a hetshard.jit step")


def _top_level_names(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out = {n.name for n in tree.body
           if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    return out | {t.id for n in tree.body if isinstance(n, ast.Assign)
                  for t in n.targets if isinstance(t, ast.Name)}


def test_the_per_batch_planners_are_one_family():
    """Groups and pipelines share one planner family (``hetshard.data.drafts``): neither
    module defines a name the other does (no second ``_Draft``, ``_draft``, ``_compose``
    or ``_static``), and neither imports the other's private names."""
    modules = _modules()
    planner, pipelines = (modules[f"hetshard.data.{m}"] for m in ("planner", "pipelines"))
    assert _top_level_names(planner) & _top_level_names(pipelines) == set()
    for name, path in (("hetshard.data.pipelines", pipelines),
                       ("hetshard.data.planner", planner)):
        for module, names in _imports(name, path, modules):
            if module in ("hetshard.data.planner", "hetshard.data.pipelines"):
                assert not [n for n in names if n.startswith("_")], (name, module, names)


def test_the_zoo_installs_as_hetshard_models_and_every_package_is_listed():
    """``models/`` installs as ``hetshard_models`` (a top-level ``models`` would take a
    name users' own packages have): pyproject maps it, lists every hetshard package (a
    directory of modules left out would be missing from the wheel), and the zoo's own
    imports are relative, so it works under the installed name. The installed version is
    the package's own (pyproject holds none)."""
    import importlib.metadata
    import tomllib
    project = tomllib.loads((ROOT.parent / "pyproject.toml").read_text())
    config = project["tool"]["setuptools"]
    assert config["package-dir"] == {"hetshard_models": "models"}
    # one version string: hetshard/_version.py's, read by setuptools
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert importlib.metadata.version("hetshard") == hetshard.__version__
    tree = {".".join(p.relative_to(ROOT.parent).parts) for p in ROOT.rglob("*")
            if p.is_dir() and any(p.glob("*.py"))}
    assert set(config["packages"]) == tree | {"hetshard", "hetshard_models"}
    absolute = []
    for path in (ROOT.parent / "models").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and not node.level and \
                    (node.module or "").split(".")[0] == "models":
                absolute.append(f"{path.name}: {node.module}")
            elif isinstance(node, ast.Import) and any(
                    a.name.split(".")[0] == "models" for a in node.names):
                absolute.append(path.name)
    assert absolute == []
