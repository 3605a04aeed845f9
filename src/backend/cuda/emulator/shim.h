// Runs CUDA C kernels on the CPU for ringtrain's tests: each block's 256 threads are fibers (ucontext) on one
// OS thread, switched at every __syncthreads(), so a block's threads meet at each barrier exactly as on a
// GPU: every live thread runs up to its next barrier before any runs past it. Blocks run one after another,
// so `__shared__` arrays can be plain statics. Compiled with -ffp-contract=off (the kernels' --fmad=false).
#include <math.h>
#include <string.h>
#include <ucontext.h>
#include <cstddef>
#include <type_traits>
#include <utility>

// CUDA's integer min and max builtins.
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }

struct EmuDim3 {
    unsigned x, y, z;
};

// CUDA's float4 (16-byte aligned, as on the device) and its maker.
struct alignas(16) float4 {
    float x, y, z, w;
};
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
static EmuDim3 threadIdx, blockIdx;

namespace emu {
constexpr int THREADS = 256;
constexpr std::size_t STACK_BYTES = 64 * 1024;
static ucontext_t scheduler;
static ucontext_t fibers[THREADS];
static bool finished[THREADS];
static int block_threads = THREADS;
static char* stacks = nullptr;
static int current = 0;
static void (*block_body)(void*) = nullptr;
static void* block_arg = nullptr;

static void fiber_main() {
    block_body(block_arg);
    finished[current] = true;
}

inline void barrier() { swapcontext(&fibers[current], &scheduler); }

// Runs one block of `block_threads` fibers: every fiber until its next barrier, round after round, until
// all have returned.
static void run_block(void (*body)(void*), void* arg) {
    if (stacks == nullptr) { stacks = new char[THREADS * STACK_BYTES]; }
    block_body = body;
    block_arg = arg;
    for (int i = 0; i < block_threads; i++) {
        getcontext(&fibers[i]);
        fibers[i].uc_stack.ss_sp = stacks + i * STACK_BYTES;
        fibers[i].uc_stack.ss_size = STACK_BYTES;
        fibers[i].uc_link = &scheduler;
        makecontext(&fibers[i], fiber_main, 0);
        finished[i] = false;
    }
    for (bool live = true; live;) {
        live = false;
        for (int i = 0; i < block_threads; i++) {
            if (finished[i]) { continue; }
            current = i;
            threadIdx.x = (unsigned)i;
            swapcontext(&scheduler, &fibers[i]);
            live = live || !finished[i];
        }
    }
}

// Calls kernel `k` with its parameters read from `params[i]`, each a pointer to the value (as for
// cuLaunchKernel).
template <typename... A, std::size_t... I>
void invoke(void (*k)(A...), void** params, std::index_sequence<I...>) {
    k(*static_cast<std::remove_reference_t<A>*>(params[I])...);
}

// Runs kernel `k` on `blocks` blocks of `threads` (at most THREADS) threads.
template <typename... A>
void grid(void (*k)(A...), unsigned blocks, unsigned threads, void** params) {
    block_threads = (int)threads;
    struct Call {
        void (*k)(A...);
        void** params;
    } call{k, params};
    for (unsigned b = 0; b < blocks; b++) {
        blockIdx.x = b;
        run_block([](void* c) {
            auto* call = static_cast<Call*>(c);
            invoke(call->k, call->params, std::index_sequence_for<A...>{});
        }, &call);
    }
}
}  // namespace emu

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(n)
#define __shared__ static
#define __syncthreads() emu::barrier()
