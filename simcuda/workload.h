/* Shared by the C workloads in workloads/: options, the driver-call table that counts every call, and the JSON
 * report.
 *
 * Every driver call goes through CU(fn, args...), which counts it under the name of the symbol that
 * really ran.  Direct mode calls the linked symbols.  --dlopen reaches the driver the way PyTorch
 * does: dlopen("libcuda.so.1"), dlsym of cuGetProcAddress_v2 only, then one cuGetProcAddress_v2
 * per function used (on first use, each call counted), and the name reported is what dladdr says
 * the returned pointer is (so "cuLaunchKernel_ptsz" under --ptsz). */
#ifndef SIMCUDA_WORKLOAD_COMMON_H
#define SIMCUDA_WORKLOAD_COMMON_H

#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cuda.h"
#include "simcuda.h"

/* X(symbol called in direct mode, base name asked of cuGetProcAddress) */
#define WL_API(X)                                                                           \
    X(cuInit, cuInit)                                                                       \
    X(cuDeviceGet, cuDeviceGet)                                                             \
    X(cuDeviceGetAttribute, cuDeviceGetAttribute)                                           \
    X(cuDevicePrimaryCtxRetain, cuDevicePrimaryCtxRetain)                                   \
    X(cuDevicePrimaryCtxRelease_v2, cuDevicePrimaryCtxRelease)                              \
    X(cuDevicePrimaryCtxGetState, cuDevicePrimaryCtxGetState)                               \
    X(cuCtxSetCurrent, cuCtxSetCurrent)                                                     \
    X(cuCtxGetCurrent, cuCtxGetCurrent)                                                     \
    X(cuCtxGetDevice_v2, cuCtxGetDevice)                                                    \
    X(cuModuleLoadData, cuModuleLoadData)                                                   \
    X(cuModuleGetFunction, cuModuleGetFunction)                                             \
    X(cuModuleUnload, cuModuleUnload)                                                       \
    X(cuLibraryLoadData, cuLibraryLoadData)                                                 \
    X(cuLibraryGetKernel, cuLibraryGetKernel)                                               \
    X(cuLibraryUnload, cuLibraryUnload)                                                     \
    X(cuKernelGetFunction, cuKernelGetFunction)                                             \
    X(cuOccupancyMaxActiveBlocksPerMultiprocessor, cuOccupancyMaxActiveBlocksPerMultiprocessor) \
    X(cuLaunchKernel, cuLaunchKernel)                                                       \
    X(cuLaunchKernelEx, cuLaunchKernelEx)                                                   \
    X(cuCtxPushCurrent_v2, cuCtxPushCurrent)                                                \
    X(cuCtxPopCurrent_v2, cuCtxPopCurrent)                                                  \
    X(cuStreamCreate, cuStreamCreate)                                                       \
    X(cuStreamDestroy_v2, cuStreamDestroy)                                                  \
    X(cuStreamSynchronize, cuStreamSynchronize)                                             \
    X(cuStreamIsCapturing, cuStreamIsCapturing)                                             \
    X(cuEventCreate, cuEventCreate)                                                         \
    X(cuEventDestroy_v2, cuEventDestroy)                                                    \
    X(cuEventRecord, cuEventRecord)                                                         \
    X(cuEventElapsedTime_v2, cuEventElapsedTime)                                            \
    X(cuMemAlloc_v2, cuMemAlloc)                                                            \
    X(cuMemFree_v2, cuMemFree)                                                              \
    X(cuMemAllocPitch_v2, cuMemAllocPitch)                                                  \
    X(cuMemAllocHost_v2, cuMemAllocHost)                                                    \
    X(cuMemHostAlloc, cuMemHostAlloc)                                                       \
    X(cuMemFreeHost, cuMemFreeHost)                                                         \
    X(cuMemAllocAsync, cuMemAllocAsync)                                                     \
    X(cuMemFreeAsync, cuMemFreeAsync)                                                       \
    X(cuMemAllocFromPoolAsync, cuMemAllocFromPoolAsync)                                     \
    X(cuMemPoolCreate, cuMemPoolCreate)                                                     \
    X(cuMemPoolDestroy, cuMemPoolDestroy)                                                   \
    X(cuArrayCreate_v2, cuArrayCreate)                                                      \
    X(cuArrayDestroy, cuArrayDestroy)                                                       \
    X(cuMemGetInfo_v2, cuMemGetInfo)                                                        \
    X(cuMemcpyHtoD_v2, cuMemcpyHtoD)                                                        \
    X(cuMemcpyDtoH_v2, cuMemcpyDtoH)                                                        \
    X(cuMemcpyDtoDAsync_v2, cuMemcpyDtoDAsync)                                              \
    X(cuMemcpyDtoHAsync_v2, cuMemcpyDtoHAsync)                                              \
    X(cuMemsetD8_v2, cuMemsetD8)                                                            \
    X(cuMemsetD32_v2, cuMemsetD32)                                                          \
    X(cuMemAddressReserve, cuMemAddressReserve)                                             \
    X(cuMemAddressFree, cuMemAddressFree)                                                   \
    X(cuMemCreate, cuMemCreate)                                                             \
    X(cuMemRelease, cuMemRelease)                                                           \
    X(cuMemRetainAllocationHandle, cuMemRetainAllocationHandle)                             \
    X(cuMemGetAllocationPropertiesFromHandle, cuMemGetAllocationPropertiesFromHandle)       \
    X(cuMemMap, cuMemMap)                                                                   \
    X(cuMemUnmap, cuMemUnmap)                                                               \
    X(cuMemSetAccess, cuMemSetAccess)                                                       \
    X(cuMemGetAllocationGranularity, cuMemGetAllocationGranularity)

