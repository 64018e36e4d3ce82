/* pattern: holds device memory of every kind the checkpointer saves, filled with a known pattern, and
 * lets a test overwrite it and read back a checksum on command: the target for checkpoint/restore
 * tests (is device memory back, byte for byte, to what was saved?).
 *
 * Allocations (S = --size, default 1 MiB, a multiple of 4): cuMemAlloc_v2 of S and of S/2 + 4,
 * cuMemAllocPitch_v2 (1000 bytes x (S/4000 + 1) rows), cuMemAllocAsync of S/4, and one VMM mapping of
 * the allocation granularity (cuMemCreate, cuMemAddressReserve, cuMemMap, cuMemSetAccess RW).
 * --plain: only the two cuMemAlloc_v2 allocations (what `suspend` can release).
 * --own-vmm: only VMM memory the program maps itself, as PyTorch's expandable segments and XLA do:
 *   a reservation of 4 granules (G) with physical allocation A (2 G) mapped at its start and
 *   allocation B (2 G) mapped twice, its second granule at +2 G and its first at +3 G (two offsets
 *   of one allocation), every mapping read-write; and a second reservation of G, mapped with C (G).
 * --mixed: the two cuMemAlloc_v2 allocations of --plain and the mappings of --own-vmm.
 * --async: the two cuMemAlloc_v2 allocations of --plain, the cuMemAllocAsync one (stream-ordered, as
 *   JAX's and CuPy's async allocators make) and one of S/4 from a memory pool of its own
 *   (cuMemPoolCreate, cuMemAllocFromPoolAsync), and the `churn` command.
 * --empty: no device memory at all until the `alloc` command asks for some (a context and a stream only):
 *   a job that allocates only after a checkpointer's command has found it holding none.
 * --spare-handle (with --own-vmm or --mixed): one more cuMemCreate allocation (G), mapped nowhere.
 * --release-early (with --own-vmm or --mixed): C is released (cuMemRelease) as soon as it is mapped; its
 *   memory lives on in the mapping, as the driver keeps it.
 * Everything is filled from seed 1, then one JSON line on stdout:
 *   {"ready": true, "sum": "<hex>", "bytes": N, "allocations": [{"base", "size", "kind"}...]}
 * Then one command per line on stdin, one JSON line back for each:
 *   fill SEED    overwrite every byte from SEED        -> {"sum": "<hex>"}
 *   sum          checksum of all device memory held    -> {"sum": "<hex>"}
 *   alloc BYTES  one more cuMemAlloc_v2 (filled)       -> {"sum": "<hex>", "base": N}
 *   touch I OFF N SEED  overwrite N bytes at OFF of allocation I (in the order of "allocations") from
 *                SEED, the rest of it unchanged            -> {"sum": "<hex>"}
 *   meminfo      cuMemGetInfo_v2 (not a gated call: answers while the process is suspended)
 *                                                      -> {"free": N, "total": N}
 *   remap        (own VMM) unmap every mapping and map it again with the handle the program holds,
 *                read-write: the data stay (they live in the allocations)  -> {"sum": "<hex>"}
 *   props        (own VMM) cuMemGetAllocationPropertiesFromHandle of each handle the program holds (not
 *                a gated call: answers while suspended)  -> {"handles": N, "same": N as made}
 *   grow         (own VMM) one more reservation of G mapped with a new allocation (filled)
 *                                                      -> {"sum": "<hex>", "base": N}
 *   churn N      (--async) N times on one stream: a cuMemAllocAsync of S/8, filled from the host, a
 *                kernel of 20 ms adding 1 to each word, a copy of it into the first S/8 of the async
 *                allocation, and a cuMemFreeAsync of it issued while the kernel runs; then the
 *                stream synchronized                       -> {"sum": "<hex>"}
 *   array        one CUDA array (cuArrayCreate_v2, 64 x 64 floats): device memory the shim does not
 *                carry                                     -> {"arrays": N}
 *   unarray      the last one destroyed                    -> {"arrays": N}
 *   quit         free everything and exit 0 (own VMM: each handle's properties read back, and each
 *                mapping's handle retained from its address and released first, as NCCL does; other
 *                properties, or a handle other than the one mapped there, exit 1)
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

/* The program's own VMM memory: mappings, allocations, reservations, as it must free them. */
static struct {
    CUdeviceptr va;
    size_t size, off;
    CUmemGenericAllocationHandle h;
} maps[MAX_BUFS];
static int nmaps;
static CUmemGenericAllocationHandle handles[MAX_BUFS];
static int nhandles;
static struct {
    CUdeviceptr va;
    size_t size;
} res[MAX_BUFS];
static int nres;
static CUarray arrays[MAX_BUFS];
static int narrays;
static CUmemAllocationProp vprop;
static size_t gran;

