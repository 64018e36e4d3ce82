/* Device memory out of the process and back: the `dump`, `restore`, `suspend` and `unsuspend`
 * commands on the control socket (control.c).  Each is one `struct op` (dump_int.h) taken through
 * the same steps, each a function here: op_open (its words, its image file), op_prepare (while the
 * job runs: what there is to copy, the image's space, the pinned memory), op_freeze (the gate
 * closed), op_layout (where each allocation goes in the image), op_copy (the data moved), op_done
 * (the gate reopened, the reply) and op_close (whatever the command holds given back, whichever step
 * failed).  The rest of the family: image.c (the image format), copy.c (the copy engine), kept.c
 * (what is kept between commands), suspend.c (`suspend`, `unsuspend`), changed.c (which chunks
 * changed, and `digest`).
 *
 * The gate reopens as soon as the last chunk is in the file (or on the device) and before the reply
 * is sent: whatever goes wrong afterwards (a client gone, a reply that cannot be sent) cannot leave
 * the job stopped.
 *
 * Everything here calls the driver's own entry points (never the wrappers, which would wait at the
 * gate this code closed). */
#include "dump_int.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* "lanes=N chunk=BYTES timeout=MS PATH" in any order; returns the path or NULL; -1 on a bad word. */
int parse_opts(char *args, struct opts *o, char **path)
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
        } else if (!strcmp(w, "stream=1") || !strcmp(w, "stream=0")) {
            o->stream = w[7] == '1';
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

void json_err(struct sbuf *b, const char *err, const char *detail)
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

static void timing_json(struct sbuf *b, const struct timing *t)
{
    sb_printf(b, ", \"setup_ns\": %llu, \"drain_ns\": %llu, \"sync_ns\": %llu, \"digest_ns\": %llu, \"copy_ns\": %llu, "
              "\"freeze_ns\": %llu", (unsigned long long)t->setup, (unsigned long long)t->drain,
              (unsigned long long)t->sync, (unsigned long long)t->digest, (unsigned long long)t->copy,
              (unsigned long long)t->freeze);
}

/* The driver's version and the devices of the job's contexts (name, UUID): a dump's and a suspension's
 * reply says what the image was taken from. */
void identity_json(struct sbuf *b, const struct collect *c)
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

static const char *const mode_name[] = {"dump", "restore", "suspend", "unsuspend"};

int fail(struct op *op, const char *error, const char *detail)
{
    op->failed = 1;
    json_err(&op->b, error, detail);
    return -1;
}

/* The words did not parse: the reply says what this command takes. */
static int op_usage(struct op *op)
{
    snprintf(op->err, sizeof op->err, "usage: %s [lanes=N] [chunk=BYTES] [timeout=MS] [direct=0|1] [stage=1] "
             "[pin_cap=BYTES]%s%s",
             mode_name[op->mode], op->mode == M_DUMP ? " [digest=BYTES|0] [base=0|1] [stream=0|1]"
             : op->mode == M_RESTORE ? " [diff=0|1]" : "", op->mode == M_UNSUSPEND ? "" : " [/PATH] (or pass an fd)");
    return fail(op, op->err, NULL);
}

/* The command's image file: the suspension's (unsuspend), the shim's own kept one (suspend keep=1,
 * found in op_prepare), the /PATH named, or the fd passed (which is the command's to close). */
static int op_image_file(struct op *op, const char *path, int fd)
{
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
    return 0;
}

/* What the command reads of an image before it starts: the head of the suspension's kept image, the
 * whole head of an image to restore, or a dump's base (its head alone, in the fd passed). */
static int op_read_head(struct op *op, const char *path)
{
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

/* The image: opened (or taken over), and read back for a restore; the driver's functions found. */
static int op_open(struct op *op, char *args, int fd)
{
    char *path;
    op->fd = fd;
    op->own_fd = fd >= 0; /* a passed fd is ours to close (a suspend keeps it), even when the words are wrong */
    if (parse_opts(args, &op->o, &path) != 0 || (path && op->mode == M_UNSUSPEND))
        return op_usage(op);
    if (op_image_file(op, path, fd))
        return -1;
    if (!drv_load())
        return fail(op, "the driver lacks a function the copy needs", NULL);
    if (op->mode == M_SUSPEND && !op->simg && K.simg && !S.kept)
        simg_drop(); /* a suspension into an image of its own (a file, -o): no second copy kept in memory */
    return op_read_head(op, path);
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

/* Where a sparse copy (a dump given a base, a restore of some chunks) puts its chunks under the gate:
 * the kept pool, grown before the freeze to hold them (K.want), or, where that does not fit, the image
 * mapped and pinned as a whole checkpoint's is (op->use_image). */
static void plan_sparse(struct op *op, uint64_t staging, uint64_t held_bytes)
{
    /* What the sparse copy will need pinned: a restore knows (the chunks its image holds); a dump
     * expects what the job's last incremental one changed (its own digests come under the gate). */
    uint64_t need = op->iheld ? held_total(op) : op->attempts ? op->found : K.expect;
    need = need < held_bytes || op->iheld ? need : held_bytes;
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

/* The image's length (a dump's: the most it can need), and for a dump into a file of its own its space
 * reserved now. */
static int prepare_space(struct op *op, int sparse)
{
    struct collect *c = &op->c;
    if (op->restore) {
        op->map_len = op->h.data_offset + op->h.data_bytes;
    } else if (c->n) {
        op->map_len = image_len(c->v, c->n, op->dchunk, op->o.base);
        /* Reserve a whole image's space while the job runs: page allocation (tmpfs, memfd) or block
         * allocation (a disk) leaves the freeze, and a full filesystem fails here, before it. */
        int e = sparse || op->simg ? 0 : posix_fallocate(op->fd, 0, (off_t)op->map_len);
        if (e == ENOSPC || e == EDQUOT)
            return fail(op, "cannot reserve space for the image", strerror(e));
    }
    return 0;
}

/* The image mapped and pinned, where the copies go straight into it: the suspension's kept image, the
 * one pinned since the suspend (unsuspend), or, direct=1, the image file. */
static int prepare_map(struct op *op, int sparse)
{
    struct collect *c = &op->c;
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
    return 0;
}

/* The pool: where the copies need staging or a dump's chunks are deferred, and at any dump, so
 * that the next one (an incremental one) finds it made.  Each lane's buffers are its first part. */
static int prepare_pool(struct op *op, uint64_t staging, uint64_t held_bytes)
{
    struct collect *c = &op->c;
    if (!op->nl || (op->map && op->mode != M_DUMP))
        return 0;
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
    return 0;
}

/* While the job still runs: what there is to copy, the image's space, the pinned memory. */
int op_prepare(struct op *op)
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
    if (sparse && op->nl && !op->use_image)
        plan_sparse(op, staging, held_bytes);
    if (op->use_image)
        sparse = 0;
    if (prepare_space(op, sparse) || prepare_map(op, sparse) || prepare_pool(op, staging, held_bytes))
        return -1;
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
int op_freeze(struct op *op)
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
int op_layout(struct op *op)
{
    struct collect *c = &op->c;
    if (c->n && !op->nl) /* nothing was allocated before the gate closed, something is now */
        return fail(op, "busy", "the process allocated device memory meanwhile; try again");
    if (op->restore) {
        struct sbuf d = {0};
        if (image_diff(op->ents, (int)op->h.count, c->v, c->n, &d)) {
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
        op->nd = n_digests(&c->v[0].size, sizeof *c->v, c->n, op->dchunk);
        image_layout(&op->h, c->v, c->n, op->nd, op->dchunk, op->o.base && op->dchunk, op->o.chunk);
        if (op->map && op->h.data_offset + op->h.data_bytes > op->map_len)
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

/* Work in flight finished first, bounded as the pause is: work that cannot finish (a collective whose
 * peer is stopped) gives the job back instead of holding it, and this thread, for good. */
static int copy_sync(struct op *op)
{
    uint64_t t2 = now_ns();
    uint64_t sync_ns;
    const char *se = sync_bounded(&op->c, op->o.timeout_ms, &sync_ns);
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
    return 0;
}

/* A restore of some chunks: every chunk that differs must be one of them. */
static int check_stale(struct op *op, int used)
{
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
    return 0;
}

/* What to copy, cut into pieces (only the chunks the digests chose, where they were used). */
static int copy_cut(struct op *op, int used)
{
    struct collect *c = &op->c;
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
    return 0;
}

/* A dump's pieces given places in the kept pool, as far as it holds them: copied there at the bus's
 * speed and written into the image once the gate has reopened.  1 where more changed than the pool
 * holds and preparing again does better (nothing is copied then: op_again). */
static int defer_to_pool(struct op *op, int used)
{
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
    return 0;
}

/* What goes through the lanes' staging under the gate, counted; the chunks copied. */
static void count_staging(struct op *op, int used)
{
    for (size_t i = 0; i < op->np; i++)
        if (!op->pieces[i].host && !op->map)
            op->staging_bytes += op->pieces[i].len;
    K.staging_copied += op->staging_bytes;
    if (op->staging_bytes)
        op->plan = op->deferred || op->preloaded ? "pool and staging" : "staging";
    for (uint64_t i = 0; used && i < op->nd; i++)
        op->copied_chunks += op->held[i];
}

/* The copy itself (timed from t3), and for a dump the image's head written after its data. */
static int copy_and_write(struct op *op, uint64_t t3)
{
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
    int werr = image_write_head(op->fd, &op->h, op->c.v, op->c.n, op->dig, op->held);
    if (werr)
        return fail(op, "writing the image header failed", strerror(werr));
    return 0;
}

/* The shared copy: work in flight finished, the data moved, and for a dump the image's header and
 * entries written after it.  0, -1 (failed), or 1: a dump whose changes outgrew the pool, to be
 * prepared again (op_again). */
int op_copy(struct op *op)
{
    if (copy_sync(op))
        return -1;
    int used = digests_compare(op);
    if (!used && !op->restore && op->dchunk) { /* a dump whose digests failed: an image without any */
        op->h.digest_chunk = op->h.digest_count = op->h.held_offset = op->h.flags = 0;
    }
    if (op->iheld && check_stale(op, used))
        return -1;
    if (!used)
        op->nd = 0;
    uint64_t t3 = now_ns();
    if (copy_cut(op, used))
        return -1;
    if (op->mode == M_DUMP && !op->map && K.pool && defer_to_pool(op, used))
        return 1;
    if (op->mode == M_DUMP && op->o.base && used)
        expect_note(op->copied_bytes);
    count_staging(op, used);
    return copy_and_write(op, t3);
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

/* A streamed dump's deferred chunks (stream=1): the dump replies once the gate has reopened, and the
 * chunks it left in the kept pool are written into its image at the client's `writeback` commands,
 * a batch at each, so that the client hashes and stores one batch while the next is written (the
 * write after the freeze, overlapped).  All on the control thread, as every command is: one at most,
 * and any command that may touch the pool (a dump, restore or suspension, digest, release, prepare)
 * writes what is left first, so the pool is never reused or freed under it; the client that asked
 * for it closing drops it (no one reads that image).  Its image is a descriptor of its own. */
static struct writeback {
    int active, fd, err, conn;
    struct piece *p; /* the deferred pieces, in image order (each a place in the pool) */
    size_t np, next;
    uint64_t total, written, ns, image_end, batch_start, batch_end;
} W = {.fd = -1, .conn = -1};

static void wb_clear(void)
{
    free(W.p);
    W.p = NULL;
    if (W.fd >= 0)
        close(W.fd);
    W.fd = -1;
    W.active = 0;
    W.np = W.next = 0;
}

/* The op's deferred pieces handed to W; 0, or -1 where they could not be (written now instead). */
static int wb_start(struct op *op)
{
    size_t n = 0;
    for (size_t i = 0; i < op->np; i++)
        n += op->pieces[i].host != NULL;
    struct piece *p = malloc((n ? n : 1) * sizeof *p);
    int fd = p ? fcntl(op->fd, F_DUPFD_CLOEXEC, 0) : -1;
    if (fd < 0) {
        free(p);
        return -1;
    }
    wb_clear();
    W = (struct writeback){.active = 1, .fd = fd, .conn = op->conn, .p = p, .np = n,
                           .image_end = op->h.data_offset + op->h.data_bytes};
    for (size_t i = 0, k = 0; i < op->np; i++)
        if (op->pieces[i].host) {
            W.p[k++] = op->pieces[i];
            W.total += op->pieces[i].len;
        }
    op->streamed = W.total;
    return 0;
}

/* The next pieces written, `max` bytes at most (one piece at least); W cleared once all are (or one
 * failed: W.err says why). */
static void wb_run(uint64_t max)
{
    uint64_t t0 = now_ns(), done = 0;
    W.batch_start = t0;
    while (W.active && W.next < W.np && (!done || done + W.p[W.next].len <= max)) {
        struct piece *q = &W.p[W.next];
        int e = io_all(0, W.fd, q->host, q->len, q->off);
        if (e) {
            W.err = e;
            wb_clear();
            break;
        }
        done += q->len;
        W.written += q->len;
        W.next++;
    }
    W.batch_end = now_ns();
    W.ns += W.batch_end - t0;
    if (W.active && W.next == W.np)
        wb_clear();
}

void dump_writeback_finish(void)
{
    if (W.active)
        wb_run(UINT64_MAX);
}

void dump_writeback_drop(int conn)
{
    if (W.active && W.conn == conn) {
        wb_clear();
        W.err = ECANCELED;
    }
}

/* `writeback [bytes=N]` (default 64 MiB): the next batch of the streamed dump's chunks written.  The
 * reply says how far the image is whole (written_to: every byte below it is final), what is left, and
 * when this batch began and ended (CLOCK_MONOTONIC ns, the clock time.monotonic_ns() reads). */
char *dump_writeback_command(char *args, size_t *len)
{
    uint64_t max = 64ull << 20;
    while (*args == ' ')
        args++;
    struct sbuf b = {0};
    if (*args) {
        char *end;
        unsigned long long v = strncmp(args, "bytes=", 6) ? 0 : strtoull(args + 6, &end, 10);
        if (!v || args[6] == '-' || *end) {
            json_err(&b, "usage: writeback [bytes=N]", NULL);
            goto out;
        }
        max = v;
    }
    W.batch_start = W.batch_end = 0;
    if (W.active)
        wb_run(max);
    if (W.err && !W.active) {
        json_err(&b, "writing the image failed", strerror(W.err));
        goto out;
    }
    sb_printf(&b, "{\"ok\": true, \"done\": %s, \"written_to\": %llu, \"written_bytes\": %llu, "
              "\"pending_bytes\": %llu, \"writeback_ns\": %llu, \"batch_start_ns\": %llu, \"batch_end_ns\": %llu}",
              W.active ? "false" : "true", (unsigned long long)(W.active ? W.p[W.next].off : W.image_end),
              (unsigned long long)W.written, (unsigned long long)(W.total - W.written), (unsigned long long)W.ns,
              (unsigned long long)W.batch_start, (unsigned long long)W.batch_end);
out:
    if (b.oom || !b.p) {
        free(b.p);
        return NULL;
    }
    *len = b.len;
    return b.p;
}

/* The gate reopened if this command closed it, and the reply's common part. */
void op_done(struct op *op)
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
    if (op->mode == M_DUMP) /* stream=1: what is left for `writeback`, and how far the image is whole */
        sb_printf(&op->b, ", \"writeback_pending_bytes\": %llu, \"written_to\": %llu", (unsigned long long)op->streamed,
                  (unsigned long long)(op->streamed && W.active ? W.p[W.next].off : op->h.data_offset + op->h.data_bytes));
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
    if (op->deferred && !(op->o.stream && wb_start(op) == 0) && op_writeback(op))
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

/* A command staged (`stage=1`): prepared while the job ran, kept for the next command of its mode
 * from the same connection with the gate held (a job's ranks: gang.py stages every rank's copy, then
 * stops them all, then copies), so that mapping and pinning its image and loading the digest kernel
 * are no part of the freeze.  Any other command of the family, or the connection closing, drops it. */
static struct op *g_staged;
static int g_staged_conn = -1;

int dump_staged(void) { return g_staged != NULL; }

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

static struct op *op_new(int mode, int have_pause)
{
    struct op *op = calloc(1, sizeof *op);
    if (op) {
        op->mode = mode;
        op->restore = mode == M_RESTORE || mode == M_UNSUSPEND;
        op->have_pause = have_pause;
    }
    return op;
}

/* `stage=1`, prepared: kept for the next command (take_staged); the reply says what was made. */
static char *op_stage(struct op *op, int conn, size_t *len)
{
    op->o.stage = 0; /* the command that takes it up runs it */
    char *out = NULL;
    struct sbuf r = {0};
    sb_printf(&r, "{\"ok\": true, \"staged\": \"%s\", \"direct\": %s, \"digests\": %s, \"setup_ns\": %llu}",
              mode_name[op->mode], op->map ? "true" : "false", op->dg ? "true" : "false",
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

static void (*const cmd_of[])(struct op *) = {cmd_dump, cmd_restore, cmd_suspend, cmd_unsuspend}; /* enum dump_mode */

char *dump_command(int mode, char *args, int fd, int have_pause, int conn, size_t *len)
{
    dump_writeback_finish(); /* a streamed dump's chunks still in the pool: written before it is touched */
    struct op *op = take_staged(mode, args, fd, have_pause, conn);
    if (op) {
        fd = -1;
    } else if (!(op = op_new(mode, have_pause))) {
        if (fd >= 0)
            close(fd);
        return NULL;
    }
    op->conn = conn;
    if (op->prepared || op_open(op, args, fd) == 0) {
        if (!op->o.stage || op->prepared)
            cmd_of[mode](op);
        else if (mode == M_UNSUSPEND || have_pause)
            fail(op, "stage=1 is for dump, restore and suspend, before the gate closes", NULL);
        else if (op_prepare(op) == 0)
            return op_stage(op, conn, len);
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
