/* What each state call does to the registry.  pre_NAME runs before the driver call, post_NAME after
 * it, both inside the gated section.  Objects are added after the driver created them; they are
 * removed *before* the driver frees them (and put back if it fails), so a handle the driver reuses
 * at once in another thread can never lose its fresh record to our late removal. */
#include "shim_int.h"

#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define MAX_DEVICES 64
static pthread_mutex_t g_ctx_mu = PTHREAD_MUTEX_INITIALIZER; /* primary-context reference counts */
static CUcontext g_primary[MAX_DEVICES];

static void put_back(CUresult r, struct hold *h)
{
    if (!h->found)
        return;
    if (r == CUDA_SUCCESS)
        reg_release(&h->rec);
    else
        reg_put(&h->rec);
}

static void take(struct hold *h, int type, uint64_t key) { h->found = reg_take(type, key, &h->rec); }

static int device_of(CUcontext c)
{
    struct rec r;
    return c && reg_get(R_CTX, (uint64_t)(uintptr_t)c, &r) ? r.device : 0;
}

static void put_object(int type, int kind, uint64_t key, uint64_t size, unsigned flags)
{
    CUcontext c = shim_current_ctx();
    struct rec r = {.type = type, .kind = kind, .key = key, .size = size, .ctx = (uintptr_t)c, .device = device_of(c),
                    .flags = flags};
    reg_put(&r);
}

/* Everything created in a context goes with it. */
static int owned_by(struct rec *r, void *arg) { return r->ctx && r->ctx == *(uint64_t *)arg && r->type != R_CTX; }

static void purge_ctx(CUcontext c)
{
    uint64_t key = (uintptr_t)c;
    reg_scan(0, owned_by, &key);
}

/* ---- contexts */

void pre_cuDevicePrimaryCtxRetain(struct hold *h, CUcontext *pctx, CUdevice dev) { (void)h, (void)pctx, (void)dev; }
void post_cuDevicePrimaryCtxRetain(CUresult r, struct hold *h, CUcontext *pctx, CUdevice dev)
{
    (void)h;
    if (r != CUDA_SUCCESS || !pctx || !*pctx)
        return;
    pthread_mutex_lock(&g_ctx_mu);
    if (dev >= 0 && dev < MAX_DEVICES)
        g_primary[dev] = *pctx;
    struct rec c;
    if (reg_take(R_CTX, (uintptr_t)*pctx, &c))
        c.refs++;
    else
        c = (struct rec){.type = R_CTX, .key = (uintptr_t)*pctx, .device = dev, .primary = 1, .refs = 1};
    reg_put(&c);
    pthread_mutex_unlock(&g_ctx_mu);
}

void pre_cuDevicePrimaryCtxRelease_v2(struct hold *h, CUdevice dev) { (void)h, (void)dev; }
void post_cuDevicePrimaryCtxRelease_v2(CUresult r, struct hold *h, CUdevice dev)
{
    (void)h;
    if (r != CUDA_SUCCESS || dev < 0 || dev >= MAX_DEVICES)
        return;
    pthread_mutex_lock(&g_ctx_mu);
    CUcontext ctx = g_primary[dev];
    struct rec c;
    if (ctx && reg_take(R_CTX, (uintptr_t)ctx, &c)) {
        if (--c.refs > 0)
            reg_put(&c);
        else
            purge_ctx(ctx); /* the last release destroys the primary context and all it holds */
    }
    pthread_mutex_unlock(&g_ctx_mu);
}

void pre_cuDevicePrimaryCtxReset_v2(struct hold *h, CUdevice dev) { (void)h, (void)dev; }
void post_cuDevicePrimaryCtxReset_v2(CUresult r, struct hold *h, CUdevice dev)
{
    (void)h;
    if (r != CUDA_SUCCESS || dev < 0 || dev >= MAX_DEVICES)
        return;
    pthread_mutex_lock(&g_ctx_mu);
    if (g_primary[dev]) {
        purge_ctx(g_primary[dev]);
        struct rec c;
        reg_take(R_CTX, (uintptr_t)g_primary[dev], &c);
    }
    pthread_mutex_unlock(&g_ctx_mu);
}

