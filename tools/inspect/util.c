/* util.c — number parsing and formatting shared by kvtier-inspect subcommands. */
#include "inspect.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

int inspect_error(int code, const char *cmd, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "kvtier-inspect%s%s: ", cmd ? " " : "", cmd ? cmd : "");
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    return code;
}

bool inspect_parse_count(const char *s, uint64_t max, uint64_t *out) {
    if (!s || !isdigit((unsigned char)s[0]))
        return false;
    errno = 0;
    char *end = NULL;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno != 0 || *end != '\0' || v == 0 || v > max)
        return false;
    *out = v;
    return true;
}

bool inspect_parse_real(const char *s, double min, double *out) {
    if (!s || !(isdigit((unsigned char)s[0]) || s[0] == '.'))
        return false;
    errno = 0;
    char *end = NULL;
    double v = strtod(s, &end);
    if (errno != 0 || *end != '\0' || !isfinite(v) || v < min)
        return false;
    *out = v;
    return true;
}

void inspect_grouped(uint64_t v, char *buf, size_t n) {
    char digits[32];
    int len = snprintf(digits, sizeof digits, "%llu", (unsigned long long)v);
    char tmp[48];
    size_t o = 0;
    for (int i = 0; i < len; i++) {
        if (i > 0 && (len - i) % 3 == 0)
            tmp[o++] = ',';
        tmp[o++] = digits[i];
    }
    tmp[o] = '\0';
    snprintf(buf, n, "%s", tmp);
}

void inspect_human(uint64_t bytes, char *buf, size_t n) {
    static const char *const units[] = {"B", "KB", "MB", "GB", "TB", "PB", "EB"};
    if (bytes < 1000) {
        snprintf(buf, n, "%llu B", (unsigned long long)bytes);
        return;
    }
    double v = (double)bytes;
    int u = 0;
    while (v >= 999.95 && u < 6) {
        v /= 1000.0;
        u++;
    }
    snprintf(buf, n, "%.1f %s", v, units[u]);
}
