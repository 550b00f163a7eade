"""Hand-made tokenizers built at run time (`tokenizers`), saved as fast-tokenizer folders, and a
brute-force mapping computed from each id's bytes by a route independent of token_bytes.py."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

TEXT_A = [
    "def add(a, b):\n    return a + b\n",
    "for item in items:\n\tprint(item, 'café', \"naïve\")\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n",
] * 20
TEXT_B = ["the quick brown fox jumps over the lazy dog\n", "return value; print(x)\n"] * 30


def byte_level(texts: list[str], vocab: int, specials: list[str], added: list[str] = ()):
    """A GPT-2 style byte-level BPE, with special and (non-special) added tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    if added:
        tok.add_tokens(list(added))
    return tok


def _bytes_pieces() -> list[str]:
    return [f"<0x{b:02X}>" for b in range(256)]


def llama_style(texts: list[str], vocab: int):
    """SentencePiece-as-BPE the Llama 2 way: `▁` from the normalizer, byte fallback pieces,
    decoder Replace/ByteFallback/Fuse/Strip. Special tokens <unk> <s> </s>."""
    base = Tokenizer(models.BPE(unk_token="<unk>"))
    base.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>", *_bytes_pieces()],
        show_progress=False,
    )  # fmt: skip
    base.train_from_iterator(texts, trainer=trainer)
    import json

    data = json.loads(base.to_str())
    data["model"]["byte_fallback"] = True
    # The byte pieces are ordinary vocabulary entries in SentencePiece, not special tokens.
    data["added_tokens"] = [t for t in data["added_tokens"] if not t["content"].startswith("<0x")]
    data["decoder"] = {
        "type": "Sequence",
        "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0},
        ],
    }
    return Tokenizer.from_str(json.dumps(data))


def unigram_metaspace(pieces: list[str]):
    """A Unigram with a Metaspace pre-tokenizer and decoder, byte fallback; <unk> is id 0."""
    vocab = [("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0)]
    vocab += [(p, -1.0 - i * 0.01) for i, p in enumerate(pieces)]
    vocab += [(p, -20.0) for p in _bytes_pieces()]
    tok = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return tok


def save(tok, folder: Path, **roles: str) -> Path:
    """Save as a `transformers` fast tokenizer folder (tokenizer.json + tokenizer_config.json)."""
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(tokenizer_object=tok, **roles).save_pretrained(folder)
    return folder


# ------------------------------------------------------------------- the brute-force route


def gpt2_unicode_to_byte() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, written out the way its encoder.py builds it, inverted."""
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def id_bytes(tok, kind: str) -> tuple[dict[int, bytes], dict[int, int], dict[int, str]]:
    """({id: bytes} of text tokens, {id: rank}, {id: content} of specials) for every id of a
    `tokenizers.Tokenizer`, from `id_to_token` and hand-written rules per family."""
    inv = gpt2_unicode_to_byte()
    added = tok.get_added_tokens_decoder()
    text, rank, special = {}, {}, {}
    for i in range(tok.get_vocab_size(with_added_tokens=True)):
        s = tok.id_to_token(i)
        if (i in added and added[i].special) or s == "<unk>":
            special[i] = s
            continue
        if i in added:
            text[i], rank[i] = s.encode(), 0
        elif kind == "byte":
            text[i], rank[i] = bytes(inv[c] for c in s), 1
        elif s.startswith("<0x") and s.endswith(">") and len(s) == 6:
            text[i], rank[i] = bytes([int(s[3:5], 16)]), 2
        else:
            text[i], rank[i] = s.replace("▁", " ").encode(), 1
    return text, rank, special


def brute_force(t, t_kind, t_roles, d, d_kind, d_roles) -> tuple[list[int], list[int]]:
    """(target_to_draft, draft_to_target) by Python dicts over every id, the documented rules:
    text by bytes to the other side's (rank, id)-first id; specials by role (eos, bos, unk,
    pad), then by identical spelling."""
    tt, tr, ts = id_bytes(t, t_kind)
    dt, dr, ds = id_bytes(d, d_kind)

    def first(text, rank):
        out = {}
        for i in sorted(text, key=lambda i: (rank[i], i)):
            out.setdefault(text[i], i)
        return out

    tf, df = first(tt, tr), first(dt, dr)
    t2d = [df.get(tt[i], -1) if i in tt else -1 for i in range(t.get_vocab_size())]
    d2t = [tf.get(dt[i], -1) if i in dt else -1 for i in range(d.get_vocab_size())]
    pairs = []
    for role in ("eos_token", "bos_token", "unk_token", "pad_token"):
        if role in t_roles and role in d_roles:
            pairs.append((t.token_to_id(t_roles[role]), d.token_to_id(d_roles[role])))
    pairs += [(i, j) for i, s in sorted(ts.items()) for j, s2 in ds.items() if s == s2]
    for a, b in pairs:
        if a in ts and t2d[a] < 0:
            t2d[a] = b
        if b in ds and d2t[b] < 0:
            d2t[b] = a
    return t2d, d2t
