#!/usr/bin/env bash
# The image in CI, with no registry: install Debian's docker.io and debootstrap, start a daemon
# without a bridge (every build and container uses --network host: only the loopback is ever
# addressed), make a Debian bookworm base with python3 3.11 (debootstrap, then `"$DOCKER" import`),
# download a wheelhouse of everything the image installs with the host's pip and serve it on a
# loopback port as a simple index, build the Dockerfile's slim and full targets on that base,
# print and bound their sizes, then run tests/image against them (as the chart runs them).
# Idempotent: the base, the wheelhouse and the daemon's layers are reused (cache folder:
# $LORAPLANE_CI_CACHE, else /var/cache/loraplane-ci). Stops what it started, on any exit.
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE=${LORAPLANE_CI_CACHE:-/var/cache/loraplane-ci}
BASE=loraplane-ci/debian-python:bookworm-r1  # bump the revision when the recipe below changes
FULL=loraplane:ci
SLIM=loraplane:ci-slim
SLIM_MAX_MB=425  # measured 409 MB: 387 before `cryptography` (signed adapters) + margin
FULL_MAX_MB=${LORAPLANE_FULL_IMAGE_MAX_MB:-2600}  # measured 2139 MB (torch, triton) + margin
PY=.venv/bin/python
# Debian's client, which speaks its daemon's API version (another docker on PATH may be newer)
DOCKER=/usr/bin/docker
export DOCKER_BUILDKIT=0  # the legacy builder: BuildKit would pull its frontend image
mkdir -p "$CACHE"
start=$(date +%s)
last=$start
took() {  # took LABEL: the seconds since the previous step
    local now
    now=$(date +%s)
    echo "image: $1 in $((now - last)) s"
    last=$now
}

daemon_pid="" index_pid=""
cleanup() {
    set +e
    if "$DOCKER" info > /dev/null 2>&1; then
        "$DOCKER" ps -aq --filter label=loraplane.test=image | xargs -r "$DOCKER" rm -f > /dev/null
    fi
    [ -n "$index_pid" ] && kill "$index_pid" 2> /dev/null && wait "$index_pid" 2> /dev/null
    if [ -n "$daemon_pid" ]; then
        kill "$daemon_pid" 2> /dev/null
        for _ in $(seq 60); do kill -0 "$daemon_pid" 2> /dev/null || break; sleep 0.5; done
    fi
}
trap cleanup EXIT

# -- the engine and debootstrap (Debian's packages)
if ! command -v dockerd > /dev/null || ! command -v debootstrap > /dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        docker.io debootstrap > /dev/null
fi
if ! "$DOCKER" info > /dev/null 2>&1; then
    dockerd --bridge=none --iptables=false --ip-masq=false > "$CACHE/dockerd.log" 2>&1 &
    daemon_pid=$!
    for _ in $(seq 120); do "$DOCKER" info > /dev/null 2>&1 && break; sleep 0.5; done
    "$DOCKER" info > /dev/null || { tail -20 "$CACHE/dockerd.log"; exit 1; }
fi
took "docker.io and its daemon"

# -- the base: Debian's python3 (3.11, the wheels' minor version) from Debian's mirror
if ! "$DOCKER" image inspect "$BASE" > /dev/null 2>&1; then
    root="$CACHE/rootfs"
    if [ ! -x "$root/usr/bin/python3" ]; then
        rm -rf "$root.partial"
        debootstrap --variant=minbase --include=python3,python3-pip,ca-certificates \
            bookworm "$root.partial" > "$CACHE/debootstrap.log" 2>&1 \
            || { tail -20 "$CACHE/debootstrap.log"; exit 1; }
        rm -rf "$root" && mv "$root.partial" "$root"
    fi
    rm -f "$root/usr/lib/python3.11/EXTERNALLY-MANAGED"
    ln -sf python3 "$root/usr/bin/python"
    ln -sf pip3 "$root/usr/bin/pip"
    # pip and apt inside a build reach the indexes the way this machine does
    cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"
    # what a slim Debian image leaves out: documentation, manual pages, translations, caches
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* \
        "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/info/* \
        "$root"/usr/share/locale/* "$root"/var/cache/debconf/*-old
    tar -C "$root" -c . | "$DOCKER" import - "$BASE" > /dev/null
