/* What changed: the digests of the live memory (computed on the device by digest.c's digester),
 * compared with an earlier image's, so that a copy moves only the chunks that differ.
 *
 * With digests (digest=BYTES, the default), a dump hashes every chunk on the device under the gate;
 * given the digests of an earlier image (base=1: the fd then holds that image's header, entries and
 * digests), it copies only the chunks whose digest differs.  A restore of an image with digests
 * hashes the live memory the same way and copies only the chunks that differ (diff=0: everything).
 * The `digest` command computes the live memory's digests alone, for the checkpointer to choose which
 * chunks of a checkpoint a restore must read.  Digests that cannot be taken fail no checkpoint: the
 * command copies everything instead and its reply says why (digest_why). */
#include "dump_int.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* Chunks of `dchunk` bytes in each context's allocations, and some more (what the job may allocate
 * before the gate closes): what the digester's scratch must hold, into need[] (zeroed). */
static void digest_need(const struct collect *c, uint64_t dchunk, size_t *need)
{
    for (int i = 0; i < c->n; i++)
        for (int k = 0; k < c->nctx; k++)
            if (c->ctxs[k] == c->v[i].ctx)
                need[k] += (c->v[i].size + dchunk - 1) / dchunk;
    for (int k = 0; k < c->nctx; k++)
        need[k] += need[k] / 8 + 16; /* what the job may allocate before the gate closes */
}

/* Every allocation's chunks of `dchunk` bytes in address order, nd of them: what the digester reads.
 * NULL: out of memory. */
static struct dg_span *digest_spans(const struct collect *c, uint64_t dchunk, uint64_t nd)
{
    struct dg_span *sp = calloc(nd ? nd : 1, sizeof *sp);
    if (!sp)
        return NULL;
    uint64_t k = 0;
    for (int i = 0; i < c->n; i++)
        for (uint64_t o = 0; o < c->v[i].size; o += dchunk)
            sp[k++] = (struct dg_span){.ptr = c->v[i].base + o, .ctx = c->v[i].ctx,
                                       .len = c->v[i].size - o < dchunk ? c->v[i].size - o : dchunk};
    return sp;
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
void digests_prepare(struct op *op)
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
    digest_need(c, op->dchunk, need);
    op->dg = keep_digester(c->ctxs, need, c->nctx, op->dg_why, sizeof op->dg_why);
    if (!op->dg && op->mode == M_DUMP)
        op->dchunk = 0; /* the image says it has none */
}

/* Which chunks to copy (op->held): those whose digest differs from `want`, the reference's (the
 * base's for a dump, the image's for a restore) for the same allocation; every chunk of one the
 * reference lacks.  The live allocations and the reference's entries are walked together, both in
 * address order. */
static void mark_changed(struct op *op, const uint64_t *want)
{
    struct collect *c = &op->c;
    const struct img_ent *ref = op->restore ? op->ents : op->bents;
    uint64_t nref = op->restore ? op->h.count : op->bh.count, r = 0, rd = 0, k = 0;
    for (int i = 0; i < c->n; i++) {
        uint64_t n = (c->v[i].size + op->dchunk - 1) / op->dchunk;
        for (; r < nref && ref[r].base < c->v[i].base; r++)
            rd += (ref[r].size + op->dchunk - 1) / op->dchunk;
        int same = r < nref && ref[r].base == c->v[i].base && ref[r].size == c->v[i].size;
        for (uint64_t x = 0; x < n; x++, k++)
            op->held[k] = !same || op->dig[2 * k] != want[2 * (rd + x)] || op->dig[2 * k + 1] != want[2 * (rd + x) + 1];
    }
}

/* The live memory's digests (op->dig), and which chunks to copy (op->held): for a dump given a base,
 * those whose digest differs from the base's for the same allocation (every chunk of one the base
 * lacks); for a restore, those that differ from the image's.  Returns whether digests were used; when
 * not, op->dg_why says why and everything is copied. */
int digests_compare(struct op *op)
{
    /* (No digester where the job held nothing before the freeze: holding something now, the command was
     * refused busy, op_layout.) */
    if (!op->dg || !op->nd)
        return 0;
    struct dg_span *sp = digest_spans(&op->c, op->dchunk, op->nd);
    if (!sp) {
        snprintf(op->dg_why, sizeof op->dg_why, "out of memory");
        return 0;
    }
    if (!dg_covers(op->dg, sp, op->nd)) { /* nothing run: the digester is kept, made larger next time */
        free(sp);
        snprintf(op->dg_why, sizeof op->dg_why, "the process allocated device memory meanwhile (more chunks than "
                 "the digester was made for, or in a context made since)");
        return 0;
    }
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
    mark_changed(op, want);
    return 1;
}

/* ---- the `digest` command */

struct digest_cmd {
    struct opts o;
    struct collect c;
    struct digester *dg;
    struct dg_span *sp;
    uint64_t *dig, nd, digest_ns, freeze_ns;
    int paused; /* this command closed the gate, and must reopen it */
    struct sbuf b; /* the reply */
};

/* While the job runs: the digester (the kept one, or made for the chunks there are now).  0, or -1
 * with the reply made. */
