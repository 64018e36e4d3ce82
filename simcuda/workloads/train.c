/* train: a job whose every step depends on all of its device memory and on its host state, for
 * whole-process checkpoint tests (checkpoint at some step, kill, restore: do the remaining steps print
 * what an uninterrupted run prints?).
 *
 *   usage: train [--size BYTES] [--steps N] [--kernel-ns NS] [--vmm 0|1|2|3] [--churn N] [--host BYTES]
 *
 * Holds a cuMemAlloc_v2 buffer of --size bytes (default 4 MiB) and a VMM mapping of one allocation
 * granule (unless --vmm 0; --vmm 2: its handle released as soon as it is mapped; --vmm 3: that granule
 * from cuMemAllocAsync instead, and each step a granule more allocated and freed stream-ordered), both filled from a fixed pattern; host state is a 64-bit chain value and a malloc'ed history
 * of every step's checksum.  Each step: inc_u32 kernels over both buffers (each --kernel-ns long, default
 * 10 ms, so a checkpoint catches the job mid-run), then both copied back and checksummed (FNV-1a), the
 * chain advanced, and one line printed and flushed:
 *   step K DEVSUM CHAIN
 * --churn N: each step also allocates N temporary buffers with cuMemAlloc_v2 (sizes varying with the
 * step), copies a slice of the first buffer into each, folds them into the step's checksum and frees
 * them again, as a training loop's activations come and go: the allocator hands the same addresses
 * to other data step after step, which a rollback of device memory alone cannot follow.
 * --host BYTES: the job also holds that much host memory (filled once), of which each step writes one
 * word in one page (the step's checksum into page K mod the pages), as a job whose host memory is large
 * but changes little between checkpoints; "done" then adds a checksum of all of it.
 * After the last step: "done HISTSUM" (a checksum of the whole host-side history), exit 0.  The output
 * depends only on the step numbers, never on timing: an uninterrupted run is the reference. */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda.h"

