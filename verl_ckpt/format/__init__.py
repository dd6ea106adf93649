"""The bytes of a step (floor 6): DCP/torch_dist files as megatron-core reads them, the
writer of one rank's files, the direct reader, inspection and the megatron-core version
guards (`megatron_compat`). Imports only `store` and `protocol`.
"""
