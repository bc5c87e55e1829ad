"""Stage a timed GPU job's inputs onto a lent machine whose calls each carry only so many bytes.

The lent machine (the `device` tool) reaches no network and takes the repository plus at most
64 MiB a call; the default model's GGUF alone is 98 MB. So the job's inputs travel in parts,
one part a call, onto the same warm machine, and the last call joins and checks them, turns the
GGUF into a model folder with this repository's own reader (no tokenizer conversion there:
the folder's tokenizer files travel from this machine's converted copy) and runs the job.

1. ``pack`` (here): the model's GGUF, its tokenizer files, ``--mix`` (``onthefly_head.py
   prepare``'s ids) and the ``gguf`` wheel in one xz tarball, split into parts that fit beside
   the repository's tree (``--limit-mib`` minus what ``git ls-files`` would carry), with a
   manifest of SHA-256 sums; it prints the calls to make:

       .venv/bin/python scripts/device_stage.py pack --mix /tmp/mix.npz --out .device_stage

2. one call per part, each carrying ``.device_stage/part_NN`` (and ``manifest.json``), copying
   it to ``/tmp/stage``; the last call also runs

       python3 scripts/device_stage.py unpack --stage /tmp/stage --out /tmp/job

   which checks every part (a missing or altered one is named), unpacks, installs the wheel
   into ``/tmp/job/site`` and writes ``/tmp/job/model`` (config, fp32 safetensors, tokenizer);
   then ``PYTHONPATH=/tmp/job/site:. EVOSPEC_CPU_OPS=0 python3 scripts/onthefly_head.py run
   --model /tmp/job/model --mix /tmp/job/mix.npz --device cuda ...`` (docs/draft-head.md).

A leaner tree leaves more room per call (docs/draft-head.md: a branch without the docs'
results, the tests and the other heads makes it two calls instead of six).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MIB = 1 << 20
MANIFEST = "manifest.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "NOTICE")


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def tree_bytes(repo: Path) -> int:
    """Bytes a device call carries of ``repo`` by itself: tracked files plus untracked ones git
    does not ignore."""
    names: set[str] = set()
    for extra in ([], ["--others", "--exclude-standard"]):
        out = subprocess.run(["git", "ls-files", "-z", *extra], cwd=repo, check=True, capture_output=True)
        names.update(n for n in out.stdout.decode().split("\0") if n)
    return sum((repo / n).stat().st_size for n in names if (repo / n).is_file())


def bundle(files: dict[str, Path]) -> bytes:
    """``files`` (name in the bundle -> path here) as one xz-compressed tarball."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:xz", preset=6) as tar:
        for name, path in files.items():
            tar.add(path, arcname=name, recursive=False)
    return buf.getvalue()


def pack(files: dict[str, Path], out: Path, part_bytes: int) -> dict:
    """Write ``files`` as parts of at most ``part_bytes`` into ``out`` (emptied first) with a
    manifest; returns the manifest."""
    if part_bytes < MIB:
        raise SystemExit(f"only {part_bytes} bytes a part fit beside the tree: make the tree leaner")
    data = bundle(files)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    parts = []
    for i, start in enumerate(range(0, len(data), part_bytes)):
        chunk = data[start : start + part_bytes]
        name = f"part_{i:02d}"
        (out / name).write_bytes(chunk)
        parts.append({"name": name, "bytes": len(chunk), "sha256": sha256(chunk)})
    manifest = {"files": sorted(files), "bytes": len(data), "sha256": sha256(data), "parts": parts}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return manifest


def join(stage: Path) -> bytes:
    """The bundle from the parts in ``stage``, checked against its manifest; raises SystemExit
    naming every missing or altered part."""
    manifest = json.loads((stage / MANIFEST).read_text())
    missing = [p["name"] for p in manifest["parts"] if not (stage / p["name"]).is_file()]
    if missing:
        raise SystemExit(f"missing parts in {stage}: {', '.join(missing)} (send them again)")
    chunks = [(stage / p["name"]).read_bytes() for p in manifest["parts"]]
    bad = [p["name"] for p, c in zip(manifest["parts"], chunks, strict=True) if sha256(c) != p["sha256"]]
    if bad:
        raise SystemExit(f"altered parts in {stage}: {', '.join(bad)} (send them again)")
    data = b"".join(chunks)
    if sha256(data) != manifest["sha256"]:
        raise SystemExit("the joined parts do not match the manifest's sum")
    return data


