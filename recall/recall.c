/* recall.c — the request's trigger state and the step's work item (recall.h). */
#include "recall/recall.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "recall/kernels/recall_scan.h"
#include "recall/kernels/recall_step.h"
#include "lib/base/base.h"

/* The public modes are the scan's (one number space). */
_Static_assert((int)KVT_RECALL_CONFORMAL == KVT__RECALL_CONFORMAL, "recall modes");
_Static_assert((int)KVT_RECALL_SOUND == KVT__RECALL_SOUND, "recall modes");
_Static_assert((int)KVT_RECALL_MARGIN == KVT__RECALL_MARGIN, "recall modes");

/* Candidates a promotion table holds for a capacity of C promoted rows. */
#define CAND_PER_PROMOTED 4u

static size_t layout(uint32_t n_heads, uint32_t cap, uint32_t prom_cap, size_t *samples,
                     size_t *best, size_t *fired, size_t *tail, size_t *promo) {
    size_t o = sizeof(kvt__recall_state);
    *samples = o;
    o += sizeof(float) * (size_t)n_heads * KVT__RECALL_SAMPLES_PER_HEAD;
    *best = o;
    o += sizeof(float) * n_heads;
    *fired = o;
    o += sizeof(uint32_t) * ((size_t)cap + prom_cap);
    *tail = o;
    o += 2 * sizeof(uint32_t);
    if (!prom_cap) { /* without promotion: the layout as before it existed */
        *promo = 0;
        return o;
    }
    o = (o + 7u) & ~(size_t)7u;
    *promo = o;
    return o + sizeof(kvt__recall_promo) +
           2u * sizeof(uint32_t) * ((size_t)prom_cap * CAND_PER_PROMOTED + prom_cap);
}

static kvt__recall_state initial_state(void) {
    kvt__recall_state st;
    memset(&st, 0, sizeof st);
    st.z = KVT__CONFORMAL_Z_MAX;
    st.phase = KVT__CONFORMAL_OPEN;
    return st;
}

kvt_status kvt__recall_layer_prepare(kvt__recall_layer *r, const kvt__backend *be,
                                     uint32_t n_heads, uint32_t cap, uint32_t prom_cap) {
    size_t o_s, o_b, o_f, o_t, o_p;
    size_t bytes = layout(n_heads, cap, prom_cap, &o_s, &o_b, &o_f, &o_t, &o_p);
    if (!r->buf || r->bytes != bytes || r->n_heads != n_heads || r->cap != cap ||
        r->prom_cap != prom_cap) {
        kvt__recall_layer_fini(r, be);
        void *p = NULL;
        kvt_status s = be->ops->buf_alloc(be, bytes, &p);
        if (s != KVT_OK)
            return s;
        uint8_t *b = p;
        r->buf = p;
        r->bytes = bytes;
        r->st = (kvt__recall_state *)b;
        r->samples = (float *)(b + o_s);
        r->best = (float *)(b + o_b);
        r->fired = (uint32_t *)(b + o_f);
        r->n_fired = (uint32_t *)(b + o_t);
        r->overflow = r->n_fired + 1;
        r->n_heads = n_heads;
        r->sample_cap = n_heads * KVT__RECALL_SAMPLES_PER_HEAD;
        r->cap = cap;
        r->prom_cap = prom_cap;
        r->cand_cap = prom_cap * CAND_PER_PROMOTED;
        r->promo = prom_cap ? (kvt__recall_promo *)(b + o_p) : NULL;
    }
    kvt__recall_state st = initial_state();
    uint32_t zero[2] = {0, 0};
    kvt_status s = be->ops->write(be, r->st, &st, sizeof st, NULL);
    if (s == KVT_OK)
        s = be->ops->write(be, r->n_fired, zero, sizeof zero, NULL);
    if (s == KVT_OK && r->promo) {
        kvt__recall_promo pr;
        memset(&pr, 0, sizeof pr);
        s = be->ops->write(be, r->promo, &pr, sizeof pr, NULL);
    }
    return s;
}

/* Bytes of each group plane for `blocks` blocks of B rows, centres of dim floats. */
static void group_plane_bytes(uint64_t blocks, uint32_t B, uint32_t dim, size_t out[5]) {
    const uint64_t G = B / 32u;
    out[0] = sizeof(uint32_t) * blocks * B;       /* perm */
    out[1] = sizeof(uint32_t) * blocks;           /* n_groups */
    out[2] = sizeof(uint32_t) * blocks * G;       /* end */
    out[3] = sizeof(float) * blocks * G * dim;    /* centre */
    out[4] = sizeof(float) * blocks * G * 5u;     /* stat */
}

