"""scripts/debian-criu.sh takes the Debian mirror from the host's own apt sources (a host behind its own
mirror or proxy installs CRIU through it), falling back to deb.debian.org: its parser held to sample
source files in a temporary directory, and debian_criu's fallback to a stub apt-get. No network."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "debian-criu.sh"
DEFAULT = "http://deb.debian.org/debian"


def mirror(tmp_path: Path, sources_list: str | None = None, parts: dict[str, str] | None = None,
           env: dict[str, str] | None = None) -> str:
    lst, d = tmp_path / "sources.list", tmp_path / "sources.list.d"
    d.mkdir(exist_ok=True)
    if sources_list is not None:
        lst.write_text(sources_list)
    for name, text in (parts or {}).items():
        (d / name).write_text(text)
    e = {k: v for k, v in os.environ.items() if k != "GPUTRACE_DEBIAN_MIRROR"} | (env or {})
    out = subprocess.run(["bash", "-c", f'. "{SCRIPT}" && debian_mirror "$1" "$2"', "_", str(lst), str(d)],
                         capture_output=True, text=True, env=e, check=True)
    return out.stdout.strip()


def test_no_sources_gives_the_default(tmp_path):
    assert mirror(tmp_path) == DEFAULT


def test_one_line_entry_with_options(tmp_path):
    text = ("# a comment\n"
            "deb-src http://src.example/debian bookworm main\n"
            "deb [arch=amd64 signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://mirror.corp/debian/ "
            "bookworm main contrib\n")
    assert mirror(tmp_path, text) == "http://mirror.corp/debian"


def test_debian_12_default_deb822_skips_security(tmp_path):
    text = ("Types: deb\n"
            "URIs: http://security.debian.org/debian-security\n"
            "Suites: bookworm-security\n"
            "Components: main\n"
            "\n"
            "Types: deb\n"
            "# http://snapshot.debian.org/archive/debian/20250520T000000Z\n"
            "URIs: http://ftp.example.org/debian\n"
            "Suites: bookworm bookworm-updates\n"
            "Components: main\n"
            "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n")
    assert mirror(tmp_path, parts={"debian.sources": text}) == "http://ftp.example.org/debian"


def test_deb822_disabled_source_only_and_folded_fields(tmp_path):
    text = ("Types: deb\n"
            "URIs: http://off.example/debian\n"
            "Suites: trixie\n"
            "Enabled: no\n"
            "\n"
            "Types: deb-src\n"
            "URIs: http://src.example/debian\n"
            "Suites: trixie\n"
            "\n"
            "Types: deb deb-src\n"
            "URIs:\n"
            " http://proxy.corp:3142/repos/deb\n"
            "Suites: trixie\n"
            "Components: main\n"
            "Signed-By:\n"
            " -----BEGIN PGP PUBLIC KEY BLOCK-----\n"
            " .\n"
            " mQINBF...\n")
    # A mirror at any path, known as Debian's by its suite.
    assert mirror(tmp_path, parts={"corp.sources": text}) == "http://proxy.corp:3142/repos/deb"


def test_ubuntu_sources_give_the_default(tmp_path):
    text = ("Types: deb\n"
            "URIs: http://archive.ubuntu.com/ubuntu/\n"
            "Suites: noble noble-updates noble-backports\n"
            "Components: main restricted universe multiverse\n"
            "Signed-By: /usr/share/keyrings/ubuntu-archive-keyring.gpg\n")
    old = "deb http://archive.ubuntu.com/ubuntu jammy main\n"
    assert mirror(tmp_path, old, parts={"ubuntu.sources": text}) == DEFAULT


def test_sources_list_first_then_parts_by_name(tmp_path):
    parts = {"b.sources": "Types: deb\nURIs: http://b.example/debian\nSuites: bookworm\n",
             "a.list": "deb http://a.example/debian bookworm main\n"}
    assert mirror(tmp_path, parts=parts) == "http://a.example/debian"
    assert mirror(tmp_path, "deb http://first.example/debian sid main\n", parts=parts) == "http://first.example/debian"


def test_cloud_image_mirror_method(tmp_path):
    text = "Types: deb\nURIs: mirror+file:///etc/apt/mirrors/debian.list\nSuites: bookworm bookworm-updates\n"
    assert mirror(tmp_path, parts={"debian.sources": text}) == "mirror+file:///etc/apt/mirrors/debian.list"


def test_environment_overrides(tmp_path):
    got = mirror(tmp_path, "deb http://a.example/debian bookworm main\n",
                 env={"GPUTRACE_DEBIAN_MIRROR": "http://chosen.example/debian/"})
    assert got == "http://chosen.example/debian"


@pytest.mark.skipif(not Path("/usr/share/keyrings/debian-archive-keyring.gpg").exists(),
                    reason="debian_criu needs Debian's archive keyring")
def test_debian_criu_falls_back_to_the_default(tmp_path):
    """A host mirror that does not carry the suite: the default is tried next, each named; a stub
    apt-get that fails every update stands for both."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "apt.log"
    stub = bin_dir / "apt-get"
    stub.write_text("#!/bin/sh\n"
                    "for a in \"$@\"; do case \"$a\" in Dir::Etc::SourceList=*) cat \"${a#*=}\" >>\"$LOG\" ;; esac; done\n"
                    "exit 100\n")
    stub.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "LOG": str(log),
           "GPUTRACE_DEBIAN_MIRROR": "http://mirror.corp/debian"}
    r = subprocess.run(["bash", "-c", f'. "{SCRIPT}" && debian_criu forky "$1" amd64', "_", str(tmp_path / "dest")],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 1
    tried = [line.split()[2] for line in log.read_text().splitlines()]
    assert tried == ["http://mirror.corp/debian", DEFAULT]
    assert "trying http://deb.debian.org/debian" in r.stderr
    assert "http://mirror.corp/debian http://deb.debian.org/debian" in r.stderr
    assert not (tmp_path / "dest").exists()
