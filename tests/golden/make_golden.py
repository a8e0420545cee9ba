#!/usr/bin/env python3
"""make_golden.py - an independent writer of kvtier trace files (docs/trace-format.md).

Uses only `struct` and `zlib`: nothing from the C side, so that the C reader and this script are
two readings of the same document. Writes small golden traces and deliberately broken variants
into the directory of this script (or argv[1]). tests/test_trace.c reads every one of them and
also checks that the C writer produces byte-identical files for the same content.

Run: python3 tests/golden/make_golden.py   (deterministic: rerunning rewrites identical bytes)
"""
import os
import struct
import sys
import zlib

MAGIC = b"\x89KVT\r\n\x1a\n"
MAJOR, MINOR = 1, 0
KIND_TRACE = 1
CRITICAL = 1

SEC_END, SEC_META, SEC_TEXT, SEC_LAYER, SEC_ROWS, SEC_QUERIES, SEC_NEEDLES, SEC_TARGETS = range(8)

# kvt_layer_kind / kvt_dtype numbers from lib/kvtier.h
MLA_NOPE, MLA_ROPE, GQA_ROPE = 0, 1, 2
BF16, FP16, FP32 = 0, 1, 2
DTYPE_BYTES = {BF16: 2, FP16: 2, FP32: 4}


def crc(b):
    return zlib.crc32(b) & 0xFFFFFFFF


def file_header(major=MAJOR, minor=MINOR, kind=KIND_TRACE, flags=0, magic=MAGIC):
    h = magic + struct.pack("<HHII", major, minor, kind, flags)
    return h + struct.pack("<I", crc(h))


def section(stype, payload, flags=CRITICAL, length=None, payload_crc=None):
    """One section: 24-byte header, payload, zero padding to a multiple of 8."""
    length = len(payload) if length is None else length
    payload_crc = crc(payload) if payload_crc is None else payload_crc
    h = struct.pack("<IIQI", stype, flags, length, payload_crc)
    h += struct.pack("<I", crc(h))
    return h + payload + b"\0" * (-len(payload) % 8)


def end():
    return section(SEC_END, b"", flags=0)


def pattern(seed, start, n):
    """Test data: byte i of a stream keyed by seed (the C test computes the same function)."""
    out = bytearray(n)
    for k in range(n):
        i = start + k
        x = (seed * 0x9E3779B1 + i * 0x85EBCA77) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x2C1B3C6D) & 0xFFFFFFFF
        x ^= x >> 12
        out[k] = x & 0xFF
    return bytes(out)


def meta(prompt_rows, n_model_layers):
    return section(SEC_META, struct.pack("<QII", prompt_rows, n_model_layers, 0))


def text(s):
    return section(SEC_TEXT, s.encode(), flags=0)


def layer(index, kind, dtype, n_kv_heads, n_planes, head_dim, value_dim, branch_dim, row_bytes,
          branch_offset, branch_dtype, sliding_window, n_q_heads):
    p = struct.pack("<14I", index, kind, dtype, n_kv_heads, n_planes, head_dim, value_dim,
                    branch_dim, row_bytes, branch_offset, branch_dtype, sliding_window, n_q_heads,
                    0)
    return section(SEC_LAYER, p)


def rows_payload(index, plane, first, n, token_bytes, n_tokens_field=None):
    seed = 1000 + index * 10 + plane
    data = pattern(seed, first * token_bytes, n * token_bytes)
    nt = n if n_tokens_field is None else n_tokens_field
    return struct.pack("<IIQQ", index, plane, first, nt) + data


def rows(index, plane, first, n, token_bytes):
    return section(SEC_ROWS, rows_payload(index, plane, first, n, token_bytes))


def queries_payload(index, dtype, n_q_heads, dim, first, positions, n_q_heads_field=None):
    step_bytes = n_q_heads * dim * DTYPE_BYTES[dtype]
    n = len(positions)
    data = pattern(5000 + index, first * step_bytes, n * step_bytes)
    h = n_q_heads if n_q_heads_field is None else n_q_heads_field
    return (struct.pack("<IIIIQQ", index, dtype, h, dim, first, n)
            + struct.pack("<%dQ" % n, *positions) + data)


def queries(index, dtype, n_q_heads, dim, first, positions):
    return section(SEC_QUERIES, queries_payload(index, dtype, n_q_heads, dim, first, positions))


def needles(lst):
    p = struct.pack("<II", len(lst), 0)
    for (lay, first, n) in lst:
        p += struct.pack("<IIQQ", lay, 0, first, n)
    return section(SEC_NEEDLES, p)