static void group_planes(kvt__recall_layer *r, void **p[5]) {
    p[0] = (void **)&r->g_perm;
    p[1] = (void **)&r->g_n;
    p[2] = (void **)&r->g_end;
    p[3] = (void **)&r->g_centre;
    p[4] = (void **)&r->g_stat;
}

static void groups_free(kvt__recall_layer *r, const kvt__backend *be) {
    void **p[5];
    size_t bytes[5];
    group_planes(r, p);
    group_plane_bytes(r->g_cap, r->g_B, r->g_dim, bytes);
    for (int k = 0; k < 5; k++)
        if (*p[k])
            be->ops->buf_free(be, *p[k], bytes[k]);
    r->g_cap = 0;
}

kvt_status kvt__recall_layer_groups_reserve(kvt__recall_layer *r, const kvt__backend *be,
                                            uint64_t blocks, uint32_t B, uint32_t dim) {
    if (blocks <= r->g_cap && (r->g_cap == 0 || (r->g_B == B && r->g_dim == dim)))
        return KVT_OK;
    if (r->g_cap && (r->g_B != B || r->g_dim != dim))
        return KVT_ERR_INVARIANT;
    uint64_t cap = r->g_cap ? r->g_cap : 1;
    while (cap < blocks)
        cap *= 2;
    size_t old_b[5], new_b[5];
    group_plane_bytes(r->g_cap, B, dim, old_b);
    group_plane_bytes(cap, B, dim, new_b);
    void *fresh[5] = {0};
    void **p[5];
    group_planes(r, p);
    kvt_status s = KVT_OK;
    for (int k = 0; k < 5 && s == KVT_OK; k++)
        s = be->ops->buf_alloc(be, new_b[k], &fresh[k]);
    for (int k = 0; k < 5 && s == KVT_OK; k++)
        if (old_b[k])
            s = be->ops->copy(be, fresh[k], *p[k], old_b[k], NULL);
    if (s != KVT_OK) {
        for (int k = 0; k < 5; k++)
            if (fresh[k])
                be->ops->buf_free(be, fresh[k], new_b[k]);
        return s;
    }
    groups_free(r, be);
    for (int k = 0; k < 5; k++)
        *p[k] = fresh[k];
    r->g_cap = cap;
    r->g_B = B;
    r->g_dim = dim;
    return KVT_OK;
}

static size_t lag_bytes(const kvt__recall_layer *r) {
    return sizeof(float) * (size_t)r->lag_floats;
}

kvt_status kvt__recall_layer_lag_prepare(kvt__recall_layer *r, const kvt__backend *be,
                                         uint32_t q_floats) {
    if (r->lag_q && r->lag_floats != q_floats) {
        be->ops->buf_free(be, r->lag_q, lag_bytes(r));
        r->lag_q = NULL;
        r->lag_floats = 0;
    }
    if (q_floats && !r->lag_q) {
        void *p = NULL;
        kvt_status s = be->ops->buf_alloc(be, sizeof(float) * (size_t)q_floats, &p);
        if (s != KVT_OK)
            return s;
        r->lag_q = p;
        r->lag_floats = q_floats;
    }
    r->lag_has = r->last_lagged = 0;
    r->lag_next = NULL;
    return KVT_OK;
}

const float *kvt__recall_layer_lag_query(kvt__recall_layer *r, const float *q) {
    if (!r->lag_q)
        return q;
    r->lag_next = q;
    r->last_lagged = r->lag_has;
    return r->lag_has ? r->lag_q : q;
}

kvt_status kvt__recall_layer_lag_advance(kvt__recall_layer *r, const kvt__backend *be,
                                         void *stream) {
    if (!r->lag_q || !r->lag_next)
        return KVT_OK;
    kvt_status s = be->ops->copy(be, r->lag_q, r->lag_next, lag_bytes(r), stream);
    r->lag_next = NULL;
    if (s == KVT_OK)
        r->lag_has = 1;
    return s;
}

