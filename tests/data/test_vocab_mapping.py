"""The vocabulary mapping (data/models/vocab_mapping.py) against brute force on hand-made tokenizers,
its cache, its coverage, and `pair.vocab` (data/models/pair_vocab.py): mapped pairs resolved from
tokenizer files before any weight, refused in one line where they cannot pay or not run yet."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from specdistill.data.models import vocab_mapping as vm
from specdistill.data.models.pairs import resolve_pair
from specdistill.data.models.token_bytes import piece_bytes, token_table
from specdistill.data.runtime import ConfigError
from tests.data import vocab_fixtures as fx

ROLES_A = {"eos_token": "<|endoftext|>", "pad_token": "<|pad|>"}
ROLES_B = {"eos_token": "</s>", "bos_token": "<s>", "pad_token": "<|endoftext|>"}
ROLES_SP = {"eos_token": "</s>", "bos_token": "<s>", "unk_token": "<unk>"}
SP_PIECES = ["▁the", "▁quick", "▁fox", "▁re", "turn", "▁print", "(x)", "▁", "e", "t", "é", "\n"]


@pytest.fixture(scope="module")
def toks():
    """The hand-made tokenizers, each as (tokenizers.Tokenizer, family, roles)."""
    a = fx.byte_level(fx.TEXT_A, 400, ["<|endoftext|>", "<|pad|>"], added=["hello world"])
    b = fx.byte_level(fx.TEXT_A[:2] + fx.TEXT_B, 350, ["<s>", "</s>", "<|endoftext|>"])
    b.add_tokens([" return"])  # an added token spelling a piece's bytes (Ġreturn) again
    llama = fx.llama_style(fx.TEXT_A + fx.TEXT_B, 400)
    uni = fx.unigram_metaspace(SP_PIECES)
    return {
        "a": (a, "byte", ROLES_A),
        "b": (b, "byte", ROLES_B),
        "llama": (llama, "sp", ROLES_SP),
        "uni": (uni, "sp", ROLES_SP),
    }


def _source(toks, name, tmp_path) -> vm.TokenizerSource:
    tok, _, roles = toks[name]
    return vm.read_source(fx.save(tok, tmp_path / name, **roles), name)


@pytest.mark.parametrize(
    "target,drafter",
    [("a", "b"), ("b", "a"), ("llama", "uni"), ("uni", "llama"), ("a", "llama"), ("uni", "b")],
)
def test_mapping_matches_brute_force(toks, target, drafter, tmp_path):
    """Byte-level pair, SentencePiece pair (metaspace + byte fallback), byte-level vs
    metaspace; special and added tokens in each: every id of both arrays as brute force."""
    t, d = _source(toks, target, tmp_path), _source(toks, drafter, tmp_path)
    m = vm.build_mapping(t.table(), d.table())
    (tt, tk, tr), (dt, dk, dr) = toks[target], toks[drafter]
    t2d, d2t = fx.brute_force(tt, tk, tr, dt, dk, dr)
    assert m.target_to_draft.tolist() == t2d
    assert m.draft_to_target.tolist() == d2t
    assert m.intersection_size == sum(x >= 0 for x in d2t) > 0
    # Every mapped pair spells the same bytes, or is a special token on both sides.
    tb, _, ts = fx.id_bytes(tt, tk)
    db, _, ds = fx.id_bytes(dt, dk)
    for i, j in enumerate(m.draft_to_target.tolist()):
        if j >= 0:
            assert (db.get(i) == tb.get(j) is not None) or (i in ds and j in ts)


def test_byte_level_decoding_agrees_with_the_library(toks):
    """Where a token's bytes are valid UTF-8, the library's own decoder (after a one-token
    prefix, so no sequence-start rule applies) gives the same text."""
    for name in ("a", "llama", "uni"):
        tok, kind, _ = toks[name]
        data = json.loads(tok.to_str())
        table = token_table(data, toks[name][2])
        prefix = tok.token_to_id("e") if kind == "sp" else tok.token_to_id("x")
        head = tok.decode([prefix])
        checked = 0
        for i, b in table.text.items():
            try:
                want = b.decode("utf-8")
            except UnicodeDecodeError:
                continue
            assert tok.decode([prefix, i], skip_special_tokens=False) == head + want, (name, i)
            checked += 1
        assert checked > 100 or name == "uni"


def test_special_and_added_tokens(toks, tmp_path):
    """eos maps by role (spelled differently); pad too; a special spelled like a regular token
    never maps; an added token maps by its content; a duplicate maps to the emitted id."""
    a, b = _source(toks, "a", tmp_path), _source(toks, "b", tmp_path)
    m = vm.build_mapping(a.table(), b.table())
    ta, tb = toks["a"][0], toks["b"][0]
    assert m.target_to_draft[ta.token_to_id("<|endoftext|>")] == tb.token_to_id("</s>")
    assert m.draft_to_target[tb.token_to_id("</s>")] == ta.token_to_id("<|endoftext|>")
    # b's pad role is its <|endoftext|>: mapped to a's pad; a's <|endoftext|> keeps its eos role.
    assert m.draft_to_target[tb.token_to_id("<|endoftext|>")] == ta.token_to_id("<|pad|>")
    assert m.draft_to_target[tb.token_to_id("<s>")] == -1  # a has no bos
    # b spells " return" twice (its piece Ġreturn, its added " return"): a's Ġreturn maps to
    # the added id (the one b's tokenizer emits), and both of b's ids map back to a's Ġreturn.
    ret, added, piece = (
        ta.token_to_id("Ġreturn"),
        tb.token_to_id(" return"),
        tb.token_to_id("Ġreturn"),
    )
    assert None not in (ret, added, piece) and added != piece
    assert m.target_to_draft[ret] == added
    assert m.draft_to_target[added] == m.draft_to_target[piece] == ret
    # a's added "hello world" (with a real space) is plain text: b spells it only in pieces.
    assert m.target_to_draft[ta.token_to_id("hello world")] == -1


def test_sentencepiece_bytes_meet_byte_level(toks, tmp_path):
    """`<0x0A>` and byte-level `Ċ` are both a newline; `▁the` and `Ġthe` both ' the'."""
    a, ll = _source(toks, "a", tmp_path), _source(toks, "llama", tmp_path)
    m = vm.build_mapping(ll.table(), a.table())
    tl, ta = toks["llama"][0], toks["a"][0]
    assert m.target_to_draft[tl.token_to_id("<0x0A>")] == ta.token_to_id("Ċ")
    if tl.token_to_id("▁return") is not None and ta.token_to_id("Ġreturn") is not None:
        assert m.target_to_draft[tl.token_to_id("▁return")] == ta.token_to_id("Ġreturn")
    assert m.target_to_draft[tl.token_to_id("<0xC3>")] == ta.token_to_id("Ã")  # half of é
    assert m.draft_to_target[ta.token_to_id("Ġ")] == tl.token_to_id("▁")  # not <0x20>


def test_decoder_steps():
    assert piece_bytes("Ġhi", [{"type": "ByteLevel"}]) == b" hi"
    assert piece_bytes("<0xE2>", [{"type": "ByteFallback"}]) == b"\xe2"
    assert piece_bytes("a▁b", [{"type": "Metaspace", "replacement": "▁"}]) == b"a b"
    assert piece_bytes("ab</w>", [{"type": "BPEDecoder", "suffix": "</w>"}]) == b"ab "
    with pytest.raises(ValueError, match="WordPiece"):
        piece_bytes("##ab", [{"type": "WordPiece"}])


def test_steps_inferred_without_a_decoder(toks):
    """A tokenizer.json saved without a decoder: byte-level read from the pre-tokenizer, `▁`
    from the normalizer's Replace (Llama 2 style); the same bytes as with its decoder, except
    byte pieces, which only a ByteFallback decoder turns into bytes."""
    for name in ("a", "llama"):
        data = json.loads(toks[name][0].to_str())
        full = token_table(data, toks[name][2]).text
        bare = token_table(data | {"decoder": None}, toks[name][2]).text
        differ = {i for i in full if full[i] != bare[i]}
        assert all(bare[i].startswith(b"<0x") for i in differ), name
        assert len(differ) == (0 if name == "a" else 256)


def test_matches_vllms_rule_on_byte_level_text_tokens(toks, tmp_path):
    """vLLM's VocabMapping rule (get_vocab strings, a leading `Ġ` read as a space, the first id
    per string) gives the same pairs on regular tokens of two byte-level tokenizers."""
    a, b = _source(toks, "a", tmp_path), _source(toks, "b", tmp_path)
    m = vm.build_mapping(a.table(), b.table())
    ta, tb = toks["a"][0], toks["b"][0]

    def norm(tok):
        out = {}
        added = tok.get_added_tokens_decoder()
        for s, i in sorted(tok.get_vocab(with_added_tokens=False).items(), key=lambda x: x[1]):
            if i not in added:
                out.setdefault(" " + s[1:] if s.startswith("Ġ") else s, i)
        return out

    na, nb = norm(ta), norm(tb)
    vllm = {(na[s], nb[s]) for s in set(na) & set(nb)}
    ours = {(int(m.draft_to_target[j]), j) for j in nb.values() if m.draft_to_target[j] >= 0}
    assert vllm == {(i, j) for i, j in ours if i in na.values()} and len(vllm) > 200


# ----------------------------------------------------------------------- cache and coverage


def test_cache_reads_then_invalidates(toks, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDISTILL_HOME", str(tmp_path / "home"))
    t, d = _source(toks, "a", tmp_path), _source(toks, "b", tmp_path)
    first = vm.vocab_mapping(t, d)
    root = tmp_path / "home" / "vocab_maps" / first.key
    assert (
        json.loads((root / "mapping.json").read_text())["intersection"] == first.intersection_size
    )

    def boom(*_):
        raise AssertionError("rebuilt instead of read from the cache")

    monkeypatch.setattr(vm, "build_mapping", boom)
    again = vm.vocab_mapping(t, d)
    assert torch.equal(again.draft_to_target, first.draft_to_target) and again.key == first.key
    # The drafter's tokenizer gains a token: another key, and it is built again.
    tok = toks["b"][0]
    changed = fx.byte_level(fx.TEXT_A[:2] + fx.TEXT_B, 351, ["<s>", "</s>", "<|endoftext|>"])
    assert changed.get_vocab_size() != tok.get_vocab_size()
    d2 = vm.read_source(fx.save(changed, tmp_path / "b2", **ROLES_B), "b2")
    with pytest.raises(AssertionError, match="rebuilt"):
        vm.vocab_mapping(t, d2)
    monkeypatch.undo()
    assert vm.vocab_mapping(t, d2).key != first.key


def test_coverage_by_hand(tmp_path, monkeypatch):
    m = vm.VocabMapping(torch.tensor([-1, 0, -1, 2, -1]), torch.tensor([1, -1, 3]))
    cov = vm.coverage_of(m, [[1, 2, 3], [3, 4, 4, 4]], str)
    assert (cov.tokens, cov.covered) == (7, 3) and cov.share == pytest.approx(3 / 7)
    assert cov.unmapped_top == [(4, "4", 3), (2, "2", 1)]
    assert vm.coverage_of(m, [], str).share == 0.0


def test_coverage_on_prompts(toks, tmp_path, monkeypatch):
    """Counted by hand: the byte-level target spells the prompts t h e Ġ fo x | print ( x ) Ċ;
    the Unigram drafter has every single byte (byte pieces, `\n`) but neither `fo` nor `print`
    (only `▁print`, which is " print"): 9 of 11."""
    monkeypatch.setenv("SPECDISTILL_HOME", str(tmp_path / "home"))
    t, d = _source(toks, "a", tmp_path), _source(toks, "uni", tmp_path)
    m = vm.vocab_mapping(t, d)
    texts = ["the fox", "print(x)\n"]
    ta = toks["a"][0]
    spelled = [ta.id_to_token(i) for s in texts for i in ta.encode(s).ids]
    assert spelled == ["t", "h", "e", "Ġ", "fo", "x", "print", "(", "x", ")", "Ċ"]
    cov = vm.coverage(m, t, texts)
    assert (cov.tokens, cov.covered) == (11, 9)
    assert {tok for _, tok, _ in cov.unmapped_top} == {"fo", "print"}
    assert next(iter(tmp_path.glob("home/vocab_maps/*/coverage-*.json")))
    monkeypatch.setattr(vm.TokenizerSource, "backend", lambda self: 1 / 0)  # read, not counted
    assert vm.coverage(m, t, texts) == cov


# ------------------------------------------------------------------------------ pair.vocab


def _drafter_with(tok, toy_tiny, folder: Path, **roles: str) -> Path:
    """The toy-tiny drafter's weights beside another tokenizer (nothing here loads them)."""
    folder.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copy(toy_tiny.drafter_dir / name, folder / name)
    return fx.save(tok, folder, **roles)


