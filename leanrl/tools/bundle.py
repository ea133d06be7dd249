"""Make one standalone file of a training script: its own text first, the project modules it imports after it.

    python leanrl/tools/bundle.py leanrl/ppo_continuous_action.py -o my_ppo.py
    python leanrl/tools/bundle.py leanrl/ppo_continuous_action.py > my_ppo.py
    python leanrl/tools/bundle.py ppo_continuous_action.py -o my_ppo.py   # a bare name: leanrl/'s script

The modules are those of the script's folder (leanrl/: the harness package, the GPU env modules, any other module
or package there) that the script imports, found in its import statements and in theirs, recursively. The bundle
reads algorithm first:

1. a header comment, then one import block: the outside imports of the script and of every module, each once, sorted
   as isort does, only those the kept code reads (or that a file runs for their effect: a name its file never reads);
2. the script as its user knows it, from its header comment and Args to its main, less its imports and its
   `if __name__ == "__main__":` block;
3. an appendix: the project modules, each under a `# ---- <file>` line after the modules it imports, pruned to what
   the script reaches: a def, class or assignment to names is kept only where a name it binds is read by the script
   or by what is kept already, across the modules (any other top-level statement runs for its effect: kept);
4. the names the script imports under names of its own (`import module as name`: a namespace of the module's names
   that the kept code reads), after what they name, then the script's `if __name__ == "__main__":` block.

What the script's own top-level statements read of the modules as they run (a base class, a decorator, a default
value, an assigned value) comes in a prelude before the script, with everything it reads. An import of a module that
follows a statement run for its effect stays after it. The statements that import project modules are left out
(`from module import name as alias` becomes `alias = name`); everything else is kept as written. A top-level name
that two of the files bind to different things would make the one file wrong: the tool refuses, naming the name and
the files. Exit code 2 with one `error:` line for bad input; a file already at the output path is never overwritten
without --force.

-o names the script: the speed record's "script" and the checkpoint files take the bundle's file name (my_ppo.py:
"my_ppo", my_ppo.pt), as they take the script's. Without -o the bundle goes to stdout, and what it reports to stderr.
"""

import argparse
import ast
import builtins
import os
import re
import symtable
import sys
import tempfile
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

# What an inlined module would read as the bundle's own (its file, its name), not its own: refused.
MODULE_DUNDERS = {"__file__", "__name__", "__doc__", "__spec__", "__package__", "__path__", "__loader__", "__cached__"}
WIDTH = 120


class BundleError(Exception):
    pass


@dataclass(eq=False)
class Module:
    name: str  # the dotted name a script imports it by; the script's own is ""
    path: Path
    is_package: bool
    source: str = ""
    tree: ast.Module = None
    # Import statements of project modules: (statement, the statement list it sits in, [(alias, binding)], whether
    # it binds module-level names) where a binding is ("from", module, name, its submodule or None), ("module",
    # module) or ("star", module).
    imports: list = field(default_factory=list)
    deps: list = field(default_factory=list)
    bindings: dict = field(default_factory=dict)  # top-level name -> set of sources (see Bundler.bindings)
    referenced: set = field(default_factory=set)  # global names its code reads
    future: set = field(default_factory=set)

    @property
    def package(self):
        return self.name if self.is_package else self.name.rpartition(".")[0]


@dataclass(eq=False)
class Unit:
    """A top-level statement of a file (or a few that share a line), with the blank lines and comments above it."""

    module: Module
    nodes: list
    first: int  # its first line (index), the comments above it included
    last: int
    # "import": an outside import, merged into the bundle's imports; "project": an import of a project module;
    # "definition": a def, a class, an assignment to names, kept where reached; "statement": any other, always kept;
    # "doc", "head": the file's docstring, the comments above its first import; "main": the script's
    # `if __name__ == "__main__":`; "future", "all": left out.
    kind: str
    binds: set = field(default_factory=set)  # the top-level names it binds
    refs: set = field(default_factory=set)  # the global names its code reads, its project imports aside
    now: set = field(default_factory=set)  # those it reads as it runs, not when its functions are called
    chains: dict = field(default_factory=dict)  # namespace name -> the attribute chains read of it: {("name",), ()}
    nested: list = field(default_factory=list)  # its project imports inside: (statement, its statement list, project)
    project: list = field(default_factory=list)  # a "project" unit's [(alias, binding)]
    every_import: set = field(default_factory=set)  # the ids of its file's project import statements


