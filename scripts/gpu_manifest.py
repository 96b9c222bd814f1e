"""The wheel folder of the GPU checks: write its manifest, check it, check the machine it is installed on.

    python scripts/gpu_manifest.py write DIR --python 3.12     # after scripts/gpu_wheels.sh downloaded into DIR
    python scripts/gpu_manifest.py check DIR [--python 3.12]   # every wheel present, sizes and sha256 as written
    python scripts/gpu_manifest.py machine DIR                 # what the wheels expect the machine to hold

`write` records every wheel (name, version, bytes, sha256), a `requirements.txt` pinning each of them (pip then
installs exactly these), and, for each requirement of these wheels that no wheel in DIR provides (torch, triton,
numpy, pandas, pyarrow, ...), the version specifiers the wheels ask for: `machine` checks those against what the
interpreter running it has installed. Exit codes: 0 fine, 1 a check failed, 2 no wheel folder or manifest.
Standard library only, so it runs on a bare machine before anything is installed.
"""

from __future__ import annotations

import argparse
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write", help="write manifest.json and requirements.txt for the wheels in DIR")
    w.add_argument("folder")
    w.add_argument("--python", required=True, help="Python version the wheels are for, e.g. 3.12")
    w.add_argument("--limit-mib", type=int, default=LIMIT_MIB)
    c = sub.add_parser("check", help="check DIR against its manifest")
    c.add_argument("folder")
    c.add_argument("--python", help="fail unless the wheels are for this Python version")
    m = sub.add_parser("machine", help="check that this interpreter has what the wheels expect")
    m.add_argument("folder")
    args = parser.parse_args(argv)
    if args.command == "write":
        return write(args.folder, args.python, args.limit_mib)
    if args.command == "check":
        return check(args.folder, args.python)
    return machine(args.folder)


if __name__ == "__main__":
    sys.exit(main())
