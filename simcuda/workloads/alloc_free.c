/* alloc_free: allocates and frees device memory of every kind in a loop, moving data through it and
 * checking every byte that comes back; at the end of each step free memory must be back where it
 * started.
 *
 * Step i uses SIZE_i = --size * (1 + i % 4) bytes and VMM_i = granularity * (1 + i % 2) bytes:
 *   plain:  cuMemAlloc_v2, cuMemcpyHtoD_v2, cuMemcpyDtoH_v2 (check)
 *   pitch:  cuMemAllocPitch_v2, cuMemsetD32_v2, cuMemcpyDtoH_v2 (check), cuMemFree_v2
 *   async:  cuMemAllocAsync, cuMemcpyDtoDAsync_v2 (from plain), cuMemcpyDtoHAsync_v2,
 *           cuStreamSynchronize (check), cuMemFreeAsync; then cuMemFree_v2 (plain)
 *   VMM:    cuMemCreate, cuMemAddressReserve, cuMemMap, cuMemSetAccess, cuMemsetD8_v2,
 *           cuMemcpyHtoD_v2, cuMemcpyDtoH_v2 (check), cuMemUnmap, cuMemRelease, cuMemAddressFree
 *   host:   cuMemHostAlloc, cuMemFreeHost
 *   end:    cuStreamSynchronize, cuMemGetInfo_v2 (check)
 * Setup: cuInit, cuDeviceGet, cuDevicePrimaryCtxRetain, cuCtxSetCurrent, cuStreamCreate,
 * 2 cuMemAllocHost_v2, cuMemGetAllocationGranularity, cuMemGetInfo_v2.
 * Teardown: 2 cuMemFreeHost, cuStreamDestroy_v2, cuDevicePrimaryCtxRelease_v2.
 * --hold: in step 0, hold points 1 (plain + pitch live), 2 (plain + async live), 3 (VMM mapped); 4 after
 * teardown.
 * Options: --steps N (default 20) | --seconds S, --size BYTES (default 64 KiB, a multiple of 4),
 * --launch-ns NS, --kernel-ns NS (unused), --wait-stdin, --ready-fd FD, --dlopen, --ptsz,
 * --cuda-version V. */
#include "workload.h"

static long bad_bytes;

static void check(const uint8_t *got, const uint8_t *want, size_t n, int fill, const char *what)
{
    for (size_t i = 0; i < n; i++)
        if (got[i] != (want ? want[i] : (uint8_t)fill)) {
            if (!bad_bytes)
                fprintf(stderr, "alloc_free: %s: byte %zu differs\n", what, i);
            bad_bytes++;
        }
}

