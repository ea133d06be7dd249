"""leanrl/tools/bundle.py: every training script's bundle, alone in an empty folder, runs as the script does (the same
--help, and a tiny CPU run whose speed record names the bundle); its layout, algorithm first (Args near the top, each
import once, the modules pruned to what the script reaches, a single-process script's without torchrun's functions);
the import forms it inlines and what it moves before the script, on made-up projects; what it refuses (a name bound
twice, a circular import, bad -o), with one error line and no file written or overwritten."""

import ast
import io
import json
import os
import subprocess
import sys
import traceback
from concurrent.futures import ThreadPoolExecutor
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
from helpers import MODULES, ROOT, SCRIPTS, assert_one_line_error, load_script

TOOL = load_script("tools/bundle")
TOOL_PATH = ROOT / "leanrl" / "tools" / "bundle.py"
NAMES = sorted(path.stem for path in SCRIPTS.glob("*.py") if path.stem not in MODULES)
# Each script's tiny CPU run, whole iterations that update the networks at least once: its flags and its env steps.
OFF_POLICY = ["--env-id", "Pendulum-v1", "--learning-starts", "40", "--batch-size", "16", "--buffer-size", "1000",
              "--total-timesteps", "80"]  # fmt: skip
GPU_OFF_POLICY = ["--env-id", "Hopper-v5", "--num-envs", "4", "--batch-size", "16", "--buffer-size", "400",
                  "--learning-starts", "40", "--total-timesteps", "48", "--critic-hidden-dim", "32",
                  "--actor-hidden-dim", "16"]  # fmt: skip
PPO_SIZES = ["--num-envs", "2", "--num-steps", "16", "--num-minibatches", "2", "--update-epochs", "1"]
TINY = {
    "dqn": (["--learning-starts", "100", "--train-frequency", "10", "--batch-size", "16", "--buffer-size", "1000",
             "--total-timesteps", "120"], 120),  # fmt: skip
    "ppo_atari_envpool": ([*PPO_SIZES, "--total-timesteps", "32"], 32),
    "ppo_classic_control_gpu": ([*PPO_SIZES, "--total-timesteps", "32"], 32),
    "ppo_continuous_action": (["--env-id", "Pendulum-v1", *PPO_SIZES, "--total-timesteps", "32"], 32),
    "ppo_continuous_action_gpu_mujoco": ([*PPO_SIZES, "--total-timesteps", "32"], 32),
    "pqn_atari_envpool": ([*PPO_SIZES, "--total-timesteps", "32"], 32),
    "pqn_classic_control_gpu": ([*PPO_SIZES, "--total-timesteps", "32"], 32),
    "sac_continuous_action": (OFF_POLICY, 80),
    "sac_gpu_mujoco": (GPU_OFF_POLICY, 48),
    "td3_continuous_action": (OFF_POLICY, 80),
    "td3_gpu_mujoco": (GPU_OFF_POLICY, 48),
}
TINY |= {f"{name}_torchcompile": run for name, run in TINY.items()}
# Runs at a time: each is one CPU thread (--torch-threads 1) but for its start, importing torch.
WORKERS = max(2, os.cpu_count() or 1)
# Scripts that run in one process (no torchrun): their bundles carry none of the harness's torchrun functions.
SINGLE_PROCESS = ["dqn", "ppo_continuous_action", "sac_continuous_action", "td3_continuous_action"]
ARGS_WITHIN = 80  # the line `class Args` is on at most
# Printed on stdout and stderr between a bundle's --help and its tiny run (HELP_THEN_RUN).
SEPARATOR = "---- the bundle's --help ended here; its tiny run follows ----"
# `python -c HELP_THEN_RUN BUNDLE ARGV...`: the bundle's --help, then its run with ARGV, each as `python BUNDLE` runs
# it (sys.argv[0] the bundle's name, which runpy.run_path would make its path; __file__ its path; its folder first on
# sys.path; a fresh __main__; the process's own stdout, whose kind tyro's help follows), in one process: torch and the
# rest imported once for both. A --help that fails ends the process as it would end its own, before the run.
HELP_THEN_RUN = f"""
import os, sys, types

bundle, argv = sys.argv[1], sys.argv[2:]
path = os.path.abspath(bundle)
sys.path[0] = os.path.dirname(path)
code = compile(open(path, "rb").read(), path, "exec")


def run(*args):
    sys.argv = [bundle, *args]
    sys.modules["__main__"] = main = types.ModuleType("__main__")
    main.__file__ = path
    exec(code, vars(main))


try:
    run("--help")
except SystemExit as stop:
    if stop.code not in (None, 0):
        raise
for stream in (sys.stdout, sys.stderr):
    print({SEPARATOR!r}, file=stream, flush=True)
run(*argv)
"""


