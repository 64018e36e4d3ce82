/* The control server: a Unix socket in a private per-user directory, served by one C thread.
 *
 * Directory: $GPUTRACE_SHIM_DIR if set, else $XDG_RUNTIME_DIR/gputrace, else /tmp/gputrace-<euid>;
 * it must be a directory owned by this user with no group/other access (created 0700 if missing),
 * or the shim does not serve at all.  Socket: <dir>/shim-<pid>.sock, mode 0600.  Each connection's
 * peer credentials are checked on accept: the process's own user or root, nobody else.
 *
 * Protocol: one command per line, one JSON line back.  Each verb is one function (v_status, v_pause, ...),
 * named with how its words follow it in the table `verbs`; `command` finds the line's verb there.
 *   status        the registry and the gate (gputrace_shim_status_json)
 *   pause [MS]    close the gate, wait up to MS (default 5000) for calls in flight; the pause belongs
 *                 to this connection and ends when it closes, so a crashed checkpointer cannot leave
 *                 the job stopped for good
 *   resume        reopen the gate
 *   ping          {"ok": true, "pid": ..., "schema": ...}
 *   dump [lanes=N] [chunk=BYTES] [timeout=MS] [/PATH]
 *                 close the gate (unless this connection holds it), synchronize (both within MS), copy every device
 *                 allocation into an image file (an fd sent with the command by SCM_RIGHTS, else
 *                 /PATH), reopen the gate; see dump.c for the reply and image.c for the image
 *   restore [...] the reverse: copy an image back, after checking under the gate that the process
 *                 holds exactly the allocations the image describes
 *   suspend [...] a dump (fd only), then release the memory of every allocation (all must be served
 *                 through the VMM API: GPUTRACE_SHIM_VMM=1), keeping the addresses and the image;
 *                 the gate stays closed, owned by no connection, until
 *   unsuspend [lanes=N] [chunk=BYTES]
 *                 maps new memory at the same addresses, copies the image back, reopens the gate.
 *                 While suspended, `resume` and a closing connection leave the gate closed.
 *   emulate [off | cost=NS [classes=C,...] [functions=NAME,...]]
 *                 the emulated layer (emulate.c): add NS of busy CPU time to every intercepted call
 *                 of those classes (submission, synchronization, state, query) or functions; alone,
 *                 what it does now and how many calls it has slowed
 *   keep          a suspension made through this connection outlives it (see below)
 *   digest [digest=BYTES] [timeout=MS]
 *                 with an fd: the live memory's digests into it, under a gate closed for the kernel
 *                 alone (what a restore reads before it: only the chunks that differ)
 *   release       the pinned pool, digest kernel and suspension image kept between commands given back
 *   writeback [bytes=N]
 *                 after a `dump stream=1`: the next N bytes (default 64 MiB) of the chunks it left in the
 *                 pinned pool written into its image, so that the client stores each batch while the
 *                 next is written (dump.c); any other command of the family writes what is left first
 *   prepare_suspend
 *                 the image the next `suspend keep=1` copies into, made now (mapped and pinned, sized for
 *                 the device memory held, within the pin cap), while the job runs: nothing is gated, and
 *                 the first suspension then pays only its copies (suspend.c says what it refuses)
 * A job of several processes (checkpointer/gang.py) is stopped in steps, each bounded, so that no
 * process waits on a peer stopped before it (see "Collectives" in shim.c):
 *   close [MS]    close the gate without waiting for the calls in flight (only for collective launches
 *                 in their gate check, up to MS, default 1000); replies the collectives launched so
 *                 far.  Held by this connection like a pause: it reopens if the connection closes
 *   advance N [MS]
 *                 with the gate closed through this connection: let the process run until it has
 *                 launched N collectives, then close again (up to MS, default 5000)
 *   drain [MS]    with the gate closed through this connection: wait for the calls in flight, then
 *                 synchronize every context, all within MS (default 5000); the gate stays closed
 * then dump, restore or suspend through the same connection (they find the gate held and leave it
 * so), and resume (a suspension keeps it closed). 
 * A suspension belongs to the connection that made it until that connection says `keep`: if it
 * closes first (the suspending gputrace was killed before it had recorded where the data are), the
 * shim unsuspends the job itself, so that no death of a client leaves the job held.
 *
 * Replies are queued per client and sent without blocking: a client that stops reading has its
 * further commands left unread (nothing more is queued for it) and is dropped once a reply has
 * waited OUT_DEADLINE_MS; the others are served meanwhile.  The server is one thread, so a dump or
 * restore in progress holds later commands of every client until it ends (two checkpoints at once
 * run one after the other).
 * The thread blocks every signal (they belong to the program) and calls nothing the program could
 * be holding a lock in, apart from malloc. */
