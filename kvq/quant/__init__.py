"""Quantized expert weights: GGUF bytes kept as they are, dequantized per call on any device.

`dequantize(raw, qtype, shape, dtype)` turns the encoded bytes of a [rows, cols] matrix (a
uint8 tensor on CPU or CUDA) into a dense tensor. The fast types (F32, F16, BF16, Q8_0, Q4_0,
Q4_K, Q5_K, Q6_K) are decoded with vectorized torch ops on the tensor's own device; every other
type `gguf` can dequantize goes through gguf's numpy reference on the CPU
(`kvq.tools.bench.dequant.measure` times one matrix against that path and a batch-1 matmul).
"""

from kvq.quant.dequant import FAST_TYPES, dequantize, row_bytes

__all__ = ["FAST_TYPES", "dequantize", "row_bytes"]
