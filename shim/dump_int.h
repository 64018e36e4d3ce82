/* Shared by the files of the dump family (the `dump`, `restore`, `suspend`, `unsuspend`, `digest` and
 * `release` commands; docs/architecture.md, "The shim", names what each file holds):
 *   dump.c     the commands: one `struct op` from its words to its reply, step by step
 *   image.c    the image format: reading, checking, laying out and writing an image's head
 *   copy.c     the driver's functions, what is saved, the copy engine (pieces, lanes), pinning an image,
 *              the bounded synchronization
 *   kept.c     what is kept between commands: the pinned pool, the digester, a suspension's image
 *   suspend.c  suspension: memory released with its addresses kept, and mapped again
 *   changed.c  which chunks changed: the digests of the live memory against a base's or an image's
 * Nothing here is exported. */
#ifndef GPUTRACE_DUMP_INT_H
#define GPUTRACE_DUMP_INT_H

#include "shim_int.h"

#include <pthread.h>
#include <time.h>

#define IMG_MAGIC "GPUTRACE-IMG-2\n" /* 15 chars + NUL = 16 bytes */
#define IMG_MAGIC_V1 "GPUTRACE-IMG-1\n"
#define IMG_V1_HDR 48u /* version 1's header: up to `chunk` */
#define IMG_PARTIAL 1u
#define IMG_ALIGN 4096u
#define MAX_LANES 16
#define MIN_CHUNK (64u << 10)
#define MAX_CHUNK (1u << 30)
#define DIGEST_DEFAULT (1u << 20)

/* The image's head (image.c has the format). */
struct img_hdr {
    char magic[16];
    uint64_t count, data_offset, data_bytes, chunk;
    uint64_t digest_chunk, digest_offset, digest_count, held_offset, flags;
};
struct img_ent {
    uint64_t base, size, offset;
    int32_t device, kind;
};

static inline uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static inline uint64_t round_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

/* ---- copy.c */

/* The driver's functions, looked up by name on the driver's handle (drv_load). */
struct drv {
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
};
HIDDEN extern struct drv D;
HIDDEN int drv_load(void); /* 1 when every function a copy needs was found */

/* What is saved: one allocation, and all of them with their contexts. */
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
HIDDEN int collect(struct collect *c); /* the live allocations, in address order; -1: out of memory */

/* One copy between device memory and the image (or kept pinned memory), and a thread that makes them. */
struct piece {
    uint64_t dev, off, len, ctx;
    char *host; /* kept pinned memory to copy to or from directly (NULL: the image map, else staging) */
};

struct lane {
    struct job *j;
    void *buf[2];
    pthread_t t;
};

HIDDEN struct piece *cut(const struct item *v, int n, size_t chunk, const unsigned char *held, uint64_t dchunk,
                         const uint64_t *pre_off, char *pre_base, size_t *np);
HIDDEN char *direct_map(int fd, uint64_t len, uint64_t ctx);
HIDDEN void direct_unmap(char *m, uint64_t len, uint64_t ctx);
HIDDEN const char *sync_bounded(const struct collect *c, int timeout_ms, uint64_t *ns);

/* ---- image.c */
HIDDEN int io_all(int restore, int fd, void *buf, size_t n, uint64_t off); /* 0, or an errno */
HIDDEN uint64_t n_digests(const uint64_t *sizes, size_t stride, int n, uint64_t dchunk);
HIDDEN uint64_t head_bytes(int n, uint64_t nd, int partial);
HIDDEN uint64_t image_len(const struct item *v, int n, uint64_t dchunk, int partial);
HIDDEN const char *read_image(int fd, int head_only, int partial_ok, struct img_hdr *h, struct img_ent **ents,
                              uint64_t **dig, unsigned char **held);
HIDDEN int image_diff(const struct img_ent *e, int ne, const struct item *v, int nv, struct sbuf *b);
HIDDEN void image_layout(struct img_hdr *h, struct item *v, int n, uint64_t nd, uint64_t dchunk, int partial,
                         size_t chunk);
HIDDEN int image_write_head(int fd, struct img_hdr *h, const struct item *v, int n, uint64_t *dig,
                            unsigned char *held);

/* ---- dump.c: one command */
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
    int stream;       /* dump: chunks deferred to the pool are written into the image afterwards, batch by batch,
                       * at the client's `writeback` commands (it hashes and stores each batch as the next is
                       * written), not all of them before the reply */
};

struct timing {
    uint64_t setup, drain, sync, digest, copy, freeze;
};

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
    int conn;         /* the connection the command came on (-1: the shim's own) */
    uint64_t streamed; /* dump stream=1: deferred bytes left for `writeback` commands (not written before the reply) */
};

HIDDEN int parse_opts(char *args, struct opts *o, char **path);
HIDDEN void json_err(struct sbuf *b, const char *err, const char *detail);
HIDDEN int fail(struct op *op, const char *error, const char *detail); /* the reply an error; -1 */
HIDDEN void identity_json(struct sbuf *b, const struct collect *c);
/* The steps, each 0 or -1 (fail has made the reply); op_copy 1 where a dump must prepare again. */
HIDDEN int op_prepare(struct op *op);
HIDDEN int op_freeze(struct op *op);
HIDDEN int op_layout(struct op *op);
HIDDEN int op_copy(struct op *op);
HIDDEN void op_done(struct op *op);
HIDDEN int run_copy(struct op *op, int restore); /* copy.c */
HIDDEN int dump_staged(void); /* a command staged (stage=1) waits for its gate: it holds what it prepared */

/* ---- changed.c */
HIDDEN void digests_prepare(struct op *op);
HIDDEN int digests_compare(struct op *op);

/* ---- suspend.c */
/* The suspended image: the gate knows whether the job is suspended (gate_suspended()); this is where
 * its data wait.  A direct suspension keeps its image mapped and pinned until unsuspend, so that
 * bringing the data back is the bus's time alone (pinning 16 GiB takes seconds; the job waits
 * through all of resume). */
struct suspension {
    int fd;
    uint64_t since_ns;
    char *map;
    uint64_t len, ctx;
    int kept; /* the image is the shim's own kept one (K.simg): kept again at unsuspend, not freed */
};
HIDDEN extern struct suspension S;
HIDDEN void cmd_suspend(struct op *op);
HIDDEN void cmd_unsuspend(struct op *op);

/* ---- kept.c: what is kept between a job's commands (its comment says what and why) */
#define PIN_CAP_DEFAULT (2ull << 30)
#define DEFER_MIN (32ull << 20)

struct kept {
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
    unsigned long long simg_prepared; /* of simg_allocs, made ahead by `prepare_suspend` */
    int simg_release; /* `release` came while it was in use: not kept at unsuspend */
};
HIDDEN extern struct kept K;
HIDDEN uint64_t pin_cap_default(void);
HIDDEN void pool_unmap(char *m, uint64_t len, uint64_t ctx);
HIDDEN void keep_forget_gone(const struct collect *c);
HIDDEN struct digester *keep_digester(const uint64_t *ctxs, const size_t *need, int nctx, char *why, size_t wl);
HIDDEN int keep_pool(uint64_t staging, uint64_t initial, uint64_t cap, uint64_t ctx);
HIDDEN uint64_t defer_max(uint64_t staging, uint64_t cap);
HIDDEN void expect_note(uint64_t bytes);
HIDDEN void simg_drop(void);
HIDDEN int keep_simg(uint64_t len, uint64_t ctx);
HIDDEN uint64_t simg_len_for(uint64_t len);
HIDDEN int simg_fits(uint64_t len, uint64_t ctx);

#endif
