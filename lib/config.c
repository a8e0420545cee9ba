/* config.c — the configuration defaults and the check that names the bad field. */
#include "base/base.h"

#include <float.h>
#include <string.h>

kvt_config kvt_config_default(void) {
    kvt_config c = {0};
    c.struct_size = sizeof c;
    c.ratio = 32;
    c.block_rows = 4096;
    c.kappa = 16;
    c.sink_rows = 4;
    c.evict_budget_rows = 1024;
    c.recent_rows = 64;
    c.cadence_rows = 0;
    c.protect_prompt = true;
    c.evict_archive = false;
    c.evict_shared_draw = false;
    c.evict_vase = false;
    c.seed = 0x6b76746965720001ull; /* "kvtier" 1 */
    c.recall = KVT_RECALL_OFF;
    c.selector = KVT_SELECT_SIGMA;
    c.recall_cap_rows = 4096;
    c.recall_margin = 1.0f;
    c.salience_budget = false;
    c.budget_min_kept = 256;
    c.sigma_basis = KVT_SIGMA_FOURIER;
    c.recall_promote_capacity = 0;
    c.recall_promote_hits = 3;
    c.recall_promote_window = 8;
    c.recall_lagged_query = false;
    c.evict_ratio_budget = false;
    return c;
}

kvt_status kvt_config_init(kvt_config *out, size_t struct_size) {
    const kvt_config c = kvt_config_default();
    return kvt__struct_init(out, struct_size, KVT_CONFIG_SIZE_MIN, &c, sizeof c, "kvt_config");
}

/* Caps that keep row arithmetic in 32 bits and far from overflow. */
#define KVT__MAX_RATIO (1u << 20)
#define KVT__MAX_BLOCK (1u << 20)
#define KVT__MAX_BUDGET (1u << 28)
#define KVT__MAX_SIGMA_BASIS (1u << 24) /* values of σ's basis: 64 MiB of fp32 */
#define KVT__MAX_PROMOTE (1u << 16)

static kvt_status check_fields(const kvt_config *c, char *err, size_t len);

kvt_status kvt__config_in(const kvt_config *user, kvt_config *out, char *err, size_t len) {
    if (!user)
        return kvt__fail(err, len, KVT_ERR_INVALID_ARGUMENT, "config is NULL");
    kvt_config c = kvt_config_default();
    kvt_status s = kvt__struct_in(&c, sizeof c, user, KVT_CONFIG_SIZE_MIN, "config");
    if (s != KVT_OK)
        return kvt__fail(err, len, s, "%s", kvt__tls_error());
    s = check_fields(&c, err, len);
    if (s == KVT_OK && out)
        *out = c;
    return s;
}

kvt_status kvt_config_check(const kvt_config *c, char *err, size_t len) {
    return kvt__config_in(c, NULL, err, len);
}