def targets(lst):
    total = sum(len(h) for (_, _, h) in lst)
    p = struct.pack("<II", len(lst), total)
    pool = []
    for (step, needle, heads) in lst:
        p += struct.pack("<QIIII", step, needle, len(pool), len(heads), 0)
        pool += heads
    p += struct.pack("<%dI" % len(pool), *pool)
    return section(SEC_TARGETS, p)


# ---------------------------------------------------------------------------------------------
# The golden contents. tests/test_trace.c mirrors these numbers exactly.
# ---------------------------------------------------------------------------------------------
MLA_TEXT = "generator=make_golden.py\ncontent=mla_bf16\nseed=1\n"
GQA_TEXT = "generator=make_golden.py\ncontent=gqa_2plane\n"


def mla_sections():
    """MLA-NoPE bf16 (Kimi Linear-like): layers 3 and 7 of 27, 20 tokens each, prompt 6 rows.
    Layer 3: bf16 queries, 2 heads x 576, steps 0..2 in two chunks. Layer 7: fp32 queries, 1 step.
    Rows of layer 3 in chunks 12 + 8, of layer 7 in one chunk of 20."""
    tb = 1152
    s = [meta(6, 27), text(MLA_TEXT)]
    s.append(layer(3, MLA_NOPE, BF16, 1, 1, 576, 512, 64, 1152, 1024, BF16, 0, 2))
    s.append(layer(7, MLA_NOPE, BF16, 1, 1, 576, 512, 64, 1152, 1024, BF16, 0, 2))
    s.append(rows(3, 0, 0, 12, tb))
    s.append(rows(7, 0, 0, 20, tb))
    s.append(rows(3, 0, 12, 8, tb))
    s.append(queries(3, BF16, 2, 576, 0, [16, 18]))
    s.append(queries(3, BF16, 2, 576, 2, [20]))
    s.append(queries(7, FP32, 2, 576, 0, [20]))
    s.append(needles([(3, 9, 2), (7, 14, 1)]))
    s.append(targets([(1, 0, [0, 1]), (0, 1, [1])]))
    return s