void pre_cuCtxCreate_v2(struct hold *h, CUcontext *pctx, unsigned int flags, CUdevice dev)
{
    (void)h, (void)pctx, (void)flags, (void)dev;
}
void post_cuCtxCreate_v2(CUresult r, struct hold *h, CUcontext *pctx, unsigned int flags, CUdevice dev)
{
    (void)h;
    if (r != CUDA_SUCCESS || !pctx || !*pctx)
        return;
    struct rec c = {.type = R_CTX, .key = (uintptr_t)*pctx, .device = dev, .refs = 1, .flags = flags};
    reg_put(&c);
}

void pre_cuCtxDestroy_v2(struct hold *h, CUcontext ctx) { take(h, R_CTX, (uintptr_t)ctx); }
void post_cuCtxDestroy_v2(CUresult r, struct hold *h, CUcontext ctx)
{
    if (r == CUDA_SUCCESS)
        purge_ctx(ctx);
    put_back(r, h);
}

/* ---- device memory */

void pre_cuMemAlloc_v2(struct hold *h, CUdeviceptr *dptr, size_t bytes) { (void)h, (void)dptr, (void)bytes; }
/* A device allocation of `kind` made: the driver's, or served through the VMM API (vmm.c: the
 * alternative says so with found = 2 and leaves its handle and reservation in the hold). */
static void put_allocation(CUresult r, struct hold *h, int kind, CUdeviceptr *dptr, size_t bytes)
{
    if (r != CUDA_SUCCESS || !dptr)
        return;
    if (h->found != 2) {
        put_object(R_MEM, kind, *dptr, bytes, 0);
        return;
    }
    CUcontext c = shim_current_ctx();
    struct rec m = {.type = R_MEM, .kind = kind, .key = *dptr, .size = bytes, .ctx = (uintptr_t)c,
                    .device = device_of(c), .handle = h->rec.handle, .reserved = h->rec.reserved};
    reg_put(&m);
}

void post_cuMemAlloc_v2(CUresult r, struct hold *h, CUdeviceptr *dptr, size_t bytes)
{
    put_allocation(r, h, K_DEVICE, dptr, bytes);
}

void pre_cuMemAllocPitch_v2(struct hold *h, CUdeviceptr *dptr, size_t *pitch, size_t width, size_t height,
                            unsigned int elsize)
{
    (void)h, (void)dptr, (void)pitch, (void)width, (void)height, (void)elsize;
}
void post_cuMemAllocPitch_v2(CUresult r, struct hold *h, CUdeviceptr *dptr, size_t *pitch, size_t width,
                             size_t height, unsigned int elsize)
{
    (void)h, (void)width, (void)elsize;
    if (r == CUDA_SUCCESS && dptr && pitch)
        put_object(R_MEM, K_PITCH, *dptr, *pitch * height, 0);
}

void pre_cuMemFree_v2(struct hold *h, CUdeviceptr dptr) { take(h, R_MEM, dptr); }
void post_cuMemFree_v2(CUresult r, struct hold *h, CUdeviceptr dptr) { (void)dptr, put_back(r, h); }

void pre_cuMemAllocAsync(struct hold *h, CUdeviceptr *dptr, size_t bytes, CUstream s) { (void)h, (void)dptr, (void)bytes, (void)s; }
void post_cuMemAllocAsync(CUresult r, struct hold *h, CUdeviceptr *dptr, size_t bytes, CUstream s)
{
    (void)s;
    put_allocation(r, h, K_ASYNC, dptr, bytes);
}
void pre_cuMemAllocAsync_ptsz(struct hold *h, CUdeviceptr *dptr, size_t bytes, CUstream s) { (void)h, (void)dptr, (void)bytes, (void)s; }
void post_cuMemAllocAsync_ptsz(CUresult r, struct hold *h, CUdeviceptr *dptr, size_t bytes, CUstream s)
{
    post_cuMemAllocAsync(r, h, dptr, bytes, s);
}

