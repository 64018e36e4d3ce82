/* launch_bound: the driver-call mix of one step of a small PyTorch training loop (4 x Linear(256),
 * Adam, batch 64, measured on an H200): many cheap getters, 35 short kernel launches, one
 * device-to-device copy and one synchronization (loss.item()) per step.
 *
 * Per step, with --scale F every count below becomes floor(count * F + 0.5) (the synchronization
 * stays 1); calls are interleaved evenly between the launches:
 *   cuCtxGetDevice_v2 324, cuDevicePrimaryCtxGetState 89, cuLaunchKernel 21, cuCtxGetCurrent 19,
 *   cuLaunchKernelEx 14, cuOccupancyMaxActiveBlocksPerMultiprocessor 4, cuKernelGetFunction 4,
 *   cuDeviceGetAttribute 4, cuMemcpyDtoDAsync_v2 1, cuStreamIsCapturing 1; cuStreamSynchronize 1.
 * Setup: cuInit, cuDeviceGet, cuDevicePrimaryCtxRetain, cuCtxSetCurrent, cuModuleLoadData,
 * cuModuleGetFunction, cuLibraryLoadData, cuLibraryGetKernel, 2 cuMemAlloc_v2, cuMemsetD32_v2.
 * Teardown: cuMemcpyDtoH_v2, 2 cuMemFree_v2, cuLibraryUnload, cuModuleUnload,
 * cuDevicePrimaryCtxRelease_v2.  Every launch increments a device buffer, checked at the end.
 * --hold: hold point 1 after setup (context, module, library, two allocations), 2 after teardown.
 * Options: --steps N (default 100) | --seconds S, --kernel-ns NS (default 5000), --launch-ns NS (CPU
 * cost of each launch; default $SIMCUDA_LAUNCH_NS, else 6000, which makes a step CPU-bound), --scale F, --wait-stdin, --ready-fd FD, --dlopen, --ptsz, --cuda-version V.
 * --warmup-stdin: after setup, a start-up phase of other calls than the loop's (cuMemGetInfo_v2, about
 * one a millisecond, as a job that loads and sets up before it trains) until a line comes on stdin;
 * --seconds and the reported elapsed_s count from its end, and its calls are in the counts. */
#include "workload.h"

#include <poll.h>

#define N_ELEMS 256

enum { M_GETDEV, M_STATE, M_LAUNCH, M_CURRENT, M_LAUNCHEX, M_OCC, M_KGETF, M_ATTR, M_DTOD, M_CAPT, M_N };

static const struct {
    int api;
    int base;
} mix[M_N] = {
    [M_GETDEV] = {API_cuCtxGetDevice_v2, 324},
    [M_STATE] = {API_cuDevicePrimaryCtxGetState, 89},
    [M_LAUNCH] = {API_cuLaunchKernel, 21},
    [M_CURRENT] = {API_cuCtxGetCurrent, 19},
    [M_LAUNCHEX] = {API_cuLaunchKernelEx, 14},
    [M_OCC] = {API_cuOccupancyMaxActiveBlocksPerMultiprocessor, 4},
    [M_KGETF] = {API_cuKernelGetFunction, 4},
    [M_ATTR] = {API_cuDeviceGetAttribute, 4},
    [M_DTOD] = {API_cuMemcpyDtoDAsync_v2, 1},
    [M_CAPT] = {API_cuStreamIsCapturing, 1},
};

/* How many of `total` calls fall in slot j of `slots`: spread evenly, summing to total. */
static long share(long total, long j, long slots)
{
    return (j + 1) * total / slots - j * total / slots;
}

