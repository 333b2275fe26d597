/*
 * kvstore/_kvbind — an LD_PRELOAD library that makes the listening sockets of Mooncake's transfer engine bind one
 * address instead of every address. Not a Python module: `kvstore serve` starts itself again with it preloaded when
 * it has a remote tier (kvstore.tiers.remote.address), and nothing imports it.
 *
 * WHY. Mooncake's transfer engine (0.3.x) binds its handshake port and its TCP data port to INADDR_ANY / in6addr_any
 * whatever address it advertises (MC_TCP_BIND_ADDRESS), and has no setting to narrow them: a daemon meant to share
 * blocks over loopback, or over one data network, would accept connections to the memory it lends on every
 * interface of the node. The binds happen inside its setup() call, in the calling thread, so this library changes
 * only binds made by a thread that armed it, and only those to the any-address: every other socket of the daemon
 * (its Unix socket, its metrics port) is bound as asked.
 *
 * CONTRACT
 *   int kvbind_arm(const char *address)
 *     Arms the calling thread: from now on, its bind() of an IPv4 socket to 0.0.0.0 binds `address` (IPv4) instead,
 *     and its bind() of an IPv6 socket to :: binds `address` (IPv6), or ::ffff:`address` for an IPv4 one (Mooncake's
 *     dual-stack acceptor clears IPV6_V6ONLY, so a v4-mapped address takes IPv4 connections). NULL or "" disarms
 *     it (back to KVSTORE_BIND_ANY_TO's default, if any). Returns 0, or -1 when `address` is not an IP literal (the
 *     thread is then disarmed).
 *   KVSTORE_BIND_ANY_TO=<address> in the environment at load: every thread not armed otherwise binds the
 *     any-address there (for processes kvstore does not control, e.g. a baseline's Mooncake client in a benchmark).
 *   int kvbind_rewrites(void)
 *     How many binds this process has rewritten (for the daemon's log and its tests).
 *   A bind that cannot be rewritten (an IPv4 socket while armed with an IPv6 address) fails with EADDRNOTAVAIL
 *   rather than listening everywhere.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

static __thread int armed_family;            /* 0: disarmed, AF_INET or AF_INET6 */
static __thread struct in_addr armed_v4;
static __thread struct in6_addr armed_v6;
static __thread int armed_set;                /* armed by kvbind_arm (else: the process's default) */
static int default_family;                    /* from KVSTORE_BIND_ANY_TO: threads never armed */
static struct in_addr default_v4;
static struct in6_addr default_v6;
static int rewrites;

__attribute__((constructor)) static void kvbind_from_env(void) {
    const char *to = getenv("KVSTORE_BIND_ANY_TO");
    if (to == NULL || to[0] == '\0')
        return;
    if (inet_pton(AF_INET, to, &default_v4) == 1)
        default_family = AF_INET;
    else if (inet_pton(AF_INET6, to, &default_v6) == 1)
        default_family = AF_INET6;
}

static void adopt_default(void) {             /* a thread not armed takes the process's default */
    if (armed_set)
        return;
    armed_family = default_family;
    armed_v4 = default_v4;
    armed_v6 = default_v6;
}

typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);

int kvbind_arm(const char *address) {
    armed_family = 0;
    armed_set = !(address == NULL || address[0] == '\0');   /* disarmed: back to the process's default */
    if (!armed_set)
        return 0;
    if (inet_pton(AF_INET, address, &armed_v4) == 1) {
        armed_family = AF_INET;
        return 0;
    }
    if (inet_pton(AF_INET6, address, &armed_v6) == 1) {
        armed_family = AF_INET6;
        return 0;
    }
    return -1;
}

int kvbind_rewrites(void) {
    return __atomic_load_n(&rewrites, __ATOMIC_RELAXED);
}

static int real_bind(int fd, const struct sockaddr *addr, socklen_t len) {
    static bind_fn next;
    if (next == NULL)
        next = (bind_fn)dlsym(RTLD_NEXT, "bind");
    return next(fd, addr, len);
}

static int bind_v4(int fd, const struct sockaddr_in *in, socklen_t len) {
    if (armed_family != AF_INET) {
        errno = EADDRNOTAVAIL;
        return -1;
    }
    struct sockaddr_in to = *in;
    to.sin_addr = armed_v4;
    __atomic_add_fetch(&rewrites, 1, __ATOMIC_RELAXED);
    return real_bind(fd, (const struct sockaddr *)&to, len);
}

static int bind_v6(int fd, const struct sockaddr_in6 *in, socklen_t len) {
    struct sockaddr_in6 to = *in;
    if (armed_family == AF_INET6) {
        to.sin6_addr = armed_v6;
    } else {                                 /* ::ffff:a.b.c.d */
        memset(&to.sin6_addr, 0, sizeof(to.sin6_addr));
        to.sin6_addr.s6_addr[10] = 0xff;
        to.sin6_addr.s6_addr[11] = 0xff;
        memcpy(&to.sin6_addr.s6_addr[12], &armed_v4, 4);
    }
    __atomic_add_fetch(&rewrites, 1, __ATOMIC_RELAXED);
    return real_bind(fd, (const struct sockaddr *)&to, len);
}

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
    adopt_default();
    if (armed_family != 0 && addr != NULL) {
        if (addr->sa_family == AF_INET && len >= (socklen_t)sizeof(struct sockaddr_in)) {
            const struct sockaddr_in *in = (const struct sockaddr_in *)addr;
            if (in->sin_addr.s_addr == htonl(INADDR_ANY))
                return bind_v4(fd, in, len);
        } else if (addr->sa_family == AF_INET6 && len >= (socklen_t)sizeof(struct sockaddr_in6)) {
            const struct sockaddr_in6 *in6 = (const struct sockaddr_in6 *)addr;
            if (memcmp(&in6->sin6_addr, &in6addr_any, sizeof(in6addr_any)) == 0)
                return bind_v6(fd, in6, len);
        }
    }
    return real_bind(fd, addr, len);
}