/* From a memory pool of the program's (or a device's default one): stream-ordered memory like
 * cuMemAllocAsync's, recorded the same way, so a checkpoint carries it. */
#define FROM_POOL(name)                                                                                          \
    void pre_##name(struct hold *h, CUdeviceptr *dptr, size_t bytes, CUmemoryPool pool, CUstream s)              \
    {                                                                                                            \
        (void)h, (void)dptr, (void)bytes, (void)pool, (void)s;                                                   \
    }                                                                                                            \
    void post_##name(CUresult r, struct hold *h, CUdeviceptr *dptr, size_t bytes, CUmemoryPool pool, CUstream s) \
    {                                                                                                            \
        (void)pool, (void)s;                                                                                     \
        put_allocation(r, h, K_ASYNC, dptr, bytes);                                                              \
    }
FROM_POOL(cuMemAllocFromPoolAsync)
FROM_POOL(cuMemAllocFromPoolAsync_ptsz)
#undef FROM_POOL

/* A stream-ordered free leaves the registry at once: once the stream reaches it the memory is gone,
 * and nothing may use it after the free was issued. */
void pre_cuMemFreeAsync(struct hold *h, CUdeviceptr dptr, CUstream s) { (void)s, take(h, R_MEM, dptr); }
void post_cuMemFreeAsync(CUresult r, struct hold *h, CUdeviceptr dptr, CUstream s) { (void)dptr, (void)s, put_back(r, h); }
void pre_cuMemFreeAsync_ptsz(struct hold *h, CUdeviceptr dptr, CUstream s) { (void)s, take(h, R_MEM, dptr); }
void post_cuMemFreeAsync_ptsz(CUresult r, struct hold *h, CUdeviceptr dptr, CUstream s) { (void)dptr, (void)s, put_back(r, h); }

/* ---- device memory the shim does not carry: counted while held, so that a checkpoint refuses
 * rather than leave it out (its contents are not copied, and a restore would not bring it back).
 * CUDA arrays (textures) and memory imported from another process (cuIpcOpenMemHandle,
 * cuMemPoolImportPointer: the other process owns it). */

atomic_int untracked_held;
const char *_Atomic untracked_what;

static void untracked(CUresult r, int delta, const char *what)
{
    if (r != CUDA_SUCCESS)
        return;
    if (delta > 0)
        atomic_store(&untracked_what, what);
    if (atomic_fetch_add(&untracked_held, delta) + delta < 0)
        atomic_store(&untracked_held, 0); /* (one made before the shim was loaded) */
}

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-parameter"
#define UNTRACKED(name, delta, ...)                                                                              \
    void pre_##name(struct hold *h, __VA_ARGS__) {}                                                              \
    void post_##name(CUresult r, struct hold *h, __VA_ARGS__) { untracked(r, delta, #name); }
UNTRACKED(cuArrayCreate_v2, 1, CUarray *ph, const CUDA_ARRAY_DESCRIPTOR *d)
UNTRACKED(cuArray3DCreate_v2, 1, CUarray *ph, const CUDA_ARRAY3D_DESCRIPTOR *d)
UNTRACKED(cuArrayDestroy, -1, CUarray a)
UNTRACKED(cuMipmappedArrayCreate, 1, CUmipmappedArray *ph, const CUDA_ARRAY3D_DESCRIPTOR *d, unsigned int n)
UNTRACKED(cuMipmappedArrayDestroy, -1, CUmipmappedArray a)
UNTRACKED(cuIpcOpenMemHandle_v2, 1, CUdeviceptr *pd, CUipcMemHandle hd, unsigned int flags)
UNTRACKED(cuIpcCloseMemHandle, -1, CUdeviceptr d)
/* (imported pool memory is freed with cuMemFreeAsync, which the registry does not know it by: held
 * from then on) */
UNTRACKED(cuMemPoolImportPointer, 1, CUdeviceptr *pd, CUmemoryPool pool, CUmemPoolPtrExportData *sd)
#undef UNTRACKED
#pragma GCC diagnostic pop

/* ---- pinned host memory */

