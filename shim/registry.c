/* The registry of GPU state a process holds: contexts, allocations of every kind, modules and
 * libraries (with a copy of their image), streams and events.
 *
 * A hash table split into shards, each with its own spinlock, so threads creating or freeing
 * objects at once rarely meet.  Critical sections are a few pointer moves (records are allocated and
 * images copied outside the lock).  Only state calls touch it; launches and copies never do. */
#include "shim_int.h"

#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define SHARDS 64
#define BUCKETS 256 /* per shard */

struct shard {
    atomic_flag lock;
    struct rec *b[BUCKETS];
} __attribute__((aligned(64)));

static struct shard g_shards[SHARDS];

static inline uint64_t mix(int type, uint64_t key)
{
    uint64_t h = (key ^ ((uint64_t)type << 56)) * 0x9E3779B97F4A7C15ull;
    return h ^ (h >> 29);
}

/* A short spin, then yield: a holder preempted mid-section (more threads than CPUs) must not cost the
 * waiters their whole time slice. */
static inline void lock(struct shard *s)
{
    for (unsigned spins = 0; atomic_flag_test_and_set_explicit(&s->lock, memory_order_acquire); spins++) {
        if (spins >= 64) {
            sched_yield();
            continue;
        }
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#elif defined(__aarch64__)
        __asm__ __volatile__("yield");
#endif
    }
}

static inline void unlock(struct shard *s) { atomic_flag_clear_explicit(&s->lock, memory_order_release); }

static struct rec **slot_of(int type, uint64_t key, struct shard **sh)
{
    uint64_t h = mix(type, key);
    *sh = &g_shards[h % SHARDS];
    return &(*sh)->b[(h / SHARDS) % BUCKETS];
}

void reg_release(struct rec *r)
{
    free(r->image);
    free(r->path);
    r->image = NULL;
    r->path = NULL;
}

void reg_put(const struct rec *r)
{
    struct rec *n = malloc(sizeof *n);
    if (!n) {
        shim_log("out of memory: %s %#llx not recorded", "object", (unsigned long long)r->key);
        return;
    }
    *n = *r;
    struct shard *sh;
    struct rec **head = slot_of(r->type, r->key, &sh);
    struct rec *old = NULL;
    lock(sh);
    for (struct rec **pp = head; *pp; pp = &(*pp)->next)
        if ((*pp)->type == r->type && (*pp)->key == r->key) { /* a stale record: the driver reused the handle */
            old = *pp;
            *pp = old->next;
            break;
        }
    n->next = *head;
    *head = n;
    unlock(sh);
    if (old) {
        reg_release(old);
        free(old);
    }
}

int reg_take(int type, uint64_t key, struct rec *out)
{
    struct shard *sh;
    struct rec **head = slot_of(type, key, &sh);
    struct rec *found = NULL;
    lock(sh);
    for (struct rec **pp = head; *pp; pp = &(*pp)->next)
        if ((*pp)->type == type && (*pp)->key == key) {
            found = *pp;
            *pp = found->next;
            break;
        }
    unlock(sh);
    if (!found)
        return 0;
    *out = *found;
    out->next = NULL;
    free(found);
    return 1;
}

int reg_update(int type, uint64_t key, void (*fn)(struct rec *, void *), void *arg)
{
    struct shard *sh;
    struct rec **head = slot_of(type, key, &sh);
    int ok = 0;
    lock(sh);
    for (struct rec *r = *head; r; r = r->next)
        if (r->type == type && r->key == key) {
            fn(r, arg);
            ok = 1;
            break;
        }
    unlock(sh);
    return ok;
}

static void copy_out(struct rec *r, void *out) { *(struct rec *)out = *r; }

int reg_get(int type, uint64_t key, struct rec *out)
{
    return reg_update(type, key, copy_out, out);
}

