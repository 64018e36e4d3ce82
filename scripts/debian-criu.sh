# Sourced by scripts/install-criu and bench/make-criu-bundle (bash).
#
# debian_criu SUITE DEST [ARCH]: Debian SUITE's criu and every package it needs at run time (libc6
# included: its loader runs criu, so the host's glibc does not matter), downloaded with apt through a
# private package list (the host's apt sources and package database are not touched) and unpacked
# into DEST/root; their names go to DEST/packages. ARCH defaults to this host's. The packages come
# from the Debian mirror the host's own apt sources name (debian_mirror), else, or where that mirror
# does not carry SUITE, from DEBIAN_MIRROR_DEFAULT. Returns 1, with the reason on stderr and DEST
# left as it was, if the lists cannot be read, have no criu, or the download fails.

DEBIAN_MIRROR_DEFAULT=http://deb.debian.org/debian

# debian_mirror [SOURCES_LIST [SOURCES_DIR]]: the URI of the first Debian archive the host's apt
# sources name (one-line entries in SOURCES_LIST, default /etc/apt/sources.list, and in SOURCES_DIR's
# *.list; deb822 stanzas in SOURCES_DIR's *.sources, default /etc/apt/sources.list.d; in the order
# apt reads them), else DEBIAN_MIRROR_DEFAULT; $GPUTRACE_DEBIAN_MIRROR, where set, overrides both.
# A Debian archive: a `deb` entry, enabled, not a security archive (its suite ends in -security),
# whose URI ends in /debian or whose suite is one of Debian's (bookworm, bookworm-updates, sid,
# stable ...): a host behind its own mirror or proxy (apt-cacher-ng's http://proxy:3142/debian,
# a cloud image's mirror+file:) is served by it. An Ubuntu host's sources name none.
debian_mirror() {
    local list="${1:-/etc/apt/sources.list}" dir="${2:-/etc/apt/sources.list.d}" f
    if [ -n "${GPUTRACE_DEBIAN_MIRROR:-}" ]; then
        printf '%s\n' "${GPUTRACE_DEBIAN_MIRROR%/}"
        return 0
    fi
    local files=()
    [ -r "$list" ] && files+=("$list")
    for f in "$dir"/*; do  # (in the order apt reads them: by name, whichever the format)
        case "$f" in *.list|*.sources) [ -r "$f" ] && files+=("$f") ;; esac
    done
    local found=""
    if [ "${#files[@]}" -gt 0 ]; then
        found="$(_debian_source_entries "${files[@]}" | awk '
            BEGIN { n = split("buster bullseye bookworm trixie forky duke sid stable oldstable oldoldstable " \
                              "testing unstable experimental", names, " ")
                    for (i = 1; i <= n; i++) debian[names[i]] = 1 }
            {
                uri = $1; suite = $2
                if (suite ~ /-security$/ || uri ~ /^cdrom:/) next
                base = suite; sub(/-(updates|backports|proposed-updates|backports-sloppy)$/, "", base)
                path = uri; sub(/\/+$/, "", path)
                if (path ~ /\/debian$/ || (base in debian)) { print path; exit }
            }')"
    fi
    printf '%s\n' "${found:-$DEBIAN_MIRROR_DEFAULT}"
}

# _debian_source_entries FILE...: "URI SUITE" for every enabled `deb` entry of these apt source files,
# in order (FILE ending in .sources: deb822 stanzas; any other: one-line entries).
_debian_source_entries() {
    local f
    for f in "$@"; do
        case "$f" in
            *.sources)
                awk '
                    function flush(   i, j, nu, ns, us, ss, isdeb, nt, ts) {
                        nt = split(types, ts, " "); isdeb = 0
                        for (i = 1; i <= nt; i++) if (ts[i] == "deb") isdeb = 1
                        if (isdeb && tolower(enabled) != "no") {
                            nu = split(uris, us, " "); ns = split(suites, ss, " ")
                            for (i = 1; i <= nu; i++) for (j = 1; j <= ns; j++) print us[i], ss[j]
                        }
                        types = uris = suites = enabled = field = ""
                    }
                    /^#/ { next }
                    /^[ \t]*$/ { flush(); next }
                    /^[ \t]/ {  # a folded line: more of the field above
                        if (field == "types") types = types " " $0
                        else if (field == "uris") uris = uris " " $0
                        else if (field == "suites") suites = suites " " $0
                        next
                    }
                    {
                        name = tolower($0); sub(/:.*/, "", name)
                        value = $0; sub(/^[^:]*:[ \t]*/, "", value)
                        field = name
                        if (name == "types") types = value
                        else if (name == "uris") uris = value
                        else if (name == "suites") suites = value
                        else if (name == "enabled") enabled = value
                    }
                    END { flush() }' "$f"
                ;;
            *)
                awk '
                    { sub(/#.*/, "") }
                    $1 == "deb" {
                        line = $0; gsub(/\[[^]]*\]/, " ", line)
                        n = split(line, w, " ")
                        if (n >= 3) print w[2], w[3]
                    }' "$f"
                ;;
        esac
    done
}

debian_criu() {
    local suite="$1" dest="$2" arch="${3:-$(dpkg --print-architecture)}"
    local keyring=/usr/share/keyrings/debian-archive-keyring.gpg aptdir deb
    [ -r "$keyring" ] || { echo "debian_criu: $keyring is missing (apt-get install debian-archive-keyring)" >&2; return 1; }
    aptdir="$(mktemp -d)"
    mkdir -p "$aptdir/lists/partial" "$aptdir/cache/archives/partial" "$aptdir/debs"
    local opts=(-o "Dir::Etc::SourceList=$aptdir/sources.list" -o Dir::Etc::SourceParts=/nonexistent
                -o "Dir::State::Lists=$aptdir/lists" -o "Dir::Cache=$aptdir/cache" -o Dir::State::Status=/dev/null
                -o "APT::Architecture=$arch" -o "APT::Architectures=$arch" -o Debug::NoLocking=1
                -o APT::Sandbox::User=root)
    local mirror tried=() got=""
    for mirror in "$(debian_mirror)" "$DEBIAN_MIRROR_DEFAULT"; do
        case " ${tried[*]} " in *" $mirror "*) continue ;; esac
        [ "${#tried[@]}" -gt 0 ] && echo "    cannot read Debian $suite from ${tried[*]}: trying $mirror" >&2
        tried+=("$mirror")
        echo "deb [signed-by=$keyring] $mirror $suite main" >"$aptdir/sources.list"
        rm -rf "$aptdir/lists" && mkdir -p "$aptdir/lists/partial"
        if apt-get "${opts[@]}" -q update >/dev/null; then
            got="$mirror"
            break
        fi
    done
    if [ -z "$got" ]; then
        echo "debian_criu: cannot read Debian $suite's package lists from ${tried[*]} (network? keyring?)" >&2
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
    echo "    downloading ${#pkgs[@]} packages from Debian $suite ($got): ${pkgs[*]}"
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
