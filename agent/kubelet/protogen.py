"""Regenerate the betterproto/grpclib code in `agent/kubelet/_protos` from our `.proto` files.

``python -m agent.kubelet.protogen`` (what ``make protos`` runs) rewrites the generated tree;
``python -m agent.kubelet.protogen --check`` exits 1 and names the files when the committed code differs
from a fresh generation. Generation runs ``python -m grpc_tools.protoc`` with the betterproto
plugin (``protoc-gen-python_betterproto``) taken from the running interpreter's ``bin``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from agent.core.errors import AgentError

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = REPO_ROOT / "protos"
OUTPUT_DIR = REPO_ROOT / "agent" / "kubelet" / "_protos"
PROTO_FILES = (
    "pluginregistration/api.proto",
    "dra/v1/api.proto",
    "dra/v1beta1/api.proto",
    "dra_health/v1/api.proto",
    "dra_health/v1alpha1/api.proto",
    "podresources/v1/api.proto",
)
PLUGIN = "protoc-gen-python_betterproto"


class ProtoGenError(AgentError):
    """Code generation could not run or failed."""


@dataclass(frozen=True)
class Difference:
    """How the committed tree differs from a fresh generation (paths relative to the output dir)."""

    missing: tuple[str, ...] = ()
    extra: tuple[str, ...] = ()
    changed: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.missing or self.extra or self.changed)

    def describe(self) -> str:
        parts = [f"{label}: {', '.join(names)}" for label, names in self._groups() if names]
        return "; ".join(parts)

    def _groups(self) -> tuple[tuple[str, tuple[str, ...]], ...]:
        return (("missing", self.missing), ("not generated", self.extra), ("changed", self.changed))


def generate(out_dir: Path, proto_root: Path = PROTO_ROOT, files: Sequence[str] = PROTO_FILES) -> None:
    """Run protoc with the betterproto plugin, writing the Python packages under `out_dir`."""
    bin_dir = Path(sys.executable).parent
    if shutil.which(PLUGIN, path=str(bin_dir)) is None and shutil.which(PLUGIN) is None:
        raise ProtoGenError(
            f"{PLUGIN} not found next to {sys.executable} or on PATH; "
            "install the dev extras: pip install -e '.[dev]'"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    cmd = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"-I{proto_root}",
        f"--python_betterproto_out={out_dir}",
        *(str(proto_root / f) for f in files),
    ]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise ProtoGenError(
            f"protoc failed (exit {result.returncode}): {result.stderr.strip() or result.stdout.strip()}"
        )


def _tree(root: Path) -> dict[str, bytes]:
    if not root.is_dir():
        return {}
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


def compare(committed: Path, fresh: Path) -> Difference:
    """Compare two generated trees file by file."""
    old, new = _tree(committed), _tree(fresh)
    return Difference(
        missing=tuple(sorted(new.keys() - old.keys())),
        extra=tuple(sorted(old.keys() - new.keys())),
        changed=tuple(sorted(k for k in old.keys() & new.keys() if old[k] != new[k])),
    )


def check(output_dir: Path = OUTPUT_DIR, proto_root: Path = PROTO_ROOT) -> Difference:
    """Generate into a temporary directory and compare with `output_dir`."""
    with tempfile.TemporaryDirectory(prefix="protogen-") as tmp:
        fresh = Path(tmp)
        generate(fresh, proto_root)
        return compare(output_dir, fresh)


def regenerate(output_dir: Path = OUTPUT_DIR, proto_root: Path = PROTO_ROOT) -> Difference:
    """Replace `output_dir` with a fresh generation; returns what changed."""
    with tempfile.TemporaryDirectory(prefix="protogen-") as tmp:
        fresh = Path(tmp) / "out"
        generate(fresh, proto_root)
        diff = compare(output_dir, fresh)
        if diff or not output_dir.is_dir():
            # Generate aside first so a failed protoc run never leaves a half-written tree.
            if output_dir.exists():
                shutil.rmtree(output_dir)
            shutil.copytree(fresh, output_dir)
        return diff


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m agent.kubelet.protogen", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--check", action="store_true", help="fail when the committed code differs from a fresh generation"
    )
    args = parser.parse_args(argv)
    try:
        if args.check:
            diff = check(OUTPUT_DIR)
            if diff:
                print(
                    f"generated code in {OUTPUT_DIR} is out of date ({diff.describe()}); "
                    "run 'make protos' and commit the result",
                    file=sys.stderr,
                )
                return 1
            print(f"{OUTPUT_DIR} is up to date")
            return 0
        diff = regenerate(OUTPUT_DIR)
        print(f"regenerated {OUTPUT_DIR}" + (f" ({diff.describe()})" if diff else " (no changes)"))
        return 0
    except ProtoGenError as exc:
        print(f"protogen: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
