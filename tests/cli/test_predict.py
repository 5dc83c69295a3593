"""`lightning-ffpa predict` through the installed console script, with a user's own data module: LightningCLI
drops what `predict` returns, so a run with no prediction writer says that nothing saved them (it exited 0 with
only Lightning's restore lines)."""

from __future__ import annotations

import textwrap

from _console import run

DATA = textwrap.dedent('''
    import lightning as L
    import torch


    class PromptIds(L.LightningDataModule):
        def predict_dataloader(self):
            ids = torch.randint(0, 200, (4, 16), generator=torch.Generator().manual_seed(0))
            return torch.utils.data.DataLoader([{"input_ids": row} for row in ids], batch_size=2)
''')


def test_predict_without_a_writer_says_nothing_saved_the_predictions(tmp_path):
    (tmp_path / "mydata.py").write_text(DATA)
    out = run("lightning-ffpa predict --config tiny --data.class_path mydata.PromptIds --trainer.logger false",
              tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert ("predict ran 2 batches, and nothing saved the predictions: add a "
            "`lightning.pytorch.callbacks.BasePredictionWriter` to `trainer.callbacks`") in out.stdout
