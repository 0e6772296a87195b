"""Regenerate the committed gRPC stubs of every service, or check that they are up to date.

python -m embedding_store.proto.generate          # rewrite the stubs
python -m embedding_store.proto.generate --check  # exit 1 if any is stale

The services: the embedding store's and the prediction server's (the Open Inference
Protocol, ``serving/proto``). Stubs are committed so that neither an install nor an
import runs protoc; ``make proto-check`` (in ``make test``) catches a stale one.

>>> [s.outputs[0] for s in STUBS]
['embedding_store/proto/embedding_store_pb2.py', 'serving/proto/grpc_predict_v2_pb2.py']
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Final

ROOT = Path(__file__).parents[2]

# What protoc writes to load a module's descriptors into the process-wide pool, and what a
# stub of its own pool loads them into instead.
_DEFAULT_POOL: Final = "DESCRIPTOR = _descriptor_pool.Default().AddSerializedFile("
_OWN_POOL: Final = (
    "# streamrec: a descriptor pool of this module's own (see embedding_store/proto/generate.py)\n"
    "DESCRIPTOR = _descriptor_pool.DescriptorPool().AddSerializedFile("
)


@dataclass(frozen=True)
class Stubs:
    """One .proto (a path relative to the repository root) and the stubs made of it.

    ``own_pool``: load the descriptors into a pool of the module's own rather than
    protobuf's process-wide one. The Open Inference Protocol's messages are named
    ``inference.*`` by the spec, and so are those of the clients' stubs
    (``tritonclient.grpc``, KServe's): in the shared pool, importing two of them in one
    process fails ("duplicate symbol 'inference.ServerLiveRequest'"). The wire format
    does not depend on the pool.
    """

    proto: str
    own_pool: bool = False

    @property
    def outputs(self) -> tuple[str, str, str]:
        """The stubs' paths, relative to the repository root."""
        stem = self.proto.removesuffix(".proto")
        return f"{stem}_pb2.py", f"{stem}_pb2.pyi", f"{stem}_pb2_grpc.py"


STUBS: tuple[Stubs, ...] = (
    Stubs("embedding_store/proto/embedding_store.proto"),
    Stubs("serving/proto/grpc_predict_v2.proto", own_pool=True),
)


def _own_pool(path: Path) -> None:
    text = path.read_text()
    if text.count(_DEFAULT_POOL) != 1:
        msg = (
            f"{path.name}: expected protoc's line {_DEFAULT_POOL!r} once, found it "
            f"{text.count(_DEFAULT_POOL)} times; grpcio-tools changed its output"
        )
        raise RuntimeError(msg)
    path.write_text(text.replace(_DEFAULT_POOL, _OWN_POOL))


def generate(stubs: Stubs, out_root: Path, root: Path | None = None) -> None:
    """Run protoc on ``stubs.proto`` (under ``root``, default :data:`ROOT`), writing the
    stubs under ``out_root`` at their paths relative to the root."""
    from grpc_tools import protoc  # a dev dependency, needed only here

    args = [
        "grpc_tools.protoc",
        f"-I{root or ROOT}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        stubs.proto,
    ]
    if protoc.main(args) != 0:
        msg = f"protoc failed on {stubs.proto}"
        raise RuntimeError(msg)
    if stubs.own_pool:
        _own_pool(out_root / stubs.outputs[0])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args(argv)
    root = ROOT  # read at call time: the tests point it at a copy
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp)
        for stubs in STUBS:
            generate(stubs, fresh, root)
        outputs = [name for stubs in STUBS for name in stubs.outputs]
        if args.check:
            stale = [
                name
                for name in outputs
                if not (root / name).exists()
                or not filecmp.cmp(fresh / name, root / name, shallow=False)
            ]
            if stale:
                print(
                    f"stale gRPC stubs: {', '.join(stale)}; run `make proto` and commit them",
                    file=sys.stderr,
                )
                return 1
            print("gRPC stubs are up to date")
            return 0
        for name in outputs:
            shutil.copyfile(fresh / name, root / name)
        print(f"wrote {', '.join(outputs)}")
        return 0


if __name__ == "__main__":
    sys.exit(main())
