/* What counts.bpf.c needs from its compiler, so that one source builds two ways:
 *
 *   bcc (the default): compiled at run time against the kernel's headers; bcc supplies the types,
 *     the helpers and BPF_TABLE, and rewrites `map.lookup(...)` calls into map helpers.
 *   -DGT_BPF_OBJECT: `clang -target bpf -O2 -g -DGT_BPF_OBJECT -c`, ahead of time, into an ELF
 *     object that tracer/bpfobj.py loads. Nothing here comes from the kernel's or libbpf's headers:
 *     the program reads no kernel struct, so the few types, helper ids and constants it uses are
 *     spelled out below (they are kernel ABI and never change).
 *
 * Maps are declared with GT_MAP and programs with GT_UPROBE / GT_RAW_TRACEPOINT; map operations
 * go through one small function per map and operation, defined in counts.bpf.c for each compiler
 * (bcc rewrites `map.op(...)` only where it is written out in a function body, never in a macro). */
#ifndef GT_COMPAT_H
#define GT_COMPAT_H

#ifndef GT_BPF_OBJECT

#include <uapi/linux/ptrace.h>
#include <linux/sched.h>

/* kind: hash, lru_hash or array; the map's size is the -D option bcc is given. */
#define GT_MAP(kind, name, key_type, value_type, entries) BPF_TABLE(#kind, key_type, value_type, name, entries)
#define GT_UPROBE
#define GT_LICENSE
/* bcc loads and attaches RAW_TRACEPOINT_PROBE(event) itself, as raw_tracepoint__<event>. */
#define GT_RAW_TRACEPOINT(event) RAW_TRACEPOINT_PROBE(event)

#else /* GT_BPF_OBJECT: plain clang */

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef int s32;
typedef long long s64;

#define __always_inline inline __attribute__((always_inline))
#define SEC(name) __attribute__((section(name), used))

struct pt_regs;  /* only passed to helpers: its layout is never read */
struct bpf_raw_tracepoint_args {
    u64 args[0];
};

/* Map types and update flags (include/uapi/linux/bpf.h). */
#define GT_MAP_TYPE_hash 1
#define GT_MAP_TYPE_array 2
#define GT_MAP_TYPE_lru_hash 9
#define BPF_ANY 0
#define BPF_NOEXIST 1

/* Helpers, by their fixed ids (include/uapi/linux/bpf.h, enum bpf_func_id). */
static void *(*bpf_map_lookup_elem)(void *map, const void *key) = (void *)1;
static long (*bpf_map_update_elem)(void *map, const void *key, const void *value, u64 flags) = (void *)2;
static long (*bpf_map_delete_elem)(void *map, const void *key) = (void *)3;
static u64 (*bpf_ktime_get_ns)(void) = (void *)5;
static u64 (*bpf_get_current_pid_tgid)(void) = (void *)14;
static u64 (*bpf_get_attach_cookie)(void *ctx) = (void *)174;

/* BTF-defined maps, as libbpf declares them: the loader reads type, size, key and value from BTF
 * (and sets max_entries from its own options, the object's being only the default). */
#define __uint(name, val) int (*name)[val]
#define __type(name, val) typeof(val) *name
#define GT_MAP(kind, name, key_type, value_type, entries)        \
    struct {                                                       \
        __uint(type, GT_MAP_TYPE_##kind);                          \
        __uint(max_entries, entries);                              \
        __type(key, key_type);                                     \
        __type(value, value_type);                                 \
    } name SEC(".maps")

/* The section names tell the loader each program's type; the attach type comes at load time. */
#define GT_UPROBE SEC("uprobe")
#define GT_LICENSE char _license[] SEC("license") = "GPL";
#define GT_RAW_TRACEPOINT(event) \
    SEC("raw_tracepoint/" #event) int raw_tracepoint__##event(struct bpf_raw_tracepoint_args *ctx)

/* bcc's bpf_log2l (src/cc/export/helpers.h), kept exactly: the histogram slots must not depend on
 * which compiler built the program. */
static __always_inline unsigned int bpf_log2(unsigned int v)
{
    unsigned int r;
    unsigned int shift;
    r = (v > 0xFFFF) << 4; v >>= r;
    shift = (v > 0xFF) << 3; v >>= shift; r |= shift;
    shift = (v > 0xF) << 2; v >>= shift; r |= shift;
    shift = (v > 0x3) << 1; v >>= shift; r |= shift;
    r |= (v >> 1);
    return r;
}

static __always_inline unsigned int bpf_log2l(unsigned long v)
{
    unsigned int hi = v >> 32;
    if (hi)
        return bpf_log2(hi) + 32 + 1;
    else
        return bpf_log2(v) + 1;
}

#endif /* GT_BPF_OBJECT */
#endif /* GT_COMPAT_H */