def bundle_name(name):
    return f"my_{name}"  # another name than the script's: the record must carry the bundle's


def run_alone(bundle, argv, driver=None):
    """Run a bundle from its own folder, where nothing else is, with no path to the project's modules (with a driver,
    `python -c DRIVER BUNDLE ARGV...`)."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    command = [sys.executable, *(["-c", driver] if driver else []), bundle.name, *argv]
    return subprocess.run(command, cwd=bundle.parent, env=env, capture_output=True, text=True, timeout=600)


def help_then_tiny_run(bundle, argv):
    """The bundle's --help, then its tiny run with argv, as run_alone runs each but in one process (HELP_THEN_RUN):
    (help, tiny run), each as subprocess.run returns it; no tiny run (None) where argv is None or the --help failed."""
    if argv is None:
        return run_alone(bundle, ["--help"]), None
    proc = run_alone(bundle, argv, HELP_THEN_RUN)
    if SEPARATOR + "\n" not in proc.stdout:
        return proc, None
    out, err = proc.stdout.partition(SEPARATOR + "\n"), proc.stderr.partition(SEPARATOR + "\n")
    return (subprocess.CompletedProcess(proc.args, 0, out[0], err[0]),
            subprocess.CompletedProcess(proc.args, proc.returncode, out[2], err[2]))  # fmt: skip


def script_help(name):
    """The script's own --help as its user gets it, `python NAME.py --help` from leanrl/ with the output captured, but
    run in this process, where the modules it imports load once for all the scripts: sys.argv[0] its name, __file__
    its path, leanrl/ first on sys.path, a fresh __main__; stdout as a pipe is, no terminal, of the encoding a new
    process's has (tyro's boxes, colours and width follow it). As subprocess.run returns it."""
    path = SCRIPTS / f"{name}.py"
    main, out, err = ModuleType("__main__"), io.TextIOWrapper(io.BytesIO(), sys.__stdout__.encoding), io.StringIO()
    main.__file__ = str(path)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "argv", [path.name, "--help"])
        patch.setattr(sys, "path", [str(SCRIPTS), *sys.path])
        patch.setattr(sys, "stdout", out)
        patch.setattr(sys, "__stdout__", out)  # shutil.get_terminal_size(), tyro's width, asks it
        patch.setattr(sys, "stderr", err)
        patch.setitem(sys.modules, "__main__", main)
        try:
            exec(compile(path.read_bytes(), str(path), "exec"), vars(main))
            code = 0
        except SystemExit as stop:
            code = stop.code or 0
        except Exception:  # a broken script: its test fails with the traceback, as from a process of its own
            traceback.print_exc()
            code = 1
    out.flush()
    stdout = out.buffer.getvalue().decode(out.encoding)
    return subprocess.CompletedProcess([path.name, "--help"], code, stdout, err.getvalue())


def bundle_text(name):
    with redirect_stdout(io.StringIO()) as out, redirect_stderr(io.StringIO()):
        TOOL.main([str(SCRIPTS / f"{name}.py")])
    return out.getvalue()


def top_level_definitions(text):
    """The names of a file's top-level functions and classes."""
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    return {node.name for node in ast.parse(text).body if isinstance(node, kinds)}


