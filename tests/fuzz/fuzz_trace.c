/* fuzz_trace.c — the trace reader: any bytes as a .kvtt file through kvt_trace_open, then
 * kvt_trace_verify and every section and row the reader exposes (meta, text, layers by index and
 * by model index, every plane's rows in chunks and whole, every query step in both dtypes,
 * needles, targets).
 *
 * The bytes go to a memfd opened by its /proc/self/fd path (kvt_trace_open takes a path), so
 * nothing touches the disk. CRCs would stop almost every mutation at the header: an input whose
 * first byte is 0x88 instead of the magic's 0x89 is written with the magic restored and every
 * header and payload CRC recomputed (fuzz_fix_crcs), so the fuzzer reaches the section parsers and the
 * cross-checks; other inputs are written as they are, which fuzzes the CRC checks themselves. Statuses must stay in each call's documented set; what open
 * accepted must be consistent (targets name needles that exist, positions within rows). */
#define _GNU_SOURCE
#include "fuzz.h"

#include "kvtier_trace.h"

#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

/* Rows and query bytes read per input: the reader holds O(sections), a fuzzed directory may
 * describe many rows; cap the reads, not what is described. */
#define FUZZ_READ_CAP (1u << 20)

static int trace_fd = -1;
static char trace_path[64];

