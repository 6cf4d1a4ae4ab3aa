"""Stand-in for `sgl_kernel` (SGLang's CUDA kernels) in the SGLang CPU test environment only.

PyPI has only CUDA builds (sgl-kernel, sglang-kernel: hundreds of MB, need libcuda), yet SGLang 0.5.23 imports
it at module level in 62 places even on its CPU path. Every attribute and submodule here is an object that
raises NotImplementedError when called (see _trustbatch_standin.py); `torch.ops.sgl_kernel` stays absent, so
SGLang's CPU-kernel path stays off and its native PyTorch layers run.
"""

import _trustbatch_standin

_trustbatch_standin.install(__import__(__name__))
