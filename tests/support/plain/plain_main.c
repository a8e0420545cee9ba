/*
 * plain_main.c — the runner of tests/support/plain/criterion/criterion.h (the ThreadSanitizer
 * leg of the CUDA emulation): usage `test [--filter=GLOB] [--verbose] [--jobs N]` (--jobs and
 * --verbose accepted and ignored). Every test matching GLOB (fnmatch with extglob, as
 * Criterion's --filter, against "suite/name") runs in a child process of its own.
 */
#define _GNU_SOURCE
#include "criterion/criterion.h"

#include <fnmatch.h>
#include <stdarg.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static kvt_plain_test *tests;

void kvt_plain_register(kvt_plain_test *t) {
    t->next = tests;
    tests = t;
}

void kvt_plain_fail(const char *file, int line, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "%s:%d: ", file, line);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    fflush(stderr);
    _exit(1);
}

void kvt_plain_skip(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs("skipped: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    fflush(stderr);
    _exit(77);
}

void kvt_plain_info(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs("[----] ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
}

int main(int argc, char **argv) {
    const char *filter = "*";
    for (int i = 1; i < argc; i++)
        if (!strncmp(argv[i], "--filter=", 9))
            filter = argv[i] + 9;
    /* registration order reversed the file's: restore it */
    kvt_plain_test *ordered = NULL;
    while (tests) {
        kvt_plain_test *t = tests;
        tests = t->next;
        t->next = ordered;
        ordered = t;
    }
    int run = 0, failed = 0, skipped = 0;
    for (kvt_plain_test *t = ordered; t; t = t->next) {
        char full[512];
        snprintf(full, sizeof full, "%s/%s", t->suite, t->name);
        if (fnmatch(filter, full, FNM_EXTMATCH) != 0)
            continue;
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        fflush(NULL);
        pid_t pid = fork();
        if (pid < 0) {
            perror("fork");
            return 2;
        }
        if (pid == 0) {
            t->fn();
            fflush(NULL);
            _exit(0);
        }
        int st = 0;
        waitpid(pid, &st, 0);
        clock_gettime(CLOCK_MONOTONIC, &t1);
        const double s = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
        run++;
        if (WIFEXITED(st) && WEXITSTATUS(st) == 0) {
            printf("[PASS] %s::%s: (%.2fs)\n", t->suite, t->name, s);
        } else if (WIFEXITED(st) && WEXITSTATUS(st) == 77) {
            printf("[SKIP] %s::%s\n", t->suite, t->name);
            skipped++;
        } else {
            printf("[FAIL] %s::%s: %s %d (%.2fs)\n", t->suite, t->name,
                   WIFEXITED(st) ? "exit status" : "signal",
                   WIFEXITED(st) ? WEXITSTATUS(st) : WTERMSIG(st), s);
            failed++;
        }
        fflush(stdout);
    }
    printf("[====] Synthesis: Tested: %d | Passing: %d | Failing: %d | Skipped: %d\n", run,
           run - failed - skipped, failed, skipped);
    return failed || run == 0 ? 1 : 0;
}
