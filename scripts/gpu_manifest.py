"""The wheel folder of the GPU checks: write its manifest, check it, check the machine it is installed on.

    python scripts/gpu_manifest.py wheel DIR                   # the dppo-trl wheel of this checkout, into DIR
    python scripts/gpu_manifest.py write DIR --python 3.12     # after scripts/gpu_wheels.sh downloaded into DIR
    python scripts/gpu_manifest.py check DIR [--python 3.12]   # every wheel present, sizes and sha256 as written
    python scripts/gpu_manifest.py machine DIR                 # what the wheels expect the machine to hold
    python scripts/gpu_manifest.py imports DIR SITE [--cuda]   # after `pip install --target SITE`: who imports from where
    python scripts/gpu_manifest.py fresh DIR                   # DIR's dppo-trl wheel holds this checkout's package
    python scripts/gpu_manifest.py refresh DIR                 # rebuild only that wheel, rewrite the manifest
    python scripts/gpu_manifest.py pytest SITE -- ARGS...      # pytest, refusing imports the GPU machine would lack

`write` records every wheel (name, version, bytes, sha256), a `requirements.txt` pinning each of them (pip then
installs exactly these), and, for each requirement of these wheels that no wheel in DIR provides (torch, triton,
numpy, pandas, pyarrow, ...), the version specifiers the wheels ask for: `machine` checks those against what the
interpreter running it has installed. Exit codes: 0 fine, 1 a check failed, 2 no wheel folder or manifest.
Standard library only, so it runs on a bare machine before anything is installed.

`wheel` writes the pure-Python dppo-trl wheel from setup.cfg and the package sources with the standard library, not
with a build backend: a bare Python (no setuptools, or a setuptools without `bdist_wheel`, as on the lent GPU image
and pyenv's 3.11) builds it without network, so the GPU check's dry run can build it too. It holds what setuptools'
wheel of this checkout holds (package files, version, requirements, extras); tests/system/test_gpu_check.py compares
the two.
"""

from __future__ import annotations

import argparse
import ast
import base64
import configparser
import hashlib
import json
import os
import re
import sys
import zipfile
from email.parser import Parser

LIMIT_MIB = 64  # what travels to the GPU machine with the working tree
MANIFEST = "manifest.json"
REQUIREMENTS = "requirements.txt"
MISSING_HINT = "build it with `scripts/gpu_wheels.sh {dir}` on a machine where pip reaches PyPI"


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _metadata(path: str):
    with zipfile.ZipFile(path) as wheel:
        name = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        return Parser().parsestr(wheel.read(name).decode("utf-8"))


def _unconditional(requirement: str) -> tuple[str, str, str] | None:
    """(name, specifier, marker) of a Requires-Dist line that applies without extras; None for extras-only lines."""
    body, _, marker = requirement.partition(";")
    if "extra" in marker:
        return None
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*\(?([^)]*)\)?", body)
    return canonical(match.group(1)), match.group(3).strip(), marker.strip()


