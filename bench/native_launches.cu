// A short native job for bench/rates_gpu.py, traced from its start: built with `nvcc -O2 -cudart static`
// (the runtime inside the executable; it reaches libcuda through cuGetProcAddress, and the pointers it
// gets are libcuda's exported entry points).  After its set-up it launches a small kernel in a loop for
// SECONDS, a stream synchronize after every PER_SYNC launches, and prints at exit one JSON line with its
// exact counts, warm-up included, under the driver functions its runtime calls reach (cudaLaunchKernel:
// cuLaunchKernel; cudaStreamSynchronize: cuStreamSynchronize), so the truth needs no exact-count pass:
//   {"workload": "native_launches", "steps": SYNCS_IN_LOOP, "elapsed_s": LOOP_S, "per_sync": N,
//    "calls": {"cuLaunchKernel": L, "cuStreamSynchronize": S}, "check": "ok"}
// "check": every launch incremented a device counter, read back at the end ("mismatch": it did not).
//   usage: native_launches SECONDS [PER_SYNC]   (PER_SYNC default 32)
#include <cstdio>
#include <cstdlib>
#include <ctime>

__global__ void bump(unsigned long long *n)
{
    if (threadIdx.x == 0)
        atomicAdd(n, 1ULL);
}

static double now()
{
    timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: native_launches SECONDS [PER_SYNC]\n");
        return 2;
    }
    double seconds = atof(argv[1]);
    long per_sync = argc > 2 ? atol(argv[2]) : 32;
    if (seconds <= 0 || per_sync < 1) {
        fprintf(stderr, "native_launches: SECONDS > 0 and PER_SYNC >= 1\n");
        return 2;
    }
    unsigned long long *d;
    cudaStream_t s;
    if (cudaMalloc(&d, sizeof *d) || cudaMemset(d, 0, sizeof *d) || cudaStreamCreate(&s)) {
        fprintf(stderr, "native_launches: CUDA set-up failed: %s\n", cudaGetErrorString(cudaGetLastError()));
        return 1;
    }
    unsigned long long launches = 0, syncs = 0, steps = 0;
    for (int w = 0; w < 8; w++) {  // warm-up: the module loaded, the first launches' costs paid
        bump<<<1, 32, 0, s>>>(d);
        launches++;
    }
    cudaStreamSynchronize(s);
    syncs++;
    double t0 = now(), t;
    do {
        for (long k = 0; k < per_sync; k++) {
            bump<<<1, 32, 0, s>>>(d);
            launches++;
        }
        cudaStreamSynchronize(s);
        syncs++;
        steps++;
        t = now();
    } while (t - t0 < seconds);
    unsigned long long h = 0;
    cudaError_t err = cudaMemcpy(&h, d, sizeof h, cudaMemcpyDeviceToHost);
    int ok = err == cudaSuccess && h == launches;
    printf("{\"workload\": \"native_launches\", \"steps\": %llu, \"elapsed_s\": %.6f, \"per_sync\": %ld, "
           "\"calls\": {\"cuLaunchKernel\": %llu, \"cuStreamSynchronize\": %llu}, \"check\": \"%s\"}\n",
           steps, t - t0, per_sync, launches, syncs, ok ? "ok" : "mismatch");
    fflush(stdout);
    if (!ok)
        fprintf(stderr, "native_launches: device counter %llu, launches %llu (%s)\n", h, launches,
                cudaGetErrorString(err));
    cudaFree(d);
    cudaStreamDestroy(s);
    return ok ? 0 : 1;
}
