/* pattern: holds device memory of every kind the checkpointer saves, filled with a known pattern, and
 * lets a test overwrite it and read back a checksum on command: the target for checkpoint/restore
 * tests (is device memory back, byte for byte, to what was saved?).
 *
 * Allocations (S = --size, default 1 MiB, a multiple of 4): cuMemAlloc_v2 of S and of S/2 + 4,
 * cuMemAllocPitch_v2 (1000 bytes x (S/4000 + 1) rows), cuMemAllocAsync of S/4, and one VMM mapping of
 * the allocation granularity (cuMemCreate, cuMemAddressReserve, cuMemMap, cuMemSetAccess RW).
 * --plain: only the two cuMemAlloc_v2 allocations (what `suspend` can release).
 * Everything is filled from seed 1, then one JSON line on stdout:
 *   {"ready": true, "sum": "<hex>", "bytes": N, "allocations": [{"base", "size", "kind"}...]}
 * Then one command per line on stdin, one JSON line back for each:
 *   fill SEED    overwrite every byte from SEED        -> {"sum": "<hex>"}
 *   sum          checksum of all device memory held    -> {"sum": "<hex>"}
 *   alloc BYTES  one more cuMemAlloc_v2 (filled)       -> {"sum": "<hex>", "base": N}
 *   meminfo      cuMemGetInfo_v2 (not a gated call: answers while the process is suspended)
 *                                                      -> {"free": N, "total": N}
 *   quit         free everything and exit 0
 * The checksum is FNV-1a over 64-bit words of every allocation, in allocation order, read back with
 * cuMemcpyDtoH_v2. */
#include "workload.h"

#define MAX_BUFS 64

static struct {
    CUdeviceptr p;
    size_t n;
    int kind;
} bufs[MAX_BUFS];
static int nbufs;

static void add(CUdeviceptr p, size_t n, int kind)
{
    if (nbufs == MAX_BUFS)
        wl_die("too many allocations");
    bufs[nbufs].p = p, bufs[nbufs].n = n, bufs[nbufs].kind = kind;
    nbufs++;
}

static uint64_t xorshift(uint64_t *s)
{
    uint64_t x = *s;
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    return *s = x;
}

static void fill_one(int i, uint64_t seed)
{
    size_t words = (bufs[i].n + 7) / 8;
    uint64_t *h = malloc(words * 8), s = (seed * 0x9E3779B97F4A7C15ull) ^ (uint64_t)(i + 1) ^ 0x5bd1e995;
    if (!h)
        wl_die("out of memory");
    for (size_t k = 0; k < words; k++)
        h[k] = xorshift(&s);
    CU(cuMemcpyHtoD_v2, bufs[i].p, h, bufs[i].n);
    free(h);
}

static uint64_t checksum(void)
{
    uint64_t x = 0xcbf29ce484222325ull;
    for (int i = 0; i < nbufs; i++) {
        size_t words = (bufs[i].n + 7) / 8;
        uint64_t *h = calloc(words, 8);
        if (!h)
            wl_die("out of memory");
        CU(cuMemcpyDtoH_v2, h, bufs[i].p, bufs[i].n);
        for (size_t k = 0; k < words; k++)
            x = (x ^ h[k]) * 0x100000001b3ull;
        free(h);
    }
    return x;
}

