"""Hugging Face weights of a role, exported from its committed torch_dist directory after the
step commits (protocol/__init__.py, step E; `save_contents: hf_model`, `verl-ckpt export`).

- model_spec.py: the model description rank 0 saves with each step;
- mapping.py: the mapping interface (megatron-core key -> Hugging Face keys and a transform)
  and the registry of mappings, with gpt2.py built in;
- export.py: one export (read, convert, write, record, publish);
- record.py: the export record and its verification (torch-free);
- scheduler.py: which roles export, and the finalizer's export queue.
Users import the public names from `verl_ckpt`.
"""
