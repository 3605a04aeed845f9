#!/usr/bin/env bash
# The check of an NVIDIA machine, as one command that needs no Rust toolchain and no network: the conformance
# self-test on CUDA and on wgpu through Vulkan, a 3-worker sim mixing cuda, wgpu and cpu workers (replicas
# bit-identical), and GPT-2 124M training-step and 4096^3 matmul benchmarks beside PyTorch eager fp32.
# bench/device/pack.sh makes the binaries this reads; bench/device/README.md says how to run it.
#
# Each result is written the moment it is known, to stdout and to OUT_DIR/results.tsv (check, status, figure,
# note; status pass, fail or skipped), so a run cut short still reports; every command's output goes to
# OUT_DIR/log.txt. Each step runs under its own timeout, cut so that the whole run fits in --budget.
# Without an NVIDIA GPU (no /dev/nvidia0, or nvidia-smi fails), or with --no-gpu, the CUDA, NVIDIA-Vulkan and
# GPU benchmark steps are reported skipped with the reason, and the rest runs: info, the CPU self-test, wgpu on
# whatever adapter exists (lavapipe), the sim on cpu and wgpu workers, and a tiny CPU `bench step` that checks
# the figure plumbing.
#
# usage: bench/device/run.sh [--bin DIR] [--out DIR] [--no-gpu] [--budget SECONDS] [--only CHECK,...]
#   --bin DIR    folder with ringtrain and ringtrain-sim (default: $RINGTRAIN_BIN_DIR, else target/device/bin)
#   --out DIR    folder for results.tsv and log.txt (default: $OUT, else a new temporary folder)
#   --no-gpu     skip the GPU parts even where an NVIDIA GPU exists
#   --budget S   wall-clock seconds for the whole run (default 420)
#   --only LIST  run only these checks, comma-separated (the environment probes always run)
# exit: 0 when no check failed, 1 when one did, 2 on a usage error.
set -uo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
pack_dir=$repo/target/device

usage() { # EXIT_STATUS
  sed -n 's/^# \{0,1\}//; /^usage:/,/^exit:/p' "$0" >&2
  exit "$1"
}

bin_dir=${RINGTRAIN_BIN_DIR:-$pack_dir/bin}
out_dir=${OUT:-}
force_no_gpu=0
budget=420
only=
while [ $# -gt 0 ]; do
  case $1 in
    --bin) [ $# -ge 2 ] || usage 2; bin_dir=$2; shift 2 ;;
    --out) [ $# -ge 2 ] || usage 2; out_dir=$2; shift 2 ;;
    --no-gpu) force_no_gpu=1; shift ;;
    --budget) [ $# -ge 2 ] || usage 2; budget=$2; shift 2 ;;
    --only) [ -n "${2:-}" ] || usage 2; only=,$2,; shift 2 ;;
    -h | --help) usage 0 ;;
    *) echo "run.sh: unknown argument $1" >&2; usage 2 ;;
  esac
done
if ! [[ $budget =~ ^[0-9]{1,5}$ ]] || [ "$budget" -lt 10 ]; then
  echo "run.sh: --budget must be a whole number of seconds, 10 to 99999" >&2
  exit 2
fi
# The checks --only may name (the environment probes gpu, binaries, cuda_libs and vulkan_* always run).
checks=(info selftest_cuda bench_step_cuda torch_step torch_matmul torch_step_tf32 bench_step_cuda_tf32 profile_cuda
  selftest_wgpu bench_step_wgpu matmul_cuda matmul_wgpu sim selftest_cpu bench_step_cpu)
if [ -n "$only" ]; then
  IFS=, read -ra asked <<<"${only:1:-1}"
  for check in "${asked[@]}"; do
    if [[ " ${checks[*]} " != *" $check "* ]]; then
      echo "run.sh: --only: unknown check '$check' (expected some of: ${checks[*]})" >&2
      exit 2
    fi
  done
