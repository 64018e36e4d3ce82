# Source on the GPU machine (no package access) from the repository root, after preparing here:
#   /work/shared/device/make-bcc-bundle .gpu/bcc
#   /work/shared/device/make-wheels .gpu/wheels cffi pyelftools orjson textual xxhash prometheus-client nvidia-ml-py
#   python -m build --wheel -o .gpu/dist .
# and carrying .gpu. Installs bcc, the dependencies and gputrace under /tmp, for this shell.
# CRIU (bench/make-criu-bundle .gpu/criu) with the bcc bundle passes the 64 MiB a device call
# carries: carry it as .gpu/criu.tar.xz (tar -C .gpu -cJf .gpu/criu.tar.xz criu, about 4 MiB, and
# move .gpu/criu aside); it is unpacked here.
if [ -f .gpu/criu.tar.xz ] && [ ! -x .gpu/criu/criu ]; then tar -C .gpu -xJf .gpu/criu.tar.xz; fi
# The project's wheel needs no bcc (its BPF object is prebuilt); the bundle is only sourced where it was
# brought (the bcc fallback). Without it, tracefs is mounted here, as enter.sh would.
if [ -f .gpu/bcc/enter.sh ]; then
    source .gpu/bcc/enter.sh
else
    mountpoint -q /sys/kernel/tracing || mount -t tracefs nodev /sys/kernel/tracing 2>/dev/null || true
fi
source .gpu/wheels/install.sh
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .gpu/dist/gputrace-*.whl
export PATH=/tmp/site/bin:$PATH
[ -x .gpu/criu/criu ] && export GPUTRACE_CRIU=${GPUTRACE_CRIU:-$PWD/.gpu/criu/criu}
