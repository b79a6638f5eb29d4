#!/usr/bin/env bash
# Makes the Dockerfile's base images locally, for buildah with --pull=never on a
# machine without a registry: a Debian 12 minbase rootfs from debootstrap (Debian's
# apt archive only), trimmed like the official slim image (no docs, man pages or
# locales; apt lists and caches empty), imported with podman and tagged
# debian:bookworm and debian:bookworm-slim (short and docker.io/library/ names).
#
#   bash tests/container/base_image.sh [ROOTFS_DIR]   (default /var/tmp/mha-rootfs)
#
# The rootfs stays outside the repo. Reuses the images when they exist
# (MHA_REBUILD_BASE=1 rebuilds them).
set -euo pipefail
rootfs="${1:-/var/tmp/mha-rootfs}"
mirror="${MHA_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
names=(debian:bookworm docker.io/library/debian:bookworm
       debian:bookworm-slim docker.io/library/debian:bookworm-slim)

if [[ "${MHA_REBUILD_BASE:-0}" != 1 ]] && podman image exists docker.io/library/debian:bookworm-slim \
   && podman image exists docker.io/library/debian:bookworm; then
  echo "base images present: ${names[*]}"
  exit 0
fi

rm -rf "$rootfs"
echo "debootstrap --variant=minbase bookworm $rootfs"
debootstrap --variant=minbase bookworm "$rootfs" "$mirror" > "$rootfs.debootstrap.log" 2>&1 \
  || { tail -20 "$rootfs.debootstrap.log"; exit 1; }

# As the official slim image: dpkg skips docs, man pages and locales from now on.
cat > "$rootfs/etc/dpkg/dpkg.cfg.d/slim" <<'CFG'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-include /usr/share/locale/locale.alias
path-exclude /usr/share/groff/*
path-exclude /usr/share/lintian/*
CFG
find "$rootfs/usr/share/doc" -mindepth 1 -not -name copyright -not -type d -delete
find "$rootfs/usr/share/doc" -mindepth 1 -type d -empty -delete
rm -rf "$rootfs/usr/share/man/"* "$rootfs/usr/share/info/"* "$rootfs/usr/share/groff/"* \
       "$rootfs/usr/share/lintian/"*
find "$rootfs/usr/share/locale" -mindepth 1 -maxdepth 1 -not -name locale.alias -exec rm -rf {} +
rm -rf "$rootfs/var/cache/apt/"*.bin "$rootfs/var/cache/apt/archives/"*.deb \
       "$rootfs/var/lib/apt/lists/"* "$rootfs/var/log/"*.log "$rootfs/debootstrap"

for name in "${names[@]}"; do
  podman rmi --force "$name" > /dev/null 2>&1 || true
done
tar -C "$rootfs" --numeric-owner -c . | podman import --quiet - "${names[0]}" > /dev/null
for name in "${names[@]:1}"; do
  podman tag "${names[0]}" "$name"
done
echo "base images: ${names[*]} ($(du -sh --apparent-size "$rootfs" | cut -f1) rootfs)"
