/* The image: the file `dump` writes device memory into and `restore` reads it back from (its Python
 * side: checkpointer/image.py).
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
 * An image comes from outside the job: read_image checks every offset and size in it before anything
 * is copied (docs/security.md). */
#include "dump_int.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* Reads (restore) or writes n bytes at `off` of the file, whole.  0, or an errno (EIO: the file is too
 * short). */
int io_all(int restore, int fd, void *buf, size_t n, uint64_t off)
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

/* How many digests an image of these allocations has, at `dchunk` bytes each (0: none). */
uint64_t n_digests(const uint64_t *sizes, size_t stride, int n, uint64_t dchunk)
{
    uint64_t k = 0;
    for (int i = 0; dchunk && i < n; i++) {
        uint64_t size = *(const uint64_t *)((const char *)sizes + (size_t)i * stride);
        k += (size + dchunk - 1) / dchunk;
    }
    return k;
}

/* Where the data start in a dump's image of these allocations. */
uint64_t head_bytes(int n, uint64_t nd, int partial)
{
    uint64_t dig_at = round_up(sizeof(struct img_hdr) + (uint64_t)n * sizeof(struct img_ent), 16);
    return round_up(dig_at + nd * 16 + (partial ? nd : 0), IMG_ALIGN);
}

/* The most a dump's image of these allocations can need: its head, with room for their digests at
 * `dchunk` bytes each and some more, and every allocation's data, each aligned.  What a dump or a
 * suspension maps (dump.c prepare_space) and what `prepare_suspend` pins ahead for one (suspend.c). */
uint64_t image_len(const struct item *v, int n, uint64_t dchunk, int partial)
{
    uint64_t nd = n ? n_digests(&v[0].size, sizeof *v, n, dchunk) : 0;
    uint64_t len = head_bytes(n, nd + nd / 4 + 64, partial);
    for (int i = 0; i < n; i++)
        len = round_up(len + v[i].size, IMG_ALIGN);
    return len;
}

/* The header, checked against the file's size; *hsize: its length in the file (version 1's is shorter). */
static const char *read_head(int fd, uint64_t fsize, int head_only, int partial_ok, struct img_hdr *h,
                             size_t *hsize)
{
    memset(h, 0, sizeof *h);
    if (io_all(1, fd, h, IMG_V1_HDR, 0))
        return "not a gputrace image (too short)";
    *hsize = sizeof *h;
    if (!memcmp(h->magic, IMG_MAGIC_V1, sizeof h->magic))
        *hsize = IMG_V1_HDR; /* no digests */
    else if (memcmp(h->magic, IMG_MAGIC, sizeof h->magic) || io_all(1, fd, h, sizeof *h, 0))
        return "not a gputrace image (bad magic)";
    if (h->count > (1u << 24) || h->data_offset < *hsize + h->count * sizeof(struct img_ent) ||
        h->data_offset > fsize || (!head_only && h->data_bytes != fsize - h->data_offset))
        return "image header inconsistent with its size";
    if (!head_only && !partial_ok && (h->flags & IMG_PARTIAL))
        return "a partial image (one link of an incremental checkpoint's chain): it must be put together first";
    return NULL;
}

/* The entries (malloc'ed into *ents): each within the first `end` bytes of the file, in address order,
 * their data not overlapping. */
static const char *read_entries(int fd, const struct img_hdr *h, size_t hsize, uint64_t end, struct img_ent **ents)
{
    struct img_ent *e = calloc(h->count ? h->count : 1, sizeof *e);
    if (!e)
        return "out of memory";
    if (h->count && io_all(1, fd, e, h->count * sizeof *e, hsize)) {
        free(e);
        return "image too short for its entries";
    }
    for (uint64_t i = 0; i < h->count; i++)
        if (e[i].offset < h->data_offset || e[i].offset > end || e[i].size > end - e[i].offset ||
            e[i].base + e[i].size < e[i].base || (i && e[i].base <= e[i - 1].base) ||
            (i && e[i].offset < e[i - 1].offset + e[i - 1].size)) {
            free(e);
            return "image entry out of range or out of order";
        }
    *ents = e;
    return NULL;
}

