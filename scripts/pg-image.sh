#!/usr/bin/env bash
# Make the PostgreSQL image that the test kit's docker backend uses available locally.
#
#   scripts/pg-image.sh            # image named by $SHARDLINE_PG_IMAGE, default postgres:15
#
# 1. If the image is already present, do nothing (fast, silent).
# 2. Else try `docker pull` (works where a registry is reachable).
# 3. Else build an equivalent image from Debian's packages with debootstrap:
#    PostgreSQL 15 with a trust-auth cluster baked in, ENTRYPOINT the postgres binary,
#    EXPOSE 5432/tcp. Needs root (debootstrap, chroot) and the `debootstrap` package.
#
# The built image behaves like the official one for the test kit: its command is
# `postgres -c name=value ...`, it listens on 5432 for every address, and it accepts
# password-less logins (the official image does with POSTGRES_HOST_AUTH_METHOD=trust).
# Its cluster is initialised at build time, so a container starts in about a second.
set -euo pipefail

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

if docker image inspect "$IMAGE" >/dev/null 2>&1; then
  exit 0
fi

log "image $IMAGE not present; trying docker pull"
if timeout 120 docker pull -q "$IMAGE" >/dev/null 2>&1; then
  log "pulled $IMAGE"
  exit 0
fi

log "pull failed; building $IMAGE from Debian's packages ($SUITE, $MIRROR)"
if [ "$(id -u)" -ne 0 ]; then
  log "building the image needs root (debootstrap and chroot); run this script as root"
  exit 1
fi
if ! command -v debootstrap >/dev/null 2>&1; then
  log "installing debootstrap"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap >/dev/null \
    || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap >/dev/null; }
fi

start=$(date +%s)
work=$(mktemp -d /var/tmp/shardline-pg-image.XXXXXX)
trap 'rm -rf "$work"' EXIT
rootfs="$work/rootfs"

debootstrap --variant=minbase --include=postgresql-15 "$SUITE" "$rootfs" "$MIRROR" >"$work/debootstrap.log" 2>&1 \
  || { tail -n 30 "$work/debootstrap.log" >&2; log "debootstrap failed"; exit 1; }

# Debian's packaging creates its own cluster in /var/lib/postgresql/15/main; drop it and
# bake a trust-auth cluster at the path PGDATA names, so a container starts in ~1 s.
rm -rf "$rootfs/var/lib/postgresql/15" "$rootfs/etc/postgresql/15"
mkdir -p "$rootfs/var/lib/postgresql/data" "$rootfs/var/run/postgresql"
chroot "$rootfs" chown -R postgres:postgres /var/lib/postgresql /var/run/postgresql
chroot --userspec=postgres:postgres "$rootfs" /usr/lib/postgresql/15/bin/initdb \
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
