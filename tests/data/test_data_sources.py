"""TextDataModule sources through `datasets`: .json/.parquet/.arrow files, dataset folders with splits, hub names
(offline: one error), custom fields, chat labels from {% generation %} marks, and the batch-size check."""

import json
import logging

import lightning.pytorch as pl
import pytest
import torch

from lightning_ffpa.data import IGNORE_INDEX, TextDataModule
from lightning_ffpa.data import sources as sources_module
from lightning_ffpa.data.text import SHAKESPEARE_PATH
from lightning_ffpa.errors import ConfigError

datasets = pytest.importorskip("datasets")
pa = pytest.importorskip("pyarrow")

CHAT = [{"role": "user", "content": "how are you"}, {"role": "assistant", "content": "i am fine thanks"}]
ROWS = [{"text": "the cat sat on the mat"}, {"messages": CHAT}, {"text": "hello world"}]


def _save(path, rows):
    """Write `rows` in the format the extension names."""
    table = pa.Table.from_pylist([{"text": r.get("text"), "messages": r.get("messages")} for r in rows])
    ext = path.suffix
    if ext == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif ext == ".json":
        path.write_text(json.dumps(rows))  # one JSON array
    elif ext == ".parquet":
        import pyarrow.parquet as pq

        pq.write_table(table, path)
    elif ext == ".arrow":
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
    return str(path)


def _decoded(dm, ds):
    tok = dm.tokenizer
    return sorted(
        (tok.decode(r["input_ids"], skip_special_tokens=True),
         tok.decode(r["labels"][r["labels"] != IGNORE_INDEX], skip_special_tokens=True))
        for r in (ds[i] for i in range(len(ds)))
    )


@pytest.mark.parametrize("ext", [".json", ".parquet", ".arrow"])
def test_datasets_files_read_like_jsonl(tmp_path, hf_tokenizer_dir, ext):
    def module(path):
        dm = TextDataModule(train_file=path, tokenizer=hf_tokenizer_dir, val_fraction=0.0, max_seq_length=64,
                            batch_size=1)
        dm.setup()
        return dm

    reference = module(_save(tmp_path / "rows.jsonl", ROWS))
    dm = module(_save(tmp_path / f"rows{ext}", ROWS))
    assert len(dm._train) == 3
    assert _decoded(dm, dm._train) == _decoded(reference, reference._train)


def test_dataset_folder_with_train_and_test_splits(tmp_path, hf_tokenizer_dir):
    folder = tmp_path / "corpus"
    folder.mkdir()
    _save(folder / "train.jsonl", [{"body": f"the cat sat {w}"} for w in ("on", "the", "mat", "end")])
    _save(folder / "test.jsonl", [{"body": "hello world"}])
    dm = TextDataModule(dataset=str(folder), val_split="test", text_field="body", tokenizer=hf_tokenizer_dir,
                        max_seq_length=64, batch_size=2)
    dm.setup()
    assert len(dm._train) == 4 and _decoded(dm, dm._val) == [("hello world", "hello world")]
    # a slice of the split, as `datasets` spells it
    dm = TextDataModule(dataset=str(folder), train_split="train[:2]", val_fraction=0.0, text_field="body",
                        tokenizer=hf_tokenizer_dir, max_seq_length=64, batch_size=2)
    dm.setup()
    assert len(dm._train) == 2


def test_unreachable_hub_dataset_is_one_config_error(offline):
    dm = TextDataModule(dataset="no-such-org/no-such-data", dataset_config="en", max_seq_length=64)
    with pytest.raises(ConfigError, match=r"^`data\.init_args\.dataset='no-such-org/no-such-data'`: "
                       r"datasets\.load_dataset could not load split 'train' of config 'en' of "
                       r"'no-such-org/no-such-data': ") as info:
        dm.setup()
    assert "\n" not in str(info.value)


def test_a_missing_val_split_names_the_split(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "train.jsonl").write_text("".join(f'{{"text": "row {i}"}}\n' for i in range(4)))
    dm = TextDataModule(dataset=str(folder), val_split="nosuch", max_seq_length=64, batch_size=1)
    with pytest.raises(ConfigError, match=r"^`data\.init_args\.val_split='nosuch'`: .*could not load split 'nosuch'"):
        dm.setup()


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        ({"dataset": "org/name", "train_file": "x.txt"}, r"`data\.init_args\.dataset='org/name'`: give either"),
        ({"val_split": "test"}, r"`data\.init_args\.val_split='test'`: needs `dataset`"),
        ({"train_file": "/nonexistent/rows.parquet"}, r"`data\.init_args\.train_file='/nonexistent/rows\.parquet'`"),
        ({"train_split": "train[:10]"}, r"`data\.init_args\.train_split='train\[:10\]'`: applies to `dataset`"),
        # accepted and ignored before: a local file has no configurations; a validation source holds nothing out
        ({"dataset_config": "foo"}, r"`data\.init_args\.dataset_config='foo'`: names a configuration of `dataset`"),
        ({"val_file": SHAKESPEARE_PATH, "val_fraction": 0.3},
         r"`data\.init_args\.val_fraction=0\.3`: holds out training documents only without .*`val_file`"),
    ],
)
def test_bad_source_options_fail_at_construction(kwargs, pattern):
    with pytest.raises(ConfigError, match=pattern):
        TextDataModule(**kwargs)


