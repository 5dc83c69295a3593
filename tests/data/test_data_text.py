"""TextDataModule: .txt and .jsonl (text and chat) loading, splits, labels, and bad-input errors."""

import json
import logging

import pytest
import torch

from lightning_ffpa.data import IGNORE_INDEX, SHAKESPEARE_PATH, ByteTokenizer, TextDataModule
from lightning_ffpa.errors import ConfigError

TXT = "First speech,\nsecond line.\n\nSecond speech.\n\n\n  \nThird speech here.\n"


def _all_rows(ds):
    return [ds[i] for i in range(len(ds))]


def test_txt_documents_split_at_blank_lines(write):
    dm = TextDataModule(train_file=write("a.txt", TXT), val_fraction=0.0, max_seq_length=64, batch_size=1)
    dm.setup()
    tok = dm.tokenizer
    texts = sorted(tok.decode(r["input_ids"]) for r in _all_rows(dm._train))
    assert texts == sorted(["First speech,\nsecond line.", "Second speech.", "Third speech here."])
    row = dm._train[0]
    assert row["input_ids"][0] == tok.bos_token_id and row["input_ids"][-1] == tok.eos_token_id
    assert torch.equal(row["labels"], row["input_ids"])
    assert dm.val_dataloader() == []


@pytest.mark.parametrize("pack", [False, True])
def test_val_fraction_holds_out_whole_documents(write, pack):
    """A document cut into windows is trained on or validated on, never both (its windows would leak)."""
    letters = "abcdefghijklmnopqrst"
    text = "\n\n".join(c * (40 + 10 * i) for i, c in enumerate(letters))  # 20 documents, each cut into windows
    dm = TextDataModule(train_file=write("a.txt", text), val_fraction=0.25, max_seq_length=16, batch_size=1,
                        pack=pack)
    dm.setup()

    def letters_in(ds):
        return {chr(t) for r in _all_rows(ds) for t in r["input_ids"].tolist() if chr(t) in letters}

    train, val = letters_in(dm._train), letters_in(dm._val)
    assert len(val) == 5 and len(train) == 15 and not train & val
    assert dm.stats["data.init_args.train_file"]["num_split"] == 20


def test_long_documents_split_into_windows(write):
    dm = TextDataModule(train_file=write("a.txt", "x" * 100), val_fraction=0.0, max_seq_length=32, batch_size=1)
    dm.setup()
    lengths = sorted(len(r["input_ids"]) for r in _all_rows(dm._train))
    assert lengths == [6, 32, 32, 32]  # 102 tokens (bos + 100 + eos) in windows of 32
    assert dm.stats["data.init_args.train_file"]["num_split"] == 1


def test_jsonl_text_and_val_file(write):
    train = write("t.jsonl", [{"text": "the cat sat"}, {"text": "on the mat"}])
    val = write("v.jsonl", [{"text": "hello"}])
    dm = TextDataModule(train_file=train, val_file=val, max_seq_length=64, batch_size=2)
    dm.setup()
    assert len(dm._train) == 2 and len(dm._val) == 1
    batch = next(iter(dm.val_dataloader()))
    assert ByteTokenizer().decode(batch["input_ids"][0]) == "hello"


def test_jsonl_messages_mask_non_assistant_tokens(write):
    chat = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "bye"},
        {"role": "assistant", "content": "ciao"},
    ]
    dm = TextDataModule(
        train_file=write("c.jsonl", [{"messages": chat}]), val_fraction=0.0, max_seq_length=128, batch_size=1
    )
    dm.setup()
    row = dm._train[0]
    tok = dm.tokenizer
    assert tok.decode(row["input_ids"]) == "user: hi\nassistant: hello\nuser: bye\nassistant: ciao\n"
    learned = row["labels"][row["labels"] != IGNORE_INDEX]
    # exactly the assistant lines (after the generation prompt's "assistant: ") plus the final eos are learned
    assert tok.decode(learned) == "hello\nciao\n"
    assert learned[-1] == tok.eos_token_id
    assert row["labels"][0] == IGNORE_INDEX


