/* replay.c — main() for a fuzz target outside libFuzzer: runs LLVMFuzzerTestOneInput once per
 * file named on the command line, or per file of each directory named there (sorted, so the
 * order is stable). The plain ctest run uses it to replay the seed corpus and every input that
 * once crashed (tests/fuzz/regress/<target>/). Exit 0 when every input ran; a finding aborts. */
#include "fuzz.h"

#include <dirent.h>
#include <string.h>
#include <sys/stat.h>

static int run_file(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "replay: cannot open %s\n", path);
        return 1;
    }
    size_t cap = 4096, n = 0;
    uint8_t *buf = malloc(cap);
    size_t got;
    while (buf && (got = fread(buf + n, 1, cap - n, f)) > 0) {
        n += got;
        if (n == cap) {
            uint8_t *b = realloc(buf, cap *= 2);
            if (!b)
                free(buf);
            buf = b;
        }
    }
    fclose(f);
    if (!buf) {
        fprintf(stderr, "replay: out of memory reading %s\n", path);
        return 1;
    }
    /* An exact-size copy, so ASan sees a read past the input as libFuzzer would. */
    uint8_t *exact = malloc(n ? n : 1);
    if (!exact) {
        free(buf);
        return 1;
    }
    memcpy(exact, buf, n);
    free(buf);
    LLVMFuzzerTestOneInput(exact, n);
    free(exact);
    return 0;
}

static int cmp(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

int main(int argc, char **argv) {
    int fails = 0, runs = 0;
    for (int a = 1; a < argc; a++) {
        struct stat st;
        if (stat(argv[a], &st) != 0) {
            fprintf(stderr, "replay: %s does not exist\n", argv[a]);
            return 1;
        }
        if (!S_ISDIR(st.st_mode)) {
            fails += run_file(argv[a]);
            runs++;
            continue;
        }
        DIR *d = opendir(argv[a]);
        if (!d)
            return 1;
        char **names = NULL;
        size_t n = 0;
        struct dirent *e;
        while ((e = readdir(d)) != NULL) {
            if (e->d_name[0] == '.')
                continue;
            char **nn = realloc(names, (n + 1) * sizeof *names);
            if (!nn)
                return 1;
            names = nn;
            names[n] = malloc(strlen(argv[a]) + strlen(e->d_name) + 2);
            if (!names[n])
                return 1;
            sprintf(names[n], "%s/%s", argv[a], e->d_name);
            n++;
        }
        closedir(d);
        qsort(names, n, sizeof *names, cmp);
        for (size_t i = 0; i < n; i++) {
            fails += run_file(names[i]);
            runs++;
            free(names[i]);
        }
        free(names);
    }
    printf("replay: %d inputs, %d unreadable\n", runs, fails);
    return fails ? 1 : 0;
}