void pre_cuMemAllocHost_v2(struct hold *h, void **pp, size_t bytes) { (void)h, (void)pp, (void)bytes; }
void post_cuMemAllocHost_v2(CUresult r, struct hold *h, void **pp, size_t bytes)
{
    (void)h;
    if (r == CUDA_SUCCESS && pp)
        put_object(R_HOST, K_HOST, (uintptr_t)*pp, bytes, 0);
}
void pre_cuMemHostAlloc(struct hold *h, void **pp, size_t bytes, unsigned int flags) { (void)h, (void)pp, (void)bytes, (void)flags; }
void post_cuMemHostAlloc(CUresult r, struct hold *h, void **pp, size_t bytes, unsigned int flags)
{
    (void)h;
    if (r == CUDA_SUCCESS && pp)
        put_object(R_HOST, K_HOST, (uintptr_t)*pp, bytes, flags);
}
void pre_cuMemFreeHost(struct hold *h, void *p) { take(h, R_HOST, (uintptr_t)p); }
void post_cuMemFreeHost(CUresult r, struct hold *h, void *p) { (void)p, put_back(r, h); }

/* ---- virtual memory management */

void pre_cuMemAddressReserve(struct hold *h, CUdeviceptr *ptr, size_t size, size_t align, CUdeviceptr addr,
                             unsigned long long fl)
{
    (void)h, (void)ptr, (void)size, (void)align, (void)addr, (void)fl;
}
void post_cuMemAddressReserve(CUresult r, struct hold *h, CUdeviceptr *ptr, size_t size, size_t align,
                              CUdeviceptr addr, unsigned long long fl)
{
    (void)h, (void)align, (void)addr, (void)fl;
    if (r == CUDA_SUCCESS && ptr) {
        struct rec v = {.type = R_VA, .kind = K_VA_RESERVE, .key = *ptr, .size = size};
        reg_put(&v);
    }
}
void pre_cuMemAddressFree(struct hold *h, CUdeviceptr ptr, size_t size) { (void)size, take(h, R_VA, ptr); }
void post_cuMemAddressFree(CUresult r, struct hold *h, CUdeviceptr ptr, size_t size) { (void)ptr, (void)size, put_back(r, h); }

void pre_cuMemCreate(struct hold *h, CUmemGenericAllocationHandle *hd, size_t size, const CUmemAllocationProp *prop,
                     unsigned long long fl)
{
    (void)h, (void)hd, (void)size, (void)prop, (void)fl;
}
void post_cuMemCreate(CUresult r, struct hold *h, CUmemGenericAllocationHandle *hd, size_t size,
                      const CUmemAllocationProp *prop, unsigned long long fl)
{
    (void)fl;
    if (r != CUDA_SUCCESS || !hd)
        return;
    struct rec p = {.type = R_PHYS, .kind = K_VMM_PHYS, .key = *hd, .handle = h->found == 3 ? h->rec.handle : *hd,
                    .size = size, .device = prop ? prop->location.id : 0};
    if (prop)
        p.prop = *prop; /* what `unsuspend` creates it again with */
    reg_put(&p);
}
/* A handle retained (cuMemRetainAllocationHandle) is released once per retain before the allocation's
 * own release: those releases leave the record in place (found = 4). */
static void release_ref(struct rec *r, void *arg)
{
    struct hold *h = arg;
    h->rec = *r;
    h->rec.next = NULL;
    if (r->refs > 0) {
        r->refs--;
        h->found = 4;
    }
}
static void add_ref(struct rec *r, void *arg) { (void)arg, r->refs++; }

void pre_cuMemRelease(struct hold *h, CUmemGenericAllocationHandle hd)
{
    if (!reg_update(R_PHYS, hd, release_ref, h) || h->found != 4)
        take(h, R_PHYS, hd);
}
void post_cuMemRelease(CUresult r, struct hold *h, CUmemGenericAllocationHandle hd)
{
    if (h->found == 4) {
        if (r != CUDA_SUCCESS)
            reg_update(R_PHYS, hd, add_ref, NULL);
        return;
    }
    put_back(r, h);
}

