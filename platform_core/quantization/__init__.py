"""Weight-only quantization: block formats kept as stored and the reference op (:mod:`.formats`).

Below both the layers and the kernels, as the reference attention is: the model's layers hold
quantized weights in these formats, and backend kernels are checked against its reference.
"""
