"""The `lightning-ffpa` command: LightningCLI with fit/validate/test/predict over YAML configs.

It owns argument parsing only; what runs is the LightningModule, DataModule, strategy and callbacks named
in the config (`class_path` for each), so any Lightning class can be plugged in from YAML.
"""

from __future__ import annotations

from lightning.pytorch.cli import LightningCLI

from lightning_ffpa.validation import PreflightCLIMixin


def _import_components() -> None:
    # Importing registers the classes as LightningModule/DataModule subclasses, so short names work too.
    import lightning_ffpa.data  # noqa: F401
    import lightning_ffpa.module  # noqa: F401


class FFPACLI(PreflightCLIMixin, LightningCLI):
    """LightningCLI with our defaults: subclass mode, config saved next to the logs, pre-flight checks."""

    def add_arguments_to_parser(self, parser) -> None:  # noqa: D102
        parser.set_defaults({"trainer.log_every_n_steps": 10})


def main(args: list[str] | None = None) -> FFPACLI:
    """Entry point for the `lightning-ffpa` console script."""
    _import_components()
    return FFPACLI(
        model_class=None,
        datamodule_class=None,
        subclass_mode_model=True,
        subclass_mode_data=True,
        seed_everything_default=1234,
        save_config_kwargs={"overwrite": True},
        args=args,
        auto_configure_optimizers=False,
    )


if __name__ == "__main__":
    main()