fi
[ -n "$out_dir" ] || out_dir=$(mktemp -d "${TMPDIR:-/tmp}/ringtrain-device.XXXXXX")
mkdir -p "$out_dir" || { echo "run.sh: cannot create $out_dir" >&2; exit 2; }
results=$out_dir/results.tsv
log=$out_dir/log.txt
# Per-step logs and unpacked libraries: scratch, not sent back (the device tool returns at most 8 files).
work=$(mktemp -d "${TMPDIR:-/tmp}/ringtrain-device-work.XXXXXX")
trap 'rm -rf "$work"' EXIT
printf 'check\tstatus\tfigure\tnote\n' >"$results"
: >"$log"

# The shape of ringtrain's `gpt2` preset (ModelConfig::gpt2), for the FLOPs per token; params come from
# each benchmark's own output.
GPT2_LAYERS=12
GPT2_EMBD=768
PEAK_TFLOPS=${PEAK_TFLOPS:-67}
# A fresh model's step-1 loss is about ln(vocab) = ln(50257) for gpt2; far off means it computes wrong.
GPT2_FIRST_LOSS=10.825
# A step that would get less than this is reported skipped instead.
MIN_STEP_SECONDS=5

# ---- results ----------------------------------------------------------------------------------------------

passed=0 failed=0 skipped=0
# record CHECK STATUS FIGURE NOTE: one line in results.tsv (tabs and newlines in the note become spaces).
record() {
  local note=${4//$'\t'/ }
  note=${note//$'\n'/ | }
  printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$note" >>"$results"
  printf 'result: %-18s %-7s %-18s %s\n' "$1" "$2" "$3" "$note" | tee -a "$log"
  case $2 in
    pass) passed=$((passed + 1)) ;;
    fail) failed=$((failed + 1)) ;;
    *) skipped=$((skipped + 1)) ;;
  esac
}

# wanted CHECK: whether --only lets CHECK run.
wanted() { [ -z "$only" ] || [[ $only == *",$1,"* ]]; }

# run_step CHECK MAX_SECONDS CMD...: runs CMD under a timeout of MAX_SECONDS cut to what is left of the
# budget, its output streamed to stdout, the log and $work/CHECK.log; sets step_rc (124 or 137 when the
# timeout ended it) and step_limit. Returns 1, having recorded CHECK as skipped, when the budget is spent.
run_step() {
  local check=$1 max=$2 left
  shift 2
  left=$((budget - SECONDS))
  step_limit=$((max < left ? max : left))
  if [ "$step_limit" -lt "$MIN_STEP_SECONDS" ]; then
    record "$check" skipped "" "the run's ${budget}s budget is spent"
    return 1
  fi
  # `rt CMD...`: CMD with ringtrain's loader path (timeout runs programs, not shell functions).
  [ "$1" = rt ] && set -- env "LD_LIBRARY_PATH=$(rt_path)" "${@:2}"
  printf '\n=== %s (at %ss, limit %ss): %s\n' "$check" "$SECONDS" "$step_limit" "$*" | tee -a "$log"
  : >"$work/$check.log"
  timeout -k 5 "$step_limit" "$@" 2>&1 | tee -a "$log" "$work/$check.log"
  step_rc=${PIPESTATUS[0]}
  return 0
}

timed_out() { [ "$step_rc" = 124 ] || [ "$step_rc" = 137 ]; }

# failure_note CHECK: why CHECK failed, from its log: a timeout, its failing cases, or its last error line.
failure_note() {
  if timed_out; then
    echo "timed out after ${step_limit}s"
    return
  fi
  local failing last
  failing=$(grep -E '\bFAIL' "$work/$1.log" | head -n 5 | tr -s ' ' | paste -sd ';' -)
  last=$(grep -iE '^error' "$work/$1.log" | tail -n 1)
  [ -n "$last" ] || last=$(grep -v '^[[:space:]]*$' "$work/$1.log" | tail -n 1)
  if [ -n "$failing" ]; then
    echo "exit $step_rc; $failing"
  else
    echo "exit $step_rc: ${last:0:300}"
  fi
}

# ---- the environment ----------------------------------------------------------------------------------------

ldconfig_cmd() { command -v ldconfig || echo /sbin/ldconfig; }

