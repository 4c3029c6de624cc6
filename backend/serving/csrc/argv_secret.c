/* Keeps a secret off a process's command line: preloaded (LD_PRELOAD) into tritonserver by
 * backend/serving/argv_secret.py.
 *
 * tritonserver 2.51 takes its repository admin key from argv only, and /proc/<pid>/cmdline is
 * readable by every local user. The launcher passes instead an argument that ends in
 * MARK + the path of a 0600 file holding the key. Before main() runs, this constructor (glibc
 * passes argc/argv/envp to it) reads the file, points that argv slot at a heap copy of the
 * argument with the key in place of the marker, and unlinks the file. /proc/<pid>/cmdline shows
 * the original bytes (the kernel reads the process's argument area, not the argv array), so it
 * keeps showing the path of a file that no longer exists. Fails closed: a missing, foreign,
 * group/other-readable or oversized file stops the process before main().
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define MARK "@triton-llm-secret-file:"
#define MAX_SECRET 256

static void die(const char *what, const char *path) {
    fprintf(stderr, "argv_secret: %s: %s\n", what, path);
    _exit(78);                          /* EX_CONFIG */
}

static size_t read_secret(const char *path, char *buf) {
    int fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) die("cannot open the secret file", path);
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) die("not a regular file", path);
    if (st.st_uid != getuid()) die("not owned by this user", path);
    if (st.st_mode & 077) die("readable or writable by others (want mode 0600)", path);
    if (st.st_size < 1 || st.st_size > MAX_SECRET) die("empty or over 256 bytes", path);
    ssize_t n = read(fd, buf, MAX_SECRET);
    close(fd);
    if (n != st.st_size) die("short read", path);
    while (n > 0 && (buf[n - 1] == '\n' || buf[n - 1] == '\r')) n--;
    if (n == 0) die("empty", path);
    return (size_t)n;
}

__attribute__((constructor)) static void argv_secret_init(int argc, char **argv, char **envp) {
    (void)envp;
    const char *done[8];
    int ndone = 0;
    for (int i = 1; i < argc; i++) {
        char *at = strstr(argv[i], MARK);
        if (at == NULL) continue;
        const char *path = at + strlen(MARK);
        char key[MAX_SECRET];
        size_t klen = read_secret(path, key);
        size_t plen = (size_t)(at - argv[i]);
        char *arg = malloc(plen + klen + 1);
        if (arg == NULL) die("out of memory", path);
        memcpy(arg, argv[i], plen);
        memcpy(arg + plen, key, klen);
        arg[plen + klen] = '\0';
        memset(key, 0, sizeof key);
        argv[i] = arg;
        if (ndone < 8) done[ndone++] = path;
    }
    for (int i = 0; i < ndone; i++) unlink(done[i]);     /* the key now lives only in memory */
}
