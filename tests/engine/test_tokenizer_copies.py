"""An engine built again in the same process copies the tokenizer it loaded before (`load_tokenizer`'s
`_Loaded`) rather than loading it again: each copy a tokenizer of its own, that tokenizes, detokenizes
and applies the chat template as a load does; a file of the directory written since loads it afresh."""

from __future__ import annotations

import json
import shutil
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import transformers
from pagedserve import LLM, SamplingParams
from pagedserve import tokenizer as tokenizer_module
from pagedserve.tokenizer import _rebuilt, load_tokenizer
from tiny_models import copy_tokenizer
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

TEXTS = ["The capital of France is", "  two  spaces, naïve café 世界 🙂", "<|im_start|>user\nhi<|im_end|>"]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


class _Model:
    """What load_tokenizer reads of a ModelConfig."""

    def __init__(self, path: Path) -> None:
        self.path = self.tokenizer_path = str(path)


@pytest.fixture(autouse=True)
def no_tokenizer_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    """None of the tokenizers this process loaded before (another test's of the same files)."""
    monkeypatch.setattr(tokenizer_module, "_loaded", OrderedDict())


@pytest.fixture
def tokenizer_dir(tiny_llama_dir: str, tmp_path: Path) -> Path:
    folder = tmp_path / "tokenizer"
    folder.mkdir()
    copy_tokenizer(tiny_llama_dir, folder)
    return folder


def loads_counted(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths transformers loads a tokenizer from from now on (its own loader still runs)."""
    loads: list[str] = []
    load = transformers.AutoTokenizer.from_pretrained

    def counted(path: str, *args: object, **kwargs: object) -> object:
        loads.append(path)
        return load(path, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", counted)
    return loads


def test_a_second_load_is_a_copy_of_its_own_that_tokenizes_as_the_first(
    tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    loads = loads_counted(monkeypatch)
    first = load_tokenizer(_Model(tokenizer_dir))
    first.chat_template = "{{ messages[0]['content'] }}"  # what an engine's --chat-template does
    second = load_tokenizer(_Model(tokenizer_dir))
    assert loads == [str(tokenizer_dir)]  # loaded once
    assert second is not first and second._tokenizer is not first._tokenizer  # not shared between threads
    assert type(second) is type(first)
    for text in TEXTS:
        ids = first.encode(text)
        assert second.encode(text) == ids
        assert second.decode(ids) == first.decode(ids)
        assert second.decode(ids, skip_special_tokens=True) == first.decode(ids, skip_special_tokens=True)
    assert second.convert_ids_to_tokens(list(range(10))) == first.convert_ids_to_tokens(list(range(10)))
    assert (second.eos_token_id, second.all_special_ids) == (first.eos_token_id, first.all_special_ids)
    # the chat template one engine set stays its own: the copy has the directory's
    assert second.apply_chat_template(QUESTION, tokenize=False).startswith("<|im_start|>")
    assert first.apply_chat_template(QUESTION, tokenize=False) == QUESTION[0]["content"]
    # and what is set on a copy reaches no later copy
    second.chat_template = "{{ 'set on a copy' }}"
    second.add_special_tokens({"additional_special_tokens": ["<extra_token_of_one_copy>"]})
    third = load_tokenizer(_Model(tokenizer_dir))
    assert third.apply_chat_template(QUESTION, tokenize=False).startswith("<|im_start|>")
    assert "<extra_token_of_one_copy>" not in third.get_vocab()
    assert "<extra_token_of_one_copy>" not in third.all_special_tokens
    assert len(third) == len(first)


def test_another_directory_holding_the_same_tokenizer_gets_a_copy_naming_it(
    tiny_llama_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Directories holding the same tokenizer share one load (a fine-tune's checkpoints, models of one
    family built for tests): their weights are not the tokenizer's, nor is config.json but for what
    AutoTokenizer reads of it (the model type, which can pick the tokenizer's class). Each copy is
    named by its own directory, as a load from it is."""
    loads = loads_counted(monkeypatch)

    def model(name: str, **config: object) -> Path:
        folder = tmp_path / name
        shutil.copytree(tiny_llama_dir, folder)
        original = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**original, **config}))
        return folder

    first = model("first")
    wider = model("wider", hidden_size=128, intermediate_size=256)
    (wider / "model.safetensors").write_bytes(b"another checkpoint's weights")
    (wider / ".cache").mkdir()  # (a hidden folder: a hub download's locks, a clone's .git)
    (wider / ".cache" / "download.lock").write_text("its own")
    qwen = model("qwen", model_type="qwen2")
    shorter = model("shorter")
    config = json.loads((shorter / "tokenizer_config.json").read_text())
    (shorter / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 64}))

    tokenizers = [load_tokenizer(_Model(folder)) for folder in (first, wider, qwen, shorter)]
    assert loads == [str(first), str(qwen), str(shorter)]  # wider's is a copy of first's
    assert tokenizers[1].name_or_path == tokenizers[1].init_kwargs["name_or_path"] == str(wider)
    assert [tokenizers[1].encode(text) for text in TEXTS] == [tokenizers[0].encode(text) for text in TEXTS]
    assert tokenizers[3].model_max_length == 64 != tokenizers[0].model_max_length
    shutil.copy(first / "tokenizer_config.json", shorter / "tokenizer_config.json")
    assert load_tokenizer(_Model(shorter)).model_max_length == tokenizers[0].model_max_length
    assert len(loads) == 3  # the same files as first's again: a copy
    # a relative name is a load of its own (transformers matches some hub ids by the name)
    monkeypatch.chdir(tmp_path)
    assert load_tokenizer(_Model(Path("wider"))).name_or_path == "wider"
    assert loads[-1] == "wider"