kvt_status kvt__recall_layer_lag_load(kvt__recall_layer *r, const kvt__backend *be, bool has,
                                      bool last_lagged, const float *q) {
    if (!r->lag_q)
        return has || last_lagged ? KVT_ERR_INVARIANT : KVT_OK;
    kvt_status s = has ? be->ops->write(be, r->lag_q, q, lag_bytes(r), NULL) : KVT_OK;
    if (s == KVT_OK) {
        r->lag_has = has;
        r->last_lagged = last_lagged;
        r->lag_next = NULL;
    }
    return s;
}

void kvt__recall_layer_fini(kvt__recall_layer *r, const kvt__backend *be) {
    groups_free(r, be);
    if (r->lag_q)
        be->ops->buf_free(be, r->lag_q, lag_bytes(r));
    if (r->buf)
        be->ops->buf_free(be, r->buf, r->bytes);
    memset(r, 0, sizeof *r);
}

kvt_status kvt__recall_layer_copy(kvt__recall_layer *dst, const kvt__recall_layer *src,
                                  const kvt__backend *be) {
    if (!dst->buf || !src->buf || dst->bytes != src->bytes)
        return KVT_ERR_INVARIANT;
    kvt_status s = KVT_OK;
    if (src->g_cap)
        s = kvt__recall_layer_groups_reserve(dst, be, src->g_cap, src->g_B, src->g_dim);
    if (s == KVT_OK && src->g_cap) {
        void **pd[5], **ps[5];
        size_t bytes[5];
        group_planes(dst, pd);
        group_planes((kvt__recall_layer *)(uintptr_t)src, ps);
        group_plane_bytes(src->g_cap, src->g_B, src->g_dim, bytes);
        for (int k = 0; k < 5 && s == KVT_OK; k++)
            s = be->ops->copy(be, *pd[k], *ps[k], bytes[k], NULL);
    }
    if (s == KVT_OK)
        s = be->ops->copy(be, dst->buf, src->buf, src->bytes, NULL);
    if (s == KVT_OK && !src->g_cap && dst->g_cap) { /* no groups to take: build them anew */
        uint32_t zero = 0;
        s = be->ops->write(be, &dst->st->n_grouped, &zero, sizeof zero, NULL);
    }
    if (s == KVT_OK && src->lag_q) { /* the child's next step scans with the parent's query */
        if (dst->lag_floats != src->lag_floats)
            return KVT_ERR_INVARIANT;
        if (src->lag_has)
            s = be->ops->copy(be, dst->lag_q, src->lag_q, lag_bytes(src), NULL);
        dst->lag_has = src->lag_has;
        dst->last_lagged = src->last_lagged;
    }
    return s;
}

kvt_status kvt__recall_layer_read(const kvt__recall_layer *r, const kvt__backend *be,
                                  kvt__recall_state *out) {
    if (!r->buf) {
        *out = initial_state();
        return KVT_OK;
    }
    return be->ops->read(be, out, r->st, sizeof *out, NULL);
}

kvt_status kvt__recall_layer_read_samples(const kvt__recall_layer *r, const kvt__backend *be,
                                          float *out, uint32_t n) {
    if (n > r->sample_cap)
        return KVT_ERR_INVARIANT;
    return n ? be->ops->read(be, out, r->samples, sizeof *out * n, NULL) : KVT_OK;
}

kvt_status kvt__recall_layer_load(kvt__recall_layer *r, const kvt__backend *be,
                                  const kvt__recall_state *st, const float *samples) {
    kvt__recall_state copy = *st;
    copy.n_grouped = 0; /* the groups are derived: the next step builds them anew */
    kvt_status s = be->ops->write(be, r->st, &copy, sizeof copy, NULL);
    if (s == KVT_OK && st->n_samples)
        s = be->ops->write(be, r->samples, samples, sizeof *samples * st->n_samples, NULL);
    return s;
}

kvt_status kvt__recall_layer_rebase(kvt__recall_layer *r, const kvt__backend *be,
                                    bool recalibrate) {
    if (!r->buf)
        return KVT_OK;
    kvt__recall_state st;
    kvt_status s = be->ops->read(be, &st, r->st, sizeof st, NULL);
    if (s != KVT_OK)
        return s;
    if (recalibrate) {
        const kvt__recall_state fresh = initial_state();
        st.z = fresh.z;
        st.phase = fresh.phase;
        st.cal_steps = st.n_samples = st.k = st.clamped = 0;
    }
    st.n_grouped = 0; /* the groups are derived from the sketches */
    return be->ops->write(be, r->st, &st, sizeof st, NULL);
}

