/* What a pod's own network namespace gives its processes, on a host network shared by every
 * pod of the test node (LD_PRELOAD):
 *
 * - a socket bound to "any" address (0.0.0.0, or :: on a dual-stack socket) is bound to the
 *   pod's own loopback address (KVPOOL_POD_IP) instead, so replicas listening on the same port
 *   never collide and nothing listens beyond loopback;
 * - abstract Unix socket names (scoped by network namespace) are prefixed with the pod's
 *   address, in bind() and connect() alike, so they stay private to the pod.
 *
 * Go programs make their own system calls and are not affected.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <netinet/in.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>

typedef int (*socket_call)(int, const struct sockaddr *, socklen_t);

static socket_call real_call(const char *name) { return (socket_call)dlsym(RTLD_NEXT, name); }

static int pod_address(struct in_addr *out) {
    const char *ip = getenv("KVPOOL_POD_IP");
    return ip != NULL && inet_pton(AF_INET, ip, out) == 1;
}

/* An abstract name "\0name" becomes "\0<pod ip>/name" (truncated to fit). */
static socklen_t pod_abstract(const struct sockaddr *addr, socklen_t len, struct sockaddr_un *out) {
    const struct sockaddr_un *un = (const struct sockaddr_un *)addr;
    const char *ip = getenv("KVPOOL_POD_IP");
    size_t base = offsetof(struct sockaddr_un, sun_path);
    if (ip == NULL || len <= base + 1 || un->sun_path[0] != '\0') return 0;
    size_t name_len = len - base - 1, ip_len = strlen(ip), room = sizeof(out->sun_path) - 1;
    if (ip_len + 1 >= room) return 0;
    memset(out, 0, sizeof(*out));
    out->sun_family = AF_UNIX;
    memcpy(out->sun_path + 1, ip, ip_len);
    out->sun_path[1 + ip_len] = '/';
    if (name_len > room - ip_len - 1) name_len = room - ip_len - 1;
    memcpy(out->sun_path + 2 + ip_len, un->sun_path + 1, name_len);
    return (socklen_t)(base + 2 + ip_len + name_len);
}

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
    static socket_call real;
    if (real == NULL) real = real_call("bind");
    struct in_addr pod;
    if (addr != NULL && addr->sa_family == AF_INET && len >= sizeof(struct sockaddr_in) &&
        ((const struct sockaddr_in *)addr)->sin_addr.s_addr == htonl(INADDR_ANY) && pod_address(&pod)) {
        struct sockaddr_in own = *(const struct sockaddr_in *)addr;
        own.sin_addr = pod;
        return real(fd, (const struct sockaddr *)&own, sizeof(own));
    }
    if (addr != NULL && addr->sa_family == AF_INET6 && len >= sizeof(struct sockaddr_in6) &&
        IN6_IS_ADDR_UNSPECIFIED(&((const struct sockaddr_in6 *)addr)->sin6_addr) && pod_address(&pod)) {
        int v6only = 0;
        socklen_t size = sizeof(v6only);
        if (getsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &v6only, &size) == 0 && !v6only) {
            struct sockaddr_in6 own = *(const struct sockaddr_in6 *)addr;
            memset(&own.sin6_addr, 0, sizeof(own.sin6_addr));
            own.sin6_addr.s6_addr[10] = 0xff;
            own.sin6_addr.s6_addr[11] = 0xff;
            memcpy(&own.sin6_addr.s6_addr[12], &pod, 4);
            return real(fd, (const struct sockaddr *)&own, sizeof(own));
        }
    }
    if (addr != NULL && addr->sa_family == AF_UNIX) {
        struct sockaddr_un own;
        socklen_t own_len = pod_abstract(addr, len, &own);
        if (own_len) return real(fd, (const struct sockaddr *)&own, own_len);
    }
    return real(fd, addr, len);
}

int connect(int fd, const struct sockaddr *addr, socklen_t len) {
    static socket_call real;
    if (real == NULL) real = real_call("connect");
    if (addr != NULL && addr->sa_family == AF_UNIX) {
        struct sockaddr_un own;
        socklen_t own_len = pod_abstract(addr, len, &own);
        if (own_len) return real(fd, (const struct sockaddr *)&own, own_len);
    }
    return real(fd, addr, len);
}