class Bundler:
    def __init__(self, script):
        self.root = script.parent
        self.script = Module("", script, False)
        self.modules = {}  # dotted name -> Module, in the order they were found
        self.order = []  # dependencies first
        self.load(self.script)

    def shown(self, path):
        return os.path.relpath(path, self.root.parent)

    def find(self, name, submodule=False):
        """The project module of a dotted name, or None for one from outside the project (a package installed) and,
        asked whether a name of a package is a submodule, for one that is not."""
        parts, folder = name.split("."), self.root
        for i, part in enumerate(parts):
            package, module = folder / part / "__init__.py", folder / f"{part}.py"
            if has_file(package):  # a package wins over a module of the same name, as in Python
                path, is_package = package, True
            elif has_file(module) and i == len(parts) - 1:
                path, is_package = module, False
            elif i == 0 or submodule:
                return None
            else:
                raise BundleError(f"no module {name} in {self.shown(self.root)}")
            folder = package.parent
        if name not in self.modules:
            self.modules[name] = Module(name, path, is_package)
        return self.modules[name]

    def load(self, module):
        try:
            module.source = module.path.read_text()
            module.tree = ast.parse(module.source, str(module.path))
        except (OSError, UnicodeDecodeError) as e:
            raise BundleError(f"{self.shown(module.path)} cannot be read: {getattr(e, 'strerror', None) or e}")
        except SyntaxError as e:
            raise BundleError(f"{self.shown(module.path)}:{e.lineno}: {e.msg}")
        self.scan_imports(module, module.tree.body)

    def resolve_from(self, module, node):
        """The absolute module name of `from ... import`, relative imports resolved against the module's package."""
        if not node.level:
            return node.module
        base = module.package.split(".") if module.package else []
        if node.level - 1 > len(base) or not module.name:
            where = f"{self.shown(module.path)}:{node.lineno}"
            raise BundleError(f"{where}: a relative import outside a package of {self.shown(self.root)}")
        base = base[: len(base) - (node.level - 1)]
        return ".".join(base + ([node.module] if node.module else []))

    def scan_imports(self, module, body, top=True):
        """Collect the project imports of a statement list and of the statement lists inside it; `top`: the list
        runs at module level (not in a function or class, where an import binds names of its own)."""
        for node in body:
            if isinstance(node, ast.Import):
                self.scan_import(module, body, node, top)
            elif isinstance(node, ast.ImportFrom):
                self.scan_import_from(module, body, node, top)
            inner = top and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.excepthandler, ast.match_case)):
                    self.scan_imports(module, child.body, inner)
            for name in ("body", "orelse", "finalbody"):
                block = getattr(node, name, None)
                if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
                    self.scan_imports(module, block, inner)

    def scan_import(self, module, body, node, top):
        project = []
        for alias in node.names:
            target = self.find(alias.name)
            if target is None:
                continue
            parents = alias.name.split(".")
            chain = [self.find(".".join(parents[: i + 1])) for i in range(len(parents))]
            module.deps += chain
            # `import a.b` binds a (with a.b inside it); `import a.b as c` binds c to a.b.
            project.append((alias.asname or parents[0], ("module", target if alias.asname else chain[0])))
        if project and len(project) != len(node.names):
            raise BundleError(f"{self.shown(module.path)}:{node.lineno}: put the project's modules in an import "
                              "statement of their own")  # fmt: skip
        if project:
            module.imports.append((node, body, project, top))

    def scan_import_from(self, module, body, node, top):
        if node.module == "__future__":
            module.future |= {alias.name for alias in node.names}
            return
        target = self.find(self.resolve_from(module, node))
        if target is None:
            if any(alias.name == "*" for alias in node.names):
                raise BundleError(f"{self.shown(module.path)}:{node.lineno}: `from {node.module} import *` binds names "
                                  "the tool cannot see, so it cannot check them for collisions")  # fmt: skip
            return
        parents = target.name.split(".")
        module.deps += [self.find(".".join(parents[: i + 1])) for i in range(len(parents))]
        project = []
        for alias in node.names:
            if alias.name == "*":
                project.append(("*", ("star", target)))
                continue
            # A name of the module, or its submodule; which one is known once the module's names are (bindings()).
            submodule = self.find(f"{target.name}.{alias.name}", submodule=True) if target.is_package else None
            module.deps += [submodule] if submodule else []
            project.append((alias.asname or alias.name, ("from", target, alias.name, submodule)))
        module.imports.append((node, body, project, top))

    def sort(self):
        """Every module after the ones it imports (a package's __init__ before its submodules only as far as it
        imports them); a circular import is refused."""
        state = {}

        def visit(module, stack):
            if state.get(module.name) == "done":
                return
            if state.get(module.name) == "active":
                if module.is_package and any(m.name.startswith(module.name + ".") for m in stack):
                    return  # a submodule imports from its package being imported: Python's partial __init__
                cycle = " -> ".join(self.shown(m.path) for m in stack[stack.index(module) :] + [module])
                raise BundleError(f"circular import: {cycle}")
            state[module.name] = "active"
            if module is not self.script:
                self.load(module)
            for dep in dict.fromkeys(module.deps):
                if dep is not module:
                    visit(dep, stack + [module])
            state[module.name] = "done"
            if module is not self.script:
                self.order.append(module)

        visit(self.script, [])

    def bindings(self):
        """Each file's top-level names, each with the set of what it is bound to: ("import", dotted name) for a
        package installed, ("const", value) for a constant, ("module", name) for a namespace of a project module,
        the defining file and line otherwise. A project import binds what the name is in the module it comes from."""
        for module in self.order + [self.script]:
            for node in module.tree.body:
                self.bind_statement(module, node)
            for name, line in declared_globals(module.tree):
                module.bindings.setdefault(name, set()).add((str(module.path), line))
            module.referenced = referenced_globals(module.source, module.path)
            if module is not self.script:
                module.bindings.pop("__all__", None)  # the module's import interface, which the bundle has not
            for node, _, project, top in module.imports:
                for alias, binding in project:
                    for name, sources in self.imported(module, node, alias, binding).items():
                        if top:
                            module.bindings.setdefault(name, set()).update(sources)

    def imported(self, module, node, alias, binding):
        """{name: sources} that one alias of a project import binds."""
        if binding[0] == "module":
            return {alias: {("module", binding[1].name)}}
        if binding[0] == "star":
            names = binding[1].bindings
            public = [n for n in names if not n.startswith("_")]
            exported = explicit_all(binding[1]) or public
            return {name: names[name] for name in exported if name in names}
        _, target, name, submodule = binding
        if name in target.bindings:
            return {alias: target.bindings[name]}
        if submodule is not None:
            return {alias: {("module", submodule.name)}}
        raise BundleError(f"{self.shown(module.path)}:{node.lineno}: {target.name or 'the script'} has no name {name}")

    def bind_statement(self, module, node):
        """The names a top-level statement binds (inside if, try, for, with blocks too), without the project
        imports: those are added by bindings()."""
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if any(node is n for n, *_ in module.imports) or getattr(node, "module", None) == "__future__":
                return
            for alias in node.names:
                if isinstance(node, ast.Import):
                    dotted = alias.name if alias.asname else alias.name.split(".")[0]
                    bound = alias.asname or alias.name.split(".")[0]
                else:
                    dotted, bound = f"{'.' * node.level}{node.module or ''}.{alias.name}", alias.asname or alias.name
                module.bindings.setdefault(bound, set()).add(("import", dotted))
            return
        where = (str(module.path), node.lineno)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            module.bindings.setdefault(node.name, set()).add(where)
            return
        constant = isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
        for name in stored_names(node):
            module.bindings.setdefault(name, set()).add(("const", repr(node.value.value)) if constant else where)
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.stmt):
                self.bind_statement(module, child)
            elif isinstance(child, (ast.excepthandler, ast.match_case)):
                if getattr(child, "name", None):
                    module.bindings.setdefault(child.name, set()).add(where)
                for statement in child.body:
                    self.bind_statement(module, statement)

    def check(self):
        """Refuse what would make the one file behave unlike the script run from its folder."""
        files = self.order + [self.script]
        futures = {frozenset(m.future) for m in files}
        if len(futures) > 1:
            listed = "; ".join(f"{self.shown(m.path)}: {', '.join(sorted(m.future)) or 'none'}" for m in files)
            raise BundleError(f"the files' `from __future__` imports differ, which one file cannot keep apart: "
                              f"{listed}")  # fmt: skip
        for module in self.order:
            for node in ast.walk(module.tree):
                if isinstance(node, ast.Name) and node.id in MODULE_DUNDERS:
                    raise BundleError(f"{self.shown(module.path)}:{node.lineno}: {node.id} would be the bundle's, "
                                      "not the module's, once inlined")  # fmt: skip
        owners = {}
        for module in files:
            for name, sources in module.bindings.items():
                owners.setdefault(name, []).append((module, frozenset(sources)))
        if self.uses_namespaces():
            owners.setdefault("types", []).append((None, frozenset({("import", "types")})))
        for name, bound in owners.items():
            if len({sources for _, sources in bound}) > 1:
                where = ", ".join(self.describe(module, name, sources) for module, sources in bound)
                raise BundleError(f"name collision: {name} is bound to different things in {where}")
        for module in files:
            for name in sorted(module.referenced - set(module.bindings)):
                others = [m for m, _ in owners.get(name, []) if m is not None and m is not module]
                if others:
                    what = "the builtin" if hasattr(builtins, name) else "the name"
                    raise BundleError(f"name collision: {self.shown(others[0].path)} binds {name}, which would "
                                      f"replace {what} {name} that {self.shown(module.path)} reads")  # fmt: skip

    def describe(self, module, name, sources):
        if module is None:
            return "the bundle (import types, for the namespaces of `import module`)"
        lines = sorted(str(s[1]) for s in sources if s[0] == str(module.path))
        return f"{self.shown(module.path)}" + (f" (line {', '.join(lines)})" if lines else "")

    def uses_namespaces(self):
        """Whether an `import module` (or `from package import submodule`) needs `types` for its namespace."""
        for module in self.order + [self.script]:
            for _, _, project, _ in module.imports:
                for _, binding in project:
                    if binding[0] == "module" or (binding[0] == "from" and binding[2] not in binding[1].bindings):
                        return True
        return False

    # ---- the bundle's text: the files cut into units, what the script reaches, the layout

    def units(self, module):
        """The file's top-level statements as units (statements that share a line: one unit), each with the blank
        lines and comments above it; the lines above the first statement, when that one moves (an import): a unit of
        their own, the file's head."""
        lines, body, groups = module.source.splitlines(), module.tree.body, []
        for node in body:
            if groups and first_line(node) <= groups[-1][-1].end_lineno:
                groups[-1].append(node)
            else:
                groups.append([node])
        top_imports = {id(node) for node, *_ in module.imports if any(node is n for n in body)}
        every_import = {id(node) for node, *_ in module.imports}
        nested = [(node, block, project) for node, block, project, _ in module.imports if id(node) not in top_imports]
        for node, block, _ in nested:
            span = {node.lineno, node.end_lineno}
            if any(n is not node and {n.lineno, n.end_lineno} & span for n in block) or lines[node.lineno - 1][
                    : node.col_offset].strip():  # fmt: skip
                raise BundleError(f"{self.shown(module.path)}:{node.lineno}: put this import on a line of its own")
        units, start, effect = [], 0, False
        for index, group in enumerate(groups):
            node = group[0]
            imports = [n for n in group if isinstance(n, (ast.Import, ast.ImportFrom))]
            if imports and len(group) > 1:
                where = f"{self.shown(module.path)}:{imports[0].lineno}"
                raise BundleError(f"{where}: put this import on a line of its own")
            if len(group) > 1:
                kind = "definition" if all(is_definition(n) for n in group) else "statement"
            elif is_future(node):
                kind = "future"
            elif id(node) in top_imports:
                kind = "project"
            elif imports:  # one that follows a statement run for its effect stays after it
                kind = "statement" if effect else "import"
            elif index == 0 and is_docstring(node):
                kind = "doc"
            elif module is self.script and is_main_block(node):
                kind = "main"
            elif module is not self.script and is_all(node):
                kind = "all"  # the module's import interface, which the bundle has not
            else:
                kind = "definition" if is_definition(node) else "statement"
            effect = effect or kind == "statement"
            if index == 0 and kind in ("import", "project", "future") and first_line(node) > 1:
                units.append(Unit(module, [], 0, first_line(node) - 2, "head"))
                start = first_line(node) - 1
            last = len(lines) - 1 if index == len(groups) - 1 else group[-1].end_lineno - 1
            unit = Unit(module, group, start, last, kind)
            start = last + 1
            unit.nested = [n for n in nested if unit.first <= n[0].lineno - 1 <= unit.last]
            unit.every_import = every_import
            if kind == "project":  # a unit for each name it binds: what the script reaches of it is kept
                for alias, binding in next(project for n, _, project, _ in module.imports if n is node):
                    binds = set(self.imported(module, node, alias, binding))
                    units.append(Unit(module, group, unit.first, unit.last, kind, binds, project=[(alias, binding)]))
                continue
            if kind in ("definition", "statement", "main"):
                unit.binds = {name for n in group for name in bound_names(n)} | {n for n, _ in declared_globals(
                    ast.Module(body=group, type_ignores=[]))}  # fmt: skip
                code = ast.unparse(ast.Module(body=group, type_ignores=[]))
                unit.refs = referenced_globals(code, module.path)
                unit.now = set().union(*(import_time_names(n, "annotations" in module.future) for n in group))
                unit.chains = attribute_chains(group, self.namespace_names)
            units.append(unit)
        if not units and lines:
            units.append(Unit(module, [], 0, len(lines) - 1, "head"))
        return units

    def refs(self, unit):
        """The global names a unit reads, those of its project imports made names of this file (a namespace: those of
        its names that the kept code reads) included."""
        names = set(unit.refs)
        for _, _, project in unit.nested + ([(None, None, unit.project)] if unit.project else []):
            for alias, binding in project:
                if binding[0] == "from" and (binding[2] in binding[1].bindings or binding[3] is None):
                    names.add(binding[2])
                elif binding[0] != "star":
                    module = binding[1] if binding[0] == "module" else binding[3]
                    names |= self.member_names(module, self.used.get(alias, set()))
        return names

    def closure(self, roots, enter=lambda unit: True):
        """The units that bind the names of `roots` ((name, the unit that reads it) pairs), and those that bind the
        names they read, on and on: {unit: (the unit it was reached from, the name)}, breadth first."""
        reached, queue = {}, deque(roots)
        while queue:
            name, origin = queue.popleft()
            for unit in self.binders.get(name, ()):
                if unit not in reached and enter(unit):
                    reached[unit] = (origin, name)
                    queue += [(n, unit) for n in sorted(self.refs(unit))]
        return reached

    def layout(self):
        """Cut the files into units, keep what the script reaches, place what its top-level code needs as it runs
        before it (the prelude)."""
        self.namespace_names = {alias for m in self.order + [self.script] for _, _, project, _ in m.imports
                                for alias, binding in project if binding[0] == "module"
                                or (binding[0] == "from" and binding[2] not in binding[1].bindings)}  # fmt: skip
        self.files = {module: self.units(module) for module in self.order + [self.script]}
        self.binders, self.used = {}, {}
        for units in self.files.values():
            for unit in units:
                if unit.kind in ("definition", "statement", "project", "main"):
                    for name in unit.binds:
                        self.binders.setdefault(name, []).append(unit)
        # The script's own statements first: the names they read are traced to them (trace()), not to its imports.
        script_units = sorted((u for u in self.files[self.script] if u.kind not in ("import", "future")),
                              key=lambda u: u.kind == "project")  # fmt: skip
        always = script_units + [u for m in self.order for u in self.files[m] if u.kind == "statement"]
        fixed = set(always)
        while True:  # the names kept namespaces carry depend on what is kept: until that settles
            roots = [(name, unit) for unit in always for name in sorted(self.refs(unit))]
            self.reached = self.closure(roots, lambda unit: unit not in fixed)
            self.kept = set(always) | set(self.reached)
            used = {}
            for unit in self.kept:
                for alias, chains in unit.chains.items():
                    used.setdefault(alias, set()).update(chains)
            if used == self.used:
                break
            self.used = used
        # What the script's own statements read as they run (a base class, a decorator, a default, a value): the
        # units that bind it, and all they read, before the script.
        own = [u for u in script_units if u.kind in ("definition", "statement")]
        movable = lambda unit: unit.module is not self.script or unit.kind == "project"
        self.prelude = set(self.closure([(name, u) for u in own for name in sorted(u.now)], movable))
        # The statements a module runs for their effect before what the prelude holds ran before it, as they do here.
        order = {unit: (i, j) for i, units in enumerate(self.files.values()) for j, unit in enumerate(units)}
        while self.prelude:
            last = max(order[u] for u in self.prelude)
            effects = [u for m in self.order for u in self.files[m] if u.kind == "statement" and order[u] < last
                       and u not in self.prelude]  # fmt: skip
            if not effects:
                break
            self.prelude |= set(effects) | set(self.closure([(n, u) for u in effects for n in self.refs(u)], movable))
        self.referenced = set().union(*(self.refs(u) for u in self.kept))

    def trace(self, unit):
        """Why a unit is kept: [(its label, the name it was reached by)], the script's statement that reads it last."""
        chain = []
        while unit in self.reached:
            origin, name = self.reached[unit]
            chain.append((self.label(unit), name))
            unit = origin
        return chain + [(self.label(unit), None)]

    def label(self, unit):
        node = unit.nodes[0] if unit.nodes else None
        name = getattr(node, "name", None) or ", ".join(sorted(unit.binds)) or f"line {unit.first + 1}"
        return f"{self.shown(unit.module.path)}:{name}"

    def kept_definitions(self, module):
        """The names of the module's functions and classes the bundle keeps."""
        return [u.nodes[0].name for u in self.files[module] if u in self.kept and hasattr(u.nodes[0], "name")]

    def member_names(self, module, used):
        names = set()
        for name, sub, sub_used in self.members(module, used):
            names |= {name} if sub is None else self.member_names(sub, sub_used)
        return names

    def members(self, module, used):
        """What the namespace of a module carries: the names that the kept code reads from it (`alias.name`), all of
        them where it uses the namespace itself; its submodules inlined, as namespaces: [(name, submodule or None,
        what is read of the submodule)]."""
        whole, read = () in used, {chain[0] for chain in used if chain}
        out = [(n, None, None) for n in module.bindings if not n.startswith("__") and (whole or n in read)]
        for sub in self.order:
            parent, _, short = sub.name.rpartition(".")
            if parent == module.name and short not in module.bindings and (whole or short in read):
                out.append((short, sub, {()} if whole else {chain[1:] for chain in used if chain[0] == short}))
        return out

    def namespace(self, module, used, column, indent):
        """`types.SimpleNamespace(...)` of the module's names the kept code reads, as it reads from `column` on, in a
        statement indented by `indent`."""
        self.namespaced = True
        parts = []
        for name, sub, sub_used in self.members(module, used):
            value = name if sub is None else self.namespace(sub, sub_used, indent + 5 + len(name), indent + 4)
            parts.append(f"{name}={value}")
        return wrap("types.SimpleNamespace(", parts, ")", column, indent)

    def replacement(self, column, project):
        """The lines that stand for a project import: a namespace for a module, `alias = name` for a renamed name."""
        indent, new = " " * column, []
        for alias, binding in project:
            if binding[0] == "from" and (binding[2] in binding[1].bindings or binding[3] is None):
                new += [f"{indent}{alias} = {binding[2]}"] if alias != binding[2] else []
            elif binding[0] != "star":  # a module, or a submodule named in `from package import`
                module = binding[1] if binding[0] == "module" else binding[3]
                used = self.used.get(alias, set())
                new.append(f"{indent}{alias} = {self.namespace(module, used, column + len(alias) + 3, column)}")
        return "\n".join(new).splitlines()

    def render(self, unit):
        """A unit's text: its lines, with the comments above it, its project imports replaced; "" for nothing."""
        module, lines = unit.module, unit.module.source.splitlines()
        if unit.kind == "project":
            new = self.replacement(0, unit.project)
            return "\n".join(new)
        replace = {}  # first line index -> (last line index, replacement lines)
        if module is self.script and unit.first == 0 and module.source.startswith("#!"):
            replace[0] = (0, [])  # the bundle's first line
        if module is self.script and unit.kind == "doc":
            # No longer the file's first statement: set as the bundle's __doc__, which is the script's.
            line, column = unit.nodes[0].lineno - 1, unit.nodes[0].col_offset
            replace[line] = (line, [f"{lines[line][:column]}__doc__ = {lines[line][column:]}"])
        for node, block, project in unit.nested:
            new = self.replacement(node.col_offset, project)
            if not new and node is block[0] and all(id(n) in unit.every_import for n in block):
                new = [" " * node.col_offset + "pass"]  # a block of nothing but project imports
            replace[node.lineno - 1] = (node.end_lineno - 1, new)
        out, i = [], unit.first
        while i <= unit.last:
            if i not in replace:
                out.append(lines[i])
                i += 1
                continue
            last, new = replace[i]
            out += new
            i = last + 1
            if not new and out and not out[-1].strip() and i <= unit.last and not lines[i].strip():
                i += 1  # a blank line before and after what was removed: one is enough
        return "\n".join(out)

    def section(self, heading, units):
        """Units under a `# ---- ` heading, their blank lines as in their files (at most two in a row); "" for none."""
        texts = [text for text in map(self.render, units) if text.strip()]
        if not texts:
            return ""
        text = re.sub(r"\n{4,}", "\n\n\n", "\n".join(texts).strip("\n"))
        return "\n".join(heading) + "\n" + text + "\n"

    def import_block(self):
        """The files' outside imports that the kept code reads (or that it runs for their effect: a name no code of
        its file reads), each once, sorted as isort does: the standard library's, then the others."""
        plain, froms = set(), {}
        for units in self.files.values():
            for unit in units:
                if unit.kind != "import":
                    continue
                node = unit.nodes[0]
                for alias in node.names:
                    bound = alias.asname or (alias.name.split(".")[0] if isinstance(node, ast.Import) else alias.name)
                    if bound not in self.referenced and bound in unit.module.referenced:
                        continue
                    if isinstance(node, ast.Import):
                        plain.add((alias.name, alias.asname))
                    else:
                        froms.setdefault("." * node.level + (node.module or ""), set()).add((alias.name, alias.asname))
        namespaces = self.namespaced and ("types", None) not in plain
        plain |= {("types", None)} if namespaces else set()

        def section(name):
            return 2 if name.startswith(".") else 0 if name.split(".")[0] in sys.stdlib_module_names else 1

        def by_type(pair):  # constants, classes, then the rest, as isort orders a from-import's names
            name, kind = pair[0], 0 if pair[0].isupper() and len(pair[0]) > 1 else 1 if pair[0][:1].isupper() else 2
            return kind, name.lower(), name, pair[1] or ""

        blocks = []
        for number in range(3):
            block = []
            plain_here = [p for p in plain if section(p[0]) == number]
            for name, asname in sorted(plain_here, key=lambda p: (p[0].lower(), p[0], p[1] or "")):
                block.append(f"import {name}" + (f" as {asname}" if asname else ""))
                block[-1] += "  # the namespaces of `import module`" if namespaces and name == "types" else ""
            for name in sorted((m for m in froms if section(m) == number), key=lambda m: (m.lower(), m)):
                names = [n + (f" as {a}" if a else "") for n, a in sorted(froms[name], key=by_type)]
                line = f"from {name} import {', '.join(names)}"
                block.append(line if len(line) <= WIDTH else f"from {name} import (\n" + "".join(
                    f"    {n},\n" for n in names) + ")")  # fmt: skip
            blocks += ["\n".join(block)] if block else []
        return "\n\n".join(blocks)

    def write(self, output):
        """The bundle's text; output: the file it goes to, or None for stdout."""
        self.sort()
        self.bindings()
        self.check()
        if not any(runs_something(node) for node in self.script.tree.body):  # mujoco_warp_envs.py: a module
            raise BundleError(f"{self.shown(self.script.path)} defines names and runs nothing (no `if __name__ == "
                              "\"__main__\":` block): not a training script; bundle a script that imports it")
        self.layout()
        self.namespaced = False
        name, script = output.name if output else "<bundle>.py", self.shown(self.script.path)
        prelude, appendix, shown = [], [], []
        for module in self.order:  # a module's docstring comes with what is kept of it, if anything
            kept = [u for u in self.files[module] if u.kind in ("doc", "head") or u in self.kept and u.kind != "all"]
            before = [u for u in kept if u in self.prelude]
            if before:
                prelude.append(self.section([f"# ---- {self.shown(module.path)}"], before))
            rest = [u for u in kept if u not in self.prelude]
            if any(u.kind not in ("doc", "head") and self.render(u).strip() for u in rest):
                top = module.name.split(".")[0]
                folder = self.shown(module.path.parent) + "/" if module.name != top or module.is_package else None
                shown += [folder or self.shown(module.path)]
                appendix.append(self.section([f"# ---- {self.shown(module.path)}"], rest))
        units = self.files[self.script]
        own = [u for u in units if u.kind in ("head", "doc", "definition", "statement")]
        imports = [u for u in units if u.kind == "project"]
        if any(u in self.prelude for u in imports):
            prelude.append(self.section([f"# ---- {script}: its imports of the project's modules"],
                                        [u for u in imports if u in self.prelude]))  # fmt: skip
        if prelude:
            heading = wrap_comment("---- The prelude: what the script's own statements read of the project modules as "
                                   "they run (a base class, a decorator, a default value), with all it reads; the rest "
                                   "is in the appendix")  # fmt: skip
            prelude.insert(0, "\n".join(heading) + "\n")
        tail = self.section([f"# ---- {script}: its imports of the project's modules, bound after what they name"],
                            [u for u in imports if u not in self.prelude])  # fmt: skip
        listed = ", ".join(dict.fromkeys(shown))
        parts = [*prelude, self.section([f"# ---- {script}: the script"], own)]
        if appendix:
            heading = wrap_comment(f"---- Appendix: the project modules this script imports ({listed}), pruned to "
                                   "what it uses")  # fmt: skip
            parts += ["\n".join(heading) + "\n", *appendix]
        parts += [tail, *[self.render(u).strip("\n") + "\n" for u in units if u.kind == "main"]]
        header = [self.script.source.splitlines()[0]] if self.script.source.startswith("#!") else []
        header += wrap_comment(f"{name}: {script} made standalone by leanrl/tools/bundle.py, to run alone as the "
                               f"script does (python {name}, the same flags and output): the imports of all the files "
                               "it takes in, merged; the script, from its Args to its main; the project modules it "
                               "imports; its `if __name__ == \"__main__\":` block.")  # fmt: skip
        header += ["# The harness appendix, pruned to what the script uses, is at the end."] if appendix else []
        future = sorted(self.script.future)
        header += [f"from __future__ import {', '.join(future)}"] if future else []
        imports = self.import_block()
        top = "\n".join(header) + "\n" + (f"{imports}\n" if imports else "")
        bundle = top + "\n" + "\n\n".join(part for part in parts if part)  # one blank line after imports, as isort
        try:
            compile(bundle, name, "exec")
        except SyntaxError as e:  # the tool's own mistake; the file is not written
            raise BundleError(f"the bundle does not compile ({e.msg}, line {e.lineno}): a bug of bundle.py")
        return bundle