@pytest.fixture(scope="module")
def bundles(request, tmp_path_factory):
    """Every script that a selected test names bundled into a folder of its own, then its --help and its tiny run
    started in one process, all at once (WORKERS at a time, the slow MuJoCo Warp ones first), and meanwhile the
    script's own --help run in this process: {name: (error or None, future of (bundle's help, tiny run), script's
    help, the bundle's text)}."""
    selected = {item.callspec.params.get("name") for item in request.session.items if hasattr(item, "callspec")}
    pool, started = ThreadPoolExecutor(WORKERS), {}
    for name in sorted(set(NAMES) & selected, key=lambda name: ("gpu_mujoco" not in name, name)):
        bundle = tmp_path_factory.mktemp(name) / f"{bundle_name(name)}.py"
        try:
            with redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()) as err:
                TOOL.main([str(SCRIPTS / f"{name}.py"), "-o", str(bundle)])
        except SystemExit:  # the script is broken (at the moment): its tests fail with the tool's error
            started[name] = (err.getvalue(), None, None, None)
            continue
        argv = [*TINY[name][0], "--no-cuda", "--no-tensorboard"] if name in TINY else None
        runs = pool.submit(help_then_tiny_run, bundle, argv)
        started[name] = (None, runs, script_help(name), bundle.read_text())
    yield started
    pool.shutdown(cancel_futures=True)


@pytest.mark.parametrize("name", NAMES)
def test_bundle_help(name, bundles):
    """The bundle's --help, alone in an empty folder, is the script's, but for the name it goes by."""
    error, runs, script, _ = bundles[name]
    assert error is None, error
    proc = runs.result()[0]
    assert proc.returncode == 0, proc.stderr
    assert f"usage: {bundle_name(name)}.py" in proc.stdout and "--save-dir" in proc.stdout
    assert script.returncode == 0, script.stderr
    assert proc.stdout == script.stdout.replace(f"usage: {name}.py", f"usage: {bundle_name(name)}.py", 1)


@pytest.mark.parametrize("name", NAMES)
def test_bundle_reads_algorithm_first(name, bundles):
    """The header, one import block, then the script: its Args near the top; each outside import once, all of them in
    that block; no project import left; the script's `if __name__` block last."""
    error, _, _, text = bundles[name]
    assert error is None, error
    lines = text.splitlines()
    assert any(line.startswith("class Args") for line in lines[:ARGS_WITHIN]), f"class Args not within {ARGS_WITHIN}"
    tree = ast.parse(text)
    imports = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    first = next(i for i, node in enumerate(tree.body) if not isinstance(node, (ast.Import, ast.ImportFrom)))
    assert imports == tree.body[:first], "an import after the import block"
    plain = [(alias.name, alias.asname) for node in imports if isinstance(node, ast.Import) for alias in node.names]
    froms = [node.module for node in imports if isinstance(node, ast.ImportFrom)]
    assert len(plain) == len(set(plain)) and len(froms) == len(set(froms)), "an import twice"
    assert len({alias.asname or alias.name for node in imports for alias in node.names}) == sum(
        len(node.names) for node in imports)  # fmt: skip
    assert not {name.split(".")[0] for name, _ in plain} & set(MODULES) and not set(froms) & set(MODULES)
    assert text.count("\nimport os\n") == 1
    assert ast.unparse(tree.body[-1].test) == "__name__ == '__main__'"
    assert next(line for line in lines if line.startswith("# ---- ")) == f"# ---- leanrl/{name}.py: the script"
    assert text.index("\n# ---- Appendix: ") > text.index("\ndef main(")


@pytest.mark.parametrize("name", SINGLE_PROCESS)
def test_single_process_bundle_has_no_torchrun(name):
    """A script that runs in one process reaches none of the harness's torchrun functions and classes: its bundle has
    none (where one is kept, the message says through which names)."""
    torchrun = top_level_definitions((SCRIPTS / "harness/torchrun.py").read_text())
    bundler = TOOL.Bundler((SCRIPTS / f"{name}.py").resolve())
    text = bundler.write(None)
    left = sorted(torchrun & top_level_definitions(text))
    why = [" <- ".join(f"{label} [{read}]" if read else label for label, read in bundler.trace(unit))
           for module in bundler.order if module.name == "harness.torchrun"
           for unit in bundler.files[module]
           if unit in bundler.kept and unit.nodes and getattr(unit.nodes[0], "name", None) in left]
    assert not left, "torchrun functions kept: " + "; ".join(why)
    assert "# ---- leanrl/harness/torchrun.py" not in text and "import torch.distributed" not in text