# has_system_lib NAME: whether the dynamic loader's cache lists NAME or a NAME.N version of it (ldconfig is in
# /sbin, off a non-root user's PATH).
has_system_lib() {
  local cache
  cache=$("$(ldconfig_cmd)" -p 2>/dev/null)
  grep -qE "^[[:space:]]*${1//./\\.}(\\.[0-9]+)* " <<<"$cache"
}

# unpack_debs DEST DEB...: unpacks Debian packages into DEST (never into /) and puts their library folders
# first on LD_LIBRARY_PATH.
unpack_debs() {
  local dest=$1 deb
  shift
  command -v dpkg >/dev/null || { echo "dpkg is needed to unpack $*"; return 1; }
  mkdir -p "$dest"
  for deb in "$@"; do
    dpkg -x "$deb" "$dest" || { echo "dpkg -x $deb failed"; return 1; }
  done
  rt_ld=$dest/usr/lib/x86_64-linux-gnu:$dest/lib/x86_64-linux-gnu${rt_ld:+:$rt_ld}
}

# The loader path of ringtrain's own processes: the packed Debian libraries first (rt_ld), never python's,
# nvidia-smi's or the driver's.
rt_ld=
rt_path() { echo "${rt_ld}${LD_LIBRARY_PATH:+${rt_ld:+:}$LD_LIBRARY_PATH}"; }
rt() { env LD_LIBRARY_PATH="$(rt_path)" "$@"; }

probe_gpu() {
  gpu=0
  if [ "$force_no_gpu" = 1 ]; then
    no_gpu_reason="--no-gpu given"
  elif [ ! -e /dev/nvidia0 ]; then
    no_gpu_reason="no NVIDIA GPU (no /dev/nvidia0)"
  elif ! command -v nvidia-smi >/dev/null; then
    no_gpu_reason="no NVIDIA GPU usable (/dev/nvidia0 exists but nvidia-smi is missing)"
  elif ! gpu_line=$(timeout 30 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1) ||
    [ -z "${gpu_line%%$'\n'*}" ]; then
    no_gpu_reason="no NVIDIA GPU usable (nvidia-smi failed: ${gpu_line:-no output})"
  else
    gpu=1
    gpu_line=${gpu_line%%$'\n'*} # the first GPU, the one the checks use
  fi
  if [ "$gpu" = 1 ]; then
    { echo "=== gpu"; nvidia-smi; } >>"$log" 2>&1
    record gpu pass "${gpu_line%%,*}" "$gpu_line; MFU against ${PEAK_TFLOPS} TFLOP/s fp32 (H200 SXM; set PEAK_TFLOPS for another GPU)"
  else
    record gpu skipped "" "$no_gpu_reason: CUDA and NVIDIA-Vulkan steps are skipped"
  fi
}