void pre_cuMemRetainAllocationHandle(struct hold *h, CUmemGenericAllocationHandle *hd, void *addr)
{
    (void)h, (void)hd, (void)addr;
}
void post_cuMemRetainAllocationHandle(CUresult r, struct hold *h, CUmemGenericAllocationHandle *hd, void *addr)
{
    (void)h, (void)addr;
    if (r == CUDA_SUCCESS && hd)
        *hd = vmm_retained(*hd); /* the program's value for it, the retain counted */
}

static void set_exported(struct rec *r, void *arg) { (void)arg, r->exported = 1; }

void pre_cuMemExportToShareableHandle(struct hold *h, void *sh, CUmemGenericAllocationHandle hd,
                                      CUmemAllocationHandleType t, unsigned long long fl)
{
    (void)h, (void)sh, (void)hd, (void)t, (void)fl;
}
void post_cuMemExportToShareableHandle(CUresult r, struct hold *h, void *sh, CUmemGenericAllocationHandle hd,
                                       CUmemAllocationHandleType t, unsigned long long fl)
{
    (void)h, (void)sh, (void)t, (void)fl;
    if (r == CUDA_SUCCESS)
        reg_update(R_PHYS, hd, set_exported, NULL); /* another process may hold it now: not released by suspend */
}

void pre_cuMemMap(struct hold *h, CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle hd,
                  unsigned long long fl)
{
    (void)h, (void)ptr, (void)size, (void)offset, (void)hd, (void)fl;
}
void post_cuMemMap(CUresult r, struct hold *h, CUdeviceptr ptr, size_t size, size_t offset,
                   CUmemGenericAllocationHandle hd, unsigned long long fl)
{
    (void)h, (void)fl;
    if (r != CUDA_SUCCESS)
        return;
    struct rec ph;
    struct rec m = {.type = R_MAP, .kind = K_VMM_MAP, .key = ptr, .size = size, .handle = hd, .offset = offset,
                    .device = reg_get(R_PHYS, hd, &ph) ? ph.device : 0};
    reg_put(&m);
}

struct range {
    uint64_t lo, hi;
    int access;
};

static int in_range(struct rec *r, void *arg)
{
    struct range *g = arg;
    return r->key >= g->lo && r->key < g->hi;
}

struct access {
    struct range g;
    const CUmemAccessDesc *desc;
    size_t count;
};

static int set_access(struct rec *r, void *arg)
{
    struct access *a = arg;
    if (r->key < a->g.lo || r->key >= a->g.hi)
        return 0;
    r->access = a->g.access;
    /* What `unsuspend` sets again: each call sets the access of the locations it names, and leaves the
     * others' as they were, so the record keeps the latest flags per location. */
    for (size_t i = 0; i < a->count && r->nacc >= 0; i++) {
        int k = 0;
        while (k < r->nacc && (r->acc[k].location.type != a->desc[i].location.type ||
                               r->acc[k].location.id != a->desc[i].location.id))
            k++;
        if (k == REC_ACC) {
            r->nacc = -1; /* more locations than kept: `suspend` refuses it */
            break;
        }
        r->acc[k] = a->desc[i];
        if (k == r->nacc)
            r->nacc++;
    }
    for (int k = 0; k < r->nacc; k++) /* readable by some device: what a dump copies through */
        if ((int)r->acc[k].flags > r->access)
            r->access = (int)r->acc[k].flags;
    return 0;
}

/* An unmap may cover several mappings; it is removed after the driver succeeds (a range has no single
 * handle to take out first, and only the program's own misuse could race with it). */
void pre_cuMemUnmap(struct hold *h, CUdeviceptr ptr, size_t size) { (void)h, (void)ptr, (void)size; }
void post_cuMemUnmap(CUresult r, struct hold *h, CUdeviceptr ptr, size_t size)
{
    (void)h;
    if (r != CUDA_SUCCESS)
        return;
    struct range g = {ptr, ptr + size, 0};
    reg_scan(R_MAP, in_range, &g);
}

