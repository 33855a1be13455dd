/* Arguments for tritonserver that must not show in the process list, where every user of the machine can
 * read a process's command line. Preloaded into the server (LD_PRELOAD), this wraps main: the lines of the
 * file that $TORCHSHIP_HIDDEN_ARGS names are appended to the argv that main receives, while
 * /proc/PID/cmdline keeps showing only the arguments the process was started with. The file is removed once
 * read, and both variables are cleared so that the server's children neither load this nor look for it.
 * Any other program (the launcher that execs the server) runs untouched. */
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

static int main_with_hidden_args(int argc, char **argv, char **envp) {
    const char *path = getenv("TORCHSHIP_HIDDEN_ARGS");
    FILE *f = fopen(path, "r");
    if (f == NULL) {
        fprintf(stderr, "torchship: cannot read the server's hidden arguments from %s: %s\n", path, strerror(errno));
        return 2;
    }
    char **args = calloc((size_t)argc + 64 + 1, sizeof(char *));
    int n = 0;
    for (; n < argc; n++)
        args[n] = argv[n];
    char *line = NULL;
    size_t cap = 0;
    ssize_t len;
    while (n < argc + 64 && (len = getline(&line, &cap, f)) > 0) {
        if (line[len - 1] == '\n')
            line[--len] = '\0';
        if (len > 0)
            args[n++] = strdup(line);
    }
    if (line != NULL) {
        memset(line, 0, cap);
        free(line);
    }
    fclose(f);
    unlink(path);
    unsetenv("TORCHSHIP_HIDDEN_ARGS");
    unsetenv("LD_PRELOAD");
    extern char **environ;
    return real_main(n, args, environ);
}

int __libc_start_main(main_fn main, int argc, char **argv, void (*init)(void), void (*fini)(void),
                      void (*rtld_fini)(void), void *stack_end) {
    start_fn next = (start_fn)dlsym(RTLD_NEXT, "__libc_start_main");
    real_main = main;
    int ours = getenv("TORCHSHIP_HIDDEN_ARGS") != NULL && strcmp(program_invocation_short_name, "tritonserver") == 0;
    return next(ours ? main_with_hidden_args : main, argc, argv, init, fini, rtld_fini, stack_end);
}
