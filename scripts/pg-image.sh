#!/usr/bin/env bash
# Make the PostgreSQL image that the test kit's docker backend uses available locally.
#
#   scripts/pg-image.sh            # image named by $SHARDLINE_PG_IMAGE, default postgres:15
#
# 1. If the image is already present, keep it (fast, silent; only the native minter's
#    layer below may be added).
# 2. Else try `docker pull` (works where a registry is reachable).
# 3. Else build an equivalent image from Debian's packages: PostgreSQL 15 with a
#    trust-auth cluster baked in, ENTRYPOINT the postgres binary, EXPOSE 5432/tcp. When
#    this machine has Debian's postgresql-15 installed (as CI's does), its root
#    filesystem is the installed files of that package and everything it depends on
#    (dpkg's own lists), copied from this machine: the same binaries the local backend
#    runs, in seconds. Else debootstrap fetches them (about 100 s on a fresh machine;
#    needs the `debootstrap` package). Needs root (chroot) either way.
#
# The built image behaves like the official one for the test kit: its command is
# `postgres -c name=value ...`, it listens on 5432 for every address, and it accepts
# password-less logins (the official image does with POSTGRES_HOST_AUTH_METHOD=trust).
# Its cluster is initialised at build time, so a container starts in about a second.
# When this machine's PostgreSQL has shardline's native minter installed
# (scripts/native-minter.sh), the image gets the same library in a layer of its own,
# labelled with its checksum: added to an image that lacks it or has another build of it,
# however that image was made (present, pulled or built here).
set -euo pipefail
# The image's directories get their modes from here (a umask of 077 would leave / and
# /usr closed to the postgres user).
umask 022

IMAGE="${SHARDLINE_PG_IMAGE:-postgres:15}"
SUITE="${SHARDLINE_PG_IMAGE_SUITE:-bookworm}"
MIRROR="${SHARDLINE_DEBIAN_MIRROR:-http://deb.debian.org/debian}"

log() { printf 'pg-image: %s\n' "$*" >&2; }

if ! command -v docker >/dev/null 2>&1; then
  log "docker is not installed; nothing to do (the test kit will use local processes)"
  exit 0
fi
if ! docker info >/dev/null 2>&1; then
  log "no Docker engine answers; nothing to do (the test kit will use local processes)"
  exit 0
fi

# Where scripts/native-minter.sh installs it (the same pg_config).
native="$("${PG_CONFIG:-/usr/lib/postgresql/15/bin/pg_config}" --pkglibdir 2>/dev/null || echo /usr/lib/postgresql/15/lib)/shardline_minter.so"
native_sum=""
if [ -f "$native" ]; then
  native_sum=$(sha256sum "$native" | cut -c1-16)
fi

# Adds this machine's native minter library to $IMAGE unless it has that build already.
add_native() {
  [ -n "$native_sum" ] || return 0
  local have
  have=$(docker image inspect -f '{{ index .Config.Labels "org.shardline.native-minter" }}' "$IMAGE" 2>/dev/null || true)
  [ "$have" = "$native_sum" ] && return 0
  local ctx
  ctx=$(mktemp -d)
  install -m 755 "$native" "$ctx/shardline_minter.so"
  printf 'FROM %s\nCOPY shardline_minter.so /usr/lib/postgresql/15/lib/shardline_minter.so\nLABEL org.shardline.native-minter=%s\n' \
    "$IMAGE" "$native_sum" >"$ctx/Dockerfile"
  if ! DOCKER_BUILDKIT=0 docker build -q -t "$IMAGE" "$ctx" >/dev/null 2>"$ctx.log"; then
    cat "$ctx.log" >&2
    rm -rf "$ctx" "$ctx.log"
    log "adding the native minter to $IMAGE failed"
    exit 1
  fi
  rm -rf "$ctx" "$ctx.log"
  log "added the native minter ($native) to $IMAGE"
}

if docker image inspect "$IMAGE" >/dev/null 2>&1; then
  add_native
  exit 0
fi

log "image $IMAGE not present; trying docker pull"
if timeout 120 docker pull -q "$IMAGE" >/dev/null 2>&1; then
  log "pulled $IMAGE"
  add_native
  exit 0
fi

if [ "$(id -u)" -ne 0 ]; then
  log "building the image needs root (chroot); run this script as root"
  exit 1
fi

