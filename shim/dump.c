/* Device memory out of the process and back: what `dump` and `restore` on the control socket do.
 *
 * Where the data goes.  The checkpointer hands the shim a file: an fd passed with the command
 * (SCM_RIGHTS; the checkpointer's memfd, so nothing is left behind if either side dies) or a path
 * it names.  The shim writes an *image* into it with pwrite (no mmap: a full filesystem is an
 * ENOSPC reply, never a SIGBUS in the job):
 *     header  {magic "GPUTRACE-IMG-2\n\0", u64 count, u64 data_offset, u64 data_bytes, u64 chunk,
 *              u64 digest_chunk, u64 digest_offset, u64 digest_count, u64 held_offset, u64 flags}
 *     entries count x {u64 base, u64 size, u64 offset, i32 device, i32 kind}
 *     digests digest_count x {u64 a, u64 b} at digest_offset: each allocation's chunks of digest_chunk
 *             bytes in turn, the last of each allocation shorter (digest.c; none where digest_chunk is 0)
 *     held    flags & PARTIAL: digest_count bytes at held_offset, 1 where this image holds the chunk's
 *             data; the others are the same as in the base image the dump was given (base=1)
 *     data    each allocation at its `offset` (4 KiB aligned) in the file
 * `restore` reads the same format back (and version 1's, which ends after `chunk` and has no
 * digests), but never a partial image: the checkpointer puts a chain together first.  A full image
 * is the checkpoint's data file byte for byte, so the checkpointer only hashes and stores it after
 * the gate has reopened.
 *
 * What changed.  With digests (digest=BYTES, the default), a dump hashes every chunk on the device
 * under the gate; given the digests of an earlier image (base=1: the fd then holds that image's
 * header, entries and digests), it copies only the chunks whose digest differs.  A restore of an
 * image with digests hashes the live memory the same way and copies only the chunks that differ
 * (diff=0: everything).
 *
 * How it moves.  Gate closed and every context synchronized (within the command's timeout=, as the
 * pause: work that cannot finish gives the job back instead of holding it), the allocations are cut into chunks
 * that `lanes` threads take in turn; each lane owns two pinned staging buffers and two streams and
 * alternates between them, so one chunk's DMA overlaps the previous chunk's pwrite (or, restoring,
 * the next chunk's pread overlaps the current DMA), and lanes overlap each other.  Staging memory
 * is pinned before the gate closes, so pinning costs the job nothing.  The gate reopens as soon as
 * the last chunk is in the file (or on the device) and before the reply is sent: whatever goes
 * wrong afterwards (a client gone, a reply that cannot be sent) cannot leave the job stopped.
 *
 * Everything here calls the driver's own entry points (never the wrappers, which would wait at the
 * gate this code closed); staging buffers and streams are therefore not in the registry either. */
#include "shim_int.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define IMG_MAGIC "GPUTRACE-IMG-2\n" /* 15 chars + NUL = 16 bytes */
#define IMG_MAGIC_V1 "GPUTRACE-IMG-1\n"
#define IMG_V1_HDR 48u /* version 1's header: up to `chunk` */
#define IMG_PARTIAL 1u
#define IMG_ALIGN 4096u
#define MAX_LANES 16
#define MIN_CHUNK (64u << 10)
#define MAX_CHUNK (1u << 30)
#define DIGEST_DEFAULT (1u << 20)

struct img_hdr {
    char magic[16];
    uint64_t count, data_offset, data_bytes, chunk;
    uint64_t digest_chunk, digest_offset, digest_count, held_offset, flags;
};
struct img_ent {
    uint64_t base, size, offset;
    int32_t device, kind;
};

/* The driver's functions, looked up by name on the driver's handle. */
static struct drv {
    CUresult (*ctx_set)(CUcontext);
    CUresult (*ctx_sync)(void);
    CUresult (*stream_create)(CUstream *, unsigned);
    CUresult (*stream_destroy)(CUstream);
    CUresult (*stream_sync)(CUstream);
    CUresult (*host_alloc)(void **, size_t, unsigned);
    CUresult (*host_free)(void *);
    CUresult (*d2h)(void *, CUdeviceptr, size_t, CUstream);
    CUresult (*h2d)(CUdeviceptr, const void *, size_t, CUstream);
    CUresult (*version)(int *);
    CUresult (*dev_name)(char *, int, CUdevice);
    CUresult (*dev_uuid)(CUuuid *, CUdevice);
    CUresult (*host_register)(void *, size_t, unsigned);
    CUresult (*host_unregister)(void *);
} D;

static int drv_load(void)
{
#define SYM(field, name) *(void **)&D.field = shim_driver_sym(name)
    SYM(ctx_set, "cuCtxSetCurrent");
    SYM(ctx_sync, "cuCtxSynchronize");
    SYM(stream_create, "cuStreamCreate");
    SYM(stream_destroy, "cuStreamDestroy_v2");
    SYM(stream_sync, "cuStreamSynchronize");
    SYM(host_alloc, "cuMemHostAlloc");
    SYM(host_free, "cuMemFreeHost");
    SYM(d2h, "cuMemcpyDtoHAsync_v2");
    SYM(h2d, "cuMemcpyHtoDAsync_v2");
    SYM(version, "cuDriverGetVersion");
    SYM(dev_name, "cuDeviceGetName");
    SYM(dev_uuid, "cuDeviceGetUuid");
    SYM(host_register, "cuMemHostRegister_v2");
    SYM(host_unregister, "cuMemHostUnregister");
#undef SYM
    return D.ctx_set && D.ctx_sync && D.stream_create && D.stream_destroy && D.stream_sync && D.host_alloc &&
           D.host_free && D.d2h && D.h2d;
}

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* ------------------------------------------------------------------------------------------------
 * What is saved: device memory the program can address.  Plain, pitched, stream-ordered and managed
 * allocations, and VMM mappings the program has made readable (the data of a cuMemCreate handle is
 * reached through its mappings; a handle mapped nowhere cannot be read and is counted as skipped). */

struct item {
    uint64_t base, size, off, ctx, reserved;
    int device, kind;
};

struct collect {
    struct item *v;
    int n, cap, oom, skipped;
    uint64_t ctxs[64]; /* contexts seen, and the device of each */
    int ctx_dev[64], nctx;
};

static int c_ctx(struct rec *r, void *arg)
{
    struct collect *c = arg;
    if (c->nctx < 64) {
        c->ctx_dev[c->nctx] = r->device;
        c->ctxs[c->nctx++] = r->key;
    }
    return 0;
}

static int c_alloc(struct rec *r, void *arg)
{
    struct collect *c = arg;
    if (r->type == R_PHYS) {
        c->skipped++; /* counted back out below for each mapping found */
        return 0;
    }
    if (r->type != R_MEM && !(r->type == R_MAP && (r->access & CU_MEM_ACCESS_FLAGS_PROT_READ)))
        return 0;
    if (c->n == c->cap) {
        int cap = c->cap ? c->cap * 2 : 64;
        struct item *v = realloc(c->v, (size_t)cap * sizeof *v);
        if (!v) {
            c->oom = 1;
            return 0;
        }
        c->v = v;
        c->cap = cap;
    }
    c->v[c->n++] = (struct item){.base = r->key, .size = r->size, .ctx = r->ctx, .device = r->device, .kind = r->kind,
                                 .reserved = r->type == R_MEM ? r->reserved : 0};
    if (r->type == R_MAP)
        c->skipped--;
    return 0;
}

static int by_base(const void *a, const void *b)
{
    const struct item *x = a, *y = b;
    return x->base < y->base ? -1 : x->base > y->base;
}

/* The live allocations, in address order, each with a context to copy it in. */
static int collect(struct collect *c)
{
    memset(c, 0, sizeof *c);
    reg_scan(R_CTX, c_ctx, c);
    reg_scan(0, c_alloc, c);
    if (c->oom)
        return -1;
    if (c->skipped < 0)
        c->skipped = 0;
    qsort(c->v, (size_t)c->n, sizeof *c->v, by_base);
    for (int i = 0; i < c->n; i++)
        if (!c->v[i].ctx)
            for (int k = 0; k < c->nctx; k++)
                if (c->ctx_dev[k] == c->v[i].device) {
                    c->v[i].ctx = c->ctxs[k];
                    break;
                }
    return 0;
}

static uint64_t round_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

/* ------------------------------------------------------------------------------------------------
 * The copy engine */

struct piece {
    uint64_t dev, off, len, ctx;
    char *host; /* kept pinned memory to copy to or from directly (NULL: the image map, else staging) */
};

struct job {
    int restore, fd;
    char *map; /* direct=1: the image mapped and registered with the driver; copies go straight to it */
    struct piece *p;
    size_t np;
    size_t chunk;
    atomic_size_t next;
    atomic_int failed;
    char err[160];
    pthread_mutex_t err_mu;
};

struct lane {
    struct job *j;
    void *buf[2];
    pthread_t t;
};

static void job_fail(struct job *j, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void job_fail(struct job *j, const char *fmt, ...)
{
    pthread_mutex_lock(&j->err_mu);
    if (!atomic_exchange(&j->failed, 1)) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(j->err, sizeof j->err, fmt, ap);
        va_end(ap);
    }
    pthread_mutex_unlock(&j->err_mu);
}

static int io_all(int restore, int fd, void *buf, size_t n, uint64_t off)
{
    char *p = buf;
    while (n) {
        ssize_t r = restore ? pread(fd, p, n, (off_t)off) : pwrite(fd, p, n, (off_t)off);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0)
            return errno;
        if (r == 0)
            return restore ? EIO : ENOSPC; /* a short file; a write that makes no progress */
        p += r;
        n -= (size_t)r;
        off += (uint64_t)r;
    }
    return 0;
}

