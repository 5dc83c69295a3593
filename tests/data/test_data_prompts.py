"""GRPO prompts: local files and `datasets` sources, `prompt` text or `messages` chats, the chat template with
its generation prompt, extra fields kept for the reward functions, and the option errors."""

import json

import pytest
import torch

from lightning_ffpa.data import ByteTokenizer, PromptDataModule
from lightning_ffpa.errors import ConfigError
from lightning_ffpa.rl.prompts import PromptDataModule as LegacyPath

PROMPTS = [{"prompt": "what is two plus three", "answer": "five"}, {"prompt": "hello", "answer": "world"}]


def _batch(dm):
    dm.setup()
    return next(iter(dm.train_dataloader()))


def test_the_rl_import_path_still_works():
    assert LegacyPath is PromptDataModule


def test_text_prompts_get_the_chat_template_and_keep_their_fields(write, hf_generation_tokenizer_dir):
    from transformers import AutoTokenizer

    dm = PromptDataModule(path=write("p.jsonl", PROMPTS), tokenizer=hf_generation_tokenizer_dir, batch_size=2)
    batch = _batch(dm)
    tok = AutoTokenizer.from_pretrained(hf_generation_tokenizer_dir)
    by_answer = dict(zip(batch["answer"], zip(batch["prompt_text"], batch["prompt_ids"])))
    text, ids = by_answer["five"]
    expected = tok.apply_chat_template([{"role": "user", "content": "what is two plus three"}], tokenize=False,
                                       add_generation_prompt=True)
    assert text == expected and text.endswith("< assistant > ")
    assert ids == tok.encode(expected, add_special_tokens=False) and ids[0] == tok.bos_token_id
    assert set(batch) == {"prompt", "prompt_text", "prompt_ids", "answer"}  # `answer` reaches the reward functions
    assert "what is two plus three" in batch["prompt"]  # the reward functions get the prompt as given (TRL)


def test_chat_prompts_from_parquet(tmp_path, hf_tokenizer_dir):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    chat = [{"role": "system", "content": "i am fine"}, {"role": "user", "content": "how are you"}]
    path = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist([{"messages": chat, "answer": "fine"}]), path)
    dm = PromptDataModule(path=str(path), tokenizer=hf_tokenizer_dir, batch_size=1)
    batch = _batch(dm)
    assert batch["prompt_text"] == ["<bos>< system > i am fine < end > < user > how are you < end > < assistant > "]
    assert batch["prompt"] == [chat] and batch["messages"] == [chat] and batch["answer"] == ["fine"]


def test_without_a_template(write, hf_tokenizer_dir):
    # chat_template off: a text prompt is tokenized as is, with the tokenizer's special tokens
    dm = PromptDataModule(path=write("p.jsonl", PROMPTS[:1]), tokenizer=hf_tokenizer_dir, chat_template=False,
                          batch_size=1)
    batch = _batch(dm)
    assert batch["prompt_text"] == batch["prompt"] == ["what is two plus three"]
    # the byte tokenizer has no template: chats use the plain format, ending in the assistant's prefix
    chat = [{"role": "user", "content": "hi"}]
    dm = PromptDataModule(path=write("c.jsonl", [{"messages": chat}]), tokenizer="byte", batch_size=1)
    batch = _batch(dm)
    assert batch["prompt_text"] == ["user: hi\nassistant: "] and batch["prompt"] == [chat]
    assert ByteTokenizer().decode(batch["prompt_ids"][0]) == "user: hi\nassistant: "
    # a text prompt keeps the tokenizer's bos but not the eos it appends: the policy continues the prompt
    tok = ByteTokenizer()
    dm = PromptDataModule(path=write("t.jsonl", PROMPTS[:1]), tokenizer="byte", batch_size=1)
    assert _batch(dm)["prompt_ids"][0] == [tok.bos_token_id, *tok.encode("what is two plus three")]


def test_dataset_folder_and_split(tmp_path, hf_tokenizer_dir):
    pytest.importorskip("datasets")
    folder = tmp_path / "prompts"
    folder.mkdir()
    (folder / "train.jsonl").write_text("".join(json.dumps({"question": f"what is {w}"}) + "\n"
                                                for w in ("two", "three", "four")))
    dm = PromptDataModule(dataset=str(folder), split="train[:2]", prompt_field="question",
                          tokenizer=hf_tokenizer_dir, batch_size=2)
    batch = _batch(dm)
    assert sorted(batch["question"]) == ["what is three", "what is two"]
    assert all(p.endswith("< assistant > ") for p in batch["prompt_text"])