fi
took "base image $BASE"

# -- the wheelhouse: what pip on this machine reaches (torch's CPU wheel is on its disk), laid
#    out as a simple index (one folder per normalised project name); keyed by pyproject.toml
key=$(sha256sum pyproject.toml | cut -c1-16)
house="$CACHE/wheelhouse-$key"
if [ ! -f "$house/done" ]; then
    rm -rf "$house"
    "$PY" -m pip download --quiet --prefer-binary -d "$house/files" \
        "torch==2.13.0" ".[controlplane,operator,dataplane]" "setuptools>=69" wheel 2>&1 \
        | { grep -v "^WARNING: Location 'file:" || true; }
    "$PY" - "$house" << 'EOF'
import os
import re
import sys
from pathlib import Path

house = Path(sys.argv[1])
for f in sorted((house / "files").iterdir()):
    if f.name.endswith(".whl"):
        name = f.name.split("-")[0]
    else:  # an sdist: name-version.tar.gz / .zip
        name = re.sub(r"-[0-9][^-]*$", "", f.name.removesuffix(".tar.gz").removesuffix(".zip"))
    project = re.sub(r"[-_.]+", "-", name).lower()
    if project == "loraplane":
        continue  # the image builds its own wheel
    folder = house / "simple" / project
    folder.mkdir(parents=True, exist_ok=True)
    os.link(f, folder / f.name)
EOF
    touch "$house/done"
fi
port=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$PY" -m http.server "$port" --bind 127.0.0.1 --directory "$house/simple" > /dev/null 2>&1 &
index_pid=$!
for _ in $(seq 50); do
    "$PY" -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/')" 2> /dev/null && break
    sleep 0.2
done
index="http://127.0.0.1:$port/"
echo "image: wheelhouse $(du -sh "$house/files" | cut -f1) ($(ls "$house/simple" | wc -l) projects) on $index"
took "wheelhouse"

# -- the targets, on that base, from that index (the Dockerfile unchanged)
build() {  # build TARGET TAG (its log: $CACHE/build-TARGET.log)
    "$DOCKER" build --network host --target "$1" -t "$2" \
        --build-arg BASE="$BASE" --build-arg PIP_INDEX_URL="$index" \
        --build-arg TORCH_INDEX_URL="$index" . > "$CACHE/build-$1.log" 2>&1 \
        || { tail -40 "$CACHE/build-$1.log"; echo "image: the $1 target did not build" >&2; exit 1; }
}
build slim "$SLIM"
took "build slim ($SLIM)"
build full "$FULL"
took "build full ($FULL)"

mb() { echo $(( $("$DOCKER" image inspect -f '{{.Size}}' "$1") / 1000000 )); }
slim_mb=$(mb "$SLIM") full_mb=$(mb "$FULL")
echo "image: sizes: $SLIM $slim_mb MB (bound $SLIM_MAX_MB), $FULL $full_mb MB (bound $FULL_MAX_MB)"
if [ "$slim_mb" -ge "$SLIM_MAX_MB" ] || [ "$full_mb" -ge "$FULL_MAX_MB" ]; then
    echo "image: an image is over its size bound" >&2
    exit 1
fi

# -- run them as the chart does
LORAPLANE_TEST_IMAGE="$FULL" LORAPLANE_TEST_IMAGE_SLIM="$SLIM" LORAPLANE_TEST_DOCKER="$DOCKER" \
    "$PY" -m pytest -q -p no:cacheprovider tests/image
took "tests/image"
echo "image: done in $(($(date +%s) - start)) s"
