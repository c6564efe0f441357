"""Regenerate protos/*_pb2*.py from protos/*.proto (`make protos`).

Generated with grpcio-tools 1.84.0: stubs from grpcio-tools N refuse to import under a grpcio older
than N, and the GPU image has grpcio 1.84.0.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def generate(out_dir: Path = ROOT) -> None:
    from grpc_tools import protoc

    for proto in sorted((ROOT / "protos").glob("*.proto")):
        rel = proto.relative_to(ROOT)
        args = [
            "grpc_tools.protoc",
            f"-I{ROOT}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            str(rel),
        ]
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed on {rel}")


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
