/* simcuda-device: the simulated GPU's memory, outside the processes that use it.
 *
 * A real GPU's memory is not part of a process: the process holds /dev/nvidia* descriptors and the
 * driver maps device memory into it; when the process dies the memory goes back to the device.  CRIU
 * cannot dump such a process (it refuses the descriptors), which is why the driver's checkpoint API
 * exists.  This daemon plays that part for simcuda (libcuda.c, SIMCUDA_DEVICE=SOCKET):
 *
 *   usage: simcuda-device SOCKET DIR      serve SOCKET; device memory lives in files under DIR
 *
 * Each connection is one process's handle on the device (its "/dev/nvidia*" descriptor: a connected
 * unix stream socket whose peer is outside the process tree, which CRIU refuses to dump).  Requests,
 * one line each:
 *   alloc SIZE   a new file DIR/mem-CONN-N of SIZE bytes; reply "ok N\n" with the file's descriptor
 *                attached (SCM_RIGHTS); the process maps it MAP_SHARED at the allocation's address
 *   free N       the file is unlinked; reply "ok 0\n"
 * When a connection closes (the process died, or the driver's checkpoint dropped it) every file of
 * that connection is unlinked: the device memory is gone, as on a GPU.  A CRIU image of a process
 * that still mapped such memory would only name the file, never carry its contents.
 *
 * The daemon prints "ready\n" on stdout once it accepts connections, and ends on SIGTERM/SIGINT,
 * removing SOCKET and its files. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#define MAX_CONN 256

struct conn {
    int fd;
    unsigned id;
    unsigned next;    /* next allocation number */
    char buf[256];
    size_t len;
};

static struct conn conns[MAX_CONN];
static const char *dir;
static volatile sig_atomic_t stop;

static void on_signal(int sig) { (void)sig; stop = 1; }

static void mem_path(char *out, size_t n, unsigned conn, unsigned id)
{
    snprintf(out, n, "%s/mem-%u-%u", dir, conn, id);
}

static void drop_all(struct conn *c)
{
    char p[4096];
    for (unsigned i = 1; i < c->next; i++) {
        mem_path(p, sizeof p, c->id, i);
        unlink(p); /* already freed ones: ENOENT, fine */
    }
}

static int reply(int fd, const char *text, int attach)
{
    struct iovec iov = {(void *)text, strlen(text)};
    union {
        char buf[CMSG_SPACE(sizeof(int))];
        struct cmsghdr align;
    } u;
    struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1};
    if (attach >= 0) {
        memset(&u, 0, sizeof u);
        m.msg_control = u.buf;
        m.msg_controllen = sizeof u.buf;
        struct cmsghdr *cm = CMSG_FIRSTHDR(&m);
        cm->cmsg_level = SOL_SOCKET;
        cm->cmsg_type = SCM_RIGHTS;
        cm->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(cm), &attach, sizeof(int));
    }
    return sendmsg(fd, &m, MSG_NOSIGNAL) < 0 ? -1 : 0;
}

static int handle(struct conn *c, char *line)
{
    char p[4096];
    unsigned long long size;
    unsigned id;
    if (sscanf(line, "alloc %llu", &size) == 1) {
        id = c->next++;
        mem_path(p, sizeof p, c->id, id);
        int fd = open(p, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
        if (fd < 0 || ftruncate(fd, (off_t)size) != 0) {
            if (fd >= 0) {
                close(fd);
                unlink(p);
            }
            return reply(c->fd, "err out of device memory\n", -1);
        }
        char out[64];
        snprintf(out, sizeof out, "ok %u\n", id);
        int r = reply(c->fd, out, fd);
        close(fd);
        return r;
    }
    if (sscanf(line, "free %u", &id) == 1) {
        if (id == 0 || id >= c->next)
            return reply(c->fd, "err no such allocation\n", -1);
        mem_path(p, sizeof p, c->id, id);
        unlink(p);
        return reply(c->fd, "ok 0\n", -1);
    }
    return reply(c->fd, "err unknown request\n", -1);
}

int main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: simcuda-device SOCKET DIR\n");
        return 2;
    }
    dir = argv[2];
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    if (strlen(argv[1]) >= sizeof sa.sun_path) {
        fprintf(stderr, "simcuda-device: socket path too long: %s\n", argv[1]);
        return 2;
    }
    strcpy(sa.sun_path, argv[1]);
    if (mkdir(dir, 0700) != 0 && errno != EEXIST) {
        fprintf(stderr, "simcuda-device: cannot create %s: %s\n", dir, strerror(errno));
        return 1;
    }
    int lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    unlink(argv[1]);
    if (lfd < 0 || bind(lfd, (struct sockaddr *)&sa, sizeof sa) != 0 || listen(lfd, 64) != 0) {
        fprintf(stderr, "simcuda-device: cannot serve %s: %s\n", argv[1], strerror(errno));
        return 1;
    }
    struct sigaction act = {.sa_handler = on_signal};
    sigaction(SIGTERM, &act, NULL);
    sigaction(SIGINT, &act, NULL);
    signal(SIGPIPE, SIG_IGN);
    printf("ready\n");
    fflush(stdout);
    for (int i = 0; i < MAX_CONN; i++)
        conns[i].fd = -1;
    unsigned conn_ids = 0;
    while (!stop) {
        struct pollfd pf[MAX_CONN + 1];
        int map[MAX_CONN + 1], n = 0;
        pf[n] = (struct pollfd){.fd = lfd, .events = POLLIN};
        map[n++] = -1;
        for (int i = 0; i < MAX_CONN; i++)
            if (conns[i].fd >= 0) {
                pf[n] = (struct pollfd){.fd = conns[i].fd, .events = POLLIN};
                map[n++] = i;
            }
        if (poll(pf, (nfds_t)n, -1) < 0)
            continue; /* EINTR: the signal sets stop */
        for (int k = 0; k < n; k++) {
            if (!pf[k].revents)
                continue;
            if (map[k] < 0) {
                int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
                int slot = -1;
                for (int i = 0; fd >= 0 && i < MAX_CONN && slot < 0; i++)
                    if (conns[i].fd < 0)
                        slot = i;
                if (slot < 0) {
                    if (fd >= 0)
                        close(fd);
                    continue;
                }
                conns[slot] = (struct conn){.fd = fd, .id = ++conn_ids, .next = 1};
                continue;
            }
            struct conn *c = &conns[map[k]];
            ssize_t got = read(c->fd, c->buf + c->len, sizeof c->buf - 1 - c->len);
            if (got <= 0) { /* the process let go of the device: its memory goes with it */
                drop_all(c);
                close(c->fd);
                c->fd = -1;
                continue;
            }
            c->len += (size_t)got;
            c->buf[c->len] = 0;
            char *nl;
            while ((nl = strchr(c->buf, '\n'))) {
                *nl = 0;
                if (handle(c, c->buf) != 0)
                    break;
                size_t rest = c->len - (size_t)(nl + 1 - c->buf);
                memmove(c->buf, nl + 1, rest);
                c->len = rest;
                c->buf[c->len] = 0;
            }
            if (c->len == sizeof c->buf - 1) /* a line too long: drop it */
                c->len = 0;
        }
    }
    for (int i = 0; i < MAX_CONN; i++)
        if (conns[i].fd >= 0)
            drop_all(&conns[i]);
    unlink(argv[1]);
    return 0;
}
