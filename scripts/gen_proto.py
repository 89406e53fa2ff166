"""Generate the Python gRPC code for protos/ into protos/python/reducer_wire/_proto.

The virtual include path makes the generated imports read
`from reducer_wire._proto.reducer.v1 import reducer_pb2`, so the code lives
inside the package without rewriting. Usage: python scripts/gen_proto.py [OUT_ROOT]
"""

import pathlib
import sys

from grpc_tools import protoc

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO = "reducer_wire/_proto/reducer/v1/reducer.proto"


def generate(out_root: pathlib.Path) -> None:
    out_root.mkdir(parents=True, exist_ok=True)
    include = protoc._get_resource_file_name("grpc_tools", "_proto")  # well-known types
    args = [
        "protoc",
        f"-Ireducer_wire/_proto={ROOT / 'protos'}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        PROTO,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    for pkg in ("reducer_wire/_proto", "reducer_wire/_proto/reducer",
                "reducer_wire/_proto/reducer/v1"):
        (out_root / pkg / "__init__.py").touch()


if __name__ == "__main__":
    generate(pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "protos" / "python")
