# Source on the GPU machine (no package access) from the repository root, after preparing here:
#   /work/shared/device/make-bcc-bundle .gpu/bcc
#   /work/shared/device/make-wheels .gpu/wheels cffi pyelftools orjson textual xxhash prometheus-client nvidia-ml-py
#   python -m build --wheel -o .gpu/dist .
# and carrying .gpu. Installs bcc, the dependencies and gputrace under /tmp, for this shell.
# CRIU (bench/make-criu-bundle .gpu/criu) with the bcc bundle passes the 64 MiB a device call
# carries: carry it as .gpu/criu.tar.xz (tar -C .gpu -cJf .gpu/criu.tar.xz criu, about 4 MiB, and
# move .gpu/criu aside); it is unpacked here.
if [ -f .gpu/criu.tar.xz ] && [ ! -x .gpu/criu/criu ]; then tar -C .gpu -xJf .gpu/criu.tar.xz; fi
source .gpu/bcc/enter.sh
source .gpu/wheels/install.sh
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .gpu/dist/gputrace-*.whl
export PATH=/tmp/site/bin:$PATH
