/* Digests of device memory, computed on the device: what lets a checkpoint copy only the chunks that
 * changed since the one before it, and a restore only the chunks that differ from the checkpoint.
 *
 * The kernel (shim/digest.cu, loaded as PTX that the driver compiles for the device at hand) reads
 * each chunk once, at the device's memory bandwidth, and leaves 16 bytes per chunk; those come back
 * to the host and are compared there.  Nothing is inferred from what the program's kernels were
 * launched with: a chunk is unchanged only when its bytes hash the same, whatever wrote them.
 *
 * Everything here runs on the driver's own entry points (never the wrappers), in the contexts the
 * allocations belong to, on streams of its own.  The module and the scratch memory (32 bytes a
 * chunk) are made before the gate closes (loading PTX takes milliseconds the job does not wait
 * for) and let go after it reopens.  Any failure here is no failure of the checkpoint: the caller
 * copies everything instead and says why. */
#include "shim_int.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "digest_ptx.h"

#define DG_THREADS 256
#define DG_MAX_CTX 64

static struct {
    CUresult (*ctx_set)(CUcontext);
    CUresult (*mod_load)(CUmodule *, const void *);
    CUresult (*mod_unload)(CUmodule);
    CUresult (*get_fn)(CUfunction *, CUmodule, const char *);
    CUresult (*launch)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,
                       void **, void **);
    CUresult (*alloc)(CUdeviceptr *, size_t);
    CUresult (*free)(CUdeviceptr);
    CUresult (*h2d)(CUdeviceptr, const void *, size_t, CUstream);
    CUresult (*d2h)(void *, CUdeviceptr, size_t, CUstream);
    CUresult (*stream_create)(CUstream *, unsigned);
    CUresult (*stream_destroy)(CUstream);
    CUresult (*stream_sync)(CUstream);
} D;

static int loaded(void)
{
#define SYM(field, name) *(void **)&D.field = shim_driver_sym(name)
    SYM(ctx_set, "cuCtxSetCurrent");
    SYM(mod_load, "cuModuleLoadData");
    SYM(mod_unload, "cuModuleUnload");
    SYM(get_fn, "cuModuleGetFunction");
    SYM(launch, "cuLaunchKernel");
    SYM(alloc, "cuMemAlloc_v2");
    SYM(free, "cuMemFree_v2");
    SYM(h2d, "cuMemcpyHtoDAsync_v2");
    SYM(d2h, "cuMemcpyDtoHAsync_v2");
    SYM(stream_create, "cuStreamCreate");
    SYM(stream_destroy, "cuStreamDestroy_v2");
    SYM(stream_sync, "cuStreamSynchronize");
#undef SYM
    return D.ctx_set && D.mod_load && D.mod_unload && D.get_fn && D.launch && D.alloc && D.free && D.h2d && D.d2h &&
           D.stream_create && D.stream_destroy && D.stream_sync;
}

struct dg_ctx {
    uint64_t ctx;
    size_t cap; /* chunks its scratch holds */
    CUmodule mod;
    CUfunction fn;
    CUdeviceptr spans, out; /* cap x {address, length}; cap x {digest a, digest b} */
    CUstream s;
};

struct digester {
    struct dg_ctx c[DG_MAX_CTX];
    int nc;
    uint64_t *host; /* staging for one context's spans and digests */
    size_t host_cap;
};

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

void dg_close(struct digester *d)
{
    if (!d)
        return;
    for (int i = 0; i < d->nc; i++) {
        struct dg_ctx *c = &d->c[i];
        D.ctx_set((CUcontext)(uintptr_t)c->ctx);
        if (c->s) {
            D.stream_sync(c->s);
            D.stream_destroy(c->s);
        }
        if (c->spans)
            D.free(c->spans);
        if (c->out)
            D.free(c->out);
        if (c->mod)
            D.mod_unload(c->mod);
    }
    if (d->nc)
        D.ctx_set(NULL);
    free(d->host);
    free(d);
}

