Seed set to 1234
GPU available: False, used: False
TPU available: False, using: 0 TPU cores
💡 Tip: For seamless cloud logging and experiment tracking, try installing [litlogger](https://pypi.org/project/litlogger/) to enable LitLogger, which logs metrics and artifacts automatically to the Lightning Experiments platform.
TextDataModule: 4858 train / 252 val rows (pack=True, max_seq_length=32); {'data.init_args.train_file': {'num_records': 1072, 'num_split': 887, 'num_dropped_unlabelled': 44, 'num_chat_generation_masked': 0, 'num_chat_prefix_masked': 0, 'num_chat_unmasked': 0}}
Initializing distributed: GLOBAL_RANK: 0, MEMBER: 1/2
[rank: 1] Seed set to 1234
Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2
----------------------------------------------------------------------------------------------------
distributed_backend=gloo
All distributed processes registered. Starting with 2 processes
----------------------------------------------------------------------------------------------------


  | Name      | Type              | Params | Mode 
--------------------------------------------------
0 | train_ppl | TokenPerplexity   | 0      | train
1 | val_ppl   | TokenPerplexity   | 0      | train
2 | model     | Gemma4ForCausalLM | 773 K  | train
--------------------------------------------------
773 K      Trainable params
0          Non-trainable params
773 K      Total params
3.093      Total estimated model params size (MB)
79         Modules in train mode
0          Modules in eval mode
/work/main/.venv/lib/python3.11/site-packages/lightning/pytorch/utilities/_pytree.py:21: `isinstance(treespec, LeafSpec)` is deprecated, use `isinstance(treespec, TreeSpec) and treespec.is_leaf()` instead.
/work/main/.venv/lib/python3.11/site-packages/lightning/pytorch/utilities/_pytree.py:21: `isinstance(treespec, LeafSpec)` is deprecated, use `isinstance(treespec, TreeSpec) and treespec.is_leaf()` instead.
`Trainer.fit` stopped: `max_steps=2` reached.
