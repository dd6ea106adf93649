"""The bytes of a step (floor 6): DCP/torch_dist files as megatron-core reads them, the
writer of one rank's files, the direct reader, inspection, the megatron-core version
guards (`megatron_compat`), and the loaders that read a checkpoint's pickles without running
any of them (`safe_load`, `safe_reader`). Imports only `store` and `protocol`.
"""