#include "shim_int.h"

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "gputrace_shim.h"

#define MAX_CLIENTS 16
#define LINE_MAX_ 512

static atomic_int g_state; /* 0: not started, 1: serving, -1: gave up */
static int g_listen = -1;
static pid_t g_owner;
static char g_path[sizeof(((struct sockaddr_un *)0)->sun_path)];

const char *control_path(void) { return atomic_load(&g_state) == 1 ? g_path : ""; }

void control_atfork_child(void)
{
    if (g_listen >= 0)
        close(g_listen); /* the parent's socket: the child serves its own once it calls the driver */
    g_listen = -1;
    g_path[0] = 0;
    atomic_store(&g_state, 0);
}

static int private_dir(const char *dir)
{
    if (mkdir(dir, 0700) != 0 && errno != EEXIST) {
        shim_log("not serving: cannot create %s: %s", dir, strerror(errno));
        return 0;
    }
    struct stat st;
    if (lstat(dir, &st) != 0 || !S_ISDIR(st.st_mode) || st.st_uid != geteuid() || (st.st_mode & 077)) {
        shim_log("not serving: %s must be a directory owned by uid %d with mode 0700", dir, (int)geteuid());
        return 0;
    }
    return 1;
}

static int choose_dir(char *out, size_t n)
{
    const char *d = getenv("GPUTRACE_SHIM_DIR");
    if (d && *d) {
        snprintf(out, n, "%s", d);
        return private_dir(out);
    }
    const char *x = getenv("XDG_RUNTIME_DIR");
    struct stat st;
    if (x && *x == '/' && stat(x, &st) == 0 && S_ISDIR(st.st_mode) && st.st_uid == geteuid()) {
        snprintf(out, n, "%s/gputrace", x);
        return private_dir(out);
    }
    snprintf(out, n, "/tmp/gputrace-%d", (int)geteuid());
    return private_dir(out);
}

#define OUT_DEADLINE_MS 10000

struct client {
    int fd;
    int passed; /* a descriptor sent with the last message (SCM_RIGHTS), -1 if none */
    size_t len;
    char buf[LINE_MAX_];
    char *out; /* replies not yet sent */
    size_t out_len, out_off;
    uint64_t out_since_ms; /* when the oldest unsent reply was queued */
};

static uint64_t now_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000 + (uint64_t)t.tv_nsec / 1000000;
}

/* Sends what is queued, as far as the socket takes it without blocking; -1 when the client is gone. */
static int flush_out(struct client *cl)
{
    while (cl->out_off < cl->out_len) {
        ssize_t w = send(cl->fd, cl->out + cl->out_off, cl->out_len - cl->out_off, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w < 0 && errno == EINTR)
            continue;
        if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            return 0;
        if (w <= 0)
            return -1;
        cl->out_off += (size_t)w;
    }
    free(cl->out);
    cl->out = NULL;
    cl->out_len = cl->out_off = 0;
    return 0;
}