size_t kvt__recall_promo_bytes_for(uint32_t prom_cap) {
    return prom_cap ? sizeof(kvt__recall_promo) +
                          2u * sizeof(uint32_t) * ((size_t)prom_cap * CAND_PER_PROMOTED + prom_cap)
                    : 0;
}

size_t kvt__recall_promo_bytes(const kvt__recall_layer *r) {
    return r->promo ? kvt__recall_promo_bytes_for(r->prom_cap) : 0;
}

kvt_status kvt__recall_layer_read_promo(const kvt__recall_layer *r, const kvt__backend *be,
                                        void *out) {
    size_t n = kvt__recall_promo_bytes(r);
    return n ? be->ops->read(be, out, r->promo, n, NULL) : KVT_OK;
}

kvt_status kvt__recall_layer_load_promo(kvt__recall_layer *r, const kvt__backend *be,
                                        const void *in) {
    if (!r->promo)
        return KVT_OK;
    if (in)
        return be->ops->write(be, r->promo, in, kvt__recall_promo_bytes(r), NULL);
    kvt__recall_promo pr;
    memset(&pr, 0, sizeof pr);
    return be->ops->write(be, r->promo, &pr, sizeof pr, NULL);
}

/* rows[0 .. n) strictly ascending in [S, n_closed), hist within mask (and nonzero: nz). */
static kvt_status check_rows(const char *what, const uint32_t *rows, const uint32_t *hist,
                             uint32_t n, uint64_t S, uint64_t n_closed, uint32_t mask, bool nz,
                             char *err, size_t len) {
    for (uint32_t i = 0; i < n; i++) {
        if (rows[i] < S || rows[i] >= n_closed || (i && rows[i - 1] >= rows[i]))
            return kvt__fail(err, len, KVT_ERR_INVARIANT,
                             "recall promotion: %s row %u at position %u (archived rows are "
                             "[%llu, %llu), ascending)",
                             what, i, rows[i], (unsigned long long)S,
                             (unsigned long long)n_closed);
        if ((hist[i] & ~mask) || (nz && !hist[i]))
            return kvt__fail(err, len, KVT_ERR_INVARIANT,
                             "recall promotion: %s row %u (position %u) has history 0x%x, window "
                             "mask 0x%x",
                             what, i, rows[i], hist[i], mask);
    }
    return KVT_OK;
}

/* The first element of a[0 .. na) that b[0 .. nb) holds too (both ascending), or UINT32_MAX. */
static uint32_t first_common(const uint32_t *a, uint64_t na, const uint32_t *b, uint64_t nb) {
    for (uint64_t i = 0, j = 0; i < na && j < nb;) {
        if (a[i] == b[j])
            return a[i];
        if (a[i] < b[j])
            i++;
        else
            j++;
    }
    return UINT32_MAX;
}

kvt_status kvt__recall_promo_check(const kvt__recall_layer *r, const void *in, uint64_t n_closed,
                                   uint64_t S, const uint32_t *kept, uint64_t m, uint64_t room,
                                   uint32_t window, char *err, size_t len) {
    if (!r->promo)
        return KVT_OK;
    kvt__recall_promo pr;
    memcpy(&pr, in, sizeof pr);
    const uint32_t *cr = (const uint32_t *)((const uint8_t *)in + sizeof pr);
    const uint32_t *ch = cr + r->cand_cap, *pw = ch + r->cand_cap, *ph = pw + r->prom_cap;
    const uint32_t mask = window >= 32 ? UINT32_MAX : (1u << window) - 1u;
    if (pr.last_promoted > r->prom_cap || pr.n_prom > r->prom_cap || pr.n_cand > r->cand_cap ||
        pr.last_closed > n_closed)
        return kvt__fail(err, len, KVT_ERR_INVARIANT,
                         "recall promotion: %u promoted (room for %u), %u candidates (room for "
                         "%u), last step at %u closed rows of %llu",
                         pr.n_prom, r->prom_cap, pr.n_cand, r->cand_cap, pr.last_closed,
                         (unsigned long long)n_closed);
    if (pr.n_prom > room)
        return kvt__fail(err, len, KVT_ERR_INVARIANT,
                         "recall promotion: %u rows promoted, the close reserved %llu: the budget "
                         "does not hold",
                         pr.n_prom, (unsigned long long)room);
    kvt_status s = check_rows("promoted", pw, ph, pr.n_prom, S, n_closed, mask, false, err, len);
    if (s == KVT_OK)
        s = check_rows("candidate", cr, ch, pr.n_cand, S, n_closed, mask, true, err, len);
    if (s != KVT_OK)
        return s;
    uint32_t c = first_common(pw, pr.n_prom, cr, pr.n_cand);
    if (c != UINT32_MAX)
        return kvt__fail(err, len, KVT_ERR_INVARIANT,
                         "recall promotion: position %u is both promoted and a candidate", c);
    if (pr.last_closed == n_closed && (c = first_common(pw, pr.n_prom, kept, m)) != UINT32_MAX)
        return kvt__fail(err, len, KVT_ERR_INVARIANT,
                         "recall promotion: position %u is both promoted and kept", c);
    return KVT_OK;
}

