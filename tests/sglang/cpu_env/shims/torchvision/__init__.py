"""Stand-in for `torchvision` in the SGLang CPU test environment only.

The torchvision wheels that match torch 2.13 here are CUDA-linked and fail on import ("operator
torchvision::nms does not exist"); SGLang uses torchvision only for multimodal models, which the tests never
load. Every attribute and submodule is an object that raises NotImplementedError when called
(see _trustbatch_standin.py).
"""

import _trustbatch_standin

_trustbatch_standin.install(__import__(__name__))