static void read_layer(kvt_trace *t, const kvt_trace_layer *li, size_t *budget) {
    size_t row = (size_t)li->spec.n_kv_heads * li->spec.row_bytes;
    uint8_t *buf = row ? malloc(row * 8) : NULL;
    kvt_status s;
    for (uint32_t pl = 0; buf && pl <= li->spec.n_planes; pl++) {
        /* In chunks of up to 8 rows (a chunk's CRC is checked only when a read covers it). */
        for (uint64_t first = 0; first < li->n_tokens && *budget >= row * 8; first += 8) {
            uint64_t n = li->n_tokens - first < 8 ? li->n_tokens - first : 8;
            s = kvt_trace_read_rows(t, li->layer, pl, first, n, buf, row * 8);
            FUZZ_STATUS("kvt_trace_read_rows", s, KVT_ERR_IO, KVT_ERR_CORRUPT,
                        KVT_ERR_OUT_OF_RANGE);
            if (pl == li->spec.n_planes)
                FUZZ_REQUIRE(s == KVT_ERR_OUT_OF_RANGE, "plane %u of %u read", pl,
                             li->spec.n_planes);
            *budget -= row * n;
        }
        /* Whole plane at once, and one row too many, and a buffer one byte short. */
        if (li->n_tokens > 0 && li->n_tokens * row <= *budget) {
            uint8_t *all = malloc(li->n_tokens * row);
            if (all) {
                s = kvt_trace_read_rows(t, li->layer, pl, 0, li->n_tokens, all,
                                        li->n_tokens * row);
                FUZZ_STATUS("kvt_trace_read_rows", s, KVT_ERR_IO, KVT_ERR_CORRUPT,
                            KVT_ERR_OUT_OF_RANGE);
                s = kvt_trace_read_rows(t, li->layer, pl, 0, li->n_tokens, all,
                                        li->n_tokens * row - 1);
                FUZZ_REQUIRE(s == KVT_ERR_CAPACITY || s == KVT_ERR_OUT_OF_RANGE,
                             "short buffer: %s", kvt_status_name(s));
                *budget -= li->n_tokens * row;
                free(all);
            }
        }
        s = kvt_trace_read_rows(t, li->layer, pl, li->n_tokens, 1, buf, row * 8);
        FUZZ_REQUIRE(s == KVT_ERR_OUT_OF_RANGE, "row past n_tokens: %s", kvt_status_name(s));
    }
    free(buf);

    if (li->n_steps == 0)
        return;
    FUZZ_REQUIRE(li->q_dtype == KVT_DTYPE_FP32 || li->q_dtype == KVT_DTYPE_BF16, "q_dtype %d",
                 (int)li->q_dtype);
    size_t q32 = (size_t)li->n_q_heads * li->q_dim * 4;
    uint8_t *q = malloc(q32 ? q32 : 1);
    for (uint64_t st = 0; q && st <= li->n_steps && *budget >= q32; st++) {
        uint64_t pos = 0, pos2 = 0;
        s = kvt_trace_query_position(t, li->layer, st, &pos);
        FUZZ_STATUS("kvt_trace_query_position", s, KVT_ERR_OUT_OF_RANGE);
        FUZZ_REQUIRE((s == KVT_OK) == (st < li->n_steps), "step %llu of %llu",
                     (unsigned long long)st, (unsigned long long)li->n_steps);
        if (s == KVT_OK)
            FUZZ_REQUIRE(pos <= li->n_tokens, "position %llu past %llu rows",
                         (unsigned long long)pos, (unsigned long long)li->n_tokens);
        static const kvt_dtype as[] = {KVT_DTYPE_FP32, KVT_DTYPE_BF16, KVT_DTYPE_FP16};
        for (size_t a = 0; a < 3; a++) {
            s = kvt_trace_read_query(t, li->layer, st, as[a], q, q32, &pos2);
            FUZZ_STATUS("kvt_trace_read_query", s, KVT_ERR_OUT_OF_RANGE, KVT_ERR_UNSUPPORTED,
                        KVT_ERR_CAPACITY, KVT_ERR_IO, KVT_ERR_CORRUPT);
            if (s == KVT_OK)
                FUZZ_REQUIRE(pos2 == pos, "read_query position %llu != %llu",
                             (unsigned long long)pos2, (unsigned long long)pos);
        }
        *budget -= q32;
    }
    free(q);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    uint8_t *fixed = NULL;
    if (size > 0 && data[0] == 0x88) {
        fixed = malloc(size);
        FUZZ_REQUIRE(fixed, "oom");
        memcpy(fixed, data, size);
        fuzz_fix_crcs(fixed, size);
        data = fixed;
    }
    if (trace_fd < 0) {
        trace_fd = memfd_create("kvt_fuzz_trace", 0);
        FUZZ_REQUIRE(trace_fd >= 0, "memfd_create failed");
        snprintf(trace_path, sizeof trace_path, "/proc/self/fd/%d", trace_fd);
    }
    FUZZ_REQUIRE(ftruncate(trace_fd, 0) == 0, "ftruncate");
    FUZZ_REQUIRE(size == 0 || pwrite(trace_fd, data, size, 0) == (ssize_t)size, "pwrite");

    kvt_trace *t = NULL;
    char err[256];
    kvt_status s = kvt_trace_open(trace_path, &t, err, sizeof err);
    FUZZ_STATUS("kvt_trace_open", s, KVT_ERR_IO, KVT_ERR_PARSE, KVT_ERR_CORRUPT,
                KVT_ERR_UNSUPPORTED, KVT_ERR_OUT_OF_MEMORY);
    free(fixed);
    if (s != KVT_OK) {
        FUZZ_REQUIRE(t == NULL, "*out set on failure");
        return 0;
    }
    uint32_t major = 0, minor = 0;
    kvt_trace_format_version(t, &major, &minor);
    FUZZ_REQUIRE(major == KVT_TRACE_FORMAT_MAJOR, "major %u accepted", major);
    (void)kvt_trace_prompt_rows(t);
    uint32_t n_model = kvt_trace_n_model_layers(t);
    size_t text_len = 0;
    const char *text = kvt_trace_text(t, &text_len);
    FUZZ_REQUIRE(text && strlen(text) <= text_len && text_len <= KVT_TRACE_MAX_TEXT_BYTES,
                 "text length %zu", text_len);

    s = kvt_trace_verify(t);
    FUZZ_STATUS("kvt_trace_verify", s, KVT_ERR_CORRUPT, KVT_ERR_IO);

    size_t budget = FUZZ_READ_CAP;
    uint32_t n = kvt_trace_n_layers(t);
    FUZZ_REQUIRE(n <= KVT_TRACE_MAX_LAYERS, "%u layers", n);
    for (uint32_t i = 0; i <= n; i++) {
        kvt_trace_layer li, again;
        s = kvt_trace_layer_info(t, i, &li);
        FUZZ_REQUIRE((s == KVT_OK) == (i < n), "layer_info %u of %u: %s", i, n,
                     kvt_status_name(s));
        if (s != KVT_OK) {
            FUZZ_REQUIRE(s == KVT_ERR_OUT_OF_RANGE, "layer_info: %s", kvt_status_name(s));
            continue;
        }
        FUZZ_REQUIRE(li.layer < n_model, "layer %u of a %u-layer model", li.layer, n_model);
        FUZZ_REQUIRE(kvt_layer_spec_check(&li.spec, err, sizeof err) == KVT_OK &&
                         li.spec.kind != KVT_LAYER_NO_KV,
                     "layer %u: spec accepted by open, refused by check: %s", li.layer, err);
        FUZZ_REQUIRE(kvt_trace_find_layer(t, li.layer, &again) == KVT_OK &&
                         again.n_tokens == li.n_tokens && again.n_steps == li.n_steps,
                     "find_layer(%u) disagrees with layer_info(%u)", li.layer, i);
        read_layer(t, &li, &budget);
    }
    kvt_trace_layer none;
    s = kvt_trace_find_layer(t, n_model, &none);
    FUZZ_REQUIRE(s == KVT_ERR_OUT_OF_RANGE, "find_layer past the model: %s", kvt_status_name(s));

    uint32_t n_needles = 0, n_targets = 0;
    const kvt_trace_needle *nd = kvt_trace_needles(t, &n_needles);
    const kvt_trace_target *tg = kvt_trace_targets(t, &n_targets);
    FUZZ_REQUIRE((nd == NULL) == (n_needles == 0) && (tg == NULL) == (n_targets == 0),
                 "needles %u / targets %u with their arrays", n_needles, n_targets);
    for (uint32_t i = 0; i < n_needles; i++) {
        kvt_trace_layer li;
        FUZZ_REQUIRE(kvt_trace_find_layer(t, nd[i].layer, &li) == KVT_OK && nd[i].n_rows >= 1 &&
                         nd[i].first_row + nd[i].n_rows <= li.n_tokens &&
                         nd[i].first_row + nd[i].n_rows > nd[i].first_row,
                     "needle %u outside its layer's rows", i);
    }
    for (uint32_t i = 0; i < n_targets; i++) {
        FUZZ_REQUIRE(tg[i].needle < n_needles && tg[i].n_heads >= 1 && tg[i].heads,
                     "target %u names needle %u of %u", i, tg[i].needle, n_needles);
        kvt_trace_layer li;
        FUZZ_REQUIRE(kvt_trace_find_layer(t, nd[tg[i].needle].layer, &li) == KVT_OK &&
                         tg[i].step < li.n_steps,
                     "target %u: step past the layer's queries", i);
        for (uint32_t h = 0; h < tg[i].n_heads; h++)
            FUZZ_REQUIRE(tg[i].heads[h] < li.n_q_heads, "target %u head %u", i, tg[i].heads[h]);
    }
    kvt_trace_close(t);
    return 0;
}
