#!/usr/bin/env bash
# On a GPU machine: the carried wheels into a scratch folder first on PYTHONPATH (the image's torch and numpy
# stay), torchship laid out as it installs (the stage folders inside torchship/), the machine named, then the GPU
# run. Arguments go to python -m tests.gpu.run (default: --out $OUT/gpu).
set -euo pipefail
cd "$(dirname "$0")/../.."
CARRY="${CARRY:-/tmp/torchship-carry}"
python3 -m pip install -q --no-deps --no-index --target "$CARRY" .gpu-wheels/*.whl
if [ $# -eq 0 ]; then set -- --out "${OUT:-$PWD/runs}/gpu"; fi
SRC="$CARRY/src"  # the image has no pip build of torchship: its namespace copied as pyproject.toml maps it
rm -rf "$SRC" && mkdir -p "$SRC" && cp -r torchship tests docs "$SRC"/ && cp -r train export serve "$SRC/torchship/"
cd "$SRC"
export PYTHONPATH="$CARRY:$PWD${PYTHONPATH:+:$PYTHONPATH}" PATH="$CARRY/bin:$PATH"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || echo "no nvidia-smi"
python3 -c "import torch, numpy; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'numpy', numpy.__version__)"
exec python3 -m tests.gpu.run "$@"
