#!/usr/bin/env bash
# Packs what bench/device/run.sh needs on an NVIDIA machine that has no Rust toolchain and no network, into
# target/device/ (ignored with the rest of target/, so nothing needs adding to .git/info/exclude):
#   bin/ringtrain, bin/ringtrain-sim  one release build with the `cuda` feature, stripped (about 34 MiB together)
#   debs/vulkan/*.deb                 Debian's Vulkan loader (libvulkan1) with the GL dispatch libraries that
#                                     the device README's recipe brings beside it (libglvnd0, ...), unpacked
#                                     there only where the machine has no libvulkan.so.1 or NVIDIA's Vulkan
#                                     driver lacks one of them
#   debs/libs/*.deb                   the packages of the other shared libraries the binaries link (fontconfig,
#                                     freetype, ...; glibc and libgcc aside), unpacked only where one is missing
#   manifest.txt                      the commit, features and sizes, copied into the run's log
# The folder stays well under the device tool's 64 MiB (the repository's tracked files add about 4 MiB).
#
# Takes: the release build, 1 to 2 minutes on 2 cores when only ringtrain's own crates changed since the last
# one (measured: 1m08s and 1m49s); a cold target/release also compiles every dependency, several times that.
# The strip and the package download take a few seconds. Needs cargo, strip
# (binutils), apt-get and dpkg (Debian or Ubuntu), and an x86-64 host, since that is what the NVIDIA machines
# run.
# usage: bench/device/pack.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
out=target/device

if [ "$(uname -m)" != x86_64 ]; then
  echo "pack.sh: this host is $(uname -m); the binaries must be built on x86-64 for the NVIDIA machines" >&2
  exit 1
fi
for tool in cargo strip apt-get dpkg; do
  command -v "$tool" >/dev/null || { echo "pack.sh: $tool is needed" >&2; exit 1; }
done

cargo build --release --locked -p ringtrain -p ringtrain-sim --features ringtrain/cuda,ringtrain-sim/cuda
rm -rf "$out"
mkdir -p "$out/bin" "$out/debs/vulkan" "$out/debs/libs"
for b in ringtrain ringtrain-sim; do
  strip -o "$out/bin/$b" "target/release/$b"
done

# The Debian package of each shared library the binaries link, by the file's path (merged-/usr systems list
# some under /lib and some under /usr/lib).
owner_of() {
  local path candidate owner
  for path in "$1" "$(readlink -f "$1")"; do
    for candidate in "$path" "/usr${path#/usr}" "${path#/usr}"; do
      # "package:arch: path" lines; the first one's package.
      if owner=$(dpkg -S "$candidate" 2>/dev/null); then
        owner=${owner%%$'\n'*}
        echo "${owner%%:*}"
        return 0
      fi
    done
  done
  echo "pack.sh: no Debian package owns $1" >&2
  return 1
}
mapfile -t libs < <(ldd "$out"/bin/* | awk '/=> \// {print $3}' | sort -u)
pkgs=()
for lib in "${libs[@]}"; do
  pkg=$(owner_of "$lib")
  case $pkg in
    libc6 | libgcc-s1) ;; # wherever these binaries can start at all, these are present
    *) [[ " ${pkgs[*]} " == *" $pkg "* ]] || pkgs+=("$pkg") ;;
  esac
done

# amd64 packages whatever this host's own package architecture, from a private copy of the package lists.
lists=$(mktemp -d)
trap 'rm -rf "$lists"' EXIT
mkdir -p "$lists/partial"
apt_opts=(-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 "-oDir::State::Lists=$lists")
apt-get "${apt_opts[@]}" update -qq
(cd "$out/debs/vulkan" && apt-get "${apt_opts[@]}" download -qq libvulkan1 libglvnd0 libegl1 libopengl0 libgl1 libglx0 libgles2)
(cd "$out/debs/libs" && apt-get "${apt_opts[@]}" download -qq "${pkgs[@]}")

{
  echo "commit $(git rev-parse HEAD)$(git diff --quiet HEAD -- . ':!target' || echo ' (with uncommitted changes)')"
  echo "built $(date -u '+%F %H:%M') UTC on $(uname -srm), features ringtrain/cuda ringtrain-sim/cuda, release, stripped"
  (cd "$out" && du -b bin/* debs/*/*)
} >"$out/manifest.txt"
cat "$out/manifest.txt"
echo "pack.sh: $(du -sh "$out" | cut -f1) in $out; carry it to the device machine (bench/device/README.md)"