enum {
#define WL_ENUM(sym, base) API_##sym,
    WL_API(WL_ENUM)
#undef WL_ENUM
    API_COUNT
};

static const char *const wl_base[API_COUNT] = {
#define WL_BASE(sym, base) #base,
    WL_API(WL_BASE)
#undef WL_BASE
};

static const char *wl_name[API_COUNT];
static void *wl_ptr[API_COUNT];
static unsigned long wl_count[API_COUNT];

static struct wl_opts {
    const char *workload;
    long steps;
    double seconds;
    long long kernel_ns;
    long long launch_ns;         /* -1: not given */
    long long default_launch_ns; /* used when neither --launch-ns nor $SIMCUDA_LAUNCH_NS is set */
    int wait_stdin;
    int hold;
    int ready_fd;
    int dlopen_mode;
    int ptsz;
    int cuda_version;
    double scale;      /* launch_bound */
    long kernels;      /* gpu_bound */
    long long size;    /* alloc_free */
} wl = {.launch_ns = -1, .ready_fd = -1, .cuda_version = CUDA_VERSION, .scale = 1.0};

static CUresult (*wl_getproc)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);
static unsigned long wl_getproc_count;

static double wl_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

__attribute__((format(printf, 1, 2), noreturn)) static void wl_die(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "%s: ", wl.workload);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    exit(1);
}

static void wl_resolve(int i)
{
    void *p = NULL;
    CUdriverProcAddressQueryResult st = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    wl_getproc_count++;
    CUresult r = wl_getproc(wl_base[i], &p, wl.cuda_version,
                            wl.ptsz ? CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM : CU_GET_PROC_ADDRESS_DEFAULT, &st);
    if (r || !p)
        wl_die("cuGetProcAddress_v2(%s) failed: CUresult %d, status %d", wl_base[i], (int)r, (int)st);
    Dl_info info;
    if (!dladdr(p, &info) || !info.dli_sname || info.dli_saddr != p)
        wl_die("dladdr names no exported symbol at the address of %s", wl_base[i]);
    wl_ptr[i] = p;
    wl_name[i] = info.dli_sname;
}

static inline int wl_use(int i)
{
    if (!wl_ptr[i])
        wl_resolve(i);
    wl_count[i]++;
    return i;
}

static inline void wl_check(CUresult r, int i, long line)
{
    if (r != CUDA_SUCCESS)
        wl_die("%s failed at line %ld: CUresult %d", wl_name[i], line, (int)r);
}

