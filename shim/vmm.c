/* cuMemAlloc_v2 served through the VMM API, so device memory can be released and brought back at the
 * same address (`suspend` / `unsuspend` in dump.c).
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
} V;
static atomic_int g_state; /* 0: not looked at, 1: on, -1: off */

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
#undef SYM
    return V.gran && V.reserve && V.addr_free && V.create && V.release && V.map && V.unmap && V.access &&
           V.ctx_device;
}

int vmm_enabled(void)
{
    int s = atomic_load(&g_state);
    if (!s) {
        const char *e = getenv("GPUTRACE_SHIM_VMM");
        s = e && !strcmp(e, "1") ? (load() ? 1 : -1) : -1;
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

/* The wrapper's alternative to the driver's cuMemAlloc_v2; the post hook records the allocation,
 * this one adds what the VMM path needs to the hold for it. */
int alt_cuMemAlloc_v2(CUresult *out, struct hold *h, CUdeviceptr *dptr, size_t bytes)
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
    CUresult r = h->rec.suspended ? CUDA_SUCCESS : V.unmap(dptr, h->rec.reserved);
    if (!r && !h->rec.suspended)
        r = V.release(h->rec.handle);
    if (!r)
        r = V.addr_free(dptr, h->rec.reserved);
    *out = r;
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