static void add(CUdeviceptr p, size_t n, int kind);

static CUmemGenericAllocationHandle own_create(size_t size)
{
    CUmemGenericAllocationHandle h;
    CU(cuMemCreate, &h, size, &vprop, 0);
    handles[nhandles++] = h;
    return h;
}

static CUdeviceptr own_reserve(size_t size)
{
    CUdeviceptr va;
    CU(cuMemAddressReserve, &va, size, 0, 0, 0);
    res[nres].va = va, res[nres].size = size, nres++;
    return va;
}

static void own_map(CUdeviceptr va, size_t size, size_t off, CUmemGenericAllocationHandle h, int record)
{
    CU(cuMemMap, va, size, off, h, 0);
    CUmemAccessDesc acc = {.location = vprop.location, .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    CU(cuMemSetAccess, va, size, &acc, 1);
    if (record) {
        maps[nmaps].va = va, maps[nmaps].size = size, maps[nmaps].off = off, maps[nmaps].h = h, nmaps++;
        add(va, size, SIMCUDA_ALLOC_VMM_MAP);
    }
}

static void own_vmm(int spare, int early)
{
    CUdeviceptr va = own_reserve(4 * gran);
    CUmemGenericAllocationHandle a = own_create(2 * gran), b = own_create(2 * gran);
    own_map(va, 2 * gran, 0, a, 1);
    own_map(va + 2 * gran, gran, gran, b, 1);
    own_map(va + 3 * gran, gran, 0, b, 1);
    own_map(own_reserve(gran), gran, 0, own_create(gran), 1);
    if (early)
        CU(cuMemRelease, handles[--nhandles]);
    if (spare)
        own_create(gran);
}

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
    int plain = 0, own = 0, mixed = 0, spare = 0, early = 0, async = 0, empty = 0;
    for (int i = 1; i < argc;) /* our own options, taken out before the common parser sees them */
        if (!strcmp(argv[i], "--plain") || !strcmp(argv[i], "--own-vmm") || !strcmp(argv[i], "--mixed") ||
            !strcmp(argv[i], "--spare-handle") || !strcmp(argv[i], "--release-early") || !strcmp(argv[i], "--async") ||
            !strcmp(argv[i], "--empty")) {
            int *o = argv[i][2] == 'p' ? &plain : argv[i][2] == 'o' ? &own : argv[i][2] == 'm' ? &mixed
                     : argv[i][2] == 's' ? &spare : argv[i][2] == 'a' ? &async : !strcmp(argv[i], "--empty") ? &empty
                     : &early;
            *o = 1;
            memmove(argv + i, argv + i + 1, (size_t)(argc - i) * sizeof *argv);
            argc--;
        } else {
            i++;
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
    CUmemGenericAllocationHandle h = 0; /* (before any goto: every path reads them at the end) */
    CUfunction inc = NULL;
    int async_buf = -1;
    CUmemoryPool pool = NULL;
    vprop = (CUmemAllocationProp){.type = CU_MEM_ALLOCATION_TYPE_PINNED};
    vprop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    vprop.location.id = dev;
    CU(cuMemGetAllocationGranularity, &gran, &vprop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
    if (empty)
        goto filled;
    if (own) {
        own_vmm(spare, early);
        goto filled;
    }
    CU(cuMemAlloc_v2, &p, S);
    add(p, S, SIMCUDA_ALLOC_DEVICE);
    CU(cuMemAlloc_v2, &p, S / 2 + 4);
    add(p, S / 2 + 4, SIMCUDA_ALLOC_DEVICE);
    size_t rows = S / 4000 + 1;
    if (mixed)
        own_vmm(spare, early);
    if (plain || mixed)
        goto filled;
    if (async) {
        CUmodule mod;
        CU(cuModuleLoadData, &mod, "SIMCUDA-MODULE\nkernel inc inc_u32 20000000\n");
        CU(cuModuleGetFunction, &inc, mod, "inc");
        CU(cuMemAllocAsync, &p, S / 4, s);
        CU(cuStreamSynchronize, s);
        add(p, S / 4, SIMCUDA_ALLOC_ASYNC);
        async_buf = nbufs - 1;
        CUmemPoolProps pp = {.allocType = CU_MEM_ALLOCATION_TYPE_PINNED};
        pp.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        pp.location.id = dev;
        CU(cuMemPoolCreate, &pool, &pp);
        CU(cuMemAllocFromPoolAsync, &p, S / 4, pool, s);
        CU(cuStreamSynchronize, s);
        add(p, S / 4, SIMCUDA_ALLOC_ASYNC);
        goto filled;
    }
    CU(cuMemAllocPitch_v2, &p, &pitch, 1000, rows, 4);
    add(p, pitch * rows, SIMCUDA_ALLOC_PITCH);
    CU(cuMemAllocAsync, &p, S / 4, s);
    CU(cuStreamSynchronize, s);
    add(p, S / 4, SIMCUDA_ALLOC_ASYNC);

    CUmemAllocationProp prop = vprop;
    CUdeviceptr va;
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
        unsigned long long ti, toff, tn, tseed;
        if (sscanf(line, "touch %llu %llu %llu %llu", &ti, &toff, &tn, &tseed) == 4) {
            if (ti >= (unsigned long long)nbufs || toff > bufs[ti].n || tn > bufs[ti].n - toff) {
                printf("{\"error\": \"out of range\"}\n");
                fflush(stdout);
                continue;
            }
            unsigned char *h = malloc(tn ? tn : 1);
            uint64_t s = tseed * 0x9E3779B97F4A7C15ull + 1;
            if (!h)
                wl_die("out of memory");
            for (size_t k = 0; k < tn; k++)
                h[k] = (unsigned char)(xorshift(&s) >> 24);
            CU(cuMemcpyHtoD_v2, bufs[ti].p + toff, h, tn);
            free(h);
            printf("{\"sum\": \"%016llx\"}\n", (unsigned long long)checksum());
        } else if (sscanf(line, "fill %llu", &v) == 1) {
            for (int i = 0; i < nbufs; i++)
                fill_one(i, v);
            printf("{\"sum\": \"%016llx\"}\n", (unsigned long long)checksum());
        } else if (sscanf(line, "alloc %llu", &v) == 1 && v > 0) {
            CU(cuMemAlloc_v2, &p, (size_t)v);
            add(p, (size_t)v, SIMCUDA_ALLOC_DEVICE);
            fill_one(nbufs - 1, 7);
            printf("{\"sum\": \"%016llx\", \"base\": %llu}\n", (unsigned long long)checksum(), (unsigned long long)p);
        } else if (sscanf(line, "churn %llu", &v) == 1 && async_buf >= 0) {
            size_t n = S / 8 / 4 * 4;
            uint32_t *host = malloc(n);
            if (!host)
                wl_die("out of memory");
            for (unsigned long long k = 0; k < v; k++) {
                CUdeviceptr q;
                CU(cuMemAllocAsync, &q, n, s);
                for (size_t j = 0; j < n / 4; j++)
                    host[j] = (uint32_t)((k + 1) * 2654435761u + j);
                CU(cuMemcpyHtoD_v2, q, host, n);
                uint64_t words = n / 4;
                void *args[] = {&q, &words};
                CU(cuLaunchKernel, inc, 1, 1, 1, 1, 1, 1, 0, s, args, NULL);
                CU(cuMemcpyDtoDAsync_v2, bufs[async_buf].p, q, n, s);
                CU(cuMemFreeAsync, q, s); /* the kernel and the copy still to run: the memory must outlive them */
            }
            CU(cuStreamSynchronize, s);
            free(host);
            printf("{\"sum\": \"%016llx\"}\n", (unsigned long long)checksum());
        } else if (!strncmp(line, "unarray", 7) && narrays) {
            CU(cuArrayDestroy, arrays[--narrays]);
            printf("{\"arrays\": %d}\n", narrays);
        } else if (!strncmp(line, "array", 5) && narrays < MAX_BUFS) {
            CUDA_ARRAY_DESCRIPTOR d = {.Width = 64, .Height = 64, .Format = CU_AD_FORMAT_FLOAT, .NumChannels = 1};
            CU(cuArrayCreate_v2, &arrays[narrays++], &d);
            printf("{\"arrays\": %d}\n", narrays);
        } else if (!strncmp(line, "remap", 5)) {
            for (int i = 0; i < nmaps; i++) {
                CU(cuMemUnmap, maps[i].va, maps[i].size);
                own_map(maps[i].va, maps[i].size, maps[i].off, maps[i].h, 0);
            }
            printf("{\"sum\": \"%016llx\"}\n", (unsigned long long)checksum());
        } else if (!strncmp(line, "props", 5)) {
            int same = 0;
            for (int i = 0; i < nhandles; i++) {
                CUmemAllocationProp pr;
                CU(cuMemGetAllocationPropertiesFromHandle, &pr, handles[i]);
                same += pr.type == vprop.type && pr.location.id == vprop.location.id;
            }
            printf("{\"handles\": %d, \"same\": %d}\n", nhandles, same);
        } else if (!strncmp(line, "grow", 4)) {
            CUdeviceptr va = own_reserve(gran);
            own_map(va, gran, 0, own_create(gran), 1);
            fill_one(nbufs - 1, 9);
            printf("{\"sum\": \"%016llx\", \"base\": %llu}\n", (unsigned long long)checksum(), (unsigned long long)va);
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

    /* The program's own mappings, with the handles it was given, then its reservations.  First, as
     * NCCL frees its buffers: the handle retained from the address must be the one the program holds. */
    for (int i = 0; i < nhandles; i++) {
        CUmemAllocationProp pr;
        CU(cuMemGetAllocationPropertiesFromHandle, &pr, handles[i]);
        if (pr.type != vprop.type || pr.location.type != vprop.location.type || pr.location.id != vprop.location.id)
            wl_die("cuMemGetAllocationPropertiesFromHandle(%#llx): not the properties it was made with",
                   (unsigned long long)handles[i]);
    }
    for (int i = 0; i < nmaps; i++) {
        CUmemGenericAllocationHandle r;
        CU(cuMemRetainAllocationHandle, &r, (void *)(uintptr_t)maps[i].va);
        if (r != maps[i].h)
            wl_die("cuMemRetainAllocationHandle(%#llx) gave %#llx, not the handle mapped there (%#llx)",
                   (unsigned long long)maps[i].va, (unsigned long long)r, (unsigned long long)maps[i].h);
        CU(cuMemRelease, r);
    }
    for (int i = 0; i < nmaps; i++)
        CU(cuMemUnmap, maps[i].va, maps[i].size);
    for (int i = 0; i < nhandles; i++)
        CU(cuMemRelease, handles[i]);
    for (int i = 0; i < nres; i++)
        CU(cuMemAddressFree, res[i].va, res[i].size);
    for (int i = 0; i < nbufs; i++)
        if (bufs[i].kind == SIMCUDA_ALLOC_VMM_MAP && nmaps) {
            continue;
        } else if (bufs[i].kind == SIMCUDA_ALLOC_VMM_MAP) {
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
    if (pool)
        CU(cuMemPoolDestroy, pool);
    CU(cuStreamDestroy_v2, s);
    CU(cuDevicePrimaryCtxRelease_v2, dev);
    return 0;
}
