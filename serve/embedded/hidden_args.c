/* Arguments for tritonserver that must not show in the process list, where every user of the machine can
 * read a process's command line. Preloaded into the server (LD_PRELOAD), this wraps main: the lines of the
 * file that $TORCHSHIP_HIDDEN_ARGS names are appended to the argv that main receives, while
 * /proc/PID/cmdline keeps showing only the arguments the process was started with. The file is removed once
 * read; both variables are cleared, and LD_PRELOAD is put back to the user's own ($TORCHSHIP_USER_PRELOAD),
 * so that the server's children neither load this nor look for it but keep what the user preloads.
 * Any other program (the launcher that execs the server) runs untouched. Where anything fails (the file, an
 * allocation), the server does not start: it never runs without the arguments it was given. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef int (*main_fn)(int, char **, char **);
typedef int (*start_fn)(main_fn, int, char **, void (*)(void), void (*)(void), void (*)(void), void *);

static main_fn real_main;

static int refuse(const char *what, const char *path) {
    fprintf(stderr, "torchship: the server's hidden arguments (%s): %s; not starting without them\n", path, what);
    if (path != NULL)
        unlink(path);
    return 2;
}

static int main_with_hidden_args(int argc, char **argv, char **envp) {
    (void)envp;
    const char *path = getenv("TORCHSHIP_HIDDEN_ARGS");
    FILE *f = fopen(path, "r");
    if (f == NULL)
        return refuse(strerror(errno), path);
    size_t cap_args = (size_t)argc + 16, n = 0;
    char **args = calloc(cap_args + 1, sizeof(char *));
    if (args == NULL)
        return fclose(f), refuse("out of memory", path);
    for (; n < (size_t)argc; n++)
        args[n] = argv[n];
    char *line = NULL;
    size_t cap = 0;
    ssize_t len;
    while ((len = getline(&line, &cap, f)) > 0) {
        if (line[len - 1] == '\n')
            line[--len] = '\0';
        if (len == 0)
            continue;
        if (n == cap_args) { /* grow: every line is an argument, none dropped */
            char **more = realloc(args, (cap_args * 2 + 1) * sizeof(char *));
            if (more == NULL)
                return fclose(f), refuse("out of memory", path);
            args = more;
            cap_args *= 2;
        }
        if ((args[n] = strdup(line)) == NULL)
            return fclose(f), refuse("out of memory", path);
        args[++n] = NULL;
    }
    int failed = ferror(f);
    if (line != NULL) {
        memset(line, 0, cap);
        free(line);
    }
    fclose(f);
    if (failed)
        return refuse("cannot read it", path);
    unlink(path);
    unsetenv("TORCHSHIP_HIDDEN_ARGS");
    const char *user = getenv("TORCHSHIP_USER_PRELOAD");
    if (user != NULL && *user != '\0')
        setenv("LD_PRELOAD", user, 1);
    else
        unsetenv("LD_PRELOAD");
    unsetenv("TORCHSHIP_USER_PRELOAD");
    extern char **environ;
    return real_main((int)n, args, environ);
}

int __libc_start_main(main_fn main, int argc, char **argv, void (*init)(void), void (*fini)(void),
                      void (*rtld_fini)(void), void *stack_end) {
    start_fn next = (start_fn)dlsym(RTLD_NEXT, "__libc_start_main");
    real_main = main;
    int ours = getenv("TORCHSHIP_HIDDEN_ARGS") != NULL && strcmp(program_invocation_short_name, "tritonserver") == 0;
    return next(ours ? main_with_hidden_args : main, argc, argv, init, fini, rtld_fini, stack_end);
}