@pytest.fixture
def no_weights(monkeypatch):
    """Any weight read fails the test: the checks must come from tokenizer files alone."""
    import safetensors.torch
    import transformers

    def refuse(*_a, **_k):
        raise AssertionError("a weight was read")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    monkeypatch.setattr(safetensors.torch, "load_file", refuse)


def _pair(drafter: Path, **extra):
    return {"toy": "toy-tiny", "drafter": str(drafter), "coverage_prompts": "toy-tiny:test"} | extra


@pytest.mark.usefixtures("no_weights")
def test_mapped_pair_is_resolved_from_tokenizer_files(toy_tiny, tmp_path):
    """Another byte-level tokenizer: auto resolves to mapped (a stage that runs mapped pairs
    gets the mode and the drafter's tokenizer); a stage that cannot is refused in one line."""
    tok = fx.byte_level(fx.TEXT_A * 3, 600, ["<|endoftext|>", "<|pad|>"])
    d = _drafter_with(tok, toy_tiny, tmp_path / "d", **ROLES_A)
    spec = resolve_pair(_pair(d, min_vocab_coverage=0.0), mapped_ok=True)
    assert (spec.vocab, spec.drafter_tokenizer) == ("mapped", str(d))
    with pytest.raises(ConfigError, match="not supported by the validate stage yet") as e:
        resolve_pair(_pair(d, min_vocab_coverage=0.0), stage="validate")
    assert "coverage" in str(e.value) and "\n" not in str(e.value)
    # shared keeps today's line; the same tokenizer under auto stays shared.
    with pytest.raises(ConfigError, match="uses a different tokenizer than pair.target"):
        resolve_pair(_pair(d, vocab="shared"))
    assert resolve_pair({"toy": "toy-tiny"}).vocab == "shared"
    # mapped on the same tokenizer is honoured (an identity mapping), not silently shared.
    assert resolve_pair({"toy": "toy-tiny", "vocab": "mapped"}, mapped_ok=True).vocab == "mapped"