static kvt_status check_fields(const kvt_config *c, char *err, size_t len) {
    if (c->ratio < 1 || c->ratio > KVT__MAX_RATIO)
        return kvt__fail(err, len, KVT_ERR_INVALID_ARGUMENT, "config.ratio: %u not in 1..%u",
                         c->ratio, KVT__MAX_RATIO);
    if (c->block_rows < 64 || c->block_rows > KVT__MAX_BLOCK ||
        (c->block_rows & (c->block_rows - 1)) != 0)
        return kvt__fail(err, len, KVT_ERR_INVALID_ARGUMENT,
                         "config.block_rows: %u is not a power of two in 64..%u", c->block_rows,
                         KVT__MAX_BLOCK);
    if (c->kappa < 1 || c->kappa > c->block_rows / 2)
        return kvt__fail(err, len, KVT_ERR_INVALID_ARGUMENT,
                         "config.kappa: %u not in 1..block_rows/2 (%u)", c->kappa,
                         c->block_rows / 2);
    /* σ's basis ((2κ − 1) columns of block_rows fp32) is built at context creation: a config
     * within the two ranges above could ask for terabytes (κ = 2^19 at block_rows 2^20). */
    if ((uint64_t)(2u * c->kappa - 1u) * c->block_rows > KVT__MAX_SIGMA_BASIS)
        return kvt__fail(err, len, KVT_ERR_INVALID_ARGUMENT,
                         "config.kappa: %u with block_rows %u makes a sigma basis of %llu values, "
                         "above %u",
                         c->kappa, c->block_rows,
                         (unsigned long long)(2u * c->kappa - 1u) * c->block_rows,
                         KVT__MAX_SIGMA_BASIS);
    if (c->sink_rows > c->block_rows)
        return kvt__fail(err, len, KVT_ERR_INVALID_ARGUMENT,
                         "config.sink_rows: %u exceeds block_rows %u", c->sink_rows,
                         c->block_rows);
    if (c->evict_budget_rows < 1 || c->evict_budget_rows > KVT__MAX_BUDGET)
        return kvt__fail(err, len, KVT_ERR_INVALID_ARGUMENT,
                         "config.evict_budget_rows: %u not in 1..%u", c->evict_budget_rows,
                         KVT__MAX_BUDGET);
    if (c->recent_rows > KVT__MAX_BUDGET)
        return kvt__fail(err, len, KVT_ERR_INVALID_ARGUMENT, "config.recent_rows: %u too large",
                         c->recent_rows);
    /* A round keeps K scored rows next to the r newest, unscored: a budget below the window
     * would leave the scored part, the only one the policy chooses, smaller than the part it
     * never looks at (issue 35; the round's arithmetic, K + r kept, would run). */
    if (c->evict_budget_rows < c->recent_rows)
        return kvt__fail(err, len, KVT_ERR_INVALID_ARGUMENT,
                         "config.evict_budget_rows: %u is below recent_rows %u (want K >= r)",
                         c->evict_budget_rows, c->recent_rows);
    if (c->cadence_rows > KVT__MAX_BUDGET)
        return kvt__fail(err, len, KVT_ERR_INVALID_ARGUMENT, "config.cadence_rows: %u too large",
                         c->cadence_rows);
    if (c->cadence_rows == 0 && c->recent_rows == 0)
        return kvt__fail(err, len, KVT_ERR_INVALID_ARGUMENT,
                         "config.cadence_rows: 0 means c = recent_rows, which is also 0; a round "
                         "would run on every token");
    if ((unsigned)c->selector > KVT_SELECT_RANDOM)
        return kvt__fail(err, len, KVT_ERR_INVALID_ARGUMENT, "config.selector: unknown value %d",
                         (int)c->selector);
    if ((unsigned)c->sigma_basis > KVT_SIGMA_DCT)
        return kvt__fail(err, len, KVT_ERR_INVALID_ARGUMENT,
                         "config.sigma_basis: unknown value %d", (int)c->sigma_basis);
    if ((unsigned)c->recall > KVT_RECALL_MARGIN)
        return kvt__fail(err, len, KVT_ERR_INVALID_ARGUMENT, "config.recall: unknown value %d",
                         (int)c->recall);
    if (c->recall_cap_rows < 1 || c->recall_cap_rows > (1u << 24))
        return kvt__fail(err, len, KVT_ERR_INVALID_ARGUMENT,
                         "config.recall_cap_rows: %u not in 1..2^24", c->recall_cap_rows);
    if (c->budget_min_kept < 1 || c->budget_min_kept > KVT__MAX_BUDGET)
        return kvt__fail(err, len, KVT_ERR_INVALID_ARGUMENT,
                         "config.budget_min_kept: %u not in 1..%u", c->budget_min_kept,
                         KVT__MAX_BUDGET);
    if (c->recall_promote_capacity > KVT__MAX_PROMOTE)
        return kvt__fail(err, len, KVT_ERR_INVALID_ARGUMENT,
                         "config.recall_promote_capacity: %u above %u",
                         c->recall_promote_capacity, KVT__MAX_PROMOTE);
    if (c->recall_promote_window < 1 || c->recall_promote_window > 32 ||
        c->recall_promote_hits < 1 || c->recall_promote_hits > c->recall_promote_window)
        return kvt__fail(err, len, KVT_ERR_INVALID_ARGUMENT,
                         "config.recall_promote_hits %u of recall_promote_window %u: want "
                         "1 <= hits <= window <= 32",
                         c->recall_promote_hits, c->recall_promote_window);
    if (!(c->recall_margin >= 0.0f && c->recall_margin <= FLT_MAX))
        return kvt__fail(err, len, KVT_ERR_INVALID_ARGUMENT,
                         "config.recall_margin: %g is not a finite value >= 0",
                         (double)c->recall_margin);
    return KVT_OK;
}

const char *kvt_recall_mode_name(kvt_recall_mode mode) {
    switch (mode) {
    case KVT_RECALL_OFF:
        return "off";
    case KVT_RECALL_CONFORMAL:
        return "conformal";
    case KVT_RECALL_SOUND:
        return "sound";
    case KVT_RECALL_MARGIN:
        return "margin";
    }
    return "unknown";
}
