/* cuMemAlloc_v2 served through the VMM API, so device memory can be released and brought back at the
 * same address (`suspend` / `unsuspend` in suspend.c).
 *
 * Only with GPUTRACE_SHIM_VMM=1 (`gputrace run --checkpointable --suspendable`): it changes what the
 * program gets.  Each allocation becomes an address reservation, a cuMemCreate handle and a mapping,
 * all rounded up to the allocation granularity (2 MiB on current GPUs and on simcuda), so small
 * allocations cost up to a granule each, and each cuMemAlloc/cuMemFree costs four or three driver
 * calls instead of one.  The memory is ordinary device memory to kernels and copies, but it is VMM
 * memory to the driver: cuIpcGetMemHandle does not accept it, and cuPointerGetAttribute reports it
 * as such.  The calls go to the driver's own entry points, so the registry holds one R_MEM record
 * (with `reserved` and `handle`) rather than the three VMM objects. */
#include "shim_int.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

static struct {
    CUresult (*gran)(size_t *, const CUmemAllocationProp *, CUmemAllocationGranularity_flags);
    CUresult (*reserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
    CUresult (*addr_free)(CUdeviceptr, size_t);
    CUresult (*create)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long);
    CUresult (*release)(CUmemGenericAllocationHandle);
    CUresult (*map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
    CUresult (*unmap)(CUdeviceptr, size_t);
    CUresult (*access)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
    CUresult (*ctx_device)(CUdevice *);
    /* For stream-ordered frees (alt_cuMemFreeAsync): an event marks where the stream frees. */
    CUresult (*ev_create)(CUevent *, unsigned int);
    CUresult (*ev_record)(CUevent, CUstream);
    CUresult (*ev_query)(CUevent);
    CUresult (*ev_sync)(CUevent);
    CUresult (*ev_destroy)(CUevent);
    CUresult (*stream_sync)(CUstream);
    CUresult (*capturing)(CUstream, CUstreamCaptureStatus *);
} V;
static atomic_int g_state; /* 0: not looked at, 1: on, -1: off */
static atomic_int g_api;   /* the same for the VMM API itself, whatever GPUTRACE_SHIM_VMM says */
static atomic_int g_translate; /* a suspension recreated a program's handle: translate from now on */

static int load(void)
{
#define SYM(f, n) *(void **)&V.f = shim_driver_sym(n)
    SYM(gran, "cuMemGetAllocationGranularity");
    SYM(reserve, "cuMemAddressReserve");
    SYM(addr_free, "cuMemAddressFree");
    SYM(create, "cuMemCreate");
    SYM(release, "cuMemRelease");
    SYM(map, "cuMemMap");
    SYM(unmap, "cuMemUnmap");
    SYM(access, "cuMemSetAccess");
    SYM(ctx_device, "cuCtxGetDevice");
    SYM(ev_create, "cuEventCreate");
    SYM(ev_record, "cuEventRecord");
    SYM(ev_query, "cuEventQuery");
    SYM(ev_sync, "cuEventSynchronize");
    SYM(ev_destroy, "cuEventDestroy_v2");
    SYM(stream_sync, "cuStreamSynchronize");
    SYM(capturing, "cuStreamIsCapturing");
#undef SYM
    return V.gran && V.reserve && V.addr_free && V.create && V.release && V.map && V.unmap && V.access &&
           V.ctx_device;
}

int vmm_api(void)
{
    int s = atomic_load(&g_api);
    if (!s) {
        s = load() ? 1 : -1;
        atomic_store(&g_api, s);
    }
    return s > 0;
}

int vmm_enabled(void)
{
    int s = atomic_load(&g_state);
    if (!s) {
        const char *e = getenv("GPUTRACE_SHIM_VMM");
        s = e && !strcmp(e, "1") ? (vmm_api() ? 1 : -1) : -1;
        if (e && !strcmp(e, "1") && s < 0)
            shim_log("GPUTRACE_SHIM_VMM=1 but the driver lacks the VMM API: allocations are not suspendable");
        atomic_store(&g_state, s);
    }
    return s > 0;
}

static CUmemAllocationProp prop_for(int dev)
{
    CUmemAllocationProp p;
    memset(&p, 0, sizeof p);
    p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    p.location.id = dev;
    return p;
}

/* Backing for [va, va + size) on `dev`: create, map, make read-write. */
static CUresult back(CUdeviceptr va, size_t size, int dev, CUmemGenericAllocationHandle *h)
{
    CUmemAllocationProp p = prop_for(dev);
    CUresult r = V.create(h, size, &p, 0);
    if (r)
        return r;
    if ((r = V.map(va, size, 0, *h, 0))) {
        V.release(*h);
        return r;
    }
    CUmemAccessDesc d;
    memset(&d, 0, sizeof d);
    d.location = p.location;
    d.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    if ((r = V.access(va, size, &d, 1))) {
        V.unmap(va, size);
        V.release(*h);
    }
    return r;
}

static int serve(CUresult *out, struct hold *h, CUdeviceptr *dptr, size_t bytes);

/* The wrapper's alternative to the driver's cuMemAlloc_v2; the post hook records the allocation,
 * this one adds what the VMM path needs to the hold for it. */
int alt_cuMemAlloc_v2(CUresult *out, struct hold *h, CUdeviceptr *dptr, size_t bytes)
{
    return serve(out, h, dptr, bytes);
}

/* ------------------------------------------------------------------------------------------------
 * Stream-ordered allocations (cuMemAllocAsync: JAX's and CuPy's async allocators, PyTorch's
 * cudaMallocAsync backend) served the same way, so they can be suspended too. The memory is there
 * when the call returns, which is all stream order asks of an allocation. A free must not take it
 * before the stream reaches the free: an event is recorded on the stream there, and the memory is
 * given back once the event has completed (looked at on each later stream-ordered call and after
 * each synchronization, as the driver's pool gives freed memory back at one, and waited for before
 * a suspension, which must give everything back). Where no event can be had, the free
 * waits for the stream. What this changes for the program: the memory is not from a pool
 * (cuPointerGetAttribute's CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE is not set), rounded up to a granule,
 * and two or three VMM calls an allocation and a free; `bench/shim_gpu.py` measures what they cost. */

#define MAX_PENDING 4096

static struct pending {
    CUdeviceptr va;
    size_t size;
    CUmemGenericAllocationHandle handle;
    CUevent ev;
} g_pending[MAX_PENDING];
static int g_npending;
atomic_int vmm_pending; /* g_npending, for the synchronizations' unlocked look (shim.c) */
static pthread_mutex_t g_pending_lock = PTHREAD_MUTEX_INITIALIZER;

static CUresult give_back(CUdeviceptr va, size_t size, CUmemGenericAllocationHandle handle, int suspended)
{
    CUresult r = suspended ? CUDA_SUCCESS : V.unmap(va, size);
    if (!r && !suspended)
        r = V.release(handle);
    if (!r)
        r = V.addr_free(va, size);
    return r;
}

/* Gives back the memory of the frees whose stream has reached them (`wait`: of every one, waiting
 * for each); returns how many are still pending. */
int vmm_reap(int wait)
{
    pthread_mutex_lock(&g_pending_lock);
    int j = 0;
    for (int i = 0; i < g_npending; i++) {
        struct pending *q = &g_pending[i];
        CUresult e = wait ? V.ev_sync(q->ev) : V.ev_query(q->ev);
        if (e == CUDA_ERROR_NOT_READY) {
            g_pending[j++] = *q;
            continue;
        }
        /* Done (or the event is broken: then the stream is too, and nothing will use the memory). */
        V.ev_destroy(q->ev);
        CUresult r = give_back(q->va, q->size, q->handle, 0);
        if (r)
            shim_log("a stream-ordered free of %#llx: giving its memory back failed (%d)", (unsigned long long)q->va, r);
    }
    g_npending = j;
    atomic_store(&vmm_pending, j);
    pthread_mutex_unlock(&g_pending_lock);
    return j;
}

/* A stream being captured into a graph: its stream-ordered allocations and frees become the graph's
 * memory nodes, made and freed at each replay; served here they would be made once and freed as the
 * capture records the free (its event is no real one), under the graph's next replay. The driver's;
 * a served allocation freed inside a capture is then refused by the driver (not its pointer), which
 * fails the capture loudly rather than free memory the graph goes on using. simcuda has no capture:
 * not tested on CI. */
static int capturing(CUstream s)
{
    CUstreamCaptureStatus st = CU_STREAM_CAPTURE_STATUS_NONE;
    return V.capturing && V.capturing(s, &st) == CUDA_SUCCESS && st != CU_STREAM_CAPTURE_STATUS_NONE;
}

int alt_cuMemAllocAsync(CUresult *out, struct hold *h, CUdeviceptr *dptr, size_t bytes, CUstream s)
{
    if (!vmm_enabled() || capturing(s))
        return 0;
    if (atomic_load_explicit(&vmm_pending, memory_order_relaxed))
        vmm_reap(0);
    return serve(out, h, dptr, bytes);
}

int alt_cuMemAllocAsync_ptsz(CUresult *out, struct hold *h, CUdeviceptr *dptr, size_t bytes, CUstream s)
{
    return alt_cuMemAllocAsync(out, h, dptr, bytes, s);
}

/* From a pool: served the same way, the pool aside (its release threshold, its access for other
 * devices and its export to other processes do not apply to memory the VMM API serves). */
int alt_cuMemAllocFromPoolAsync(CUresult *out, struct hold *h, CUdeviceptr *dptr, size_t bytes, CUmemoryPool pool,
                                CUstream s)
{
    if (!pool)
        return 0; /* the driver's answer to that */
    return alt_cuMemAllocAsync(out, h, dptr, bytes, s);
}

int alt_cuMemAllocFromPoolAsync_ptsz(CUresult *out, struct hold *h, CUdeviceptr *dptr, size_t bytes,
                                     CUmemoryPool pool, CUstream s)
{
    return alt_cuMemAllocFromPoolAsync(out, h, dptr, bytes, pool, s);
}

int alt_cuMemFreeAsync(CUresult *out, struct hold *h, CUdeviceptr dptr, CUstream s)
{
    if (h->found != 1 || !h->rec.reserved || capturing(s))
        return 0;
    if (atomic_load_explicit(&vmm_pending, memory_order_relaxed))
        vmm_reap(0);
    if (h->rec.suspended) { /* nothing behind it to wait for */
        *out = give_back(dptr, h->rec.reserved, h->rec.handle, 1);
        return 1;
    }
    CUevent ev = NULL;
    pthread_mutex_lock(&g_pending_lock);
    int room = g_npending < MAX_PENDING;
    if (room && V.ev_create && V.ev_create(&ev, CU_EVENT_DISABLE_TIMING) == CUDA_SUCCESS) {
        CUresult r = V.ev_record(ev, s);
        if (r == CUDA_SUCCESS) {
            g_pending[g_npending++] = (struct pending){dptr, h->rec.reserved, h->rec.handle, ev};
            atomic_store(&vmm_pending, g_npending);
            pthread_mutex_unlock(&g_pending_lock);
            *out = CUDA_SUCCESS;
            return 1;
        }
        V.ev_destroy(ev);
        if (r == CUDA_ERROR_INVALID_HANDLE || r == CUDA_ERROR_INVALID_VALUE) { /* the program's stream is bad */
            pthread_mutex_unlock(&g_pending_lock);
            *out = r;
            return 1;
        }
    }
    pthread_mutex_unlock(&g_pending_lock);
    CUresult r = V.stream_sync(s); /* no event: the free waits for the stream */
    *out = r ? r : give_back(dptr, h->rec.reserved, h->rec.handle, 0);
    return 1;
}

int alt_cuMemFreeAsync_ptsz(CUresult *out, struct hold *h, CUdeviceptr dptr, CUstream s)
{
    return alt_cuMemFreeAsync(out, h, dptr, s ? s : CU_STREAM_PER_THREAD);
}

/* cuMemAlloc_v2 and cuMemAllocAsync through the VMM API: a reservation, a handle and a mapping. */
static int serve(CUresult *out, struct hold *h, CUdeviceptr *dptr, size_t bytes)
{
    if (!vmm_enabled() || !dptr || !bytes)
        return 0; /* the driver's own answer, errors included */
    CUdevice dev;
    if (V.ctx_device(&dev) != CUDA_SUCCESS)
        return 0;
    CUmemAllocationProp p = prop_for(dev);
    size_t g = 0;
    if (V.gran(&g, &p, CU_MEM_ALLOC_GRANULARITY_MINIMUM) != CUDA_SUCCESS || !g)
        return 0;
    size_t size = (bytes + g - 1) / g * g;
    CUdeviceptr va;
    CUmemGenericAllocationHandle mh = 0;
    CUresult r = V.reserve(&va, size, g, 0, 0);
    if (!r && (r = back(va, size, dev, &mh)))
        V.addr_free(va, size);
    if (!r) {
        *dptr = va;
        h->rec.handle = mh;
        h->rec.reserved = size;
        h->found = 2; /* tells post_cuMemAlloc_v2 */
    }
    *out = r;
    return 1;
}

int alt_cuMemFree_v2(CUresult *out, struct hold *h, CUdeviceptr dptr)
{
    if (h->found != 1 || !h->rec.reserved)
        return 0;
    *out = give_back(dptr, h->rec.reserved, h->rec.handle, h->rec.suspended);
    return 1;
}

CUresult vmm_release(struct rec *r)
{
    CUresult e = V.unmap(r->key, r->reserved);
    if (!e)
        e = V.release(r->handle);
    if (!e) {
        r->handle = 0;
        r->suspended = 1;
    }
    return e;
}

CUresult vmm_remap(struct rec *r)
{
    CUmemGenericAllocationHandle h;
    CUresult e = back(r->key, r->reserved, r->device, &h);
    if (!e) {
        r->handle = h;
        r->suspended = 0;
    }
    return e;
}

/* ------------------------------------------------------------------------------------------------
 * The program's own VMM memory (cuMemCreate, cuMemMap, cuMemSetAccess: PyTorch's expandable
 * segments, XLA's allocator).  `suspend` unmaps each mapping and releases each physical allocation,
 * keeping the program's address reservations; `unsuspend` creates each allocation again with the
 * same properties and maps it at the same addresses and offsets.  The driver then hands out new
 * handles, while the program still holds the old ones: the registry's R_PHYS record, keyed by the
 * program's handle, holds the driver's in `handle`, and every call that takes a handle goes
 * through it once a suspension has recreated one (before that, the two are always equal and
 * nothing is looked up). */

CUresult vmm_own_unmap(const struct rec *m) { return V.unmap(m->key, m->size); }
CUresult vmm_own_release(const struct rec *p) { return V.release(p->handle); }

CUresult vmm_own_create(struct rec *p)
{
    CUmemGenericAllocationHandle h;
    CUresult e = V.create(&h, p->size, &p->prop, 0);
    if (!e)
        p->handle = h;
    return e;
}

/* Mapped at the same address and offset; made writable (for the copy back, before the program's
 * own access flags are put back with vmm_own_access) when `writable`. */
CUresult vmm_own_map(const struct rec *m, uint64_t driver_handle, int writable)
{
    CUresult e = V.map(m->key, m->size, m->offset, driver_handle, 0);
    if (e || !writable || m->nacc <= 0)
        return e;
    CUmemAccessDesc d[REC_ACC];
    for (int i = 0; i < m->nacc; i++) {
        d[i] = m->acc[i];
        d[i].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    }
    if ((e = V.access(m->key, m->size, d, (size_t)m->nacc)))
        V.unmap(m->key, m->size);
    return e;
}

CUresult vmm_own_access(const struct rec *m)
{
    int rw = 1;
    for (int i = 0; i < m->nacc; i++)
        rw &= m->acc[i].flags == CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    return m->nacc <= 0 || rw ? CUDA_SUCCESS : V.access(m->key, m->size, m->acc, (size_t)m->nacc);
}

void vmm_translating(void) { atomic_store(&g_translate, 1); }

static int translated(uint64_t prog, uint64_t *drv)
{
    struct rec p;
    if (LIKELY(!atomic_load_explicit(&g_translate, memory_order_relaxed)) || !reg_get(R_PHYS, prog, &p) ||
        p.handle == prog)
        return 0;
    *drv = p.handle;
    return 1;
}

int alt_cuMemMap(CUresult *out, struct hold *h, CUdeviceptr ptr, size_t size, size_t offset,
                 CUmemGenericAllocationHandle hd, unsigned long long fl)
{
    (void)h;
    uint64_t drv;
    if (!translated(hd, &drv))
        return 0;
    CUresult (*f)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long) =
        (__typeof__(f))shim_real(F_cuMemMap);
    *out = f ? f(ptr, size, offset, drv, fl) : CUDA_ERROR_NOT_FOUND;
    return 1;
}