def stored_names(node):
    """Names a statement (not a def or class) stores at its own scope: targets, for and with variables, walrus
    targets anywhere in it (even in a comprehension), not names inside nested functions or classes."""
    names, stack = [], [child for child in ast.iter_child_nodes(node) if not isinstance(child, ast.stmt)]
    while stack:
        child = stack.pop()
        if isinstance(child, (ast.Lambda, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if isinstance(child, ast.NamedExpr):
            names.append(child.target.id)
        elif isinstance(child, ast.Name) and isinstance(child.ctx, (ast.Store, ast.Del)):
            names.append(child.id)
        elif isinstance(child, (ast.MatchAs, ast.MatchStar)) and child.name:
            names.append(child.name)
        elif isinstance(child, ast.MatchMapping) and child.rest:
            names.append(child.rest)
        if isinstance(child, ast.comprehension):
            stack += [child.iter]  # its target is the comprehension's own
            stack += [n for cond in child.ifs for n in ast.walk(cond) if isinstance(n, ast.NamedExpr)]
            continue
        stack += [c for c in ast.iter_child_nodes(child) if not isinstance(c, (ast.stmt, ast.excepthandler))]
    return names


def declared_globals(tree):
    """(name, line) of the module-level names that functions assign after `global name`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            declared = {n for s in ast.walk(node) if isinstance(s, ast.Global) for n in s.names}
            found += [(n, node.lineno) for n in declared]
    return found


def referenced_globals(source, path):
    """The global names a module's code reads, at its top level and in its functions and classes."""
    names = set()

    def visit(table, top):
        for symbol in table.get_symbols():
            if symbol.is_referenced() and (top or symbol.is_global()):
                names.add(symbol.get_name())
        for child in table.get_children():
            visit(child, False)

    visit(symtable.symtable(source, str(path), "exec"), True)
    return names


def first_line(node):
    """The first line of a statement, its decorators included."""
    return min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])