@pytest.mark.usefixtures("no_weights")
def test_low_coverage_and_no_overlap_are_one_line(toy_tiny, tmp_path):
    tok = fx.byte_level(fx.TEXT_B, 300, ["<|endoftext|>", "<|pad|>"])
    low = _drafter_with(tok, toy_tiny, tmp_path / "low", **ROLES_A)
    with pytest.raises(ConfigError, match=r"cover \d+\.\d% .* below pair.min_vocab_coverage=0.99"):
        resolve_pair(_pair(low, min_vocab_coverage=0.99), mapped_ok=True)
    none = _drafter_with(fx.unigram_metaspace(["ꙮ", "▁ꙮꙮ"]), toy_tiny, tmp_path / "none",
                         unk_token="<unk>")  # fmt: skip
    # No byte pieces either (they would share bytes with any byte-level target).
    data = json.loads((none / "tokenizer.json").read_text())
    data["model"]["vocab"] = [v for v in data["model"]["vocab"] if not v[0].startswith("<0x")]
    (none / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="shares no token with pair.target's tokenizer"):
        resolve_pair(_pair(none, vocab="mapped"), mapped_ok=True)


@pytest.mark.parametrize(
    "extra,field",
    [
        ({"vocab": "maybe"}, "pair.vocab='maybe'"),
        ({"min_vocab_coverage": 1.5}, "pair.min_vocab_coverage=1.5"),
        ({"min_vocab_coverage": "lots"}, "pair.min_vocab_coverage='lots'"),
        ({"vocab": "mapped", "coverage_prompts": "/nonexistent.jsonl"}, "pair.coverage_prompts="),
    ],
)
def test_pair_vocab_settings_name_the_field(toy_tiny, extra, field):
    with pytest.raises(ConfigError) as e:
        resolve_pair({"toy": "toy-tiny"} | extra)
    assert str(e.value).startswith(field), str(e.value)