def test_messages_with_hf_chat_template(write, hf_tokenizer_dir):
    chat = [{"role": "user", "content": "how are you"}, {"role": "assistant", "content": "i am fine thanks"}]
    dm = TextDataModule(
        train_file=write("c.jsonl", [{"messages": chat}, {"text": "hello world"}]),
        tokenizer=hf_tokenizer_dir,
        val_fraction=0.0,
        max_seq_length=64,
        batch_size=1,
    )
    dm.setup()
    tok = dm.tokenizer
    rows = {tok.decode(r["input_ids"], skip_special_tokens=True): r for r in _all_rows(dm._train)}
    assert set(rows) == {"hello world", "< user > how are you < end > < assistant > i am fine thanks < end >"}
    chat_row = rows["< user > how are you < end > < assistant > i am fine thanks < end >"]
    assert chat_row["input_ids"][0] == tok.bos_token_id and chat_row["input_ids"][-1] == tok.eos_token_id
    learned = chat_row["labels"][chat_row["labels"] != IGNORE_INDEX]
    assert tok.decode(learned, skip_special_tokens=True) == "i am fine thanks < end >"
    assert dm.vocab_size == len(tok) and dm.pad_id == tok.pad_token_id
    stats = dm.stats["data.init_args.train_file"]
    assert (stats["num_chat_prefix_masked"], stats["num_chat_generation_masked"], stats["num_chat_unmasked"]) == (1, 0, 0)


def test_val_split_is_seeded_and_disjoint(write):
    path = write("a.txt", "\n\n".join(f"document number {i}" for i in range(40)))

    def split(seed):
        dm = TextDataModule(train_file=path, val_fraction=0.25, seed=seed, max_seq_length=64)
        dm.setup()
        dec = dm.tokenizer.decode
        return {dec(r["input_ids"]) for r in _all_rows(dm._train)}, {
            dec(r["input_ids"]) for r in _all_rows(dm._val)
        }

    train, val = split(0)
    assert len(val) == 10 and len(train) == 30 and not train & val
    assert split(0) == (train, val) and split(1)[1] != val


def test_packed_loader_batches(write):
    dm = TextDataModule(train_file=SHAKESPEARE_PATH, max_seq_length=128, batch_size=4, pack=True)
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"input_ids", "labels", "position_ids", "document_ids"}
    assert all(v.shape == (4, 128) and v.dtype == torch.long for v in batch.values())
    assert int(batch["input_ids"].max()) < 512  # fits the tiny model


def test_the_start_up_line_says_how_full_packing_made_the_rows(write, caplog):
    """Documents longer than a row pack little (each one's last window shares a row only with what follows), and
    nothing said so: `pack: true` ran with as many rows as `pack: false`."""
    long_docs = "\n\n".join("x" * 100 for _ in range(4))  # 100 bytes each: windows of 64 and 36 (+ specials)
    with caplog.at_level("INFO"):
        TextDataModule(train_file=write("long.txt", long_docs), val_fraction=0.0, max_seq_length=64, batch_size=1,
                       pack=True).setup("fit")
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("TextDataModule:"))
    assert "8 train / 0 val rows" in line and "8 pieces packed" in line, line
    fill = int(line.split("packed ")[1].split("%")[0])
    assert 70 <= fill < 100, line


def test_unpacked_loader_batches_and_max_len():
    dm = TextDataModule(max_seq_length=96, batch_size=3)  # the shipped Shakespeare sample
    assert dm.max_seq_length == 96
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"input_ids", "labels", "attention_mask"}
    assert batch["input_ids"].shape[0] == 3 and batch["input_ids"].shape[1] <= 96
    assert torch.all(batch["labels"][batch["attention_mask"] == 0] == IGNORE_INDEX)