size_t reg_copy_image(int type, uint64_t key, void *buf, size_t len)
{
    struct shard *sh;
    struct rec **head = slot_of(type, key, &sh);
    size_t n = 0;
    lock(sh);
    for (struct rec *r = *head; r; r = r->next)
        if (r->type == type && r->key == key) {
            n = r->image_len;
            if (buf && r->image)
                memcpy(buf, r->image, n < len ? n : len);
            break;
        }
    unlock(sh);
    return n;
}

void reg_scan(int type, int (*fn)(struct rec *, void *), void *arg)
{
    struct rec *dead = NULL;
    for (int i = 0; i < SHARDS; i++) {
        struct shard *sh = &g_shards[i];
        lock(sh);
        for (int j = 0; j < BUCKETS; j++)
            for (struct rec **pp = &sh->b[j]; *pp;) {
                struct rec *r = *pp;
                if ((!type || r->type == type) && fn(r, arg)) {
                    *pp = r->next;
                    r->next = dead;
                    dead = r;
                } else {
                    pp = &r->next;
                }
            }
        unlock(sh);
    }
    while (dead) {
        struct rec *n = dead->next;
        reg_release(dead);
        free(dead);
        dead = n;
    }
}

void reg_atfork_prepare(void)
{
    for (int i = 0; i < SHARDS; i++)
        lock(&g_shards[i]);
}

void reg_atfork_release(void)
{
    for (int i = SHARDS - 1; i >= 0; i--)
        unlock(&g_shards[i]);
}

/* ------------------------------------------------------------------------------------------------
 * JSON */

void sb_printf(struct sbuf *b, const char *fmt, ...)
{
    if (b->oom)
        return;
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(b->p ? b->p + b->len : NULL, b->p ? b->cap - b->len : 0, fmt, ap);
        va_end(ap);
        if (n < 0) {
            b->oom = 1;
            return;
        }
        if (b->p && b->len + (size_t)n < b->cap) {
            b->len += (size_t)n;
            return;
        }
        size_t cap = b->cap ? b->cap * 2 : 4096;
        while (cap < b->len + (size_t)n + 1)
            cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p) {
            b->oom = 1;
            return;
        }
        b->p = p;
        b->cap = cap;
    }
}

static const char *const kind_name[] = {"?",          "device",   "pitch",   "async",           "host",
                                        "va_reserve", "vmm_phys", "vmm_map", "managed", "host_registered"};

struct jctx {
    struct sbuf *b;
    int first;
    unsigned long long device_bytes, host_bytes, va_bytes, mapped_bytes, image_bytes;
    int counts[R_NTYPES];
};

static void sep(struct jctx *j)
{
    sb_printf(j->b, "%s", j->first ? "" : ", ");
    j->first = 0;
}

static int j_ctx(struct rec *r, void *arg)
{
    struct jctx *j = arg;
    sep(j);
    sb_printf(j->b, "{\"handle\": %llu, \"device\": %d, \"primary\": %s, \"refs\": %d, \"flags\": %u}",
              (unsigned long long)r->key, r->device, r->primary ? "true" : "false", r->refs, r->flags);
    j->counts[R_CTX]++;
    return 0;
}

static int j_alloc(struct rec *r, void *arg)
{
    struct jctx *j = arg;
    if (r->type < R_MEM || r->type > R_MAP)
        return 0;
    sep(j);
    sb_printf(j->b, "{\"kind\": \"%s\", \"base\": %llu, \"size\": %llu, \"device\": %d, \"ctx\": %llu", kind_name[r->kind],
              r->type == R_PHYS ? 0ull : (unsigned long long)r->key, (unsigned long long)r->size, r->device,
              (unsigned long long)r->ctx);
    if (r->type == R_PHYS || r->type == R_MAP) /* the program's handle (R_PHYS: the key; see vmm.c) */
        sb_printf(j->b, ", \"handle\": %llu, \"suspended\": %s",
                  (unsigned long long)(r->type == R_PHYS ? r->key : r->handle), r->suspended ? "true" : "false");
    if (r->type == R_PHYS)
        sb_printf(j->b, ", \"driver_handle\": %llu", (unsigned long long)r->handle);
    if (r->type == R_MAP)
        sb_printf(j->b, ", \"offset\": %llu, \"access\": %d", (unsigned long long)r->offset, r->access);
    if (r->type == R_HOST)
        sb_printf(j->b, ", \"flags\": %u", r->flags);
    if (r->type == R_MEM && r->reserved)
        sb_printf(j->b, ", \"handle\": %llu, \"reserved\": %llu, \"suspended\": %s", (unsigned long long)r->handle,
                  (unsigned long long)r->reserved, r->suspended ? "true" : "false");
    sb_printf(j->b, "}");
    switch (r->type) {
    case R_MEM:
    case R_PHYS:
        j->device_bytes += r->size;
        break;
    case R_HOST:
        j->host_bytes += r->size;
        break;
    case R_VA:
        j->va_bytes += r->size;
        break;
    case R_MAP:
        j->mapped_bytes += r->size;
        break;
    }
    j->counts[r->type]++;
    return 0;
}