static int digest_ready(struct digest_cmd *d)
{
    char why[160] = "";
    if (!drv_load() || collect(&d->c) != 0) {
        json_err(&d->b, "cannot digest", "the driver lacks a function the copy needs, or out of memory");
        return -1;
    }
    size_t need[64] = {0};
    digest_need(&d->c, d->o.digest, need);
    keep_forget_gone(&d->c);
    d->dg = d->c.n ? keep_digester(d->c.ctxs, need, d->c.nctx, why, sizeof why) : NULL;
    if (d->c.n && !d->dg) {
        json_err(&d->b, "cannot digest", why);
        return -1;
    }
    return 0;
}

/* Under the gate (closed here unless the caller holds it), for the kernel alone: the digests of the
 * chunks there are then, into d->dig.  0, or -1 with the reply made. */
static int digest_frozen(struct digest_cmd *d, int have_pause)
{
    char why[160] = "";
    uint64_t t0 = now_ns();
    if (!have_pause) {
        int r = gputrace_shim_pause(d->o.timeout_ms);
        if (r != 0) {
            json_err(&d->b, r == -2 ? "already paused" : "busy",
                     r == -2 ? "another client holds a pause of this process"
                             : "driver calls still in flight at the timeout; the gate is open again");
            return -1;
        }
        d->paused = 1;
    }
    free(d->c.v);
    if (collect(&d->c) != 0) {
        json_err(&d->b, "out of memory", NULL);
        return -1;
    }
    struct collect *c = &d->c;
    d->nd = n_digests(c->n ? &c->v[0].size : NULL, sizeof *c->v, c->n, d->o.digest);
    if (!(d->sp = digest_spans(c, d->o.digest, d->nd)) || !(d->dig = calloc(d->nd ? d->nd : 1, 16))) {
        json_err(&d->b, "out of memory", NULL);
        return -1;
    }
    if (!dg_covers(d->dg, d->sp, d->nd)) {
        /* The job allocated between digest_ready and the gate: more than the digester was made for, or
         * in a context made since, or anything at all where it held nothing then (no digester: none
         * is made for nothing).  Refused as a dump is then, the gate reopened (dump_digest), nothing
         * run; the next try is prepared for what it holds now. */
        json_err(&d->b, "busy", "the process allocated device memory meanwhile; try again");
        return -1;
    }
    const char *e = d->nd ? dg_run(d->dg, d->sp, d->nd, d->dig, &d->digest_ns, why, sizeof why) : NULL;
    if (d->paused) {
        gputrace_shim_resume();
        d->paused = 0;
    }
    d->freeze_ns = now_ns() - t0;
    if (e) {
        if (d->dg == K.dg)
            K.dg = NULL, K.dg_nctx = 0; /* made again next time; never freed while the device may use it */
        json_err(&d->b, "cannot digest", e);
        return -1;
    }
    return 0;
}

/* After the gate reopened: the digests written into the fd, 16 bytes a chunk.  0, or -1 with the reply
 * made. */
static int digest_write(struct digest_cmd *d, int fd)
{
    int we = ftruncate(fd, (off_t)(d->nd * 16)) ? errno : io_all(0, fd, d->dig, d->nd * 16, 0);
    if (we) {
        json_err(&d->b, "writing the digests failed", strerror(we));
        return -1;
    }
    return 0;
}

/* `digest [digest=BYTES] [timeout=MS]` with an fd: the digests of the live memory, each allocation's
 * chunks in address order, written into the fd (16 bytes a chunk) for a restore to choose which
 * chunks of a checkpoint it must read: those whose digest differs.  The gate is closed while the
 * kernel reads (no allocation can be freed under it) and reopened before the digests are written;
 * the work the program had submitted is not waited for, so a chunk it writes meanwhile may read
 * either way: the restore's own comparison, under its gate, is what decides (a chunk that then
 * differs and was not read is refused there, "stale", and nothing is copied).  Where the job allocated
 * between the preparation and the gate, beyond what the digester was made for (anything, where it
 * held nothing then), the command is refused as a dump is then, `busy` ("...allocated device memory
 * meanwhile; try again"), with the gate reopened and nothing run: the caller tries again. */
char *dump_digest(char *args, int fd, int have_pause, size_t *len)
{
    struct digest_cmd d = {0};
    char *path;
    if (parse_opts(args, &d.o, &path) != 0 || path || fd < 0 || !d.o.digest)
        json_err(&d.b, "usage: digest [digest=BYTES] [timeout=MS], with the fd to write the digests into", NULL);
    else if (gate_suspended())
        json_err(&d.b, "suspended", "the process's device memory is off the GPU");
    else if (digest_ready(&d) == 0 && digest_frozen(&d, have_pause) == 0 && digest_write(&d, fd) == 0)
        sb_printf(&d.b, "{\"ok\": true, \"digest_chunk\": %llu, \"chunks\": %llu, \"allocations\": %d, "
                  "\"digest_ns\": %llu, \"freeze_ns\": %llu, \"digester_loads\": %llu}", (unsigned long long)d.o.digest,
                  (unsigned long long)d.nd, d.c.n, (unsigned long long)d.digest_ns, (unsigned long long)d.freeze_ns,
                  K.dg_loads);
    if (d.paused)
        gputrace_shim_resume();
    if (fd >= 0)
        close(fd);
    free(d.sp);
    free(d.dig);
    free(d.c.v);
    if (d.b.oom || !d.b.p) {
        free(d.b.p);
        return NULL;
    }
    *len = d.b.len;
    return d.b.p;
}