@pytest.mark.parametrize(
    "kwargs, error, pattern",
    [
        (
            {"train_file": "/nonexistent/train.txt"},
            ConfigError,
            r"`data\.init_args\.train_file='/nonexistent/train\.txt'`: does not exist",
        ),
        ({"val_file": "/nonexistent/val.txt"}, ConfigError, r"`data\.init_args\.val_file="),
        ({"val_fraction": 1.0}, ConfigError, r"`data\.init_args\.val_fraction=1\.0`"),
        ({"max_seq_length": 1}, ConfigError, r"`data\.init_args\.max_seq_length=1`"),
        ({"seed": -1}, ConfigError, r"`data\.init_args\.seed=-1`"),
    ],
)
def test_bad_options_fail_at_construction(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        TextDataModule(**kwargs)


@pytest.mark.parametrize(
    "name, content, pattern",
    [
        ("empty.txt", "", r"`data\.init_args\.train_file=.*empty\.txt'`: holds no documents"),
        ("blank.txt", "\n\n   \n", r"`data\.init_args\.train_file=.*blank\.txt'`: holds no documents"),
        ("empty.jsonl", "\n", r"`data\.init_args\.train_file=.*empty\.jsonl'`: holds no documents"),
        ("bad.jsonl", '{"text": "ok"}\n{"txt": 1}\n', r"`data\.init_args\.train_file=.*bad\.jsonl'`: line 2 needs"),
        ("broken.jsonl", "{not json\n", r"line 1 is not valid JSON"),
        ("msgs.jsonl", '{"messages": [{"role": "user"}]}\n', r"line 1: `messages` must be"),
        ("both.jsonl", '{"text": "ok"}\n{"text": "hi", "messages": [{"role": "user", "content": "hi"}]}\n',
         r"both\.jsonl'`: line 2 has both `text` and `messages`: remove one"),  # it trained on the text, unmasked
        ("null.jsonl", '{"messages": [{"role": "user", "content": null}]}\n', r"line 1: `messages` must be"),
        ("nulls.jsonl", '{"messages": [{"role": "assistant", "content": null, "name": null}]}\n',
         r"line 1: `messages` must be a non-empty list of messages \{role: str, content: str\}, `content` null or "
         r"absent only beside other fields \(tool_calls\)"),
        ("parts.jsonl", '{"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}\n',
         r"line 1: `messages` must be"),
        ("data.csv", "a,b\n", r"must end in one of \.txt, \.jsonl, \.json, \.parquet, \.arrow, not '\.csv'"),
        ("users.jsonl", '{"messages": [{"role": "user", "content": "hi"}]}\n', r"no document with a token"),
        ("empties.jsonl", '{"text": ""}\n{"text": "  "}\n', r"no document with a token to learn from \(2 empty"),
    ],
)
def test_empty_or_malformed_data_names_file(write, name, content, pattern):
    with pytest.raises(ConfigError, match=pattern):  # at construction (path, extension) or in setup
        TextDataModule(train_file=write(name, content), val_fraction=0.0).setup()


def test_split_leaving_no_train_document(write):
    dm = TextDataModule(train_file=write("one.txt", "only one"), val_fraction=0.5)
    with pytest.raises(ConfigError, match=r"`data\.init_args\.val_fraction=0\.5`: leaves no training document"):
        dm.setup()


def test_empty_texts_are_not_trained_on(write, caplog):
    """An empty text would be a row of bos -> eos alone: dropped and counted."""
    dm = TextDataModule(train_file=write("some.jsonl", [{"text": ""}, {"text": "kept text"}, {"text": " "}]),
                        val_fraction=0.0, batch_size=1)
    with caplog.at_level(logging.INFO):
        dm.setup()
    assert "`data.init_args.train_file`: 2 of 3 records are empty texts, not trained on" in caplog.text
    one = TextDataModule(train_file=write("one.jsonl", [{"text": ""}, {"text": "kept text"}]), val_fraction=0.0,
                         batch_size=1)
    with caplog.at_level(logging.INFO):
        one.setup()
    assert "`data.init_args.train_file`: 1 of 2 records is an empty text, not trained on" in caplog.text
    assert len(dm._train) == 1 and dm.stats["data.init_args.train_file"]["num_dropped_empty"] == 2


@pytest.mark.parametrize("name", ["latin1.txt", "latin1.jsonl"])
def test_a_file_that_is_not_utf8_names_the_option_and_the_file(tmp_path, name):
    path = tmp_path / name
    path.write_bytes(b'{"text": "caf\xe9"}\n' if name.endswith(".jsonl") else b"caf\xe9 au lait\n")
    with pytest.raises(ConfigError, match=rf"^`data\.init_args\.train_file='.*{name}'`: is not UTF-8 text .*0xe9"):
        TextDataModule(train_file=str(path), val_fraction=0.0).setup()


@pytest.mark.parametrize("num, said", [(2, "2 chats are longer than {} and were cut"),
                                       (1, "1 chat is longer than {} and was cut")])  # was "1 chats are"
def test_chats_cut_into_windows_are_warned_about(write, num, said):
    """A chat longer than max_seq_length was cut with only a count in the stats: the windows after the first are
    learned without the user turns before them."""
    chat = [{"role": "user", "content": "a question " * 4}, {"role": "assistant", "content": "an answer " * 6}]
    dm = TextDataModule(train_file=write("c.jsonl", [{"messages": chat}] * num), val_fraction=0.0, max_seq_length=32,
                        batch_size=1)
    with pytest.warns(UserWarning, match=rf"`data.init_args.train_file`: "
                                         rf"{said.format('`data.init_args.max_seq_length=32`')} into windows"):
        dm.setup()
    assert dm.stats["data.init_args.train_file"]["num_chat_split"] == num


def test_chats_with_a_tokenizer_without_a_template_are_refused(write, tmp_path):
    """Rendered in a `role: content` format of our own, silently: the roles were `<unk>` to a fresh trial's
    tokenizer, and the exported tokenizer could not reproduce the format at inference (transformers refuses)."""
    from tests.data.conftest import save_tokenizer

    chat = [{"role": "user", "content": "how are you"}, {"role": "assistant", "content": "i am fine thanks"}]
    dm = TextDataModule(train_file=write("c.jsonl", [{"messages": chat}]), tokenizer=save_tokenizer(tmp_path / "bare", None),
                        val_fraction=0.0, max_seq_length=64, batch_size=1)
    with pytest.raises(ConfigError, match=r"^`data.init_args.tokenizer='.*bare'`: has no chat template, and the data "
                                          r"holds chats"):
        dm.setup()


# a template that refuses a system turn, as templates of models without one do (Gemma 2, Mistral)
REFUSES_SYSTEM = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('Conversation roles must alternate') }}"
                  "{% endif %}")


