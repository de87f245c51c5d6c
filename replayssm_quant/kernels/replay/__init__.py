"""Triton kernels of the ReplaySSM layer: decode step, verify, GDN correction solve, flush and
the anchor chain.

Each kernel has its torch reference in :mod:`replayssm_quant.replay` (``core.py``,
``mamba2.py``, ``gdn.py``, ``window.py``); the kernel files only re-state the maths where the
kernel's order of operations matters. ``tests/test_replay_kernels.py`` and
``tests/test_emulation_kernels.py`` compare every kernel with its reference; the design, the
numbers measured on an H200 and the commands are in ``docs/kernels-replay.md`` and
``docs/kl-throughput.md``.

Files (each with its kernel, its host wrapper and a pointer to its torch reference):

* :mod:`.codec` -- stored copies in and out of registers: the format constants of a launch,
  built once per spec (``_decode_consts``, ``_cast_consts``), decode of a stored tile, the
  round-and-pack of a new one, the kernels' shape rule;
* :mod:`.records` -- ``_records_kernel``: everything that reads a checkpoint C plus buffer
  records in *output-only* form (decode step with the ring append, verify, the GDN correction
  solve), one program per (sequence, head, tile of value rows);
* :mod:`.flush` -- ``_flush_kernel``: reconstruct S from the anchor and the committed records,
  then ``A <- Q_rec(S)`` and ``R <- Q_read(S)`` independently, one program per matrix;
* :mod:`.cuda_verify` -- GDN's verify under a single-checkpoint FP32 policy as one CUDA C++
  kernel on the tensor cores (``gdn_verify.cu``, built at first use with nvcc), the
  backend ``cuda``'s kernel of ``gdn_state_verify``; the Triton kernel where it does not apply;
* :mod:`.cuda_step` -- GDN's decode step from an FP32 or NVFP4 read copy as one CUDA C++ kernel
  (``gdn_step.cu``, in the same extension), the backend ``cuda``'s kernel of ``gdn_state_step``;
  the Triton kernel where it does not apply;
* :mod:`.cuda_flush` -- GDN's flush with an fp16 anchor and an NVFP4 read copy as one CUDA C++
  kernel (``gdn_flush.cu``, in the same extension), the backend ``cuda``'s kernel of
  ``gdn_state_flush``; the Triton kernel where it does not apply;
* :mod:`.chain` -- ``_chain_kernel`` (:func:`anchor_chain`): the anchor recurrence of many
  windows in one launch for the adapters and the teacher-forced emulation (``replay/window.py``).

Stored copies are read in their real layout (:class:`~replayssm_quant.packed.PackedTensor`):
fp32 / bf16 / fp16 values, fp8 codes + FP32 matrix scale, nvfp4 nibbles + E4M3 block scales +
FP32 matrix scale, mx codes + E8M0 block scales, and decoded in registers to exactly the values
``PackedTensor.dequantize`` gives (integer decode of the codes, one IEEE multiplication by the
scale). The flush kernel holds key-axis tiles as two halves, the even and the odd elements,
which is how FP4 bytes hold them (element 2i in the low nibble); 8-bit and wider formats are
loaded contiguously and split in registers (on the H200 this measured 2x faster for the flush
than two strided accesses; see docs/kernels-replay.md).

Rounding uses the jit helpers of :mod:`replayssm_quant.kernels.quant` (integer-exact code
computation, ``div_rn`` divisions, ``tl.philox`` SR bits), so a flush kernel cast is
bit-identical to :func:`replayssm_quant.quant.pack_reference` of the same FP32 S. The
reconstruction itself adds in a different order than ``torch.matmul`` (so S may differ in its
last bit from :func:`replayssm_quant.replay.core.reconstruct`); see the tests for how
bit-exactness is checked.

Limits (the wrappers raise ValueError otherwise; the backend seam then keeps the torch path):
float32 only; the key dim K a power of two >= 32 (whole nvfp4/mx blocks); any value dim.

Callers outside ``replayssm_quant.kernels`` reach these through the backend seam
(:mod:`replayssm_quant.backend`), never by importing this package (``docs/architecture.md``).
"""

from .chain import (CHAIN_EXCHANGE, CHAIN_PREFETCH, CHAIN_TILE_ELEMENTS, CHAIN_WARPS, ChainResult,
                    anchor_chain, chain_block_v)
from .codec import kernels_supported
from .cuda_flush import gdn_flush_cuda, gdn_state_flush_cuda
from .cuda_step import gdn_state_step_cuda, gdn_step_cuda
from .cuda_verify import gdn_state_verify_cuda, gdn_verify_cuda
from .flush import (DEFAULT_BV_FLUSH, flush_kernel, gdn_flush_kernel, gdn_state_flush,
                    mamba2_flush_kernel, mamba2_state_flush)
from .records import (DEFAULT_BV, DEFAULT_WARPS, MIN_LP, gdn_corrections_kernel, gdn_state_step,
                      gdn_state_verify, gdn_step_kernel, gdn_verify_kernel, mamba2_state_step, mamba2_state_verify,
                      mamba2_step_kernel, mamba2_verify_kernel, records_outputs)

__all__ = [
    "records_outputs",
    "mamba2_step_kernel",
    "gdn_step_kernel",
    "mamba2_verify_kernel",
    "gdn_verify_kernel",
    "gdn_verify_cuda",
    "gdn_state_verify_cuda",
    "gdn_step_cuda",
    "gdn_state_step_cuda",
    "gdn_flush_cuda",
    "gdn_state_flush_cuda",
    "gdn_corrections_kernel",
    "flush_kernel",
    "mamba2_flush_kernel",
    "gdn_flush_kernel",
    "kernels_supported",
    "anchor_chain",
    "chain_block_v",
    "ChainResult",
    "mamba2_state_step",
    "mamba2_state_verify",
    "mamba2_state_flush",
    "gdn_state_step",
    "gdn_state_verify",
    "gdn_state_flush",
    "DEFAULT_BV",
    "DEFAULT_BV_FLUSH",
    "DEFAULT_WARPS",
    "MIN_LP",
    "CHAIN_TILE_ELEMENTS",
    "CHAIN_WARPS",
    "CHAIN_PREFETCH",
    "CHAIN_EXCHANGE",
]
