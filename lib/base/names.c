/* names.c — pure functions of the public enums (kvtier.h): their names, a dtype's size, the kind ->
 * policy table. In the bottom layer because every layer uses them (tiers/ names a layer's kind
 * in its messages and sizes rows by dtype), and nothing below lib/ may call a function defined in
 * lib/ (DESIGN §3; tests/scripts/check_layers.py checks calls as well as includes). */
#include "base.h"

kvt_policy kvt_policy_for_kind(kvt_layer_kind kind) {
    switch (kind) {
    case KVT_LAYER_MLA_NOPE:
        return KVT_POLICY_SALIENCE;
    case KVT_LAYER_MLA_ROPE:
    case KVT_LAYER_GQA_ROPE:
    case KVT_LAYER_GQA_NOPE:
        return KVT_POLICY_EVICT;
    case KVT_LAYER_SLIDING:
    case KVT_LAYER_NO_KV:
        return KVT_POLICY_NONE;
    }
    return KVT_POLICY_NONE;
}

const char *kvt_layer_kind_name(kvt_layer_kind kind) {
    switch (kind) {
    case KVT_LAYER_MLA_NOPE:
        return "mla-nope";
    case KVT_LAYER_MLA_ROPE:
        return "mla-rope";
    case KVT_LAYER_GQA_ROPE:
        return "gqa-rope";
    case KVT_LAYER_GQA_NOPE:
        return "gqa-nope";
    case KVT_LAYER_SLIDING:
        return "sliding";
    case KVT_LAYER_NO_KV:
        return "no-kv";
    }
    return "unknown";
}

const char *kvt_policy_name(kvt_policy policy) {
    switch (policy) {
    case KVT_POLICY_NONE:
        return "none";
    case KVT_POLICY_SALIENCE:
        return "salience";
    case KVT_POLICY_EVICT:
        return "random-evict";
    }
    return "unknown";
}

const char *kvt_dtype_name(kvt_dtype dtype) {
    switch (dtype) {
    case KVT_DTYPE_BF16:
        return "bf16";
    case KVT_DTYPE_FP16:
        return "fp16";
    case KVT_DTYPE_FP32:
        return "fp32";
    case KVT_DTYPE_FP8_E4M3:
        return "fp8_e4m3";
    }
    return "unknown";
}

uint32_t kvt_dtype_bytes(kvt_dtype dtype) {
    switch (dtype) {
    case KVT_DTYPE_BF16:
    case KVT_DTYPE_FP16:
        return 2;
    case KVT_DTYPE_FP32:
        return 4;
    case KVT_DTYPE_FP8_E4M3:
        return 1;
    }
    return 0;
}