void pre_cuMemSetAccess(struct hold *h, CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count)
{
    (void)h, (void)ptr, (void)size, (void)desc, (void)count;
}
void post_cuMemSetAccess(CUresult r, struct hold *h, CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc,
                         size_t count)
{
    (void)h;
    if (r != CUDA_SUCCESS || !desc)
        return;
    struct access a = {{ptr, ptr + size, 0}, desc, count};
    for (size_t i = 0; i < count; i++)
        if ((int)desc[i].flags > a.g.access)
            a.g.access = (int)desc[i].flags;
    reg_scan(R_MAP, set_access, &a);
}

/* ---- streams and events */

void pre_cuStreamCreate(struct hold *h, CUstream *ph, unsigned int flags) { (void)h, (void)ph, (void)flags; }
void post_cuStreamCreate(CUresult r, struct hold *h, CUstream *ph, unsigned int flags)
{
    (void)h;
    if (r == CUDA_SUCCESS && ph)
        put_object(R_STREAM, 0, (uintptr_t)*ph, 0, flags);
}
void pre_cuStreamCreateWithPriority(struct hold *h, CUstream *ph, unsigned int flags, int prio)
{
    (void)h, (void)ph, (void)flags, (void)prio;
}
void post_cuStreamCreateWithPriority(CUresult r, struct hold *h, CUstream *ph, unsigned int flags, int prio)
{
    (void)h;
    if (r != CUDA_SUCCESS || !ph)
        return;
    CUcontext c = shim_current_ctx();
    struct rec s = {.type = R_STREAM, .key = (uintptr_t)*ph, .ctx = (uintptr_t)c, .device = device_of(c),
                    .flags = flags, .priority = prio};
    reg_put(&s);
}
void pre_cuStreamDestroy_v2(struct hold *h, CUstream s) { take(h, R_STREAM, (uintptr_t)s); }
void post_cuStreamDestroy_v2(CUresult r, struct hold *h, CUstream s) { (void)s, put_back(r, h); }

void pre_cuEventCreate(struct hold *h, CUevent *ph, unsigned int flags) { (void)h, (void)ph, (void)flags; }
void post_cuEventCreate(CUresult r, struct hold *h, CUevent *ph, unsigned int flags)
{
    (void)h;
    if (r == CUDA_SUCCESS && ph)
        put_object(R_EVENT, 0, (uintptr_t)*ph, 0, flags);
}
void pre_cuEventDestroy_v2(struct hold *h, CUevent e) { take(h, R_EVENT, (uintptr_t)e); }
void post_cuEventDestroy_v2(CUresult r, struct hold *h, CUevent e) { (void)e, put_back(r, h); }

/* ---- modules and libraries: keep the image, so the module can be loaded again after a restore */

/* The size of a module image: an ELF cubin (up to the end of its last section or header table), a
 * fatbin (its header says), a fatbin wrapper (the fatbin it points to), else NUL-terminated text
 * (PTX, or simcuda's modules). */
static size_t image_size(const void *img, const void **start)
{
    const unsigned char *p = img;
    uint32_t magic;
    *start = img;
    memcpy(&magic, p, 4);
    if (magic == 0x464c457fu && p[4] == 2) { /* ELF64 */
        uint64_t shoff, phoff;
        uint16_t shentsize, shnum, phentsize, phnum;
        memcpy(&phoff, p + 0x20, 8);
        memcpy(&shoff, p + 0x28, 8);
        memcpy(&phentsize, p + 0x36, 2);
        memcpy(&phnum, p + 0x38, 2);
        memcpy(&shentsize, p + 0x3a, 2);
        memcpy(&shnum, p + 0x3c, 2);
        uint64_t end = shoff + (uint64_t)shentsize * shnum;
        if (phoff + (uint64_t)phentsize * phnum > end)
            end = phoff + (uint64_t)phentsize * phnum;
        for (unsigned i = 0; i < shnum && shentsize >= 0x28; i++) {
            const unsigned char *sh = p + shoff + (uint64_t)i * shentsize;
            uint32_t type;
            uint64_t off, size;
            memcpy(&type, sh + 4, 4);
            memcpy(&off, sh + 0x18, 8);
            memcpy(&size, sh + 0x20, 8);
            if (type != 8 /* SHT_NOBITS */ && off + size > end)
                end = off + size;
        }
        return end > 64 ? end : 64;
    }
    if (magic == 0xBA55ED50u) { /* fatbin: u32 magic, u16 version, u16 header size, u64 payload size */
        uint16_t hsize;
        uint64_t fsize;
        memcpy(&hsize, p + 6, 2);
        memcpy(&fsize, p + 8, 8);
        return (size_t)hsize + fsize;
    }
    if (magic == 0x466243b1u) { /* fatbin wrapper: int magic, int version, const void *data, ... */
        const void *data;
        memcpy(&data, p + 8, sizeof data);
        if (data && data != img)
            return image_size(data, start);
    }
    return strlen((const char *)img) + 1;
}