def write(folder: str, python: str, limit_mib: int) -> int:
    wheels = sorted(f for f in os.listdir(folder) if f.endswith(".whl"))
    records, provided, wanted = [], set(), {}
    for file in wheels:
        path = os.path.join(folder, file)
        meta = _metadata(path)
        name = canonical(meta["Name"])
        provided.add(name)
        records.append(
            {
                "file": file,
                "name": name,
                "version": meta["Version"],
                "bytes": os.path.getsize(path),
                "sha256": _sha256(path),
            }
        )
        for line in meta.get_all("Requires-Dist") or []:
            parsed = _unconditional(line)
            if parsed is None:
                continue
            req, spec, marker = parsed
            # "" is "any version"; a marker travels with its specifier and is evaluated on the machine
            wanted.setdefault(req, set()).add(spec + (f" ; {marker}" if marker else ""))
    names = [r["name"] for r in records]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        print(f"gpu_manifest: two versions of {duplicates} in {folder}: keep one (pip refuses both)", file=sys.stderr)
        return 1
    total = sum(r["bytes"] for r in records)
    manifest = {
        "python": python,
        "platform": "manylinux x86_64",
        "wheels": records,
        "total_bytes": total,
        "limit_bytes": limit_mib * 2**20,
        "expected_on_machine": {n: sorted(s) for n, s in sorted(wanted.items()) if n not in provided},
    }
    with open(os.path.join(folder, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
    with open(os.path.join(folder, REQUIREMENTS), "w") as f:
        f.writelines(f"{r['name']}=={r['version']}\n" for r in records)
    print(f"gpu_manifest: {len(records)} wheels, {total / 2**20:.1f} MiB (limit {limit_mib} MiB) in {folder}")
    if total > limit_mib * 2**20:
        print(f"gpu_manifest: {folder} is {total / 2**20:.1f} MiB, over the {limit_mib} MiB limit", file=sys.stderr)
        return 1
    return 0


def load(folder: str) -> dict | None:
    path = os.path.join(folder, MANIFEST)
    if not os.path.isdir(folder) or not os.path.isfile(path):
        what = "no wheel folder" if not os.path.isdir(folder) else f"no {MANIFEST} in the wheel folder"
        print(f"gpu_manifest: {what} {folder!r}: {MISSING_HINT.format(dir=folder)}", file=sys.stderr)
        return None
    with open(path) as f:
        return json.load(f)


def check(folder: str, python: str | None) -> int:
    manifest = load(folder)
    if manifest is None:
        return 2
    problems = []
    listed = {r["file"] for r in manifest["wheels"]}
    extra = sorted(f for f in os.listdir(folder) if f.endswith(".whl") and f not in listed)
    if extra:
        problems.append(f"wheels not in the manifest: {extra}")
    for record in manifest["wheels"]:
        path = os.path.join(folder, record["file"])
        if not os.path.isfile(path):
            problems.append(f"missing {record['file']}")
        elif os.path.getsize(path) != record["bytes"] or _sha256(path) != record["sha256"]:
            problems.append(f"{record['file']} differs from the manifest (size or sha256)")
    if manifest["total_bytes"] > manifest["limit_bytes"]:
        problems.append(f"{manifest['total_bytes'] / 2**20:.1f} MiB, over the limit")
    if python is not None and manifest["python"] != python:
        problems.append(f"wheels are for Python {manifest['python']}, this interpreter is {python}")
    if not os.path.isfile(os.path.join(folder, REQUIREMENTS)):
        problems.append(f"no {REQUIREMENTS}")
    if not any(r["name"] == "dppo-trl" for r in manifest["wheels"]):
        problems.append("no dppo-trl wheel")
    for problem in problems:
        print(f"gpu_manifest: {folder}: {problem}", file=sys.stderr)
    if not problems:
        print(f"gpu_manifest: {folder}: {len(manifest['wheels'])} wheels match the manifest")
    return 1 if problems else 0


def machine(folder: str) -> int:
    """Whether this interpreter holds what the wheels expect the machine to provide."""
    import importlib.metadata as md

    manifest = load(folder)
    if manifest is None:
        return 2
    try:
        from packaging.markers import Marker
        from packaging.specifiers import SpecifierSet
    except ImportError:  # checked by pip itself at install time then
        Marker = SpecifierSet = None
    problems = []
    for name, specs in manifest["expected_on_machine"].items():
        applicable = []
        for entry in specs:
            spec, _, marker = entry.partition(" ; ")
            if marker and (Marker is None or not Marker(marker).evaluate()):
                continue  # needed only where the marker holds (another platform or Python)
            applicable.append(spec)
        if not applicable:
            continue
        applicable = [spec for spec in applicable if spec]
        try:
            version = md.version(name)
        except md.PackageNotFoundError:
            problems.append(f"{name} is not installed (wanted {', '.join(applicable) or 'any version'})")
            continue
        if SpecifierSet is not None:
            for spec in applicable:
                if not SpecifierSet(spec).contains(version, prereleases=True):
                    problems.append(f"{name} {version} does not satisfy {spec}")
    for problem in problems:
        print(f"gpu_manifest: machine: {problem}", file=sys.stderr)
    if not problems:
        print(f"gpu_manifest: machine has {sorted(manifest['expected_on_machine'])}")
    return 1 if problems else 0


def _source_version(root: str, attr: str) -> str:
    """The string literal behind setup.cfg's `version = attr: pkg.module.__version__`, read without importing the
    package (the module is a file, `pkg/module.py`, or a package, `pkg/module/__init__.py`)."""
    module, _, name = attr.rpartition(".")
    path = os.path.join(root, *module.split(".")) + ".py"
    if not os.path.isfile(path):
        path = os.path.join(root, *module.split("."), "__init__.py")
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise SystemExit(f"gpu_manifest: {path} has no literal `{name} = ...`")


def _lines(value: str) -> list[str]:
    return [line.strip() for line in value.splitlines() if line.strip()]


# The modules the GPU checks use, by distribution: each one whose wheel is in the folder must import from the
# installed wheels; torch must come from the machine. liger-kernel is the optional `liger` extra.
CHECKED_MODULES = {
    "torch": "torch",
    "transformers": "transformers",
    "trl": "trl",
    "peft": "peft",
    "accelerate": "accelerate",
    "datasets": "datasets",
    "liger_kernel": "liger-kernel",
    "dppo_trl": "dppo-trl",
}
OPTIONAL_MODULES = {"liger_kernel"}


def imports(folder: str, site: str, cuda: bool) -> int:
    """Import the checked modules (with SITE on PYTHONPATH) and report where each came from; 1 on any mismatch."""
    import importlib

    manifest = load(folder)
    if manifest is None:
        return 2
    site = os.path.realpath(site)
    from_wheels = {r["name"] for r in manifest["wheels"]}
    report, problems = {}, []
    for module, distribution in CHECKED_MODULES.items():
        try:
            loaded = importlib.import_module(module)
        except Exception as error:  # report every module, not just the first that fails
            if module not in OPTIONAL_MODULES or distribution in from_wheels:
                problems.append(f"{module} does not import: {type(error).__name__}: {error}")
            continue
        where = os.path.realpath(loaded.__file__)
        in_site = where.startswith(site + os.sep)
        report[module] = {"version": getattr(loaded, "__version__", None), "from": "wheels" if in_site else "machine"}
        report[module]["file"] = where
        if distribution in from_wheels and not in_site:
            problems.append(f"{module} imports from {where}, not from its wheel installed in {site}")
        if distribution not in from_wheels and in_site:
            problems.append(f"{module} imports from {site}, but the wheel folder has no {distribution}")
    if cuda and "torch" in report:
        torch = sys.modules["torch"]
        if torch.cuda.is_available():
            report["torch"]["cuda_device"] = torch.cuda.get_device_name()
        else:
            problems.append("torch sees no CUDA device")
    for problem in problems:
        print(f"gpu_manifest: imports: {problem}", file=sys.stderr)
    print(json.dumps(report, indent=1))
    return 1 if problems else 0


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _write_member(wheel: zipfile.ZipFile, arcname: str, data: bytes) -> None:
    # A fixed timestamp and mode: the same sources give the same bytes, so the manifest's sha256 is reproducible.
    info = zipfile.ZipInfo(arcname, date_time=(1980, 1, 1, 0, 0, 0))
    info.compress_type = zipfile.ZIP_DEFLATED
    info.external_attr = 0o644 << 16
    wheel.writestr(info, data)


def _wheel_members(root: str) -> tuple[str, dict[str, bytes]]:
    """The dppo-trl wheel of ROOT/setup.cfg: its file name stem (`name-version`) and every member but RECORD, with
    its bytes (package files as in the checkout, then METADATA, WHEEL and top_level.txt)."""
    config = configparser.ConfigParser(interpolation=None)
    if not config.read(os.path.join(root, "setup.cfg")):
        raise SystemExit(f"gpu_manifest: no setup.cfg in {root!r}")
    meta, options = config["metadata"], config["options"]
    name = meta["name"]
    version = meta["version"]
    if version.startswith("attr:"):
        version = _source_version(root, version.split(":", 1)[1].strip())
    # setup.cfg's `packages = find:` with `include = pkg, pkg.*`: every folder of pkg holding an __init__.py.
    includes = [p.strip() for p in config["options.packages.find"]["include"].split(",") if p.strip()]
    tops = sorted({p.split(".")[0] for p in includes})
    package_data = (
        {k: v.split() for k, v in config["options.package_data"].items()}
        if config.has_section("options.package_data")
        else {}
    )
    files = []
    for top in tops:
        for here, dirs, names in os.walk(os.path.join(root, top)):
            dirs[:] = sorted(d for d in dirs if os.path.isfile(os.path.join(here, d, "__init__.py")))
            package = os.path.relpath(here, root).replace(os.sep, ".")
            keep = [n for n in names if n.endswith(".py") or n in package_data.get(package, [])]
            files += [os.path.relpath(os.path.join(here, n), root) for n in sorted(keep)]
    metadata = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}", f"Summary: {meta['description']}"]
    metadata.append(f"Requires-Python: {options['python_requires']}")
    metadata += [f"Requires-Dist: {r}" for r in _lines(options.get("install_requires", ""))]
    if config.has_section("options.extras_require"):
        for extra, requirements in config["options.extras_require"].items():
            metadata.append(f"Provides-Extra: {extra}")
            metadata += [f'Requires-Dist: {r} ; extra == "{extra}"' for r in _lines(requirements)]
    dist = f"{canonical(name).replace('-', '_')}-{version}"
    members = {f.replace(os.sep, "/"): _read(os.path.join(root, f)) for f in files}
    generated = {
        f"{dist}.dist-info/METADATA": "\n".join(metadata) + "\n",
        f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: scripts/gpu_manifest.py\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
        f"{dist}.dist-info/top_level.txt": "".join(f"{t}\n" for t in tops),
    }
    members.update((arcname, text.encode("utf-8")) for arcname, text in generated.items())
    return dist, members


def build_wheel(root: str, folder: str) -> str:
    """Write the pure-Python wheel of the package described by ROOT/setup.cfg into FOLDER; returns its path."""
    dist, members = _wheel_members(root)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{dist}-py3-none-any.whl")
    record = []
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as wheel:
        for arcname, data in members.items():
            _write_member(wheel, arcname, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append(f"{arcname},sha256={digest},{len(data)}\n")
        record.append(f"{dist}.dist-info/RECORD,,\n")
        _write_member(wheel, f"{dist}.dist-info/RECORD", "".join(record).encode("utf-8"))
    n_files = sum(1 for arcname in members if not arcname.startswith(f"{dist}.dist-info/"))
    print(f"gpu_manifest: built {path} ({n_files} package files)")
    return path


REFRESH_HINT = "rebuild it from this checkout: `scripts/gpu_wheels.sh --refresh {dir}` (no network; it replaces only the dppo-trl wheel and rewrites the manifest)"


def fresh(folder: str, root: str) -> int:
    """Whether the folder's dppo-trl wheel holds this checkout's package: the same files with the same bytes, and the
    same metadata. A wheel built before a change would run the old code on the GPU machine (its name never changes)."""
    wheels = sorted(f for f in os.listdir(folder) if f.startswith("dppo_trl-") and f.endswith(".whl"))
    if len(wheels) != 1:
        print(
            f"gpu_manifest: {folder}: {len(wheels)} dppo-trl wheels, not one; {REFRESH_HINT.format(dir=folder)}",
            file=sys.stderr,
        )
        return 1
    dist, expected = _wheel_members(root)
    with zipfile.ZipFile(os.path.join(folder, wheels[0])) as wheel:
        held = {n: wheel.read(n) for n in wheel.namelist() if not n.endswith(".dist-info/RECORD")}
    differences = [f"missing {n}" for n in sorted(set(expected) - set(held))]
    differences += [f"not in the checkout: {n}" for n in sorted(set(held) - set(expected))]
    differences += [f"differs: {n}" for n in sorted(set(held) & set(expected)) if held[n] != expected[n]]
    if differences:
        shown = "; ".join(differences[:8]) + (f"; and {len(differences) - 8} more" if len(differences) > 8 else "")
        print(
            f"gpu_manifest: {folder}/{wheels[0]} was built from another version of the checkout ({shown}): the GPU "
            f"run would test that code, not this checkout's; {REFRESH_HINT.format(dir=folder)}",
            file=sys.stderr,
        )
        return 1
    print(f"gpu_manifest: {wheels[0]} holds this checkout's {dist} ({len(expected)} files)")
    return 0


def refresh(folder: str, root: str) -> int:
    """Replace the folder's dppo-trl wheel with this checkout's and rewrite the manifest for the folder's Python,
    keeping every other wheel (they need PyPI to fetch again)."""
    manifest = load(folder)
    if manifest is None:
        return 2
    for name in os.listdir(folder):
        if name.startswith("dppo_trl-") and name.endswith(".whl"):
            os.remove(os.path.join(folder, name))
    build_wheel(root, folder)
    return write(folder, manifest["python"], manifest["limit_bytes"] // 2**20)


# Top-level modules the lent GPU machine's python3 provides besides the standard library (recorded on 2026-11-26,
# ../shared notes and docs/recipes.md, "GPU checks"): its CUDA torch and triton, and what the wheel list leaves to it.
MACHINE_MODULES = frozenset(
    {"torch", "triton", "numpy", "pandas", "pyarrow", "matplotlib", "sympy", "transformers", "accelerate", "peft"}
    | {"pytest", "_pytest"}
)


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root + os.sep)


class _ImportGuard:
    """Wraps `builtins.__import__` so that every import statement of this project's own code (the installed dppo_trl,
    the checkout's sources: dppo_dev, tests, examples) naming a top-level module the GPU machine would not have fails:
    neither the standard library, nor this project, nor a distribution of the wheel list (scripts/gpu_wheels.txt,
    what scripts/gpu_wheels.sh puts in the folder; the dry run's tests take them from their environment), nor
    `MACHINE_MODULES`. Every statement is checked, also when another package imported the module first. Imports made by
    third-party packages are theirs (their wheels' metadata declare them, and the `machine` step checks those)."""

    def __init__(self, site: str, checkout: str):
        import builtins
        import importlib.metadata

        self.site, self.checkout = os.path.realpath(site), os.path.realpath(checkout)
        # The interpreter's own packages (a virtual environment may sit inside the checkout, as .venv does)
        self.installed = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
        with open(os.path.join(checkout, "scripts", "gpu_wheels.txt")) as f:
            pins = [line.split("==")[0].strip() for line in f if line.strip() and not line.startswith("#")]
        self.pinned = {canonical(name) for name in pins}
        self.distributions = importlib.metadata.packages_distributions()
        self.refused: list[str] = []
        self.checked: dict[str, bool] = {}
        self.builtins, self.original = builtins, builtins.__import__

    def __enter__(self):
        self.builtins.__import__ = self._import
        return self

    def __exit__(self, *exc):
        self.builtins.__import__ = self.original

    def _project(self, path: str) -> bool:
        """A file of this project: the installed dppo_trl, or the checkout's own sources (dppo_dev, tests, ...)."""
        path = os.path.realpath(path)
        if _inside(path, os.path.join(self.site, "dppo_trl")):
            return True
        return _inside(path, self.checkout) and not any(_inside(path, p) for p in self.installed | {self.site})

    def _provided(self, top: str) -> bool:
        if top in sys.stdlib_module_names or top in MACHINE_MODULES or top in sys.builtin_module_names:
            return True
        if {canonical(d) for d in self.distributions.get(top, [])} & self.pinned:
            return True
        module = sys.modules.get(top)
        if module is not None:
            origin = getattr(module, "__file__", None) or next(iter(getattr(module, "__path__", []) or []), "")
        else:
            import importlib.machinery

            spec = importlib.machinery.PathFinder.find_spec(top)
            if spec is None:
                return True  # not installed here either: Python raises its own ModuleNotFoundError
            origin = spec.origin or next(iter(spec.submodule_search_locations or []), "")
        return not origin or _inside(os.path.realpath(origin), self.site) or self._project(origin)

    def _import(self, name, globals=None, locals=None, fromlist=(), level=0):
        importer = (globals or {}).get("__file__")
        if level == 0 and importer and self._project(importer):
            top = name.partition(".")[0]
            if top not in self.checked:
                self.checked[top] = self._provided(top)
            if not self.checked[top]:
                importer = os.path.realpath(importer)
                where = (
                    f"{os.path.relpath(importer, self.site)} of the installed dppo-trl wheel"
                    if _inside(importer, self.site)
                    else os.path.relpath(importer, self.checkout)
                )
                message = (
                    f"{top} (imported by {where}) is neither in the wheel list (scripts/gpu_wheels.txt) nor on the GPU "
                    f"machine (scripts/gpu_manifest.py MACHINE_MODULES): the GPU run could not import it. Import it "
                    f"where it is used instead, or add its wheel to scripts/gpu_wheels.txt"
                )
                self.refused.append(message)
                raise ModuleNotFoundError(message, name=top)
        return self.original(name, globals, locals, fromlist, level)


def guarded_pytest(site: str, pytest_args: list[str]) -> int:
    """`pytest PYTEST_ARGS` with `_ImportGuard` installed: run as the dry run's test collection, it fails where a test
    file (or what it imports of this project) needs a module the GPU machine would lack, naming it."""
    import pytest

    with _ImportGuard(site, os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) as guard:
        code = int(pytest.main(pytest_args))
    for message in dict.fromkeys(guard.refused):
        print(f"gpu_manifest: import guard: {message}", file=sys.stderr)
    return code or (1 if guard.refused else 0)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("wheel", help="write the dppo-trl wheel of this checkout into DIR (standard library only)")
    b.add_argument("folder")
    b.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    w = sub.add_parser("write", help="write manifest.json and requirements.txt for the wheels in DIR")
    w.add_argument("folder")
    w.add_argument("--python", required=True, help="Python version the wheels are for, e.g. 3.12")
    w.add_argument("--limit-mib", type=int, default=LIMIT_MIB)
    f = sub.add_parser("fresh", help="check that DIR's dppo-trl wheel holds this checkout's package")
    f.add_argument("folder")
    f.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = sub.add_parser("refresh", help="replace DIR's dppo-trl wheel with this checkout's and rewrite the manifest")
    r.add_argument("folder")
    r.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    g = sub.add_parser("pytest", help="run pytest refusing this project's imports the GPU machine would lack")
    g.add_argument("site")
    g.add_argument("pytest_args", nargs=argparse.REMAINDER)
    c = sub.add_parser("check", help="check DIR against its manifest")
    c.add_argument("folder")
    c.add_argument("--python", help="fail unless the wheels are for this Python version")
    m = sub.add_parser("machine", help="check that this interpreter has what the wheels expect")
    m.add_argument("folder")
    i = sub.add_parser("imports", help="import the checked modules and say whether each came from SITE")
    i.add_argument("folder")
    i.add_argument("site")
    i.add_argument("--cuda", action="store_true", help="also require a CUDA device")
    args = parser.parse_args(argv)
    if args.command == "wheel":
        build_wheel(args.root, args.folder)
        return 0
    if args.command == "write":
        return write(args.folder, args.python, args.limit_mib)
    if args.command == "check":
        return check(args.folder, args.python)
    if args.command == "fresh":
        return fresh(args.folder, args.root)
    if args.command == "refresh":
        return refresh(args.folder, args.root)
    if args.command == "pytest":
        return guarded_pytest(args.site, [a for a in args.pytest_args if a != "--"])
    if args.command == "imports":
        return imports(args.folder, args.site, args.cuda)
    return machine(args.folder)


if __name__ == "__main__":
    sys.exit(main())
