#!/usr/bin/env python3
"""The seam rule (lib/base/seam.h): no object of the library calls the system's allocation or
file functions except the seam files, lib/base/alloc.c (allocation) and lib/base/io.c (files).
A raw malloc or fopen elsewhere would be a call the fault sweeps of tests/test_seams.c can never
fail, so the rule is checked on what the compiler emitted: each object's undefined symbols
(nm -u), which also catches a call hidden in a macro.

usage: check_seams.py [--no-seam] OBJECT...
--no-seam treats the seam files like any other object (the checker's own test: it must fail).
"""
import os
import subprocess
import sys

ALLOC = {
    "malloc", "calloc", "realloc", "reallocarray", "free", "strdup", "strndup", "__strdup",
    "aligned_alloc", "posix_memalign", "memalign", "valloc", "pvalloc", "mmap", "mmap64",
    "munmap", "mremap", "asprintf", "vasprintf", "getline", "getdelim", "open_memstream",
    "realpath", "canonicalize_file_name", "scandir", "glob", "tempnam", "tmpnam",
}
IO = {
    "fopen", "fopen64", "fdopen", "freopen", "fclose", "fread", "fwrite", "fflush", "fseek",
    "fseeko", "ftell", "ftello", "fgets", "fputs", "fgetc", "fputc", "getc", "putc", "ungetc",
    "__fread_chk", "__fgets_chk", "open", "open64", "openat", "openat64", "creat", "creat64",
    "__open_2", "__open64_2", "__openat_2", "__openat64_2", "read", "pread", "pread64",
    "__read_chk", "__pread_chk", "__pread64_chk", "readv", "preadv", "write", "pwrite",
    "pwrite64", "writev", "pwritev", "fsync", "fdatasync", "sync_file_range", "rename",
    "renameat", "renameat2", "unlink", "unlinkat", "remove", "rmdir", "mkdir", "mkstemp",
    "mkstemp64", "mkostemp", "mkostemp64", "mkdtemp", "tmpfile", "tmpfile64", "close",
    "opendir", "fdopendir", "readdir", "readdir64", "closedir", "flock", "lockf", "stat",
    "stat64", "fstat", "fstat64", "lstat", "lstat64", "fstatat", "fstatat64", "__xstat",
    "__fxstat", "__lxstat", "__fxstatat", "__xstat64", "__fxstat64", "statx", "truncate",
    "ftruncate", "json_load_file", "json_loadf", "json_loadfd", "json_dump_file", "json_dumpf",
    "json_dumpfd",
}
SEAMS = {"lib/base/alloc.c": ALLOC, "lib/base/io.c": IO}


def undefined(obj):
    out = subprocess.run(["nm", "-u", obj], check=True, capture_output=True, text=True).stdout
    syms = set()
    for line in out.splitlines():
        name = line.split()[-1] if line.split() else ""
        syms.add(name.split("@")[0])  # versioned names: read@GLIBC_2.2.5
    return syms


def main(argv):
    no_seam = "--no-seam" in argv
    objs = [a for a in argv if a != "--no-seam"]
    if not objs:
        print("check_seams: no objects given")
        return 2
    seen_seams = set()
    bad = []
    for obj in objs:
        src = next((s for s in SEAMS if obj.replace(os.sep, "/").endswith("/" + s + ".o")), None)
        if src:
            seen_seams.add(src)
        allowed = set() if no_seam or not src else SEAMS[src]
        for sym in sorted(undefined(obj) & (ALLOC | IO)):
            if sym not in allowed:
                kind = "allocation" if sym in ALLOC else "file"
                bad.append(f"{obj}: calls {sym} ({kind} function) outside its seam")
    if seen_seams != set(SEAMS):
        print("check_seams: the seam objects are missing from the list:",
              ", ".join(sorted(set(SEAMS) - seen_seams)))
        return 2
    for b in bad:
        print(b)
    print(f"check_seams: {len(objs)} objects, {len(bad)} raw call(s) outside "
          "lib/base/alloc.c and lib/base/io.c")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