/* pre_cuMemRelease took the record out (or counted a retain off it): its `handle` is the driver's. */
int alt_cuMemRelease(CUresult *out, struct hold *h, CUmemGenericAllocationHandle hd)
{
    if (!h->found || h->rec.handle == hd)
        return 0;
    CUresult (*f)(CUmemGenericAllocationHandle) = (__typeof__(f))shim_real(F_cuMemRelease);
    *out = f ? f(h->rec.handle) : CUDA_ERROR_NOT_FOUND;
    return 1;
}

static uint64_t fresh_value(uint64_t drv);

/* A new allocation after a suspension: the driver may hand out a value the program already holds
 * for an allocation that was recreated (its old handle, since released to the driver).  The
 * program then gets a value of its own, which no live record uses. */
int alt_cuMemCreate(CUresult *out, struct hold *h, CUmemGenericAllocationHandle *hd, size_t size,
                    const CUmemAllocationProp *prop, unsigned long long fl)
{
    if (LIKELY(!atomic_load_explicit(&g_translate, memory_order_relaxed)) || !hd)
        return 0;
    CUresult (*f)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long) =
        (__typeof__(f))shim_real(F_cuMemCreate);
    CUmemGenericAllocationHandle drv = 0;
    *out = f ? f(&drv, size, prop, fl) : CUDA_ERROR_NOT_FOUND;
    if (*out != CUDA_SUCCESS)
        return 1;
    *hd = fresh_value(drv);
    h->rec.handle = drv;
    h->found = 3; /* tells post_cuMemCreate: the program's value differs from the driver's */
    return 1;
}