/* Queues n bytes of reply for the client (taking ownership of `own` when given) and sends what it can. */
static void queue(struct client *cl, const char *p, size_t n, char *own)
{
    if (!cl->out) {
        cl->out = own ? own : malloc(n ? n : 1);
        if (!cl->out)
            return; /* out of memory: the reply is lost, the client times out on its side */
        if (!own)
            memcpy(cl->out, p, n);
        cl->out_len = n;
        cl->out_off = 0;
        cl->out_since_ms = now_ms();
    } else {
        char *m = realloc(cl->out, cl->out_len + n);
        if (m) {
            memcpy(m + cl->out_len, p, n);
            cl->out = m;
            cl->out_len += n;
        }
        free(own);
    }
    flush_out(cl); /* a failure shows as POLLHUP/POLLERR at the next poll */
}

static void reply(struct client *cl, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void reply(struct client *cl, const char *fmt, ...)
{
    char buf[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf, sizeof buf - 1, fmt, ap);
    va_end(ap);
    if (n < 0)
        return;
    if (n > (int)sizeof buf - 2)
        n = (int)sizeof buf - 2;
    buf[n++] = '\n';
    queue(cl, buf, (size_t)n, NULL);
}

/* A reply built by sb_printf (room for the NUL at buf[n]): sent as one line, buf freed. */
static void reply_buf(struct client *cl, char *buf, size_t n)
{
    if (!buf) {
        reply(cl, "{\"ok\": false, \"error\": \"out of memory\"}");
        return;
    }
    buf[n] = '\n';
    queue(cl, buf, n + 1, buf);
}

static void send_status(struct client *cl)
{
    size_t n = 0;
    char *buf = shim_status_alloc(&n);
    reply_buf(cl, buf, n);
}

static int g_pauser = -1; /* index of the connection holding the pause */
static int g_susp_holder = -1; /* index of the connection whose suspension ends with it (no `keep` yet) */

/* A timeout in ms, 0-600000, alone on the rest of the line. */
static int parse_ms(const char *p, long *ms)
{
    char *end;
    long v = strtol(p, &end, 10);
    if (end == p || *end || v < 0 || v > 600000)
        return 0;
    *ms = v;
    return 1;
}

static long long elapsed_ns(const struct timespec *t0)
{
    struct timespec t1;
    clock_gettime(CLOCK_MONOTONIC, &t1);
    return (t1.tv_sec - t0->tv_sec) * 1000000000ll + (t1.tv_nsec - t0->tv_nsec);
}

/* ---- The verbs, one function each (the table `verbs` below names them).  Each is called with the
 * client, its index (what owns a pause or a suspension) and the rest of the line after the verb's
 * name: empty, or a space and the verb's words. */

static void v_status(struct client *cl, int idx, char *rest) { send_status(cl); }

static void v_ping(struct client *cl, int idx, char *rest)
{
    reply(cl, "{\"ok\": true, \"pid\": %d, \"schema\": %d}", (int)getpid(), SCHEMA);
}

static void v_pause(struct client *cl, int idx, char *rest)
{
    char *end;
    long ms = *rest ? strtol(rest + 1, &end, 10) : 5000;
    if (*rest && (*end || ms < 0 || ms > 600000)) {
        reply(cl, "{\"ok\": false, \"error\": \"pause takes a timeout in ms (0-600000)\"}");
        return;
    }
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    int r = gputrace_shim_pause((int)ms);
    long long ns = elapsed_ns(&t0);
    if (r == 0) {
        g_pauser = idx;
        reply(cl, "{\"ok\": true, \"paused\": true, \"drain_ns\": %lld, \"waiting\": %d}", ns,
              gputrace_shim_waiting());
    } else if (r == -2) {
        reply(cl, "{\"ok\": false, \"error\": \"already paused\"}");
    } else {
        reply(cl,
              "{\"ok\": false, \"error\": \"busy\", \"detail\": \"calls still in flight after %ld ms; the gate is "
              "open again\", \"in_flight\": %d}",
              ms, gputrace_shim_in_flight());
    }
}

static void v_close(struct client *cl, int idx, char *rest)
{
    long ms = 1000;
    if (*rest && !parse_ms(rest + 1, &ms)) {
        reply(cl, "{\"ok\": false, \"error\": \"close takes a timeout in ms (0-600000)\"}");
        return;
    }
    if (gate_suspended()) {
        reply(cl, "{\"ok\": false, \"error\": \"suspended\"}");
        return;
    }
    unsigned long long n = 0;
    int r = gate_close((int)ms, &n);
    if (r == 0) {
        g_pauser = idx;
        reply(cl, "{\"ok\": true, \"paused\": true, \"collectives\": %llu, \"in_flight\": %d, \"waiting\": %d}", n,
              gputrace_shim_in_flight(), gputrace_shim_waiting());
    } else if (r == -2) {
        reply(cl, "{\"ok\": false, \"error\": \"already paused\"}");
    } else {
        reply(cl, "{\"ok\": false, \"error\": \"busy\", \"detail\": \"a collective launch still in the gate after %ld "
                  "ms; the gate is open again\"}", ms);
    }
}

/* advance and drain act on a gate this connection closed. */
static int holds_gate(struct client *cl, int idx)
{
    if (g_pauser == idx)
        return 1;
    reply(cl, "{\"ok\": false, \"error\": \"not paused\", \"detail\": \"close the gate through this connection "
              "first\"}");
    return 0;
}

static void v_advance(struct client *cl, int idx, char *rest)
{
    char *end, *words = rest + 1;
    errno = 0;
    unsigned long long target = strtoull(words, &end, 10);
    long ms = 5000;
    if (errno || end == words || (*end && (*end != ' ' || !parse_ms(end + 1, &ms)))) {
        reply(cl, "{\"ok\": false, \"error\": \"usage: advance COLLECTIVES [MS]\"}");
        return;
    }
    if (!holds_gate(cl, idx))
        return;
    unsigned long long n = 0;
    int r = gate_advance(target, (int)ms, &n);
    if (r == 0)
        reply(cl, "{\"ok\": true, \"paused\": true, \"collectives\": %llu}", n);
    else if (r == -1)
        reply(cl, "{\"ok\": false, \"error\": \"timeout\", \"detail\": \"%llu of %llu collectives launched after %ld "
                  "ms; the gate is closed\", \"collectives\": %llu}", n, target, ms, n);
    else
        reply(cl, "{\"ok\": false, \"error\": \"not paused\"}");
}

static void v_drain(struct client *cl, int idx, char *rest)
{
    long ms = 5000;
    if (*rest && !parse_ms(rest + 1, &ms)) {
        reply(cl, "{\"ok\": false, \"error\": \"drain takes a timeout in ms (0-600000)\"}");
        return;
    }
    if (!holds_gate(cl, idx))
        return;
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    if (gate_drain((int)ms) != 0) {
        reply(cl, "{\"ok\": false, \"error\": \"timeout\", \"detail\": \"driver calls still in flight after %ld ms; "
                  "the gate is closed\", \"in_flight\": %d}", ms, gputrace_shim_in_flight());
        return;
    }
    long long drain_ns = elapsed_ns(&t0);
    long left = ms - (long)(drain_ns / 1000000);
    uint64_t sync_ns = 0;
    const char *e = dump_sync(left > 0 ? (int)left : 0, &sync_ns);
    if (e && !strcmp(e, "timeout"))
        reply(cl, "{\"ok\": false, \"error\": \"timeout\", \"detail\": \"work on the device still running after %ld "
                  "ms; the gate is closed\"}", ms);
    else if (e)
        reply(cl, "{\"ok\": false, \"error\": \"driver error\", \"detail\": \"%s\"}", e);
    else
        reply(cl, "{\"ok\": true, \"paused\": true, \"drain_ns\": %lld, \"sync_ns\": %llu}", drain_ns,
              (unsigned long long)sync_ns);
}

static void v_resume(struct client *cl, int idx, char *rest)
{
    if (gate_suspended()) {
        reply(cl, "{\"ok\": false, \"error\": \"suspended\", \"detail\": \"the device memory is off the GPU: "
                      "unsuspend brings it back and reopens the gate\"}");
        return;
    }
    int r = gputrace_shim_resume();
    g_pauser = -1;
    if (r == 0)
        reply(cl, "{\"ok\": true, \"paused\": false}");
    else
        reply(cl, "{\"ok\": false, \"error\": \"not paused\"}");
}

/* The descriptor sent with the command, taken: -1 if none. */
static int take_passed(struct client *cl)
{
    int fd = cl->passed;
    cl->passed = -1;
    return fd;
}

static void v_rehome(struct client *cl, int idx, char *rest)
{
    int fd = take_passed(cl);
    dump_writeback_finish();
    const char *e = fd < 0 ? "pass the file's descriptor with the command" : dump_rehome(fd);
    if (e) {
        if (fd >= 0)
            close(fd);
        reply(cl, "{\"ok\": false, \"error\": \"%s\"}", e);
    } else {
        reply(cl, "{\"ok\": true}");
    }
}

static void v_emulate(struct client *cl, int idx, char *rest)
{
    char *buf = emul_command(rest);
    if (!buf) {
        reply(cl, "{\"ok\": false, \"error\": \"out of memory\"}");
        return;
    }
    queue(cl, buf, strlen(buf), buf);
}

/* dump, restore, suspend, unsuspend: dump.c's; who holds the gate and the suspension afterwards. */
static void run_dump(struct client *cl, int idx, char *rest, int mode)
{
    int fd = take_passed(cl);
    size_t n = 0;
    int was = gate_suspended();
    char *buf = dump_command(mode, rest, fd, g_pauser == idx, idx, &n);
    if (gate_suspended() && g_pauser == idx)
        g_pauser = -1; /* the gate is the suspension's now, not this connection's */
    if (!was && gate_suspended())
        g_susp_holder = idx; /* until `keep`: undone if this connection closes first */
    if (!gate_suspended())
        g_susp_holder = -1;
    reply_buf(cl, buf, n);
}

static void v_dump(struct client *cl, int idx, char *rest) { run_dump(cl, idx, rest, M_DUMP); }
static void v_restore(struct client *cl, int idx, char *rest) { run_dump(cl, idx, rest, M_RESTORE); }
static void v_suspend(struct client *cl, int idx, char *rest) { run_dump(cl, idx, rest, M_SUSPEND); }
static void v_unsuspend(struct client *cl, int idx, char *rest) { run_dump(cl, idx, rest, M_UNSUSPEND); }

static void v_digest(struct client *cl, int idx, char *rest)
{
    int fd = take_passed(cl);
    size_t n = 0;
    dump_writeback_finish(); /* (the pool is no longer a streamed dump's: dump.c) */
    char *buf = dump_digest(rest, fd, g_pauser == idx, &n);
    reply_buf(cl, buf, n);
}

static void v_release(struct client *cl, int idx, char *rest)
{
    size_t n = 0;
    dump_writeback_finish();
    char *buf = dump_release_command(&n);
    reply_buf(cl, buf, n);
}

static void v_prepare_suspend(struct client *cl, int idx, char *rest)
{
    size_t n = 0;
    dump_writeback_finish();
    char *buf = suspend_prepare_command(&n);
    reply_buf(cl, buf, n);
}

static void v_writeback(struct client *cl, int idx, char *rest)
{
    size_t n = 0;
    char *buf = dump_writeback_command(rest, &n);
    reply_buf(cl, buf, n);
}

static void v_keep(struct client *cl, int idx, char *rest)
{
    if (!gate_suspended())
        reply(cl, "{\"ok\": false, \"error\": \"not suspended\"}");
    else if (g_susp_holder >= 0 && g_susp_holder != idx)
        reply(cl, "{\"ok\": false, \"error\": \"the suspension belongs to another connection\"}");
    else {
        g_susp_holder = -1;
        reply(cl, "{\"ok\": true, \"suspended\": true, \"kept\": true}");
    }
}

/* How a verb's name ends on the line: the line is the name alone (NAME), words may follow it after a
 * space (WORDS), or must (ARGS). */
enum { NAME, WORDS, ARGS };

static const struct verb {
    const char *name;
    int words;
    void (*fn)(struct client *cl, int idx, char *rest);
} verbs[] = {
    {"status", NAME, v_status},     {"ping", NAME, v_ping},       {"pause", WORDS, v_pause},
    {"close", WORDS, v_close},      {"advance", ARGS, v_advance}, {"drain", WORDS, v_drain},
    {"resume", NAME, v_resume},     {"rehome", NAME, v_rehome},   {"emulate", WORDS, v_emulate},
    {"dump", WORDS, v_dump},        {"restore", WORDS, v_restore}, {"suspend", WORDS, v_suspend},
    {"unsuspend", WORDS, v_unsuspend}, {"digest", WORDS, v_digest}, {"release", NAME, v_release},
    {"keep", NAME, v_keep},         {"prepare_suspend", NAME, v_prepare_suspend},
    {"writeback", WORDS, v_writeback},
};

/* One command line: trimmed of spaces (and a CR), then run by the verb it names. */
static void command(struct client *cl, int idx, char *line)
{
    while (*line == ' ')
        line++;
    size_t n = strlen(line);
    while (n && (line[n - 1] == ' ' || line[n - 1] == '\r'))
        line[--n] = 0;
    for (size_t i = 0; i < sizeof verbs / sizeof *verbs; i++) {
        const struct verb *v = &verbs[i];
        size_t k = strlen(v->name);
        char *rest = line + k;
        if (strncmp(line, v->name, k) || (v->words == NAME && *rest) || (v->words == WORDS && *rest && *rest != ' ') ||
            (v->words == ARGS && *rest != ' '))
            continue;
        v->fn(cl, idx, rest);
        return;
    }
    reply(cl, "{\"ok\": false, \"error\": \"unknown command; try status, pause [MS], resume, ping, dump, "
                  "restore, suspend, unsuspend, keep, rehome, digest, release, prepare_suspend, writeback, emulate, close [MS], "
                  "advance N [MS], drain [MS]\"}");
}

static void drop(struct client *cls, int i)
{
    close(cls[i].fd);
    if (cls[i].passed >= 0)
        close(cls[i].passed);
    free(cls[i].out);
    cls[i].out = NULL;
    cls[i].out_len = cls[i].out_off = 0;
    cls[i].passed = -1;
    cls[i].fd = -1;
    cls[i].len = 0;
    dump_unstage(i); /* what it staged is no one's now */
    dump_writeback_drop(i); /* ... and a streamed dump's chunks it did not ask for */
    if (g_susp_holder == i) { /* its suspender went away before keeping it: give the job back */
        g_susp_holder = -1;
        size_t n = 0;
        char none[1] = "";
        char *buf = dump_command(M_UNSUSPEND, none, -1, 1, -1, &n);
        if (gate_suspended())
            shim_log("the connection that suspended this process closed before keeping the suspension, and "
                     "unsuspending failed: %s", buf ? buf : "out of memory");
        else
            shim_log("the connection that suspended this process closed before keeping the suspension: unsuspended");
        free(buf);
    }
    if (g_pauser == i) { /* the pausing connection went away: never leave the job stopped (unless suspended) */
        gputrace_shim_resume();
        g_pauser = -1;
    }
}

/* The descriptors to poll: every client (for its reply to go out, or its commands to come in), and the
 * listening socket while there is room; how long to wait (until the oldest reply's deadline).  A
 * client whose reply has waited OUT_DEADLINE_MS is dropped here.  Returns how many there are. */
static int poll_set(struct client *cls, int lfd, struct pollfd *pf, int *map, int *wait_ms)
{
    int n = 0, nclients = 0;
    *wait_ms = -1;
    uint64_t now = now_ms();
    for (int i = 0; i < MAX_CLIENTS; i++) {
        if (cls[i].fd < 0)
            continue;
        nclients++;
        if (cls[i].out) {
            uint64_t due = cls[i].out_since_ms + OUT_DEADLINE_MS;
            if (due <= now) { /* it has not read a reply for OUT_DEADLINE_MS: let the others be */
                shim_log("dropping a control client that has not read its reply for %d s", OUT_DEADLINE_MS / 1000);
                drop(cls, i);
                nclients--;
                continue;
            }
            if (*wait_ms < 0 || (int)(due - now) < *wait_ms)
                *wait_ms = (int)(due - now);
        }
        /* While a reply waits, that client's further commands stay unread: it cannot queue more. */
        pf[n] = (struct pollfd){.fd = cls[i].fd, .events = cls[i].out ? POLLOUT : POLLIN};
        map[n++] = i;
    }
    if (nclients < MAX_CLIENTS) {
        pf[n] = (struct pollfd){.fd = lfd, .events = POLLIN};
        map[n++] = -1;
    }
    return n;
}

/* A new connection, kept where its peer is this process's user or root; anyone else is told so and
 * closed. */
static void accept_client(struct client *cls, int lfd)
{
    int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0)
        return;
    struct ucred cr;
    socklen_t len = sizeof cr;
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &len) != 0 || (cr.uid != 0 && cr.uid != geteuid())) {
        char msg[160];
        int m = snprintf(msg, sizeof msg, "{\"ok\": false, \"error\": \"permission denied: only uid %d "
                         "or root may control this process\"}\n", (int)geteuid());
        if (send(fd, msg, (size_t)m, MSG_NOSIGNAL | MSG_DONTWAIT) < 0) {
            /* nothing to do: it is refused either way */
        }
        close(fd);
        return;
    }
    for (int i = 0; i < MAX_CLIENTS; i++)
        if (cls[i].fd < 0) {
            cls[i] = (struct client){.fd = fd, .passed = -1};
            break;
        }
}

