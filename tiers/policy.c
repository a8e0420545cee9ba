/* policy.c — which table a policy group gets (policy.h). */
#include "policy.h"

const kvt__policy_ops *kvt__policy_ops_for(const kvt__group *gr, const kvt__store *stores) {
    switch (gr->policy) {
    case KVT_POLICY_NONE:
        for (uint32_t k = 0; k < gr->n_layers; k++)
            if (stores[gr->layers[k]].spec.kind == KVT_LAYER_SLIDING)
                return &kvt__policy_sliding;
        return &kvt__policy_none;
    case KVT_POLICY_SALIENCE:
        return &kvt__policy_salience;
    case KVT_POLICY_EVICT:
        return &kvt__policy_evict;
    }
    return NULL;
}

const kvt__policy_ops *kvt__policy_table(kvt_policy policy) {
    switch (policy) {
    case KVT_POLICY_NONE:
        return &kvt__policy_none;
    case KVT_POLICY_SALIENCE:
        return &kvt__policy_salience;
    case KVT_POLICY_EVICT:
        return &kvt__policy_evict;
    }
    return NULL;
}

uint64_t kvt__attended_count(const kvt__tier_layer *l) {
    kvt__attended_desc d;
    l->gr->ops->attended(l, &d);
    return kvt__attended_desc_count(&d);
}

void kvt__attended_rows(const kvt__tier_layer *l, int64_t *out) {
    kvt__attended_desc d;
    l->gr->ops->attended(l, &d);
    uint64_t n = 0;
    for (uint64_t r = 0; r < d.lo_end; r++)
        out[n++] = (int64_t)r;
    for (uint64_t j = 0; j < d.n_list; j++)
        out[n++] = d.list[j];
    for (uint64_t r = d.hi_begin; r < d.hi_end; r++)
        out[n++] = (int64_t)r;
}
