"""The dspark.v1 protobuf and gRPC stubs, generated from `serve/proto` by grpcio-tools.

The stubs are build output, never committed: `scripts/setup.sh` generates them
(`python -m serve.protos`) into `serve/_generated/` with the .proto's hash beside them, and
`load()` generates them again whenever the .proto changed since, so they are never stale.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import sys
import tempfile
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent / "proto"
PROTO_FILE = "dspark/v1/dspark.proto"
OUT_DIR = Path(__file__).resolve().parent / "_generated"
SERVICE_NAME = "dspark.v1.DSpark"


def proto_hash() -> str:
    return hashlib.sha256((PROTO_ROOT / PROTO_FILE).read_bytes()).hexdigest()


def generate(out_dir: Path = OUT_DIR) -> Path:
    """Run protoc (python, grpc and .pyi outputs) into `out_dir`; files are replaced atomically so
    two processes generating at once never see a half-written stub."""
    import grpc_tools
    from grpc_tools import protoc

    well_known = Path(grpc_tools.__file__).resolve().parent / "_proto"
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir.parent, prefix=".protos-") as tmp:
        args = ["grpc_tools.protoc", f"-I{PROTO_ROOT}", f"-I{well_known}", f"--python_out={tmp}",
                f"--grpc_python_out={tmp}", f"--pyi_out={tmp}", PROTO_FILE]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {PROTO_ROOT / PROTO_FILE}")
        Path(tmp, "HASH").write_text(proto_hash())
        for root, _, files in os.walk(tmp):
            rel = Path(root).relative_to(tmp)
            (out_dir / rel).mkdir(parents=True, exist_ok=True)
            for name in sorted(files, key=lambda n: n == "HASH"):  # the hash last: it marks completion
                os.replace(Path(root, name), out_dir / rel / name)
    return out_dir


def load():
    """(pb2, pb2_grpc): the generated modules, regenerated first if the .proto changed."""
    stamp = OUT_DIR / "HASH"
    if not stamp.exists() or stamp.read_text() != proto_hash():
        generate()
    if str(OUT_DIR) not in sys.path:
        sys.path.insert(0, str(OUT_DIR))  # the stubs import each other as `dspark.v1.*`
    pb2 = importlib.import_module("dspark.v1.dspark_pb2")
    pb2_grpc = importlib.import_module("dspark.v1.dspark_pb2_grpc")
    return pb2, pb2_grpc


if __name__ == "__main__":
    print(f"generated {generate()} from {PROTO_ROOT / PROTO_FILE}")
