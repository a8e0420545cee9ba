/* make_snapshot_seeds.c — writes the fuzz_snapshot seed corpus with the library's own writer:
 * requests of the fuzz context (snapshot_ctx.h) at points that reach every state the reader
 * knows — empty, a tail only, after a close, after eviction rounds with an archive, after the
 * sliding layer returned pages — each once as written and once with its first byte 0x88 (the
 * target then fixes the CRCs, so mutations of those reach the parsers).
 * Usage: make_snapshot_seeds DIR (writes DIR/NAME.kvts and DIR/NAME-fix.kvts). */
#include "snapshot_ctx.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void die(const char *what, kvt_status s) {
    fprintf(stderr, "make_snapshot_seeds: %s: %s: %s\n", what, kvt_status_name(s),
            kvt_last_error());
    exit(1);
}

static void step(kvt_seq *seq, kvt_batch *b, uint32_t n, uint32_t salt) {
    kvt_status s = kvt_batch_reserve(b, &seq, &n, 1);
    if (s != KVT_OK)
        die("reserve", s);
    uint8_t row[64];
    for (uint32_t l = 0; l < 3; l++) {
        const kvt_layer_spec *sp = kvt_model_layer(kvt_ctx_model(kvt_seq_context(seq)), l);
        size_t slot = (size_t)sp->n_kv_heads * sp->row_bytes;
        for (uint32_t p = 0; p < sp->n_planes; p++)
            for (uint32_t i = 0; i < n; i++) {
                for (size_t k = 0; k < slot; k++)
                    row[k] = (uint8_t)((k * 37u + i * 11u + salt * 5u + l) & 0x3f);
                if ((s = kvt_seq_write(seq, l, p, i, 1, row, slot)) != KVT_OK)
                    die("write", s);
            }
    }
    if ((s = kvt_batch_commit(b, NULL)) != KVT_OK)
        die("commit", s);
}

static void save(const kvt_seq *seq, const char *dir, const char *name) {
    size_t n;
    kvt_status s = kvt_seq_snapshot_size(seq, &n);
    if (s != KVT_OK)
        die("size", s);
    uint8_t *b = malloc(n);
    if (!b || (s = kvt_seq_snapshot(seq, b, n, &n)) != KVT_OK)
        die("snapshot", s);
    char path[4096];
    for (int fix = 0; fix < 2; fix++) {
        snprintf(path, sizeof path, "%s/%s%s.kvts", dir, name, fix ? "-fix" : "");
        b[0] = fix ? 0x88 : 0x89;
        FILE *f = fopen(path, "wb");
        if (!f || fwrite(b, 1, n, f) != n || fclose(f) != 0) {
            fprintf(stderr, "make_snapshot_seeds: cannot write %s\n", path);
            exit(1);
        }
    }
    free(b);
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s DIR\n", argv[0]);
        return 2;
    }
    kvt_model *m;
    kvt_ctx *ctx = fuzz_snapshot_ctx(&m, 64);
    if (!ctx)
        die("context", KVT_ERR_INVALID_ARGUMENT);
    kvt_batch *b = NULL;
    kvt_seq *seq = NULL;
    kvt_seq_params p = kvt_seq_default_params();
    p.request_id = 3;
    p.prompt_rows = 3;
    if (kvt_batch_create(ctx, 1, &b) != KVT_OK || kvt_seq_create(ctx, &p, &seq) != KVT_OK)
        die("request", KVT_ERR_OUT_OF_MEMORY);
    save(seq, argv[1], "empty");
    step(seq, b, 9, 1);
    save(seq, argv[1], "tail");
    step(seq, b, 13, 2);
    save(seq, argv[1], "round");
    for (uint32_t i = 0; i < 50; i++)
        step(seq, b, 1 + i % 3, 3 + i);
    save(seq, argv[1], "closed_rounds_archive");
    kvt_ctx_destroy(ctx);
    kvt_model_destroy(m);
    return 0;
}