start=$(date +%s)
work=$(mktemp -d /var/tmp/shardline-pg-image.XXXXXX)
trap 'rm -rf "$work"' EXIT
rootfs="$work/rootfs"

# The root filesystem from this machine's own installed packages: postgresql-15, what it
# depends on (recursively, as installed here), the shell and coreutils. Each
# package's files as dpkg lists them, placed where they are (so /bin/dash, listed under
# the merged /bin, lands in /usr/bin beside the image's bin -> usr/bin link).
from_host() {
  local packages
  # The server, the shell its entrypoint and `COPY ... TO PROGRAM` run, and coreutils for
  # the programs such a COPY runs (the test kit writes TLS files with `cat`), as
  # debootstrap's minimal base has them.
  local base="postgresql-15 dash coreutils libc-bin tzdata"
  # shellcheck disable=SC2086
  packages=$( { printf '%s\n' $base;
    apt-cache depends --recurse --installed --no-recommends --no-suggests --no-conflicts \
      --no-breaks --no-replaces --no-enhances $base 2>/dev/null \
      | grep -v '^ ' | grep -v '^<'; } | sort -u \
    | xargs dpkg-query -W -f='${db:Status-Abbrev} ${binary:Package}\n' 2>/dev/null \
    | awk '$1 == "ii" { print $2 }')
  [ -n "$packages" ] || return 1
  # shellcheck disable=SC2086
  dpkg -L $packages 2>/dev/null | python3 -c '
import os, shutil, sys
root = sys.argv[1]
os.makedirs(root)
for top in ("bin", "sbin", "lib", "lib64"):
    if os.path.islink("/" + top):
        os.makedirs(os.path.join(root, "usr", top), exist_ok=True)
        os.symlink("usr/" + top, os.path.join(root, top))
skip = ("/usr/share/doc/", "/usr/share/man/", "/usr/share/info/", "/usr/share/locale/")
for line in sys.stdin:
    path = line.rstrip("\n")
    if not path.startswith("/") or path.startswith(skip) or os.path.isdir(path) and not os.path.islink(path):
        continue
    if not os.path.lexists(path):
        continue
    where = os.path.realpath(os.path.dirname(path))
    dest = root + os.path.join(where, os.path.basename(path))
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    if not os.path.lexists(dest):
        shutil.copy2(path, dest, follow_symlinks=False)
' "$rootfs" || return 1
  local uid gid
  uid=$(id -u postgres 2>/dev/null || echo 999)
  gid=$(id -g postgres 2>/dev/null || echo 999)
  mkdir -p "$rootfs/etc" "$rootfs/tmp" "$rootfs/var/lib/postgresql" "$rootfs/usr/local/bin" "$rootfs/dev"
  chmod 1777 "$rootfs/tmp"
  # initdb runs in the chroot and writes to /dev/null (a container gets Docker's /dev).
  # (Called left of `||`, this function runs without errexit: each step checks itself.)
  mknod -m 666 "$rootfs/dev/null" c 1 3 || return 1
  mknod -m 666 "$rootfs/dev/zero" c 1 5 || return 1
  mknod -m 666 "$rootfs/dev/urandom" c 1 9 || return 1
  printf 'root:x:0:0:root:/root:/bin/sh\npostgres:x:%s:%s:PostgreSQL administrator:/var/lib/postgresql:/bin/sh\n' \
    "$uid" "$gid" >"$rootfs/etc/passwd"
  printf 'root:x:0:\npostgres:x:%s:\n' "$gid" >"$rootfs/etc/group"
  # A loader cache, as Debian's packages leave one; then the shell must run in it.
  chroot "$rootfs" /sbin/ldconfig || return 1
  chroot "$rootfs" /bin/sh -c true || return 1
}

from_debootstrap() {
  if ! command -v debootstrap >/dev/null 2>&1; then
    log "installing debootstrap"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap >/dev/null \
      || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap >/dev/null; }
  fi
  debootstrap --variant=minbase --include=postgresql-15 "$SUITE" "$rootfs" "$MIRROR" >"$work/debootstrap.log" 2>&1 \
    || { tail -n 30 "$work/debootstrap.log" >&2; log "debootstrap failed"; exit 1; }
}

