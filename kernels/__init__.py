"""Worker-side block tables and the Triton kernels that serve them.

- :mod:`~kvproof.kernels.block_table`: per-request, per-group tables sized by the geometry
  spec, with staged appends that are checked for every group before anything changes;
- one module per kernel, each with its torch reference beside it:
  :mod:`~kvproof.kernels.apply_writes`, :mod:`~kvproof.kernels.gather_block_tables`,
  :mod:`~kvproof.kernels.slot_mapping`;
- :mod:`~kvproof.kernels.host`: picks Triton (GPU, or the interpreter on CPU) or the reference,
  and turns the kernels' error outputs into exceptions.

Imports ``kvproof.spec``, torch and (optionally) triton; never ``kvproof.impl``. The padding
sentinel is :data:`kvproof.spec.placement.PAD_SLOT` (-1). See docs/kernels.md.
"""
