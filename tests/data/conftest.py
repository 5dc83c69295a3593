"""Fixtures for the data tests: a tiny local Hugging Face tokenizer and small data files."""

import json

import pytest

WORDS = ("hello world how are you i am fine thanks the cat sat on mat user assistant system : < > end "
         "what is two plus three five four").split()


# a template without {% generation %} marks; every turn renders the same in every prefix of the chat
PLAIN_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}< {{ m['role'] }} > {{ m['content'] }} < end > {% endfor %}"
    "{% if add_generation_prompt %}< assistant > {% endif %}"
)
# the same rendering, with the assistant's content and end marker inside {% generation %}
GENERATION_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}< {{ m['role'] }} > "
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }} < end > {% endgeneration %}"
    "{% else %}{{ m['content'] }} < end > {% endif %}{% endfor %}"
    "{% if add_generation_prompt %}< assistant > {% endif %}"
)


def save_tokenizer(path, chat_template):
    """A WordLevel `PreTrainedTokenizerFast` over WORDS with `chat_template`, written by `save_pretrained`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<pad>", "<unk>", "<bos>", "<eos>", *dict.fromkeys(WORDS)])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", bos_token="<bos>", eos_token="<eos>"
    )
    fast.chat_template = chat_template
    fast.save_pretrained(path)
    return str(path)


@pytest.fixture
def hf_tokenizer_dir(tmp_path):
    """A tiny local tokenizer whose chat template has no {% generation %} marks."""
    return save_tokenizer(tmp_path / "tok", PLAIN_TEMPLATE)


@pytest.fixture
def hf_generation_tokenizer_dir(tmp_path):
    """A tiny local tokenizer whose chat template marks the assistant's tokens with {% generation %}."""
    return save_tokenizer(tmp_path / "tok_gen", GENERATION_TEMPLATE)


@pytest.fixture
def write(tmp_path):
    """write(name, content) -> path; content is a str, or a list of dicts written as JSON lines."""

    def _write(name, content):
        path = tmp_path / name
        if isinstance(content, list):
            content = "".join(json.dumps(r) + "\n" for r in content)
        path.write_text(content, encoding="utf-8")
        return str(path)

    return _write


@pytest.fixture
def offline(monkeypatch):
    """Hugging Face hub offline mode (there is no network here): a hub lookup fails at once, not after retries."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    try:
        import datasets.config
    except ImportError:
        return
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True, raising=False)
