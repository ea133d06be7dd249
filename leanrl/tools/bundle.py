"""Make one standalone file of a training script: the project modules it imports inlined above its own text.

    python leanrl/tools/bundle.py leanrl/ppo_continuous_action.py -o my_ppo.py
    python leanrl/tools/bundle.py leanrl/ppo_continuous_action.py > my_ppo.py
    python leanrl/tools/bundle.py ppo_continuous_action.py -o my_ppo.py   # a bare name: leanrl/'s script

The modules are those of the script's folder (leanrl/: the harness package, the GPU env modules, any other module
or package there) that the script imports, found in its import statements and in theirs, recursively. Each comes
once, after the modules it imports, under a line naming its file; the script's own text follows, whole. The
statements that import project modules are left out (`import module as name` becomes a namespace of the module's
names under that name); everything else is kept as written. A top-level name that two of the files bind to
different things would make the one file wrong: the tool refuses, naming the name and the files. Exit code 2 with
one `error:` line for bad input; a file already at the output path is never overwritten without --force.

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

    def namespace(self, module, emitted, column, indent):
        """`types.SimpleNamespace(...)` of a module's names and of its submodules inlined so far, as it reads from
        `column` on, in a statement indented by `indent`."""
        names = [n for n in module.bindings if not n.startswith("__")]
        parts = [f"{n}={n}" for n in names]
        for sub in emitted:
            parent, _, short = sub.name.rpartition(".")
            if parent == module.name and short not in names:
                parts.append(f"{short}={self.namespace(sub, emitted, indent + 5 + len(short), indent + 4)}")
        return wrap("types.SimpleNamespace(", parts, ")", column, indent)

    def text(self, module, emitted):
        """The module's source without its project imports (and, for a module, its __all__ and future imports)."""
        lines = module.source.splitlines()
        dropped = [(node, body, project) for node, body, project, _ in module.imports]
        if module is not self.script:
            dropped += [(node, module.tree.body, []) for node in module.tree.body if is_all(node)]
        dropped += [(node, module.tree.body, []) for node in module.tree.body if is_future(node)]
        removed = {id(node) for node, _, _ in dropped}
        replace = {}  # first line index -> (last line index, replacement lines)
        if module is self.script and module.source.startswith("#!"):
            replace[0] = (0, [])  # the bundle's first line
        if module is self.script and ast.get_docstring(module.tree, clean=False) is not None:
            # No longer the file's first statement: set as the bundle's __doc__, which is the script's.
            line, column = module.tree.body[0].lineno - 1, module.tree.body[0].col_offset
            lines[line] = f"{lines[line][:column]}__doc__ = {lines[line][column:]}"
        for node, body, project in dropped:
            span = {node.lineno, node.end_lineno}
            if any(n is not node and {n.lineno, n.end_lineno} & span for n in body) or lines[node.lineno - 1][
                    : node.col_offset].strip():  # fmt: skip
                raise BundleError(f"{self.shown(module.path)}:{node.lineno}: put this import on a line of its own")
            new = self.replacement(node, project, emitted)
            if not new and node is body[0] and body is not module.tree.body and all(id(n) in removed for n in body):
                new = [" " * node.col_offset + "pass"]  # a block of nothing but project imports
            replace[node.lineno - 1] = (node.end_lineno - 1, new)
        out, i = [], 0
        while i < len(lines):
            if i not in replace:
                out.append(lines[i])
                i += 1
                continue
            last, new = replace[i]
            out += new
            i = last + 1
            if not new and out and not out[-1].strip() and i < len(lines) and not lines[i].strip():
                i += 1  # a blank line before and after what was removed: one is enough
        text = re.sub(r"\n{4,}", "\n\n\n", "\n".join(out).strip("\n"))
        return text + "\n"

    def replacement(self, node, project, emitted):
        """The lines that stand for a project import: a namespace for a module, `alias = name` for a renamed name."""
        indent, new = " " * node.col_offset, []
        for alias, binding in project:
            column = node.col_offset + len(alias) + 3
            if binding[0] == "from" and (binding[2] in binding[1].bindings or binding[3] is None):
                new += [f"{indent}{alias} = {binding[2]}"] if alias != binding[2] else []
            elif binding[0] != "star":  # a module, or a submodule named in `from package import`
                module = binding[1] if binding[0] == "module" else binding[3]
                new.append(f"{indent}{alias} = {self.namespace(module, emitted, column, node.col_offset)}")
        return "\n".join(new).splitlines()

    def write(self, output):
        """The bundle's text; output: the file it goes to, or None for stdout."""
        self.sort()
        self.bindings()
        self.check()
        name, shebang = output.name if output else "<bundle>.py", self.script.source.startswith("#!")
        header = [self.script.source.splitlines()[0]] if shebang else []
        header += wrap_comment(f"{name}: {self.shown(self.script.path)} made standalone by leanrl/tools/bundle.py. The "
                               "project modules it imports come first, each under a `# ---- <file>` line; the script "
                               f"follows, whole but for its imports of them. Run it as the script: python {name}")
        future = sorted(self.script.future)
        if future:
            header.append(f"from __future__ import {', '.join(future)}")
        if self.uses_namespaces():
            header.append("import types  # the namespaces of `import module`")
        parts, emitted = ["\n".join(header) + "\n"], []
        for module in self.order:
            parts.append(f"# ---- {self.shown(module.path)}\n" + self.text(module, emitted))
            emitted.append(module)
        parts.append(f"# ---- {self.shown(self.script.path)}: the script\n" + self.text(self.script, emitted))
        bundle = "\n\n".join(parts)
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


def main(argv=None):
    parser = argparse.ArgumentParser(
        description="Write one standalone file of a training script: the project modules it imports (the harness, "
        "the GPU env modules, any module or package of its folder) inlined above its own text. The file runs alone, "
        "copied anywhere, with the script's flags and output.",
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
    script, output = args.script, args.output and Path(args.output)
    collection_script = Path(__file__).resolve().parent.parent / f"{script.stem}.py"
    if not script.exists() and script.parent == Path() and script.suffix in ("", ".py") and collection_script.is_file():
        script = collection_script  # a bare name, from any folder: the collection's script of that name
    if not script.is_file():
        fail(f"{script}: no such script" if not script.exists() else f"{script} is not a file")
    if script.suffix != ".py":
        fail(f"{script}: a training script is a .py file")
    if output is None:
        try:
            bundler = Bundler(script.resolve())
            sys.stdout.write(bundler.write(None))
        except BundleError as e:
            fail(str(e))
        return 0
    if output.is_dir() or args.output.endswith(os.sep):  # into a folder, under the script's own name
        output = output / script.name
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
