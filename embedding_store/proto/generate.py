"""Regenerate the committed gRPC stubs, or check that they are up to date.

python -m embedding_store.proto.generate          # rewrite the stubs
python -m embedding_store.proto.generate --check  # exit 1 if they are stale
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

PROTO = Path(__file__).with_name("embedding_store.proto")
ROOT = PROTO.parents[2]
OUTPUTS = ("embedding_store_pb2.py", "embedding_store_pb2.pyi", "embedding_store_pb2_grpc.py")


def generate(out_root: Path) -> Path:
    """Run protoc into ``out_root``; returns the folder holding the stubs."""
    from grpc_tools import protoc  # a dev dependency, needed only here

    rel = PROTO.relative_to(ROOT)
    args = [
        "grpc_tools.protoc",
        f"-I{ROOT}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        str(rel),
    ]
    if protoc.main(args) != 0:
        msg = f"protoc failed on {rel}"
        raise RuntimeError(msg)
    return out_root / rel.parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        here = PROTO.parent
        if args.check:
            stale = [
                n
                for n in OUTPUTS
                if not (here / n).exists() or not filecmp.cmp(fresh / n, here / n, shallow=False)
            ]
            if stale:
                print(
                    f"stale gRPC stubs: {', '.join(stale)}; run `make proto` and commit them",
                    file=sys.stderr,
                )
                return 1
            print("gRPC stubs are up to date")
            return 0
        for n in OUTPUTS:
            shutil.copyfile(fresh / n, here / n)
        print(f"wrote {', '.join(OUTPUTS)} to {here}")
        return 0


if __name__ == "__main__":
    sys.exit(main())