if [ "${SHARDLINE_PG_IMAGE_FROM:-}" != "debootstrap" ] \
  && dpkg-query -W -f='${db:Status-Abbrev}' postgresql-15 2>/dev/null | grep -q '^ii' \
  && command -v python3 >/dev/null 2>&1; then
  log "building $IMAGE from this machine's installed postgresql-15 and its dependencies"
  from_host || { log "copying this machine's packages failed"; exit 1; }
else
  log "building $IMAGE from Debian's packages ($SUITE, $MIRROR)"
  from_debootstrap
fi

# Debian's packaging creates its own cluster in /var/lib/postgresql/15/main; drop it and
# bake a trust-auth cluster at the path PGDATA names, so a container starts in ~1 s.
rm -rf "$rootfs/var/lib/postgresql/15" "$rootfs/etc/postgresql/15"
mkdir -p "$rootfs/var/lib/postgresql/data" "$rootfs/var/run/postgresql"
# The image's own postgres user, by number (the rootfs may hold no chown of its own).
owner=$(awk -F: '$1 == "postgres" { print $3 ":" $4 }' "$rootfs/etc/passwd")
[ -n "$owner" ] || { log "the image has no postgres user"; exit 1; }
chown -R "$owner" "$rootfs/var/lib/postgresql" "$rootfs/var/run/postgresql"
chroot --userspec="$owner" "$rootfs" /usr/lib/postgresql/15/bin/initdb \
  -D /var/lib/postgresql/data -U postgres -A trust -E UTF8 --locale=C.UTF-8 --no-instructions \
  >"$work/initdb.log" 2>&1 || { cat "$work/initdb.log" >&2; log "initdb failed"; exit 1; }
echo "host all all 0.0.0.0/0 trust" >>"$rootfs/var/lib/postgresql/data/pg_hba.conf"
echo "host all all ::/0 trust" >>"$rootfs/var/lib/postgresql/data/pg_hba.conf"
echo "host replication all 0.0.0.0/0 trust" >>"$rootfs/var/lib/postgresql/data/pg_hba.conf"

# An entrypoint that accepts what the official image accepts: `postgres -c k=v ...`
# (a leading "postgres" is the program name), so the test kit runs both images alike.
cat >"$rootfs/usr/local/bin/docker-entrypoint.sh" <<'SH'
#!/bin/sh
set -e
if [ "${1:-}" = "postgres" ]; then shift; fi
exec /usr/lib/postgresql/15/bin/postgres -D "${PGDATA:-/var/lib/postgresql/data}" -c listen_addresses='*' "$@"
SH
chmod 755 "$rootfs/usr/local/bin/docker-entrypoint.sh"

# Slim: apt caches and lists, docs, man pages, locales other than C.
rm -rf "$rootfs"/var/cache/apt/* "$rootfs"/var/lib/apt/lists/* \
  "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* \
  "$rootfs"/var/log/*.log "$rootfs"/var/cache/debconf/*-old
find "$rootfs/usr/share/locale" -mindepth 1 -maxdepth 1 ! -name 'locale.alias' -exec rm -rf {} + 2>/dev/null || true

# `docker import` takes only some Dockerfile instructions; STOPSIGNAL (SIGINT: a fast
# shutdown, as the official image has) and the label come from a one-line build on top.
base="shardline-pg-rootfs:$$"
tar --numeric-owner -C "$rootfs" -cf - . | docker import \
  --change 'USER postgres' \
  --change 'ENV PGDATA=/var/lib/postgresql/data' \
  --change 'ENV PATH=/usr/lib/postgresql/15/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'EXPOSE 5432/tcp' \
  --change 'ENTRYPOINT ["/usr/local/bin/docker-entrypoint.sh"]' \
  --change 'CMD ["postgres"]' \
  - "$base" >/dev/null
mkdir -p "$work/ctx"
printf 'FROM %s\nSTOPSIGNAL SIGINT\nLABEL org.shardline.built-from=debian-packages\n' "$base" >"$work/ctx/Dockerfile"
DOCKER_BUILDKIT=0 docker build -q -t "$IMAGE" "$work/ctx" >/dev/null 2>"$work/build.log" \
  || { cat "$work/build.log" >&2; docker rmi "$base" >/dev/null 2>&1; log "docker build failed"; exit 1; }
docker rmi "$base" >/dev/null 2>&1 || true

log "built $IMAGE in $(( $(date +%s) - start )) s"
add_native