/* The digests (malloc'ed into *dig): one for each digest_chunk of each entry, between the entries and
 * the data. */
static const char *read_digests(int fd, const struct img_hdr *h, const struct img_ent *e, size_t hsize,
                                uint64_t **dig)
{
    uint64_t dc = h->digest_chunk;
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
    return NULL;
}

/* A partial image's held map (malloc'ed into *held): which chunks it holds, after its digests. */
static const char *read_held(int fd, const struct img_hdr *h, unsigned char **held)
{
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
    return NULL;
}

/* Reads and checks an image's header, entries and digests (malloc'ed into *ents and *dig; *dig NULL
 * where it has none).  Every offset and size is checked without overflow against the file's size:
 * the image comes from outside the job, and a copy that runs past the mapped file would kill it.
 * head_only: the file holds only what comes before the data (a base for a dump). */
const char *read_image(int fd, int head_only, int partial_ok, struct img_hdr *h, struct img_ent **ents,
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
    size_t hsize;
    const char *e = read_head(fd, fsize, head_only, partial_ok, h, &hsize);
    if (!e)
        e = read_entries(fd, h, hsize, head_only ? UINT64_MAX : fsize, ents);
    if (e)
        return e;
    if (!h->digest_chunk) {
        h->digest_count = 0;
        if (!head_only && (h->flags & IMG_PARTIAL))
            return "a partial image without digests";
        return NULL;
    }
    if ((e = read_digests(fd, h, *ents, hsize, dig)))
        return e;
    if (held && (h->flags & IMG_PARTIAL)) /* a restore of some chunks: which ones the image holds */
        return read_held(fd, h, held);
    return NULL;
}

/* Compares a checkpoint's entries with the live items (both in address order); describes up to a few
 * differences in `b` (a JSON fragment) and returns how many there are. */
int image_diff(const struct img_ent *e, int ne, const struct item *v, int nv, struct sbuf *b)
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

/* A dump's image head for these allocations: each given its place in the file (v[i].off), 4 KiB
 * aligned after the head; nd digests of dchunk bytes; partial: a held map after them. */
void image_layout(struct img_hdr *h, struct item *v, int n, uint64_t nd, uint64_t dchunk, int partial, size_t chunk)
{
    memset(h, 0, sizeof *h);
    memcpy(h->magic, IMG_MAGIC, sizeof h->magic);
    h->count = (uint64_t)n;
    h->data_offset = head_bytes(n, nd, partial);
    uint64_t off = h->data_offset;
    for (int i = 0; i < n; i++) {
        v[i].off = off;
        off = round_up(off + v[i].size, IMG_ALIGN);
    }
    h->data_bytes = off - h->data_offset;
    h->chunk = chunk;
    h->digest_chunk = dchunk;
    h->digest_count = nd;
    h->digest_offset = round_up(sizeof *h + (uint64_t)n * sizeof(struct img_ent), 16);
    h->held_offset = partial ? h->digest_offset + nd * 16 : 0;
    h->flags = partial ? IMG_PARTIAL : 0;
}

/* The head written after the data: header, entries, digests and held map.  0, or an errno. */
int image_write_head(int fd, struct img_hdr *h, const struct item *v, int n, uint64_t *dig, unsigned char *held)
{
    struct img_ent *e = calloc(n ? (size_t)n : 1, sizeof *e);
    int werr = e ? 0 : ENOMEM;
    for (int i = 0; e && i < n; i++)
        e[i] = (struct img_ent){.base = v[i].base, .size = v[i].size, .offset = v[i].off,
                                .device = v[i].device, .kind = v[i].kind};
    if (!werr)
        werr = io_all(0, fd, h, sizeof *h, 0);
    if (!werr && n)
        werr = io_all(0, fd, e, (size_t)n * sizeof *e, sizeof *h);
    if (!werr && h->digest_count)
        werr = io_all(0, fd, dig, h->digest_count * 16, h->digest_offset);
    if (!werr && (h->flags & IMG_PARTIAL))
        werr = io_all(0, fd, held, h->digest_count, h->held_offset);
    free(e);
    return werr;
}
