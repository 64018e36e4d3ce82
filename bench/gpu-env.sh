# Source on the GPU machine (no package access) from the repository root, after preparing here:
#   /work/shared/device/make-bcc-bundle .gpu/bcc
#   /work/shared/device/make-wheels .gpu/wheels cffi pyelftools orjson textual xxhash prometheus-client nvidia-ml-py
#   python -m build --wheel -o .gpu/dist .
# and carrying .gpu. Installs bcc, the dependencies and gputrace under /tmp, for this shell.
source .gpu/bcc/enter.sh
source .gpu/wheels/install.sh
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .gpu/dist/gputrace-*.whl
export PATH=/tmp/site/bin:$PATH
