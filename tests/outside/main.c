/* Links the installed shared library through find_package(kvtier) and uses it. */
#include <kvtier.h>

#include <stdio.h>
#include <string.h>

int main(int argc, char **argv) {
    if (argc < 2)
        return 2;
    kvt_model *m = NULL;
    char err[256];
    kvt_status s = kvt_model_from_file(argv[1], KVT_DTYPE_BF16, &m, err, sizeof err);
    if (s != KVT_OK) {
        fprintf(stderr, "outside: %s: %s\n", kvt_status_name(s), err);
        return 1;
    }
    kvt_ctx_params p = kvt_ctx_default_params();
    p.model = m;
    p.n_pages = 8;
    kvt_config cfg = kvt_config_default();
    cfg.block_rows = 64;
    p.config = &cfg;
    kvt_ctx *ctx = NULL;
    s = kvt_ctx_create(&p, &ctx, err, sizeof err);
    if (s != KVT_OK) {
        fprintf(stderr, "outside: %s: %s\n", kvt_status_name(s), err);
        return 1;
    }
    printf("outside: kvtier %s, %llu bytes/token, backend %s, allocator %s\n", kvt_version(0, 0, 0),
           (unsigned long long)kvt_model_kv_bytes_per_token(m), kvt_ctx_backend_name(ctx),
           kvt_ctx_allocator_name(ctx));
    kvt_ctx_destroy(ctx);
    kvt_model_destroy(m);
    return 0;
}