/* A value no live R_PHYS record has as the program's, near `drv`. */
static uint64_t fresh_value(uint64_t drv)
{
    struct rec x;
    uint64_t v = drv;
    for (uint64_t n = 1; reg_get(R_PHYS, v, &x); n++)
        v = (drv ^ 0x8000000000000000ull) + n * 0x1000;
    return v;
}

struct by_driver {
    uint64_t drv, key;
    int found;
};

static int find_driver(struct rec *r, void *arg)
{
    struct by_driver *b = arg;
    if (!b->found && r->handle == b->drv) {
        b->found = 1;
        b->key = r->key;
        r->refs++;
    }
    return 0;
}

static void count_ref(struct rec *r, void *arg) { (void)arg, r->refs++; }

/* cuMemRetainAllocationHandle hands out the driver's handle; the program gets the value it knows the
 * allocation by, and the record counts the retain (one more cuMemRelease to come).  An allocation the
 * program had released while mapped has no record: once handles are translated, its driver value may
 * be one the program holds for another allocation, and then the program gets a value of its own (its
 * record, of unknown properties, makes `suspend` refuse rather than guess). */
uint64_t vmm_retained(uint64_t drv)
{
    if (LIKELY(!atomic_load_explicit(&g_translate, memory_order_relaxed))) {
        reg_update(R_PHYS, drv, count_ref, NULL);
        return drv;
    }
    struct by_driver b = {.drv = drv};
    reg_scan(R_PHYS, find_driver, &b);
    if (b.found)
        return b.key;
    struct rec x;
    if (!reg_get(R_PHYS, drv, &x))
        return drv;
    struct rec p = {.type = R_PHYS, .kind = K_VMM_PHYS, .key = fresh_value(drv), .handle = drv};
    reg_put(&p);
    return p.key;
}

int alt_cuMemExportToShareableHandle(CUresult *out, struct hold *h, void *sh, CUmemGenericAllocationHandle hd,
                                     CUmemAllocationHandleType t, unsigned long long fl)
{
    (void)h;
    uint64_t drv;
    if (!translated(hd, &drv))
        return 0;
    CUresult (*f)(void *, CUmemGenericAllocationHandle, CUmemAllocationHandleType, unsigned long long) =
        (__typeof__(f))shim_real(F_cuMemExportToShareableHandle);
    *out = f ? f(sh, drv, t, fl) : CUDA_ERROR_NOT_FOUND;
    return 1;
}

int vmm_translate_handle(uint64_t h, uint64_t *drv, CUmemAllocationProp *prop)
{
    struct rec p;
    if (LIKELY(!atomic_load_explicit(&g_translate, memory_order_relaxed)) || !reg_get(R_PHYS, h, &p))
        return 0;
    if (p.suspended && p.size) {
        if (prop)
            *prop = p.prop;
        return 1;
    }
    *drv = p.handle;
    return 0;
}
