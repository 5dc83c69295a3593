"""Assistant-only chat labels under a template without `{% generation %}` marks, laid out as the stock Gemma4
template is (`<|turn>role` ... `<turn|>`, the system turn first, `model` for the assistant, the generation
prompt `<|turn>model`). HF's `return_assistant_tokens_mask` is all zeros under it (trl#6578); the prefix-by-
prefix rendering labels exactly what the same template with the marks around each assistant turn labels."""

from __future__ import annotations

import logging

import pytest

from lightning_ffpa.data import IGNORE_INDEX, TextDataModule
from lightning_ffpa.data.documents import tokenize_records
from lightning_ffpa.data.tokenizer import load_tokenizer
from lightning_ffpa.errors import ConfigError

WORDS = ("the cat how are you i am fine thanks what is two plus three five four hello world model system user "
         "tool call").split()
_OPEN = (
    "{{ bos_token }}{% set turns = messages %}"
    "{% if messages[0]['role'] == 'system' %}<|turn> system {{ messages[0]['content'] | trim }} <turn|> "
    "{% set turns = messages[1:] %}{% endif %}"
    "{% for m in turns %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}<|turn> {{ role }} "
)
_CLOSE = "{% endfor %}{% if add_generation_prompt %}<|turn> model {% endif %}"
# the Gemma4 layout, no marks: the model's turn header is the generation prompt
GEMMA4_LIKE = _OPEN + "{{ m['content'] | trim }} <turn|> " + _CLOSE
# the same rendering, with the assistant's content and turn end inside {% generation %}, outside the header
GEMMA4_LIKE_MARKED = (
    _OPEN + "{% if role == 'model' %}{% generation %}{{ m['content'] | trim }} <turn|> {% endgeneration %}"
    "{% else %}{{ m['content'] | trim }} <turn|> {% endif %}" + _CLOSE
)

CHATS = [
    [{"role": "system", "content": "the cat"}, {"role": "user", "content": "how are you"},
     {"role": "assistant", "content": "i am fine thanks"}, {"role": "user", "content": "what is two plus three"},
     {"role": "assistant", "content": "five"}],
    [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hello world"},
     {"role": "user", "content": "thanks"}],  # ends on the user: its eos is not learned
    [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "four"},
     {"role": "assistant", "content": "five"}],  # two assistant messages in a row
]


