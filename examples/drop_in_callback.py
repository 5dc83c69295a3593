"""A plain Lightning project that trains a Hugging Face Gemma4 and adds only lightning-ffpa's Callback.

Everything here is the user's own code: the LightningModule, the data, the Trainer. What changes training
comes from lightning-ffpa and is marked `# lightning-ffpa`: the `FFPAAttention` Callback (routes Gemma4's
head_dim-512 full-attention layers to FFPA and reports which kernels ran) and, optionally, the
`FSDP2Strategy` (per-layer FSDP2 + selective activation checkpointing). The other imports from the package
only read the dispatch counters, pick the CPU reference kernel, build a tiny random Gemma4 config, and add
the step progress bar.

    python examples/drop_in_callback.py                      # tiny random Gemma4, CPU, a few seconds
    python examples/drop_in_callback.py --pretrained /path/to/gemma-4 --accelerator gpu --devices 8 \\
        --strategy fsdp2 --seq-len 8192 --max-steps 1000     # fp32 master weights, bf16 compute (FSDP2)
    python examples/drop_in_callback.py --accelerator gpu --precision bf16-true   # one GPU, no strategy

On CPU the FFPA CuTeDSL kernels cannot run, so the example runs the same dispatch code on the CPU
reference kernel (`--kernel reference`, the default there); the summary line says which kernel ran.
"""

from __future__ import annotations

import argparse
import contextlib

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset
from transformers import AutoConfig, AutoModelForCausalLM, Gemma4ForCausalLM

from lightning_ffpa.attention import dispatch_counts, force_kernel, kernel_counts
from lightning_ffpa.callbacks import FFPAAttention  # lightning-ffpa
from lightning_ffpa.callbacks.screen import default_callbacks  # lightning-ffpa
from lightning_ffpa.presets import build_text_config


class RandomTokens(Dataset):
    """Random token ids: stands in for the user's own dataset."""

    def __init__(self, vocab_size: int, seq_len: int, num_samples: int, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, vocab_size, (num_samples, seq_len), generator=gen)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data[i]


class CausalLM(L.LightningModule):
    """The user's LightningModule: an HF Gemma4ForCausalLM in `self.model`, HF's own loss, AdamW."""

    def __init__(self, pretrained: str | None = None, preset: str = "tiny", lr: float = 3e-4) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model: torch.nn.Module | None = None

    def configure_model(self) -> None:
        # Built here rather than in __init__ so a sharding strategy can build it where it wants.
        if self.model is not None:
            return
        if self.hparams.pretrained:
            # fp32 master weights: FSDP2 computes in bf16, and precision="bf16-true" casts the module itself.
            self.model = AutoModelForCausalLM.from_pretrained(self.hparams.pretrained, dtype=torch.float32)
        else:
            self.model = Gemma4ForCausalLM(build_text_config(self.hparams.preset))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch, labels=batch, use_cache=False).loss
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pretrained", default=None, help="HF Gemma4 checkpoint (path or hub id); default: tiny random")
    p.add_argument("--preset", default="tiny", help="lightning_ffpa.presets shape when --pretrained is not set")
    p.add_argument("--accelerator", default="cpu", help="cpu | gpu | auto")
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--num-nodes", type=int, default=1)
    p.add_argument("--strategy", choices=["auto", "fsdp2"], default="auto", help="fsdp2: lightning-ffpa's FSDP2Strategy")
    p.add_argument("--precision", default="32-true", help="Lightning precision, e.g. bf16-true on GPUs")
    p.add_argument("--kernel", choices=["auto", "reference"], default=None,
                   help="FFPA kernel: auto (CuTeDSL where it runs) or reference (CPU); default reference on CPU")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=5)
    p.add_argument("--lr", type=float, default=3e-4)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    """Train; return the callback's summary and the attention/kernel counters of this run."""
    args = parse_args(argv)
    torch.manual_seed(0)
    module = CausalLM(args.pretrained, args.preset, args.lr)
    strategy = "auto"
    if args.strategy == "fsdp2":
        from lightning_ffpa.parallel import FSDP2Strategy  # lightning-ffpa

        strategy = FSDP2Strategy(activation_checkpointing="selective",
                                 param_dtype="bf16" if args.accelerator != "cpu" else "fp32")
    attention = FFPAAttention(log_every_n_steps=1)
    trainer = L.Trainer(accelerator=args.accelerator, devices=args.devices, num_nodes=args.num_nodes,
                        strategy=strategy, precision=args.precision, max_steps=args.max_steps,
                        # the step progress bar (Lightning's reads `Epoch 0/-2` under max_steps)
                        callbacks=[attention, *default_callbacks({"enable_model_summary": False}, [attention])],
                        logger=False, enable_checkpointing=False,
                        enable_model_summary=False, log_every_n_steps=1)
    # RandomTokens only (real projects bring their data): ids below the model's own vocabulary
    config = AutoConfig.from_pretrained(args.pretrained) if args.pretrained else build_text_config(args.preset)
    vocab = config.get_text_config().vocab_size
    data = DataLoader(RandomTokens(vocab, args.seq_len, args.batch_size * args.max_steps * 2),
                      batch_size=args.batch_size)
    kernel = args.kernel or ("reference" if args.accelerator == "cpu" else "auto")
    with force_kernel("reference") if kernel == "reference" else contextlib.nullcontext():
        trainer.fit(module, data)
    report = {"summary": attention.summary(), "dispatch": dispatch_counts(), "kernels": kernel_counts(),
              "loss": float(trainer.callback_metrics["train/loss"]), "model_class": type(module.model).__name__}
    if trainer.is_global_zero:  # FFPAAttention itself prints its summary line at the end of fit
        print(f"kernels: {report['kernels']}  final loss: {report['loss']:.4f}")
    return report


if __name__ == "__main__":
    main()
    from lightning_ffpa.parallel import close_process_group  # lightning-ffpa

    close_process_group()  # several processes: meet, then end the group before exit (docs/troubleshooting.md)
