/* policy.c — which table a policy group gets (policy.h). */
#include "tiers_internal.h"

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

const size_t kvt__tier_state_bytes = sizeof(kvt__tier_state);
const size_t kvt__group_state_bytes = sizeof(kvt__group_state);
