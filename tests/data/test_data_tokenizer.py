"""Byte tokenizer round trips and local tokenizer loading."""

import warnings

import pytest

from lightning_ffpa.data import ByteTokenizer, TextDataModule, load_tokenizer
from lightning_ffpa.errors import ConfigError


def test_byte_roundtrip_and_specials():
    tok = ByteTokenizer()
    text = "Flower of warriors,\nhow is it? — naïve ☃"
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids) and len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    wrapped = tok.encode(text, add_special_tokens=True)
    assert wrapped[0] == tok.bos_token_id and wrapped[-1] == tok.eos_token_id
    assert tok.decode(wrapped) == text
    assert tok.decode([*wrapped, tok.pad_token_id], skip_special_tokens=False) == f"<bos>{text}<eos><pad>"
    # every id fits the tiny model's vocabulary of 512
    assert len(tok) == 259 and max(tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) < 512
    assert len({tok.pad_token_id, tok.bos_token_id, tok.eos_token_id}) == 3


def test_byte_chat_format():
    tok = ByteTokenizer()
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert tok.apply_chat_template(msgs, tokenize=False) == "user: hi\nassistant: hello\n"
    assert (
        tok.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True)
        == "user: hi\nassistant: "
    )
    assert tok.decode(tok.apply_chat_template(msgs)) == "user: hi\nassistant: hello\n"


def test_load_local_tokenizer(hf_tokenizer_dir):
    tok = load_tokenizer(hf_tokenizer_dir)
    ids = tok.encode("hello world", add_special_tokens=False)
    assert tok.decode(ids) == "hello world"
    assert tok.pad_token_id == 0 and tok.bos_token_id == 2 and tok.eos_token_id == 3
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)


def test_bad_tokenizer_path_names_option(tmp_path, write):
    missing = str(tmp_path / "no_such_tokenizer")
    with pytest.raises(ConfigError, match=r"`data\.init_args\.tokenizer='.*no_such_tokenizer'`: is not a tokenizer folder"):
        load_tokenizer(missing)
    train = write("train.txt", "hello world\n")
    with pytest.raises(ConfigError, match=r"`data\.init_args\.tokenizer=.*no_such_tokenizer"):
        TextDataModule(train_file=train, tokenizer=missing)
    # a directory that is not a tokenizer: one line naming what it lacks (it ended at transformers' "one of:")
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(ConfigError, match=r"`data\.init_args\.tokenizer=.*empty_dir'`: holds no tokenizer files "
                                          r"\(none of tokenizer\.json, tokenizer_config\.json") as info:
        load_tokenizer(str(tmp_path / "empty_dir"))
    assert "\n" not in str(info.value)


def test_hub_id_goes_to_auto_tokenizer(monkeypatch, hf_tokenizer_dir):
    """A name that is not a local folder is a hub id: handed to `AutoTokenizer.from_pretrained` as is."""
    import transformers

    asked = []
    real = transformers.AutoTokenizer.from_pretrained

    def fake(name, *args, **kwargs):
        asked.append(name)
        return real(hf_tokenizer_dir)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", fake)
    tok = load_tokenizer("some-org/some-tokenizer")
    assert asked == ["some-org/some-tokenizer"] and tok.bos_token_id == 2


def test_unreachable_hub_id_is_one_config_error(offline):
    with pytest.raises(ConfigError, match=r"^`data\.init_args\.tokenizer='no-such-org/no-such-tok'`: AutoTokenizer "
                       r"could not load it from the Hugging Face hub \(or its local cache\): ") as info:
        load_tokenizer("no-such-org/no-such-tok")
    assert "\n" not in str(info.value)


def test_a_message_that_introduces_its_lines_keeps_them_on_one_line():
    """transformers' "Couldn't instantiate the backend tokenizer from one of:" ended the user's error line there."""
    from lightning_ffpa.errors import one_line

    err = ValueError("Couldn't instantiate the backend tokenizer from one of: \n(1) a `tokenizers` library "
                     "serialization file, \n(2) a slow tokenizer instance to convert or \n(3) an equivalent slow "
                     "tokenizer class to instantiate and convert. \nYou need to have sentencepiece installed")
    assert one_line(err) == ("Couldn't instantiate the backend tokenizer from one of: (1) a `tokenizers` library "
                             "serialization file, (2) a slow tokenizer instance to convert or (3) an equivalent slow "
                             "tokenizer class to instantiate and convert. You need to have sentencepiece installed")
    assert one_line(ValueError("first line\nsecond")) == "first line"


def test_a_pretrained_folders_own_tokenizer_left_unused_is_warned_about(tmp_path, write):
    """`TextDataModule.tokenizer` defaults to byte: beside a pretrained folder that ships its tokenizer the fit
    trained on byte ids without a word (a fresh trial's finding); the pre-flight says so, naming both options."""
    from types import SimpleNamespace

    from lightning_ffpa.validation import warn_pretrained_tokenizer_unused
    from tests.data.conftest import PLAIN_TEMPLATE, save_tokenizer

    folder = save_tokenizer(tmp_path / "pretrained", PLAIN_TEMPLATE)
    model = SimpleNamespace(hparams={"pretrained": folder})
    data = TextDataModule(train_file=write("t.txt", "hello world\n"), batch_size=1)
    with pytest.warns(UserWarning, match=r"^`model.init_args.pretrained='.*pretrained'` holds a tokenizer, but the data "
                                         r"is encoded by the byte tokenizer \(`data.init_args.tokenizer=byte`"):
        warn_pretrained_tokenizer_unused(model, data)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_pretrained_tokenizer_unused(model, TextDataModule(train_file=data.train_file, tokenizer=folder))


def test_byte_chat_format_keeps_a_messages_other_fields():
    """Without a template, the fields beside `content` (a tool call) follow it as JSON; null ones (a parquet
    column the message lacks) are left out."""
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 2}}}
    msgs = [{"role": "assistant", "tool_calls": [call]}, {"role": "tool", "content": "4", "tool_call_id": "c1",
                                                           "name": None}]
    assert ByteTokenizer().apply_chat_template(msgs, tokenize=False) == (
        'assistant: {"tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2}}}]}\n'
        'tool: 4 {"tool_call_id": "c1"}\n')