@pytest.mark.parametrize("name", NAMES)
def test_bundle_tiny_run(name, bundles):
    assert name in TINY, f"{name}: a new script? give it a tiny run in TINY"
    error, runs, _, _ = bundles[name]
    assert error is None, error
    help_run, proc = runs.result()
    assert proc is not None, f"not run: the bundle's --help, run first, failed: {help_run.stderr}"
    assert proc.returncode == 0, proc.stderr
    record = json.loads(proc.stdout.strip().splitlines()[-1])
    assert record["script"] == bundle_name(name) and record["device"] == "cpu"
    assert record["total_timesteps"] == TINY[name][1]
    assert record["interrupted"] is record["diverged"] is False


# ---- the tool, on made-up projects


def write(folder, files):
    for path, text in files.items():
        (folder / path).parent.mkdir(parents=True, exist_ok=True)
        (folder / path).write_text(text)


def bundle_main(argv, capsys):
    """The tool's main() in this process, as bad input ends it: (exit code, stderr)."""
    with pytest.raises(SystemExit) as exit_info:
        TOOL.main([str(arg) for arg in argv])
    return SimpleNamespace(returncode=exit_info.value.code, stderr=capsys.readouterr().err)


# A package with relative imports and an __all__, a module that imports from it; a script that imports them in every
# form: `import m`, `import m as a`, `from package import name as alias, submodule`, `from package.sub import name`,
# and an import inside a function. The same outside import (sys) and constant (SCALE) bound in two files are one.
PROJECT = {
    "pkg/__init__.py": '"""A package."""\n\nfrom .core import add\nfrom .extra import SCALE\n\n'
                       '__all__ = ["add", "SCALE"]\n',
    "pkg/extra.py": "SCALE = 10\n",
    "pkg/core.py": "from .extra import SCALE\n\n\ndef add(a, b):\n    return (a + b) * SCALE\n",
    "envs_mod.py": '"""Envs."""\n\nimport sys\n\nfrom pkg import add\n\nOFFSET = 1\n\n\ndef thing(x):\n'
                   "    return add(x, OFFSET) + len(sys.argv)\n",
    "script.py": "# The script's own header.\nimport sys\n\nimport envs_mod\nimport envs_mod as em\n"
                 "from pkg import add as plus, core\nfrom pkg.extra import SCALE\n\nSCALE = 10\n\n\ndef main():\n"
                 "    from envs_mod import thing as lazy\n\n    print(envs_mod.thing(1), em.OFFSET, plus(1, 2), "
                 "core.add(0, 1), SCALE, lazy(2), sys.argv[1:])\n\n\n"
                 'if __name__ == "__main__":\n    main()\n',
}  # fmt: skip


def test_import_forms(tmp_path, capsys):
    write(tmp_path / "project", PROJECT)
    alone = tmp_path / "alone"
    alone.mkdir()
    TOOL.main([str(tmp_path / "project/script.py"), "-o", str(alone / "standalone.py")])
    out, err = capsys.readouterr()
    assert out == "" and "wrote" in err
    original = subprocess.run([sys.executable, "script.py", "x"], cwd=tmp_path / "project", capture_output=True,
                              text=True, check=True)  # fmt: skip
    bundled = run_alone(alone / "standalone.py", ["x"])
    assert bundled.returncode == 0, bundled.stderr
    assert bundled.stdout == original.stdout == "22 1 30 10 10 32 ['x']\n"
    text = (alone / "standalone.py").read_text()
    # The imports; the script, its header comment kept; the modules, each after those it imports, under its line (the
    # package's __init__, only imports, has nothing left); the names the script imports as its own; its main block.
    heads = [line for line in text.splitlines() if line.startswith("# ---- ")]
    appendix = "# ---- Appendix: the project modules this script imports (project/pkg/, project/envs_mod.py), pruned"
    assert heads == ["# ---- project/script.py: the script", f"{appendix} to what it uses",
                     "# ---- project/pkg/extra.py", "# ---- project/pkg/core.py", "# ---- project/envs_mod.py",
                     "# ---- project/script.py: its imports of the project's modules, bound after what they name"]
    assert text.index("import sys\nimport types") < text.index("# The script's own header.\n") < text.index("def main")
    assert text.count("import sys") == 1 and "__all__" not in text and text.endswith('__main__":\n    main()\n')
    # A namespace carries the names read of it.
    assert "envs_mod = types.SimpleNamespace(thing=thing)\nem = types.SimpleNamespace(OFFSET=OFFSET)\n" in text