@pytest.mark.parametrize("marked", [False, True], ids=["prefix", "generation_marks"])
def test_a_chat_the_template_refuses_names_the_file_and_line(write, tmp_path, marked):
    """The template's `raise_exception` was a jinja2 traceback (exit 1), with no word of which row it refused."""
    from tests.data.conftest import GENERATION_TEMPLATE, PLAIN_TEMPLATE, save_tokenizer

    tok = save_tokenizer(tmp_path / "tok", REFUSES_SYSTEM + (GENERATION_TEMPLATE if marked else PLAIN_TEMPLATE))
    ok = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hello world"}]
    path = write("sys.jsonl", json.dumps({"messages": ok}) + "\n\n" + json.dumps(
        {"messages": [{"role": "system", "content": "the cat"}, *ok]}) + "\n")  # line 3: a blank line counts
    dm = TextDataModule(train_file=path, tokenizer=tok, val_fraction=0.0, batch_size=1)
    with pytest.raises(ConfigError, match=r"^`data\.init_args\.train_file='.*sys\.jsonl'`: line 3: the chat template of "
                                          r"`data\.init_args\.tokenizer` refused it: Conversation roles must alternate$"):
        dm.setup()


def test_a_template_that_renders_whole_chats_only_is_said_to_need_generation_marks(write, tmp_path):
    """A fresh trial: a template requiring the last turn to be the assistant's renders every chat of the file, yet the
    prefix rendering (no `{% generation %}` marks) met its `raise_exception` and the error blamed line 1."""
    from tests.data.conftest import PLAIN_TEMPLATE, save_tokenizer

    tok = save_tokenizer(tmp_path / "tok", "{% if messages[-1]['role'] != 'assistant' %}"
                                           "{{ raise_exception('chat must end with assistant') }}{% endif %}"
                                           + PLAIN_TEMPLATE)
    chat = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hello world"}]
    dm = TextDataModule(train_file=write("c.jsonl", [{"messages": chat}]), tokenizer=tok, val_fraction=0.0,
                        batch_size=1)
    with pytest.raises(ConfigError, match=r"line 1: the chat template of `data\.init_args\.tokenizer` refused it: chat "
                                          r"must end with assistant \(on a prefix of the chat: the whole chat renders, "
                                          r"but .*mark the assistant's content with them\)$"):
        dm.setup()


def test_a_chat_template_that_is_not_jinja_names_the_tokenizer(write, tmp_path):
    """A syntax error is the tokenizer's, whichever chat meets it first: the option named is the tokenizer's."""
    from tests.data.conftest import save_tokenizer

    tok = save_tokenizer(tmp_path / "tok", "{% for m in messages %}{{ m['content'] }")
    chat = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hello world"}]
    dm = TextDataModule(train_file=write("c.jsonl", [{"messages": chat}]), tokenizer=tok, val_fraction=0.0,
                        batch_size=1)
    with pytest.raises(ConfigError, match=r"^`data\.init_args\.tokenizer='.*tok'`: its chat template is not valid "
                                          r"Jinja \(template line 1\): "):
        dm.setup()
