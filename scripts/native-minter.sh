#!/usr/bin/env bash
# Build shardline's native minter (crates/id/native/shardline_minter.c: each shard's
# next_id() in C, `id.minter = "native"`) for this machine's PostgreSQL, and install it
# into the server's library directory, where `CREATE FUNCTION ... AS 'shardline_minter'`
# finds it. The test kit's hosts (local processes, and the image scripts/pg-image.sh
# builds) load it from there.
#
#   scripts/native-minter.sh             # build into target/native/, install (needs root)
#   scripts/native-minter.sh --build     # build only; prints the library's path
#   scripts/native-minter.sh --werror    # warnings are errors (CI)
#
# PG_CONFIG names the server's pg_config (default: PostgreSQL 15's, as Debian installs
# it). The server's headers come from its -dev package when installed; else the script
# unpacks only the headers from Debian's postgresql-server-dev-<major> (`apt-get
# download`: that package would pull in clang and LLVM, and upgrade the server), into
# target/native/. A header release newer than the server's within the same major version
# builds a library the server loads (PostgreSQL keeps its C interface within a major
# version; the library checks the major version when it is loaded).
#
# On another server (a production host), build it the same way there or with PGXS, and
# put shardline_minter.so into `pg_config --pkglibdir` on every host as this script does
# (install to a temporary name, then mv: never cp over a library a server has loaded):
# see docs/ids.md, "The native minter".
set -euo pipefail

PG_CONFIG="${PG_CONFIG:-/usr/lib/postgresql/15/bin/pg_config}"
root=$(cd "$(dirname "$0")/.." && pwd)
src="$root/crates/id/native/shardline_minter.c"
out="$root/target/native"
log() { printf 'native-minter: %s\n' "$*" >&2; }

build_only=false
werror=()
for arg in "$@"; do
  case "$arg" in
    --build) build_only=true ;;
    --werror) werror=(-Werror) ;;
    *) log "unknown argument $arg: expected --build or --werror"; exit 2 ;;
  esac
done

[ -x "$PG_CONFIG" ] || { log "no pg_config at $PG_CONFIG (set PG_CONFIG)"; exit 1; }
version=$("$PG_CONFIG" --version)            # PostgreSQL 15.18 (Debian ...)
major=$(printf '%s\n' "$version" | sed -E 's/^PostgreSQL ([0-9]+).*/\1/')
mkdir -p "$out"

inc=$("$PG_CONFIG" --includedir-server)
if [ ! -f "$inc/postgres.h" ]; then
  unpacked="$out/pg-headers-$major"
  inc="$unpacked/usr/include/postgresql/$major/server"
  if [ ! -f "$inc/postgres.h" ]; then
    command -v apt-get >/dev/null 2>&1 \
      || { log "no server headers at $(dirname "$inc") and no apt-get to fetch them: install PostgreSQL $major's server headers"; exit 1; }
    log "fetching PostgreSQL $major's server headers (postgresql-server-dev-$major, unpacked, not installed)"
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    chmod 755 "$work"
    # apt-get download runs as _apt when it can write the directory; either way is fine.
    (cd "$work" && { apt-get download -q "postgresql-server-dev-$major" >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null && apt-get download -q "postgresql-server-dev-$major" >/dev/null; }; }) \
      || { log "apt-get download postgresql-server-dev-$major failed"; exit 1; }
    rm -rf "$unpacked"
    dpkg -x "$work"/postgresql-server-dev-"$major"_*.deb "$unpacked"
    [ -f "$inc/postgres.h" ] || { log "the package held no $inc/postgres.h"; exit 1; }
  fi
fi

lib="$out/shardline_minter.so"
# The server's own compiler flags (-fwrapv, -fexcess-precision=standard, ...).
# shellcheck disable=SC2046
${CC:-cc} $("$PG_CONFIG" --cflags) $("$PG_CONFIG" --cflags_sl) $("$PG_CONFIG" --cppflags) \
  -Wall -Wextra -Wno-unused-parameter -Wno-missing-field-initializers -Wmissing-prototypes ${werror[@]+"${werror[@]}"} \
  -I"$inc" -shared -o "$lib.tmp" "$src" $("$PG_CONFIG" --ldflags_sl)
mv "$lib.tmp" "$lib"

if $build_only; then
  printf '%s\n' "$lib"
  exit 0
fi
dest="$("$PG_CONFIG" --pkglibdir)/shardline_minter.so"
if [ -f "$dest" ] && cmp -s "$lib" "$dest"; then
  exit 0
fi
if [ ! -w "$(dirname "$dest")" ]; then
  log "cannot write $(dirname "$dest"): run as root, or copy $lib there"
  exit 1
fi
install -m 755 "$lib" "$dest.tmp"
mv "$dest.tmp" "$dest"
log "installed $dest ($version)"
