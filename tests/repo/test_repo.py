"""The repository keeps its promises: CI runs the README's test command, lint is clean,
modules stay small, imports point one way between the package's layers."""

import ast
import pathlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _readme_commands():
    block = re.search(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    return [line for line in block.splitlines() if line and not line.startswith("#")]


def test_readme_top_shows_two_commands_and_ci_runs_the_test_one():
    main_job, tests = _readme_commands()
    assert "flatshard train" in main_job and "pytest" in tests
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert tests in ci, f"{tests!r} is not a line of .ci/run"


def test_lint_and_format_are_clean():
    paths = ["src", "tests", "benchmarks", "examples"]
    check = subprocess.run(
        [sys.executable, "-m", "ruff", "check", *paths], cwd=ROOT, capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr
    fmt = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", *paths], cwd=ROOT, capture_output=True, text=True
    )
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr


def test_no_module_over_600_lines():
    long = {p.name: n for p in (ROOT / "src").rglob("*.py") if (n := len(p.read_text().splitlines())) > 600}
    assert not long, f"split these by concept: {long}"


def test_only_the_stage_policy_compares_the_stage_number():
    """[Note: stage policy]: what a stage means lives in flatshard/planner/stage.py alone; elsewhere
    code asks the policy (``policy.shards_grads``), never ``stage == 3`` or ``stage > 0``."""
    compare = re.compile(r"\bstage\s*(==|!=|<=|>=|<|>)\s*\d|\bstage\s+(not\s+)?in\s*[(\[{]")
    found = [
        f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
        for p in (ROOT / "src").rglob("*.py")
        if p.name != "stage.py"
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if compare.search(line.split("#")[0]) and not line.lstrip().startswith(('f"', '"', "'"))
    ]
    assert not found, "ask StagePolicy instead:\n" + "\n".join(found)


# [Note: package layers] in flatshard/__init__.py, lowest first. A module's layer is that of
# the longest prefix of its dotted name listed here.
LAYERS = [
    ["flatshard.errors", "flatshard.planner", "flatshard.toolkit.malloc"],
    ["flatshard.comm"],
    ["flatshard.engine"],
    ["flatshard.units"],
    ["flatshard.wrap"],
    ["flatshard.optim"],
    ["flatshard.checkpoint"],
    ["flatshard", "flatshard.memory", "flatshard.phases"],
    ["flatshard.app", "flatshard.toolkit", "flatshard.hosts", "flatshard.__main__"],
]


def _layer(module: str) -> int:
    best = max((p for layer in LAYERS for p in layer if module == p or module.startswith(p + ".")), key=len)
    return next(i for i, layer in enumerate(LAYERS) if best in layer)


def _imports(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, imported flatshard module) for every import in the file, function-local ones too."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "flatshard"]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "flatshard":
            for a in node.names:  # "from flatshard.app import launcher" imports flatshard.app.launcher
                sub = f"{node.module}.{a.name}"
                out.append((node.lineno, sub if _is_module(sub) else node.module))
    return out


def _is_module(dotted: str) -> bool:
    base = ROOT / "src" / pathlib.Path(*dotted.split("."))
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def _modules():
    for p in sorted((ROOT / "src" / "flatshard").rglob("*.py")):
        parts = p.relative_to(ROOT / "src").with_suffix("").parts
        yield p, ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_import_flatshard_leaves_the_checkpoint_modules_to_their_first_use():
    """``torch.distributed.checkpoint`` (with DTensor) was a third of ``import flatshard``,
    paid by every ``python -m flatshard`` and every rank that never saves."""
    code = (
        "import sys, flatshard; assert 'torch.distributed.checkpoint' not in sys.modules; "
        "assert callable(flatshard.save_checkpoint); assert 'torch.distributed.checkpoint' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


RETIRED_WORDS = {
    r"\bBucketGroup\b|\bbucket groups?\b": "a Reduction (a buffer's buckets reduced by one collective)",
    r"\blaunch units?\b": "a launch",
    r"\bper_group\b|\bbuckets_per_group\b": "Buckets(per_launch=...)",
    r"\bExpertGroup\b": "Experts",
    r"\bUnitOptions\b|\bunit_options\b": "Stage3",
    r"\bflatshard\.stage3\b|(?<![\w.])stage3/": "the stage-3 layer, flatshard/units/",
    r"\bwhole on every rank": "replicated",
    r"\bapp/launch\.py|\bapp\.launch\b|\bapp import launch$": "the launcher, app/launcher.py",
}


@pytest.mark.parametrize("retired", sorted(RETIRED_WORDS))
def test_each_concept_has_one_name(retired):
    """The glossary of docs/concepts.md ("One word, one meaning"): each of these once named a
    second concept, or the same concept under a second name."""
    paths = [*(ROOT / "src").rglob("*.py"), *(ROOT / "docs").rglob("*.md"), ROOT / "README.md"]
    paths += [p for p in (ROOT / "tests").rglob("*.py") if p.name != "test_repo.py"]
    found = [
        f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
        for p in paths
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if re.search(retired, line) and "(retired spellings)" not in line
    ]
    assert not found, f"say {RETIRED_WORDS[retired]}:\n" + "\n".join(found)


def test_hybrid_names_only_the_host_device_optimizer():
    """One meaning per word (docs/concepts.md): a 2-D mesh is "replicated sharding"."""
    paths = [*(ROOT / "src").rglob("*.py"), *(ROOT / "docs").rglob("*.md"), ROOT / "README.md"]
    found = [
        f"{p.relative_to(ROOT)}" for p in paths if re.search(r"hybrid[ -_]?(shard|mesh)", p.read_text(), re.I)
    ]
    assert not found, found


def test_imports_point_down_the_layers():
    """No module imports from a layer above its own, so the folder tree is the dependency
    picture (e.g. the engine never reaches into stage 3 or the optimizers)."""
    upward = [
        f"{p.relative_to(ROOT)}:{line}: {module} (layer {_layer(module)}) imports {target} "
        f"(layer {_layer(target)})"
        for p, module in _modules()
        for line, target in _imports(p)
        if _layer(target) > _layer(module)
    ]
    assert not upward, "imports that point up the layers:\n" + "\n".join(upward)


def _docstring(path: pathlib.Path) -> str:
    return ast.get_docstring(ast.parse(path.read_text())) or ""


def _packages() -> list[tuple[str, pathlib.Path]]:
    return [
        (f"flatshard.{p.parent.name}", p.parent)
        for p in sorted((ROOT / "src" / "flatshard").glob("*/__init__.py"))
    ]


def test_each_package_docstring_names_its_layer_and_its_modules_and_no_others():
    """The package map has one source, ``LAYERS`` above and the files themselves: each
    package's docstring opens with its layer's number and names each of its modules as
    ``module``, and no module of another package as if it were its own."""
    everywhere = {p.stem for p in (ROOT / "src" / "flatshard").rglob("*.py")} | {
        n.split(".")[-1] for n, _ in _packages()
    }
    wrong = []
    for name, folder in _packages():
        doc = _docstring(folder / "__init__.py")
        opening = re.match(r"Layer (\d+)", doc)
        if opening is None or int(opening.group(1)) != _layer(name):
            wrong.append(f"{name}: opens with {doc[:12]!r}, its layer is {_layer(name)}")
        mine = {p.stem for p in folder.glob("*.py")} - {"__init__"} | {
            p.parent.name for p in folder.glob("*/__init__.py")
        }
        named = set(re.findall(r"``(\w+)``", doc))
        wrong += [f"{name}: does not name its module {m!r}" for m in sorted(mine - named)]
        wrong += [
            f"{name}: names {m!r}, a module of another package" for m in sorted((named & everywhere) - mine)
        ]
    assert not wrong, "\n".join(wrong)


def test_the_layer_note_and_the_design_page_follow_layers():
    """[Note: package layers] lists each layer's packages under its number, and
    docs/design.md has a section per layer naming its folder."""
    init = (ROOT / "src" / "flatshard" / "__init__.py").read_text().splitlines()
    note = "\n".join(line[2:] if line.startswith("# ") else line.lstrip("#") for line in init)
    design = (ROOT / "docs" / "design.md").read_text()
    wrong = []
    for number, layer in enumerate(LAYERS):
        folders = [
            p.split(".")[1]
            for p in layer
            if p.count(".") == 1 and (ROOT / "src" / Path(*p.split("."))).is_dir()
        ]
        item = re.search(rf"^{number}\. (.*?)(?=^\d+\. |\n\n)", note, re.M | re.S)
        if item is None:
            wrong.append(f"[Note: package layers] has no item {number}.")
            continue
        wrong += [f"item {number}. does not name {f}/" for f in folders if f"``{f}/``" not in item.group(1)]
        heading = re.search(rf"^## Layer {number}\b.*$", design, re.M)
        if (
            folders
            and number < 8
            and (heading is None or not all(f"`{f}/`" in heading.group(0) for f in folders))
        ):
            wrong.append(f"docs/design.md: no '## Layer {number}' heading naming {folders}")
    assert not wrong, "\n".join(wrong)


CITED = re.compile(r"(?<![\w/.-])((?:[a-z_]+/)+[a-z_0-9]+\.(?:py|md))\b")


def test_every_file_a_docstring_or_page_cites_exists():
    """``engine/buffer.py``, ``tests/_parity.py``, ``docs/cli.md``: a path a comment or a
    page cites is a file of this repository (relative to src/flatshard, the repository or the
    docs), and nothing cites outside the repository or an issue number."""
    paths = [*(ROOT / "src").rglob("*.py"), *(ROOT / "docs").rglob("*.md"), ROOT / "README.md"]
    roots = [ROOT / "src" / "flatshard", ROOT, ROOT / "docs", ROOT / "src"]
    missing = [
        f"{p.relative_to(ROOT)}: {cited}"
        for p in paths
        for cited in CITED.findall(p.read_text())
        if not any((r / cited).exists() for r in roots) and not cited.startswith(("site-packages/", "torch/"))
    ]
    outside = [
        f"{p.relative_to(ROOT)}: {m.group(0)}"
        for p in paths
        for m in re.finditer(r"\.\./shared/\S+|\bissue \d+\b", p.read_text())
    ]
    assert not missing, "cited but not in the repository:\n" + "\n".join(missing)
    assert not outside, "cites outside the repository:\n" + "\n".join(outside)


def test_module_docstrings_say_what_the_module_is_for_in_a_few_lines():
    """The reasoning lives in the design notes below a docstring, not in it."""
    long = [
        f"{path.relative_to(ROOT)}: {len(_docstring(path).splitlines())} lines"
        for path, _ in _modules()
        if len(_docstring(path).splitlines()) > 20
    ]
    assert not long, "\n".join(long)


def test_every_module_has_a_layer():
    for _, module in _modules():
        assert _layer(module) >= 0
    assert _layer("flatshard.engine.buffer") < _layer("flatshard.units.unshard") < _layer("flatshard.app.cli")


# torch's own private members that flatshard has to use (no public equivalent)
TORCH_PRIVATE = {
    "_parameters",
    "_modules",
    "_buffers",
    "_non_persistent_buffers_set",
    "_orig_mod",
    "_get_backend",
    "_replace",
    # ProcessGroup's single-tensor gather and reduce-scatter: the only spelling of them that
    # takes per-op options, which carry the deadline ([Note: deadlines])
    "_allgather_base",
    "_reduce_scatter_base",
    # a tensor's version counter: how in-place writes through a param are seen ([Note: writes
    # through the params])
    "_version",
    # a DTensor's local shard: binding it to a flat buffer's view has no public spelling
    # (FSDP2 assigns it the same way; [Note: tensor-parallel params])
    "_local_tensor",
    # a module's call with its hooks: what a module holding DTensor params runs as one eager
    # piece under torch.compile (``nn.Module.compile()`` wraps the same; [Note: hooks and
    # torch.compile])
    "_call_impl",
    # a param's post-accumulate-grad hooks: whether a user registered one after flatshard's,
    # whose grad flatshard then takes after them (the public API only registers)
    "_post_accumulate_grad_hooks",
}
# transformers' per-module initializer: its public init_weights() re-initializes the whole
# model, where a meta model is initialized one unit at a time ([Note: default init])
# accelerate's process-wide state: the test harness's reused ranks retire once it is set
# ([Note: reused ranks])
# transformers' resolved tensor-parallel plan (its rules with the layer numbers filled in):
# from_pretrained applies it only on a mesh of its own ([Note: tensor-parallel params])
THIRD_PARTY_PRIVATE = {"_init_weights", "_shared_state", "_resolve_parallel_plans", "_subclass_zeros"}
"""(``_subclass_zeros``: the hook by which torchao's low-bit Adams make a quantized moment)"""


def test_no_module_reads_another_objects_private_attributes():
    """Typed seams: a module reaches another class only through its public names; ``x._y``
    is allowed on ``self``/``cls``, on torch, for the few third-party members listed, and
    for attributes the same file defines."""
    found = []
    for p, _ in _modules():
        tree = ast.parse(p.read_text())
        own = {
            n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
        }
        own |= {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_")) or node.attr.startswith(
                "__"
            ):
                continue
            base = ast.unparse(node.value)
            if (
                base in ("self", "cls")
                or base.startswith("torch")
                or node.attr in TORCH_PRIVATE | THIRD_PARTY_PRIVATE | own
            ):
                continue
            found.append(f"{p.relative_to(ROOT)}:{node.lineno}: {base}.{node.attr}")
    assert not found, "add a public method or property instead:\n" + "\n".join(found)


NOTE = re.compile(r"\[Note: ([^\]]+)\]")


def test_design_notes_are_defined_once_and_indexed():
    """A note is defined where a line starts with it (not followed by " in"), exactly once,
    in the code; every note named anywhere exists; docs/design.md lists each one."""
    tests = [p for p in (ROOT / "tests").rglob("*.py") if p.name != "test_repo.py"]
    files = [*(ROOT / "src").rglob("*.py"), *tests, ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]
    defined: dict[str, list[str]] = {}
    named: set[str] = set()
    for p in files:
        for i, line in enumerate(p.read_text().splitlines(), 1):
            named.update(NOTE.findall(line))
            m = re.match(r"\s*(?:# )?\[Note: ([^\]]+)\](?! in )", line)
            if m and p.suffix == ".py":
                defined.setdefault(m.group(1), []).append(f"{p.relative_to(ROOT)}:{i}")
    index = set(NOTE.findall((ROOT / "docs" / "design.md").read_text())) - {"name"}
    assert {k: v for k, v in defined.items() if len(v) > 1} == {}, "defined twice"
    assert named - set(defined) - {"name"} == set(), "named but never defined"  # ("name": the convention)
    assert set(defined) - index == set(), "defined but not in docs/design.md"
    assert index - set(defined) == set(), "docs/design.md lists a note the code does not define"


def test_each_row_of_the_torch_utilities_table_names_tests_that_exist():
    """docs/torch-utilities.md's table (torch utility -> behaviour per stage) is checked by
    the tests it names in its last column: each row names at least one, and each exists."""
    lines = (ROOT / "docs" / "torch-utilities.md").read_text().splitlines()
    rows = [r for r in lines if r.startswith("| ") and not r.startswith(("| what", "| ---"))]
    tests = (ROOT / "tests").rglob("test_*.py")
    defined = {m for p in tests for m in re.findall(r"^def (test_\w+)", p.read_text(), re.M)}
    for row in rows:
        named = re.findall(r"`(test_\w+)`", row.rstrip(" |").rsplit("|", 1)[-1])
        assert named, f"a row names no test: {row[:80]}"
        assert set(named) <= defined, f"named but not defined: {set(named) - defined}"
    assert len(rows) >= 10


def test_tests_live_in_feature_folders_and_import_only_shared_helpers():
    """docs/design.md's "Tests": every test file in a feature folder, names unique across them
    (pytest imports each by its bare name), and no test file importing another (what several
    share is a ``tests/_*.py`` helper)."""
    tests = ROOT / "tests"
    assert sorted(p.name for p in tests.glob("test_*.py")) == [], "a test file outside a feature folder"
    files = sorted(tests.rglob("test_*.py"))
    names = [p.name for p in files]
    assert sorted({n for n in names if names.count(n) > 1}) == [], "two test files of one name"
    imports = [
        f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
        for p in files
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if re.match(r"\s*(from|import) test_\w+", line)
    ]
    assert imports == [], "a test file imports another; move what they share to a tests/_*.py helper"
    folders = {p.parent.name for p in files}
    text = (ROOT / "docs" / "design.md").read_text()
    assert {f for f in folders if f"`{f}/`" not in text} == set(), "a folder docs/design.md does not name"


def test_no_test_runs_pytest_in_its_own_process():
    """pytester's in-process run (``runpytest``, ``inline_run``) empties ``sys.modules`` when it
    ends, while the early jobs' threads import on the same worker ([Note: early starts]): a
    CI run lost 21 tests and the type sweep to modules imported twice. A suite of its own runs
    in a new interpreter (``runpytest_subprocess``)."""
    found = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in sorted((ROOT / "tests").rglob("*.py"))
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if re.search(r"\.(runpytest|inline_run|runpytest_inprocess)\(|pytest\.main\(", line)
    ]
    assert found == [], found
