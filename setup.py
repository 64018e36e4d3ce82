"""The wheel's build step beyond pyproject.toml: the shim and the probe-cost calibration target are
compiled once here, and the BPF program by clang into a BPF object, all carried in the wheel
(`gputrace/shim/prebuilt`, `gputrace/tracer/prebuilt`, `gputrace/bpf/prebuilt`, each with the key of
its sources), so that a machine that installs the wheel needs no C compiler, no bcc and no kernel
headers to run `gputrace run --checkpointable` or `gputrace attach` (bcc stays the fallback where the
kernel refuses the object). The wheel is therefore a platform wheel; building it needs a C compiler
and clang. GPUTRACE_NO_PREBUILD=1 leaves them out (they are then built at first use, as in a checkout)."""

import os
import subprocess
import sys

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools before 70.1
    from wheel.bdist_wheel import bdist_wheel

# Run with the package as just copied into build_lib: the same build arguments the code uses at run time.
# A build directory kept from an earlier build may hold older copies: they go first.
PREBUILD = """
import shutil, sys
sys.path.insert(0, sys.argv[1])
from gputrace.base import native
from gputrace.base.errors import BuildError
from gputrace import bpf, shim
from gputrace.tracer import calibtarget
for spec in (shim.BUILD, calibtarget.BUILD, bpf.OBJECT):
    shutil.rmtree(spec["prebuilt"], ignore_errors=True)
    if sys.argv[2] == "1":
        try:
            print("prebuilt", native.prebuild(spec))
        except BuildError as exc:
            sys.exit(f"setup.py: {exc.msg}\\nhint: {exc.hint} (or GPUTRACE_NO_PREBUILD=1 for a wheel that builds "
                     "its native parts at first use)")
"""


class BuildPyWithNatives(build_py):
    def run(self):
        super().run()
        if not self.editable_mode:
            want = "0" if os.environ.get("GPUTRACE_NO_PREBUILD") == "1" else "1"
            subprocess.run([sys.executable, "-c", PREBUILD, os.path.abspath(self.build_lib), want], check=True)


class PlatformDistribution(Distribution):
    def has_ext_modules(self):
        return True  # native code inside: installed as platform code, in a platform wheel


class PlatformWheel(bdist_wheel):
    """Native code, but no Python extension: one wheel for every Python 3 of the platform."""

    def get_tag(self):
        return "py3", "none", super().get_tag()[2]


setup(cmdclass={"build_py": BuildPyWithNatives, "bdist_wheel": PlatformWheel}, distclass=PlatformDistribution)
