#!/bin/bash
# bench/rates_gpu.py on the GPU machine, in one device call, from the repository root with $OUT set:
#     bash bench/rates_gpu.sh [rates_gpu.py options]
# Needs, prepared here and carried as .whl (ignored: `echo /.whl/ >> .git/info/exclude`):
#     /work/shared/device/make-wheels .whl/rates cffi pyelftools orjson textual xxhash prometheus-client nvidia-ml-py
#     .venv/bin/python -m pip wheel --no-deps -w .whl/rates/dist .
# Installs the dependencies and the project's wheel (its prebuilt BPF object, shim and calibration
# target: no bcc, compiler or kernel headers there) under /tmp/site, then lays the working tree's
# Python over the wheel's (RATES_OVERLAY=0: not), so the estimator measured is the one in the tree
# sent, whenever the wheel was built; if the tree's modules do not import, the wheel's own are put
# back and it says so. Mounts tracefs. The log is $OUT/log.txt; the table ends it. The native part
# builds bench/native_launches.cu there with the machine's nvcc (`--native ''` leaves it out;
# `--top-jobs ''` leaves out the three jobs under `top --once`).
set -uo pipefail
: "${OUT:?set OUT}"
t0=$(date +%s)
mountpoint -q /sys/kernel/tracing || mount -t tracefs nodev /sys/kernel/tracing 2>/dev/null || true
whl=(.whl/rates/dist/gputrace-*.whl)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/rates/wheels/*.whl "${whl[@]}" || { echo "rates_gpu.sh: wheels did not install"; exit 1; }
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
overlay() {
    python3 - <<'EOF'
import pathlib, shutil, tomllib
cfg = tomllib.load(open("pyproject.toml", "rb"))["tool"]["setuptools"]
dirs, n = cfg["package-dir"], 0
for pkg in cfg["packages"]:
    parts = pkg.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in dirs:
            src = pathlib.Path(dirs[".".join(parts[:i])], *parts[i:])
            break
    dst = pathlib.Path("/tmp/site", *parts)
    for f in src.glob("*.py"):
        shutil.copy2(f, dst / f.name)
        n += 1
print(f"rates_gpu.sh: {n} modules of the working tree laid over the wheel's")
EOF
}
if [ "${RATES_OVERLAY:-1}" = 1 ]; then
    overlay
    # (from /tmp: python3 -c puts the working directory first, and the tree's gputrace/ is not the package)
    if ! (cd /tmp && python3 -c "import gputrace.cli, gputrace.commands.attach, gputrace.tracer.session, gputrace.tracer.estimator"); then
        echo "rates_gpu.sh: the working tree's modules do not import: the wheel's own put back"
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --force-reinstall \
            --target /tmp/site "${whl[@]}"
    fi
fi
(cd /tmp && python3 - <<'EOF'
import hashlib, pathlib
import gputrace.tracer.estimator as e
print("rates_gpu.sh: estimator", e.__file__, hashlib.sha256(pathlib.Path(e.__file__).read_bytes()).hexdigest()[:12])
EOF
)
timeout 60 gputrace doctor 2>&1 | tail -n 25
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader 2>&1
echo "rates_gpu.sh: set up in $(( $(date +%s) - t0 )) s"
mkdir -p /tmp/rates
python3 bench/rates_gpu.py --out "$OUT" --raw /tmp/rates/raw "$@" 2>&1 | tee "$OUT/log.txt"