# A script whose top-level statements read names of the modules as they run (a base class through a namespace, a
# decorator, a default value, a value assigned): those, with what they read, come before it; what it never reaches
# (a function, an import, a renamed name) is left out; a module's statement run for its effect is kept; an import that
# follows such a statement stays after it.
PRELUDE_PROJECT = {
    "pkg/__init__.py": "",
    "pkg/base.py": '"""Bases."""\nimport math\nimport os\n\nSTATE = []\nSTATE.append("loaded")\nimport json\n\n\n'
                   "def helper():\n    return math.pi\n\n\ndef unused():\n    return os.sep\n\n\nclass Base:\n"
                   "    LIMIT = 3\n\n    def value(self):\n        return helper()\n\n\ndef register(cls):\n"
                   "    cls.registered = json.dumps(STATE)\n    return cls\n",
    "pkg/mid.py": "import pkg.base as pb\nfrom pkg.base import register as reg\n\n\nclass Mid(pb.Base):\n"
                  "    def more(self):\n        return pb.helper() + 1\n",
    "script.py": '#!/usr/bin/env python\n"""Doc."""\nimport dataclasses\n\nfrom pkg.base import Base, register\n'
                 "from pkg import mid as M\nfrom pkg.mid import Mid as Middle\n\n\n@register\n@dataclasses.dataclass\n"
                 "class Args(M.Mid):\n    x: int = Base.LIMIT\n\n\ndef main(y=Middle.LIMIT):\n"
                 "    print(__doc__, Args().x, Args.registered, round(Args().more(), 2), y)\n\n\n"
                 'if __name__ == "__main__":\n    main()\n',
}  # fmt: skip


def test_prelude_and_pruning(tmp_path, capsys):
    write(tmp_path / "project", PRELUDE_PROJECT)
    (tmp_path / "alone").mkdir()
    TOOL.main([str(tmp_path / "project/script.py"), "-o", str(tmp_path / "alone/standalone.py")])
    capsys.readouterr()
    original = subprocess.run([sys.executable, "script.py"], cwd=tmp_path / "project", capture_output=True, text=True,
                              check=True)  # fmt: skip
    bundled = run_alone(tmp_path / "alone/standalone.py", [])
    assert bundled.returncode == 0, bundled.stderr
    assert bundled.stdout == original.stdout == 'Doc. 3 ["loaded"] 4.14 3\n'
    text = (tmp_path / "alone/standalone.py").read_text()
    assert text.startswith("#!/usr/bin/env python\n# standalone.py: ")
    assert "def unused" not in text and "reg = " not in text and "import os" not in text
    assert text.index("# ---- The prelude") < text.index("class Base:") < text.index("M = types.SimpleNamespace(Mid=")
    assert text.index("M = types") < text.index("Middle = Mid") < text.index("# ---- project/script.py: the script")
    assert text.index('STATE.append("loaded")\nimport json\n') < text.index("def register")
    assert "pb = types.SimpleNamespace(helper=helper, Base=Base)" in text
    assert "Appendix" not in text  # all the script reads, it reads as it runs