kvt_status kvt__recall_state_check(const kvt__recall_layer *r, const kvt__recall_state *st,
                                   const float *samples, char *err, size_t len) {
    if (st->n_grouped > r->g_cap || st->reserved0 != 0)
        return kvt__fail(err, len, KVT_ERR_INVARIANT, "recall: %u grouped blocks, room for %llu",
                         st->n_grouped, (unsigned long long)r->g_cap);
    if (st->phase > KVT__CONFORMAL_PROVISIONAL)
        return kvt__fail(err, len, KVT_ERR_INVARIANT, "recall: phase %u", st->phase);
    if (st->n_samples > r->sample_cap)
        return kvt__fail(err, len, KVT_ERR_INVARIANT, "recall: %u samples, room for %u",
                         st->n_samples, r->sample_cap);
    if (st->cal_steps > KVT__CONFORMAL_LAST_WINDOW || st->cal_steps > st->calib_steps)
        return kvt__fail(err, len, KVT_ERR_INVARIANT, "recall: %u calibration steps (%llu dense)",
                         st->cal_steps, (unsigned long long)st->calib_steps);
    if (isnan(st->z) || isinf(st->z) || st->z > KVT__CONFORMAL_Z_MAX)
        return kvt__fail(err, len, KVT_ERR_INVARIANT, "recall: z = %g", (double)st->z);
    if (st->phase == KVT__CONFORMAL_CALIBRATED &&
        (st->k == 0 || st->k > st->n_samples || st->n_samples < KVT__CONFORMAL_MIN_SAMPLES))
        return kvt__fail(err, len, KVT_ERR_INVARIANT, "recall: calibrated from sample %u of %u",
                         st->k, st->n_samples);
    if (st->last_fetched > st->last_archived || st->last_visited > st->last_archived ||
        st->calib_steps + st->overflow_steps > st->steps || st->fetched < st->last_fetched)
        return kvt__fail(err, len, KVT_ERR_INVARIANT,
                         "recall: certificate counts disagree (fetched %llu of %llu archived, "
                         "%llu calibration + %llu overflow of %llu steps)",
                         (unsigned long long)st->last_fetched,
                         (unsigned long long)st->last_archived,
                         (unsigned long long)st->calib_steps,
                         (unsigned long long)st->overflow_steps, (unsigned long long)st->steps);
    for (uint32_t i = 0; samples && i < st->n_samples; i++)
        if (isnan(samples[i]) || (i > 0 && samples[i - 1] > samples[i]))
            return kvt__fail(err, len, KVT_ERR_INVARIANT,
                             "recall: calibration samples not sorted or NaN at %u", i);
    return KVT_OK;
}

/* The scan's archive side, field by field from the policy's view (the rest zero). */
static void scan_of_view(const kvt__nope_view *v, kvt__recall_scan_args *a) {
    memset(a, 0, sizeof *a);
    a->base = v->base;
    a->pages = v->pages;
    a->first_page = v->first_page;
    a->pdiv = v->pdiv;
    a->slot_stride = v->slot_stride;
    a->dtype = v->dtype;
    a->latent_dim = v->latent_dim;
    a->branch_offset = v->branch_offset;
    a->branch_dtype = v->branch_dtype;
    a->branch_dim = v->branch_dim;
    a->csk = v->csk;
    a->rho = v->rho;
    a->csk_head = v->csk_head;
    a->rho_head = v->rho_head;
    a->n_head = v->n_head;
    a->csk_stride = v->csk_stride;
    a->q8_off = v->q8_off;
    a->basis = v->basis;
    a->rank = v->rank;
    a->n_closed = v->n_closed;
    a->sinks = v->sinks;
    a->kept = v->kept;
    a->m = v->m;
}