static void put_image(int type, uint64_t key, const void *img, char *path)
{
    struct rec m = {.type = type, .key = key, .path = path};
    if (img) {
        const void *start;
        size_t n = image_size(img, &start);
        m.image = malloc(n);
        if (m.image) {
            memcpy(m.image, start, n);
            m.image_len = n;
        }
    }
    CUcontext c = shim_current_ctx();
    m.ctx = (uintptr_t)c;
    m.device = device_of(c);
    reg_put(&m);
}

/* A module or library loaded from a file: keep the path and a copy of the file as it was then. */
static void put_file(int type, uint64_t key, const char *fname)
{
    struct rec m = {.type = type, .key = key, .path = strdup(fname)};
    int fd = open(fname, O_RDONLY | O_CLOEXEC);
    struct stat st;
    if (fd >= 0 && fstat(fd, &st) == 0 && st.st_size > 0 && (m.image = malloc((size_t)st.st_size))) {
        size_t got = 0;
        while (got < (size_t)st.st_size) {
            ssize_t n = read(fd, (char *)m.image + got, (size_t)st.st_size - got);
            if (n <= 0)
                break;
            got += (size_t)n;
        }
        m.image_len = got;
    }
    if (fd >= 0)
        close(fd);
    CUcontext c = shim_current_ctx();
    m.ctx = (uintptr_t)c;
    m.device = device_of(c);
    reg_put(&m);
}

void pre_cuModuleLoadData(struct hold *h, CUmodule *pm, const void *image) { (void)h, (void)pm, (void)image; }
void post_cuModuleLoadData(CUresult r, struct hold *h, CUmodule *pm, const void *image)
{
    (void)h;
    if (r == CUDA_SUCCESS && pm && image)
        put_image(R_MODULE, (uintptr_t)*pm, image, NULL);
}

void pre_cuModuleLoad(struct hold *h, CUmodule *pm, const char *fname) { (void)h, (void)pm, (void)fname; }
void post_cuModuleLoad(CUresult r, struct hold *h, CUmodule *pm, const char *fname)
{
    (void)h;
    if (r == CUDA_SUCCESS && pm && fname)
        put_file(R_MODULE, (uintptr_t)*pm, fname);
}

void pre_cuModuleUnload(struct hold *h, CUmodule m) { take(h, R_MODULE, (uintptr_t)m); }
void post_cuModuleUnload(CUresult r, struct hold *h, CUmodule m) { (void)m, put_back(r, h); }

void pre_cuLibraryLoadData(struct hold *h, CUlibrary *pl, const void *code, CUjit_option *jo, void **jv,
                           unsigned int nj, CUlibraryOption *lo, void **lv, unsigned int nl)
{
    (void)h, (void)pl, (void)code, (void)jo, (void)jv, (void)nj, (void)lo, (void)lv, (void)nl;
}
void post_cuLibraryLoadData(CUresult r, struct hold *h, CUlibrary *pl, const void *code, CUjit_option *jo,
                            void **jv, unsigned int nj, CUlibraryOption *lo, void **lv, unsigned int nl)
{
    (void)h, (void)jo, (void)jv, (void)nj, (void)lo, (void)lv, (void)nl;
    if (r == CUDA_SUCCESS && pl && code)
        put_image(R_LIBRARY, (uintptr_t)*pl, code, NULL);
}

