"""Load libkvtier.so the way a Python engine does (ctypes -> dlopen) and call it.

Usage: ctypes_check.py LIBKVTIER.so CONFIG.json [expect-allocator]
Checks: the library loads (Debian's libjemalloc.so.2 would make it fail with "cannot allocate
memory in static TLS block" if the library depended on it), the census of a real config gives
the expected bytes per token, errors come back as statuses with messages, and a context reports
which host allocator it uses (libc without jemalloc in the process, jemalloc under LD_PRELOAD).
"""
import ctypes
import sys

lib = ctypes.CDLL(sys.argv[1])
config = sys.argv[2].encode()
expect_alloc = sys.argv[3] if len(sys.argv) > 3 else None

lib.kvt_version.restype = ctypes.c_char_p
lib.kvt_version.argtypes = [ctypes.c_void_p] * 3
lib.kvt_strerror.restype = ctypes.c_char_p
lib.kvt_status_name.restype = ctypes.c_char_p
lib.kvt_model_from_file.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.POINTER(ctypes.c_void_p),
                                    ctypes.c_char_p, ctypes.c_size_t]
lib.kvt_model_kv_bytes_per_token.restype = ctypes.c_uint64
lib.kvt_model_kv_bytes_per_token.argtypes = [ctypes.c_void_p]
lib.kvt_model_destroy.argtypes = [ctypes.c_void_p]
lib.kvt_model_n_layers.argtypes = [ctypes.c_void_p]
lib.kvt_model_n_layers.restype = ctypes.c_uint32

print("kvtier", lib.kvt_version(None, None, None).decode())
model = ctypes.c_void_p()
err = ctypes.create_string_buffer(256)
rc = lib.kvt_model_from_file(config, 0, ctypes.byref(model), err, 256)
assert rc == 0, (rc, err.value)
bpt = lib.kvt_model_kv_bytes_per_token(model)
print("layers", lib.kvt_model_n_layers(model), "kv bytes/token", bpt)
assert bpt == 8064, bpt

rc = lib.kvt_model_from_file(b"/nonexistent/config.json", 0, ctypes.byref(ctypes.c_void_p()), err, 256)
assert rc == -8, rc  # KVT_ERR_IO
print("missing file ->", lib.kvt_status_name(rc).decode(), "|", err.value.decode())

# A context through the C helper that fills default params (no struct layout in Python needed).
lib.kvt_ctx_create_default.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                                       ctypes.c_char_p, ctypes.c_size_t]
lib.kvt_ctx_allocator_name.restype = ctypes.c_char_p
lib.kvt_ctx_allocator_name.argtypes = [ctypes.c_void_p]
lib.kvt_ctx_destroy.argtypes = [ctypes.c_void_p]
ctx = ctypes.c_void_p()
rc = lib.kvt_ctx_create_default(model, ctypes.byref(ctx), err, 256)
assert rc == 0, (rc, err.value)
alloc = lib.kvt_ctx_allocator_name(ctx).decode()
print("allocator", alloc)
if expect_alloc:
    assert alloc == expect_alloc, alloc
lib.kvt_ctx_destroy(ctx)
lib.kvt_model_destroy(model)
print("ctypes: ok")
