"""Which package of `kvq` may import which: the layout holds the design.

The layers, from the bottom:

- the records: `kvq.errors`, `kvq.slices`, `kvq.catalog` (a model as the bus carries it) and
  `kvq.quant` (the kernels over encoded bytes);
- the file format, `kvq.gguf`: reads a GGUF file into those records; it runs no model and
  knows no text, no Redis and no role;
- text, `kvq.text` (tokenizers, chat templates, tool calls, grammars), over the file format;
- the forward pass, `kvq.model`, over the file format: it never tokenizes, talks to Redis or
  names a role (a role hands it a `MoeFn`);
- the runtime: the bus, the settings and the roles (`kvq.bus`, `kvq.config`, `kvq.bank`,
  `kvq.coordinator`, `kvq.worker`, `kvq.monitor`, `kvq.api`, ...), free among themselves (their
  own rules: `test_import_graph.py`, `test_board_owns_records.py`);
- the shell, `kvq.cli`: it imports a tool only inside the command that runs it, so `kvq
  --help` and the long-running roles never load one;
- the tools, `kvq.tools` (benches, synthetic-model writers, the demo): they may import
  anything; no runtime package imports them.

Every `import` counts (module level, inside functions, under `TYPE_CHECKING`), as in
`test_import_graph.py`, whose graph this reuses.
"""

from __future__ import annotations

import ast

from test_import_graph import graph, modules

ANY = None  # no limit
RECORDS = {"kvq.errors", "kvq.slices", "kvq.catalog"}
# package -> the kvq packages its modules may import besides its own; a package not listed
# may import any runtime package (anything but `kvq.tools`, and `kvq.cli` only from the shell)
MAY_IMPORT: dict[str, set[str] | None] = {
    "kvq.tools": ANY,
    "kvq.cli": ANY,
    "kvq.__main__": ANY,
    "kvq.model": {*RECORDS, "kvq.quant", "kvq.gguf"},
    "kvq.text": {*RECORDS, "kvq.gguf"},
    "kvq.gguf": {*RECORDS, "kvq.quant"},
    "kvq.quant": {"kvq.errors"},
    "kvq.catalog": {"kvq.errors", "kvq.slices"},
    "kvq.slices": {"kvq.errors"},
    "kvq.errors": set(),
}
# only the tools and the shell import these
ABOVE_THE_RUNTIME = ("kvq.tools", "kvq.cli")


def package(module: str) -> str:
    """The package a module belongs to for the rule: `kvq.X` (the module itself at the top)."""
    return ".".join(module.split(".")[:2])


def under(module: str, pkg: str) -> bool:
    return module == pkg or module.startswith(pkg + ".")


def violations(edges: dict[str, set[str]]) -> set[tuple[str, str]]:
    """(importer, imported) pairs that break the rule."""
    bad = set()
    for m, deps in edges.items():
        rule = MAY_IMPORT.get(package(m), ())
        for dep in deps:
            own = package(dep) == package(m)
            if own or rule is ANY:
                continue
            if rule == ():  # an unlisted runtime package
                if any(under(dep, top) for top in ABOVE_THE_RUNTIME):
                    bad.add((m, dep))
            elif package(dep) not in rule:
                bad.add((m, dep))
    return bad


def test_the_rule_finds_a_violation() -> None:
    edges = {
        "kvq.gguf.meta": {"kvq.errors", "kvq.model.backbone"},
        "kvq.model.backbone": {"kvq.gguf.meta", "kvq.text.tokenizer"},
        "kvq.coordinator.engine": {"kvq.model.backbone", "kvq.tools.synth.tiny"},
        "kvq.worker.loader": {"kvq.cli.core"},
        "kvq.tools.bench.api": {"kvq.coordinator.engine", "kvq.cli.core"},
        "kvq.cli.core": {"kvq.tools.demo"},
    }
    assert violations(edges) == {
        ("kvq.gguf.meta", "kvq.model.backbone"),
        ("kvq.model.backbone", "kvq.text.tokenizer"),
        ("kvq.coordinator.engine", "kvq.tools.synth.tiny"),
        ("kvq.worker.loader", "kvq.cli.core"),
    }


def test_every_listed_package_exists() -> None:
    packages = {package(m) for m in modules()}
    assert set(MAY_IMPORT) <= packages
    for allowed in MAY_IMPORT.values():
        assert allowed is ANY or allowed <= packages


def test_each_package_imports_only_the_layers_below_it() -> None:
    bad = sorted(violations(graph()))
    assert not bad, f"imports that break the layers (see this module's docstring): {bad}"


def test_the_cli_imports_tools_inside_the_command() -> None:
    """A module-level import of `kvq.tools` in `kvq.cli` would load every bench on each start."""
    eager = []
    for name, path in modules().items():
        if not under(name, "kvq.cli"):
            continue
        for node in ast.parse(path.read_text()).body:  # module level only
            if isinstance(node, ast.ImportFrom) and under(node.module or "", "kvq.tools"):
                eager.append(f"{name}: {node.module}")
            if isinstance(node, ast.Import):
                eager += [f"{name}: {a.name}" for a in node.names if under(a.name, "kvq.tools")]
    assert not eager, eager
