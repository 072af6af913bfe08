#!/usr/bin/env bash
# Run HERE (a machine with network), before a session on a lent GPU machine: fills .whl/ with
# the wheels tests/device/run.sh installs THERE, where nothing can be downloaded.
#
# The device image (/work/.library/device/KINDS.md: Python 3.12, x86-64, torch 2.11+cu130,
# pytest, numpy, typer, rich, safetensors, packaging, pluggy, pathspec, ... preinstalled) lacks
# these runtime dependencies of casckpt (pyproject.toml) and of its deepspeed and megatron
# extras. One version each (two of one name stop the whole install), pinned to the versions the
# CPU suite passes with; cp312 manylinux x86-64 binaries only, no dependencies resolved (each
# is named here). hatchling and trove-classifiers build casckpt's own metadata there (its
# storage backends are entry points: a checkout on PYTHONPATH alone registers none).
#
# Usage: PYTHON=/path/to/python tests/device/wheels.sh   (any Python with pip; network needed)
# Then carry .whl to the device call: run(command="bash tests/device/run.sh", carry=[".whl"]).
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
DEST=.whl
DEEPSPEED=deepspeed==0.19.8

WHEELS=(
    # casckpt (pyproject.toml [project] dependencies) and what they need
    blake3==1.0.11 zstandard==0.25.0 lmdb==3.0.0 pyeclib==1.8.0 pyfastcdc==0.3.1
    SQLAlchemy==2.1.9 alembic==1.20.1 Mako==1.4.3
    cryptography==51.0.1 cffi==2.1.1 pycparser==3.12
    boto3==1.44.18 botocore==1.44.18 s3transfer==0.19.3 jmespath==1.1.0
    # the megatron extra
    megatron-core==0.16.1
    # the deepspeed extra's needs (DeepSpeed itself: built below, it publishes no wheel)
    hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
    # casckpt's build backend, for its metadata on the device
    hatchling==1.33.0 trove-classifiers==2026.9.21.13 tomlkit==0.15.3
    # in the image, but maybe older than these need (pydantic: typing-extensions>=4.16;
    # hatchling, megatron-core: packaging>=24.2): on PYTHONPATH they come first
    typing-extensions==4.16.0 packaging==26.4
)

platforms=(--platform manylinux1_x86_64 --platform manylinux2010_x86_64 --platform manylinux2014_x86_64)
for n in $(seq 17 39); do  # the device runs Ubuntu 24.04 (glibc 2.39); pip matches each N exactly
    platforms+=(--platform "manylinux_2_${n}_x86_64")
done

rm -rf "$DEST"
mkdir -p "$DEST"
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --abi cp312 --abi abi3 --abi none "${platforms[@]}" -d "$DEST" "${WHEELS[@]}"

# DeepSpeed: an sdist only. Built in pip's isolated environment (no torch there: no ops are
# compiled ahead, the device compiles what it needs), it is pure Python.
build=$(mktemp -d)
trap 'rm -rf "$build"' EXIT
"$PYTHON" -m pip wheel --quiet --no-deps --no-binary=deepspeed -w "$build" "$DEEPSPEED" >"$build/log" 2>&1 \
    || { tail -40 "$build/log"; exit 1; }
built=("$build"/deepspeed-*.whl)
case "${built[0]##*/}" in
    *-py3-none-any.whl) mv "${built[0]}" "$DEST/" ;;
    *) echo "DeepSpeed built ${built[0]##*/}, not a py3-none-any wheel" >&2; exit 1 ;;
esac

# one version of each name
names=$(for f in "$DEST"/*.whl; do f=${f##*/}; echo "${f%%-*}" | tr 'A-Z_.' 'a-z--'; done)
dups=$(sort <<<"$names" | uniq -d)
[ -z "$dups" ] || { echo "two versions of: $dups" >&2; exit 1; }
[ "$(wc -l <<<"$names")" -eq $((${#WHEELS[@]} + 1)) ] || { echo "a wheel is missing" >&2; ls "$DEST"; exit 1; }

ls -1 "$DEST"
echo "wheels: $(du -sh "$DEST" | cut -f1); tracked tree: $(git ls-files -z | du -ch --files0-from=- | tail -1 | cut -f1)" \
    "(the device call carries both: at most 64 MiB)"