def test_mapped_bare_drafter_is_refused(toy_tiny, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(toy_tiny.drafter_dir / name, bare / name)
    with pytest.raises(ConfigError, match="pair.vocab=mapped: pair.drafter=.* has no tokenizer"):
        resolve_pair({"toy": "toy-tiny", "drafter": str(bare), "vocab": "mapped"})


@pytest.mark.slow
def test_smollm2_and_the_toy_drafter(tmp_path, monkeypatch):
    """The real cross-tokenizer pair (SmolLM2's tokenizer read from its GGUF file, the toy
    tokenizer trained alone): figures of data/RESULTS.md, "Vocabulary mapping coverage"."""
    try:
        from specdistill.data.models.gguf import packaged_gguf

        packaged_gguf("smollm2")
    except ConfigError as e:
        pytest.skip(str(e))
    t = vm.load_source("smollm2", field="--target")
    d = vm.load_source("toy", field="--drafter")
    m = vm.vocab_mapping(t, d)
    assert (m.target_vocab, m.draft_vocab, m.intersection_size, m.target_mapped) == (
        49152, 4096, 3375, 3375,
    )  # fmt: skip
    tt, dt = t.table(), d.table()
    regular = [(int(m.draft_to_target[i]), i) for i in dt.text if m.draft_to_target[i] >= 0]
    assert len(regular) == 3373  # vLLM's 3374 also pairs <|endoftext|> by its spelling
    assert all(tt.text[i] == dt.text[j] for i, j in regular)
    eos = dt.roles["eos_token"]
    assert m.draft_to_target[eos] == tt.roles["eos_token"]  # <|endoftext|> -> <|im_end|>
    cov = vm.coverage(m, t, vm.default_texts())
    assert cov.share == pytest.approx(0.901, abs=0.005)
