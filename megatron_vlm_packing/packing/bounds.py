"""Integer bounds the packer checks Python ints against, in one place (no imports: any module may use it).

Token ids, placeholder ids and the pad id are written into int64 tensors: a larger Python int would
overflow there (or wrap), so the modules that take such ids (`media.MediaTokens`, `rows`, `batch`)
refuse it against `INT64_MAX`.
"""

INT64_MAX = 2**63 - 1  # torch.iinfo(torch.int64).max
