/* shim_bench: what the gputrace shim adds to one intercepted driver call, measured in one process.
 *
 * Run with the shim preloaded.  For each case, the same call is timed through two pointers: the
 * driver's own entry point (gputrace_shim_real) and the shim's wrapper (what dlsym on libcuda now
 * returns).  Blocks of --calls calls alternate between the two, the order flipping every round, so
 * frequency changes and interrupts hit both alike; the added cost is the per-round difference.
 *
 * Cases (all on the current context of device 0):
 *   launch_invalid  cuLaunchKernel with a zero grid: the driver rejects it at once, so the call is
 *                   cheap and the shim's share stands out (gated path: slot, fence, gate, count)
 *   launch          a real launch of an empty kernel on a stream (synchronized after each block)
 *   event_record    cuEventRecord on that stream
 *   free_invalid    cuMemFree_v2 of an address that is no allocation: a state call's path, with the
 *                   registry lookup (shard lock, hash) that every free makes
 *   not_wrapped     cuCtxGetCurrent: a query the shim passes straight through (wrapped only so the
 *                   emulated layer can add to it): a load and a jump, the floor (named before it was wrapped)
 *   alloc_free_async  cuMemAllocAsync of 1 MiB and its cuMemFreeAsync on the stream, a pair per call:
 *                   the driver's pool against the shim's path (with GPUTRACE_SHIM_VMM=1, served through
 *                   the VMM API: what a --suspendable job pays for each stream-ordered allocation)
 * Prints one JSON object: per case, the per-round ns/call of each pointer and their difference.
 * Usage: shim_bench [--rounds R] [--calls N] [--image FILE] [--only CASE]  (FILE: a PTX or cubin with an
 * entry named "noop" taking no parameters; default: simcuda's text image). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int CUresult;
typedef void *CUcontext, *CUmodule, *CUfunction, *CUstream, *CUevent;

static CUresult (*cuInit)(unsigned);
static CUresult (*cuDeviceGet)(int *, int);
static CUresult (*cuDevicePrimaryCtxRetain)(CUcontext *, int);
static CUresult (*cuCtxSetCurrent)(CUcontext);
static CUresult (*cuModuleLoadData)(CUmodule *, const void *);
static CUresult (*cuModuleGetFunction)(CUfunction *, CUmodule, const char *);
static CUresult (*cuStreamCreate)(CUstream *, unsigned);
static CUresult (*cuStreamSynchronize)(CUstream);
static CUresult (*cuEventCreate)(CUevent *, unsigned);

typedef CUresult (*launch_t)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,
                             void **, void **);
typedef CUresult (*record_t)(CUevent, CUstream);
typedef CUresult (*getctx_t)(CUcontext *);
typedef CUresult (*free_t)(unsigned long long);
typedef CUresult (*alloc_async_t)(unsigned long long *, size_t, CUstream);
typedef CUresult (*free_async_t)(unsigned long long, CUstream);

static CUfunction fn;
static CUstream stream;
static CUevent event;

static uint64_t now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

enum { C_LAUNCH_INVALID, C_LAUNCH, C_RECORD, C_FREE_INVALID, C_NOT_WRAPPED, C_ALLOC_ASYNC, NCASES };
static const char *const case_name[NCASES] = {"launch_invalid", "launch", "event_record", "free_invalid",
                                              "not_wrapped", "alloc_free_async"};
static const char *const case_fn[NCASES] = {"cuLaunchKernel", "cuLaunchKernel", "cuEventRecord", "cuMemFree_v2",
                                            "cuCtxGetCurrent", "cuMemAllocAsync"};
/* The alloc_free_async case's free, through the same kind of pointer as its allocation. */
static void *free_async_w, *free_async_r, *free_async_now;

static double block(int c, void *p, long n)
{
    uint64_t t0 = now();
    switch (c) {
    case C_LAUNCH_INVALID:
        for (long i = 0; i < n; i++)
            ((launch_t)p)(fn, 0, 1, 1, 1, 1, 1, 0, stream, NULL, NULL);
        break;
    case C_LAUNCH:
        for (long i = 0; i < n; i++)
            ((launch_t)p)(fn, 1, 1, 1, 1, 1, 1, 0, stream, NULL, NULL);
        break;
    case C_RECORD:
        for (long i = 0; i < n; i++)
            ((record_t)p)(event, stream);
        break;
    case C_FREE_INVALID:
        for (long i = 0; i < n; i++)
            ((free_t)p)(0x10 + (unsigned long long)i * 16); /* never a device allocation */
        break;
    case C_ALLOC_ASYNC:
        for (long i = 0; i < n; i++) {
            unsigned long long d = 0;
            if (((alloc_async_t)p)(&d, 1 << 20, stream) == 0)
                ((free_async_t)free_async_now)(d, stream);
        }
        break;
    case C_NOT_WRAPPED: {
        CUcontext ctx;
        for (long i = 0; i < n; i++)
            ((getctx_t)p)(&ctx);
        break;
    }
    }
    uint64_t t1 = now();
    if (c == C_LAUNCH || c == C_RECORD || c == C_ALLOC_ASYNC)
        cuStreamSynchronize(stream); /* untimed: keep the queue from growing */
    return (double)(t1 - t0) / (double)n;
}