static int j_module(struct rec *r, void *arg)
{
    struct jctx *j = arg;
    if (r->type != R_MODULE && r->type != R_LIBRARY)
        return 0;
    sep(j);
    sb_printf(j->b, "{\"kind\": \"%s\", \"handle\": %llu, \"ctx\": %llu, \"image_bytes\": %zu",
              r->type == R_MODULE ? "module" : "library", (unsigned long long)r->key, (unsigned long long)r->ctx,
              r->image_len);
    if (r->path) {
        sb_printf(j->b, ", \"path\": \"");
        for (const char *c = r->path; *c; c++)
            if (*c == '"' || *c == '\\')
                sb_printf(j->b, "\\%c", *c);
            else
                sb_printf(j->b, "%c", (unsigned char)*c < 0x20 ? '?' : *c);
        sb_printf(j->b, "\"");
    }
    sb_printf(j->b, "}");
    j->image_bytes += r->image_len;
    j->counts[r->type]++;
    return 0;
}

static int j_stream(struct rec *r, void *arg)
{
    struct jctx *j = arg;
    sep(j);
    if (r->type == R_STREAM)
        sb_printf(j->b, "{\"handle\": %llu, \"ctx\": %llu, \"flags\": %u, \"priority\": %d}", (unsigned long long)r->key,
                  (unsigned long long)r->ctx, r->flags, r->priority);
    else
        sb_printf(j->b, "{\"handle\": %llu, \"ctx\": %llu, \"flags\": %u}", (unsigned long long)r->key,
                  (unsigned long long)r->ctx, r->flags);
    j->counts[r->type]++;
    return 0;
}

void reg_json(struct sbuf *b)
{
    struct jctx j = {.b = b, .first = 1};
    sb_printf(b, "\"contexts\": [");
    reg_scan(R_CTX, j_ctx, &j);
    sb_printf(b, "], \"allocations\": [");
    j.first = 1;
    reg_scan(0, j_alloc, &j);
    sb_printf(b, "], \"modules\": [");
    j.first = 1;
    reg_scan(0, j_module, &j);
    sb_printf(b, "], \"streams\": [");
    j.first = 1;
    reg_scan(R_STREAM, j_stream, &j);
    sb_printf(b, "], \"events\": [");
    j.first = 1;
    reg_scan(R_EVENT, j_stream, &j);
    sb_printf(b,
              "], \"totals\": {\"device_bytes\": %llu, \"host_bytes\": %llu, \"va_reserved_bytes\": %llu, "
              "\"vmm_mapped_bytes\": %llu, \"module_image_bytes\": %llu, \"contexts\": %d, \"allocations\": %d, "
              "\"modules\": %d, \"streams\": %d, \"events\": %d}",
              j.device_bytes, j.host_bytes, j.va_bytes, j.mapped_bytes, j.image_bytes, j.counts[R_CTX],
              j.counts[R_MEM] + j.counts[R_HOST] + j.counts[R_VA] + j.counts[R_PHYS] + j.counts[R_MAP],
              j.counts[R_MODULE] + j.counts[R_LIBRARY], j.counts[R_STREAM], j.counts[R_EVENT]);
}
