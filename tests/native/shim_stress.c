/* shim_stress: THREADS threads submit work and create/free state as fast as they can while a
 * controller pauses and resumes the shim's gate from outside.  Odd threads make every driver call
 * while holding one mutex of the program's (as Python threads hold the GIL), so a thread stopped at
 * the gate holds a lock the others queue on.
 *
 * Prints "ready" once the threads run, runs until a line arrives on stdin, then checks and prints
 * one JSON line: every thread's device counter must equal the launches it made (no call lost or
 * doubled), and the shim must have counted exactly the launches made.  Exit status 1 on a mismatch. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "cuda.h"

#define MAX_THREADS 64

static CUcontext ctx;
static CUfunction fn;
static atomic_int stop;
static pthread_mutex_t app_lock = PTHREAD_MUTEX_INITIALIZER;

struct worker {
    pthread_t t;
    int id;
    unsigned long launches, allocs, errors;
    int ok;
};

#define CK(call)                                                                                                 \
    do {                                                                                                         \
        CUresult r_ = (call);                                                                                    \
        if (r_) {                                                                                                \
            fprintf(stderr, "shim_stress: %s failed: %d\n", #call, (int)r_);                                     \
            w->errors++;                                                                                         \
        }                                                                                                        \
    } while (0)

static void *work(void *arg)
{
    struct worker *w = arg;
    CUstream s;
    CUdeviceptr buf;
    cuCtxSetCurrent(ctx);
    CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    CK(cuMemAlloc_v2(&buf, 4));
    CK(cuMemsetD32Async(buf, 0, 1, s)); /* on s: the null stream does not order a non-blocking one */
    unsigned long long n = 1;
    void *params[] = {&buf, &n};
    while (!atomic_load_explicit(&stop, memory_order_relaxed)) {
        if (w->id & 1)
            pthread_mutex_lock(&app_lock);
        CK(cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, s, params, NULL));
        w->launches++;
        if (w->launches % 16 == 0) {
            CUdeviceptr tmp;
            CUevent e;
            CK(cuMemAlloc_v2(&tmp, 256));
            CK(cuEventCreate(&e, CU_EVENT_DISABLE_TIMING));
            CK(cuEventRecord(e, s));
            CK(cuEventDestroy_v2(e));
            CK(cuMemFree_v2(tmp));
            w->allocs++;
        }
        if (w->id & 1)
            pthread_mutex_unlock(&app_lock);
    }
    uint32_t got = 0;
    CK(cuStreamSynchronize(s));
    CK(cuMemcpyDtoH_v2(&got, buf, 4));
    CK(cuMemFree_v2(buf));
    CK(cuStreamDestroy_v2(s));
    w->ok = got == (uint32_t)w->launches && !w->errors;
    if (!w->ok)
        fprintf(stderr, "shim_stress: thread %d: counter %u, launches %lu, errors %lu\n", w->id, got, w->launches,
                w->errors);
    return NULL;
}

int main(int argc, char **argv)
{
    int nt = argc > 1 ? atoi(argv[1]) : 8;
    if (nt < 1 || nt > MAX_THREADS)
        nt = 8;
    CUdevice dev;
    CUmodule mod;
    if (cuInit(0) || cuDeviceGet(&dev, 0) || cuDevicePrimaryCtxRetain(&ctx, dev) || cuCtxSetCurrent(ctx) ||
        cuModuleLoadData(&mod, "SIMCUDA-MODULE\nkernel inc inc_u32 0\n") || cuModuleGetFunction(&fn, mod, "inc")) {
        fprintf(stderr, "shim_stress: setup failed\n");
        return 2;
    }
    static struct worker ws[MAX_THREADS];
    for (int i = 0; i < nt; i++) {
        ws[i].id = i;
        pthread_create(&ws[i].t, NULL, work, &ws[i]);
    }
    printf("ready\n");
    fflush(stdout);
    char line[64];
    if (!fgets(line, sizeof line, stdin))
        line[0] = 0;
    atomic_store(&stop, 1);
    unsigned long launches = 0, allocs = 0;
    int ok = 1;
    for (int i = 0; i < nt; i++) {
        pthread_join(ws[i].t, NULL);
        launches += ws[i].launches;
        allocs += ws[i].allocs;
        ok &= ws[i].ok;
    }
    long long (*calls)(const char *) = NULL;
    *(void **)&calls = dlsym(RTLD_DEFAULT, "gputrace_shim_calls");
    long long shim_launches = calls ? calls("cuLaunchKernel") : -1;
    long long shim_allocs = calls ? calls("cuMemAlloc_v2") : -1;
    ok &= shim_launches == (long long)launches && shim_allocs == (long long)(allocs + nt);
    cuModuleUnload(mod);
    cuDevicePrimaryCtxRelease_v2(dev);
    printf("{\"threads\": %d, \"launches\": %lu, \"shim_launches\": %lld, \"allocs\": %lu, \"shim_allocs\": %lld, "
           "\"ok\": %s}\n", nt, launches, shim_launches, allocs + nt, shim_allocs, ok ? "true" : "false");
    return ok ? 0 : 1;
}
