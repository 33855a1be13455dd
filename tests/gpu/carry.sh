#!/usr/bin/env bash
# The wheels a GPU machine's image lacks (Python 3.12, torch and numpy of its own, no package registry), fetched
# here into .gpu-wheels/ to travel with the code. On the GPU machine, tests/gpu/device.sh installs them into a
# scratch folder on PYTHONPATH, leaving the image's torch and numpy as they are. Versions from requirements.lock
# (python-rapidjson: the newest with a wheel for that Python).
set -euo pipefail
cd "$(dirname "$0")/../.."
pin() { grep -i "^$1==" requirements.lock | cut -d= -f3; }
rm -rf .gpu-wheels && mkdir -p .gpu-wheels
python -m pip download -q --no-deps --only-binary=:all: --python-version "${PYTHON_VERSION:-3.12}" \
  --platform manylinux_2_35_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform any \
  -d .gpu-wheels "tritonclient==$(pin tritonclient)" "nvidia-pytriton==$(pin nvidia-pytriton)" \
  python-rapidjson "torchao==$(pin torchao)"
du -sh .gpu-wheels && ls .gpu-wheels