def gqa_sections():
    """GQA-RoPE fp16: layers 0 and 1 of 2, 2 KV heads x head_dim 8 (16-byte rows, 32 B per token
    per plane), 10 tokens, K and V interleaved in chunks of 4 + 6 as a live engine would dump them.
    fp32 queries on layer 0: 4 query heads x 8, steps at positions 8 and 10."""
    tb = 2 * 16
    s = [meta(4, 2), text(GQA_TEXT)]
    s.append(layer(0, GQA_ROPE, FP16, 2, 2, 8, 8, 0, 16, 0, BF16, 0, 4))
    s.append(layer(1, GQA_ROPE, FP16, 2, 2, 8, 8, 0, 16, 0, BF16, 0, 4))
    for first, n in ((0, 4), (4, 6)):
        for lay in (0, 1):
            for plane in (0, 1):
                s.append(rows(lay, plane, first, n, tb))
    s.append(queries(0, FP32, 4, 8, 0, [8, 10]))
    s.append(needles([(0, 5, 1)]))
    s.append(targets([(1, 0, [0, 3])]))
    return s


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
    files = {}

    mla = mla_sections()
    files["mla_bf16.kvtt"] = file_header() + b"".join(mla) + end()
    gqa = gqa_sections()
    gqa_bytes = file_header() + b"".join(gqa) + end()
    files["gqa_2plane.kvtt"] = gqa_bytes

    # Unknown, non-critical sections (a future writer's additions) must be skipped: one in the
    # middle with an odd length (7 bytes + 1 padding byte), one just before the end marker.
    unk = list(gqa)
    unk.insert(3, section(0x80000001, b"future!", flags=0))
    unk.append(section(0x200, struct.pack("<QQ", 1, 2), flags=0))
    files["unknown_section.kvtt"] = file_header(minor=7) + b"".join(unk) + end()

    # ---- broken variants: (name, bytes); expected status/message live in tests/test_trace.c ----
    g = gqa_bytes
    hdr_len = 24
    meta_len = len(gqa[0])
    b = {}
    b["bad_magic"] = b"\x89KVX" + g[4:]
    b["major2"] = file_header(major=2) + g[hdr_len:]
    b["kind_snapshot"] = file_header(kind=2) + g[hdr_len:]
    b["header_crc"] = g[:10] + b"\x01" + g[11:]          # minor byte changed, CRC not updated
    b["trunc_header"] = g[:10]
    b["trunc_section_header"] = g[:hdr_len + 10]
    b["trunc_meta_payload"] = g[:hdr_len + 24 + 5]
    b["trunc_rows"] = g[:hdr_len + sum(len(x) for x in gqa[:4]) + 24 + 40]
    b["trunc_no_end"] = g[:-24]
    b["empty"] = b""
    b["trailing_bytes"] = g + b"\0" * 8
    # META payload changed after its CRC was computed: a CRC mismatch found at open.
    m = bytearray(g)
    m[hdr_len + 24] ^= 0x01
    b["crc_meta"] = bytes(m)
    # One byte of row data flipped: open succeeds (row CRCs are checked when read in full or by
    # kvt_trace_verify), verify and full reads fail.
    r = bytearray(g)
    r[hdr_len + sum(len(x) for x in gqa[:4]) + 24 + 24 + 7] ^= 0x40
    b["crc_rows"] = bytes(r)
    # Section header with a valid header CRC but a length running past the end of the file.
    b["length_past_eof"] = (g[:hdr_len] +
                            section(SEC_META, struct.pack("<QII", 4, 2, 0), length=1 << 40)[:24] +
                            g[hdr_len + 24:])

    def variant(replace_at, new_section, base=gqa, head=None):
        secs = list(base)
        if replace_at is None:
            secs.append(new_section)
        else:
            secs[replace_at] = new_section
        return (head or file_header()) + b"".join(secs) + end()

    # ROWS whose header says 5 tokens while the payload carries 4 (valid CRCs).
    b["rows_len_mismatch"] = variant(4, section(SEC_ROWS, rows_payload(0, 0, 0, 4, 32, 5)))
    # ROWS claiming 2^40 tokens.
    b["rows_absurd_tokens"] = variant(4, section(SEC_ROWS, rows_payload(0, 0, 0, 4, 32, 1 << 40)))
    # ROWS continuing at the wrong position (gap).
    b["rows_gap"] = variant(4, section(SEC_ROWS, rows_payload(0, 0, 1, 4, 32)))
    # ROWS for a layer never declared.
    b["rows_unknown_layer"] = variant(None, section(SEC_ROWS, rows_payload(9, 0, 0, 1, 32)))
    # LAYER with row_bytes 0.
    b["layer_row_bytes0"] = variant(2, layer(0, GQA_ROPE, FP16, 2, 2, 8, 8, 0, 0, 0, BF16, 0, 4))
    # LAYER with an unknown kind.
    b["layer_bad_kind"] = variant(2, layer(0, 77, FP16, 2, 2, 8, 8, 0, 16, 0, BF16, 0, 4))
    # LAYER index beyond the model's layer count (META says 2).
    b["layer_index_range"] = variant(3, layer(5, GQA_ROPE, FP16, 2, 2, 8, 8, 0, 16, 0, BF16, 0, 4))
    # LAYER declared twice.
    b["layer_duplicate"] = variant(3, layer(0, GQA_ROPE, FP16, 2, 2, 8, 8, 0, 16, 0, BF16, 0, 4))
    # QUERIES with 2^30 heads.
    qi = len(gqa) - 3
    b["queries_absurd_heads"] = variant(
        qi, section(SEC_QUERIES, queries_payload(0, FP32, 4, 8, 0, [8, 10], 1 << 30)))
    # QUERIES whose position lies beyond the layer's rows.
    b["queries_position_range"] = variant(qi, queries(0, FP32, 4, 8, 0, [8, 11]))
    # Needle beyond the rows of its layer.
    b["needle_range"] = variant(qi + 1, needles([(0, 9, 2)]))
    # Target naming a head the layer's queries do not have.
    b["target_head_range"] = variant(qi + 2, targets([(1, 0, [4])]))
    # Unknown section marked critical: must be refused.
    b["critical_unknown"] = variant(None, section(0x80000002, b"12345678", flags=CRITICAL))
    # No META section.
    b["missing_meta"] = file_header() + b"".join(gqa[1:]) + end()
    # META with a reader-visible inconsistency: prompt longer than the rows.
    b["prompt_range"] = variant(0, meta(11, 2))

    for name, data in b.items():
        files["broken_" + name + ".kvtt"] = data

    os.makedirs(out, exist_ok=True)
    for name, data in sorted(files.items()):
        with open(os.path.join(out, name), "wb") as f:
            f.write(data)
    print("wrote %d files to %s" % (len(files), out))


if __name__ == "__main__":
    main()