probe_binaries() {
  ringtrain=$bin_dir/ringtrain
  sim=$bin_dir/ringtrain-sim
  have_ringtrain=0 have_sim=0
  local missing=() unresolved b
  for b in "$ringtrain" "$sim"; do
    [ -x "$b" ] || missing+=("$(basename "$b")")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    record binaries fail "" "not in $bin_dir: ${missing[*]} (make them with bench/device/pack.sh, or pass --bin DIR)"
  fi
  # Shared libraries this machine lacks (fontconfig, freetype, ...) come from the packed .debs.
  unresolved=$(for b in "$ringtrain" "$sim"; do [ -x "$b" ] && ldd "$b" 2>&1; done | grep 'not found' | sed 's/^[[:space:]]*//' | sort -u)
  if [ -n "$unresolved" ]; then
    local debs=()
    for b in "$pack_dir"/debs/libs/*.deb; do
      [ -e "$b" ] && debs+=("$b")
    done
    echo "missing shared libraries: $unresolved; unpacking ${debs[*]:-nothing}" | tee -a "$log"
    [ ${#debs[@]} -gt 0 ] && unpack_debs "$work/syslibs" "${debs[@]}" >>"$log" 2>&1
  fi
  [ -x "$ringtrain" ] && rt "$ringtrain" --help >/dev/null 2>>"$log" && have_ringtrain=1
  [ -x "$sim" ] && rt "$sim" --help >/dev/null 2>>"$log" && have_sim=1
  [ -f "$pack_dir/manifest.txt" ] && { echo "=== manifest"; cat "$pack_dir/manifest.txt"; } >>"$log"
  if [ ${#missing[@]} -eq 0 ]; then
    if [ "$have_ringtrain$have_sim" = 11 ]; then
      record binaries pass "" "$bin_dir${unresolved:+ (with the packed libraries for: $(echo "$unresolved" | awk '{print $1}' | paste -sd ' ' -))}"
    else
      record binaries fail "" "in $bin_dir but they do not start: $(tail -n 2 "$log" | paste -sd ' ' -)"
    fi
  fi
}

# CUDA's run-time libraries for the cuda backend (loaded when it opens): the toolkit's, else the ones in the
# nvidia packages of python3's site-packages (PyTorch's), put first on LD_LIBRARY_PATH.
probe_cuda_libs() {
  local dirs=() found=() lib d
  local candidates=("${CUDA_HOME:-/usr/local/cuda}/lib64" /usr/local/cuda/targets/x86_64-linux/lib /usr/local/cuda-*/lib64)
  if command -v python3 >/dev/null; then
    mapfile -t -O ${#candidates[@]} candidates < <(timeout 30 python3 -c '
import glob, os
try:
    import nvidia
except ImportError:
    raise SystemExit
for root in nvidia.__path__:
    for d in sorted(glob.glob(os.path.join(root, "*", "lib"))):
        print(d)' 2>/dev/null)
  fi
  for lib in libnvrtc libcublas libcublasLt; do
    if has_system_lib "$lib.so"; then
      found+=("$lib: system")
      continue
    fi
    for d in "${candidates[@]}"; do
      if compgen -G "$d/$lib.so*" >/dev/null; then
        found+=("$lib: $d")
        [[ " ${dirs[*]} " == *" $d "* ]] || dirs+=("$d")
        continue 2
      fi
    done
  done
  for d in "${dirs[@]}"; do
    export LD_LIBRARY_PATH=$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  done
  # The driver's own folder, for libcuda and the NVIDIA Vulkan driver where the loader's cache lacks them.
  for d in /usr/local/nvidia/lib64 /usr/local/nvidia/lib; do
    [ -d "$d" ] && export LD_LIBRARY_PATH=${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$d
  done
  local summary=
  [ ${#found[@]} -eq 0 ] || summary=$(printf '%s; ' "${found[@]}")
  summary=${summary%; }
  if [ ${#found[@]} -eq 3 ]; then
    record cuda_libs pass "${#found[@]}/3" "$summary"
  elif [ "$gpu" = 1 ]; then
    record cuda_libs fail "${#found[@]}/3" "${summary:+$summary; }others missing from the loader's cache and ${candidates[*]}"
  else
    record cuda_libs skipped "${#found[@]}/3" "$no_gpu_reason; found ${summary:-none}"
  fi
}

# The Vulkan loader (libvulkan.so.1), from the packed libvulkan1 .deb where the machine has none; then, on a
# GPU machine, NVIDIA's Vulkan driver files, to which the loader is pinned so wgpu opens the GPU.
probe_vulkan() {
  have_loader=0 vulkan_nvidia=0 vulkan_unpacked=0
  if has_system_lib libvulkan.so.1; then
    have_loader=1
    record vulkan_loader pass "system" "libvulkan.so.1 in the loader's cache"
  elif unpack_vulkan_debs && [ -e "$work/vulkan/usr/lib/x86_64-linux-gnu/libvulkan.so.1" ]; then
    have_loader=1
    record vulkan_loader pass "packed" "libvulkan1 from $pack_dir/debs/vulkan unpacked into a scratch folder"
  elif [ "$gpu" = 1 ]; then
    record vulkan_loader fail "" "no libvulkan.so.1 on this machine and none unpacked from $pack_dir/debs/vulkan (bench/device/pack.sh downloads it)"
  else
    record vulkan_loader skipped "" "no libvulkan.so.1 on this machine and none packed in $pack_dir/debs/vulkan; wgpu is skipped"
  fi
  if [ "$gpu" = 0 ]; then
    record vulkan_nvidia skipped "" "$no_gpu_reason; wgpu runs on whatever adapter this machine has"
    return
  fi
  local dirs=(/etc/vulkan/icd.d /usr/share/vulkan/icd.d /usr/local/share/vulkan/icd.d /usr/local/nvidia/share/vulkan/icd.d)
  local d f icd='' gaps rc
  for d in "${dirs[@]}"; do
    for f in "$d"/nvidia_icd*.json; do
      [ -e "$f" ] && { icd=$f; break 2; }
    done
  done
  if [ -z "$icd" ]; then
    record vulkan_nvidia skipped "" "no NVIDIA Vulkan driver files (nvidia_icd*.json) in ${dirs[*]}: the wgpu steps are skipped"
    return
  elif [ "$have_loader" = 0 ]; then
    record vulkan_nvidia skipped "" "$icd found, but no Vulkan loader: the wgpu steps are skipped"
    return
  fi
  # The driver's library may need GL dispatch libraries (libGLdispatch) that only the packed set brings.
  gaps=$(icd_library_gaps "$icd")
  rc=$?
  if [ "$rc" = 1 ] && [ "$vulkan_unpacked" = 0 ] && unpack_vulkan_debs; then
    gaps=$(icd_library_gaps "$icd")
    rc=$?
  fi
  case $rc in
    1) record vulkan_nvidia fail "" "$icd: its driver library cannot load, missing $gaps" ;;
    *)
      export VK_DRIVER_FILES=$icd VK_ICD_FILENAMES=$icd
      vulkan_nvidia=1
      local packed=
      [ "$vulkan_unpacked" = 1 ] && packed="; with the packed loader libraries"
      record vulkan_nvidia pass "" "$icd, pinned with VK_DRIVER_FILES${gaps:+ ($gaps)}$packed"
      ;;
  esac
}

# unpack_vulkan_debs: the packed Vulkan loader and GL dispatch libraries, into a scratch folder (once).
unpack_vulkan_debs() {
  local debs=("$pack_dir"/debs/vulkan/*.deb)
  [ -e "${debs[0]}" ] || return 1
  [ "$vulkan_unpacked" = 1 ] && return 0
  unpack_debs "$work/vulkan" "${debs[@]}" >>"$log" 2>&1 || return 1
  vulkan_unpacked=1
}

# icd_library_gaps ICD: checks the library that Vulkan driver file ICD names. Prints nothing and returns 0
# when all its dependencies resolve; prints the missing ones and returns 1; prints why it could not look and
# returns 2 (the wgpu steps then tell).
icd_library_gaps() {
  local lib path='' d
  lib=$(sed -n 's/.*"library_path"[[:space:]]*:[[:space:]]*"\([^"]*\)".*/\1/p' "$1" | head -n 1)
  [ -n "$lib" ] || { echo "could not read its library_path"; return 2; }
  if [[ $lib == /* ]]; then
    path=$lib
  else
    local search=()
    IFS=: read -ra search <<<"${rt_ld}:${LD_LIBRARY_PATH:-}"
    for d in "${search[@]}" /usr/local/nvidia/lib64 /lib/x86_64-linux-gnu /usr/lib/x86_64-linux-gnu /usr/lib64 /usr/lib; do
      [ -n "$d" ] && [ -e "$d/$lib" ] && { path=$d/$lib; break; }
    done
    [ -n "$path" ] || path=$("$(ldconfig_cmd)" -p 2>/dev/null | awk -v name="$lib" '$1 == name {print $NF; exit}')
  fi
  if [ -z "$path" ] || [ ! -e "$path" ]; then
    echo "did not find its library $lib"
    return 2
  fi
  local missing
  missing=$(rt ldd "$path" 2>&1 | awk '/not found/ {print $1}' | paste -sd ' ' -)
  [ -z "$missing" ] || { echo "$missing (needed by $path)"; return 1; }
}

# ---- the checks ---------------------------------------------------------------------------------------------

check_info() {
  wanted info || return 0
  run_step info 20 rt "$ringtrain" info || return 0
  if [ "$step_rc" = 0 ]; then
    # The CUDA lines (driver, devices, NVRTC, cuBLAS) follow `cuda:` indented, up to the `--backend` line.
    record info pass "" "$(sed -n '/^cuda:/,/^--backend/p' "$work/info.log" | sed 's/^ *//' | paste -sd ';' -)"
  else
    record info fail "" "$(failure_note info)"
  fi
}

# Whether wgpu has an adapter to test here: the NVIDIA one on a GPU machine, any one (lavapipe) elsewhere.
wgpu_usable() {
  if [ "$gpu" = 1 ]; then
    [ "$vulkan_nvidia" = 1 ]
  else
    local info
    info=$(rt timeout 60 "$ringtrain" info 2>/dev/null)
    [ "$have_loader" = 1 ] && grep -q '^wgpu: [1-9]' <<<"$info"
  fi
}

check_selftest() { # BACKEND LIMIT
  local check=selftest_$1 summary figure
  wanted "$check" || return 0
  run_step "$check" "$2" rt "$ringtrain" selftest --backend "$1" || return 0
  summary=$(grep -o 'selftest: [0-9]*/[0-9]* passed on .*' "$work/$check.log" | tail -n 1)
  figure=$(sed -n 's#^selftest: \([0-9]*/[0-9]*\) passed.*#\1#p' <<<"$summary")
  if [ "$step_rc" = 0 ] && [ -n "$summary" ]; then
    record "$check" pass "$figure" "$summary"
  elif [ "$step_rc" = 0 ]; then
    record "$check" fail "" "exit 0 but no 'selftest: X/Y passed on' line"
  else
    record "$check" fail "$figure" "$(failure_note "$check")"
  fi
}

check_sim() { # BACKENDS
  wanted sim || return 0
  run_step sim 25 rt "$sim" --workers 3 --backends "$1" --update sharded --steps 5 || return 0
  local verdict
  verdict=$(grep -E 'bit-identical|diverged' "$work/sim.log" | tail -n 1)
  if [ "$step_rc" = 0 ] && [[ $verdict == *bit-identical* ]]; then
    record sim pass "bit-identical" "backends $1: $verdict"
  else
    record sim fail "" "backends $1: $(failure_note sim)"
  fi
}

# record_figures CHECK KIND ARGS...: the figure and note figures.py reads from CHECK's log, recorded as a pass;
# a fail when the command failed or printed no figure.
record_figures() {
  local check=$1 line
  shift
  if timed_out || [ "$step_rc" != 0 ]; then
    record "$check" fail "" "$(failure_note "$check")"
  elif ! command -v python3 >/dev/null; then
    record "$check" fail "" "python3 is needed to read the figures (they are in the log)"
  elif line=$(python3 "$here/figures.py" "$@" <"$work/$check.log" 2>&1); then
    record "$check" pass "${line%%$'\t'*}" "${line#*$'\t'}"
  else
    record "$check" fail "" "$line"
  fi
}

check_bench_step() { # CHECK BACKEND MODEL BATCH SEQ STEPS LIMIT [EXTRA FLAG...]
  wanted "$1" || return 0
  run_step "$1" "$7" rt "$ringtrain" bench step --backend "$2" --model "$3" --batch-size "$4" --seq-len "$5" \
    --steps "$6" --warmup-steps 2 "${@:8}" || return 0
  local shape=(--layers "$GPT2_LAYERS" --embd "$GPT2_EMBD" --loss-near "$GPT2_FIRST_LOSS")
  [ "$3" = tiny ] && shape=(--layers 2 --embd 64) # ModelConfig::tiny
  record_figures "$1" step "${shape[@]}" --peak-tflops "$PEAK_TFLOPS"
}

# The per-op profile of the CUDA step (each op synchronised, so slower than bench_step_cuda): its table goes
# to the log, its JSON line (with `profile`) too; the figure is the step's tokens/s under profiling.
check_profile() {
  wanted profile_cuda || return 0
  run_step profile_cuda 30 rt "$ringtrain" bench step --backend cuda --model gpt2 --batch-size 8 --seq-len 1024 \
    --steps 2 --warmup-steps 1 --profile || return 0
  record_figures profile_cuda step --layers "$GPT2_LAYERS" --embd "$GPT2_EMBD" --peak-tflops "$PEAK_TFLOPS"
}

check_matmul() { # BACKEND
  wanted "matmul_$1" || return 0
  run_step "matmul_$1" 15 rt "$ringtrain" bench kernels --backend "$1" --sizes 4096 --iters 5 || return 0
  record_figures "matmul_$1" matmul --size 4096
}

# The PyTorch reference: one process gives torch_step, torch_matmul and torch_step_tf32 (the same step with
# TF32 matmuls); torch_ref.py exits 3 when python3 has no torch, transformers or CUDA.
check_torch() {
  local all=(torch_step torch_matmul torch_step_tf32) c
  wanted torch_step || wanted torch_matmul || wanted torch_step_tf32 || return 0
  if [ "$gpu" = 0 ]; then
    skip_all "$no_gpu_reason" "${all[@]}"
    return
  elif ! command -v python3 >/dev/null; then
    skip_all "no python3" "${all[@]}"
    return
  fi
  run_step torch_step 95 env PYTHONUNBUFFERED=1 python3 "$here/torch_ref.py" --model gpt2 --batch-size 8 \
    --seq-len 1024 --steps 6 --warmup 2 --matmul 4096 --matmul-iters 10 --tf32 || {
    skip_all "the run's ${budget}s budget is spent" torch_matmul torch_step_tf32
    return
  }
  if [ "$step_rc" = 3 ]; then
    skip_all "PyTorch reference unavailable: $(tail -n 1 "$work/torch_step.log")" "${all[@]}"
    return
  fi
  for c in torch_matmul torch_step_tf32; do cp "$work/torch_step.log" "$work/$c.log"; done
  local shape=(--layers "$GPT2_LAYERS" --embd "$GPT2_EMBD" --peak-tflops "$PEAK_TFLOPS" --loss-near "$GPT2_FIRST_LOSS")
  wanted torch_step && record_figures torch_step step "${shape[@]}" --impl pytorch-eager-fp32
  wanted torch_matmul && record_figures torch_matmul matmul --size 4096
  wanted torch_step_tf32 && record_figures torch_step_tf32 step "${shape[@]}" --impl pytorch-eager-tf32
  return 0
}

skip_all() { # REASON CHECK...
  local reason=$1 check
  shift
  for check in "$@"; do
    wanted "$check" && record "$check" skipped "" "$reason"
  done
  return 0
}

# skip_or REASON CHECK CMD...: records CHECK skipped with REASON when REASON is set, else runs CMD.
skip_or() {
  if [ -n "$1" ]; then
    skip_all "$1" "$2"
  else
    "${@:3}"
  fi
}

# libcuda.so.1 as ringtrain's processes will load it: the driver's, not the CUDA toolkit's stub (which loads
# but fails every call), found first on the loader path or in the loader's cache.
probe_cuda_driver() {
  if [ "$gpu" = 0 ]; then
    record cuda_driver skipped "" "$no_gpu_reason"
    return
  fi
  local dirs=() d path=
  IFS=: read -ra dirs <<<"$(rt_path)"
  for d in "${dirs[@]}"; do
    [ -n "$d" ] && [ -e "$d/libcuda.so.1" ] && { path=$d/libcuda.so.1; break; }
  done
  [ -n "$path" ] || path=$("$(ldconfig_cmd)" -p 2>/dev/null | awk '$1 == "libcuda.so.1" {print $NF; exit}')
  if [ -z "$path" ]; then
    record cuda_driver fail "" "no libcuda.so.1 on the loader path or in its cache: the NVIDIA driver's library is missing"
  elif [[ $(readlink -f "$path") == */stubs/* ]]; then
    record cuda_driver fail "" "$path is the CUDA toolkit's stub, not the driver: take its folder off LD_LIBRARY_PATH"
  else
    record cuda_driver pass "" "$(readlink -f "$path")"
  fi
}

# ---- the run ------------------------------------------------------------------------------------------------

echo "run.sh: results in $results, full log in $log (budget ${budget}s)"
probe_gpu
probe_binaries
probe_cuda_libs
probe_cuda_driver
probe_vulkan
echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}" >>"$log"

# Why each kind of check cannot run on this machine ('' where it can).
cuda_skip='' wgpu_skip='' sim_skip='' no_ringtrain=''
[ "$gpu" = 1 ] || cuda_skip=$no_gpu_reason
[ "$have_sim" = 1 ] || sim_skip="no working ringtrain-sim binary (see binaries)"
[ "$have_ringtrain" = 1 ] || no_ringtrain="no working ringtrain binary (see binaries)"
# Ordered by what a short loan of the machine should learn first: CUDA's correctness and speed beside
# PyTorch's (fp32, then TF32), where its time goes, then wgpu, then what CI already checks elsewhere.
if [ -n "$no_ringtrain" ]; then
  skip_all "$no_ringtrain" info selftest_cuda bench_step_cuda
else
  check_info
  wgpu_usable || wgpu_skip="no wgpu adapter (on a GPU machine: the NVIDIA Vulkan driver, see vulkan_nvidia; elsewhere: mesa-vulkan-drivers for lavapipe)"
  skip_or "$cuda_skip" selftest_cuda check_selftest cuda 45
  skip_or "$cuda_skip" bench_step_cuda check_bench_step bench_step_cuda cuda gpt2 8 1024 6 50
fi
check_torch
# The wgpu benchmarks are GPU benchmarks: without an NVIDIA GPU they say so, not that lavapipe is slow.
wgpu_bench_skip=${cuda_skip:-$wgpu_skip}
if [ -n "$no_ringtrain" ]; then
  skip_all "$no_ringtrain" bench_step_cuda_tf32 profile_cuda selftest_wgpu bench_step_wgpu matmul_cuda \
    matmul_wgpu sim selftest_cpu bench_step_cpu
else
  skip_or "$cuda_skip" bench_step_cuda_tf32 check_bench_step bench_step_cuda_tf32 cuda gpt2 8 1024 4 30 \
    --matmul-precision tf32
  skip_or "$cuda_skip" profile_cuda check_profile
  skip_or "$wgpu_skip" selftest_wgpu check_selftest wgpu 35
  skip_or "$wgpu_bench_skip" bench_step_wgpu check_bench_step bench_step_wgpu wgpu gpt2 8 1024 3 35
  skip_or "$cuda_skip" matmul_cuda check_matmul cuda
  skip_or "$wgpu_bench_skip" matmul_wgpu check_matmul wgpu
  # cuda, wgpu and cpu ranks; cpu stands in for a backend this machine lacks.
  skip_or "$sim_skip" sim check_sim "$([ -z "$cuda_skip" ] && echo cuda || echo cpu),$([ -z "$wgpu_skip" ] && echo wgpu || echo cpu),cpu"
  check_selftest cpu 25
  # The figure plumbing on a tiny model (a fraction of a second).
  check_bench_step bench_step_cpu cpu tiny 2 32 3 15
fi

# ratio_to_torch CHECK TORCH_CHECK GOAL: CHECK's tokens/s over PyTorch's, beside the issue's goal, when both
# ran.
ratio_to_torch() {
  awk -F'\t' -v check="$1" -v ref="$2" -v goal="$3" '
    $1 == check && $2 == "pass" { mine = $3 + 0 }
    $1 == ref && $2 == "pass" { torch = $3 + 0 }
    END { if (mine > 0 && torch > 0) printf "%s tokens/s = %.2f x %s (goal: at least %s)\n", check, mine / torch, ref, goal }
  ' "$results"
}

{
  printf '\n=== summary after %ss: %s passed, %s failed, %s skipped\n' "$SECONDS" "$passed" "$failed" "$skipped"
  column -t -s $'\t' "$results" 2>/dev/null || cat "$results"
  ratio_to_torch bench_step_cuda torch_step 1.0
  ratio_to_torch bench_step_cuda_tf32 torch_step_tf32 1.0
  ratio_to_torch bench_step_wgpu torch_step 0.5
} | tee -a "$log"
[ "$failed" = 0 ]
