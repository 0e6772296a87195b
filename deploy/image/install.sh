#!/bin/sh
# Every step that puts streamrec into its container image, as one script: the
# Dockerfile (deploy/image/Dockerfile) RUNs these steps and nothing else installs
# Python packages there; tests/deploy/test_image.py runs the very same steps on a
# plain machine, so the image cannot drift from what is tested.
#
#   install.sh torch   VENV VARIANT   create the virtualenv VENV and install torch
#                                     (pinned: $TORCH_VERSION) for VARIANT, cpu or cuda
#   install.sh project VENV SRC       build the streamrec wheel from the source tree SRC
#                                     and install it with its runtime dependencies
#                                     (no test/dev extras); torch stays as installed
#   install.sh check   VENV           smoke check: every role's command answers --help
#                                     and the heavy dependencies import
#
# Environment:
#   PYTHON           the interpreter the venv is made from (default: python3)
#   TORCH_VERSION    default 2.13.0, as in the Makefile's TORCH_SPEC
#   TORCH_INDEX_URL  where torch comes from. Unset or empty: the variant's default
#                    (cpu: https://download.pytorch.org/whl/cpu, torch's CPU-only wheel;
#                    cuda: pip's own index, i.e. PyPI, whose torch wheels are the CUDA
#                    build and bring the CUDA libraries as nvidia-* wheels). "default":
#                    pip's own configured index whatever the variant (the tests use
#                    this where download.pytorch.org is out of reach). Anything else:
#                    that index URL.
#   PIP_*            pip's own settings pass through (PIP_NO_COMPILE, PIP_INDEX_URL, ...).
set -eu

PYTHON="${PYTHON:-python3}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
CPU_INDEX_URL="https://download.pytorch.org/whl/cpu"

die() {
    echo "install.sh: $*" >&2
    exit 2
}

usage() {
    die "usage: install.sh torch VENV cpu|cuda | project VENV SRC | check VENV"
}

say() {
    echo "install.sh: $*"
}

# torch VENV VARIANT
step_torch() {
    venv="$1"
    variant="$2"
    case "$variant" in
        cpu) default_index="$CPU_INDEX_URL" ;;
        cuda) default_index="default" ;;
        *) die "unknown variant '$variant' (cpu or cuda)" ;;
    esac
    index="${TORCH_INDEX_URL:-$default_index}"
    say "torch==$TORCH_VERSION ($variant) from $index, into a new venv $venv"
    "$PYTHON" -m venv "$venv"
    # torch first and pinned: the project's `torch>=2.2` is then already satisfied and
    # pip never swaps in another build (an unpinned torch pulls gigabytes of CUDA wheels).
    if [ "$index" = "default" ]; then
        "$venv/bin/python" -m pip install "torch==$TORCH_VERSION"
    else
        "$venv/bin/python" -m pip install --index-url "$index" "torch==$TORCH_VERSION"
    fi
    # The variant is what the wheel is, not what it was called: a CUDA build in the cpu
    # image would be gigabytes of dead weight, a CPU build in the cuda image useless.
    "$venv/bin/python" - "$variant" <<'EOF'
import sys

import torch

variant = sys.argv[1]
cuda = torch.version.cuda
print(f"install.sh: torch {torch.__version__}, CUDA {cuda or 'none'}")
if (variant == "cpu") != (cuda is None):
    sys.exit(f"install.sh: the {variant} variant got torch {torch.__version__} (CUDA {cuda})")
EOF
}

# project VENV SRC
step_project() {
    venv="$1"
    src="$2"
    [ -f "$src/pyproject.toml" ] || die "$src has no pyproject.toml"
    py="$venv/bin/python"
    [ -x "$py" ] || die "$venv is not a virtualenv (run the torch step first)"
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' EXIT
    say "wheel of $src"
    "$py" -m pip wheel --no-deps --wheel-dir "$work/dist" "$src"
    # The installed torch, exactly (local version label included), as a constraint:
    # pip fails rather than replacing it if a dependency ever asks for another one.
    "$py" -c 'import importlib.metadata as m; print("torch==" + m.version("torch"))' \
        >"$work/constraints.txt"
    say "$(ls "$work/dist") with its runtime dependencies ($(cat "$work/constraints.txt"))"
    "$py" -m pip install --constraint "$work/constraints.txt" "$work"/dist/streamrec-*.whl
    "$py" -m pip check
}

# check VENV
step_check() {
    venv="$1"
    bin="$venv/bin"
    [ -x "$bin/streamrec" ] || die "$bin/streamrec is missing"
    # Run from an empty folder with no PYTHONPATH: the packages must come from the venv,
    # never from a source tree in the working directory.
    here="$(mktemp -d)"
    trap 'rm -rf "$here"' EXIT
    cd "$here"
    unset PYTHONPATH
    say "check $bin/streamrec"
    for cmd in "" "store serve" "store health" "run" "dask scheduler" "dask worker" "torchrun"; do
        # shellcheck disable=SC2086  # $cmd is words on purpose
        "$bin/streamrec" $cmd --help >"$here/out" 2>&1 || {
            cat "$here/out" >&2
            die "'streamrec${cmd:+ $cmd} --help' failed"
        }
        say "streamrec${cmd:+ $cmd} --help: ok"
    done
    "$bin/python" - "$venv" <<'EOF'
import importlib
import os
import sys

venv = os.path.realpath(sys.argv[1])
for name in ["torch", "dask", "distributed", "grpc", "numba", "pyarrow", "kafka"]:
    importlib.import_module(name)
for name in ["pipeline", "embedding_store", "trainer", "connectors", "deploy", "monitoring"]:
    where = os.path.realpath(importlib.import_module(name).__file__)
    if not where.startswith(venv + os.sep):
        sys.exit(f"install.sh: {name} imports from {where}, not from {venv}")
# Package data the code reads at run time (the Dask dashboard's streamrec page).
from importlib import resources

for package, name in [("monitoring", "page.html")]:
    if not resources.files(package).joinpath(name).is_file():
        sys.exit(f"install.sh: {package}/{name} is not installed (pyproject's package-data)")
import torch

print(f"install.sh: imports ok (torch {torch.__version__}, CUDA {torch.version.cuda or 'none'})")
EOF
}

[ $# -ge 1 ] || usage
step="$1"
shift
case "$step" in
    torch) [ $# -eq 2 ] || usage; step_torch "$@" ;;
    project) [ $# -eq 2 ] || usage; step_project "$@" ;;
    check) [ $# -eq 1 ] || usage; step_check "$@" ;;
    *) usage ;;
esac