def test_without_output_the_bundle_goes_to_stdout(tmp_path):
    """`bundle.py SCRIPT > my.py`, from any folder: the bundle alone on stdout, and it runs alone."""
    alone = tmp_path / "alone"
    alone.mkdir()
    with open(alone / "my_sac.py", "w") as f:
        proc = subprocess.run([sys.executable, str(SCRIPTS / "tools/bundle.py"), "sac_continuous_action.py"],
                              cwd=SCRIPTS, stdout=f, stderr=subprocess.PIPE, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert not (tmp_path / "sac_continuous_action.py").exists()
    help_run = run_alone(alone / "my_sac.py", ["--help"])
    assert help_run.returncode == 0 and "usage: my_sac.py" in help_run.stdout, help_run.stderr
    # The bare name from another folder (the repository's root, here an empty one) finds the collection's script.
    for bare in ("sac_continuous_action.py", "sac_continuous_action"):
        proc = subprocess.run([sys.executable, str(SCRIPTS / "tools/bundle.py"), bare], cwd=alone, capture_output=True,
                              text=True, timeout=120)  # fmt: skip
        assert proc.returncode == 0 and proc.stdout == (alone / "my_sac.py").read_text(), proc.stderr


def test_docstring_future_and_blocks(tmp_path, capsys):
    """The script's shebang stays the first line and its docstring its __doc__; the future imports every file shares
    come first; a block of nothing but project imports keeps a statement."""
    write(tmp_path, {"m.py": "from __future__ import annotations\n\nX: int = 1\n",
                     "script.py": '#!/usr/bin/env python\n"""Doc."""\n\nfrom __future__ import annotations\n\n'
                                  "if True:\n    from m import X\n\nprint(__doc__, X)\n"})  # fmt: skip
    TOOL.main([str(tmp_path / "script.py"), "-o", str(tmp_path / "standalone.py")])
    capsys.readouterr()
    text = (tmp_path / "standalone.py").read_text()
    assert text.startswith("#!/usr/bin/env python\n# standalone.py: ")
    assert "\nfrom __future__ import annotations\n" in text and "    pass\n" in text
    (tmp_path / "alone").mkdir()
    (tmp_path / "alone/standalone.py").write_text(text)
    assert run_alone(tmp_path / "alone/standalone.py", []).stdout == "Doc. 1\n"
    write(tmp_path, {"m.py": "X = 1\n"})
    proc = bundle_main([tmp_path / "script.py", "-o", tmp_path / "other.py"], capsys)
    assert_one_line_error(proc, "`from __future__` imports differ", "m.py: none", "script.py: annotations")


def test_help_says_that_the_output_names_the_script(capsys):
    with pytest.raises(SystemExit):
        TOOL.main(["--help"])
    assert "names the script" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize(
    "files, fragments",
    [
        ({"helpers_mod.py": "def helper():\n    return 1\n",
          "script.py": "from helpers_mod import helper\n\n\ndef helper():\n    return 2\n"},
         ["name collision: helper", "helpers_mod.py", "script.py"]),
        ({"a.py": "import numpy as xp\n", "script.py": "import a\nimport math as xp\n"},
         ["name collision: xp", "a.py", "script.py"]),
        ({"a.py": "id = 3\n", "script.py": "import a\n\nprint(id(a))\n"},
         ["name collision", "a.py binds id", "builtin id", "script.py"]),
        ({"a.py": "import b\n", "b.py": "import a\n", "script.py": "import a\n"}, ["circular import", "a.py", "b.py"]),
        ({"a.py": "X = 1\n", "script.py": "from a import Y\n"}, ["script.py:1", "a has no name Y"]),
        ({"a.py": "print(__file__)\n", "script.py": "import a\n"}, ["a.py:1", "__file__"]),
        ({"script.py": "def broken(:\n"}, ["script.py:1"]),
        ({"script.py": '"""Doc."""\nimport math\n\nX = 1\n\ntry:\n    import numpy\nexcept ImportError:\n    numpy = None\n'},
         ["script.py defines names and runs nothing", "not a training script"]),
    ],
    ids=["def", "import", "builtin", "circular", "missing-name", "module-file", "syntax", "module"],
)
def test_refused_bundles(tmp_path, capsys, files, fragments):
    write(tmp_path, files)
    proc = bundle_main([tmp_path / "script.py", "-o", tmp_path / "out.py"], capsys)
    assert_one_line_error(proc, *fragments)
    assert not (tmp_path / "out.py").exists()


def test_the_collections_modules_are_refused(tmp_path, capsys):
    """A module the scripts import, in a package or beside them, or a package's __init__, is not a training script: no
    file written. The scripts themselves, in the package leanrl (for `python -m leanrl.dqn`), are."""
    for module, fragment in (("harness/run.py", "a module of the package harness"),
                             ("mujoco_warp_envs.py", "defines names and runs nothing"),
                             ("__init__.py", "sets up the package leanrl")):  # fmt: skip
        proc = bundle_main([ROOT / "leanrl" / module, "-o", tmp_path / "out.py"], capsys)
        assert_one_line_error(proc, fragment, "not a training script")
        assert not (tmp_path / "out.py").exists()


def test_stdout_full_or_closed(tmp_path):
    """The bundle to stdout that cannot take it (a full disk, a closed stdout): one line, exit code 2."""
    script = tmp_path / "script.py"
    script.write_text("print(1)\n")
    for redirect in ("> /dev/full", ">&-"):
        proc = subprocess.run(["bash", "-c", f"{sys.executable} {TOOL_PATH} {script} {redirect}"], capture_output=True,
                              text=True)  # fmt: skip
        assert_one_line_error(proc, "stdout")


def test_bad_output(tmp_path, capsys, monkeypatch):
    write(tmp_path, {"script.py": "print(1)\n", "mine.py": "the user's\n", "a_file": ""})
    script = tmp_path / "script.py"
    assert_one_line_error(bundle_main([tmp_path / "nothing.py", "-o", tmp_path / "o.py"], capsys), "no such script")
    assert_one_line_error(bundle_main([script, "-o", tmp_path / "mine.py"], capsys), "mine.py exists", "--force")
    assert_one_line_error(bundle_main([script, "-o", ""], capsys), "-o '': an empty name")
    assert (tmp_path / "mine.py").read_text() == "the user's\n"
    assert_one_line_error(bundle_main([script, "-o", script, "--force"], capsys), "one of the files bundled")
    assert script.read_text() == "print(1)\n"
    assert TOOL.main([str(script), "-o", str(tmp_path / "new/folder/o.py")]) == 0  # made, as --save-dir is
    assert "print(1)" in (tmp_path / "new/folder/o.py").read_text()
    assert_one_line_error(bundle_main([script, "-o", tmp_path / "a_file/o.py"], capsys), "cannot be made")
    assert (tmp_path / "a_file").read_text() == ""
    # A folder, as cp takes one: the script's own name in it; here that is the script itself, which stays as it was.
    assert_one_line_error(bundle_main([script, "-o", tmp_path], capsys), "script.py exists", "--force")
    assert script.read_text() == "print(1)\n"
    (tmp_path / "empty").mkdir()
    for folder in (str(tmp_path / "empty"), str(tmp_path / "not_yet") + os.sep):
        assert TOOL.main([str(script), "-o", folder]) == 0
        assert "print(1)" in (Path(folder) / "script.py").read_text()
    # Nothing that is not a regular file is replaced: a device, a link (to nothing, or a loop).
    os.symlink("nowhere/deep", tmp_path / "dangling")
    os.symlink(tmp_path / "loop", tmp_path / "loop")
    assert_one_line_error(bundle_main([script, "-o", "/dev/null", "--force"], capsys), "is not a regular file")
    for link in ("dangling", "loop"):
        assert_one_line_error(bundle_main([script, "-o", tmp_path / link], capsys), "is a symbolic link")
    assert os.path.islink(tmp_path / "dangling") and not (tmp_path / "nowhere").exists()
    # A new name without .py is a file, as cp writes one: python runs any file.
    assert TOOL.main([str(script), "-o", str(tmp_path / "standalone")]) == 0
    assert run_alone(tmp_path / "standalone", []).stdout == "1\n"

    def unwritable(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    # A folder that refuses the new file (as root, chmod would not stop it).
    monkeypatch.setattr(TOOL, "tempfile", SimpleNamespace(NamedTemporaryFile=unwritable))
    assert_one_line_error(bundle_main([script, "-o", tmp_path / "mine.py", "--force"], capsys), "cannot be written",
                          "Permission denied")  # fmt: skip
    assert (tmp_path / "mine.py").read_text() == "the user's\n"
    monkeypatch.undo()
    TOOL.main([str(script), "-o", str(tmp_path / "mine.py"), "--force"])
    assert "print(1)" in (tmp_path / "mine.py").read_text()