def test_missing_datasets_package_is_named(tmp_path, monkeypatch):
    path = _save(tmp_path / "rows.parquet", ROWS)
    real = sources_module.importlib.util.find_spec
    monkeypatch.setattr(sources_module.importlib.util, "find_spec", lambda n: None if n == "datasets" else real(n))
    with pytest.raises(ConfigError, match=r"train_file=.*rows\.parquet'`: needs the `datasets` package"):
        TextDataModule(train_file=path)
    with pytest.raises(ConfigError, match=r"`data\.init_args\.dataset='org/name'`: needs the `datasets` package"):
        TextDataModule(dataset="org/name")


def test_row_without_the_fields_names_them(tmp_path):
    path = _save(tmp_path / "rows.json", [{"text": "ok"}, {"question": "what"}])
    with pytest.raises(ConfigError, match=r"rows\.json'`: row 2 needs a string `text` or a list `messages` "
                       r"\(its fields: question, text\)"):
        TextDataModule(train_file=path, val_fraction=0.0, batch_size=1).setup()


def test_a_row_with_both_a_text_and_a_chat_is_refused(tmp_path):
    """It trained on the text alone, unmasked, without a word; a null in either column (parquet) is not a value."""
    path = _save(tmp_path / "both.parquet", [{"text": "ok"}, {"messages": CHAT}, {"text": "the cat", "messages": CHAT}])
    with pytest.raises(ConfigError, match=r"both\.parquet'`: row 3 has both `text` and `messages`: remove one"):
        TextDataModule(train_file=path, val_fraction=0.0, batch_size=1).setup()


@pytest.mark.parametrize("pack", [False, True])
def test_generation_marks_label_exactly_the_assistant_tokens(tmp_path, hf_generation_tokenizer_dir, caplog, pack):
    path = _save(tmp_path / "chat.parquet", [{"messages": CHAT}, {"text": "hello world"}])
    dm = TextDataModule(train_file=path, tokenizer=hf_generation_tokenizer_dir, val_fraction=0.0,
                        max_seq_length=64, batch_size=1, pack=pack)
    with caplog.at_level(logging.INFO):
        dm.setup()
    stats = dm.stats["data.init_args.train_file"]
    assert (stats["num_chat_generation_masked"], stats["num_chat_prefix_masked"], stats["num_chat_unmasked"]) == (
        1, 0, 0)
    assert "1 chat learns the assistant tokens only" in caplog.text
    tok = dm.tokenizer
    rows = [dm._train[i] for i in range(len(dm._train))]
    learned = " | ".join(tok.decode(r["labels"][r["labels"] != IGNORE_INDEX], skip_special_tokens=True) for r in rows)
    # the assistant's content and end marker only: not the "< assistant >" header, not the user turn
    assert "i am fine thanks < end >" in learned and "assistant" not in learned and "how are you" not in learned
    assert "hello world" in learned  # plain text documents are learned whole
    if pack:
        assert len(rows) == 1 and set(rows[0]["document_ids"].tolist()) == {-1, 0, 1}


def test_without_generation_marks_the_prefix_rule_is_reported(tmp_path, hf_tokenizer_dir, caplog):
    path = _save(tmp_path / "chat.jsonl", [{"messages": CHAT}])
    dm = TextDataModule(train_file=path, tokenizer=hf_tokenizer_dir, val_fraction=0.0, max_seq_length=64,
                        batch_size=1)
    with caplog.at_level(logging.INFO):
        dm.setup()
    assert "1 chat learns the assistant tokens only, found by rendering the chat prefix by prefix" in caplog.text
    assert "role header is learned" not in caplog.text
    row = dm._train[0]
    learned = dm.tokenizer.decode(row["labels"][row["labels"] != IGNORE_INDEX], skip_special_tokens=True)
    assert learned == "i am fine thanks < end >"  # the "< assistant >" header is the generation prompt's


class _Builds(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.built = False

    def configure_model(self):
        self.built = True
        self.w = torch.nn.Parameter(torch.zeros(1))

    def training_step(self, batch, batch_idx):
        return self.w.sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("pack, rows", [(False, 4), (True, 1)])
def test_batch_larger_than_the_data_fails_before_the_model_is_built(tmp_path, write, pack, rows):
    path = write("four.txt", "\n\n".join(["the cat", "sat on", "the mat", "hello"]))
    dm = TextDataModule(train_file=path, val_fraction=0.0, max_seq_length=64, batch_size=5, pack=pack)
    model = _Builds()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    with pytest.raises(ConfigError, match=rf"^`data\.init_args\.batch_size=5`: larger than the training set "
                       rf"\({rows} rows?\)"):
        trainer.fit(model, datamodule=dm)
    assert not model.built