int main(int argc, char **argv)
{
    wl.workload = "pattern";
    wl.size = 1 << 20;
    int plain = 0;
    for (int i = 1; i < argc; i++) /* our own option, taken out before the common parser sees it */
        if (!strcmp(argv[i], "--plain")) {
            plain = 1;
            memmove(argv + i, argv + i + 1, (size_t)(argc - i) * sizeof *argv);
            argc--;
            break;
        }
    wl_parse(argc, argv, WL_OPT_SIZE);
    if (wl.size <= 0 || wl.size % 4) {
        fprintf(stderr, "pattern: --size must be a positive multiple of 4\n");
        return 2;
    }
    wl_start();
    size_t S = (size_t)wl.size;
    CUdevice dev;
    CUcontext ctx;
    CUstream s;
    CU(cuInit, 0);
    CU(cuDeviceGet, &dev, 0);
    CU(cuDevicePrimaryCtxRetain, &ctx, dev);
    CU(cuCtxSetCurrent, ctx);
    CU(cuStreamCreate, &s, CU_STREAM_DEFAULT);

    CUdeviceptr p;
    size_t pitch;
    CU(cuMemAlloc_v2, &p, S);
    add(p, S, SIMCUDA_ALLOC_DEVICE);
    CU(cuMemAlloc_v2, &p, S / 2 + 4);
    add(p, S / 2 + 4, SIMCUDA_ALLOC_DEVICE);
    size_t rows = S / 4000 + 1, gran = 0;
    CUmemGenericAllocationHandle h = 0;
    if (plain)
        goto filled;
    CU(cuMemAllocPitch_v2, &p, &pitch, 1000, rows, 4);
    add(p, pitch * rows, SIMCUDA_ALLOC_PITCH);
    CU(cuMemAllocAsync, &p, S / 4, s);
    CU(cuStreamSynchronize, s);
    add(p, S / 4, SIMCUDA_ALLOC_ASYNC);

    CUmemAllocationProp prop = {.type = CU_MEM_ALLOCATION_TYPE_PINNED};
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = dev;
    CUdeviceptr va;
    CU(cuMemGetAllocationGranularity, &gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
    CU(cuMemCreate, &h, gran, &prop, 0);
    CU(cuMemAddressReserve, &va, gran, 0, 0, 0);
    CU(cuMemMap, va, gran, 0, h, 0);
    CUmemAccessDesc acc = {.location = prop.location, .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    CU(cuMemSetAccess, va, gran, &acc, 1);
    add(va, gran, SIMCUDA_ALLOC_VMM_MAP);

filled:;
    size_t total = 0;
    for (int i = 0; i < nbufs; i++) {
        fill_one(i, 1);
        total += bufs[i].n;
    }
    printf("{\"ready\": true, \"sum\": \"%016llx\", \"bytes\": %zu, \"allocations\": [", (unsigned long long)checksum(),
           total);
    for (int i = 0; i < nbufs; i++)
        printf("%s{\"base\": %llu, \"size\": %zu, \"kind\": %d}", i ? ", " : "", (unsigned long long)bufs[i].p,
               bufs[i].n, bufs[i].kind);
    printf("]}\n");
    fflush(stdout);

    char line[256];
    while (fgets(line, sizeof line, stdin)) {
        unsigned long long v;
        if (!strncmp(line, "quit", 4))
            break;
        if (sscanf(line, "fill %llu", &v) == 1) {
            for (int i = 0; i < nbufs; i++)
                fill_one(i, v);
            printf("{\"sum\": \"%016llx\"}\n", (unsigned long long)checksum());
        } else if (sscanf(line, "alloc %llu", &v) == 1 && v > 0) {
            CU(cuMemAlloc_v2, &p, (size_t)v);
            add(p, (size_t)v, SIMCUDA_ALLOC_DEVICE);
            fill_one(nbufs - 1, 7);
            printf("{\"sum\": \"%016llx\", \"base\": %llu}\n", (unsigned long long)checksum(), (unsigned long long)p);
        } else if (!strncmp(line, "meminfo", 7)) {
            size_t fr, tot;
            CU(cuMemGetInfo_v2, &fr, &tot);
            printf("{\"free\": %zu, \"total\": %zu}\n", fr, tot);
        } else if (!strncmp(line, "sum", 3)) {
            printf("{\"sum\": \"%016llx\"}\n", (unsigned long long)checksum());
        } else {
            printf("{\"error\": \"unknown command\"}\n");
        }
        fflush(stdout);
    }

    for (int i = 0; i < nbufs; i++)
        if (bufs[i].kind == SIMCUDA_ALLOC_VMM_MAP) {
            CU(cuMemUnmap, bufs[i].p, bufs[i].n);
            CU(cuMemAddressFree, bufs[i].p, bufs[i].n);
        } else if (bufs[i].kind == SIMCUDA_ALLOC_ASYNC) {
            CU(cuMemFreeAsync, bufs[i].p, s);
        } else {
            CU(cuMemFree_v2, bufs[i].p);
        }
    if (h)
        CU(cuMemRelease, h);
    CU(cuStreamSynchronize, s);
    CU(cuStreamDestroy_v2, s);
    CU(cuDevicePrimaryCtxRelease_v2, dev);
    return 0;
}