struct digester *dg_open(const uint64_t *ctxs, const size_t *caps, int nctx, char *why, size_t wl)
{
    if (!loaded()) {
        snprintf(why, wl, "the driver lacks a function the digest needs");
        return NULL;
    }
    if (nctx > DG_MAX_CTX) {
        snprintf(why, wl, "more than %d contexts", DG_MAX_CTX);
        return NULL;
    }
    struct digester *d = calloc(1, sizeof *d);
    if (!d) {
        snprintf(why, wl, "out of memory");
        return NULL;
    }
    size_t most = 0;
    for (int i = 0; i < nctx; i++) {
        struct dg_ctx *c = &d->c[d->nc++];
        c->ctx = ctxs[i];
        c->cap = caps[i] ? caps[i] : 1;
        most = c->cap > most ? c->cap : most;
        CUresult r;
        const char *what;
        if ((r = D.ctx_set((CUcontext)(uintptr_t)c->ctx)) != CUDA_SUCCESS)
            what = "cuCtxSetCurrent";
        else if ((r = D.mod_load(&c->mod, digest_ptx)) != CUDA_SUCCESS)
            what = "loading the digest kernel (cuModuleLoadData)", c->mod = NULL;
        else if ((r = D.get_fn(&c->fn, c->mod, "gputrace_chunk_digest")) != CUDA_SUCCESS)
            what = "cuModuleGetFunction";
        else if ((r = D.alloc(&c->spans, c->cap * 16)) != CUDA_SUCCESS)
            what = "device memory for the digests (cuMemAlloc)", c->spans = 0;
        else if ((r = D.alloc(&c->out, c->cap * 16)) != CUDA_SUCCESS)
            what = "device memory for the digests (cuMemAlloc)", c->out = 0;
        else if ((r = D.stream_create(&c->s, CU_STREAM_NON_BLOCKING)) != CUDA_SUCCESS)
            what = "cuStreamCreate", c->s = NULL;
        else
            continue;
        snprintf(why, wl, "%s failed: CUresult %d", what, (int)r);
        dg_close(d);
        return NULL;
    }
    D.ctx_set(NULL);
    d->host_cap = most * 2;
    if (!(d->host = malloc(d->host_cap * sizeof *d->host))) {
        snprintf(why, wl, "out of memory");
        dg_close(d);
        return NULL;
    }
    return d;
}

/* Whether `d` holds the `n` chunks of `s`: it was made before the gate closed, for the allocations
 * there were then (none at all where there were none), and the job may have allocated since, more
 * chunks than its scratch holds or in a context made since (whose chunks it would never read). */
int dg_covers(const struct digester *d, const struct dg_span *s, size_t n)
{
    if (!n)
        return 1;
    if (!d)
        return 0;
    size_t m[DG_MAX_CTX] = {0};
    for (size_t i = 0; i < n; i++) {
        int k = 0;
        while (k < d->nc && d->c[k].ctx != s[i].ctx)
            k++;
        if (k == d->nc || ++m[k] > d->c[k].cap)
            return 0;
    }
    return 1;
}

/* The digests of `n` chunks (out: 2n words, in the chunks' order).  Returns NULL, or why not. */
const char *dg_run(struct digester *d, const struct dg_span *s, size_t n, uint64_t *out, uint64_t *ns, char *why,
                   size_t wl)
{
    uint64_t t0 = now_ns();
    const char *fail = NULL;
    *ns = 0;
    if (!n)
        return NULL;
    if (!dg_covers(d, s, n)) { /* (callers check first: this one never runs an outgrown digester, or none) */
        snprintf(why, wl, "the process allocated device memory meanwhile (more chunks than planned, or in a "
                          "context made since)");
        return why;
    }
    for (int k = 0; k < d->nc && !fail; k++) {
        struct dg_ctx *c = &d->c[k];
        size_t m = 0;
        for (size_t i = 0; i < n; i++)
            if (s[i].ctx == c->ctx) {
                if (s[i].ptr % 8) {
                    snprintf(why, wl, "an allocation at %#llx is not 8-byte aligned", (unsigned long long)s[i].ptr);
                    return why;
                }
                d->host[2 * m] = s[i].ptr;
                d->host[2 * m + 1] = s[i].len;
                m++;
            }
        if (!m)
            continue;
        CUresult r;
        uint64_t nn = m;
        void *args[] = {&c->spans, &nn, &c->out};
        if ((r = D.ctx_set((CUcontext)(uintptr_t)c->ctx)) != CUDA_SUCCESS)
            fail = "cuCtxSetCurrent";
        else if ((r = D.h2d(c->spans, d->host, m * 16, c->s)) != CUDA_SUCCESS)
            fail = "cuMemcpyHtoDAsync";
        else if ((r = D.launch(c->fn, (unsigned)m, 1, 1, DG_THREADS, 1, 1, 0, c->s, args, NULL)) != CUDA_SUCCESS)
            fail = "launching the digest kernel";
        else if ((r = D.d2h(d->host, c->out, m * 16, c->s)) != CUDA_SUCCESS)
            fail = "cuMemcpyDtoHAsync";
        else if ((r = D.stream_sync(c->s)) != CUDA_SUCCESS)
            fail = "cuStreamSynchronize";
        if (fail) {
            snprintf(why, wl, "%s failed: CUresult %d", fail, (int)r);
            break;
        }
        m = 0;
        for (size_t i = 0; i < n; i++)
            if (s[i].ctx == c->ctx) {
                out[2 * i] = d->host[2 * m];
                out[2 * i + 1] = d->host[2 * m + 1];
                m++;
            }
    }
    D.ctx_set(NULL);
    *ns = now_ns() - t0;
    return fail ? why : NULL;
}