#define DRV(call, what, ...)                                                                                     \
    do {                                                                                                         \
        CUresult r_ = (call);                                                                                    \
        if (r_ != CUDA_SUCCESS) {                                                                                \
            job_fail(j, "driver: " what " failed: CUresult %d", ##__VA_ARGS__, (int)r_);                          \
            goto out;                                                                                            \
        }                                                                                                        \
    } while (0)

static void *lane_run(void *arg)
{
    struct lane *L = arg;
    struct job *j = L->j;
    CUstream s[2] = {NULL, NULL};
    uint64_t ctx = 0;
    size_t pend[2] = {(size_t)-1, (size_t)-1}; /* dump: piece whose data sits in buf[b] */
    int b = 0;
    for (;;) {
        size_t i = atomic_load(&j->failed) ? j->np : atomic_fetch_add(&j->next, 1);
        int done = i >= j->np;
        if (done || j->p[i].ctx != ctx) {
            /* Drain what this lane has in flight before it leaves or changes context. */
            for (int x = 0; x < 2; x++) {
                if (s[x])
                    DRV(D.stream_sync(s[x]), "cuStreamSynchronize");
                if (!j->restore && pend[x] != (size_t)-1) {
                    struct piece *q = &j->p[pend[x]];
                    int e = io_all(0, j->fd, L->buf[x], q->len, q->off);
                    if (e) {
                        job_fail(j, "writing the image: %s", strerror(e));
                        goto out;
                    }
                    pend[x] = (size_t)-1;
                }
            }
            if (done)
                break;
            for (int k = 0; k < 2; k++)
                if (s[k]) {
                    D.stream_destroy(s[k]);
                    s[k] = NULL;
                }
            ctx = j->p[i].ctx;
            DRV(D.ctx_set((CUcontext)(uintptr_t)ctx), "cuCtxSetCurrent");
            DRV(D.stream_create(&s[0], CU_STREAM_NON_BLOCKING), "cuStreamCreate");
            DRV(D.stream_create(&s[1], CU_STREAM_NON_BLOCKING), "cuStreamCreate");
        }
        struct piece *p = &j->p[i];
        if (p->host || j->map) { /* no staging, no CPU copy: the DMA engine reads or writes pinned memory */
            char *h = p->host ? p->host : j->map + p->off;
            if (j->restore)
                DRV(D.h2d((CUdeviceptr)p->dev, h, p->len, s[b]), "cuMemcpyHtoDAsync(%#llx, %llu)",
                    (unsigned long long)p->dev, (unsigned long long)p->len);
            else
                DRV(D.d2h(h, (CUdeviceptr)p->dev, p->len, s[b]), "cuMemcpyDtoHAsync(%#llx, %llu)",
                    (unsigned long long)p->dev, (unsigned long long)p->len);
            b ^= 1;
            continue;
        }
        if (!j->restore && pend[b] != (size_t)-1) { /* buf[b] still holds a piece not written yet */
            DRV(D.stream_sync(s[b]), "cuStreamSynchronize");
            struct piece *q = &j->p[pend[b]];
            int e = io_all(0, j->fd, L->buf[b], q->len, q->off);
            if (e) {
                job_fail(j, "writing the image: %s", strerror(e));
                goto out;
            }
            pend[b] = (size_t)-1;
        }
        if (j->restore) {
            DRV(D.stream_sync(s[b]), "cuStreamSynchronize"); /* buf[b]'s last upload is done */
            int e = io_all(1, j->fd, L->buf[b], p->len, p->off);
            if (e) {
                job_fail(j, "reading the image: %s", e == EIO ? "file too short" : strerror(e));
                goto out;
            }
            DRV(D.h2d((CUdeviceptr)p->dev, L->buf[b], p->len, s[b]), "cuMemcpyHtoDAsync(%#llx, %llu)",
                (unsigned long long)p->dev, (unsigned long long)p->len);
        } else {
            DRV(D.d2h(L->buf[b], (CUdeviceptr)p->dev, p->len, s[b]), "cuMemcpyDtoHAsync(%#llx, %llu)",
                (unsigned long long)p->dev, (unsigned long long)p->len);
            pend[b] = i;
            int o = b ^ 1; /* meanwhile, write out the other buffer */
            if (pend[o] != (size_t)-1) {
                DRV(D.stream_sync(s[o]), "cuStreamSynchronize");
                struct piece *q = &j->p[pend[o]];
                int e = io_all(0, j->fd, L->buf[o], q->len, q->off);
                if (e) {
                    job_fail(j, "writing the image: %s", strerror(e));
                    goto out;
                }
                pend[o] = (size_t)-1;
            }
        }
        b ^= 1;
    }
out:
    for (int k = 0; k < 2; k++)
        if (s[k]) {
            D.stream_sync(s[k]); /* never free a buffer a copy still uses */
            D.stream_destroy(s[k]);
        }
    D.ctx_set(NULL);
    return NULL;
}

/* Runs the job on `nl` lanes whose buffers are already pinned. */
static void job_run(struct job *j, struct lane *L, int nl)
{
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old); /* the lanes inherit it: signals belong to the program */
    int started = 0;
    for (int i = 0; i < nl; i++) {
        L[i].j = j;
        if (pthread_create(&L[i].t, NULL, lane_run, &L[i]) != 0)
            break;
        started++;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (!started) {
        job_fail(j, "cannot start copy threads");
        return;
    }
    for (int i = 0; i < started; i++)
        pthread_join(L[i].t, NULL);
}

/* ------------------------------------------------------------------------------------------------
 * Suspension: between `suspend` and `unsuspend` the gate stays closed (owned by no connection), the
 * image stays open here, and the VMM-served allocations have no memory behind their addresses; nor
 * have the program's own VMM mappings (their allocations released, the reservations kept). */

/* The suspended image: the gate knows whether the job is suspended (gate_suspended()); this is where
 * its data wait.  A direct suspension keeps its image mapped and pinned until unsuspend, so that
 * bringing the data back is the bus's time alone (pinning 16 GiB takes seconds; the job waits
 * through all of resume). */
static struct {
    int fd;
    uint64_t since_ns;
    char *map;
    uint64_t len, ctx;
    int kept; /* the image is the shim's own kept one (K.simg): kept again at unsuspend, not freed */
} S = {.fd = -1};

struct vmm_walk {
    int remap; /* 0: release the backing of live allocations; 1: map new backing for released ones */
    CUresult err;
    uint64_t at;
    uint64_t bytes;
};

static int vmm_walk(struct rec *r, void *arg)
{
    struct vmm_walk *w = arg;
    if (w->err || !r->reserved || r->suspended != w->remap)
        return 0;
    CUresult e = w->remap ? vmm_remap(r) : vmm_release(r);
    if (e) {
        w->err = e;
        w->at = r->key;
    } else {
        w->bytes += r->reserved;
    }
    return 0;
}

/* Every suspended allocation gets memory again (or, on failure, none does). */
static CUresult remap_all(uint64_t *at)
{
    struct vmm_walk w = {.remap = 1};
    reg_scan(R_MEM, vmm_walk, &w);
    if (w.err) {
        struct vmm_walk undo = {.remap = 0};
        reg_scan(R_MEM, vmm_walk, &undo);
        *at = w.at;
    }
    return w.err;
}

/* The program's own VMM memory (see vmm.c): copies of its R_PHYS and R_MAP records, taken with the
 * gate closed (nothing can change them then), changed here and written back one by one, so that the
 * registry always says what was released and what was made again. */
struct own {
    struct rec *p, *m;
    int np, nm, capp, capm, oom;
};

static int own_add(struct rec *r, void *arg)
{
    struct own *o = arg;
    struct rec **v = r->type == R_PHYS ? &o->p : &o->m;
    int *n = r->type == R_PHYS ? &o->np : &o->nm, *cap = r->type == R_PHYS ? &o->capp : &o->capm;
    if (*n == *cap) {
        int c = *cap ? *cap * 2 : 16;
        struct rec *x = realloc(*v, (size_t)c * sizeof *x);
        if (!x) {
            o->oom = 1;
            return 0;
        }
        *v = x, *cap = c;
    }
    (*v)[(*n)++] = *r;
    return 0;
}

static void own_free(struct own *o)
{
    free(o->p);
    free(o->m);
    memset(o, 0, sizeof *o);
}

static int own_snap(struct own *o)
{
    memset(o, 0, sizeof *o);
    reg_scan(R_PHYS, own_add, o);
    reg_scan(R_MAP, own_add, o);
    return o->oom ? -1 : 0;
}

static struct rec *own_phys(struct own *o, uint64_t prog_handle)
{
    for (int i = 0; i < o->np; i++)
        if (o->p[i].key == prog_handle)
            return &o->p[i];
    return NULL;
}

static int by_offset(const void *a, const void *b)
{
    const uint64_t *x = a, *y = b;
    return x[0] < y[0] ? -1 : x[0] > y[0];
}

/* NULL when every physical allocation can be made again and its data copied: it is wholly covered
 * by mappings the program made readable, each mapping has a record of its allocation and access. */
static const char *own_check(struct own *o, char *err, size_t len)
{
    if (o->np && !vmm_api())
        return "the driver lacks the VMM API the program's own allocations need";
    for (int i = 0; i < o->nm; i++) {
        struct rec *m = &o->m[i];
        struct rec *p = own_phys(o, m->handle);
        if (!p || !p->size) {
            snprintf(err, len, "the program's VMM mapping at %#llx maps a physical allocation the shim has no "
                     "record of (released by the program while mapped, or imported from another process), "
                     "which cannot be made again", (unsigned long long)m->key);
            return err;
        }
        if (m->nacc < 0) {
            snprintf(err, len, "the program's VMM mapping at %#llx has access set for more than %d devices",
                     (unsigned long long)m->key, REC_ACC);
            return err;
        }
    }
    for (int i = 0; i < o->np; i++) {
        struct rec *p = &o->p[i];
        if (p->exported || !p->size) {
            snprintf(err, len, "the program's VMM physical allocation %#llx %s, so it cannot be released and made "
                     "again", (unsigned long long)p->key, p->exported ? "was exported (cuMemExportToShareableHandle) "
                     "and another process may hold it" : "has properties the shim does not know");
            return err;
        }
        uint64_t (*r)[2] = calloc((size_t)o->nm + 1, sizeof *r);
        if (!r)
            return "out of memory";
        int n = 0;
        for (int k = 0; k < o->nm; k++)
            if (o->m[k].handle == p->key && (o->m[k].access & CU_MEM_ACCESS_FLAGS_PROT_READ))
                r[n][0] = o->m[k].offset, r[n][1] = o->m[k].offset + o->m[k].size, n++;
        qsort(r, (size_t)n, sizeof *r, by_offset);
        uint64_t covered = 0;
        for (int k = 0; k < n && r[k][0] <= covered; k++)
            if (r[k][1] > covered)
                covered = r[k][1];
        free(r);
        if (covered < p->size) {
            snprintf(err, len, "the program's VMM physical allocation %#llx (%llu bytes) is not wholly mapped "
                     "readable (%llu bytes from offset 0 are), so its data cannot be copied out; map it "
                     "(cuMemMap, cuMemSetAccess) or release it before suspending",
                     (unsigned long long)p->key, (unsigned long long)p->size, (unsigned long long)covered);
            return err;
        }
    }
    return NULL;
}

/* Unmaps every mapping and releases every allocation not yet released (stopping at the first failure,
 * in *at).  Returns the bytes given back to the driver in *bytes. */
static CUresult own_release_all(struct own *o, uint64_t *at, uint64_t *bytes)
{
    for (int i = 0; i < o->nm; i++) {
        struct rec *m = &o->m[i];
        if (m->suspended)
            continue;
        CUresult e = vmm_own_unmap(m);
        if (e) {
            *at = m->key;
            return e;
        }
        m->suspended = 1;
        reg_put(m);
    }
    for (int i = 0; i < o->np; i++) {
        struct rec *p = &o->p[i];
        if (p->suspended)
            continue;
        CUresult e = vmm_own_release(p);
        if (e) {
            *at = p->key;
            return e;
        }
        p->suspended = 1;
        vmm_translating(); /* the program's handle has no driver handle behind it now */
        reg_put(p);
        *bytes += p->size;
    }
    return CUDA_SUCCESS;
}

/* Every released allocation made again and every mapping mapped again (writable, for the copy back);
 * on failure, what this call made is released again (all stays suspended). */
static CUresult own_remap_all(struct own *o, uint64_t *at, int undo)
{
    CUresult e = CUDA_SUCCESS;
    for (int i = 0; i < o->np && !e; i++) {
        struct rec *p = &o->p[i];
        if (!p->suspended)
            continue;
        if ((e = vmm_own_create(p))) {
            *at = p->key;
            break;
        }
        p->suspended = 0;
        vmm_translating();
        reg_put(p);
    }
    for (int i = 0; i < o->nm && !e; i++) {
        struct rec *m = &o->m[i];
        if (!m->suspended)
            continue;
        if ((e = vmm_own_map(m, own_phys(o, m->handle)->handle, 1))) {
            *at = m->key;
            break;
        }
        m->suspended = 0;
        reg_put(m);
    }
    if (e && undo) {
        uint64_t at2, b = 0;
        own_release_all(o, &at2, &b);
    }
    return e;
}

/* After the copy back: the access each mapping had from the program. */
static void own_access_all(struct own *o)
{
    for (int i = 0; i < o->nm; i++) {
        CUresult e = vmm_own_access(&o->m[i]);
        if (e)
            shim_log("resume: setting the program's access to its mapping at %#llx failed: CUresult %d (it stays "
                     "readable and writable)", (unsigned long long)o->m[i].key, (int)e);
    }
}

/* ------------------------------------------------------------------------------------------------
 * The commands */

struct opts {
    int direct;
    int lanes;
    size_t chunk;
    int timeout_ms;
    uint64_t digest; /* bytes each digest covers; 0: no digests */
    int base;        /* dump: the fd holds the base image's header, entries and digests */
    int diff;        /* restore: copy only the chunks whose digest differs */
    int stage;       /* only prepare (map and pin the image, load the digests) and keep it for the next command */
    uint64_t pin_cap; /* the most pinned memory kept between commands (0: the default) */
    int keep;         /* suspend: into the shim's own image, kept mapped and pinned for the next suspension */
};

/* "lanes=N chunk=BYTES timeout=MS PATH" in any order; returns the path or NULL; -1 on a bad word. */
static int parse_opts(char *args, struct opts *o, char **path)
{
    *o = (struct opts){.lanes = 4, .chunk = 8u << 20, .timeout_ms = 5000, .digest = DIGEST_DEFAULT, .diff = 1};
    *path = NULL;
    for (char *save = NULL, *w = strtok_r(args, " ", &save); w; w = strtok_r(NULL, " ", &save)) {
        char *end;
        if (!strncmp(w, "lanes=", 6)) {
            long v = strtol(w + 6, &end, 10);
            if (*end || v < 1 || v > MAX_LANES)
                return -1;
            o->lanes = (int)v;
        } else if (!strncmp(w, "chunk=", 6)) {
            unsigned long long v = strtoull(w + 6, &end, 10);
            if (*end || v < MIN_CHUNK || v > MAX_CHUNK || v % IMG_ALIGN)
                return -1;
            o->chunk = (size_t)v;
        } else if (!strcmp(w, "direct=1") || !strcmp(w, "direct=0")) {
            o->direct = w[7] == '1';
        } else if (!strncmp(w, "digest=", 7)) {
            unsigned long long v = strtoull(w + 7, &end, 10);
            if (*end || w[7] == '-' || (v && (v < MIN_CHUNK || v > MAX_CHUNK || v % IMG_ALIGN)))
                return -1;
            o->digest = v;
        } else if (!strcmp(w, "base=1") || !strcmp(w, "base=0")) {
            o->base = w[5] == '1';
        } else if (!strcmp(w, "diff=1") || !strcmp(w, "diff=0")) {
            o->diff = w[5] == '1';
        } else if (!strcmp(w, "stage=1")) {
            o->stage = 1;
        } else if (!strcmp(w, "keep=1")) {
            o->keep = 1;
        } else if (!strncmp(w, "pin_cap=", 8)) {
            unsigned long long v = strtoull(w + 8, &end, 10);
            if (*end || w[8] == '-' || !v)
                return -1;
            o->pin_cap = v;
        } else if (!strncmp(w, "timeout=", 8)) {
            long v = strtol(w + 8, &end, 10);
            if (*end || v < 0 || v > 600000)
                return -1;
            o->timeout_ms = (int)v;
        } else if (w[0] == '/' && !*path) {
            *path = w;
        } else {
            return -1;
        }
    }
    return 0;
}

static void json_err(struct sbuf *b, const char *err, const char *detail)
{
    sb_printf(b, "{\"ok\": false, \"error\": \"%s\"", err);
    if (detail) {
        sb_printf(b, ", \"detail\": \"");
        for (const char *c = detail; *c; c++)
            if (*c == '"' || *c == '\\')
                sb_printf(b, "\\%c", *c);
            else
                sb_printf(b, "%c", (unsigned char)*c < 0x20 ? '?' : *c);
        sb_printf(b, "\"");
    }
    sb_printf(b, "}");
}

/* Cuts what is to be copied of the items into pieces of at most `chunk` bytes: all of each, or
 * (held non-NULL) the runs of chunks of `dchunk` bytes whose held[] is set, each item's in turn. */
static struct piece *cut(const struct item *v, int n, size_t chunk, const unsigned char *held, uint64_t dchunk,
                         const uint64_t *pre_off, char *pre_base, size_t *np)
{
    size_t total = 0;
    for (int i = 0; i < n; i++)
        total += (v[i].size + chunk - 1) / chunk + (held ? (v[i].size + dchunk - 1) / dchunk : 0);
    struct piece *p = calloc(total ? total : 1, sizeof *p);
    if (!p)
        return NULL;
    size_t k = 0, d = 0;
    for (int i = 0; i < n; i++) {
        uint64_t at = 0;
        while (at < v[i].size) {
            uint64_t end = v[i].size; /* the run [at, end) */
            char *host = NULL; /* where the run's chunks were read in before the freeze (consecutive there) */
            if (held) {
                for (; at < v[i].size && !held[d]; at += dchunk)
                    d++;
                if (at >= v[i].size)
                    break;
                if (pre_off && pre_off[d] != UINT64_MAX)
                    host = pre_base + pre_off[d];
                for (end = at; end < v[i].size && held[d]; end += dchunk) {
                    if (host && (pre_off[d] == UINT64_MAX || pre_base + pre_off[d] != host + (end - at)))
                        host = NULL; /* (never: a restore's differing chunks are all held, all read in) */
                    d++;
                }
                end = end < v[i].size ? end : v[i].size;
            }
            for (uint64_t o = at; o < end; o += chunk)
                p[k++] = (struct piece){.dev = v[i].base + o, .off = v[i].off + o,
                                        .len = end - o < chunk ? end - o : chunk, .ctx = v[i].ctx,
                                        .host = host ? host + (o - at) : NULL};
            at = end;
        }
    }
    *np = k;
    return p;
}

/* ------------------------------------------------------------------------------------------------
 * What is kept between a job's commands, so that a checkpoint after the first pays none of it again:
 * the digest kernel loaded in each context with its scratch (dg_open), and one pool of pinned host
 * memory (mapped here and registered with the driver, portable: a context the program destroys takes
 * the registration with it, never the memory, which is then given back here): each lane's two staging buffers at its start, then a *deferred*
 * area into which the changed chunks of a dump are copied at the bus's speed under the gate and from
 * which they are written into the image after it reopens (and into which a restore of some chunks
 * reads them before it closes).  The pool is made at the first command that copies and grown only
 * where a command needs more than its deferred area holds (to 1.25x that, before the freeze: what a
 * restore's partial image holds, what a dump is planned for or found under a gate it then reopened,
 * op_prepare and op_copy; where that exceeds the cap, the command maps and pins its image instead);
 * it never exceeds the cap: `pin_cap=BYTES` on the command, else $GPUTRACE_SHIM_PIN_CAP, else
 * PIN_CAP_DEFAULT.  `release` (control.c) gives all of it back; the process's exit does too. */
#define PIN_CAP_DEFAULT (2ull << 30)
#define DEFER_MIN (32ull << 20)

static struct {
    struct digester *dg;
    uint64_t dg_ctxs[64];
    size_t dg_caps[64];
    int dg_nctx;
    char *pool;
    uint64_t pool_len, staging_len; /* staging_len: the lanes' part, at the start */
    uint64_t want;                  /* deferred bytes the next command should have room for */
    uint64_t pool_ctx;              /* the context it was allocated in: it goes with it */
    uint64_t cap;                   /* the cap the last command gave */
    unsigned long long dg_loads, pool_allocs, reused;
    /* What an incremental dump is planned for before its freeze (the digests that say what changed
     * are taken under the gate): the smaller of what the job's last two found changed (a steady change
     * is planned for from the second on; one large change alone does not make the next small one pin
     * the whole image).  Counted: bytes copied through the lanes' staging under a gate (not by a dump
     * whose gate this shim closed itself, unless preparing again could not do better), and freezes
     * ended without a copy because the changes outgrew the pool (the dump then prepared again, for
     * what it found, and froze once more). */
    uint64_t expect, expect_last;
    unsigned long long expect_seen, staging_copied, outgrown;
    /* A suspension's image (`suspend keep=1`): a memfd of the shim's, mapped shared and registered, kept
     * after unsuspend (where it fits the cap beside the pool) so that the next suspension copies
     * straight into it, and resume unpins nothing.  In use while the job is suspended (S.kept). */
    char *simg;
    int simg_fd;
    uint64_t simg_len, simg_ctx;
    unsigned long long simg_allocs, simg_reused;
    int simg_release; /* `release` came while it was in use: not kept at unsuspend */
} K = {.simg_fd = -1};

static uint64_t pin_cap_default(void)
{
    static uint64_t cap;
    if (!cap) {
        const char *e = getenv("GPUTRACE_SHIM_PIN_CAP");
        char *end;
        unsigned long long v = e ? strtoull(e, &end, 10) : 0;
        cap = e && *e && !*end && v ? (uint64_t)v : PIN_CAP_DEFAULT;
    }
    return cap;
}

static void pool_unmap(char *m, uint64_t len, uint64_t ctx)
{
    D.ctx_set((CUcontext)(uintptr_t)ctx);
    D.host_unregister(m); /* waits for copies still using it */
    D.ctx_set(NULL);
    munmap(m, (size_t)len);
}

static int ctx_known(const struct collect *c, uint64_t ctx)
{
    for (int k = 0; k < c->nctx; k++)
        if (c->ctxs[k] == ctx)
            return 1;
    return 0;
}

/* What was kept in a context the program has destroyed since went with it (the driver frees a
 * context's pinned memory and modules): forgotten, never freed again. */
static void keep_forget_gone(const struct collect *c)
{
    if (K.pool && !ctx_known(c, K.pool_ctx)) { /* registered no more: unmapped, made again when needed */
        munmap(K.pool, (size_t)K.pool_len);
        K.pool = NULL;
        K.pool_len = K.staging_len = 0;
    }
    if (K.simg && !S.kept && !ctx_known(c, K.simg_ctx)) {
        munmap(K.simg, (size_t)K.simg_len);
        close(K.simg_fd);
        K.simg = NULL;
        K.simg_fd = -1;
        K.simg_len = 0;
    }
    for (int k = 0; K.dg && k < K.dg_nctx; k++)
        if (!ctx_known(c, K.dg_ctxs[k])) {
            K.dg = NULL; /* (its few bytes of host memory are left) */
            K.dg_nctx = 0;
        }
}

/* The kept digester, made again only where the contexts changed or the job's chunks outgrew it. */
static struct digester *keep_digester(const uint64_t *ctxs, const size_t *need, int nctx, char *why, size_t wl)
{
    int same = K.dg && K.dg_nctx == nctx;
    for (int k = 0; same && k < nctx; k++)
        same = K.dg_ctxs[k] == ctxs[k] && K.dg_caps[k] >= need[k];
    if (same) {
        K.reused++;
        return K.dg;
    }
    if (K.dg)
        dg_close(K.dg);
    size_t caps[64];
    for (int k = 0; k < nctx; k++)
        caps[k] = need[k] + need[k] / 4 + 64; /* room for what the job allocates meanwhile, and later */
    K.dg = dg_open(ctxs, caps, nctx, why, wl);
    if (K.dg) {
        K.dg_loads++;
        K.dg_nctx = nctx;
        memcpy(K.dg_ctxs, ctxs, sizeof *ctxs * (size_t)nctx);
        memcpy(K.dg_caps, caps, sizeof *caps * (size_t)nctx);
    }
    return K.dg;
}

static void keep_drop_digester(void)
{
    if (K.dg)
        dg_close(K.dg);
    K.dg = NULL;
}

/* The pool with room for `staging` bytes of lane buffers and, within the cap, for the deferred area
 * this job wants (initially `initial` bytes); made or grown only where it is smaller. 0, or -1 where
 * the staging alone exceeds the cap or the driver cannot pin it. */
static void simg_drop(void);

static int keep_pool(uint64_t staging, uint64_t initial, uint64_t cap, uint64_t ctx)
{
    if (K.simg && !S.kept && staging + K.simg_len > cap)
        simg_drop(); /* the cap holds both: a suspension's kept image gives way to the lanes' staging */
    if (K.simg && K.simg_len < cap)
        cap -= K.simg_len;
    if (staging > cap)
        return -1;
    if (!K.want)
        K.want = initial;
    uint64_t defer = K.want < cap - staging ? K.want : cap - staging;
    if (K.pool && K.staging_len == staging && K.pool_len >= staging + defer && K.pool_len <= cap)
        return 0;
    if (K.pool) {
        pool_unmap(K.pool, K.pool_len, K.pool_ctx);
        K.pool = NULL;
        K.pool_len = 0;
    }
    uint64_t len = round_up(staging + defer, IMG_ALIGN);
    if (!D.host_register || !D.host_unregister)
        return -1;
    void *m = mmap(NULL, (size_t)len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED)
        return -1;
    memset(m, 0, (size_t)len); /* faulted in now, never during a freeze */
    if (D.ctx_set((CUcontext)(uintptr_t)ctx) != CUDA_SUCCESS) {
        munmap(m, (size_t)len);
        return -1;
    }
    CUresult r = D.host_register(m, (size_t)len, CU_MEMHOSTALLOC_PORTABLE /* = CU_MEMHOSTREGISTER_PORTABLE */);
    D.ctx_set(NULL);
    if (r != CUDA_SUCCESS) {
        munmap(m, (size_t)len);
        return -1;
    }
    K.pool = m;
    K.pool_ctx = ctx;
    K.pool_len = len;
    K.staging_len = staging;
    K.pool_allocs++;
    return 0;
}

/* The most a pool could hold for deferred chunks beside `staging` bytes of lane buffers under `cap`,
 * as keep_pool would make it (a suspension's kept image counts against the cap unless it gives way). */
static uint64_t defer_max(uint64_t staging, uint64_t cap)
{
    if (K.simg && !(!S.kept && staging + K.simg_len > cap) && K.simg_len < cap)
        cap -= K.simg_len;
    return staging > cap ? 0 : cap - staging;
}

/* An incremental dump found `bytes` changed: what the next one is planned for. */
static void expect_note(uint64_t bytes)
{
    K.expect = K.expect_seen && K.expect_last < bytes ? K.expect_last : bytes;
    K.expect_last = bytes;
    K.expect_seen++;
}

/* Everything kept, given back (no command is running: they run on the control thread, as this). */
void dump_release(struct sbuf *b)
{
    dump_unstage(-1);
    uint64_t bytes = K.pool_len + (K.simg && !S.kept ? K.simg_len : 0);
    if (!S.kept)
        simg_drop(); /* (in use by a suspension: given back at its unsuspend instead) */
    else
        K.simg_release = 1;
    int had_dg = K.dg != NULL;
    keep_drop_digester();
    if (K.pool)
        pool_unmap(K.pool, K.pool_len, K.pool_ctx);
    K.pool = NULL;
    K.pool_len = K.staging_len = K.want = 0;
    sb_printf(b, "{\"ok\": true, \"released_pinned_bytes\": %llu, \"released_digester\": %s}",
              (unsigned long long)bytes, had_dg ? "true" : "false");
}

/* Its part of the status JSON: what is kept, and how often it was made. */
void dump_kept_json(struct sbuf *b)
{
    sb_printf(b, "\"kept\": {\"pinned_bytes\": %llu, \"staging_bytes\": %llu, \"pin_cap\": %llu, "
                 "\"digester\": %s, \"digester_loads\": %llu, \"pool_allocs\": %llu, \"reused\": %llu, "
                 "\"suspend_image_bytes\": %llu, \"suspend_image_allocs\": %llu, \"suspend_image_reused\": %llu, "
                 "\"expect_bytes\": %llu, \"staging_copied_bytes\": %llu, \"outgrown\": %llu}",
              (unsigned long long)K.pool_len, (unsigned long long)K.staging_len,
              (unsigned long long)(K.cap ? K.cap : pin_cap_default()), K.dg ? "true" : "false", K.dg_loads, K.pool_allocs, K.reused,
              (unsigned long long)K.simg_len, K.simg_allocs, K.simg_reused, (unsigned long long)K.expect,
              K.staging_copied, K.outgrown);
}

/* Synchronizes every context the registry knows: work submitted before the gate closed finishes. */
static int sync_all(const struct collect *c, char *err, size_t errlen)
{
    for (int k = 0; k < c->nctx; k++) {
        CUresult r = D.ctx_set((CUcontext)(uintptr_t)c->ctxs[k]);
        if (r == CUDA_SUCCESS)
            r = D.ctx_sync();
        if (r != CUDA_SUCCESS) {
            snprintf(err, errlen, "driver: synchronizing context %#llx failed: CUresult %d",
                     (unsigned long long)c->ctxs[k], (int)r);
            D.ctx_set(NULL);
            return -1;
        }
    }
    D.ctx_set(NULL);
    return 0;
}

/* A bounded sync_all, for `drain`: the contexts are synchronized on a thread of its own while the
 * control thread waits up to the timeout.  A synchronization that does not return in time (work
 * that waits on another process, a collective whose peer is stopped) is left to end by itself on
 * that thread, which then exits; until it has, another drain is refused, so there is never more
 * than one such thread. */
struct sync_job {
    struct collect c;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int done, rc, refs;
    char err[160];
};

static atomic_int g_sync_running;

static void sync_job_unref(struct sync_job *j)
{
    pthread_mutex_lock(&j->mu);
    int last = --j->refs == 0;
    pthread_mutex_unlock(&j->mu);
    if (last) {
        pthread_mutex_destroy(&j->mu);
        pthread_cond_destroy(&j->cv);
        free(j->c.v);
        free(j);
    }
}

static void *sync_run(void *arg)
{
    struct sync_job *j = arg;
    int rc = sync_all(&j->c, j->err, sizeof j->err);
    /* Free for the next one before the waiter hears it is done: a request right after this one
     * (a gang restore after its checkpoint) must not find it still running because this thread
     * was preempted between the two. */
    atomic_store(&g_sync_running, 0);
    pthread_mutex_lock(&j->mu);
    j->rc = rc;
    j->done = 1;
    pthread_cond_signal(&j->cv);
    pthread_mutex_unlock(&j->mu);
    sync_job_unref(j);
    return NULL;
}

static const char *sync_bounded(const struct collect *c, int timeout_ms, uint64_t *ns)
{
    static char err[200];
    uint64_t t0 = now_ns();
    *ns = 0;
    int zero = 0;
    if (!atomic_compare_exchange_strong(&g_sync_running, &zero, 1))
        return "an earlier synchronization of this process has not returned yet";
    struct sync_job *j = calloc(1, sizeof *j);
    if (j) {
        j->c = *c;
        j->c.v = NULL; /* only the contexts are needed */
        j->c.n = j->c.cap = 0;
    }
    if (!j) {
        atomic_store(&g_sync_running, 0);
        return "out of memory";
    }
    pthread_mutex_init(&j->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&j->cv, &ca);
    pthread_condattr_destroy(&ca);
    j->refs = 2;
    int e = shim_spawn_detached(sync_run, j, 0);
    if (e) {
        j->refs = 1;
        sync_job_unref(j);
        atomic_store(&g_sync_running, 0);
        return "cannot start the synchronizing thread";
    }
    uint64_t end = t0 + (uint64_t)(timeout_ms < 0 ? 0 : timeout_ms) * 1000000u;
    struct timespec dl = {(time_t)(end / 1000000000u), (long)(end % 1000000000u)};
    const char *out = NULL;
    pthread_mutex_lock(&j->mu);
    while (!j->done)
        if (pthread_cond_timedwait(&j->cv, &j->mu, &dl) == ETIMEDOUT)
            break;
    if (!j->done)
        out = "timeout";
    else if (j->rc) {
        snprintf(err, sizeof err, "%s", j->err);
        out = err;
    }
    pthread_mutex_unlock(&j->mu);
    sync_job_unref(j);
    *ns = now_ns() - t0;
    return out;
}

const char *dump_sync(int timeout_ms, uint64_t *ns)
{
    *ns = 0;
    if (!drv_load())
        return "the driver lacks a function the synchronization needs";
    struct collect c;
    if (collect(&c) != 0) {
        free(c.v);
        return "out of memory";
    }
    const char *e = sync_bounded(&c, timeout_ms, ns);
    free(c.v);
    return e;
}

static void identity_json(struct sbuf *b, const struct collect *c)
{
    int v = 0;
    if (D.version)
        D.version(&v);
    sb_printf(b, ", \"driver_version\": %d, \"devices\": [", v);
    int seen[64], ns = 0;
    for (int k = 0; k < c->nctx; k++) {
        int d = c->ctx_dev[k], dup = 0;
        for (int x = 0; x < ns; x++)
            dup |= seen[x] == d;
        if (dup || ns == 64)
            continue;
        seen[ns++] = d;
        char name[128] = "";
        CUuuid u;
        memset(&u, 0, sizeof u);
        if (D.dev_name && D.dev_name(name, sizeof name, d) != CUDA_SUCCESS)
            name[0] = 0;
        if (D.dev_uuid)
            D.dev_uuid(&u, d);
        sb_printf(b, "%s{\"ordinal\": %d, \"name\": \"", ns > 1 ? ", " : "", d);
        for (char *p = name; *p; p++)
            sb_printf(b, "%c", (*p == '"' || *p == '\\' || (unsigned char)*p < 0x20) ? '?' : *p);
        sb_printf(b, "\", \"uuid\": \"");
        for (int i = 0; i < 16; i++)
            sb_printf(b, "%02x", (unsigned char)u.bytes[i]);
        sb_printf(b, "\"}");
    }
    sb_printf(b, "]");
}

/* direct=1: the image file mapped shared and registered (pinned) with the driver, before the gate
 * closes: pinning takes time the job does not wait for, and the copies inside the freeze then move
 * at the bus's speed with no CPU copy.  NULL when the driver cannot (the staging path is used). */
static char *direct_map(int fd, uint64_t len, uint64_t ctx)
{
    if (!D.host_register || !D.host_unregister || !len)
        return NULL;
    void *m = mmap(NULL, (size_t)len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED)
        return NULL;
    D.ctx_set((CUcontext)(uintptr_t)ctx);
    CUresult r = D.host_register(m, (size_t)len, CU_MEMHOSTALLOC_PORTABLE /* = CU_MEMHOSTREGISTER_PORTABLE */);
    D.ctx_set(NULL);
    if (r != CUDA_SUCCESS) {
        munmap(m, (size_t)len);
        return NULL;
    }
    return m;
}

static void direct_unmap(char *m, uint64_t len, uint64_t ctx)
{
    D.ctx_set((CUcontext)(uintptr_t)ctx);
    D.host_unregister(m); /* waits for copies still using it */
    D.ctx_set(NULL);
    munmap(m, (size_t)len);
}

/* The kept suspension image given back (never while a suspension uses it). */
static void simg_drop(void)
{
    if (K.simg)
        direct_unmap(K.simg, K.simg_len, K.simg_ctx);
    if (K.simg_fd >= 0)
        close(K.simg_fd);
    K.simg = NULL;
    K.simg_fd = -1;
    K.simg_len = 0;
    K.simg_release = 0;
}

/* The image a `suspend keep=1` copies into: the kept one where it holds `len` bytes and its context
 * is `ctx`, else a new memfd of the shim's, its pages allocated, mapped and registered now (while the
 * job runs; what every suspension without it pays).  0, or -1 with nothing kept. */
static int keep_simg(uint64_t len, uint64_t ctx)
{
    if (K.simg && K.simg_len >= len && K.simg_ctx == ctx) {
        K.simg_reused++;
        return 0;
    }
    simg_drop();
    len = round_up(len ? len + len / 16 : IMG_ALIGN, IMG_ALIGN); /* room for what the job allocates later */
    int fd = memfd_create("gputrace-suspend", MFD_CLOEXEC);
    if (fd < 0)
        return -1;
    if (posix_fallocate(fd, 0, (off_t)len) != 0) {
        close(fd);
        return -1;
    }
    char *m = direct_map(fd, len, ctx);
    if (!m) {
        close(fd);
        return -1;
    }
    K.simg = m;
    K.simg_fd = fd;
    K.simg_len = len;
    K.simg_ctx = ctx;
    K.simg_allocs++;
    return 0;
}

struct timing {
    uint64_t setup, drain, sync, digest, copy, freeze;
};

static void timing_json(struct sbuf *b, const struct timing *t)
{
    sb_printf(b, ", \"setup_ns\": %llu, \"drain_ns\": %llu, \"sync_ns\": %llu, \"digest_ns\": %llu, \"copy_ns\": %llu, "
              "\"freeze_ns\": %llu", (unsigned long long)t->setup, (unsigned long long)t->drain,
              (unsigned long long)t->sync, (unsigned long long)t->digest, (unsigned long long)t->copy,
              (unsigned long long)t->freeze);
}

/* Compares a checkpoint's entries with the live items (both in address order); describes up to a few
 * differences in `b` (a JSON fragment) and returns how many there are. */
static int diff(const struct img_ent *e, int ne, const struct item *v, int nv, struct sbuf *b)
{
    int i = 0, k = 0, nd = 0;
    sb_printf(b, ", \"differences\": [");
    while (i < ne || k < nv) {
        const char *what = NULL;
        uint64_t base = 0, want = 0, have = 0;
        if (k >= nv || (i < ne && e[i].base < v[k].base)) {
            what = "missing", base = e[i].base, want = e[i].size, i++;
        } else if (i >= ne || v[k].base < e[i].base) {
            what = "unexpected", base = v[k].base, have = v[k].size, k++;
        } else {
            if (e[i].size != v[k].size || e[i].device != v[k].device)
                what = "size", base = e[i].base, want = e[i].size, have = v[k].size;
            i++, k++;
        }
        if (!what)
            continue;
        if (nd < 8)
            sb_printf(b, "%s{\"what\": \"%s\", \"base\": %llu, \"checkpoint_size\": %llu, \"live_size\": %llu}",
                      nd ? ", " : "", what, (unsigned long long)base, (unsigned long long)want,
                      (unsigned long long)have);
        nd++;
    }
    sb_printf(b, "], \"difference_count\": %d", nd);
    return nd;
}

/* How many digests an image of these allocations has, at `dchunk` bytes each (0: none). */
static uint64_t n_digests(const uint64_t *sizes, size_t stride, int n, uint64_t dchunk)
{
    uint64_t k = 0;
    for (int i = 0; dchunk && i < n; i++) {
        uint64_t size = *(const uint64_t *)((const char *)sizes + (size_t)i * stride);
        k += (size + dchunk - 1) / dchunk;
    }
    return k;
}

/* Reads and checks an image's header, entries and digests (malloc'ed into *ents and *dig; *dig NULL
 * where it has none).  Every offset and size is checked without overflow against the file's size:
 * the image comes from outside the job, and a copy that runs past the mapped file would kill it.
 * head_only: the file holds only what comes before the data (a base for a dump). */
static const char *read_image(int fd, int head_only, int partial_ok, struct img_hdr *h, struct img_ent **ents,
                              uint64_t **dig, unsigned char **held)
{
    *ents = NULL;
    *dig = NULL;
    if (held)
        *held = NULL;
    struct stat st;
    if (fstat(fd, &st) != 0)
        return "cannot stat the image";
    if (!S_ISREG(st.st_mode))
        return "the image is not a regular file";
    uint64_t fsize = (uint64_t)st.st_size;
    memset(h, 0, sizeof *h);
    if (io_all(1, fd, h, IMG_V1_HDR, 0))
        return "not a gputrace image (too short)";
    size_t hsize = sizeof *h;
    if (!memcmp(h->magic, IMG_MAGIC_V1, sizeof h->magic))
        hsize = IMG_V1_HDR; /* no digests */
    else if (memcmp(h->magic, IMG_MAGIC, sizeof h->magic) || io_all(1, fd, h, sizeof *h, 0))
        return "not a gputrace image (bad magic)";
    if (h->count > (1u << 24) || h->data_offset < hsize + h->count * sizeof(struct img_ent) ||
        h->data_offset > fsize || (!head_only && h->data_bytes != fsize - h->data_offset))
        return "image header inconsistent with its size";
    if (!head_only && !partial_ok && (h->flags & IMG_PARTIAL))
        return "a partial image (one link of an incremental checkpoint's chain): it must be put together first";
    struct img_ent *e = calloc(h->count ? h->count : 1, sizeof *e);
    if (!e)
        return "out of memory";
    if (h->count && io_all(1, fd, e, h->count * sizeof *e, hsize)) {
        free(e);
        return "image too short for its entries";
    }
    uint64_t end = head_only ? UINT64_MAX : fsize;
    for (uint64_t i = 0; i < h->count; i++)
        if (e[i].offset < h->data_offset || e[i].offset > end || e[i].size > end - e[i].offset ||
            e[i].base + e[i].size < e[i].base || (i && e[i].base <= e[i - 1].base) ||
            (i && e[i].offset < e[i - 1].offset + e[i - 1].size)) {
            free(e);
            return "image entry out of range or out of order";
        }
    *ents = e;
    uint64_t dc = h->digest_chunk;
    if (!dc) {
        h->digest_count = 0;
        if (!head_only && (h->flags & IMG_PARTIAL))
            return "a partial image without digests";
        return NULL;
    }
    if (dc < MIN_CHUNK || dc > MAX_CHUNK || dc % IMG_ALIGN ||
        h->digest_count != n_digests(&e[0].size, sizeof *e, (int)h->count, dc) ||
        h->digest_offset < hsize + h->count * sizeof *e || h->digest_offset > h->data_offset ||
        h->digest_count > (h->data_offset - h->digest_offset) / 16)
        return "image digests inconsistent with its entries";
    uint64_t *d = malloc(h->digest_count ? h->digest_count * 16 : 1);
    if (!d)
        return "out of memory";
    if (h->digest_count && io_all(1, fd, d, h->digest_count * 16, h->digest_offset)) {
        free(d);
        return "image too short for its digests";
    }
    *dig = d;
    if (held && (h->flags & IMG_PARTIAL)) { /* a restore of some chunks: which ones the image holds */
        if (h->held_offset < h->digest_offset + h->digest_count * 16 || h->held_offset > h->data_offset ||
            h->digest_count > h->data_offset - h->held_offset)
            return "image held map inconsistent";
        unsigned char *m = malloc(h->digest_count ? h->digest_count : 1);
        if (!m)
            return "out of memory";
        if (h->digest_count && io_all(1, fd, m, h->digest_count, h->held_offset)) {
            free(m);
            return "image too short for its held map";
        }
        *held = m;
    }
    return NULL;
}

static const char *const mode_name[] = {"dump", "restore", "suspend", "unsuspend"};

/* One command from its words to its reply: what each step needs from the steps before it, and what
 * op_close gives back whichever step failed. */
struct op {
    int mode, restore;
    struct opts o;
    int fd, own_fd;
    int have_pause; /* the gate was closed before the command (the client's pause, or the suspension) */
    int paused;     /* this command closed the gate, and must reopen it */
    struct collect c;
    struct img_hdr h;
    struct img_ent *ents;
    uint64_t *idig;          /* restore: the image's digests */
    unsigned char *iheld;    /* restore of a partial image: 1 where it holds the chunk (the others must not differ) */
    uint64_t *pre_off;       /* ... where each held chunk was read into the pool's deferred area (UINT64_MAX: not) */
    uint64_t preloaded, deferred, writeback_ns, stale;
    int dg_lost;             /* the digester failed: closed after the gate reopens, not kept */
    int reopened;            /* the gate reopened before the reply (a dump's deferred chunks written after) */
    struct img_hdr bh;       /* dump base=1: the base image's header, entries and digests */
    struct img_ent *bents;
    uint64_t *bdig;
    uint64_t dchunk;         /* bytes each digest covers here (0: no digests) */
    struct digester *dg;     /* made before the freeze; NULL: no digests (dg_why says why, if wanted) */
    char dg_why[160];
    uint64_t *dig;           /* this command's digests of the live memory, 2 words each */
    unsigned char *held;     /* 1: the chunk is copied */
    uint64_t nd, copied_chunks, copied_bytes;
    struct lane L[MAX_LANES];
    int nl;
    char *map; /* direct: the image mapped and pinned */
    uint64_t map_len;
    int direct_used;
    struct piece *pieces;
    size_t np;
    struct timing t;
    uint64_t t_gate; /* when the gate began to close */
    struct sbuf b;   /* the reply */
    char err[320];
    int prepared; /* op_prepare has run (for a staged command: when it was staged) */
    int staged;   /* ... before the gate closed, by a `stage=1` command */
    int simg;  /* suspend keep=1: the image is K.simg (op->fd, op->map are its, never closed or unmapped here) */
    int stuck; /* a synchronization did not return: the device may still use the pinned memory */
    int failed; /* the reply is an error: the device may be busy, even held (a collective's peer stopped) */
    /* A dump whose changes outgrew its plan (op_copy): the gate reopened without a copy and the dump
     * prepared again for what it found.  attempts: freezes before this one; aborted_ns: their length;
     * setup_prev: their preparations'; use_image: map and pin the whole image (the path of a whole
     * checkpoint).  staging_bytes: bytes copied through the lanes' staging under the gate. */
    int attempts, use_image;
    uint64_t aborted_ns, setup_prev, staging_bytes;
    uint64_t found; /* a dump given a base: the bytes its digests found changed (what a retry plans for) */
    const char *plan; /* where the copies went: "image" (mapped and pinned), "pool" or "staging" */
};

static int fail(struct op *op, const char *error, const char *detail)
{
    op->failed = 1;
    json_err(&op->b, error, detail);
    return -1;
}

/* The image: opened (or taken over), and read back for a restore; the driver's functions found. */
static int op_open(struct op *op, char *args, int fd)
{
    char *path;
    op->fd = fd;
    op->own_fd = fd >= 0; /* a passed fd is ours to close (a suspend keeps it), even when the words are wrong */
    if (parse_opts(args, &op->o, &path) != 0 || (path && op->mode == M_UNSUSPEND)) {
        snprintf(op->err, sizeof op->err, "usage: %s [lanes=N] [chunk=BYTES] [timeout=MS] [direct=0|1] [stage=1] "
                 "[pin_cap=BYTES]%s%s",
                 mode_name[op->mode], op->mode == M_DUMP ? " [digest=BYTES|0] [base=0|1]"
                 : op->mode == M_RESTORE ? " [diff=0|1]" : "", op->mode == M_UNSUSPEND ? "" : " [/PATH] (or pass an fd)");
        return fail(op, op->err, NULL);
    }
    if (op->mode == M_UNSUSPEND) {
        if (fd >= 0)
            close(fd);
        op->fd = -1;
        op->own_fd = 0;
        if (!gate_suspended())
            return fail(op, "not suspended", NULL);
        op->fd = S.fd;       /* stays the suspension's until the data are back */
        op->have_pause = 1;  /* the gate has been closed since the suspend */
    } else if (gate_suspended()) {
        return fail(op, "suspended", "the process's device memory is off the GPU; unsuspend it first");
    } else if (op->o.keep) {
        if (op->mode != M_SUSPEND || path || !op->o.direct)
            return fail(op, "keep=1 is for a direct suspend, without an image of its own", NULL);
        if (fd >= 0)
            close(fd);
        op->fd = -1;
        op->own_fd = 0;
        op->simg = 1; /* the image is made or found in op_prepare, once its size is known */
    } else if (path) {
        if (fd >= 0)
            close(fd);
        op->own_fd = 0;
        op->fd = open(path, (op->restore ? O_RDONLY : O_RDWR | O_CREAT | O_TRUNC) | O_CLOEXEC | O_NOFOLLOW, 0600);
        if (op->fd < 0)
            return fail(op, "cannot open the image file", strerror(errno));
        op->own_fd = 1;
    } else if (fd < 0) {
        return fail(op, "no image: pass a file descriptor with the command or name a /PATH", NULL);
    }
    if (!drv_load())
        return fail(op, "the driver lacks a function the copy needs", NULL);
    if (op->mode == M_SUSPEND && !op->simg && K.simg && !S.kept)
        simg_drop(); /* a suspension into an image of its own (a file, -o): no second copy kept in memory */
    if (op->mode == M_UNSUSPEND && S.kept) {
        /* The kept image is larger than what it holds: its head says where the data end. */
        struct stat st;
        const char *e = read_image(op->fd, 1, 0, &op->h, &op->ents, &op->idig, NULL);
        if (!e && (fstat(op->fd, &st) != 0 || op->h.data_offset + op->h.data_bytes > (uint64_t)st.st_size))
            e = "image header inconsistent with its size";
        if (e)
            return fail(op, "bad image", e);
    } else if (op->restore) {
        const char *e = read_image(op->fd, 0, op->mode == M_RESTORE && op->o.diff, &op->h, &op->ents, &op->idig,
                                   &op->iheld);
        if (e)
            return fail(op, "bad image", e);
    } else if (op->o.base) {
        if (!op->own_fd || path)
            return fail(op, "base=1 needs the base image's head in the fd passed with the command", NULL);
        const char *e = read_image(op->fd, 1, 0, &op->bh, &op->bents, &op->bdig, NULL);
        if (e)
            return fail(op, "bad base image", e);
    }
    return 0;
}

/* The digests this command computes: none for a suspension (its memory is given back, not compared),
 * the base's chunking for a dump given one, the image's for a restore. */
static uint64_t digest_chunk_of(const struct op *op)
{
    if (op->mode == M_DUMP && op->o.digest)
        return op->o.base ? (op->bdig ? op->bh.digest_chunk : 0) : op->o.digest;
    if (op->mode == M_RESTORE && op->o.diff)
        return op->idig ? op->h.digest_chunk : 0;
    return 0;
}

/* Before the freeze: the digest kernel loaded and its scratch made in every context, room for the
 * chunks there are now and some more (what the job allocates meanwhile). */
static void digests_prepare(struct op *op)
{
    struct collect *c = &op->c;
    op->dchunk = digest_chunk_of(op);
    if (op->mode == M_DUMP && op->o.digest && op->o.base && !op->dchunk)
        snprintf(op->dg_why, sizeof op->dg_why, "the base image has no digests");
    if (op->mode == M_RESTORE && op->o.diff && !op->dchunk)
        snprintf(op->dg_why, sizeof op->dg_why, "the image has no digests");
    if (!op->dchunk || !c->n)
        return;
    size_t need[64] = {0};
    for (int i = 0; i < c->n; i++)
        for (int k = 0; k < c->nctx; k++)
            if (c->ctxs[k] == c->v[i].ctx)
                need[k] += (c->v[i].size + op->dchunk - 1) / op->dchunk;
    for (int k = 0; k < c->nctx; k++)
        need[k] += need[k] / 8 + 16; /* what the job may allocate before the gate closes */
    op->dg = keep_digester(c->ctxs, need, c->nctx, op->dg_why, sizeof op->dg_why);
    if (!op->dg && op->mode == M_DUMP)
        op->dchunk = 0; /* the image says it has none */
}

/* Where the data start in a dump's image of these allocations. */
static uint64_t head_bytes(int n, uint64_t nd, int partial)
{
    uint64_t dig_at = round_up(sizeof(struct img_hdr) + (uint64_t)n * sizeof(struct img_ent), 16);
    return round_up(dig_at + nd * 16 + (partial ? nd : 0), IMG_ALIGN);
}

/* The bytes of the chunks a restore's partial image holds. */
static uint64_t held_total(const struct op *op)
{
    uint64_t dc = op->h.digest_chunk, total = 0, d = 0;
    for (uint64_t i = 0; dc && i < op->h.count; i++)
        for (uint64_t o = 0; o < op->ents[i].size; o += dc, d++)
            if (op->iheld[d])
                total += op->ents[i].size - o < dc ? op->ents[i].size - o : dc;
    return total;
}

/* A restore of a partial image: the chunks it holds read into the pool's deferred area before the
 * gate closes, where they all fit (op_prepare grows the pool, or maps and pins the image instead,
 * where they would not; else, where pinning failed, they are read under the gate through the lanes'
 * staging). */
static void preload(struct op *op)
{
    uint64_t nd = op->h.digest_count, dc = op->h.digest_chunk, total = held_total(op);
    if (!(op->pre_off = malloc((nd ? nd : 1) * sizeof *op->pre_off)))
        return;
    for (uint64_t d = 0; d < nd; d++)
        op->pre_off[d] = UINT64_MAX;
    if (!total || total > K.pool_len - K.staging_len)
        return;
    char *area = K.pool + K.staging_len;
    uint64_t at = 0, d = 0;
    for (uint64_t i = 0; i < op->h.count; i++)
        for (uint64_t o = 0; o < op->ents[i].size; o += dc, d++) {
            if (!op->iheld[d])
                continue;
            uint64_t n = op->ents[i].size - o < dc ? op->ents[i].size - o : dc;
            if (io_all(1, op->fd, area + at, n, op->ents[i].offset + o)) {
                for (uint64_t x = 0; x < nd; x++) /* read under the gate instead, where the error shows */
                    op->pre_off[x] = UINT64_MAX;
                return;
            }
            op->pre_off[d] = at;
            at += n;
        }
    op->preloaded = at;
}

/* While the job still runs: what there is to copy, the image's space, the pinned memory. */
static int op_prepare(struct op *op)
{
    uint64_t t0 = now_ns();
    struct collect *c = &op->c;
    if (collect(c) != 0)
        return fail(op, "out of memory", NULL);
    op->nl = c->n ? op->o.lanes : 0;
    if (op->nl && !c->nctx) {
        op->nl = 0;
        return fail(op, "unsupported", "device memory but no context to copy it in");
    }
    keep_forget_gone(c);
    digests_prepare(op);
    if (op->iheld && !op->dg)
        return fail(op, "cannot compare", "the image holds only some chunks, and the digests that say which chunks "
                    "differ cannot be taken here");
    /* A dump given a base copies only what changed, into the kept pool: no space reserved for the
     * whole image and nothing of it pinned (the data go into the file after the gate reopens). */
    int sparse = (op->mode == M_DUMP && op->o.base && op->dg) || op->iheld;
    uint64_t held_bytes = 0;
    for (int i = 0; i < c->n; i++)
        held_bytes += c->v[i].size;
    uint64_t staging = (uint64_t)op->nl * 2 * op->o.chunk;
    if (op->nl)
        K.cap = op->o.pin_cap ? op->o.pin_cap : pin_cap_default();
    /* What the sparse copy will need pinned: a restore knows (the chunks its image holds); a dump
     * expects what the job's last incremental one changed (its own digests come under the gate). */
    uint64_t need = op->iheld ? held_total(op) : op->attempts ? op->found : K.expect;
    need = need < held_bytes || op->iheld ? need : held_bytes;
    if (sparse && op->nl && !op->use_image) {
        uint64_t dmax = defer_max(staging, K.cap);
        uint64_t room = K.pool && K.staging_len == staging ? K.pool_len - K.staging_len : 0;
        uint64_t grown = staging + (need + need / 4 < dmax ? need + need / 4 : dmax);
        uint64_t image = op->restore ? op->h.data_offset + op->h.data_bytes : held_bytes;
        /* Where it does not fit the pool: the pool grown now, within the cap, or else the image mapped
         * and pinned as a whole checkpoint's is, whichever pins less (the pool is kept; the image is
         * pinned at each such command).  Never the staging under the gate, at a few GB/s. */
        if (need > room && op->o.direct && (need > dmax || grown > image))
            op->use_image = 1; /* (direct=0: the image is never pinned; the pool grows as far as it can) */
        else if (need > room && need + need / 4 > K.want) {
            uint64_t initial = held_bytes / 16 > DEFER_MIN ? held_bytes / 16 : DEFER_MIN;
            K.want = need + need / 4 > initial || K.want ? need + need / 4 : initial;
        }
    }
    if (op->use_image)
        sparse = 0;
    if (op->restore) {
        op->map_len = op->h.data_offset + op->h.data_bytes;
    } else if (c->n) {
        uint64_t nd = n_digests(&c->v[0].size, sizeof *c->v, c->n, op->dchunk);
        op->map_len = head_bytes(c->n, nd + nd / 4 + 64, op->o.base);
        for (int i = 0; i < c->n; i++)
            op->map_len = round_up(op->map_len + c->v[i].size, IMG_ALIGN);
        /* Reserve a whole image's space while the job runs: page allocation (tmpfs, memfd) or block
         * allocation (a disk) leaves the freeze, and a full filesystem fails here, before it. */
        int e = sparse || op->simg ? 0 : posix_fallocate(op->fd, 0, (off_t)op->map_len);
        if (e == ENOSPC || e == EDQUOT)
            return fail(op, "cannot reserve space for the image", strerror(e));
    }
    if (op->simg && !op->nl) { /* nothing to copy: an image of its own, a head alone, not kept */
        op->simg = 0;
        if ((op->fd = memfd_create("gputrace-suspend", MFD_CLOEXEC)) < 0)
            return fail(op, "cannot make the suspension's image", strerror(errno));
        op->own_fd = 1;
    }
    if (op->simg) {
        if (keep_simg(op->map_len, c->nctx ? c->ctxs[0] : 0) != 0)
            return fail(op, "cannot pin the suspension's image", "memfd_create, allocating its pages or "
                        "cuMemHostRegister failed (host memory); a suspend without keep=1 copies through staging");
        op->fd = K.simg_fd;
        op->map = K.simg;
        op->map_len = K.simg_len;
    } else if (op->mode == M_UNSUSPEND && S.map) {
        op->map = S.map; /* pinned since the suspend */
        op->map_len = S.len;
    } else if (op->nl && op->o.direct && !sparse) { /* a suspension too: its image is the memfd kept until unsuspend */
        op->map = direct_map(op->fd, op->map_len, c->ctxs[0]);
    }
    op->direct_used = op->map != NULL;
    /* The pool: where the copies need staging or a dump's chunks are deferred, and at any dump, so
     * that the next one (an incremental one) finds it made. */
    if (op->nl && (!op->map || op->mode == M_DUMP)) {
        uint64_t initial = held_bytes / 16 > DEFER_MIN ? held_bytes / 16 : DEFER_MIN;
        if (keep_pool(staging, initial, K.cap, c->ctxs[0]) != 0) {
            K.want = 0; /* a pool this large cannot be pinned: the next command asks for the first size again */
            if (!op->map) {
                op->nl = 0;
                return fail(op, "cannot pin staging memory", "cuMemHostAlloc failed, or the lanes' buffers exceed "
                            "pin_cap: try a smaller chunk= or fewer lanes=, or a larger pin_cap=");
            }
        } else {
            for (int i = 0; i < op->nl; i++)
                for (int k = 0; k < 2; k++)
                    op->L[i].buf[k] = K.pool + ((uint64_t)i * 2 + (uint64_t)k) * op->o.chunk;
        }
    }
    if (op->iheld && op->nl && K.pool && !op->map)
        preload(op);
    op->plan = op->map ? "image" : K.pool && op->nl ? "pool" : "staging";
    op->t_gate = now_ns();
    op->t.setup = op->t_gate - t0 + op->setup_prev;
    op->prepared = 1;
    return 0;
}

/* The gate closed (unless it already was), calls in flight drained, and what to copy read again:
 * now the registry cannot change. */
static int op_freeze(struct op *op)
{
    if (!op->have_pause) {
        int r = gputrace_shim_pause(op->o.timeout_ms);
        if (r == -2)
            return fail(op, "already paused", "another client holds a pause of this process");
        if (r != 0)
            return fail(op, "busy", "driver calls still in flight at the timeout; the gate is open again");
        op->paused = 1;
    }
    op->t.drain = now_ns() - op->t_gate;
    int held = atomic_load(&untracked_held);
    if (held > 0) { /* (under the gate: none can be made or freed until it opens) */
        const char *what = atomic_load(&untracked_what);
        snprintf(op->err, sizeof op->err,
                 "the program holds device memory the shim does not carry (%d made by %s or the like: CUDA arrays, "
                 "memory imported from another process); a checkpoint would leave it out", held, what ? what : "?");
        return fail(op, "unsupported", op->err);
    }
    free(op->c.v);
    if (collect(&op->c) != 0)
        return fail(op, "out of memory", NULL);
    return 0;
}

/* Where each allocation goes in the image: the image's own places for a restore (after checking that
 * it holds the same allocations), new ones for a dump. */
static int op_layout(struct op *op)
{
    struct collect *c = &op->c;
    if (c->n && !op->nl) /* nothing was allocated before the gate closed, something is now */
        return fail(op, "busy", "the process allocated device memory meanwhile; try again");
    if (op->restore) {
        struct sbuf d = {0};
        if (diff(op->ents, (int)op->h.count, c->v, c->n, &d)) {
            op->failed = 1;
            sb_printf(&op->b, "{\"ok\": false, \"error\": \"mismatch\"%s}", d.p);
            free(d.p);
            return -1;
        }
        free(d.p);
        for (int i = 0; i < c->n; i++)
            c->v[i].off = op->ents[i].offset;
        op->nd = op->dg ? op->h.digest_count : 0;
    } else {
        struct img_hdr *h = &op->h;
        op->nd = n_digests(&c->v[0].size, sizeof *c->v, c->n, op->dchunk);
        int partial = op->o.base && op->dchunk;
        memset(h, 0, sizeof *h);
        memcpy(h->magic, IMG_MAGIC, sizeof h->magic);
        h->count = (uint64_t)c->n;
        h->data_offset = head_bytes(c->n, op->nd, partial);
        uint64_t off = h->data_offset;
        for (int i = 0; i < c->n; i++) {
            c->v[i].off = off;
            off = round_up(off + c->v[i].size, IMG_ALIGN);
        }
        h->data_bytes = off - h->data_offset;
        h->chunk = op->o.chunk;
        h->digest_chunk = op->dchunk;
        h->digest_count = op->nd;
        h->digest_offset = round_up(sizeof *h + (uint64_t)c->n * sizeof(struct img_ent), 16);
        h->held_offset = partial ? h->digest_offset + op->nd * 16 : 0;
        h->flags = partial ? IMG_PARTIAL : 0;
        if (op->map && h->data_offset + h->data_bytes > op->map_len)
            return fail(op, "busy", "the process allocated device memory meanwhile; try again");
    }
    if (op->nd && (!(op->dig = calloc(op->nd, 16)) || !(op->held = calloc(op->nd, 1))))
        return fail(op, "out of memory", NULL);
    for (int i = 0; i < c->n; i++)
        if (!c->v[i].ctx) {
            snprintf(op->err, sizeof op->err, "no context known for the allocation at %#llx",
                     (unsigned long long)c->v[i].base);
            return fail(op, "unsupported", op->err);
        }
    return 0;
}

/* Every lane copies its share of the pieces, in the direction `restore` says. Returns whether all did. */
static int run_copy(struct op *op, int restore)
{
    struct job j = {.restore = restore, .fd = op->fd, .map = op->map, .p = op->pieces, .np = op->np,
                    .chunk = op->o.chunk};
    pthread_mutex_init(&j.err_mu, NULL);
    if (op->np)
        job_run(&j, op->L, op->nl < (int)op->np ? op->nl : (int)op->np);
    pthread_mutex_destroy(&j.err_mu);
    if (atomic_load(&j.failed)) {
        snprintf(op->err, sizeof op->err, "%s", j.err);
        return -1;
    }
    return 0;
}

/* The live memory's digests (op->dig), and which chunks to copy (op->held): for a dump given a base,
 * those whose digest differs from the base's for the same allocation (every chunk of one the base
 * lacks); for a restore, those that differ from the image's.  Returns whether digests were used; when
 * not, op->dg_why says why and everything is copied. */
static int digests_compare(struct op *op)
{
    struct collect *c = &op->c;
    if (!op->dg || !op->nd)
        return 0;
    struct dg_span *sp = calloc(op->nd, sizeof *sp);
    if (!sp) {
        snprintf(op->dg_why, sizeof op->dg_why, "out of memory");
        return 0;
    }
    uint64_t k = 0;
    for (int i = 0; i < c->n; i++)
        for (uint64_t o = 0; o < c->v[i].size; o += op->dchunk)
            sp[k++] = (struct dg_span){.ptr = c->v[i].base + o, .ctx = c->v[i].ctx,
                                       .len = c->v[i].size - o < op->dchunk ? c->v[i].size - o : op->dchunk};
    const char *e = dg_run(op->dg, sp, op->nd, op->dig, &op->t.digest, op->dg_why, sizeof op->dg_why);
    free(sp);
    if (e) {
        if (op->dg == K.dg) /* made again next time (its context may be gone) */
            K.dg = NULL, K.dg_nctx = 0;
        op->dg_lost = 1;
        return 0;
    }
    const uint64_t *want = op->restore ? op->idig : op->bdig;
    if (!want) { /* a dump without a base: every chunk */
        memset(op->held, 1, op->nd);
        return 1;
    }
    /* Walk the live allocations and the reference's entries together, both in address order. */
    const struct img_ent *ref = op->restore ? op->ents : op->bents;
    uint64_t nref = op->restore ? op->h.count : op->bh.count, r = 0, rd = 0;
    k = 0;
    for (int i = 0; i < c->n; i++) {
        uint64_t n = (c->v[i].size + op->dchunk - 1) / op->dchunk;
        for (; r < nref && ref[r].base < c->v[i].base; r++)
            rd += (ref[r].size + op->dchunk - 1) / op->dchunk;
        int same = r < nref && ref[r].base == c->v[i].base && ref[r].size == c->v[i].size;
        for (uint64_t x = 0; x < n; x++, k++)
            op->held[k] = !same || op->dig[2 * k] != want[2 * (rd + x)] || op->dig[2 * k + 1] != want[2 * (rd + x) + 1];
    }
    return 1;
}

/* The shared copy: work in flight finished, the data moved, and for a dump the image's header and
 * entries written after it. */
static int op_copy(struct op *op)
{
    struct collect *c = &op->c;
    uint64_t t2 = now_ns();
    /* Bounded, as the pause is: work that cannot finish (a collective whose peer is stopped) gives
     * the job back instead of holding it, and this thread, for good. */
    uint64_t sync_ns;
    const char *se = sync_bounded(c, op->o.timeout_ms, &sync_ns);
    if (se && !strcmp(se, "timeout")) {
        op->stuck = 1;
        snprintf(op->err, sizeof op->err, "work on the device still running after %d ms (it may wait on another "
                 "process: a collective whose peer is stopped)%s", op->o.timeout_ms,
                 op->paused ? "; the gate is open again" : "");
        return fail(op, "busy", op->err);
    }
    if (se) {
        snprintf(op->err, sizeof op->err, "%s", se);
        return fail(op, "driver error", op->err);
    }
    op->t.sync = now_ns() - t2;
    int used = digests_compare(op);
    if (!used && !op->restore && op->dchunk) { /* a dump whose digests failed: an image without any */
        op->h.digest_chunk = op->h.digest_count = op->h.held_offset = op->h.flags = 0;
    }
    if (op->iheld) { /* a restore of some chunks: every chunk that differs must be one of them */
        if (!used)
            return fail(op, "cannot compare", op->dg_why[0] ? op->dg_why : "no digests");
        for (uint64_t i = 0; i < op->nd; i++)
            op->stale += op->held[i] && !op->iheld[i];
        if (op->stale) {
            snprintf(op->err, sizeof op->err, "%llu chunks differ from the checkpoint that the image given does not "
                     "hold (they changed since their digests were taken); nothing was copied",
                     (unsigned long long)op->stale);
            return fail(op, "stale", op->err);
        }
    }
    if (!used)
        op->nd = 0;
    uint64_t t3 = now_ns();
    if (!(op->pieces = cut(c->v, c->n, op->o.chunk, used ? op->held : NULL, op->dchunk, op->pre_off,
                           K.pool ? K.pool + K.staging_len : NULL, &op->np)))
        return fail(op, "out of memory", NULL);
    int all_pinned = 1;
    for (size_t i = 0; i < op->np; i++) {
        op->copied_bytes += op->pieces[i].len;
        all_pinned &= op->pieces[i].host != NULL;
    }
    if (op->restore && op->preloaded && all_pinned)
        op->direct_used = 1; /* straight from the pool it was read into before the freeze */
    if (op->mode == M_DUMP && op->o.base && used)
        op->found = op->copied_bytes;
    if (op->mode == M_DUMP && !op->map && K.pool) {
        /* Copied at the bus's speed into the kept pool, as far as it holds them, and written into the
         * image once the gate has reopened. */
        uint64_t room = K.pool_len - K.staging_len, at = 0;
        /* Whether preparing again can do better: the image pinned (unless it was planned and could not
         * be, or direct=0 forbids it), or else the pool grown once, where what was found fits its cap. */
        int better = op->o.direct ? !op->use_image
                                  : !op->attempts && op->copied_bytes <= defer_max(K.staging_len, K.cap);
        if (op->copied_bytes > room && used && op->paused && op->attempts < 2 && better) {
            /* More changed than the pool holds: the rest would go through the lanes' staging under the
             * gate, at a few GB/s (on an H100, 10% of 16 GiB froze the job 232 ms so, against 38 ms
             * with the image pinned).  Nothing is copied: the gate reopens, and the dump prepares again
             * for what it found (the pool grown, or the image pinned) and freezes once more; the
             * second time, should the job have changed more meanwhile than that holds, the image. */
            K.outgrown++;
            return 1;
        }
        for (size_t i = 0; i < op->np && at + op->pieces[i].len <= room; i++) {
            op->pieces[i].host = K.pool + K.staging_len + at;
            at += op->pieces[i].len;
        }
        op->deferred = at;
        /* The rest through the lanes' staging, under the gate: only where this command did not close the
         * gate itself (a gang's, a client's pause: it cannot reopen it), or the digests failed. Room for
         * it next time, within the cap. */
        if (op->copied_bytes > room && op->copied_bytes > K.want)
            K.want = op->copied_bytes + op->copied_bytes / 4;
    }
    if (op->mode == M_DUMP && op->o.base && used)
        expect_note(op->copied_bytes);
    for (size_t i = 0; i < op->np; i++)
        if (!op->pieces[i].host && !op->map)
            op->staging_bytes += op->pieces[i].len;
    K.staging_copied += op->staging_bytes;
    if (op->staging_bytes)
        op->plan = op->deferred || op->preloaded ? "pool and staging" : "staging";
    for (uint64_t i = 0; used && i < op->nd; i++)
        op->copied_chunks += op->held[i];
    /* (The kept image is never shrunk: its pages are pinned, and a page cut off would be another one
     * when it came back.  Its head says where its data end.) */
    if (!op->restore && !(op->simg && op->h.data_offset + op->h.data_bytes <= op->map_len) &&
        ftruncate(op->fd, (off_t)(op->h.data_offset + op->h.data_bytes)) != 0)
        return fail(op, "cannot size the image file", strerror(errno));
    int failed = run_copy(op, op->restore);
    op->t.copy = now_ns() - t3;
    if (failed)
        return fail(op, "copy failed", op->err);
    if (op->restore)
        return 0;
    struct img_ent *e = calloc(c->n ? (size_t)c->n : 1, sizeof *e);
    int werr = e ? 0 : ENOMEM;
    for (int i = 0; e && i < c->n; i++)
        e[i] = (struct img_ent){.base = c->v[i].base, .size = c->v[i].size, .offset = c->v[i].off,
                                .device = c->v[i].device, .kind = c->v[i].kind};
    if (!werr)
        werr = io_all(0, op->fd, &op->h, sizeof op->h, 0);
    if (!werr && c->n)
        werr = io_all(0, op->fd, e, (size_t)c->n * sizeof *e, sizeof op->h);
    if (!werr && op->h.digest_count)
        werr = io_all(0, op->fd, op->dig, op->h.digest_count * 16, op->h.digest_offset);
    if (!werr && (op->h.flags & IMG_PARTIAL))
        werr = io_all(0, op->fd, op->held, op->h.digest_count, op->h.held_offset);
    free(e);
    if (werr)
        return fail(op, "writing the image header failed", strerror(werr));
    return 0;
}

/* The gate reopened if this command closed it: the data is off the device (or back on it). */
static void op_reopen(struct op *op)
{
    if (op->reopened)
        return;
    if (op->paused) {
        gputrace_shim_resume();
        op->paused = 0;
    }
    op->t.freeze = now_ns() - op->t_gate; /* from closing the gate to reopening it */
    op->reopened = 1;
}

/* A dump's chunks copied into the kept pool, written into the image (the job runs meanwhile). */
static int op_writeback(struct op *op)
{
    uint64_t t0 = now_ns();
    for (size_t i = 0; i < op->np; i++) {
        struct piece *p = &op->pieces[i];
        if (!p->host)
            continue;
        int e = io_all(0, op->fd, p->host, p->len, p->off);
        if (e)
            return fail(op, "writing the image failed", strerror(e));
    }
    op->writeback_ns = now_ns() - t0;
    return 0;
}

/* The gate reopened if this command closed it, and the reply's common part. */
static void op_done(struct op *op)
{
    op_reopen(op);
    struct collect *c = &op->c;
    uint64_t bytes = 0;
    for (int i = 0; i < c->n; i++)
        bytes += c->v[i].size;
    sb_printf(&op->b, "{\"ok\": true, \"direct\": %s, \"allocations\": %d, \"bytes\": %llu, \"image_bytes\": %llu, "
                      "\"skipped\": %d, \"lanes\": %d, \"chunk\": %zu, \"pieces\": %zu",
              op->direct_used ? "true" : "false", c->n, (unsigned long long)bytes,
              (unsigned long long)(op->h.data_offset + op->h.data_bytes), c->skipped, op->nl, op->o.chunk, op->np);
    timing_json(&op->b, &op->t);
    /* What was compared and copied: with digests, the chunks copied of all there are; without, why
     * not (where they were asked for). */
    int used = op->nd != 0;
    sb_printf(&op->b, ", \"digests\": %s, \"digest_chunk\": %llu, \"chunks\": %llu, \"chunks_copied\": %llu, "
              "\"bytes_copied\": %llu, \"partial\": %s", used ? "true" : "false",
              (unsigned long long)(used ? op->dchunk : 0), (unsigned long long)op->nd,
              (unsigned long long)op->copied_chunks, (unsigned long long)op->copied_bytes,
              (op->h.flags & IMG_PARTIAL) && !op->restore ? "true" : "false");
    sb_printf(&op->b, ", \"staged\": %s, \"plan\": \"%s\", \"staging_copied_bytes\": %llu, \"attempts\": %d, "
              "\"aborted_freeze_ns\": %llu", op->staged ? "true" : "false", op->plan ? op->plan : "none",
              (unsigned long long)op->staging_bytes, op->attempts + 1, (unsigned long long)op->aborted_ns);
    sb_printf(&op->b, ", \"deferred_bytes\": %llu, \"writeback_ns\": %llu, \"preloaded_bytes\": %llu, "
              "\"kept_pinned_bytes\": %llu, \"digester_loads\": %llu, \"pool_allocs\": %llu",
              (unsigned long long)op->deferred, (unsigned long long)op->writeback_ns,
              (unsigned long long)op->preloaded, (unsigned long long)K.pool_len, K.dg_loads, K.pool_allocs);
    if (!used && op->dg_why[0]) {
        sb_printf(&op->b, ", \"digest_why\": \"");
        for (const char *p = op->dg_why; *p; p++)
            sb_printf(&op->b, "%c", (*p == '"' || *p == '\\' || (unsigned char)*p < 0x20) ? '?' : *p);
        sb_printf(&op->b, "\"");
    }
}

/* Unpinning and freeing pinned memory wait for the device to be idle (as cuMemFreeHost does on a GPU):
 * after a synchronization that did not return, that is done on a thread of its own, once the
 * device's work has ended, and never on the control thread, which must go on answering. */
struct late_free {
    char *map, *pool;
    uint64_t map_len, ctx, pool_len, pool_ctx;
};

static void *late_free_run(void *arg)
{
    struct late_free *f = arg;
    if (f->map)
        direct_unmap(f->map, f->map_len, f->ctx);
    if (f->pool)
        pool_unmap(f->pool, f->pool_len, f->pool_ctx);
    free(f);
    return NULL;
}

static int free_later(struct op *op)
{
    struct late_free *f = calloc(1, sizeof *f);
    if (!f)
        return -1;
    f->map = op->map;
    f->map_len = op->map_len;
    f->ctx = op->c.nctx ? op->c.ctxs[0] : 0;
    if (op->nl && K.pool) { /* the device may still copy into it: not kept for the next command */
        f->pool = K.pool;
        f->pool_len = K.pool_len;
        f->pool_ctx = K.pool_ctx;
        K.pool = NULL;
        K.pool_len = K.staging_len = 0;
    }
    int e = shim_spawn_detached(late_free_run, f, 0);
    if (e) {
        free(f);
        return -1;
    }
    return 0;
}

static void op_close(struct op *op)
{
    if (op->map && op->map == S.map) /* a failed unsuspend: the image stays pinned for the next try */
        op->map = NULL;
    if (op->simg && op->map == K.simg && !S.kept) { /* a suspend that failed: the image stays kept */
        if (op->stuck) { /* unless the device may still copy into it: freed once it has finished */
            K.simg = NULL;
            K.simg_len = 0;
            close(K.simg_fd);
            K.simg_fd = -1;
        } else {
            op->map = NULL;
        }
    }
    if ((op->stuck || op->failed) && op->paused) { /* first of all: the job goes on */
        gputrace_shim_resume();
        op->paused = 0;
    }
    if (!op->stuck && op->failed && (op->map || op->nl)) {
        /* Freed here, as after a success, unless the device's work does not end soon (it may wait on
         * another process), which the copy's own synchronization would have said. */
        uint64_t ns;
        const char *e = op->c.nctx ? sync_bounded(&op->c, op->o.timeout_ms < 2000 ? op->o.timeout_ms : 2000, &ns) : NULL;
        op->stuck = e != NULL;
    }
    if (op->stuck && (op->map || op->nl)) {
        if (free_later(op) != 0)
            shim_log("cannot start a thread to free the pinned copy buffers: they stay allocated");
        op->map = NULL;
        op->nl = 0;
    }
    if (op->map) /* after the gate reopened: unpinning and unmapping are no part of the freeze */
        direct_unmap(op->map, op->map_len, op->c.nctx ? op->c.ctxs[0] : 0);
    if (op->paused)
        gputrace_shim_resume();
    if (op->own_fd && op->fd >= 0)
        close(op->fd);
    if (op->dg && op->dg == K.dg && op->stuck) /* the device may still use its scratch: never freed */
        K.dg = NULL, K.dg_nctx = 0;
    else if (op->dg && op->dg != K.dg && op->dg_lost && !op->stuck) /* after the gate reopened */
        dg_close(op->dg);
    free(op->pieces);
    free(op->ents);
    free(op->idig);
    free(op->iheld);
    free(op->pre_off);
    free(op->bents);
    free(op->bdig);
    free(op->dig);
    free(op->held);
    free(op->c.v);
}

/* ---- one function per command */

/* A dump whose changes outgrew the pool, given back at once (nothing was copied) and made ready
 * again: everything this attempt found under the gate let go, the plan made anew while the job runs
 * (op_prepare: K.expect now says what changed). */
static void op_again(struct op *op)
{
    if (op->paused) {
        gputrace_shim_resume();
        op->paused = 0;
    }
    op->aborted_ns += now_ns() - op->t_gate;
    op->attempts++;
    op->setup_prev = op->t.setup;
    if (op->attempts >= 2)
        op->use_image = 1;
    free(op->pieces);
    free(op->dig);
    free(op->held);
    free(op->c.v);
    op->pieces = NULL, op->dig = NULL, op->held = NULL, op->c.v = NULL;
    op->np = 0, op->nd = 0, op->copied_bytes = op->copied_chunks = op->deferred = op->staging_bytes = 0;
    memset(&op->t, 0, sizeof op->t);
    op->prepared = 0;
}

static void cmd_dump(struct op *op)
{
    for (;;) {
        if ((!op->prepared && op_prepare(op)) || op_freeze(op) || op_layout(op))
            return;
        int r = op_copy(op);
        if (r < 0)
            return;
        if (!r)
            break;
        op_again(op);
    }
    op_reopen(op);
    if (op->deferred && op_writeback(op))
        return;
    op_done(op);
    identity_json(&op->b, &op->c);
    sb_printf(&op->b, "}");
}

static void cmd_restore(struct op *op)
{
    if ((!op->prepared && op_prepare(op)) || op_freeze(op) || op_layout(op) || op_copy(op))
        return;
    op_done(op);
    sb_printf(&op->b, "}");
}

/* A dump, then the VMM-served memory given back to the GPU; the gate stays closed, the image kept. */
static void cmd_suspend(struct op *op)
{
    if ((!op->prepared && op_prepare(op)) || op_freeze(op))
        return;
    /* Stream-ordered frees the streams have reached (frozen: all of them) give their memory back now:
     * it is in no record, and a suspension must leave none held. */
    vmm_reap(1);
    struct collect *c = &op->c;
    for (int i = 0; i < c->n; i++)
        if (!c->v[i].reserved && c->v[i].kind != K_VMM_MAP) {
            snprintf(op->err, sizeof op->err, "the %s allocation at %#llx is not served through the VMM API",
                     c->v[i].kind == K_DEVICE ? "device" : c->v[i].kind == K_PITCH ? "pitched"
                     : c->v[i].kind == K_ASYNC ? "stream-ordered" : "managed", (unsigned long long)c->v[i].base);
            fail(op, "unsupported", op->err);
            return;
        }
    struct own own;
    if (own_snap(&own) != 0) {
        own_free(&own);
        fail(op, "out of memory", NULL);
        return;
    }
    char why_buf[sizeof op->err];
    const char *why = own_check(&own, why_buf, sizeof why_buf);
    if (why) { /* refused before anything changed */
        snprintf(op->err, sizeof op->err, "%s", why);
        own_free(&own);
        fail(op, "unsupported", op->err);
        return;
    }
    if (op_layout(op) || op_copy(op)) {
        own_free(&own);
        return;
    }
    uint64_t tr = now_ns(), own_at = 0, own_bytes = 0;
    struct vmm_walk w = {.remap = 0};
    reg_scan(R_MEM, vmm_walk, &w);
    CUresult own_err = w.err ? CUDA_SUCCESS : own_release_all(&own, &own_at, &own_bytes);
    uint64_t release_ns = now_ns() - tr;
    if (w.err || own_err) { /* put everything back as it was: new memory, the data from the image */
        uint64_t at = 0;
        CUresult back_own = own_remap_all(&own, &at, 0);
        remap_all(&at);
        int back = run_copy(op, 1);
        own_access_all(&own);
        snprintf(op->err, sizeof op->err, "releasing the memory at %#llx failed: CUresult %d; nothing was suspended%s",
                 (unsigned long long)(w.err ? w.at : own_at), (int)(w.err ? w.err : own_err),
                 back || back_own ? " (and copying back failed)" : "");
        own_free(&own);
        fail(op, "driver error", op->err);
        return;
    }
    own_free(&own);
    w.bytes += own_bytes;
    gate_suspend(); /* the gate stays closed until unsuspend, whoever closed it */
    S.fd = op->fd;
    S.since_ns = now_ns();
    S.map = op->map;
    S.len = op->map_len;
    S.ctx = c->ctxs[0];
    S.kept = op->simg;
    op->map = NULL;   /* stays mapped and pinned until unsuspend */
    op->own_fd = 0;   /* the suspension's now */
    op->paused = 0;   /* not reopened here */
    op_done(op);
    sb_printf(&op->b, ", \"reserved_bytes\": %llu, \"release_ns\": %llu, \"image_kept\": %s, "
              "\"suspend_image_allocs\": %llu, \"suspend_image_reused\": %llu", (unsigned long long)w.bytes,
              (unsigned long long)release_ns, S.kept ? "true" : "false", K.simg_allocs, K.simg_reused);
    identity_json(&op->b, c);
    sb_printf(&op->b, "}");
}

/* New memory at the same addresses, the data back from the image, the gate reopened. On failure the
 * job stays suspended: no memory behind its addresses, the data in the image. */
static void cmd_unsuspend(struct op *op)
{
    struct own own = {0};
    if (op_prepare(op) || op_freeze(op))
        goto still_suspended;
    if (own_snap(&own) != 0) {
        fail(op, "out of memory", NULL);
        goto still_suspended;
    }
    uint64_t at = 0, tr = now_ns();
    CUresult e = remap_all(&at);
    if (!e && (e = own_remap_all(&own, &at, 1)) != CUDA_SUCCESS) {
        struct vmm_walk undo = {.remap = 0};
        reg_scan(R_MEM, vmm_walk, &undo);
    }
    uint64_t remap_ns = now_ns() - tr;
    if (e) {
        snprintf(op->err, sizeof op->err, "mapping memory at %#llx failed: CUresult %d; still suspended",
                 (unsigned long long)at, (int)e);
        fail(op, "cannot map device memory again", op->err);
        goto still_suspended;
    }
    if (op_layout(op) || op_copy(op))
        goto still_suspended;
    own_access_all(&own); /* the data are back: the program's own access flags again */
    own_free(&own);
    uint64_t suspended_ns = now_ns() - S.since_ns;
    int kept = 0;
    if (S.kept) { /* the shim's own image: kept for the next suspension where it fits the cap beside the pool */
        uint64_t cap = K.cap ? K.cap : pin_cap_default();
        kept = !K.simg_release && K.simg_len <= cap && K.pool_len <= cap - K.simg_len;
        S.kept = 0;
        if (kept)
            op->map = NULL; /* neither unpinned nor unmapped */
        else /* op_close unpins and unmaps it, after the gate reopened; the memfd goes with the mapping */
            K.simg = NULL, K.simg_len = 0, K.simg_fd = -1, K.simg_release = 0;
    }
    if (!kept)
        close(S.fd);
    S.fd = -1;
    S.map = NULL; /* op->map: unpinned and unmapped by op_close, after the gate reopened (unless kept) */
    gate_unsuspend();
    op_done(op);
    sb_printf(&op->b, ", \"remap_ns\": %llu, \"suspended_ns\": %llu, \"image_kept\": %s}",
              (unsigned long long)remap_ns, (unsigned long long)suspended_ns, kept ? "true" : "false");
    return;
still_suspended:;
    struct vmm_walk w = {.remap = 0};
    reg_scan(R_MEM, vmm_walk, &w);
    uint64_t at2, b = 0;
    own_release_all(&own, &at2, &b); /* what was mapped again goes again (the snapshot says what that is) */
    own_free(&own);
}

/* A command staged (`stage=1`): prepared while the job ran, kept for the next command of its mode
 * from the same connection with the gate held (a job's ranks: gang.py stages every rank's copy, then
 * stops them all, then copies), so that mapping and pinning its image and loading the digest kernel
 * are no part of the freeze.  Any other command of the family, or the connection closing, drops it. */
static struct op *g_staged;
static int g_staged_conn = -1;

static void op_free(struct op *op)
{
    op_close(op);
    free(op->b.p);
    free(op);
}

static void *op_free_run(void *arg)
{
    op_free(arg);
    return NULL;
}

/* Unpinning and freeing wait for the device (as after a failed copy, `free_later`): a staged command
 * is dropped when its gang failed, perhaps because a peer holds this process's collective, so that
 * is done on a thread of its own, never on the control thread. */
void dump_unstage(int conn)
{
    if (g_staged && (conn < 0 || conn == g_staged_conn)) {
        struct op *op = g_staged;
        g_staged = NULL;
        g_staged_conn = -1;
        if (shim_spawn_detached(op_free_run, op, 0) != 0)
            op_free(op);
    }
}

/* The staged op, for a command of `mode` from `conn` that holds the gate: its own words may set only
 * the timeout (the rest were given when it was staged), and an fd it passes is not needed. */
static struct op *take_staged(int mode, char *args, int fd, int have_pause, int conn)
{
    struct opts o;
    char *path;
    if (!g_staged || g_staged->mode != mode || g_staged_conn != conn || !have_pause ||
        parse_opts(args, &o, &path) != 0 || o.stage || path) {
        dump_unstage(-1);
        return NULL;
    }
    struct op *op = g_staged;
    g_staged = NULL;
    g_staged_conn = -1;
    if (fd >= 0)
        close(fd);
    if (strstr(args, "timeout="))
        op->o.timeout_ms = o.timeout_ms;
    op->have_pause = 1;
    op->staged = 1;
    op->t_gate = now_ns(); /* the freeze, as this process sees it, starts with this command */
    return op;
}

char *dump_command(int mode, char *args, int fd, int have_pause, int conn, size_t *len)
{
    struct op *op = take_staged(mode, args, fd, have_pause, conn);
    if (op) {
        fd = -1;
    } else {
        if (!(op = calloc(1, sizeof *op))) {
            if (fd >= 0)
                close(fd);
            return NULL;
        }
        op->mode = mode;
        op->restore = mode == M_RESTORE || mode == M_UNSUSPEND;
        op->have_pause = have_pause;
    }
    if (op->prepared || op_open(op, args, fd) == 0) {
        if (op->o.stage && !op->prepared) {
            if (mode == M_UNSUSPEND || have_pause) {
                fail(op, "stage=1 is for dump, restore and suspend, before the gate closes", NULL);
            } else if (op_prepare(op) == 0) {
                op->o.stage = 0; /* the command that takes it up runs it */
                char *out = NULL;
                struct sbuf r = {0};
                sb_printf(&r, "{\"ok\": true, \"staged\": \"%s\", \"direct\": %s, \"digests\": %s, \"setup_ns\": %llu}",
                          mode_name[mode], op->map ? "true" : "false", op->dg ? "true" : "false",
                          (unsigned long long)op->t.setup);
                if (!r.oom && r.p) {
                    out = r.p;
                    *len = r.len;
                } else {
                    free(r.p);
                }
                g_staged = op;
                g_staged_conn = conn;
                return out;
            }
        } else if (mode == M_DUMP) {
            cmd_dump(op);
        } else if (mode == M_RESTORE) {
            cmd_restore(op);
        } else if (mode == M_SUSPEND) {
            cmd_suspend(op);
        } else {
            cmd_unsuspend(op);
        }
    }
    op_close(op);
    char *out = op->b.oom || !op->b.p ? NULL : op->b.p;
    if (!out)
        free(op->b.p);
    else
        *len = op->b.len;
    free(op);
    return out;
}

/* `rehome` with an fd: a suspended job's image moves from the memfd it was copied into to a file
 * holding the same bytes (`gputrace suspend -o DIR` writes it, checksummed, while the job waits), so
 * the host memory goes back to the system and unsuspend reads the file.  The shim checks that the
 * file is the same size and starts with the same header before it lets go of the memfd. */
const char *dump_rehome(int fd)
{
    if (!gate_suspended())
        return "not suspended";
    struct stat a, b;
    if (fstat(S.fd, &a) != 0 || fstat(fd, &b) != 0 || a.st_size != b.st_size)
        return "the file is not the size of the suspended image";
    char x[IMG_ALIGN], y[IMG_ALIGN];
    size_t n = a.st_size < (off_t)IMG_ALIGN ? (size_t)a.st_size : IMG_ALIGN;
    if (pread(S.fd, x, n, 0) != (ssize_t)n || pread(fd, y, n, 0) != (ssize_t)n || memcmp(x, y, n))
        return "the file does not hold the suspended image";
    if (S.map) {
        direct_unmap(S.map, S.len, S.ctx);
        S.map = NULL;
    }
    close(S.fd);
    if (S.kept) { /* the kept image was that memory: given back, as -o asks */
        K.simg = NULL;
        K.simg_fd = -1;
        K.simg_len = 0;
        K.simg_release = 0;
        S.kept = 0;
    }
    S.fd = fd;
    return NULL;
}

/* `digest [digest=BYTES] [timeout=MS]` with an fd: the digests of the live memory, each allocation's
 * chunks in address order, written into the fd (16 bytes a chunk) for a restore to choose which
 * chunks of a checkpoint it must read: those whose digest differs.  The gate is closed while the
 * kernel reads (no allocation can be freed under it) and reopened before the digests are written;
 * the work the program had submitted is not waited for, so a chunk it writes meanwhile may read
 * either way: the restore's own comparison, under its gate, is what decides (a chunk that then
 * differs and was not read is refused there, "stale", and nothing is copied). */
char *dump_digest(char *args, int fd, int have_pause, size_t *len)
{
    struct opts o;
    char *path;
    struct sbuf b = {0};
    struct collect c = {0};
    struct dg_span *sp = NULL;
    uint64_t *dig = NULL, nd = 0;
    char why[160] = "";
    int paused = 0;
    if (parse_opts(args, &o, &path) != 0 || path || fd < 0 || !o.digest) {
        json_err(&b, "usage: digest [digest=BYTES] [timeout=MS], with the fd to write the digests into", NULL);
        goto out;
    }
    if (gate_suspended()) {
        json_err(&b, "suspended", "the process's device memory is off the GPU");
        goto out;
    }
    if (!drv_load() || collect(&c) != 0) {
        json_err(&b, "cannot digest", "the driver lacks a function the copy needs, or out of memory");
        goto out;
    }
    size_t need[64] = {0};
    for (int i = 0; i < c.n; i++)
        for (int k = 0; k < c.nctx; k++)
            if (c.ctxs[k] == c.v[i].ctx)
                need[k] += (c.v[i].size + o.digest - 1) / o.digest;
    for (int k = 0; k < c.nctx; k++)
        need[k] += need[k] / 8 + 16;
    keep_forget_gone(&c);
    struct digester *dg = c.n ? keep_digester(c.ctxs, need, c.nctx, why, sizeof why) : NULL;
    if (c.n && !dg) {
        json_err(&b, "cannot digest", why);
        goto out;
    }
    uint64_t t0 = now_ns();
    if (!have_pause) {
        int r = gputrace_shim_pause(o.timeout_ms);
        if (r != 0) {
            json_err(&b, r == -2 ? "already paused" : "busy", r == -2 ? "another client holds a pause of this process"
                     : "driver calls still in flight at the timeout; the gate is open again");
            goto out;
        }
        paused = 1;
    }
    free(c.v);
    if (collect(&c) != 0) {
        json_err(&b, "out of memory", NULL);
        goto out;
    }
    nd = n_digests(c.n ? &c.v[0].size : NULL, sizeof *c.v, c.n, o.digest);
    if (!(sp = calloc(nd ? nd : 1, sizeof *sp)) || !(dig = calloc(nd ? nd : 1, 16))) {
        json_err(&b, "out of memory", NULL);
        goto out;
    }
    uint64_t k = 0, digest_ns = 0;
    for (int i = 0; i < c.n; i++)
        for (uint64_t x = 0; x < c.v[i].size; x += o.digest)
            sp[k++] = (struct dg_span){.ptr = c.v[i].base + x, .ctx = c.v[i].ctx,
                                       .len = c.v[i].size - x < o.digest ? c.v[i].size - x : o.digest};
    const char *e = nd ? dg_run(dg, sp, nd, dig, &digest_ns, why, sizeof why) : NULL;
    if (paused) {
        gputrace_shim_resume();
        paused = 0;
    }
    uint64_t freeze_ns = now_ns() - t0;
    if (e) {
        if (dg == K.dg)
            K.dg = NULL, K.dg_nctx = 0; /* made again next time; never freed while the device may use it */
        json_err(&b, "cannot digest", e);
        goto out;
    }
    int we = ftruncate(fd, (off_t)(nd * 16)) ? errno : io_all(0, fd, dig, nd * 16, 0);
    if (we) {
        json_err(&b, "writing the digests failed", strerror(we));
        goto out;
    }
    sb_printf(&b, "{\"ok\": true, \"digest_chunk\": %llu, \"chunks\": %llu, \"allocations\": %d, \"digest_ns\": %llu, "
              "\"freeze_ns\": %llu, \"digester_loads\": %llu}", (unsigned long long)o.digest, (unsigned long long)nd,
              c.n, (unsigned long long)digest_ns, (unsigned long long)freeze_ns, K.dg_loads);
out:
    if (paused)
        gputrace_shim_resume();
    if (fd >= 0)
        close(fd);
    free(sp);
    free(dig);
    free(c.v);
    if (b.oom || !b.p) {
        free(b.p);
        return NULL;
    }
    *len = b.len;
    return b.p;
}

/* `release`: what is kept between commands given back. */
char *dump_release_command(size_t *len)
{
    struct sbuf b = {0};
    dump_release(&b);
    if (b.oom || !b.p) {
        free(b.p);
        return NULL;
    }
    *len = b.len;
    return b.p;
}
