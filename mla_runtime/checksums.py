"""Weight files checked by sha256 before serving, and the fingerprint that shows which weights are served.

The manifest of a checkpoint folder is, in order:
1. the hub's own hashes, when the folder is a snapshot in the hub cache (``snapshots/<commit>/``): each
   ``*.safetensors`` there links to ``blobs/<sha256>``, the LFS object id the hub recorded at upload;
2. else a ``SHA256SUMS`` file in the folder (``sha256sum`` format: ``<hex>  <name>`` per line), written by
   ``mla-runtime hash PATH``.

A GGUF model's weight files are its ``.gguf`` file or split parts, and its manifest the ``SHA256SUMS`` of their folder.

``verify`` hashes every ``*.safetensors`` file and raises ``WeightsMismatch`` naming the first file whose
digest differs from the manifest (or that the manifest lacks). ``fingerprint`` folds the manifest into 16 hex
digits: two folders with the same fingerprint hold the same weights, so a rollback shows in the start-up log
and in ``mla_model_info``.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import sys
from collections.abc import Sequence
from pathlib import Path

MANIFEST = "SHA256SUMS"
CHUNK = 8 << 20  # bytes read at a time
_HEX64 = re.compile(r"[0-9a-f]{64}")


class WeightsMismatch(ValueError):
    """A weight file's sha256 differs from the checkpoint's manifest (or the manifest lacks it)."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def weight_files(folder: Path) -> list[Path]:
    """The ``*.safetensors`` files of a checkpoint folder, or the file(s) of a GGUF model (``gguf_meta.gguf_files``:
    a ``.gguf`` file, its split parts, or a folder holding one)."""
    from mla_runtime.gguf_meta import gguf_files

    gguf = gguf_files(folder)
    return gguf if gguf is not None else sorted(folder.glob("*.safetensors"))


def manifest_path(path: Path) -> Path:
    """Where the manifest of a checkpoint folder (or of a GGUF file: its folder's) lies."""
    return (path.parent if path.is_file() else path) / MANIFEST


def hub_manifest(folder: Path) -> dict[str, str] | None:
    """The hub's LFS sha256 of each weight file of a hub-cache snapshot (None: not such a snapshot)."""
    out = {}
    for f in weight_files(folder):
        if not f.is_symlink():
            return None
        blob = Path(f.readlink()).name
        if _HEX64.fullmatch(blob) is None or Path(f.resolve()).parent.name != "blobs":
            return None
        out[f.name] = blob
    return out or None


def read_manifest(folder: Path) -> tuple[dict[str, str], str] | None:
    """(file name → sha256, where it came from), or None when the folder has no manifest."""
    hub = hub_manifest(folder)
    if hub is not None:
        return hub, "the hub's LFS hashes"
    path = manifest_path(folder)
    if not path.is_file():
        return None
    out = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        digest, _, name = line.strip().partition(" ")
        name = name.strip().lstrip("*")
        if _HEX64.fullmatch(digest.lower()) is None or not name:
            raise ValueError(f"{path}:{n}: expected '<sha256 hex>  <file name>', got {line.strip()[:80]!r}")
        out[name] = digest.lower()
    return out, str(path)


def fingerprint(manifest: dict[str, str]) -> str:
    """16 hex digits standing for the whole set of weight files (their names and hashes)."""
    text = "".join(f"{digest}  {name}\n" for name, digest in sorted(manifest.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def verify(folder: str | Path) -> str:
    """Hash every ``*.safetensors`` file of ``folder`` against its manifest; the fingerprint when all match."""
    folder = Path(folder)
    found = read_manifest(folder)
    if found is None:
        raise WeightsMismatch(f"--verify-weights: {folder} has no sha256 manifest (no hub LFS hashes and no "
                              f"{MANIFEST}); write one with `mla-runtime hash {folder}`")
    manifest, source = found
    files = weight_files(folder)
    if not files:
        raise WeightsMismatch(f"--verify-weights: {folder} has no *.safetensors files")
    for f in files:
        want = manifest.get(f.name)
        if want is None:
            raise WeightsMismatch(f"--verify-weights: {f.name} is not in the manifest ({source})")
        got = sha256_file(f)
        if got != want:
            raise WeightsMismatch(f"--verify-weights: {f.name} does not match the manifest ({source}): sha256 "
                                  f"{got}, expected {want}; the file is corrupt or not the published one")
    return fingerprint({f.name: manifest[f.name] for f in files})


def manifest_fingerprint(folder: str | Path) -> str | None:
    """The fingerprint the manifest claims, without reading the weights (None: no manifest for every file)."""
    folder = Path(folder)
    found = read_manifest(folder)
    files = weight_files(folder)
    if found is None or not files or any(f.name not in found[0] for f in files):
        return None
    return fingerprint({f.name: found[0][f.name] for f in files})


def write_manifest(folder: str | Path) -> Path:
    """Hash every ``*.safetensors`` file of ``folder`` (or the GGUF file(s) it names) into the folder's
    ``SHA256SUMS``; the lines of other files already there (another GGUF model of the folder) are kept."""
    folder = Path(folder)
    files = weight_files(folder)
    if not files:
        raise ValueError(f"{folder}: no *.safetensors files to hash")
    path = manifest_path(folder)
    old = read_manifest(folder) if path.is_file() else None
    lines = {} if old is None else dict(old[0])
    lines.update({f.name: sha256_file(f) for f in files})
    path.write_text("".join(f"{digest}  {name}\n" for name, digest in sorted(lines.items())))
    return path


def main(argv: Sequence[str] | None = None, prog: str = "mla-runtime hash") -> int:
    p = argparse.ArgumentParser(prog=prog, description="Write a checkpoint folder's sha256 manifest (SHA256SUMS), "
                                                       "which `serve --verify-weights` checks before loading.")
    p.add_argument("path", help="checkpoint folder with *.safetensors files, or a GGUF file")
    p.add_argument("--check", action="store_true", help="verify the files against the existing manifest instead")
    args = p.parse_args(argv)
    folder = Path(args.path).expanduser()
    if not folder.is_dir() and not folder.is_file():
        print(f"{prog}: error: {folder} is not a folder or a file", file=sys.stderr)
        return 2
    try:
        if args.check:
            print(f"{folder}: every weight file matches its manifest; fingerprint {verify(folder)}")
            return 0
        path = write_manifest(folder)
    except (OSError, ValueError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {path} ({len(weight_files(folder))} files); fingerprint {manifest_fingerprint(folder)}")
    return 0
