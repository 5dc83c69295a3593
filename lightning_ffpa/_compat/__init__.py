"""One compat module per library: every private or version-dependent surface of torch, transformers and
Lightning that lightning_ffpa uses lives in `torch.py`, `transformers.py` or `lightning.py` here.

A library upgrade breaks these files and nothing else; `tests/test_compat_boundary.py` fails when a private
name of one of those libraries is used anywhere else in `lightning_ffpa/` or `benchmarks/`.
Import the submodule under a name that does not shadow the library, e.g.
`from lightning_ffpa._compat import torch as torch_compat`.
"""