def is_definition(node):
    """A def, a class, or an assignment to names only: kept only where the script reaches the names it binds."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return True
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
        node, (ast.AnnAssign, ast.AugAssign)) else None  # fmt: skip
    return targets is not None and all(isinstance(n, ast.Name) for t in targets for n in names_of_target(t))


def names_of_target(target):
    """The nodes an assignment target is made of: a name, or the parts of a tuple or list of them."""
    if isinstance(target, (ast.Tuple, ast.List)):
        return [n for element in target.elts for n in names_of_target(element)]
    return names_of_target(target.value) if isinstance(target, ast.Starred) else [target]


def is_docstring(node):
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)


def runs_something(node):
    """Whether a top-level statement does more than define names: a call, a loop, a main block."""
    if isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Assign,
                         ast.AnnAssign, ast.Pass)) or is_docstring(node):  # fmt: skip
        return False
    if isinstance(node, (ast.If, ast.Try)) and not is_main_block(node):  # a definition made on a condition
        parts = [*node.body, *node.orelse, *getattr(node, "finalbody", [])]
        return any(runs_something(n) for n in parts + [n for h in getattr(node, "handlers", []) for n in h.body])
    return True


def is_main_block(node):
    test = getattr(node, "test", None)
    return (isinstance(node, ast.If) and isinstance(test, ast.Compare) and isinstance(test.left, ast.Name)
            and test.left.id == "__name__" and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)
            and isinstance(test.comparators[0], ast.Constant) and test.comparators[0].value == "__main__")  # fmt: skip


def bound_names(node):
    """The top-level names a top-level statement binds (inside if, try, for, with blocks too)."""
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {a.asname or (a.name.split(".")[0] if isinstance(node, ast.Import) else a.name) for a in node.names}
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    names = set(stored_names(node))
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.stmt):
            names |= bound_names(child)
        elif isinstance(child, (ast.excepthandler, ast.match_case)):
            names |= {child.name} if getattr(child, "name", None) else set()
            names |= {name for statement in child.body for name in bound_names(statement)}
    return names


def import_time_names(node, lazy_annotations):
    """The names a top-level statement reads as it runs: a def's decorators, defaults and annotations, a class's
    bases and body, any other statement whole; not what functions (and lambdas) read when they are called."""
    names = set()

    def visit(n):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            args = n.args
            now = [*getattr(n, "decorator_list", []), *args.defaults, *[d for d in args.kw_defaults if d]]
            if not lazy_annotations and not isinstance(n, ast.Lambda):
                every = [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]
                now += [a.annotation for a in every if a is not None and a.annotation]
                now += [n.returns] if n.returns else []
            return [visit(child) for child in now]
        if isinstance(n, ast.AnnAssign) and lazy_annotations:
            return [visit(child) for child in (n.target, n.value) if child]
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load):
            names.add(n.id)
        for child in ast.iter_child_nodes(n):
            visit(child)

    visit(node)
    return names


def attribute_chains(nodes, watched):
    """{name: the attribute chains read of it} for the watched names (`ns.a.b` -> ("a", "b"); `ns` alone -> ())."""
    parents, chains = {}, {}
    for node in nodes:
        for parent in ast.walk(node):
            for child in ast.iter_child_nodes(parent):
                parents[child] = parent
    for node in nodes:
        for name in ast.walk(node):
            if isinstance(name, ast.Name) and name.id in watched and isinstance(name.ctx, ast.Load):
                chain, current = [], name
                while isinstance(parents.get(current), ast.Attribute) and parents[current].value is current:
                    current = parents[current]
                    chain.append(current.attr)
                chains.setdefault(name.id, set()).add(tuple(chain))
    return chains


def explicit_all(module):
    for node in module.tree.body:
        if is_all(node) and isinstance(node.value, (ast.List, ast.Tuple)):
            return [e.value for e in node.value.elts if isinstance(e, ast.Constant)]
    return None


def is_all(node):
    return isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)


def is_future(node):
    return isinstance(node, ast.ImportFrom) and node.module == "__future__"


def wrap(start, parts, end, column, indent):
    """A call on one line from `column` on if it fits, else its arguments on lines of their own, packed."""
    one_line = start + ", ".join(parts) + end
    if column + len(one_line) <= WIDTH and "\n" not in one_line:
        return one_line
    pad, lines = " " * (indent + 4), [""]
    for part in parts:
        if "\n" in part or len(pad) + len(lines[-1]) + len(part) + 1 > WIDTH:
            lines.append("")
        lines[-1] += part + ","
        lines += [""] if "\n" in part else []
        lines[-1] += " " if lines[-1] else ""
    return start + "\n" + "\n".join(pad + line.rstrip() for line in lines if line) + "\n" + " " * indent + end


def wrap_comment(text):
    lines, line = [], "#"
    for word in text.split():
        if len(line) + 1 + len(word) > WIDTH:
            lines.append(line)
            line = "#"
        line += " " + word
    return lines + [line]


def has_file(path):
    """Whether path is a file, its name matched case and all (as Python's import does on a case-insensitive disk)."""
    return path.is_file() and path.name in os.listdir(path.parent)


def fail(message):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def imports_relatively(path):
    """Whether the file imports from its own package (`from .run import ...`), which a script on its own cannot; one
    that does not parse says why in the Bundler."""
    try:
        tree = ast.parse(path.read_bytes())
    except (SyntaxError, ValueError):
        return False
    return any(isinstance(node, ast.ImportFrom) and node.level for node in ast.walk(tree))


def main(argv=None):
    parser = argparse.ArgumentParser(
        description="Write one standalone file of a training script that reads algorithm first: the imports of all "
        "its files, merged; the script itself, from its Args to its main; then an appendix of the project modules it "
        "imports (the harness, the GPU env modules, any module or package of its folder), pruned to what the script "
        "uses. The file runs alone, copied anywhere, with the script's flags and output.",
    )
    parser.add_argument("script", type=Path, help="the training script, e.g. leanrl/ppo_continuous_action.py (or "
                        "its bare name, ppo_continuous_action.py or ppo_continuous_action, from any folder)")
    parser.add_argument(
        "-o",
        "--output",
        help="the file to write; it names the script: the speed record's \"script\" and the checkpoint files take "
        "its name (my_ppo.py: \"my_ppo\", my_ppo.pt; a name without .py runs too). A folder (or a path ending in "
        "/): the script's own name in it, as cp does. Without it, the bundle goes to stdout",
    )
    parser.add_argument("--force", action="store_true", help="overwrite the output file if it exists")
    args = parser.parse_args(argv)
    if args.output == "":
        fail("-o '': an empty name (without -o the bundle goes to stdout)")
    script, output = args.script, args.output and Path(args.output)
    collection_script = Path(__file__).resolve().parent.parent / f"{script.stem}.py"
    if not script.exists() and script.parent == Path() and script.suffix in ("", ".py") and collection_script.is_file():
        script = collection_script  # a bare name, from any folder: the collection's script of that name
    if not script.is_file():
        fail(f"{script}: no such script" if not script.exists() else f"{script} is not a file")
    if script.suffix != ".py":
        fail(f"{script}: a training script is a .py file")
    if script.name == "__init__.py":
        fail(f"{script} sets up the package {script.resolve().parent.name}: not a training script")
    if (script.resolve().parent / "__init__.py").is_file() and imports_relatively(script):  # harness/run.py
        fail(f"{script} is a module of the package {script.resolve().parent.name}, not a training script")
    if output is None:
        if sys.stdout is None:  # >&-
            fail("stdout is closed: pass -o FILE")
        try:
            bundler = Bundler(script.resolve())
            sys.stdout.write(bundler.write(None))
            sys.stdout.flush()
        except BundleError as e:
            fail(str(e))
        except OSError as e:  # > /dev/full
            fail(f"the bundle could not be written to stdout: {e.strerror or e}")
        return 0
    if output.is_dir() or args.output.endswith(os.sep):  # into a folder, under the script's own name
        output = output / script.name
    if output.is_symlink():  # replacing the link would leave its target as it was; a loop cannot be followed
        fail(f"-o {output} is a symbolic link: name the file itself")
    if output.exists() and not output.is_file():
        fail(f"-o {output} is not a regular file (a device, a pipe?): name a file")
    folder = output.resolve().parent
    if output.exists() and not args.force:
        fail(f"-o {output} exists: pass --force to overwrite it, or name another file")
    try:
        bundler = Bundler(script.resolve())
        bundle = bundler.write(output)
    except BundleError as e:
        fail(str(e))
    sources = [bundler.script.path] + [m.path for m in bundler.order]
    if any(output.exists() and os.path.samefile(output, s) for s in sources):
        fail(f"-o {output} is one of the files bundled: name another file")
    try:  # a new folder, as --save-dir makes one: only now that there is a bundle to put in it
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        fail(f"-o {output}: the folder {folder} cannot be made: {e.strerror or e}")
    temporary, umask = None, os.umask(0)
    os.umask(umask)
    try:  # a new file renamed over the path: a failed write leaves the old file as it was
        with tempfile.NamedTemporaryFile("w", dir=folder, prefix=f".{output.name}.", delete=False) as f:
            temporary = f.name
            f.write(bundle)
        os.chmod(temporary, 0o666 & ~umask)
        os.replace(temporary, output)
    except OSError as e:
        if temporary and os.path.exists(temporary):
            os.unlink(temporary)
        fail(f"-o {output} cannot be written: {e.strerror or e}")
    inlined = ", ".join(bundler.shown(m.path) for m in bundler.order) or "none"
    print(f"wrote {output}: {bundler.shown(bundler.script.path)} with the modules it imports inlined ({inlined})",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
