"""The distribution: one version, license and citation files, and an sdist and wheel that hold what they should.

`test_distributions` is the release check. It copies the files a clone would get (`git ls-files`: tracked plus new,
not-ignored files, with their working-tree content, so uncommitted edits are tested but `.venv`, `outputs/`, build
leftovers and other ignored files never reach the build), builds the sdist and then the wheel *from the sdist* (as
`pip install dppo-trl.tar.gz` would) with `python -m build --no-isolation` (the venv's setuptools, no network), and
runs `twine check --strict` (the README must render on PyPI).

Installing the wheel's dependencies into a fresh virtual environment would download gigabytes (torch, TRL, vLLM), so
the wheel is installed with `pip install --no-deps --target <dir>` and checked in a subprocess whose `sys.path` starts
with that dir: the dependencies come from this environment, the package only from the wheel. The subprocess asserts
that `dppo_trl` (and its `.dist-info`) are the wheel's, not this checkout's or the editable install's. The packages
only the `examples`, `test` and `trackio` extras bring (derived from the wheel's metadata: extra requirements minus everything
the base requirements pull in, so e.g. PyYAML, which TRL itself needs, stays importable) and the repository-only
packages `dapo_math` and `dppo_dev` are made unimportable (`sys.modules[name] = None`, which also makes
`importlib.util.find_spec` report them missing, as TRL's availability checks use). What this cannot show: that pip
resolves the declared dependency ranges on a fresh machine; `scripts/setup.sh` does that.
"""

from __future__ import annotations

import ast
import configparser
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import textwrap
import zipfile
from email.parser import Parser
from importlib import metadata
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "dppo_trl"
DIST_NAME = "dppo-trl"
# Files every sdist must carry besides the package.
SDIST_FILES = {"LICENSE", "README.md", "CITATION.cff", "CHANGELOG.md", "pyproject.toml", "setup.cfg", "PKG-INFO"}
# Repository-only packages that must not be needed by (or shipped with) the library.
REPO_ONLY_PACKAGES = ("dapo_math", "dppo_dev")
PAPER_AUTHORS = ["Penghui Qi", "Xiangxin Zhou", "Zichen Liu", "Tianyu Pang", "Chao Du", "Min Lin", "Wee Sun Lee"]


