/* fakegpu client: one unix-socket connection per thread to the device server
 * (KREX_FAKEGPU_SOCKET), synchronous fixed-size requests. */
#define _GNU_SOURCE
#include "client.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

static __thread int t_fd = -1;
static pthread_key_t g_fd_key;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

static void close_fd(void *p)
{
    int fd = (int)(intptr_t)p - 1;
    if (fd >= 0)
        close(fd);
}

static void forget_fd_in_child(void)
{
    if (t_fd >= 0)
        close(t_fd);
    t_fd = -1;
}

static void init_once(void)
{
    pthread_key_create(&g_fd_key, close_fd);
    pthread_atfork(NULL, NULL, forget_fd_in_child);
}

static int connect_server(void)
{
    const char *path = getenv("KREX_FAKEGPU_SOCKET");
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    if (!path || strlen(path) >= sizeof(addr.sun_path))
        return -1;
    strcpy(addr.sun_path, path);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -1;
    if (connect(fd, (struct sockaddr *)&addr, sizeof(addr)) < 0) {
        close(fd);
        return -1;
    }
    pthread_once(&g_once, init_once);
    pthread_setspecific(g_fd_key, (void *)(intptr_t)(fd + 1));
    return fd;
}

static int io_full(int fd, void *buf, size_t n, int writing)
{
    for (size_t done = 0; done < n;) {
        ssize_t k = writing ? write(fd, (char *)buf + done, n - done)
                            : read(fd, (char *)buf + done, n - done);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0)
            return -1;
        done += (size_t)k;
    }
    return 0;
}

/* One request; a connection kept from an earlier server (restarted since, e.g. by
 * another test in the same process) is dropped and the request sent once more. */
int fg_call(struct fg_req *q, struct fg_rep *r)
{
    q->pid = (uint32_t)getpid();
    for (int attempt = 0; attempt < 2; attempt++) {
        int fresh = t_fd < 0;
        if (fresh && (t_fd = connect_server()) < 0)
            return -1;
        if (io_full(t_fd, q, sizeof(*q), 1) == 0 && io_full(t_fd, r, sizeof(*r), 0) == 0)
            return 0;
        close(t_fd);
        t_fd = -1;
        if (fresh)
            return -1;
    }
    return -1;
}

int fg_simple(uint32_t op, uint32_t ctx, uint64_t a, uint32_t flags, struct fg_rep *r)
{
    struct fg_req q = {.op = op, .ctx = ctx, .a = a, .flags = flags};
    struct fg_rep local;
    if (!r)
        r = &local;
    if (fg_call(&q, r) < 0)
        return -1;
    return r->status;
}

void fg_parse_kernel(const char *name, uint64_t *dur_ns, uint32_t *flags)
{
    *flags = 0;
    *dur_ns = 10000; /* unknown kernels take 10 us */
    if (strncmp(name, "spin_us_", 8) == 0)
        *dur_ns = strtoull(name + 8, NULL, 10) * 1000;
    else if (strncmp(name, "spin_ns_", 8) == 0)
        *dur_ns = strtoull(name + 8, NULL, 10);
    else if (strcmp(name, "spin_param") == 0)
        *dur_ns = 0; /* taken from the first kernel parameter (uint64 ns) */
    else if (strcmp(name, "poison") == 0)
        *flags = FG_POISON;
}

uint64_t fg_copy_ns(uint64_t n)
{
    return 2000 + n / 16;
}
