/* What is kept between a job's commands, so that a checkpoint after the first pays none of it again:
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
 * PIN_CAP_DEFAULT.  `release` (control.c) gives all of it back; the process's exit does too.
 *
 * Also kept, within the same cap: a suspension's image (`suspend keep=1`, keep_simg; or made ahead,
 * while the job runs, by `prepare_suspend` in suspend.c), so that the next suspension copies straight
 * into memory already pinned; and what the next incremental dump is planned for (expect_note).
 * `struct kept` in dump_int.h says what each field holds. */
#include "dump_int.h"

#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

struct kept K = {.simg_fd = -1};

uint64_t pin_cap_default(void)
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

void pool_unmap(char *m, uint64_t len, uint64_t ctx)
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
void keep_forget_gone(const struct collect *c)
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
struct digester *keep_digester(const uint64_t *ctxs, const size_t *need, int nctx, char *why, size_t wl)
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
int keep_pool(uint64_t staging, uint64_t initial, uint64_t cap, uint64_t ctx)
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
uint64_t defer_max(uint64_t staging, uint64_t cap)
{
    if (K.simg && !(!S.kept && staging + K.simg_len > cap) && K.simg_len < cap)
        cap -= K.simg_len;
    return staging > cap ? 0 : cap - staging;
}

/* An incremental dump found `bytes` changed: what the next one is planned for. */
void expect_note(uint64_t bytes)
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
                 "\"suspend_image_prepared\": %llu, \"expect_bytes\": %llu, \"staging_copied_bytes\": %llu, "
                 "\"outgrown\": %llu}",
              (unsigned long long)K.pool_len, (unsigned long long)K.staging_len,
              (unsigned long long)(K.cap ? K.cap : pin_cap_default()), K.dg ? "true" : "false", K.dg_loads, K.pool_allocs, K.reused,
              (unsigned long long)K.simg_len, K.simg_allocs, K.simg_reused, K.simg_prepared,
              (unsigned long long)K.expect,
              K.staging_copied, K.outgrown);
}

/* The kept suspension image given back (never while a suspension uses it). */
void simg_drop(void)
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

/* The length of the kept image made for a suspension of `len` bytes: a sixteenth more, room for what
 * the job allocates later (a job that grows more gets a new one at its next suspension). */
uint64_t simg_len_for(uint64_t len)
{
    return round_up(len ? len + len / 16 : IMG_ALIGN, IMG_ALIGN);
}

/* Whether the kept image serves a suspension of `len` bytes in context `ctx` as it is. */
int simg_fits(uint64_t len, uint64_t ctx)
{
    return K.simg && K.simg_len >= len && K.simg_ctx == ctx;
}

/* The image a `suspend keep=1` copies into: the kept one where it holds `len` bytes and its context
 * is `ctx`, else a new memfd of the shim's, its pages allocated, mapped and registered now (while the
 * job runs; what every suspension without it pays, unless `prepare_suspend` made it ahead).  0, or
 * -1 with nothing kept. */
int keep_simg(uint64_t len, uint64_t ctx)
{
    if (simg_fits(len, ctx)) {
        K.simg_reused++;
        return 0;
    }
    simg_drop();
    len = simg_len_for(len);
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