/* What the client sent, added to its buffer, with the descriptors sent along (SCM_RIGHTS: the last
 * one kept).  1: something came; 0: nothing to read now; -1: the client is gone. */
static int receive(struct client *c)
{
    struct iovec iov = {c->buf + c->len, sizeof c->buf - 1 - c->len};
    union {
        struct cmsghdr h;
        char b[CMSG_SPACE(sizeof(int) * 4)];
    } cm;
    struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cm.b, .msg_controllen = sizeof cm.b};
    ssize_t r = recvmsg(c->fd, &mh, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
    if (r < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK))
        return 0;
    for (struct cmsghdr *h = r > 0 ? CMSG_FIRSTHDR(&mh) : NULL; h; h = CMSG_NXTHDR(&mh, h))
        if (h->cmsg_level == SOL_SOCKET && h->cmsg_type == SCM_RIGHTS) {
            int nfd = (int)((h->cmsg_len - CMSG_LEN(0)) / sizeof(int));
            for (int q = 0; q < nfd; q++) {
                int f;
                memcpy(&f, CMSG_DATA(h) + q * sizeof(int), sizeof f);
                if (c->passed >= 0) /* keep the last one sent */
                    close(c->passed);
                c->passed = f;
            }
        }
    if (r <= 0)
        return -1;
    c->len += (size_t)r;
    return 1;
}