def _source_version() -> str:
    """`__version__` as written in dppo_trl/_version.py, read without importing anything."""
    tree = ast.parse((ROOT / PACKAGE / "_version.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__version__" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("dppo_trl/_version.py has no literal `__version__ = ...`")


def _run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    assert result.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{result.stdout}\n{result.stderr}"
    return result


# ---------------------------------------------------------------------------------------------------------------------
# Fast checks on the source tree
# ---------------------------------------------------------------------------------------------------------------------


def test_version_has_one_source():
    import dppo_trl

    version = _source_version()
    Version(version)  # PEP 440
    assert dppo_trl.__version__ == version

    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg", encoding="utf-8")
    assert cfg["metadata"]["version"] == "attr: dppo_trl._version.__version__", (
        "setup.cfg must read the version, not repeat it"
    )

    # setuptools must get it statically: importing dppo_trl at build time would need torch/TRL in the build env.
    script = textwrap.dedent("""
        import json, sys
        for name in ("torch", "trl", "transformers"):
            sys.modules[name] = None
        from setuptools.config.setupcfg import read_configuration
        conf = read_configuration("setup.cfg")
        print(json.dumps({"version": str(conf["metadata"]["version"]), "imported": "dppo_trl" in sys.modules}))
    """)
    out = json.loads(_run([sys.executable, "-c", script], cwd=ROOT).stdout.strip().splitlines()[-1])
    assert out == {"version": version, "imported": False}


def test_changelog_lists_the_current_version():
    changelog = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    assert "## [Unreleased]" in changelog
    assert re.search(rf"^## \[{re.escape(_source_version())}\] - \d{{4}}-\d{{2}}-\d{{2}}$", changelog, re.M), (
        f"CHANGELOG.md has no '## [{_source_version()}] - YYYY-MM-DD' section: add one when bumping __version__"
    )


def test_license_is_apache_2():
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert text.lstrip().startswith("Apache License\n                           Version 2.0, January 2004")
    assert "END OF TERMS AND CONDITIONS" in text
    assert "Copyright 2026 The dppo-trl authors" in text
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg", encoding="utf-8")
    assert cfg["metadata"]["license_expression"] == "Apache-2.0"
    assert cfg["metadata"]["license_files"].split() == ["LICENSE"]


def test_citation_matches_the_trainer_and_readme():
    yaml = pytest.importorskip("yaml")
    from dppo_trl import DPPOTrainer

    cff = yaml.safe_load((ROOT / "CITATION.cff").read_text(encoding="utf-8"))
    assert cff["cff-version"] == "1.2.0" and cff["type"] == "software" and cff["license"] == "Apache-2.0"
    assert cff["title"].startswith(DIST_NAME)
    (paper,) = cff["references"]
    assert paper["title"] == DPPOTrainer._paper["title"]
    assert DPPOTrainer._paper["id"] in paper["url"] and paper["year"] == 2026
    names = [f"{a['given-names']} {a['family-names']}" for a in paper["authors"]]
    assert names == PAPER_AUTHORS
    assert " and ".join(PAPER_AUTHORS) in DPPOTrainer._paper["citation"]
    # The README's BibTeX is the one the trainer writes into model cards.
    assert DPPOTrainer._paper["citation"] in (ROOT / "README.md").read_text(encoding="utf-8")


def test_readme_states_the_declared_version_ranges():
    from trl_contract import TESTED_TRL_RANGE

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg", encoding="utf-8")
    assert f"`{cfg['options']['python_requires'].strip()}`" in readme
    lines = cfg["options"]["install_requires"].split("\n")
    for extra in ("vllm", "cpu", "liger"):
        lines += cfg["options.extras_require"][extra].split("\n")
    for line in filter(None, map(str.strip, lines)):
        name, spec = re.fullmatch(r"([A-Za-z0-9_.-]+)\s*(.+)", line).groups()
        assert spec in readme, f"README.md's supported versions lack {name} {spec} (setup.cfg)"
    assert f"`{','.join(TESTED_TRL_RANGE)}`" in readme


# ---------------------------------------------------------------------------------------------------------------------
# The built distributions
# ---------------------------------------------------------------------------------------------------------------------


def _clone_files(dest: Path) -> None:
    """Copy what a clone of the current tree holds: tracked and new not-ignored files, as they are on disk."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the distribution is built from the files git would commit")
    listed = _run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT).stdout
    for rel in filter(None, listed.split("\0")):
        src = ROOT / rel
        if src.is_file():  # tracked files deleted in the working tree are not part of it
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def _require_build_tools() -> None:
    for dist, minimum in (("build", "1.2"), ("twine", "6.1"), ("setuptools", "77")):
        try:
            installed = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pytest.fail(f"{dist} is not installed: it is part of the `test` extra (pip install -e '.[test]')")
        assert Version(installed) >= Version(minimum), f"{dist}>={minimum} needed (test extra), found {installed}"


def _base_closure(requirements: list[Requirement]) -> set[str]:
    """Canonical names of every distribution the base requirements pull in, as installed in this environment."""
    env = default_environment()
    seen: set[str] = set()
    todo = [r for r in requirements if r.marker is None or r.marker.evaluate({**env, "extra": ""})]
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in seen:
            continue
        seen.add(name)
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            continue
        for line in dist.requires or []:
            sub = Requirement(line)
            if sub.marker is None or sub.marker.evaluate({**env, "extra": ""}):
                todo.append(sub)
    return seen


def _import_names(dist_name: str) -> set[str]:
    """Top-level modules a distribution installs (from its RECORD / top_level.txt)."""
    try:
        dist = metadata.distribution(dist_name)
    except metadata.PackageNotFoundError:
        return set()
    top_level = dist.read_text("top_level.txt")
    if top_level:
        return {line.strip() for line in top_level.splitlines() if line.strip()}
    names = set()
    for file in dist.files or []:
        first = file.parts[0]
        if first.endswith((".dist-info", ".data")) or first in ("..", "__pycache__") or "bin" == first:
            continue
        names.add(first[:-3] if first.endswith(".py") else first)
    return {n for n in names if n.isidentifier()}


_CHECK_INSTALLED = textwrap.dedent("""
    import importlib, json, pkgutil, sys
    from importlib import metadata

    target, blocked, out_dir = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    # Loaded at start-up by a .pth file of this environment (e.g. setuptools' _distutils_hack): not ours to block.
    preloaded = sorted(n for n in blocked if n in sys.modules)
    blocked = [n for n in blocked if n not in sys.modules]
    for name in blocked:
        sys.modules[name] = None

    import dppo_trl
    modules = sorted(m.name for m in pkgutil.walk_packages(dppo_trl.__path__, "dppo_trl."))
    for name in modules:
        importlib.import_module(name)
    from dppo_trl import DPPOConfig, DPPOTrainer

    config = DPPOConfig(output_dir=out_dir, use_cpu=True, report_to="none", divergence="topk_kl")
    dist = metadata.distribution("dppo-trl")
    (script,) = [e for e in dist.entry_points if e.group == "console_scripts"]
    assert script.load() is importlib.import_module("dppo_trl.cli").main
    print(json.dumps({
        "file": dppo_trl.__file__,
        "version": dppo_trl.__version__,
        "dist_version": dist.version,
        "dist_path": str(dist.locate_file("")),
        "modules": modules,
        "trainer_is_grpo": [c.__name__ for c in DPPOTrainer.__mro__ if c.__name__.endswith("GRPOTrainer") or c is DPPOTrainer],
        "config": [config.divergence, config.delta_low, config.delta_high, config.divergence_top_k],
        "blocked": blocked,
        "preloaded": preloaded,
    }))
""")


@pytest.mark.slow
def test_distributions(tmp_path):
    _require_build_tools()
    version = _source_version()
    src, dist_dir, target = tmp_path / "src", tmp_path / "dist", tmp_path / "site"
    _clone_files(src)
    # What a developer's checkout also has: none of it may reach the sdist.
    for junk in (".venv/pyvenv.cfg", "outputs/tiny-math-dppo/config.json", f"{PACKAGE}/__pycache__/trainer.pyc"):
        (src / junk).parent.mkdir(parents=True, exist_ok=True)
        (src / junk).write_text("junk\n")

    env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist_dir), str(src)], env=env)
    sdist = dist_dir / f"{PACKAGE}-{version}.tar.gz"
    wheel = dist_dir / f"{PACKAGE}-{version}-py3-none-any.whl"
    assert sorted(p.name for p in dist_dir.iterdir()) == sorted([sdist.name, wheel.name])
    _run([sys.executable, "-m", "twine", "check", "--strict", str(sdist), str(wheel)], env=env)

    expected_modules = {p.relative_to(src).as_posix() for p in (src / PACKAGE).rglob("*.py")}
    assert f"{PACKAGE}/__init__.py" in expected_modules

    # sdist: the package, the metadata files, nothing from the developer's checkout or the repository-only trees.
    with tarfile.open(sdist) as tar:
        names = {m.name.split("/", 1)[1] for m in tar.getmembers() if m.isfile()}
        assert tar.extractfile(f"{PACKAGE}-{version}/LICENSE").read() == (src / "LICENSE").read_bytes()
    missing = (SDIST_FILES | expected_modules | {f"{PACKAGE}/py.typed"}) - names
    assert not missing, f"sdist lacks {sorted(missing)}"
    stray = sorted(
        n
        for n in names
        if n.split("/")[0]
        in {".venv", "outputs", "tests", "examples", "benchmarks", "docs", "scripts", *REPO_ONLY_PACKAGES}
        or "__pycache__" in n.split("/")
        or n.endswith(".pyc")
    )
    assert not stray, f"sdist holds files that belong to the repository only: {stray}"

    # wheel: exactly the library modules and py.typed, plus the .dist-info with the license.
    dist_info = f"{PACKAGE}-{version}.dist-info"
    with zipfile.ZipFile(wheel) as whl:
        names = set(whl.namelist())
        package_files = {n for n in names if n.startswith(f"{PACKAGE}/")}
        assert package_files == expected_modules | {f"{PACKAGE}/py.typed"}
        assert {n.split("/")[0] for n in names} == {PACKAGE, dist_info}
        assert whl.read(f"{dist_info}/licenses/LICENSE") == (src / "LICENSE").read_bytes()
        meta = Parser().parsestr(whl.read(f"{dist_info}/METADATA").decode())
        entry_points = configparser.ConfigParser()
        entry_points.read_string(whl.read(f"{dist_info}/entry_points.txt").decode())
    # The `dppo-trl` command is the wheel's (pip writes the script from this entry).
    assert dict(entry_points["console_scripts"]) == {"dppo-trl": "dppo_trl.cli:main"}
    assert (meta["Name"], meta["Version"]) == (DIST_NAME, version)
    assert meta["License-Expression"] == "Apache-2.0" and meta.get_all("License-File") == ["LICENSE"]
    assert meta["Description-Content-Type"] == "text/markdown"

    # Install the wheel alone and import it with the examples/test extras and repository-only packages blocked.
    requires = [Requirement(r) for r in meta.get_all("Requires-Dist")]
    base = [r for r in requires if r.marker is None]
    extras_only = {
        canonicalize_name(r.name)
        for r in requires
        if r.marker is not None and re.search(r'extra == "(examples|test|trackio)"', str(r.marker))
    } - _base_closure(base)
    blocked = sorted(set().union(*map(_import_names, extras_only)) | set(REPO_ONLY_PACKAGES))
    assert "math_verify" in blocked and "matplotlib" in blocked and "trackio" in blocked, blocked
    _run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-compile", "--target", str(target), str(wheel)],
        env=env,
    )

    check_env = {**env, "PYTHONPATH": str(target)}
    result = _run(
        [sys.executable, "-s", "-P", "-c", _CHECK_INSTALLED, str(target), json.dumps(blocked), str(tmp_path / "out")],
        cwd=tmp_path,
        env=check_env,
    )
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert Path(report["file"]).resolve() == (target / PACKAGE / "__init__.py").resolve(), report["file"]
    assert Path(report["dist_path"]).resolve() == target.resolve()
    assert report["version"] == report["dist_version"] == version
    expected_names = []
    for module in expected_modules:
        parts = Path(module).with_suffix("").parts
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        if parts != (PACKAGE,):
            expected_names.append(".".join(parts))
    expected_names.sort()
    assert report["modules"] == expected_names
    # DPPOTrainer is a GRPOTrainer through its TRL 1.16 room.
    assert report["trainer_is_grpo"] == ["DPPOTrainer", "HookedGRPOTrainer", "GRPOTrainer"]
    assert report["config"] == ["topk_kl", 0.05, 0.05, 20]
    # Every name was really blocked: none had been imported at start-up, before the check could block it.
    assert report["preloaded"] == [] and set(blocked) == set(report["blocked"]), report
