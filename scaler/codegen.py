"""Generate the Python for ``externalscaler.proto`` (committed; ``make proto``), and check it is current.

The generated files are committed so that running kvgate never needs grpcio-tools; ``make test``
regenerates them into a temporary folder and fails if they differ from the committed ones.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO = "scaler/externalscaler.proto"
OUTPUTS = ("externalscaler_pb2.py", "externalscaler_pb2.pyi", "externalscaler_pb2_grpc.py")


def generate(out_root: Path) -> list[Path]:
    from grpc_tools import protoc

    (out_root / "scaler").mkdir(parents=True, exist_ok=True)
    args = ["protoc", f"-I{ROOT}", f"--python_out={out_root}", f"--pyi_out={out_root}",
            f"--grpc_python_out={out_root}", str(ROOT / PROTO)]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTO}")
    return [out_root / "scaler" / name for name in OUTPUTS]


def stale() -> list[str]:
    """Names of the committed generated files that differ from a fresh generation."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        return [f.name for f in fresh if not (ROOT / "scaler" / f.name).is_file()
                or (ROOT / "scaler" / f.name).read_bytes() != f.read_bytes()]


def main(argv: list[str]) -> int:
    if argv[:1] == ["--check"]:
        bad = stale()
        if bad:
            print(f"scaler: generated code is stale ({', '.join(bad)}); run: make proto", file=sys.stderr)
            return 1
        print("scaler: generated code is current")
        return 0
    generate(ROOT)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