void pre_cuLibraryUnload(struct hold *h, CUlibrary l) { take(h, R_LIBRARY, (uintptr_t)l); }
void post_cuLibraryUnload(CUresult r, struct hold *h, CUlibrary l) { (void)l, put_back(r, h); }

/* ---- functions beyond the simulator's slice of the API (wrapped all the same) */

/* Managed memory is device memory the driver may migrate: a checkpoint must save it all the same. */
void pre_cuMemAllocManaged(struct hold *h, CUdeviceptr *dptr, size_t bytes, unsigned int flags)
{
    (void)h, (void)dptr, (void)bytes, (void)flags;
}
void post_cuMemAllocManaged(CUresult r, struct hold *h, CUdeviceptr *dptr, size_t bytes, unsigned int flags)
{
    (void)h;
    if (r == CUDA_SUCCESS && dptr)
        put_object(R_MEM, K_MANAGED, *dptr, bytes, flags);
}

/* Registered host memory is the program's own; recorded because a restore must register it again. */
void pre_cuMemHostRegister_v2(struct hold *h, void *p, size_t bytes, unsigned int flags)
{
    (void)h, (void)p, (void)bytes, (void)flags;
}
void post_cuMemHostRegister_v2(CUresult r, struct hold *h, void *p, size_t bytes, unsigned int flags)
{
    (void)h;
    if (r == CUDA_SUCCESS)
        put_object(R_HOST, K_HOST_REGISTERED, (uintptr_t)p, bytes, flags);
}
void pre_cuMemHostUnregister(struct hold *h, void *p) { take(h, R_HOST, (uintptr_t)p); }
void post_cuMemHostUnregister(CUresult r, struct hold *h, void *p) { (void)p, put_back(r, h); }

void pre_cuModuleLoadDataEx(struct hold *h, CUmodule *pm, const void *image, unsigned int n, CUjit_option *o, void **v)
{
    (void)h, (void)pm, (void)image, (void)n, (void)o, (void)v;
}
void post_cuModuleLoadDataEx(CUresult r, struct hold *h, CUmodule *pm, const void *image, unsigned int n,
                             CUjit_option *o, void **v)
{
    (void)h, (void)n, (void)o, (void)v;
    if (r == CUDA_SUCCESS && pm && image)
        put_image(R_MODULE, (uintptr_t)*pm, image, NULL);
}

void pre_cuModuleLoadFatBinary(struct hold *h, CUmodule *pm, const void *fatbin) { (void)h, (void)pm, (void)fatbin; }
void post_cuModuleLoadFatBinary(CUresult r, struct hold *h, CUmodule *pm, const void *fatbin)
{
    (void)h;
    if (r == CUDA_SUCCESS && pm && fatbin)
        put_image(R_MODULE, (uintptr_t)*pm, fatbin, NULL);
}

void pre_cuLibraryLoadFromFile(struct hold *h, CUlibrary *pl, const char *path, CUjit_option *jo, void **jv,
                               unsigned int nj, CUlibraryOption *lo, void **lv, unsigned int nl)
{
    (void)h, (void)pl, (void)path, (void)jo, (void)jv, (void)nj, (void)lo, (void)lv, (void)nl;
}
void post_cuLibraryLoadFromFile(CUresult r, struct hold *h, CUlibrary *pl, const char *path, CUjit_option *jo,
                                void **jv, unsigned int nj, CUlibraryOption *lo, void **lv, unsigned int nl)
{
    (void)h, (void)jo, (void)jv, (void)nj, (void)lo, (void)lv, (void)nl;
    if (r == CUDA_SUCCESS && pl && path)
        put_file(R_LIBRARY, (uintptr_t)*pl, path);
}

size_t gputrace_shim_module_image(int kind, unsigned long long handle, void *buf, size_t len)
    __attribute__((visibility("default")));
size_t gputrace_shim_module_image(int kind, unsigned long long handle, void *buf, size_t len)
{
    return reg_copy_image(kind ? R_LIBRARY : R_MODULE, handle, buf, len);
}