int main(int argc, char **argv)
{
    wl.workload = "launch_bound";
    wl.steps = 100;
    wl.kernel_ns = 5000;
    wl.default_launch_ns = 6000;
    int warmup = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--warmup-stdin")) {
            warmup = 1;
            memmove(argv + i, argv + i + 1, (size_t)(argc - i) * sizeof *argv);
            argc--;
            break;
        }
    }
    wl_parse(argc, argv, WL_OPT_SCALE);

    long per[M_N];
    for (int k = 0; k < M_N; k++)
        per[k] = (long)floor(mix[k].base * wl.scale + 0.5);
    long launches = per[M_LAUNCH] + per[M_LAUNCHEX];
    long slots = launches > 0 ? launches : 1;

    char image[256];
    snprintf(image, sizeof image, "SIMCUDA-MODULE\nkernel inc inc_u32 %lld\n", wl.kernel_ns);

    double t0 = wl_start();
    CUdevice dev;
    CUcontext ctx;
    CUmodule mod;
    CUfunction fn, f2;
    CUlibrary lib;
    CUkernel kern;
    CUdeviceptr buf, buf2;
    CU(cuInit, 0);
    CU(cuDeviceGet, &dev, 0);
    CU(cuDevicePrimaryCtxRetain, &ctx, dev);
    CU(cuCtxSetCurrent, ctx);
    CU(cuModuleLoadData, &mod, image);
    CU(cuModuleGetFunction, &fn, mod, "inc");
    CU(cuLibraryLoadData, &lib, image, NULL, NULL, 0, NULL, NULL, 0);
    CU(cuLibraryGetKernel, &kern, lib, "inc");
    CU(cuMemAlloc_v2, &buf, N_ELEMS * 4);
    CU(cuMemAlloc_v2, &buf2, N_ELEMS * 4);
    CU(cuMemsetD32_v2, buf, 0, N_ELEMS);
    char held[256];
    snprintf(held, sizeof held, "\"contexts\": [%llu], \"modules\": [%llu], \"libraries\": [%llu], \"streams\": [], \"events\": []",
             (unsigned long long)(uintptr_t)ctx, (unsigned long long)(uintptr_t)mod, (unsigned long long)(uintptr_t)lib);
    wl_hold(1, held);
    if (warmup) {
        struct pollfd in = {.fd = 0, .events = POLLIN};
        for (;;) {
            size_t free_b, total_b;
            CU(cuMemGetInfo_v2, &free_b, &total_b);
            int r = poll(&in, 1, 1);
            if (r < 0 && errno != EINTR)
                wl_die("poll on stdin: %s", strerror(errno));
            if (r > 0) {
                char line[64];
                if (!fgets(line, sizeof line, stdin))
                    wl_die("--warmup-stdin: stdin closed before a line came");
                break;
            }
        }
        t0 = wl_now();
    }

    CUstream stream = NULL; /* the default stream, like PyTorch's */
    unsigned long long n = N_ELEMS;
    void *params[] = {&buf, &n};
    CUlaunchConfig lc = {1, 1, 1, 256, 1, 1, 0, stream, NULL, 0};
    long step;
    for (step = 0; wl_more(step, t0); step++) {
        for (long j = 0; j < slots; j++) {
            CUdevice d;
            CUcontext c;
            unsigned flags;
            int active, v;
            CUstreamCaptureStatus cs;
            for (long i = share(per[M_GETDEV], j, slots); i > 0; i--)
                CU(cuCtxGetDevice_v2, &d, NULL);
            for (long i = share(per[M_STATE], j, slots); i > 0; i--)
                CU(cuDevicePrimaryCtxGetState, dev, &flags, &active);
            for (long i = share(per[M_CURRENT], j, slots); i > 0; i--)
                CU(cuCtxGetCurrent, &c);
            for (long i = share(per[M_ATTR], j, slots); i > 0; i--)
                CU(cuDeviceGetAttribute, &v, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev);
            for (long i = share(per[M_KGETF], j, slots); i > 0; i--)
                CU(cuKernelGetFunction, &f2, kern);
            for (long i = share(per[M_OCC], j, slots); i > 0; i--)
                CU(cuOccupancyMaxActiveBlocksPerMultiprocessor, &v, fn, 256, 0);
            for (long i = share(per[M_CAPT], j, slots); i > 0; i--)
                CU(cuStreamIsCapturing, stream, &cs);
            for (long i = share(per[M_LAUNCH], j, slots); i > 0; i--)
                CU(cuLaunchKernel, fn, 1, 1, 1, 256, 1, 1, 0, stream, params, NULL);
            for (long i = share(per[M_LAUNCHEX], j, slots); i > 0; i--)
                CU(cuLaunchKernelEx, &lc, fn, params, NULL);
            for (long i = share(per[M_DTOD], j, slots); i > 0; i--)
                CU(cuMemcpyDtoDAsync_v2, buf2, buf, N_ELEMS * 4, stream);
        }
        CU(cuStreamSynchronize, stream);
    }

    uint32_t host[N_ELEMS];
    CU(cuMemcpyDtoH_v2, host, buf, sizeof host);
    int ok = 1;
    for (int i = 0; i < N_ELEMS; i++)
        ok &= host[i] == (uint32_t)(step * launches);
    CU(cuMemFree_v2, buf);
    CU(cuMemFree_v2, buf2);
    CU(cuLibraryUnload, lib);
    CU(cuModuleUnload, mod);
    CU(cuDevicePrimaryCtxRelease_v2, dev);
    wl_hold(2, "\"contexts\": [], \"modules\": [], \"libraries\": [], \"streams\": [], \"events\": []");

    char extra[1024];
    int len = snprintf(extra, sizeof extra, "\"check\": \"%s\", \"per_step\": {", ok ? "ok" : "mismatch");
    for (int k = 0; k < M_N; k++)
        len += snprintf(extra + len, sizeof extra - len, "%s\"%s\": %ld", k ? ", " : "", wl_name[mix[k].api]
                        ? wl_name[mix[k].api] : wl_base[mix[k].api], per[k]);
    snprintf(extra + len, sizeof extra - len, ", \"%s\": 1}", wl_name[API_cuStreamSynchronize]);
    wl_report(step, t0, extra);
    if (!ok)
        fprintf(stderr, "launch_bound: device buffer is %u, expected %ld\n", host[0], step * launches);
    return ok ? 0 : 1;
}
