#!/usr/bin/env bash
# The whole test suite, with its set-up: installs the system packages the tests need when they are missing
# (Debian/Ubuntu, as root), checks formatting and clippy, then builds every feature and runs every test of the
# workspace.
# With CI=true, GPU-path tests fail instead of skipping when no wgpu adapter is found.
set -euo pipefail
cd "$(dirname "$0")"

need_pkgs=()
[ -e /usr/share/vulkan/icd.d/lvp_icd.x86_64.json ] || [ -e /usr/share/vulkan/icd.d/lvp_icd.json ] || need_pkgs+=(mesa-vulkan-drivers)
# The loader's cache (ldconfig -p) can lag a fresh install, so ask for the file itself.
{ ldconfig -p 2>/dev/null | grep -q 'libvulkan.so.1' || compgen -G '/usr/lib/*/libvulkan.so.1' >/dev/null; } || need_pkgs+=(libvulkan1)
pkg-config --exists fontconfig 2>/dev/null || need_pkgs+=(libfontconfig1-dev pkg-config)
fc-list 2>/dev/null | grep -qi dejavu || need_pkgs+=(fonts-dejavu-core)
# tests/emulated_hosts.rs (as root) builds network namespaces with ip and shapes them with tc.
{ command -v ip && command -v tc; } >/dev/null 2>&1 || need_pkgs+=(iproute2)
# The CUDA backend's emulator tests build kernels/*.cu with g++. (tests/slurm.rs's script installs Slurm and
# munge itself, as root.)
command -v g++ >/dev/null 2>&1 || need_pkgs+=(g++)
if [ ${#need_pkgs[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "run-tests: installing ${need_pkgs[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${need_pkgs[@]}" >/dev/null
  else
    echo "run-tests: missing packages ${need_pkgs[*]} (install them, or run as root on Debian/Ubuntu)" >&2
  fi
fi

# Mesa's lavapipe prints an error for every Vulkan instance when XDG_RUNTIME_DIR is unset (harmless, but it
# floods the log); give it a private directory for this run.
if [ -z "${XDG_RUNTIME_DIR:-}" ]; then
  XDG_RUNTIME_DIR=$(mktemp -d)
  export XDG_RUNTIME_DIR
  trap 'rm -rf "$XDG_RUNTIME_DIR"' EXIT
fi

# Every stage runs even when an earlier one failed, so that one run reports every failure; the script
# then lists the failed stages and exits non-zero.
failed_stages=()
stage() { # a name, then the command
  local name=$1
  shift
  echo "run-tests: stage: $name"
  if ! "$@"; then
    echo "run-tests: FAILED stage: $name" >&2
    failed_stages+=("$name")
  fi
}

# Habits first, since they fail in seconds: formatting, then clippy on every crate of the workspace (the
# fuzz targets included) with and without the `cuda` feature, warnings as errors.
stage fmt cargo fmt --all -- --check
stage clippy cargo clippy --workspace --all-targets --profile test -- -D warnings
stage "clippy (cuda)" cargo clippy --workspace --all-targets --profile test --features ringtrain/cuda -- -D warnings

# NVRTC for tests/nvrtc_kernels.rs, which compiles every kernels/*.cu without a GPU: the newest release and
# the 13.0 series (what the driver of the NVIDIA machines this project borrows accepts), each from NVIDIA's
# pip wheel into its own folder under target/ (delete target/nvrtc to fetch a newer release). Left alone
# when RINGTRAIN_NVRTC_LIBS is set or pip is missing: the test then looks for libnvrtc.so.13 on the loader's
# path, and skips without it (fails under CI=true).
install_nvrtc() { # folder under target/nvrtc, pip requirement; prints the library's path
  local dir="target/nvrtc/$1" lib
  lib=$(find "$dir" -name libnvrtc.so.13 2>/dev/null | head -n 1)
  if [ -z "$lib" ]; then
    python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --no-deps --target "$dir" "$2" >&2 || return 1
    lib=$(find "$dir" -name libnvrtc.so.13 | head -n 1)
  fi
  [ -n "$lib" ] && echo "$PWD/$lib"
}
if [ -z "${RINGTRAIN_NVRTC_LIBS:-}" ] && python3 -m pip --version >/dev/null 2>&1; then
  if nvrtc_newest=$(install_nvrtc newest nvidia-cuda-nvrtc) && nvrtc_13_0=$(install_nvrtc 13.0 'nvidia-cuda-nvrtc==13.0.*'); then
    export RINGTRAIN_NVRTC_LIBS="$nvrtc_newest:$nvrtc_13_0"
  else
    echo "run-tests: could not install NVRTC with pip; tests/nvrtc_kernels.rs looks for libnvrtc.so.13 itself" >&2
  fi
fi

# One build of the test profile serves the rest: the tests, then the `cuda` feature's library and binary,
# which must keep building where no NVIDIA GPU exists (only the ringtrain crate is rebuilt for it).
# --no-fail-fast: a failing test binary does not stop the others from running.
stage tests cargo test --workspace --no-fail-fast
# The wgpu conformance and training tests again, with a software adapter (lavapipe) running only the kernels
# a hardware GPU runs (tree reductions, plain and strided matmuls), so CI checks those kernels too.
stage "wgpu hardware kernels" env RINGTRAIN_WGPU_HARDWARE_KERNELS=1 \
  cargo test -p ringtrain --no-fail-fast --test conformance --test wgpu_training
stage "cuda build" cargo build --profile test -p ringtrain --features cuda --lib --bins
# The CUDA backend's own tests: its NVRTC path compiles every kernel to CUBIN and caches it (NVRTC found on the
# loader's path, here the first library named above); its op logic, kernels (built by g++ against a fiber
# shim) and GEMM layouts pass the conformance suite and train `tiny` like the CPU on an emulator; and
# without a driver `--backend cuda` says what is missing while `auto` opens another backend.
nvrtc_dir=$(dirname "${RINGTRAIN_NVRTC_LIBS%%:*}" 2>/dev/null || true)
stage "cuda tests" env LD_LIBRARY_PATH="${nvrtc_dir:+$nvrtc_dir:}${LD_LIBRARY_PATH:-}" \
  cargo test --profile test -p ringtrain --no-fail-fast --features cuda --lib -- backend::cuda backend::factory

# The benchmark harness that lives outside the workspace (its own lock file) must keep building too.
check_nexar() { (cd bench/allreduce/nexar && CARGO_TARGET_DIR=../../../target/bench-nexar cargo check --locked --quiet); }
stage "nexar harness" check_nexar

if [ ${#failed_stages[@]} -gt 0 ]; then
  echo "run-tests: ${#failed_stages[@]} stage(s) failed: ${failed_stages[*]}" >&2
  exit 1
fi
echo "run-tests: every stage passed"