/* CU(cuLaunchKernel, f, ...): count, call through the table, exit on error. */
#define CU(fn, ...) wl_check(((__typeof__(&fn))wl_ptr[wl_use(API_##fn)])(__VA_ARGS__), API_##fn, __LINE__)

enum { WL_OPT_SCALE = 1, WL_OPT_KERNELS = 2, WL_OPT_SIZE = 4 };

static void wl_usage(int extra, int rc)
{
    fprintf(rc ? stderr : stdout,
            "usage: %s [--steps N | --seconds S] [--kernel-ns NS] [--launch-ns NS] [--wait-stdin]\n"
            "          [--ready-fd FD] [--dlopen] [--ptsz] [--cuda-version V] [--hold]%s%s%s\n",
            wl.workload, extra & WL_OPT_SCALE ? " [--scale F]" : "", extra & WL_OPT_KERNELS ? " [--kernels K]" : "",
            extra & WL_OPT_SIZE ? " [--size BYTES]" : "");
    exit(rc);
}

static double wl_num(const char *opt, const char *v, int extra)
{
    char *end;
    errno = 0;
    double x = v ? strtod(v, &end) : 0;
    if (!v || errno || *end || x < 0) {
        fprintf(stderr, "%s: %s needs a non-negative number\n", wl.workload, opt);
        wl_usage(extra, 2);
    }
    return x;
}

static void wl_parse(int argc, char **argv, int extra)
{
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
#define NUM() wl_num(a, v, extra), i++
        if (!strcmp(a, "--steps"))
            wl.steps = (long)NUM();
        else if (!strcmp(a, "--seconds"))
            wl.seconds = NUM();
        else if (!strcmp(a, "--kernel-ns"))
            wl.kernel_ns = (long long)NUM();
        else if (!strcmp(a, "--launch-ns"))
            wl.launch_ns = (long long)NUM();
        else if (!strcmp(a, "--ready-fd"))
            wl.ready_fd = (int)NUM();
        else if (!strcmp(a, "--cuda-version"))
            wl.cuda_version = (int)NUM();
        else if (!strcmp(a, "--scale") && (extra & WL_OPT_SCALE))
            wl.scale = NUM();
        else if (!strcmp(a, "--kernels") && (extra & WL_OPT_KERNELS))
            wl.kernels = (long)NUM();
        else if (!strcmp(a, "--size") && (extra & WL_OPT_SIZE))
            wl.size = (long long)NUM();
        else if (!strcmp(a, "--wait-stdin"))
            wl.wait_stdin = 1;
        else if (!strcmp(a, "--hold"))
            wl.hold = 1;
        else if (!strcmp(a, "--dlopen"))
            wl.dlopen_mode = 1;
        else if (!strcmp(a, "--ptsz"))
            wl.dlopen_mode = wl.ptsz = 1;
        else if (!strcmp(a, "-h") || !strcmp(a, "--help"))
            wl_usage(extra, 0);
        else {
            fprintf(stderr, "%s: unknown option %s\n", wl.workload, a);
            wl_usage(extra, 2);
        }
#undef NUM
    }
}

/* Binds the driver, says "ready", waits for stdin if asked: everything before the first driver
 * call.  Returns the start time. */
static double wl_start(void)
{
    const char *env = getenv("SIMCUDA_LAUNCH_NS");
    long long launch_ns = wl.launch_ns >= 0 ? wl.launch_ns : (env && *env) ? -1 : wl.default_launch_ns;
    if (launch_ns >= 0) {
        char buf[32];
        snprintf(buf, sizeof buf, "%lld", launch_ns);
        setenv("SIMCUDA_LAUNCH_NS", buf, 1);
    }
    if (wl.dlopen_mode) {
        void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
        if (!h)
            wl_die("dlopen: %s", dlerror());
        *(void **)&wl_getproc = dlsym(h, "cuGetProcAddress_v2");
        if (!wl_getproc)
            wl_die("no cuGetProcAddress_v2 in libcuda.so.1");
    } else {
#define WL_BIND(sym, base) wl_ptr[API_##sym] = (void *)&sym, wl_name[API_##sym] = #sym;
        WL_API(WL_BIND)
#undef WL_BIND
    }
    if (wl.ready_fd >= 0) {
        if (write(wl.ready_fd, "ready\n", 6) != 6)
            wl_die("writing to --ready-fd: %s", strerror(errno));
        close(wl.ready_fd);
    }
    if (wl.wait_stdin) {
        char line[256];
        if (!fgets(line, sizeof line, stdin) && ferror(stdin))
            wl_die("reading stdin: %s", strerror(errno));
    }
    return wl_now();
}