static int cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double pct(double *v, int n, double q)
{
    qsort(v, (size_t)n, sizeof *v, cmp);
    return v[(int)(q * (n - 1) + 0.5)];
}

static void *must(void *h, const char *name)
{
    void *p = dlsym(h, name);
    if (!p) {
        fprintf(stderr, "shim_bench: %s not found\n", name);
        exit(2);
    }
    return p;
}

int main(int argc, char **argv)
{
    int rounds = 200;
    long calls = 20000;
    const char *image_file = NULL, *only = NULL;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--rounds"))
            rounds = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--calls"))
            calls = atol(argv[i + 1]);
        else if (!strcmp(argv[i], "--image"))
            image_file = argv[i + 1];
        else if (!strcmp(argv[i], "--only"))
            only = argv[i + 1];
    }
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        fprintf(stderr, "shim_bench: %s\n", dlerror());
        return 2;
    }
    void *(*real)(const char *) = (void *(*)(const char *))dlsym(RTLD_DEFAULT, "gputrace_shim_real");
    if (!real) {
        fprintf(stderr, "shim_bench: run it with the gputrace shim preloaded\n");
        return 2;
    }
    *(void **)&cuInit = must(h, "cuInit");
    *(void **)&cuDeviceGet = must(h, "cuDeviceGet");
    *(void **)&cuDevicePrimaryCtxRetain = must(h, "cuDevicePrimaryCtxRetain");
    *(void **)&cuCtxSetCurrent = must(h, "cuCtxSetCurrent");
    *(void **)&cuModuleLoadData = must(h, "cuModuleLoadData");
    *(void **)&cuModuleGetFunction = must(h, "cuModuleGetFunction");
    *(void **)&cuStreamCreate = must(h, "cuStreamCreate");
    *(void **)&cuStreamSynchronize = must(h, "cuStreamSynchronize");
    *(void **)&cuEventCreate = must(h, "cuEventCreate");

    char *image = "SIMCUDA-MODULE\nkernel noop spin 0\n";
    if (image_file) {
        FILE *f = fopen(image_file, "rb");
        if (!f) {
            perror(image_file);
            return 2;
        }
        fseek(f, 0, SEEK_END);
        long n = ftell(f);
        fseek(f, 0, SEEK_SET);
        image = calloc(1, (size_t)n + 1);
        if (fread(image, 1, (size_t)n, f) != (size_t)n)
            return 2;
        fclose(f);
    }
    int dev;
    CUcontext ctx;
    CUmodule mod;
    if (cuInit(0) || cuDeviceGet(&dev, 0) || cuDevicePrimaryCtxRetain(&ctx, dev) || cuCtxSetCurrent(ctx) ||
        cuModuleLoadData(&mod, image) || cuModuleGetFunction(&fn, mod, "noop") || cuStreamCreate(&stream, 1) ||
        cuEventCreate(&event, 2 /* CU_EVENT_DISABLE_TIMING */)) {
        fprintf(stderr, "shim_bench: setup failed\n");
        return 2;
    }

    free_async_w = must(h, "cuMemFreeAsync");
    free_async_r = real("cuMemFreeAsync");
    printf("{\"rounds\": %d, \"calls_per_block\": %ld, \"cases\": {", rounds, calls);
    int first = 1;
    for (int c = 0; c < NCASES; c++) {
        if (only && strcmp(only, case_name[c]))
            continue;
        void *w = must(h, case_fn[c]), *r = real(case_fn[c]);
        if (!r) /* not wrapped: the driver's pointer both ways */
            r = w;
        long n = c == C_LAUNCH || c == C_RECORD ? calls / 10 : c == C_ALLOC_ASYNC ? calls / 100 : calls;
        if (n < 1)
            n = 1;
        void *fw = free_async_w, *fr = free_async_r ? free_async_r : free_async_w;
#define BLOCK(ptr) (free_async_now = (ptr) == w ? fw : fr, block(c, (ptr), n))
        double *dr = calloc((size_t)rounds, sizeof(double)), *dw = calloc((size_t)rounds, sizeof(double)),
               *dd = calloc((size_t)rounds, sizeof(double));
        BLOCK(r); /* warm both */
        BLOCK(w);
        for (int k = 0; k < rounds; k++) {
            if (k & 1) {
                dw[k] = BLOCK(w);
                dr[k] = BLOCK(r);
            } else {
                dr[k] = BLOCK(r);
                dw[k] = BLOCK(w);
            }
            dd[k] = dw[k] - dr[k];
        }
        printf("%s\"%s\": {\"function\": \"%s\", \"wrapped\": %s, \"calls_per_block\": %ld, "
               "\"driver_ns\": %.2f, \"shim_ns\": %.2f, \"added_ns_median\": %.2f, \"added_ns_p10\": %.2f, "
               "\"added_ns_p90\": %.2f}",
               first ? "" : ", ", case_name[c], case_fn[c], r != w ? "true" : "false", n, pct(dr, rounds, 0.5),
               pct(dw, rounds, 0.5), pct(dd, rounds, 0.5), pct(dd, rounds, 0.1), pct(dd, rounds, 0.9));
        free(dr), free(dw), free(dd);
        first = 0;
#undef BLOCK
    }
    printf("}}\n");
    return 0;
}