#define CK(call)                                                                        \
    do {                                                                                \
        CUresult r_ = (call);                                                           \
        if (r_ != CUDA_SUCCESS) {                                                       \
            fprintf(stderr, "train: %s failed: CUresult %d\n", #call, (int)r_);         \
            exit(1);                                                                    \
        }                                                                               \
    } while (0)

static uint64_t fnv(const void *p, size_t n, uint64_t x)
{
    const uint64_t *w = p;
    for (size_t k = 0; k < n / 8; k++)
        x = (x ^ w[k]) * 0x100000001b3ull;
    return x;
}

int main(int argc, char **argv)
{
    size_t size = 4 << 20;
    long steps = 100;
    long long kernel_ns = 10000000;
    int vmm = 1;
    long churn = 0;
    size_t hostb = 0;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--size"))
            size = strtoull(argv[i + 1], NULL, 0);
        else if (!strcmp(argv[i], "--steps"))
            steps = strtol(argv[i + 1], NULL, 0);
        else if (!strcmp(argv[i], "--kernel-ns"))
            kernel_ns = strtoll(argv[i + 1], NULL, 0);
        else if (!strcmp(argv[i], "--vmm"))
            vmm = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--churn"))
            churn = strtol(argv[i + 1], NULL, 0);
        else if (!strcmp(argv[i], "--host"))
            hostb = strtoull(argv[i + 1], NULL, 0) & ~(size_t)4095;
        else {
            fprintf(stderr, "usage: train [--size BYTES] [--steps N] [--kernel-ns NS] [--vmm 0|1|2|3] [--churn N] "
                            "[--host BYTES]\n");
            return 2;
        }
    }
    if (!size || size % 8 || steps <= 0 || churn < 0 || churn > 64) {
        fprintf(stderr, "train: --size must be a positive multiple of 8, --steps positive, --churn 0-64\n");
        return 2;
    }
    CUdevice dev;
    CUcontext ctx;
    CUstream s;
    CUmodule mod;
    CUfunction inc;
    CK(cuInit(0));
    CK(cuDeviceGet(&dev, 0));
    CK(cuDevicePrimaryCtxRetain(&ctx, dev));
    CK(cuCtxSetCurrent(ctx));
    CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    char image[128];
    snprintf(image, sizeof image, "SIMCUDA-MODULE\nkernel inc inc_u32 %lld\n", kernel_ns);
    CK(cuModuleLoadData(&mod, image));
    CK(cuModuleGetFunction(&inc, mod, "inc"));

    CUdeviceptr a;
    CK(cuMemAlloc_v2(&a, size));
    CUmemAllocationProp prop = {.type = CU_MEM_ALLOCATION_TYPE_PINNED};
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = dev;
    size_t gran = 2 << 20;
    CUmemGenericAllocationHandle h = 0;
    CUdeviceptr v;
    if (vmm == 3) { /* stream-ordered, as JAX's and CuPy's async allocators */
        CK(cuMemAllocAsync(&v, gran, s));
        CK(cuStreamSynchronize(s));
    } else if (vmm) {
        CK(cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
        CK(cuMemCreate(&h, gran, &prop, 0));
        CK(cuMemAddressReserve(&v, gran, 0, 0, 0));
        CK(cuMemMap(v, gran, 0, h, 0));
        CUmemAccessDesc acc = {.location = prop.location, .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
        CK(cuMemSetAccess(v, gran, &acc, 1));
        if (vmm == 2) { /* released at once, as some programs do: the memory lives on in the mapping */
            CK(cuMemRelease(h));
            h = 0;
        }
    } else {
        CK(cuMemAlloc_v2(&v, gran)); /* the same bytes in plain device memory: what the shim can suspend */
    }

    size_t big = size > gran ? size : gran;
    uint32_t *host = malloc(big);
    uint64_t *hist = calloc((size_t)steps + 1, sizeof *hist);
    uint64_t *ballast = hostb ? malloc(hostb) : NULL;
    if (!host || !hist || (hostb && !ballast)) {
        fprintf(stderr, "train: out of memory\n");
        return 1;
    }
    for (size_t i = 0; i < big / 4; i++)
        host[i] = (uint32_t)(i * 2654435761u);
    for (size_t i = 0; i < hostb / 8; i++)
        ballast[i] = i * 0x9E3779B97F4A7C15ull;
    CK(cuMemcpyHtoD_v2(a, host, size));
    CK(cuMemcpyHtoD_v2(v, host, gran));

    uint64_t chain = 0x9E3779B97F4A7C15ull;
    for (long k = 1; k <= steps; k++) {
        uint64_t na = size / 4, nv = gran / 4;
        void *pa[] = {&a, &na}, *pv[] = {&v, &nv};
        CK(cuLaunchKernel(inc, 1, 1, 1, 1, 1, 1, 0, s, pa, NULL));
        CK(cuLaunchKernel(inc, 1, 1, 1, 1, 1, 1, 0, s, pv, NULL));
        if (vmm == 3) { /* a scratch granule, freed while the kernels run */
            CUdeviceptr t;
            CK(cuMemAllocAsync(&t, gran, s));
            CK(cuMemcpyDtoDAsync_v2(t, v, gran, s));
            CK(cuMemFreeAsync(t, s));
        }
        CK(cuStreamSynchronize(s));
        CK(cuMemcpyDtoH_v2(host, a, size));
        uint64_t sum = fnv(host, size, 0xcbf29ce484222325ull);
        CK(cuMemcpyDtoH_v2(host, v, gran));
        sum = fnv(host, gran, sum);
        for (long j = 0; j < churn; j++) { /* this step's temporaries: allocated, filled, read, freed */
            size_t n = (size_t)(1 + (k + j) % 4) << 14;
            if (n > size)
                n = size;
            CUdeviceptr t;
            CK(cuMemAlloc_v2(&t, n));
            CK(cuMemcpyDtoD_v2(t, a + ((size_t)(k * 8 + j * 4096) % (size - n + 8) & ~(size_t)7), n));
            CK(cuMemcpyDtoH_v2(host, t, n));
            sum = fnv(host, n, sum ^ (uint64_t)j);
            CK(cuMemFree_v2(t));
        }
        hist[k] = sum;
        if (hostb)
            ballast[((size_t)k % (hostb / 4096)) * 512] ^= sum;
        chain = (chain ^ sum ^ hist[k / 2]) * 0x100000001b3ull;
        printf("step %ld %016llx %016llx\n", k, (unsigned long long)sum, (unsigned long long)chain);
        fflush(stdout);
    }
    printf("done %016llx", (unsigned long long)fnv(hist, ((size_t)steps + 1) * 8, 0xcbf29ce484222325ull));
    if (hostb)
        printf(" %016llx", (unsigned long long)fnv(ballast, hostb, 0xcbf29ce484222325ull));
    printf("\n");
    fflush(stdout);
    if (vmm == 3) {
        CK(cuMemFreeAsync(v, s));
        CK(cuStreamSynchronize(s));
    } else if (vmm) {
        CK(cuMemUnmap(v, gran));
        CK(cuMemAddressFree(v, gran));
        if (h)
            CK(cuMemRelease(h));
    } else {
        CK(cuMemFree_v2(v));
    }
    CK(cuMemFree_v2(a));
    CK(cuStreamDestroy_v2(s));
    CK(cuDevicePrimaryCtxRelease_v2(dev));
    return 0;
}
