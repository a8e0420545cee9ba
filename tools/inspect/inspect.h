/*
 * inspect.h — shared pieces of kvtier-inspect. Each subcommand lives in its own file of
 * tools/inspect/ and is listed in the dispatch table of main.c; it gets argv starting at its own
 * name and returns the process exit status (INSPECT_EXIT_*). Subcommands use the public headers
 * only (kvtier.h, kvtier_trace.h).
 */
#ifndef KVT_TOOLS_INSPECT_H
#define KVT_TOOLS_INSPECT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

enum {
    INSPECT_EXIT_OK = 0,
    INSPECT_EXIT_FAIL = 1,  /* the input could not be read or processed */
    INSPECT_EXIT_USAGE = 2, /* bad command line */
};

/* Subcommands. */
int inspect_census(int argc, char **argv);
int inspect_trace(int argc, char **argv);
int inspect_snapshot(int argc, char **argv);
int inspect_calibrate(int argc, char **argv);

/* One-line error on stderr: "kvtier-inspect <cmd>: <message>". Returns code. */
int inspect_error(int code, const char *cmd, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;

/* Strict decimal parse of a whole string into 1..max ("12", not "-1", "1e3", "12x", ""). */
bool inspect_parse_count(const char *s, uint64_t max, uint64_t *out);
/* Strict parse of a finite number >= min. */
bool inspect_parse_real(const char *s, double min, double *out);
/* 8064 -> "8,064". */
void inspect_grouped(uint64_t v, char *buf, size_t n);
/* Decimal units as in docs/design.md: 264241152 -> "264.2 MB" (B, KB, MB, GB, TB, PB, EB). */
void inspect_human(uint64_t bytes, char *buf, size_t n);

#endif