int main(int argc, char **argv)
{
    wl.workload = "alloc_free";
    wl.steps = 20;
    wl.size = 64 * 1024;
    wl_parse(argc, argv, WL_OPT_SIZE);
    if (wl.size <= 0 || wl.size % 4) {
        fprintf(stderr, "alloc_free: --size must be a positive multiple of 4\n");
        return 2;
    }

    double t0 = wl_start();
    CUdevice dev;
    CUcontext ctx;
    CUstream s;
    uint8_t *src, *dst;
    size_t gran, free0, free1, total;
    size_t maxsize = (size_t)wl.size * 4;
    CUmemAllocationProp prop = {.type = CU_MEM_ALLOCATION_TYPE_PINNED};
    CU(cuInit, 0);
    CU(cuDeviceGet, &dev, 0);
    CU(cuDevicePrimaryCtxRetain, &ctx, dev);
    CU(cuCtxSetCurrent, ctx);
    CU(cuStreamCreate, &s, CU_STREAM_DEFAULT);
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = dev;
    CU(cuMemGetAllocationGranularity, &gran, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
    if (maxsize < 2 * gran)
        maxsize = 2 * gran;
    CU(cuMemAllocHost_v2, (void **)&src, maxsize);
    CU(cuMemAllocHost_v2, (void **)&dst, maxsize);
    CU(cuMemGetInfo_v2, &free0, &total);

    CUmemAccessDesc access = {.location = prop.location, .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    char held[256];
    snprintf(held, sizeof held, "\"contexts\": [%llu], \"modules\": [], \"libraries\": [], \"streams\": [%llu], \"events\": []",
             (unsigned long long)(uintptr_t)ctx, (unsigned long long)(uintptr_t)s);
    long step;
    for (step = 0; wl_more(step, t0); step++) {
        size_t size = (size_t)wl.size * (1 + step % 4), vsize = gran * (1 + step % 2);
        for (size_t i = 0; i < maxsize; i++)
            src[i] = (uint8_t)(i * 7 + step * 13 + 1);

        CUdeviceptr d, p, a, va;
        size_t pitch, width = 1000 + step % 3 * 4, height = 4;
        CU(cuMemAlloc_v2, &d, size);
        CU(cuMemcpyHtoD_v2, d, src, size);
        CU(cuMemcpyDtoH_v2, dst, d, size);
        check(dst, src, size, 0, "cuMemAlloc_v2 round trip");

        CU(cuMemAllocPitch_v2, &p, &pitch, width, height, 4);
        uint32_t word = 0x01010101u * (uint32_t)(step % 200 + 1);
        CU(cuMemsetD32_v2, p, word, pitch * height / 4);
        CU(cuMemcpyDtoH_v2, dst, p, pitch * height);
        check(dst, NULL, pitch * height, (uint8_t)word, "cuMemAllocPitch_v2 memset");
        if (step == 0)
            wl_hold(1, held);
        CU(cuMemFree_v2, p);

        CU(cuMemAllocAsync, &a, size, s);
        CU(cuMemcpyDtoDAsync_v2, a, d, size, s);
        if (step == 0)
            wl_hold(2, held);
        memset(dst, 0, size);
        CU(cuMemcpyDtoHAsync_v2, dst, a, size, s);
        CU(cuStreamSynchronize, s);
        check(dst, src, size, 0, "cuMemAllocAsync copy");
        CU(cuMemFreeAsync, a, s);
        CU(cuMemFree_v2, d);

        CUmemGenericAllocationHandle h;
        size_t n = size < vsize ? size : vsize;
        CU(cuMemCreate, &h, vsize, &prop, 0);
        CU(cuMemAddressReserve, &va, vsize, 0, 0, 0);
        CU(cuMemMap, va, vsize, 0, h, 0);
        CU(cuMemSetAccess, va, vsize, &access, 1);
        if (step == 0)
            wl_hold(3, held);
        CU(cuMemsetD8_v2, va, (unsigned char)(step + 3), vsize);
        CU(cuMemcpyHtoD_v2, va, src, n);
        CU(cuMemcpyDtoH_v2, dst, va, vsize);
        check(dst, src, n, 0, "VMM copy");
        check(dst + n, NULL, vsize - n, (uint8_t)(step + 3), "VMM memset");
        CU(cuMemUnmap, va, vsize);
        CU(cuMemRelease, h);
        CU(cuMemAddressFree, va, vsize);

        void *hp;
        CU(cuMemHostAlloc, &hp, size, CU_MEMHOSTALLOC_PORTABLE);
        memcpy(hp, src, size);
        check(hp, src, size, 0, "cuMemHostAlloc");
        CU(cuMemFreeHost, hp);

        CU(cuStreamSynchronize, s);
        CU(cuMemGetInfo_v2, &free1, &total);
        if (free1 != free0) {
            fprintf(stderr, "alloc_free: step %ld leaked %zd bytes of device memory\n", step,
                    (ssize_t)(free0 - free1));
            bad_bytes++;
        }
    }

    CU(cuMemFreeHost, src);
    CU(cuMemFreeHost, dst);
    CU(cuStreamDestroy_v2, s);
    CU(cuDevicePrimaryCtxRelease_v2, dev);
    wl_hold(4, "\"contexts\": [], \"modules\": [], \"libraries\": [], \"streams\": [], \"events\": []");

    char extra[128];
    snprintf(extra, sizeof extra, "\"check\": \"%s\", \"size\": %lld, \"granularity\": %zu", bad_bytes ? "mismatch" : "ok",
             wl.size, gran);
    wl_report(step, t0, extra);
    return bad_bytes ? 1 : 0;
}
