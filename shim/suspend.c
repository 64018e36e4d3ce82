/* Suspension: between `suspend` and `unsuspend` the gate stays closed (owned by no connection), the
 * image stays open here, and the VMM-served allocations have no memory behind their addresses; nor
 * have the program's own VMM mappings (their allocations released, the reservations kept).
 *
 * `suspend` is a dump (dump.c's steps) followed by releasing that memory; `unsuspend` maps new memory
 * at the same addresses (vmm.c) and copies the image back.  `rehome` moves a suspended image into a file. */
#include "dump_int.h"

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

struct suspension S = {.fd = -1};

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

/* How many bytes of physical allocation p, from its offset 0, the mappings the program made readable
 * cover without a gap, in *covered.  0, or -1: out of memory. */
static int own_covered(const struct own *o, const struct rec *p, uint64_t *covered)
{
    uint64_t (*r)[2] = calloc((size_t)o->nm + 1, sizeof *r);
    if (!r)
        return -1;
    int n = 0;
    for (int k = 0; k < o->nm; k++)
        if (o->m[k].handle == p->key && (o->m[k].access & CU_MEM_ACCESS_FLAGS_PROT_READ))
            r[n][0] = o->m[k].offset, r[n][1] = o->m[k].offset + o->m[k].size, n++;
    qsort(r, (size_t)n, sizeof *r, by_offset);
    *covered = 0;
    for (int k = 0; k < n && r[k][0] <= *covered; k++)
        if (r[k][1] > *covered)
            *covered = r[k][1];
    free(r);
    return 0;
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
        uint64_t covered;
        if (own_covered(o, p, &covered) != 0)
            return "out of memory";
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

/* Every allocation must be one whose memory can be released with its address kept: served through the
 * VMM API (GPUTRACE_SHIM_VMM=1), or a VMM mapping the program made itself.  NULL, or why not (in err). */
static const char *unserved(const struct collect *c, char *err, size_t len)
{
    for (int i = 0; i < c->n; i++)
        if (!c->v[i].reserved && c->v[i].kind != K_VMM_MAP) {
            snprintf(err, len, "the %s allocation at %#llx is not served through the VMM API",
                     c->v[i].kind == K_DEVICE ? "device" : c->v[i].kind == K_PITCH ? "pitched"
                     : c->v[i].kind == K_ASYNC ? "stream-ordered" : "managed", (unsigned long long)c->v[i].base);
            return err;
        }
    return NULL;
}

static int suspend_check_served(struct op *op)
{
    return unserved(&op->c, op->err, sizeof op->err) ? fail(op, "unsupported", op->err) : 0;
}

/* The program's own VMM memory, taken and checked (refused before anything changed); nothing to
 * free on failure. */
static int suspend_own_snap(struct op *op, struct own *own)
{
    if (own_snap(own) != 0) {
        own_free(own);
        return fail(op, "out of memory", NULL);
    }
    char why_buf[sizeof op->err];
    const char *why = own_check(own, why_buf, sizeof why_buf);
    if (why) { /* refused before anything changed */
        snprintf(op->err, sizeof op->err, "%s", why);
        own_free(own);
        return fail(op, "unsupported", op->err);
    }
    return 0;
}

/* Once the data are in the image: the memory of every allocation given back to the GPU (the
 * VMM-served ones, then the program's own), *bytes of it.  Where that fails, everything is put back
 * as it was (new memory, the data from the image) and nothing is suspended. */
static int suspend_release(struct op *op, struct own *own, uint64_t *bytes, uint64_t *release_ns)
{
    uint64_t tr = now_ns(), own_at = 0, own_bytes = 0;
    struct vmm_walk w = {.remap = 0};
    reg_scan(R_MEM, vmm_walk, &w);
    CUresult own_err = w.err ? CUDA_SUCCESS : own_release_all(own, &own_at, &own_bytes);
    *release_ns = now_ns() - tr;
    if (w.err || own_err) { /* put everything back as it was: new memory, the data from the image */
        uint64_t at = 0;
        CUresult back_own = own_remap_all(own, &at, 0);
        remap_all(&at);
        int back = run_copy(op, 1);
        own_access_all(own);
        snprintf(op->err, sizeof op->err, "releasing the memory at %#llx failed: CUresult %d; nothing was suspended%s",
                 (unsigned long long)(w.err ? w.at : own_at), (int)(w.err ? w.err : own_err),
                 back || back_own ? " (and copying back failed)" : "");
        return fail(op, "driver error", op->err);
    }
    *bytes = w.bytes + own_bytes;
    return 0;
}

/* The suspension begins: the gate stays closed until unsuspend, whoever closed it, and the image
 * (mapped and pinned, where it was) is the suspension's. */
static void suspend_hold(struct op *op)
{
    gate_suspend(); /* the gate stays closed until unsuspend, whoever closed it */
    S.fd = op->fd;
    S.since_ns = now_ns();
    S.map = op->map;
    S.len = op->map_len;
    S.ctx = op->c.ctxs[0];
    S.kept = op->simg;
    op->map = NULL;   /* stays mapped and pinned until unsuspend */
    op->own_fd = 0;   /* the suspension's now */
    op->paused = 0;   /* not reopened here */
}

/* A dump, then the VMM-served memory given back to the GPU; the gate stays closed, the image kept. */
void cmd_suspend(struct op *op)
{
    if ((!op->prepared && op_prepare(op)) || op_freeze(op))
        return;
    /* Stream-ordered frees the streams have reached (frozen: all of them) give their memory back now:
     * it is in no record, and a suspension must leave none held. */
    vmm_reap(1);
    struct own own;
    if (suspend_check_served(op) || suspend_own_snap(op, &own))
        return;
    uint64_t bytes = 0, release_ns = 0;
    int failed = op_layout(op) || op_copy(op) || suspend_release(op, &own, &bytes, &release_ns);
    own_free(&own);
    if (failed)
        return;
    suspend_hold(op);
    op_done(op);
    sb_printf(&op->b, ", \"reserved_bytes\": %llu, \"release_ns\": %llu, \"image_kept\": %s, "
              "\"suspend_image_allocs\": %llu, \"suspend_image_reused\": %llu", (unsigned long long)bytes,
              (unsigned long long)release_ns, S.kept ? "true" : "false", K.simg_allocs, K.simg_reused);
    identity_json(&op->b, &op->c);
    sb_printf(&op->b, "}");
}

/* ---- `prepare_suspend`: the kept image made ahead
 *
 * A job's first suspension pays for its image inside the command: a memfd the size of its device
 * memory, its pages allocated, mapped and registered with the driver (about 0.35 s a GiB on an H100:
 * 5.7 s at 16 GiB, against 0.32 s for the copy itself), while the GPU it is to free stays held.
 * `prepare_suspend` makes that image now, while the job runs: the one `suspend keep=1` would make
 * (keep_simg, sized by image_len for the memory the job holds, with its sixteenth more room), which
 * the next suspension then finds and copies straight into (`setup_ns` near 0).  Nothing is gated:
 * the job goes on running through it (the control thread allocates, maps and registers, as a
 * checkpoint's preparation does; other commands wait behind it on the socket).  Idempotent: an image
 * kept already that holds what the job has now is left as it is.  Refused, with nothing made or
 * changed, where the suspension itself would be (memory not served through the VMM API, the program's
 * own VMM memory that cannot be made again), where the image and the checkpoints' pool would not fit
 * the cap together (the image would not be kept after the suspension it serves), where host memory
 * is short, and while the gate is closed or a command is staged (a checkpoint or suspension under
 * way: pinning for seconds would lengthen its freeze).  `release` gives it back, as it does any kept
 * image. */

/* MemAvailable and MemTotal of /proc/meminfo, in bytes; -1 where they cannot be read. */
static int host_memory(uint64_t *avail, uint64_t *total)
{
    char buf[4096];
    int fd = open("/proc/meminfo", O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0)
        return -1;
    buf[n] = 0;
    char *a = strstr(buf, "MemAvailable:"), *t = strstr(buf, "MemTotal:");
    if (!a || !t)
        return -1;
    *avail = strtoull(a + 13, NULL, 10) << 10;
    *total = strtoull(t + 9, NULL, 10) << 10;
    return 0;
}

/* What would refuse a suspension of the job as it is now, before anything is made: NULL, or the
 * error (the detail in err). */
static const char *prepare_refusal(const struct collect *c, char *err, size_t len)
{
    if (c->n && !c->nctx) {
        snprintf(err, len, "device memory but no context to copy it in");
        return "unsupported";
    }
    if (unserved(c, err, len))
        return "unsupported";
    int held = atomic_load(&untracked_held);
    if (held > 0) {
        const char *what = atomic_load(&untracked_what);
        snprintf(err, len, "the program holds device memory the shim does not carry (%d made by %s or the like: CUDA "
                 "arrays, memory imported from another process); a suspension would leave it out", held,
                 what ? what : "?");
        return "unsupported";
    }
    struct own own;
    if (own_snap(&own) != 0) {
        own_free(&own);
        snprintf(err, len, "out of memory");
        return "out of memory";
    }
    const char *why = own_check(&own, err, len);
    if (why && why != err)
        snprintf(err, len, "%s", why);
    own_free(&own);
    return why ? "unsupported" : NULL;
}

/* Whether the image, `room` bytes, can be kept beside the pool within the cap, and host memory spared
 * for it: NULL, or the error (the detail in err). */
static const char *prepare_fits(uint64_t room, uint64_t cap, char *err, size_t len)
{
    if (room > cap || K.pool_len > cap - room) {
        snprintf(err, len, "the suspension's image needs %llu bytes pinned (the device memory the job holds and a "
                 "sixteenth more room), which with the %llu bytes of the checkpoints' pinned pool exceeds the pin "
                 "cap of %llu bytes (GPUTRACE_SHIM_PIN_CAP in the job's environment); nothing was pinned",
                 (unsigned long long)room, (unsigned long long)K.pool_len, (unsigned long long)cap);
        return "over the pin cap";
    }
    uint64_t avail, total;
    uint64_t freed = K.simg && !S.kept ? K.simg_len : 0; /* a smaller kept image gives way first */
    if (host_memory(&avail, &total) == 0 && room > freed && room - freed + total / 16 > avail) {
        snprintf(err, len, "the suspension's image needs %llu bytes of host memory and %llu are available (a "
                 "sixteenth of the host's %llu kept free); nothing was pinned", (unsigned long long)room,
                 (unsigned long long)avail, (unsigned long long)total);
        return "host memory";
    }
    return NULL;
}

static void prepare_reply(struct sbuf *b, int made, const struct collect *c, uint64_t cap, uint64_t setup_ns)
{
    uint64_t bytes = 0;
    for (int i = 0; i < c->n; i++)
        bytes += c->v[i].size;
    sb_printf(b, "{\"ok\": true, \"made\": %s, \"allocations\": %d, \"bytes\": %llu, \"image_bytes\": %llu, "
                 "\"setup_ns\": %llu, \"pin_cap\": %llu, \"kept_pinned_bytes\": %llu, \"suspend_image_allocs\": %llu, "
                 "\"suspend_image_prepared\": %llu}", made ? "true" : "false", c->n, (unsigned long long)bytes,
              (unsigned long long)K.simg_len, (unsigned long long)setup_ns, (unsigned long long)cap,
              (unsigned long long)K.pool_len, K.simg_allocs, K.simg_prepared);
}

static void prepare_suspend(struct sbuf *b)
{
    if (gate_suspended()) {
        json_err(b, "suspended", "the device memory is off the GPU already, in the suspension's image");
        return;
    }
    if (gate_paused() || dump_staged()) {
        json_err(b, "busy", "a checkpoint, a suspension or a pause holds this process's gate, or is about to: "
                            "pinning now would lengthen its freeze; nothing was pinned, try again once it has ended");
        return;
    }
    if (!drv_load()) {
        json_err(b, "the driver lacks a function the copy needs", NULL);
        return;
    }
    struct collect c = {0};
    char err[320];
    if (collect(&c) != 0) {
        free(c.v);
        json_err(b, "out of memory", NULL);
        return;
    }
    keep_forget_gone(&c);
    uint64_t cap = pin_cap_default(); /* what the suspensions are given (they pass no pin_cap=) */
    const char *e = prepare_refusal(&c, err, sizeof err);
    if (e) {
        json_err(b, e, err);
    } else if (!c.n) {
        prepare_reply(b, 0, &c, cap, 0); /* nothing to copy: a suspension would make no image either */
    } else {
        uint64_t len = image_len(c.v, c.n, 0, 0), ctx = c.ctxs[0]; /* as op_prepare sizes a suspension's */
        if (simg_fits(len, ctx)) {
            prepare_reply(b, 0, &c, cap, 0);
        } else if ((e = prepare_fits(simg_len_for(len), cap, err, sizeof err))) {
            json_err(b, e, err);
            if (!b->oom && b->len) { /* what it needs, for the client's hint: the closing brace reopened */
                b->len--;
                sb_printf(b, ", \"needs_bytes\": %llu, \"pin_cap\": %llu, \"kept_pinned_bytes\": %llu}",
                          (unsigned long long)simg_len_for(len), (unsigned long long)cap,
                          (unsigned long long)K.pool_len);
            }
        } else {
            uint64_t t0 = now_ns();
            if (keep_simg(len, ctx) != 0) {
                json_err(b, "cannot pin the suspension's image", "memfd_create, allocating its pages or "
                         "cuMemHostRegister failed (host memory); nothing is kept, and the next suspension makes "
                         "its image itself");
            } else {
                K.simg_prepared++;
                prepare_reply(b, 1, &c, cap, now_ns() - t0);
            }
        }
    }
    free(c.v);
}

/* `prepare_suspend`: the reply, malloc'ed (NULL: out of memory). */
char *suspend_prepare_command(size_t *len)
{
    struct sbuf b = {0};
    prepare_suspend(&b);
    if (b.oom || !b.p) {
        free(b.p);
        return NULL;
    }
    *len = b.len;
    return b.p;
}

/* New memory behind every suspended address: the VMM-served allocations' and the program's own (all
 * of it, or, on failure, none). */
static int unsuspend_remap(struct op *op, struct own *own, uint64_t *remap_ns)
{
    uint64_t at = 0, tr = now_ns();
    CUresult e = remap_all(&at);
    if (!e && (e = own_remap_all(own, &at, 1)) != CUDA_SUCCESS) {
        struct vmm_walk undo = {.remap = 0};
        reg_scan(R_MEM, vmm_walk, &undo);
    }
    *remap_ns = now_ns() - tr;
    if (e) {
        snprintf(op->err, sizeof op->err, "mapping memory at %#llx failed: CUresult %d; still suspended",
                 (unsigned long long)at, (int)e);
        return fail(op, "cannot map device memory again", op->err);
    }
    return 0;
}

/* The data are back: the suspension lets go of its image, which the shim keeps (its own, where it fits
 * the cap beside the pool) or gives back.  Returns whether it is kept. */
static int unsuspend_image(struct op *op)
{
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
    return kept;
}

/* New memory at the same addresses, the data back from the image, the gate reopened. On failure the
 * job stays suspended: no memory behind its addresses, the data in the image. */
void cmd_unsuspend(struct op *op)
{
    struct own own = {0};
    if (op_prepare(op) || op_freeze(op))
        goto still_suspended;
    if (own_snap(&own) != 0) {
        fail(op, "out of memory", NULL);
        goto still_suspended;
    }
    uint64_t remap_ns;
    if (unsuspend_remap(op, &own, &remap_ns) || op_layout(op) || op_copy(op))
        goto still_suspended;
    own_access_all(&own); /* the data are back: the program's own access flags again */
    own_free(&own);
    uint64_t suspended_ns = now_ns() - S.since_ns;
    int kept = unsuspend_image(op);
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