/* --hold: at hold point n, print what the process holds as one JSON line on stdout,
 * {"hold": n, "allocations": [simcudaListAllocations records], <extra_json>}, and wait for a line on
 * stdin.  Lets a test compare a process's own view of its GPU state with what an observer reports.
 * The driver's list is looked up by name, as a program that only dlopens the driver would. */
static void wl_hold(int n, const char *extra_json)
{
    if (!wl.hold)
        return;
    void *h = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
    int (*list)(simcudaAllocation *, int) = NULL;
    if (h)
        *(void **)&list = dlsym(h, "simcudaListAllocations");
    if (!list)
        wl_die("--hold needs simcuda's simcudaListAllocations");
    int count = list(NULL, 0);
    simcudaAllocation *a = calloc(count > 0 ? (size_t)count : 1, sizeof *a);
    if (!a)
        wl_die("out of memory");
    count = list(a, count);
    printf("{\"hold\": %d, \"allocations\": [", n);
    for (int i = 0; i < count; i++)
        printf("%s{\"kind\": %d, \"base\": %llu, \"size\": %llu, \"handle\": %llu, \"offset\": %llu, \"access\": %d}",
               i ? ", " : "", a[i].kind, a[i].base, a[i].size, (unsigned long long)a[i].handle, a[i].offset,
               a[i].access);
    printf("]%s%s}\n", extra_json && *extra_json ? ", " : "", extra_json ? extra_json : "");
    fflush(stdout);
    free(a);
    char line[256];
    if (!fgets(line, sizeof line, stdin) && ferror(stdin))
        wl_die("reading stdin: %s", strerror(errno));
}

static int wl_more(long step, double t0)
{
    if (wl.seconds > 0)
        return step == 0 || wl_now() - t0 < wl.seconds;
    return step < wl.steps;
}

static void wl_json_str(const char *s)
{
    putchar('"');
    for (; *s; s++)
        if (*s == '"' || *s == '\\')
            printf("\\%c", *s);
        else
            putchar(*s);
    putchar('"');
}

/* One JSON line on stdout: {"workload", "mode", "ptsz", "steps", "elapsed_s", "calls", <extra>}. */
static void wl_report(long steps, double t0, const char *extra_json)
{
    double elapsed = wl_now() - t0;
    printf("{\"workload\": ");
    wl_json_str(wl.workload);
    printf(", \"mode\": \"%s\", \"ptsz\": %s, \"cuda_version\": %d, \"steps\": %ld, \"elapsed_s\": %.6f, \"calls\": {",
           wl.dlopen_mode ? "dlopen" : "direct", wl.ptsz ? "true" : "false", wl.cuda_version, steps, elapsed);
    int first = 1;
    if (wl_getproc_count) {
        printf("\"cuGetProcAddress_v2\": %lu", wl_getproc_count);
        first = 0;
    }
    for (int i = 0; i < API_COUNT; i++) {
        if (!wl_count[i])
            continue;
        int dup = 0; /* two table entries resolved to one symbol: report it once, summed */
        for (int j = 0; j < i; j++)
            dup |= wl_count[j] && !strcmp(wl_name[j], wl_name[i]);
        if (dup)
            continue;
        unsigned long n = 0;
        for (int j = i; j < API_COUNT; j++)
            if (wl_count[j] && !strcmp(wl_name[j], wl_name[i]))
                n += wl_count[j];
        printf("%s", first ? "" : ", ");
        wl_json_str(wl_name[i]);
        printf(": %lu", n);
        first = 0;
    }
    printf("}%s%s}\n", extra_json && *extra_json ? ", " : "", extra_json ? extra_json : "");
    fflush(stdout);
}

#endif
