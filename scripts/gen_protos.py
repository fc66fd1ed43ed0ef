"""Regenerate the Python modules for proto/wakegate/**.proto (committed; checked in tests)."""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent / "proto"


def generate(out_dir: Path = ROOT) -> None:
    protos = sorted(str(p.relative_to(ROOT)) for p in ROOT.rglob("*.proto"))
    include = str(Path(protoc.__file__).parent / "_proto")
    for proto in protos:
        rc = protoc.main(
            [
                "protoc",
                f"-I{ROOT}",
                f"-I{include}",
                f"--python_out={out_dir}",
                f"--pyi_out={out_dir}",
                f"--grpc_python_out={out_dir}",
                proto,
            ]
        )
        if rc != 0:
            raise SystemExit(f"protoc failed on {proto}")


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