void kvt__recall_step_make(const kvt__recall_layer *r, const kvt__nope_view *view,
                           const float *q, uint64_t n_rows, kvt_recall_mode mode, float margin,
                           uint8_t *dense, kvt__recall_step_args *out) {
    memset(out, 0, sizeof *out);
    scan_of_view(view, &out->scan);
    out->scan.q = q;
    out->scan.best = r->best;
    out->scan.n_heads = r->n_heads;
    out->scan.scale = 1.0f; /* the engine's queries carry the softmax scale */
    out->scan.mode = (int)mode;
    out->scan.cap = r->cap;
    out->scan.fired = r->fired;
    out->scan.n_fired = r->n_fired;
    out->scan.overflow = r->overflow;
    out->n_rows = n_rows;
    out->mode = (int)mode;
    out->margin = margin;
    out->st = r->st;
    out->samples = r->samples;
    out->sample_cap = r->sample_cap;
    out->dense = dense;
    if (r->g_cap) {
        out->g_perm = r->g_perm;
        out->g_n = r->g_n;
        out->g_end = r->g_end;
        out->g_centre = r->g_centre;
        out->g_stat = r->g_stat;
        out->g_blocks_cap = r->g_cap;
        out->block_rows = r->g_B;
        out->g_dim = r->g_dim;
    }
}

void kvt__recall_step_promote(const kvt__recall_layer *r, uint64_t room, uint32_t hits,
                              uint32_t window, kvt__recall_step_args *out) {
    if (!r->promo)
        return;
    out->promo = r->promo;
    out->cand_cap = r->cand_cap;
    out->prom_cap = r->prom_cap;
    out->prom_room = (uint32_t)(room < r->prom_cap ? room : r->prom_cap);
    out->hits = hits;
    out->window = window;
}

void kvt__recall_pack_query(const kvt__recall_layer *r, kvt__pack_query *pq) {
    pq->fetch = r->fired;
    pq->fetch_cap = r->cap + r->prom_cap;
    pq->n_fetch = r->n_fired;
    pq->dense = &r->st->last_dense;
}

uint64_t kvt__recall_layer_bytes(const kvt__recall_layer *r) {
    size_t g[5];
    group_plane_bytes(r->g_cap, r->g_B, r->g_dim, g);
    return (r->buf ? r->bytes : 0) + g[0] + g[1] + g[2] + g[3] + g[4] + lag_bytes(r);
}

void kvt__recall_plan_bound(uint32_t n_heads, uint32_t rank, uint32_t D, uint32_t branch_dim,
                            uint64_t max_rows, uint32_t prom_cap, uint32_t block_rows,
                            kvt__recall_step_args *out) {
    static kvt__recall_promo on; /* only its address is read: promotion on */
    static uint32_t perm_on;     /* likewise: group planes */
    *out = (kvt__recall_step_args){.promo = prom_cap ? &on : NULL,
                                   .prom_cap = prom_cap,
                                   .cand_cap = prom_cap * CAND_PER_PROMOTED,
                                   .sample_cap = n_heads * KVT__RECALL_SAMPLES_PER_HEAD};
    out->scan.n_heads = n_heads;
    out->scan.rank = rank;
    out->scan.latent_dim = D;
    out->scan.branch_dim = branch_dim;
    out->scan.n_closed = max_rows;
    out->scan.m = (uint32_t)max_rows; /* the kept set holds at most every closed row */
    if (block_rows) {
        out->g_perm = &perm_on;
        out->block_rows = block_rows;
        out->g_dim = branch_dim + rank;
        out->g_blocks_cap = max_rows / block_rows;
    }
}

bool kvt__recall_plan_ok(const kvt__recall_step_args *bound, const kvt__recall_step_args *x) {
    return kvt__recall_step_args_ok(x) && kvt__recall_plan_fits(bound, x);
}

size_t kvt__recall_step_scratch_max(uint32_t n_heads, uint32_t rank, uint32_t D,
                                    uint32_t branch_dim, uint64_t max_rows, uint32_t block_rows,
                                    uint32_t prom_cap) {
    kvt__recall_step_args x;
    kvt__recall_plan_bound(n_heads, rank, D, branch_dim, max_rows, prom_cap, block_rows, &x);
    return kvt__recall_step_scratch_floats(&x);
}