def unbundle(data: bytes, out: Path) -> list[str]:
    """Extract a :func:`bundle` into ``out``: plain files at its top level only."""
    out.mkdir(parents=True, exist_ok=True)
    names = []
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:xz") as tar:
        for member in tar.getmembers():
            if not member.isfile() or Path(member.name).name != member.name:
                raise SystemExit(f"unexpected entry in the bundle: {member.name!r}")
            (out / member.name).write_bytes(tar.extractfile(member).read())
            names.append(member.name)
    return names


def model_folder(job: Path, gguf: Path) -> Path:
    """``job/model``: the GGUF's config and fp32 weights (this repository's reader) beside the
    tokenizer files that travelled with it."""
    from evospec.models.registry import convert_gguf_weights

    folder = job / "model"
    folder.mkdir(exist_ok=True)
    convert_gguf_weights(gguf, folder, progress=False)
    for name in TOKENIZER_FILES:
        if (job / name).is_file():
            shutil.move(str(job / name), folder / name)
    return folder


def pack_files(model: str, mix: Path, wheel: Path | None, work: Path) -> dict[str, Path]:
    """What ``run`` needs of this machine: the registered model's GGUF and tokenizer files, the
    mix, and the ``gguf`` wheel (fetched by pip when ``wheel`` is None)."""
    from importlib import metadata

    from evospec.models.registry import REGISTRY, ensure_converted, package_files

    if model not in REGISTRY:
        raise SystemExit(f"--model {model!r}: not a registered model ({', '.join(sorted(REGISTRY))})")
    if not mix.is_file():
        raise SystemExit(f"--mix {mix}: no such file (onthefly_head.py prepare writes it)")
    entry = REGISTRY[model]
    parts = package_files(entry)
    if len(parts) != 1:
        raise SystemExit(f"{model}: a GGUF in {len(parts)} parts is not supported here")
    files = {"model.gguf": parts[0], "mix.npz": mix}
    folder = ensure_converted(entry)
    files.update({n: folder / n for n in TOKENIZER_FILES if (folder / n).is_file()})
    if wheel is None:
        version = metadata.version("gguf")
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "--only-binary=:all:",
            "-d",
            str(work),
        ]
        subprocess.run([*cmd, f"gguf=={version}"], check=True)
        wheel = next(work.glob("gguf-*.whl"))
    files[wheel.name] = wheel
    return files


def print_plan(manifest: dict, out: Path) -> None:
    parts = manifest["parts"]
    print(f"{len(manifest['files'])} files, {manifest['bytes'] / MIB:.1f} MiB packed, {len(parts)} part(s):")
    for i, p in enumerate(parts):
        carry = [f"{out}/{p['name']}", f"{out}/{MANIFEST}"]
        cmd = f"mkdir -p /tmp/stage && cp {carry[0]} {carry[1]} /tmp/stage/"
        tail = " && python3 scripts/device_stage.py unpack --stage /tmp/stage --out /tmp/job && <the job>"
        print(f"  call {i + 1}: carry {carry}; command: {cmd}{tail if i == len(parts) - 1 else ''}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("pack", help="bundle and split the job's inputs (here)")
    a.add_argument("--model", default="smollm2-135m-instruct", help="registered model name")
    a.add_argument("--mix", type=Path, required=True, help="onthefly_head.py prepare's .npz")
    a.add_argument(
        "--wheel", type=Path, help="the gguf wheel (default: pip download of the installed version)"
    )
    a.add_argument(
        "--out", type=Path, default=Path(".device_stage"), help="an ignored folder in the repository"
    )
    a.add_argument("--limit-mib", type=float, default=64.0, help="what one device call carries")
    a.add_argument("--margin-mib", type=float, default=1.0, help="room left for files added later")
    b = sub.add_parser("unpack", help="check, join and unpack the parts; write the model folder (there)")
    b.add_argument("--stage", type=Path, required=True)
    b.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))  # evospec from this checkout (not installed on the lent machine)
    if args.cmd == "pack":
        room = int((args.limit_mib - args.margin_mib) * MIB) - tree_bytes(ROOT)
        with tempfile.TemporaryDirectory() as work:
            files = pack_files(args.model, args.mix, args.wheel, Path(work))
            print_plan(pack(files, args.out, room - 64 * 1024), args.out)  # the manifest travels too
        return
    names = unbundle(join(args.stage), args.out)
    wheels = [args.out / n for n in names if n.endswith(".whl")]
    if wheels:
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target"]
        subprocess.run([*pip, str(args.out / "site"), *map(str, wheels)], check=True)
        sys.path.insert(0, str(args.out / "site"))
    folder = model_folder(args.out, args.out / "model.gguf")
    print(f"unpacked {len(names)} files; model folder {folder}; export PYTHONPATH={args.out / 'site'}:.")


if __name__ == "__main__":
    main()
