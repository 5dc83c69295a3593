"""One compat module per library: every private or version-dependent surface of torch, transformers,
Lightning, flash-attn-4 and ffpa-attn that lightning_ffpa uses lives in `torch.py`, `transformers.py`,
`lightning.py`, `fa4.py` or `ffpa.py` here.

A library upgrade breaks these files and nothing else; `tests/test_compat_boundary.py` fails when a private
name of torch, transformers or Lightning, or a private op of ffpa-attn (`torch.ops.ffpa_attn._*`), is used
anywhere else in `lightning_ffpa/` or `benchmarks/`.
Import the submodule under a name that does not shadow the library, e.g.
`from lightning_ffpa._compat import torch as torch_compat`.
"""
