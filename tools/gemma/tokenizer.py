"""Gemma-3 tokenizer rebuilt from the vocabulary a GGUF ships (tokenizer.ggml.*), run by
SentencePiece.

Gemma's tokenizer is a SentencePiece BPE model (byte fallback, no dummy prefix, no whitespace
normalisation, spaces escaped to U+2581). llama.cpp's converter copies its pieces, scores and
piece types into the GGUF (`tokenizer.ggml.model = "llama"`, llama.cpp's name for SentencePiece),
with the piece types numbered as in sentencepiece_model.proto (1 normal, 2 unknown, 3 control,
4 user-defined, 5 unused, 6 byte). This module writes those back into a ModelProto and loads it
with sentencepiece, so encoding and decoding are SentencePiece's own, not a re-implementation.

One adjustment: the GGUF spells the whitespace user-defined pieces with real spaces ("  ",
"   ", ...), as the Hugging Face tokenizer lists them; SentencePiece matches user-defined pieces
after escaping spaces to U+2581, so they are written back with U+2581 (decoding turns U+2581
into a space again). llama.cpp matches them on the raw text, which is the same thing.
"""
from __future__ import annotations

import numpy as np

SPACE = "\u2581"


def _strings(reader, key):
    f = reader.fields[key]
    return [bytes(f.parts[i]).decode("utf-8") for i in f.data]


def _scalars(reader, key):
    f = reader.fields[key]
    return np.array([f.parts[i][0] for i in f.data])


def build_model_proto(reader) -> bytes:
    from sentencepiece import sentencepiece_model_pb2 as pb

    kind = reader.fields["tokenizer.ggml.model"].contents()
    if kind != "llama":
        raise ValueError(f"tokenizer.ggml.model = {kind!r}; only SentencePiece ('llama') is known")
    tokens = _strings(reader, "tokenizer.ggml.tokens")
    scores = _scalars(reader, "tokenizer.ggml.scores").astype(np.float32)
    types = _scalars(reader, "tokenizer.ggml.token_type").astype(np.int32)
    get = lambda k, d: (reader.fields[k].contents() if k in reader.fields else d)  # noqa: E731

    m = pb.ModelProto()
    ts = m.trainer_spec
    ts.model_type = pb.TrainerSpec.BPE
    ts.vocab_size = len(tokens)
    ts.byte_fallback = True
    ts.allow_whitespace_only_pieces = True
    ts.unk_id = int(get("tokenizer.ggml.unknown_token_id", 3))
    ts.bos_id = int(get("tokenizer.ggml.bos_token_id", 2))
    ts.eos_id = int(get("tokenizer.ggml.eos_token_id", 1))
    ts.pad_id = int(get("tokenizer.ggml.padding_token_id", 0))
    ts.unk_piece, ts.bos_piece = tokens[ts.unk_id], tokens[ts.bos_id]
    ts.eos_piece, ts.pad_piece = tokens[ts.eos_id], tokens[ts.pad_id]
    ns = m.normalizer_spec
    ns.name = "identity"
    ns.add_dummy_prefix = bool(get("tokenizer.ggml.add_space_prefix", False))
    ns.remove_extra_whitespaces = False
    ns.escape_whitespaces = True

    for piece, score, t in zip(tokens, scores, types):
        p = m.pieces.add()
        if t == 4:  # user-defined: matched after space escaping
            piece = piece.replace(" ", SPACE)
        p.piece = piece
        p.score = float(score)
        p.type = int(t)
    return m.SerializeToString()


class Tokenizer:
    """SentencePiece processor over a serialized ModelProto (from_gguf builds one)."""

    def __init__(self, proto: bytes, add_bos: bool = True):
        import sentencepiece as spm

        self.proto = proto
        self.sp = spm.SentencePieceProcessor()
        self.sp.LoadFromSerializedProto(proto)
        self.bos_id = self.sp.bos_id()
        self.eos_id = self.sp.eos_id()
        self.add_bos = add_bos

    @classmethod
    def from_gguf(cls, reader) -> "Tokenizer":
        f = reader.fields.get("tokenizer.ggml.add_bos_token")
        return cls(build_model_proto(reader), bool(f.contents()) if f is not None else True)

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    def encode(self, text: str, bos: bool | None = None) -> list[int]:
        ids = self.sp.encode(text)
        if self.add_bos if bos is None else bos:
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids) -> str:
        return self.sp.decode([int(i) for i in ids])

    def piece(self, i: int) -> str:
        return self.sp.id_to_piece(int(i))