def test_a_tokenizer_naming_its_directory_elsewhere_is_loaded_for_another(
    tokenizer_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tokenizer that keeps its directory beside its name (a vocabulary file's path, as a slow one
    keeps it) would name the first directory in a copy for another: loaded again there."""
    loads: list[str] = []
    load = transformers.AutoTokenizer.from_pretrained

    def keeping_its_vocab_file(path: str, *args: object, **kwargs: object) -> Any:
        loads.append(path)
        tokenizer = load(path, *args, **kwargs)
        tokenizer.init_kwargs["vocab_file"] = f"{path}/tokenizer.json"
        return tokenizer

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", keeping_its_vocab_file)
    twin = tmp_path / "twin"
    shutil.copytree(tokenizer_dir, twin)
    load_tokenizer(_Model(tokenizer_dir))
    again = load_tokenizer(_Model(tokenizer_dir))
    there = load_tokenizer(_Model(twin))
    assert loads == [str(tokenizer_dir), str(twin)]
    assert again.init_kwargs["vocab_file"] == f"{tokenizer_dir}/tokenizer.json"
    assert there.init_kwargs["vocab_file"] == f"{twin}/tokenizer.json"


def test_a_copy_is_rebuilt_around_the_loaded_model_not_parsed_again(
    tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = load_tokenizer(_Model(tokenizer_dir))

    def parse(*args: object) -> None:
        raise AssertionError("a copy parsed the Rust tokenizer's JSON again")

    monkeypatch.setattr(Tokenizer, "from_str", parse)
    second = load_tokenizer(_Model(tokenizer_dir))
    assert second._tokenizer.to_str() == first._tokenizer.to_str()
    assert [second.encode(text) for text in TEXTS] == [first.encode(text) for text in TEXTS]


def test_a_tokenizer_not_rebuilt_as_it_is_is_copied_through_its_json(
    tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def without_its_decoder(rust: Tokenizer) -> Tokenizer:
        own = _rebuilt(rust)
        own.decoder = decoders.Fuse()
        return own

    monkeypatch.setattr(tokenizer_module, "_rebuilt", without_its_decoder)
    first = load_tokenizer(_Model(tokenizer_dir))
    second = load_tokenizer(_Model(tokenizer_dir))
    assert second._tokenizer.to_str() == first._tokenizer.to_str()
    ids = first.encode(TEXTS[1])
    assert second.decode(ids) == first.decode(ids) == TEXTS[1]


def _wordpiece() -> Tokenizer:
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "hello", "world", "##s", "new", "##word"]
    rust = Tokenizer(models.WordPiece({word: i for i, word in enumerate(words)}, unk_token="[UNK]"))
    rust.normalizer = normalizers.BertNormalizer(lowercase=True)
    rust.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    rust.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", 2), ("[SEP]", 3)],
    )
    rust.decoder = decoders.WordPiece()
    rust.add_special_tokens(["[PAD]", "[UNK]", "[CLS]", "[SEP]"])
    rust.add_tokens(
        [AddedToken("newword", single_word=True, lstrip=True), AddedToken("<Raw>", normalized=False)]
    )
    rust.enable_truncation(12, stride=1, strategy="only_first", direction="left")
    rust.enable_padding(direction="left", pad_id=0, pad_token="[PAD]", length=14)
    return rust


def _unigram() -> Tokenizer:
    pieces = [("<unk>", 0.0), ("▁a", -1.0), ("b", -2.0), ("▁hello", -1.5)]
    rust = Tokenizer(models.Unigram(pieces, unk_id=0, byte_fallback=False))
    rust.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Replace(" ", "▁")])
    rust.pre_tokenizer = pre_tokenizers.Metaspace()
    rust.decoder = decoders.Metaspace()
    rust.add_special_tokens([AddedToken("</s>", special=True), "<pad>"])
    rust.encode_special_tokens = True
    return rust


def _byte_fallback_bpe() -> Tokenizer:
    vocab = {"<unk>": 0, "▁": 1, "a": 2, "b": 3, "ab": 4, "▁ab": 5, "<0x41>": 6, "<0xC3>": 7, "<0xA9>": 8}
    rust = Tokenizer(models.BPE(vocab, [("a", "b"), ("▁", "ab")], byte_fallback=True, unk_token="<unk>"))
    rust.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    rust.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    rust.add_special_tokens(["<unk>"])
    rust.add_tokens(["zzz"])
    return rust


@pytest.mark.parametrize(
    ("make", "texts"),
    [
        (_wordpiece, ["Hello worlds newword <Raw>", "hello   NEWWORD"]),
        (_unigram, ["hello ab</s>", "a b <pad> hello"]),
        (_byte_fallback_bpe, ["ab ab zzz", "é ab"]),
    ],
    ids=["wordpiece-truncation-padding", "unigram-metaspace", "bpe-byte-fallback"],
)
def test_a_rebuilt_tokenizer_is_the_loaded_one_and_its_own(make: Any, texts: list[str]) -> None:
    """Each kind of model, normalizer, pre-tokenizer, post-processor and decoder, added tokens of every
    kind, truncation and padding: a rebuilt tokenizer serializes as the one it copies, and tokenizes
    and detokenizes as it does; what is changed on one copy reaches neither the loaded one nor the
    next copy."""
    loaded = make()
    json = loaded.to_str()
    copy = _rebuilt(loaded)
    assert copy.to_str() == json
    for text in texts:
        assert copy.encode(text).tokens == loaded.encode(text).tokens
        ids = loaded.encode(text).ids
        assert copy.decode(ids) == loaded.decode(ids)
        assert copy.decode(ids, skip_special_tokens=False) == loaded.decode(ids, skip_special_tokens=False)
    copy.add_special_tokens(["<of-one-copy>"])
    copy.no_truncation()
    copy.no_padding()
    # the parts changed where they are, as much as each kind allows
    if isinstance(copy.normalizer, normalizers.BertNormalizer):
        copy.normalizer.lowercase = False
    if isinstance(copy.pre_tokenizer, pre_tokenizers.Metaspace):
        copy.pre_tokenizer.replacement = "_"
    if isinstance(copy.decoder, decoders.WordPiece):
        copy.decoder.prefix = "@@"
    copy.post_processor = processors.ByteLevel()
    assert copy.to_str() != json
    assert loaded.to_str() == json
    assert _rebuilt(loaded).to_str() == json


@pytest.mark.parametrize("written", ["chat_template.jinja", "tokenizer_config.json"])
def test_a_file_written_since_loads_the_tokenizer_again(
    tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch, written: str
) -> None:
    loads = loads_counted(monkeypatch)
    before = load_tokenizer(_Model(tokenizer_dir))
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}"
    if written == "chat_template.jinja":
        (tokenizer_dir / written).write_text(template)
    else:
        (tokenizer_dir / "chat_template.jinja").unlink()
        config = json.loads((tokenizer_dir / written).read_text())
        (tokenizer_dir / written).write_text(json.dumps({**config, "chat_template": template}))
    after = load_tokenizer(_Model(tokenizer_dir))
    assert loads == [str(tokenizer_dir)] * 2
    assert before.apply_chat_template(QUESTION, tokenize=False).startswith("<|im_start|>")
    assert after.apply_chat_template(QUESTION, tokenize=False) == "[user] What is the capital of France?"


def test_engines_built_one_after_another_each_chat_with_their_own_template(tiny_llama_dir: str) -> None:
    one_token = SamplingParams(temperature=0.0, max_tokens=1)
    engine = {"dtype": "float32", "num_kv_blocks": 64}
    plain = LLM(model=tiny_llama_dir, chat_template="[{{ messages[0]['content'] }}]", **engine)
    own = LLM(model=tiny_llama_dir, **engine)
    assert plain.chat(QUESTION, one_token)[0].prompt == "[What is the capital of France?]"
    prompt = own.chat(QUESTION, one_token)[0].prompt
    assert prompt is not None and prompt.startswith("<|im_start|>")
    assert own.generate(TEXTS[:1], one_token)[0].prompt_token_ids == plain.get_tokenizer().encode(TEXTS[0])
