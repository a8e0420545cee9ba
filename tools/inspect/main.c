/*
 * kvtier-inspect — look at what kvtier would do with a model or a running cache.
 *
 *   kvtier-inspect census CONFIG.json [--context N] [--concurrency C] [--ratio X]
 *                         [--dtype bf16|fp16|fp32] [--json]
 *   kvtier-inspect trace FILE.kvtt [--verify] [--json] [--rows LAYER:FIRST:N]...
 *   kvtier-inspect snapshot FILE [--verify] [--json]
 *   kvtier-inspect snapshot --clean DIR [--min-age SECONDS]
 *   kvtier-inspect calibrate TRACE... -o OUT [--layer L] [--rank R]   (RoPE layers: OUT.h<H>)
 *
 * Subcommands live in their own files of tools/inspect/ and are listed in k_commands below
 * Exit status: 0 success, 1 bad input, 2 bad command line.
 */
#include "inspect.h"

#include <kvtier.h>

#include <stdio.h>
#include <string.h>

static const struct command {
    const char *name;
    int (*run)(int argc, char **argv); /* argv[0] is the subcommand's name */
    const char *summary;
} k_commands[] = {
    {"census", inspect_census, "per-layer KV cache census of a Hugging Face config.json"},
    {"trace", inspect_trace, "contents of a kvtier trace file (.kvtt); --verify checks all CRCs"},
    {"snapshot", inspect_snapshot,
     "a request snapshot: occupancy per tier and layer, sigma, memory; --verify checks it all"},
    {"calibrate", inspect_calibrate, "recall bases from traces: MLA-NoPE from queries, RoPE per KV head from keys"},
};

#define N_COMMANDS (sizeof k_commands / sizeof k_commands[0])

static void usage(FILE *f) {
    fprintf(f, "usage: kvtier-inspect COMMAND [ARGS...]   (kvtier %s)\n\ncommands:\n",
            kvt_version(NULL, NULL, NULL));
    for (size_t i = 0; i < N_COMMANDS; i++)
        fprintf(f, "  %-10s %s\n", k_commands[i].name, k_commands[i].summary);
    fprintf(f, "\n'kvtier-inspect COMMAND --help' describes a command.\n");
}

int main(int argc, char **argv) {
    if (argc < 2) {
        usage(stderr);
        return INSPECT_EXIT_USAGE;
    }
    if (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0 ||
        strcmp(argv[1], "help") == 0) {
        usage(stdout);
        return INSPECT_EXIT_OK;
    }
    if (strcmp(argv[1], "--version") == 0) {
        printf("kvtier-inspect %s\n", kvt_version(NULL, NULL, NULL));
        return INSPECT_EXIT_OK;
    }
    for (size_t i = 0; i < N_COMMANDS; i++)
        if (strcmp(argv[1], k_commands[i].name) == 0)
            return k_commands[i].run(argc - 1, argv + 1);
    return inspect_error(INSPECT_EXIT_USAGE, NULL,
                         "unknown command '%s' (try 'kvtier-inspect --help')", argv[1]);
}