def _tokenizer(path, template):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<unk>", "<bos>", "<eos>", "<|turn>", "<turn|>"]
    vocab = {t: i for i, t in enumerate([*specials, *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", bos_token="<bos>",
                                   eos_token="<eos>")
    fast.chat_template = template
    fast.save_pretrained(path)
    return load_tokenizer(str(path))


@pytest.fixture
def gemma4_like(tmp_path):
    return _tokenizer(tmp_path / "plain", GEMMA4_LIKE), _tokenizer(tmp_path / "marked", GEMMA4_LIKE_MARKED)


def test_hf_assistant_mask_is_all_zeros_without_marks(gemma4_like):
    plain, marked = gemma4_like
    for chat in CHATS:
        assert plain.apply_chat_template(chat, tokenize=False) == marked.apply_chat_template(chat, tokenize=False)
        out = plain.apply_chat_template(chat, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert sum(out["assistant_masks"]) == 0  # what assistant-only SFT gets from the stock template


def test_prefix_rendering_labels_exactly_the_marked_assistant_turns(gemma4_like):
    plain, marked = gemma4_like
    got, stats = tokenize_records(CHATS, plain, max_seq_length=128)
    want, marked_stats = tokenize_records(CHATS, marked, max_seq_length=128)
    assert (stats.num_chat_prefix_masked, stats.num_chat_unmasked, stats.num_chat_header_learned) == (3, 0, 0)
    assert marked_stats.num_chat_generation_masked == 3
    for doc, ref in zip(got, want, strict=True):
        assert doc.input_ids == ref.input_ids
        assert doc.labels == ref.labels
    learned = [plain.decode([t for t in d.labels if t != IGNORE_INDEX]) for d in got]
    assert learned == ["i am fine thanks <turn|> five <turn|> <eos>", "hello world <turn|>",
                       "four <turn|> five <turn|> <eos>"]


def test_a_template_that_rewrites_earlier_turns_learns_every_token_and_says_so(tmp_path):
    """Under a template whose earlier turns change as the chat grows, tokens cannot be attributed to turns."""
    rewrites = "{{ bos_token }}{% for m in messages %}{{ 'the ' * (messages | length) }}{{ m['content'] }} {% endfor %}"
    docs, stats = tokenize_records(CHATS[1:2], _tokenizer(tmp_path / "rewrites", rewrites), max_seq_length=128)
    assert stats.num_chat_unmasked == 1 and docs[0].labels == docs[0].input_ids


def test_an_assistant_turn_that_opens_the_chat_keeps_its_header_and_is_counted(gemma4_like):
    plain, marked = gemma4_like
    chat = [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "how are you"},
            {"role": "assistant", "content": "i am fine thanks"}]
    (doc,), stats = tokenize_records([chat], plain, max_seq_length=128)
    assert (stats.num_chat_prefix_masked, stats.num_chat_header_learned) == (1, 1)
    learned = plain.decode([t for t in doc.labels if t != IGNORE_INDEX])
    assert learned == "<|turn> model hello <turn|> i am fine thanks <turn|> <eos>"


def test_a_chat_data_set_without_assistant_turns_is_refused_by_name(tmp_path, write):
    path = write("users.jsonl", [{"messages": [{"role": "user", "content": "how are you"}]}] * 2)
    _tokenizer(tmp_path / "tok", GEMMA4_LIKE)
    with pytest.raises(ConfigError, match=r"^`data\.init_args\.train_file=.*`: has no document with a token to learn "
                                          r"from \(0 empty, 2 too short or without an assistant turn\)"):
        TextDataModule(train_file=path, tokenizer=str(tmp_path / "tok"), val_fraction=0.0, batch_size=1).setup()


def test_the_data_module_reports_the_prefix_rule(tmp_path, write, caplog):
    path = write("chats.jsonl", [{"messages": chat} for chat in CHATS])
    _tokenizer(tmp_path / "tok", GEMMA4_LIKE)
    dm = TextDataModule(train_file=path, tokenizer=str(tmp_path / "tok"), val_fraction=0.0, batch_size=1,
                        max_seq_length=64)
    with caplog.at_level(logging.INFO):
        dm.setup()
    assert "3 chats learn the assistant tokens only, found by rendering the chat prefix by prefix" in caplog.text
    assert dm.stats["data.init_args.train_file"]["num_chat_header_learned"] == 0


# the Gemma4 layout with tool calls: an assistant turn renders its content (if any), then each call
_TOOL_BODY = ("{% if m['content'] %}{{ m['content'] | trim }} {% endif %}{% for t in m['tool_calls'] or [] %}"
              "call {{ t['function']['name'] }} {{ t['function']['arguments']['x'] }} {% endfor %}<turn|> ")
TOOLS = _OPEN + _TOOL_BODY + _CLOSE
TOOLS_MARKED = (_OPEN + "{% if role == 'model' %}{% generation %}" + _TOOL_BODY + "{% endgeneration %}"
                "{% else %}" + _TOOL_BODY + "{% endif %}" + _CLOSE)
_CALL = {"type": "function", "function": {"name": "plus", "arguments": {"x": "two three"}}}


def _tool_chat(content):
    """A tool-use chat whose tool-calling turn has `content` ("": OpenAI's exports; None; "absent": no key)."""
    calling = {"role": "assistant", "tool_calls": [_CALL]} | ({} if content == "absent" else {"content": content})
    return [{"role": "user", "content": "what is two plus three"}, calling,
            {"role": "tool", "name": "plus", "tool_call_id": "call", "content": "five"},
            {"role": "assistant", "content": "five"}]


@pytest.mark.parametrize("content", ["", None, "absent"])
@pytest.mark.parametrize("template", ["plain", "marked"])
def test_tool_calls_reach_the_template_and_are_learned(tmp_path, write, template, content):
    """`tool_calls`, `name` and `tool_call_id` were dropped (a message kept `role` and `content` alone), so a
    tool-calling turn trained as an empty one; a null or absent `content` beside them was refused."""
    chat = _tool_chat(content)
    tok = _tokenizer(tmp_path / template, TOOLS if template == "plain" else TOOLS_MARKED)
    dm = TextDataModule(train_file=write("tools.jsonl", [{"messages": chat}]), tokenizer=str(tmp_path / template),
                        val_fraction=0.0, batch_size=1, max_seq_length=128)
    dm.setup()
    row = dm._train[0]
    want = tok.apply_chat_template(chat, tokenize=True, return_dict=True)["input_ids"]
    assert row["input_ids"].tolist() == [*want, tok.eos_token_id]  # the data module adds the eos the template lacks
    learned = tok.decode([t for t in row["labels"].tolist() if t != IGNORE_INDEX])
    assert learned == "call plus two three <turn|> five <turn|> <eos>"  # not the tool's result, not the headers
    stats = dm.stats["data.init_args.train_file"]
    assert stats["num_chat_generation_masked" if template == "marked" else "num_chat_prefix_masked"] == 1