/* The client's complete lines, each a command; a line that fills the buffer drops the client. */
static void run_lines(struct client *cls, int i)
{
    struct client *c = &cls[i];
    char *nl;
    /* One reply at a time: the next command waits until this one's reply is sent. */
    while (c->fd >= 0 && !c->out && (nl = memchr(c->buf, '\n', c->len))) {
        *nl = 0;
        command(c, i, c->buf);
        size_t used = (size_t)(nl + 1 - c->buf);
        memmove(c->buf, nl + 1, c->len - used);
        c->len -= used;
    }
    if (c->fd >= 0 && !c->out && c->len >= sizeof c->buf - 1) {
        reply(c, "{\"ok\": false, \"error\": \"line too long\"}");
        drop(cls, i);
    }
}

/* Client i's socket is ready: its queued reply sent on, or what it sent read and run. */
static void serve_client(struct client *cls, int i, short revents)
{
    struct client *c = &cls[i];
    if (c->out) {
        if (flush_out(c) < 0 || (revents & (POLLHUP | POLLERR)))
            drop(cls, i);
        else if (!c->out && c->len) /* commands that came while the reply waited */
            run_lines(cls, i);
        return;
    }
    int r = receive(c);
    if (r < 0)
        drop(cls, i);
    else if (r > 0)
        run_lines(cls, i);
}

