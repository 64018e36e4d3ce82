"""`gputrace doctor`: all OK on a host that can trace, and each degraded host gives its line and hint, no traceback."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys

import orjson
import pytest

from gputrace import doctor
from gputrace.doctor import FAIL, OK, WARN, Check

# `python -m gputrace.cli` would run cli.py a second time as __main__, whose command registry stays empty
# (the commands register into gputrace.cli); calling main() from the imported module avoids that.
CLI = [sys.executable, "-c", "import sys; from gputrace.cli import main; sys.exit(main())"]
HOST_CHECKS = ["privileges", "bpf-syscall", "btf", "tracefs", "kernel-headers", "bcc", "bcc-compile", "uprobes",
               "uprobe-multi", "bpf-program"]
BCC = {"GPUTRACE_BPF": "bcc"}  # the bcc path only: its checks FAIL when what it needs is missing
GPU_CHECKS = ["libcuda", "nvidia-driver", "checkpoint-api", "criu"]
BUILD_CHECKS = ["native"]

is_root = os.geteuid() == 0
needs_root = pytest.mark.skipif(not is_root, reason="needs root")


def run_doctor(*extra: str, env: dict[str, str] | None = None, prefix: list[str] | None = None,
               json: bool = True) -> tuple[int, dict | str, str]:
    full_env = {**os.environ, **(env or {})}
    cmd = (prefix or []) + CLI + ["doctor"] + (["--json"] if json else []) + list(extra)
    p = subprocess.run(cmd, capture_output=True, env=full_env, timeout=120)
    out, err = p.stdout.decode(), p.stderr.decode()
    assert "Traceback" not in out + err, out + err
    return p.returncode, (orjson.loads(p.stdout) if json else out), err


def by_name(doc: dict) -> dict[str, dict]:
    return {c["name"]: c for c in doc["checks"]}


def clang_here() -> bool:
    from gputrace.base import native
    from gputrace.base.errors import BuildError

    try:
        native.find_clang()
        return True
    except BuildError:
        return False


def bcc_importable_here() -> bool:
    try:
        from gputrace.base.bccload import import_bcc

        import_bcc()
        return True
    except Exception:
        return False


# --- a host that can trace ------------------------------------------------------------------------------------------

@pytest.mark.bpf
@needs_root
def test_every_host_check_is_ok_here():
    if not bcc_importable_here():
        pytest.skip("bcc is not installed (scripts/setup-host installs it)")
    rc, doc, err = run_doctor()
    checks = by_name(doc)
    assert doc["schema"] == 1
    assert list(checks) == HOST_CHECKS + GPU_CHECKS + BUILD_CHECKS
    assert checks["native"]["status"] == OK and "compiled at first use" in checks["native"]["detail"]  # a checkout
    for name in HOST_CHECKS:
        if name == "bpf-program" and not clang_here():
            continue  # no object to load without clang: bcc's fallback, a WARN
        assert checks[name]["status"] == OK, checks[name]
    if clang_here():
        assert checks["bpf-program"]["detail"].startswith("precompiled object "), checks["bpf-program"]
        assert "built here by clang at first use" in checks["bpf-program"]["detail"]  # a checkout
    for name in GPU_CHECKS:
        assert checks[name]["status"] in (OK, WARN), checks[name]
    assert rc == 0
    assert err == ""  # clang and libbcc chatter stays captured
    assert "fired" in checks["uprobes"]["detail"]


@pytest.mark.bpf
@needs_root
def test_run_checks_returns_frozen_checks():
    checks = doctor.run_checks()
    assert isinstance(checks, tuple) and all(isinstance(c, Check) for c in checks)
    with pytest.raises(dataclasses.FrozenInstanceError):
        checks[0].status = FAIL  # type: ignore[misc]
    assert {c.status for c in checks} <= {OK, WARN, FAIL}
    assert all(c.hint for c in checks if c.status != OK)


@pytest.mark.bpf
@needs_root
def test_text_output_one_line_per_check_with_hints():
    rc, out, _ = run_doctor(env={"GPUTRACE_TRACEFS": "/nonexistent"}, json=False)
    lines = out.splitlines()
    assert any(ln.startswith("OK   privileges ") for ln in lines)
    i = next(i for i, ln in enumerate(lines) if ln.split()[1:2] == ["tracefs"])
    assert lines[i].split()[0] in (WARN, FAIL)
    assert lines[i + 1].startswith(" ") and "hint: mount -t tracefs nodev /nonexistent" in lines[i + 1]


# --- degraded hosts, each through the CLI as a subprocess ---------------------------------------------------------

def test_bcc_hidden():
    probe = subprocess.run([sys.executable, "-c", "import bcc"], capture_output=True)
    if probe.returncode == 0:
        pytest.skip(f"{sys.executable} imports bcc by itself; it cannot be hidden")
    rc, doc, _ = run_doctor(env={"GPUTRACE_BCC_PATH": "", **BCC})
    checks = by_name(doc)
    assert checks["bcc"]["status"] == FAIL
    assert "not installed" in checks["bcc"]["detail"]
    assert "python3-bpfcc" in checks["bcc"]["hint"]
    assert checks["bcc-compile"] == {"name": "bcc-compile", "status": FAIL, "detail": "skipped: needs bcc",
                                     "hint": "see the bcc check above"}
    assert checks["bpf-program"]["status"] == FAIL and "bcc" in checks["bpf-program"]["detail"]
    assert rc == 1


@pytest.mark.bpf
@needs_root
def test_bcc_hidden_with_the_precompiled_object():
    """Where the precompiled object loads, bcc is only the fallback: missing, it is a WARN, not a FAIL."""
    probe = subprocess.run([sys.executable, "-c", "import bcc"], capture_output=True)
    if probe.returncode == 0:
        pytest.skip(f"{sys.executable} imports bcc by itself; it cannot be hidden")
    if not clang_here():
        pytest.skip("clang is not installed (scripts/setup-host installs it): no BPF object to load")
    rc, doc, _ = run_doctor(env={"GPUTRACE_BCC_PATH": ""})
    checks = by_name(doc)
    assert checks["bpf-program"]["status"] == OK and checks["bpf-program"]["detail"].startswith("precompiled object")
    for name in ("bcc", "bcc-compile"):
        assert checks[name]["status"] == WARN, checks[name]
        assert "only the bcc fallback needs this" in checks[name]["hint"], checks[name]
    assert "python3-bpfcc" in checks["bcc"]["hint"]
    assert checks["uprobe-multi"]["status"] == OK  # needs no bcc
    assert all(checks[n]["status"] != FAIL for n in HOST_CHECKS)
    assert rc == (1 if any(c["status"] == FAIL for c in doc["checks"]) else 0)


@pytest.mark.bpf
@needs_root
@pytest.mark.parametrize("case", ["corrupt", "missing", "refused", "no-clang"])
def test_an_object_that_cannot_load_falls_back_to_bcc_and_doctor_says_why(case, tmp_path):
    if not bcc_importable_here():
        pytest.skip("bcc is not installed: there is no fallback to show")
    env: dict[str, str] = {}
    if case == "corrupt":
        (tmp_path / "counts.bpf.o").write_bytes(b"\x7fELF" + b"\0" * 60)
        env["GPUTRACE_BPF_OBJECT"] = str(tmp_path / "counts.bpf.o")
        why = "is not a BPF object gputrace can load"
    elif case == "missing":
        env["GPUTRACE_BPF_OBJECT"] = str(tmp_path / "absent.bpf.o")
        why = "cannot read the BPF object"
    elif case == "refused":
        if not clang_here():
            pytest.skip("clang is not installed: no object to refuse")
        from bpfobjtest import REFUSED, build_test_object

        env["GPUTRACE_BPF_OBJECT"] = str(build_test_object(tmp_path, "refused", REFUSED))
        why = "the kernel's verifier refused gt_entry of refused.bpf.o: "
    else:  # a checkout where nothing came prebuilt and there is no clang to build the object
        (tmp_path / "bin").mkdir()
        env.update(PATH=str(tmp_path / "bin"), GPUTRACE_CACHE=str(tmp_path / "cache"))
        why = "no precompiled BPF object in this install, and it cannot be built here: no clang found"
    rc, doc, err = run_doctor(env=env)
    c = by_name(doc)["bpf-program"]
    assert c["status"] == WARN, c
    assert c["detail"].startswith("bcc run-time compile, because the precompiled object did not load: "), c
    assert why in c["detail"] and "\n" not in c["detail"], c
    assert "falls back to bcc" in c["hint"], c
    if case == "refused":
        assert "map_value_or_null" in c["detail"], c  # the verifier's own words
    if case == "no-clang":
        assert "apt-get install clang" in c["hint"] and "platform wheel" in c["hint"], c
    assert err == ""
    # Forced to the object, the same reason is a FAIL.
    rc, doc, _ = run_doctor(env={**env, "GPUTRACE_BPF": "object"})
    c = by_name(doc)["bpf-program"]
    assert c["status"] == FAIL and why in c["detail"] and "GPUTRACE_BPF=object" in c["detail"], c
    assert rc == 1


def test_an_unknown_gputrace_bpf_is_a_fail_with_a_hint():
    rc, doc, _ = run_doctor(env={"GPUTRACE_BPF": "llvm"})
    c = by_name(doc)["bpf-program"]
    if c["detail"].startswith("skipped"):
        pytest.skip("BPF is not available to this user")
    assert c["status"] == FAIL and "GPUTRACE_BPF='llvm'" in c["detail"] and "object or bcc" in c["hint"], c
    assert rc == 1


def test_headers_missing():
    rc, doc, _ = run_doctor(env={"GPUTRACE_KERNEL_HEADERS": "/nonexistent", **BCC})
    checks = by_name(doc)
    h = checks["kernel-headers"]
    assert h["status"] == FAIL and "/nonexistent does not exist" in h["detail"]
    assert "scripts/setup-host" in h["hint"] and f"linux-headers-{os.uname().release}" in h["hint"]
    assert checks["bcc-compile"]["status"] == FAIL
    assert checks["bcc-compile"]["detail"] in ("skipped: needs kernel-headers", "skipped: needs bcc")
    assert rc == 1


@pytest.mark.bpf
@needs_root
def test_headers_missing_are_a_warn_where_the_object_loads():
    if not clang_here():
        pytest.skip("clang is not installed (scripts/setup-host installs it): no BPF object to load")
    rc, doc, _ = run_doctor(env={"GPUTRACE_KERNEL_HEADERS": "/nonexistent"})
    checks = by_name(doc)
    assert checks["bpf-program"]["status"] == OK, checks["bpf-program"]
    h = checks["kernel-headers"]
    assert h["status"] == WARN and "/nonexistent does not exist" in h["detail"], h
    assert "scripts/setup-host" in h["hint"] and "only the bcc fallback needs this" in h["hint"]


def test_headers_without_include_dir(tmp_path):
    rc, doc, _ = run_doctor(env={"GPUTRACE_KERNEL_HEADERS": str(tmp_path), **BCC})
    h = by_name(doc)["kernel-headers"]
    assert h["status"] == FAIL and h["detail"] == f"{tmp_path} has no include/"
    assert rc == 1


@pytest.mark.bpf
@needs_root
def test_compile_failure_is_one_useful_line(tmp_path):
    if not bcc_importable_here():
        pytest.skip("bcc is not installed")
    (tmp_path / "include").mkdir()  # headers that pass a glance but cannot compile anything
    rc, doc, err = run_doctor(env={"BCC_KERNEL_SOURCE": str(tmp_path), **BCC})
    c = by_name(doc)["bcc-compile"]
    assert c["status"] == FAIL
    assert "\n" not in c["detail"], c
    assert "Unable to find kernel headers" in c["detail"] or "error" in c["detail"], c
    assert "setup-host" in c["hint"]
    assert err == ""
    assert rc == 1


def test_tracefs_missing():
    rc, doc, _ = run_doctor(env={"GPUTRACE_TRACEFS": "/nonexistent"})
    checks = by_name(doc)
    t = checks["tracefs"]
    assert t["hint"] == "mount -t tracefs nodev /nonexistent"
    assert "/nonexistent" in t["detail"]
    # Only a warning where multi-uprobe links work; without them bcc's per-probe path needs tracefs.
    assert t["status"] == (WARN if checks["uprobe-multi"]["status"] == OK else FAIL)
    assert rc == (1 if any(c["status"] == FAIL for c in doc["checks"]) else 0)


@needs_root
def test_not_root():
    setpriv = shutil.which("setpriv")
    if not setpriv:
        pytest.skip("setpriv (util-linux) is not installed")
    drop = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all", "--bounding-set=-all"]
    rc, doc, _ = run_doctor(prefix=drop, env={"HOME": "/tmp"})
    checks = by_name(doc)
    p = checks["privileges"]
    assert p["status"] == FAIL and "uid 65534" in p["detail"]
    assert "setcap" in p["hint"] and "sudo" in p["hint"]
    # The capabilities go on the interpreter that runs gputrace, not on whatever python3 PATH finds.
    assert p["hint"].endswith(os.path.realpath(sys.executable)), p["hint"]
    assert checks["bpf-syscall"]["status"] == FAIL
    criu = checks.get("criu")
    if criu is not None and "criu check` fails" in criu["detail"]:
        # As an unprivileged user criu cannot look at the kernel: the hint says so, not that the kernel lacks it.
        assert "needs root to check" in criu["hint"] and "kernel lacks" not in criu["hint"], criu
    assert checks["uprobes"]["status"] == FAIL and checks["uprobes"]["detail"].startswith("skipped")
    assert rc == 1
    rc, out, err = run_doctor(prefix=drop, env={"HOME": "/tmp"}, json=False)
    assert out.startswith("FAIL privileges ") and "hint: run it with sudo" in out
    assert rc == 1 and err == ""


def test_help_has_examples_and_environment():
    p = subprocess.run(CLI + ["doctor", "--help"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0
    for s in ("examples:", "gputrace doctor --json", "GPUTRACE_KERNEL_HEADERS", "GPUTRACE_TRACEFS", "GPUTRACE_BCC_PATH",
              "GPUTRACE_BPF=auto|object|bcc", "GPUTRACE_BPF_OBJECT"):
        assert s in p.stdout


# --- pieces that a host without a GPU cannot show through the CLI ----------------------------------------------------

def test_a_check_that_raises_becomes_a_fail():
    c = doctor._run_one("boom", lambda: 1 // 0)
    assert c == Check("boom", FAIL, "ZeroDivisionError: integer division or modulo by zero", "")


def _fake_libcuda(tmp_path, functions):
    if not shutil.which("gcc"):
        pytest.skip("gcc is not installed")
    src = tmp_path / "fake.c"
    src.write_text("".join(f"int {f}(void *a) {{ return 0; }}\n" for f in functions))
    lib = tmp_path / "libcuda.so.1"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    return lib


def test_libcuda_in_a_process_and_its_checkpoint_api(tmp_path, monkeypatch):
    lib = _fake_libcuda(tmp_path, list(doctor.CHECKPOINT_API) + ["cuInit"])
    holder = subprocess.Popen([sys.executable, "-c",
                               f"import ctypes, sys, time; ctypes.CDLL({str(lib)!r}); print(1, flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline().strip() == b"1"
        monkeypatch.setenv("LD_LIBRARY_PATH", str(tmp_path))  # what a job started here would load: the fake
        d = doctor._Doctor()
        c = d.libcuda_check()
        assert c.status == OK, c
        assert c.detail.startswith(f"{lib} (what a job started here loads)")
        assert f"{holder.pid} (python" in c.detail
        api = d.checkpoint_api()
        assert api == Check("", OK, f"{lib} exports cuCheckpointProcess{{Lock,Checkpoint,Restore,Unlock}}")
    finally:
        holder.kill()
        holder.wait()


def test_old_driver_lacks_checkpoint_api(tmp_path):
    lib = _fake_libcuda(tmp_path, ["cuInit", "cuCheckpointProcessLock"])
    d = doctor._Doctor()
    d.libcuda = str(lib)
    c = d.checkpoint_api()
    assert c.status == WARN
    assert "cuCheckpointProcessCheckpoint, cuCheckpointProcessRestore, cuCheckpointProcessUnlock" in c.detail
    assert "newer NVIDIA driver" in c.hint


def test_checkpoint_api_skipped_without_libcuda():
    c = doctor._run_one("checkpoint-api", doctor._Doctor().checkpoint_api)
    assert (c.status, c.detail) == (WARN, "skipped: needs libcuda")
    assert "simcuda" in c.hint


def test_libc_getpid_offset_is_a_file_offset():
    path, off = doctor._Doctor().libc_target()
    assert os.path.basename(path).startswith("libc")
    assert off > 0
    with open(path, "rb") as f:
        f.seek(off)
        assert len(f.read(16)) == 16  # a file offset, inside the file


def test_criu_missing_or_too_old_is_a_warn_with_a_hint(tmp_path, monkeypatch):
    old = tmp_path / "criu"
    old.write_text("#!/bin/sh\necho 'Version: 3.17.1'\n")
    old.chmod(0o755)
    for path, says in ((old, "is 3.17.1"), (tmp_path / "absent", "does not run")):
        monkeypatch.setenv("GPUTRACE_CRIU", str(path))
        c = doctor._run_one("criu", doctor._Doctor().criu)
        assert c.status == WARN and says in c.detail and "setup-host" in c.hint, c


def test_a_criu_before_4_2_is_a_warn_for_traced_jobs(tmp_path, monkeypatch):
    v41 = tmp_path / "criu"
    v41.write_text("#!/bin/sh\necho 'Version: 4.1.1'\n[ \"$1\" = check ] && echo 'Looks good.'\nexit 0\n")
    v41.chmod(0o755)
    monkeypatch.setenv("GPUTRACE_CRIU", str(v41))
    c = doctor._run_one("criu", doctor._Doctor().criu)
    assert c.status == WARN and "4.1.1" in c.detail and "uprobe" in c.detail and "4.2" in c.hint, c


def test_native_check_fails_without_a_compiler_where_nothing_came_prebuilt(tmp_path):
    (tmp_path / "bin").mkdir()
    env = {k: v for k, v in os.environ.items() if k != "CC"}
    env["PATH"] = str(tmp_path / "bin")
    rc, doc, _ = run_doctor(env=env)
    native = by_name(doc)["native"]
    assert native["status"] == FAIL and "no C compiler" in native["detail"] and "platform wheel" in native["hint"]
    assert rc != 0
