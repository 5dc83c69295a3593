"""Data for lightning_ffpa: mock token rows, text from local files or Hugging Face datasets, GRPO prompts,
tokenizers, padding and packing.

Batches are dicts of LongTensors (B, S): unpacked `input_ids`, `labels` (-100 = no loss), `attention_mask`
(1 real / 0 pad); packed `input_ids`, `labels`, `position_ids`, `document_ids` (-1 on padding).
"""

from lightning_ffpa.data.collate import PackedCollate, PadCollate
from lightning_ffpa.data.documents import IGNORE_INDEX, Document, read_records, tokenize_records
from lightning_ffpa.data.mock import MockDataModule, MockDataset
from lightning_ffpa.data.packing import pack_documents
from lightning_ffpa.data.prompts import PromptDataModule
from lightning_ffpa.data.sampler import ResumableSampler
from lightning_ffpa.data.text import SHAKESPEARE_PATH, TextDataModule, TokenDataset
from lightning_ffpa.data.tokenizer import ByteTokenizer, load_tokenizer

__all__ = [
    "IGNORE_INDEX",
    "SHAKESPEARE_PATH",
    "ByteTokenizer",
    "Document",
    "MockDataModule",
    "MockDataset",
    "PackedCollate",
    "PadCollate",
    "PromptDataModule",
    "ResumableSampler",
    "TextDataModule",
    "TokenDataset",
    "load_tokenizer",
    "pack_documents",
    "read_records",
    "tokenize_records",
]