static void *serve(void *arg)
{
    (void)arg;
    prctl(PR_SET_NAME, "gputrace-shim", 0, 0, 0);
    struct client cls[MAX_CLIENTS];
    for (int i = 0; i < MAX_CLIENTS; i++)
        cls[i] = (struct client){.fd = -1, .passed = -1};
    int lfd = g_listen;
    for (;;) {
        struct pollfd pf[MAX_CLIENTS + 1];
        int map[MAX_CLIENTS + 1], wait_ms;
        int n = poll_set(cls, lfd, pf, map, &wait_ms);
        if (poll(pf, (nfds_t)n, wait_ms) < 0) {
            if (errno == EINTR)
                continue;
            shim_log("control server stops: poll: %s", strerror(errno));
            return NULL;
        }
        for (int k = 0; k < n; k++) {
            if (!pf[k].revents)
                continue;
            if (map[k] < 0)
                accept_client(cls, lfd);
            else
                serve_client(cls, map[k], pf[k].revents);
        }
    }
}

void control_start(void)
{
    int zero = 0;
    if (!atomic_compare_exchange_strong(&g_state, &zero, -1))
        return;
    char dir[sizeof g_path];
    if (!choose_dir(dir, sizeof dir))
        return;
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    if ((size_t)snprintf(sa.sun_path, sizeof sa.sun_path, "%s/shim-%d.sock", dir, (int)getpid()) >= sizeof sa.sun_path) {
        shim_log("not serving: socket path too long under %s", dir);
        return;
    }
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        shim_log("not serving: socket: %s", strerror(errno));
        return;
    }
    unlink(sa.sun_path); /* a dead process's socket with our pid; the directory is ours alone */
    if (bind(fd, (struct sockaddr *)&sa, sizeof sa) != 0 || chmod(sa.sun_path, 0600) != 0 || listen(fd, 16) != 0) {
        shim_log("not serving: %s: %s", sa.sun_path, strerror(errno));
        close(fd);
        return;
    }
    memcpy(g_path, sa.sun_path, sizeof g_path);
    g_listen = fd;
    g_owner = getpid();
    int err = shim_spawn_detached(serve, NULL, 256 * 1024);
    if (err) {
        shim_log("not serving: pthread_create: %s", strerror(err));
        unlink(g_path);
        close(fd);
        g_listen = -1;
        return;
    }
    atomic_store(&g_state, 1);
}

__attribute__((destructor)) static void control_cleanup(void)
{
    if (atomic_load(&g_state) != 1 || g_owner != getpid())
        return;
    unlink(g_path);
    /* The checkpointer's lock file beside the socket (checkpointer/ops.py): ours to remove once we are
     * gone, since nobody can checkpoint this process any more. */
    char lock[sizeof g_path];
    size_t n = strlen(g_path);
    if (n > 5 && n < sizeof lock && !strcmp(g_path + n - 5, ".sock")) {
        memcpy(lock, g_path, n - 5);
        memcpy(lock + n - 5, ".lock", 6);
        unlink(lock);
    }
}
