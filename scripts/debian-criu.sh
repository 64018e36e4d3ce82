# Sourced by scripts/install-criu and bench/make-criu-bundle (bash).
#
# debian_criu SUITE DEST [ARCH]: Debian SUITE's criu and every package it needs at run time (libc6
# included: its loader runs criu, so the host's glibc does not matter), downloaded with apt through a
# private package list (the host's apt sources and package database are not touched) and unpacked
# into DEST/root; their names go to DEST/packages. ARCH defaults to this host's. Returns 1, with the
# reason on stderr and DEST left as it was, if the lists cannot be read, have no criu, or the download
# fails.
debian_criu() {
    local suite="$1" dest="$2" arch="${3:-$(dpkg --print-architecture)}"
    local keyring=/usr/share/keyrings/debian-archive-keyring.gpg aptdir deb
    [ -r "$keyring" ] || { echo "debian_criu: $keyring is missing (apt-get install debian-archive-keyring)" >&2; return 1; }
    aptdir="$(mktemp -d)"
    mkdir -p "$aptdir/lists/partial" "$aptdir/cache/archives/partial" "$aptdir/debs"
    echo "deb [signed-by=$keyring] http://deb.debian.org/debian $suite main" >"$aptdir/sources.list"
    local opts=(-o "Dir::Etc::SourceList=$aptdir/sources.list" -o Dir::Etc::SourceParts=/nonexistent
                -o "Dir::State::Lists=$aptdir/lists" -o "Dir::Cache=$aptdir/cache" -o Dir::State::Status=/dev/null
                -o "APT::Architecture=$arch" -o "APT::Architectures=$arch" -o Debug::NoLocking=1
                -o APT::Sandbox::User=root)
    if ! apt-get "${opts[@]}" -q update >/dev/null; then
        echo "debian_criu: cannot read Debian $suite's package lists (network? keyring?)" >&2
        rm -rf "$aptdir"
        return 1
    fi
    local pkgs
    mapfile -t pkgs < <(apt-cache "${opts[@]}" depends --recurse --no-recommends --no-suggests --no-conflicts \
        --no-breaks --no-replaces --no-enhances criu | grep -v '^ ' | grep -v '^<' | sort -u)
    if [ "${#pkgs[@]}" -le 1 ]; then
        echo "debian_criu: Debian $suite's package lists have no criu" >&2
        rm -rf "$aptdir"
        return 1
    fi
    echo "    downloading ${#pkgs[@]} packages from Debian $suite: ${pkgs[*]}"
    if ! (cd "$aptdir/debs" && apt-get "${opts[@]}" -q download "${pkgs[@]}" >/dev/null); then
        echo "debian_criu: the download from Debian $suite failed" >&2
        rm -rf "$aptdir"
        return 1
    fi
    mkdir -p "$dest/root"
    for deb in "$aptdir"/debs/*.deb; do dpkg -x "$deb" "$dest/root"; done
    printf '%s\n' "${pkgs[@]}" >"$dest/packages"
    rm -rf "$aptdir"
}