def test_random_prompts_are_seeded_token_ids():
    dm = PromptDataModule(num_random_prompts=4, prompt_len=3, vocab_size=50, batch_size=4, seed=7)
    dm.setup()
    rows = [dm.dataset_rows[i]["prompt_ids"] for i in range(4)]
    expected = torch.randint(2, 50, (4, 3), generator=torch.Generator().manual_seed(7)).tolist()
    assert rows == expected


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        ({"path": "PROMPTS"}, r"`data\.init_args\.tokenizer=None`: is needed"),
        ({"path": "/nonexistent/p.jsonl", "tokenizer": "byte"}, r"`data\.init_args\.path='/nonexistent/p\.jsonl'`"),
        ({"path": "PROMPTS", "dataset": "org/name", "tokenizer": "byte"}, r"`data\.init_args\.dataset='org/name'`"),
        ({"vocab_size": 2}, r"`data\.init_args\.vocab_size=2`"),
        ({"path": "PROMPTS", "dataset_config": "x", "tokenizer": "byte"},
         r"`data\.init_args\.dataset_config='x'`: names a configuration of `dataset`"),  # was ignored
    ],
)
def test_bad_options_name_the_option(write, kwargs, pattern):
    kwargs = {k: write("p.jsonl", PROMPTS) if v == "PROMPTS" else v for k, v in kwargs.items()}
    with pytest.raises(ConfigError, match=pattern):
        PromptDataModule(**kwargs)


def test_setup_errors_name_the_option(write, offline):
    dm = PromptDataModule(path=write("p.jsonl", PROMPTS), tokenizer="byte", batch_size=3)
    with pytest.raises(ConfigError, match=r"`data\.init_args\.batch_size=3`: larger than the training set \(2 rows\)"):
        dm.setup()
    dm = PromptDataModule(path=write("q.jsonl", [{"question": "x"}]), tokenizer="byte", batch_size=1)
    with pytest.raises(ConfigError, match=r"row 1 needs a string `prompt` or a list `messages`"):
        dm.setup()
    dm = PromptDataModule(dataset="no-such-org/no-such-prompts", tokenizer="byte")
    with pytest.raises(ConfigError, match=r"`data\.init_args\.dataset='no-such-org/no-such-prompts'`: "):
        dm.setup()


@pytest.mark.parametrize("row", [{"prompt": ""}, {"prompt": "  \n"}, {"messages": [{"role": "user", "content": ""}]}])
def test_an_empty_prompt_is_refused_naming_the_row(write, hf_tokenizer_dir, row):
    """An empty prompt became `<bos>` alone, and the run trained on it."""
    path = write("p.jsonl", [{"prompt": "hello world"}, row])
    dm = PromptDataModule(path=path, tokenizer=hf_tokenizer_dir, batch_size=1)
    with pytest.raises(ConfigError, match=rf"^`data\.init_args\.path='{path}'`: row 2 has an empty prompt"):
        dm.setup()


def test_prompt_vocab_is_the_tokenizers_and_is_checked_against_the_model(write, hf_tokenizer_dir):
    """A tokenizer larger than the model failed mid-rollout with an IndexError; now before any model is built."""
    from transformers import AutoTokenizer

    from lightning_ffpa.module import Gemma4LM
    from lightning_ffpa.validation import check_data_fits_model

    dm = PromptDataModule(path=write("p.jsonl", PROMPTS), tokenizer=hf_tokenizer_dir, batch_size=2)
    size = len(AutoTokenizer.from_pretrained(hf_tokenizer_dir))
    assert dm.vocab_size == size
    with pytest.raises(ValueError, match=rf"^`data.init_args.tokenizer='.*'`: has {size} tokens, more than the model's "
                                         "vocab_size=3"):
        check_data_fits_model(Gemma4LM(preset="tiny", config_overrides={"vocab_size": 3}), dm)


def test_a_field_some_rows_lack_reaches_the_rewards_as_none(write, hf_tokenizer_dir):
    rows = [{"prompt": "a", "answer": "x"}, {"prompt": "b"}, {"prompt": "c", "hint": 3}]
    dm = PromptDataModule(path=write("ragged.jsonl", rows), tokenizer=hf_tokenizer_dir, batch_size=3)
    dm.setup()
    batch = next(iter(dm.train_dataloader()))
    pairs = set(zip(batch["answer"], batch["hint"]))
    assert pairs == {("x", None), (None, None), (None, 3)}


def test_chat_prompts_with_a_tokenizer_without_a_template_are_refused(write, tmp_path):
    """A Hugging Face tokenizer without a chat template rendered chats in a `role: content` format of our own,
    silently (transformers refuses it); the byte tokenizer and `chat_template: false` keep that format."""
    from tests.data.conftest import save_tokenizer

    bare = save_tokenizer(tmp_path / "bare", None)
    dm = PromptDataModule(path=write("c.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}]),
                          tokenizer=bare, batch_size=1)
    with pytest.raises(ConfigError, match=r"^`data.init_args.tokenizer='.*bare'`: has no chat template, and the data "
                                          r"holds chats"):
        _batch(dm)


def test_a_prompt_the_chat_template_refuses_names_the_row(write, tmp_path):
    from tests.data.conftest import PLAIN_TEMPLATE, save_tokenizer

    refuses = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system turn') }}{% endif %}"
    tok = save_tokenizer(tmp_path / "tok", refuses + PLAIN_TEMPLATE)
    rows = [{"prompt": "hello"}, {"messages": [{"role": "system", "content": "the cat"}, {"role": "user", "content": "hi"}]}]
    dm = PromptDataModule(path=write("p.jsonl", rows), tokenizer=tok, batch_size=1)
    with pytest.raises(ConfigError, match=r"^`data\.init_args\.path='.*p\.jsonl'`: row 2: the chat template of "
                                          r"`data\.init_args\.tokenizer` refused it: no system turn$"):
        dm.setup()
